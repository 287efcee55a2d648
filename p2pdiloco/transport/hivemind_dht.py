"""What the hivemind transport runs inside hivemind's DHT process.

hivemind keeps its DHT in a child process; four pieces of ours run there, through its
public hooks: the validator that applies a run's record rules to every record stored or
returned (`record_validators`), a ping that reads another peer's DHT clock, the dial
back of `reach.dial_back`, and the storage that shares a key's room among the peers
that sign its records (the last three `DHT.run_coroutine`). Kept apart from the
transport, which runs in the peer's process.
"""

from __future__ import annotations

import asyncio

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.transport.records import RefusalLog, make_room

MAX_DERIVED_KEYS = 4096
"""Shard and epoch keys a validator remembers by DHT id (then it starts over)."""


class RunRecordValidator(RecordValidatorBase):
    """hivemind's record-validator hook around a run's pure record rules.

    hivemind shows a validator the key's DHT id, the msgpack-encoded subkey and value;
    we map the id back to the run's key names and hand the decoded parts to the rules.
    Runs inside the DHT process on every store request and every value a peer returns.
    """

    def __init__(self, rules) -> None:
        self.rules = rules
        self._keys = {DHTID.generate(source=key).to_bytes(): key for key in rules.keys()}
        self._derived: dict[bytes, str] = {}
        """Shard and epoch keys found so far (`RunRecordRules.keys_of`), by their DHT id."""
        self._refused = RefusalLog()

    def key_named(self, key_id: bytes, subkey: object) -> str | None:
        """The run's key whose DHT id is `key_id`: a fixed one, or the shard or epoch key
        its subkey implies (found once, then remembered)."""
        key = self._keys.get(key_id) or self._derived.get(key_id)
        if key is not None:
            return key
        for candidate in self.rules.keys_of(subkey):
            if DHTID.generate(source=candidate).to_bytes() == key_id:
                if len(self._derived) >= MAX_DERIVED_KEYS:
                    self._derived.clear()
                self._derived[key_id] = candidate
                return candidate
        return None

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            key = self.key_named(record.key, subkey)
            if key is None:
                reason = "not a key of this run"
            else:
                value = MSGPackSerializer.loads(record.value)
                reason = self.rules.check(key, subkey, value, record.expiration_time, get_dht_time())
        except Exception as exc:  # noqa: BLE001 - any bytes from the network: a refusal
            reason = f"undecodable record ({type(exc).__name__})"
        if reason is None:
            return True
        self._refused.note(reason)
        return False


class SharedRoomStorage(DHTLocalStorage):
    """hivemind's local storage, with each key's records bounded and shared among the peers
    that sign them as the record table's (`records.make_room`): hivemind keeps any
    number of subkeys under a key, so one signer's flood of valid records (~190 of 64 KiB)
    made every peer read and verify megabytes per look at the round records."""

    def store_subkey(self, key: DHTID, subkey: object, value: bytes, expiration_time: float) -> bool:
        found = self.get(key)
        if found is not None and isinstance(found.value, DictionaryDHTValue) and isinstance(subkey, str):
            entries = found.value
            old = entries.get(subkey)
            if old is not None and old.expiration_time >= expiration_time:
                return False
            held = {s: (len(item.value), item.expiration_time) for s, item in entries.items() if isinstance(s, str)}
            drop = make_room(held, subkey, len(value), expiration_time)
            if drop is None:
                return False
            for gone in drop:
                del entries[gone]
        return super().store_subkey(key, subkey, value, expiration_time)


async def share_room(_dht: DHT, node) -> None:
    """In the DHT process: the node's storage and cache become `SharedRoomStorage` (same
    data, same hivemind behaviour otherwise); run once the node is up."""
    for storage in (node.protocol.storage, node.protocol.cache):
        storage.__class__ = SharedRoomStorage


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


async def dial_from_dht(_dht: DHT, _node, maddrs: list[str], timeout_s: float) -> str | None:
    """In the DHT process: a throwaway p2pd (its own random key, listening nowhere, no
    relay) dials `maddrs` as its bootstrap peers and stops: "" when a connection opened
    (the handshake proved the peer id the addresses end with), "no connection" when p2pd
    gave up on every address, None when it did not get that far in `timeout_s` (a slow
    machine is not the asker's fault: no verdict).

    A new daemon is a new connection: the one the asker opened to us would carry any
    stream from our own daemon and prove nothing. Run here, under the DHT process, so
    its watchdog kills this p2pd too if the peer dies mid-dial."""
    try:
        p2p = await P2P.create(
            initial_peers=maddrs,
            dht_mode="client",
            no_listen=True,
            auto_nat=False,
            nat_port_map=False,
            use_relay=False,
            startup_timeout=timeout_s,
        )
    except P2PDaemonError as exc:
        # p2pd prints this once it tried every address (refused, unreachable, wrong key)
        return "no connection" if "failed to connect to bootstrap peers" in str(exc) else None
    except Exception:  # noqa: BLE001 - our dialer failed, not the asker
        return None
    await p2p.shutdown()
    return ""
