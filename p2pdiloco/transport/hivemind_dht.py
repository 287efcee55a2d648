"""What the hivemind transport runs inside hivemind's DHT process.

hivemind keeps its DHT in a child process; two pieces of ours run there, through its
public hooks: the validator that applies a run's record rules to every record stored or
returned (`record_validators`), and a ping that reads another peer's DHT clock
(`DHT.run_coroutine`). Kept apart from the transport, which runs in the peer's process.
"""

from __future__ import annotations

import asyncio

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.transport.records import RefusalLog


class RunRecordValidator(RecordValidatorBase):
    """hivemind's record-validator hook around a run's pure record rules.

    hivemind shows a validator the key's DHT id, the msgpack-encoded subkey and value;
    we map the id back to the run's key names and hand the decoded parts to the rules.
    Runs inside the DHT process on every store request and every value a peer returns.
    """

    def __init__(self, rules) -> None:
        self.rules = rules
        self._keys = {DHTID.generate(source=key).to_bytes(): key for key in rules.keys()}
        self._refused = RefusalLog()

    def validate(self, record: DHTRecord) -> bool:
        try:
            key = self._keys.get(record.key)
            if key is None:
                reason = "not a key of this run"
            else:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
                reason = self.rules.check(key, subkey, value, record.expiration_time, get_dht_time())
        except Exception as exc:  # noqa: BLE001 - any bytes from the network: a refusal
            reason = f"undecodable record ({type(exc).__name__})"
        if reason is None:
            return True
        self._refused.note(reason)
        return False


async def ping_for_time(_dht: DHT, node, peer_id: str, timeout_s: float) -> tuple[float, float, float] | None:
    """In the DHT process: hivemind's own ping to `peer_id`, whose answer carries the
    peer's DHT time; (sent, their time, received), or None if it did not answer."""
    try:
        stub = node.protocol.get_stub(PeerID.from_base58(peer_id))
        request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
        sent = get_dht_time()
        response = await asyncio.wait_for(stub.rpc_ping(request, timeout=timeout_s), timeout_s)
        received = get_dht_time()
    except Exception:  # noqa: BLE001 - any failure means no reading
        return None
    if not response.dht_time:
        return None
    return sent, float(response.dht_time), received
