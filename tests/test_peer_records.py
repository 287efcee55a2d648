"""Round records read from a reachable peer instead of the DHT key (`roles.peer_records`).

At N = 1,000 every replica read its records epoch's key each pass and the five peers that
store it could not keep up: a round reached 90 % of the swarm 30-60 s after its commit.
Three passes in four now ask one peer; what it answers is checked as a DHT read would be,
and bounded, so a peer can withhold records but neither forge nor flood them.
"""

from __future__ import annotations

import asyncio

import torch

from p2pdiloco import wire
from p2pdiloco.config import OuterConfig
from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import (
    ROUND_RECORD_TTL_S,
    RoundRecord,
    record_subkey,
    rounds_key,
    seal_record,
)
from p2pdiloco.roles import peer_records
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport

RUN = "peer-records"
NOW = 1_800_000_000.0
EPOCH = 4


def sealed_record(
    identity: Identity, round_id: int, fragment: int = 0, closed_at: float = NOW, parent: str = ""
) -> bytes:
    record = RoundRecord(
        round=round_id, fragment=fragment, synchronizer=identity.peer_id, hash=f"h{round_id}",
        parent=parent or f"h{round_id - 1}", closed_at=closed_at,
    )  # fmt: skip
    return seal_record(identity, RUN, record)


def test_a_reply_adds_only_signed_records_of_the_rounds_asked_and_a_few_per_round() -> None:
    signer = Identity.generate()
    kept: dict[str, tuple[bytes, float]] = {}
    rivals = [sealed_record(Identity.generate(), 5) for _ in range(peer_records.MAX_RECORDS_PER_ROUND + 3)]
    forged = bytearray(sealed_record(signer, 6))
    forged[-1] ^= 1
    offered = [
        sealed_record(signer, 4),
        sealed_record(signer, 4),  # the same one twice: one entry
        sealed_record(signer, 9),  # a round not asked for
        sealed_record(signer, 6, fragment=1),  # another fragment
        sealed_record(signer, 7, closed_at=NOW + 10 * ROUND_RECORD_TTL_S),  # a close in the future
        bytes(forged),
        b"\x00junk",
        *rivals,
    ]
    added = peer_records.admit(kept, offered, RUN, 0, range(4, 8), ROUND_RECORD_TTL_S, NOW)
    assert added == len(kept) == 2 + peer_records.MAX_RECORDS_PER_ROUND
    assert record_subkey(4, signer.peer_id) in kept and record_subkey(7, signer.peer_id) in kept
    assert sum(s.startswith("5/") for s in kept) == peer_records.MAX_RECORDS_PER_ROUND
    assert max(expiration for _, expiration in kept.values()) <= NOW + ROUND_RECORD_TTL_S


def test_a_peer_serves_what_it_holds_from_the_round_asked_lowest_first_and_bounded() -> None:
    signer = Identity.generate()
    raw = {record_subkey(r, signer.peer_id): (sealed_record(signer, r), NOW + 60) for r in range(100)}
    raw["3/expired"] = (sealed_record(signer, 3), NOW - 1)
    served = peer_records.served(raw, 40, NOW)
    assert served == [sealed_record(signer, r) for r in range(40, 40 + peer_records.MAX_SERVED_RECORDS)]
    # with epochs: only the rounds the asker keeps (its epoch and the next)
    assert peer_records.served(raw, 40, NOW, epoch_rounds=8) == [sealed_record(signer, r) for r in range(40, 56)]
    assert peer_records.served(raw, 41, NOW, epoch_rounds=1) == [sealed_record(signer, r) for r in (41, 42)]
    reply = peer_records.records_reply(RUN, 0, signer.peer_id, served)
    assert peer_records.parse_records_reply(reply, wire.WireLimits(), RUN) == served
    assert isinstance(peer_records.parse_records_reply(b"garbage", wire.WireLimits(), RUN), str)
    assert isinstance(peer_records.parse_records_reply(reply, wire.WireLimits(), "another-run"), str)


class Replica:
    """A replica with record epochs on the in-memory network, its view set by the test."""

    def __init__(self, network: MemoryNetwork) -> None:
        self.transport = MemoryTransport(network)
        self.view: dict[str, Heartbeat] = {}
        state = GlobalState({"w": torch.zeros(4)}, [["w"]], OuterConfig())
        self.replicas = ReplicaSync(
            self.transport, RUN, state, lambda: self.view, wire.WireLimits(), None,  # type: ignore[arg-type]
            void_after_s=60.0, epoch_rounds=EPOCH,
        )  # fmt: skip

    async def start(self) -> None:
        await self.transport.start()
        await self.replicas.start()

    def rounds_keys_read(self) -> int:
        return sum(1 for key in self.transport.traffic.by_key if "/rounds/" in key)


def test_a_replica_learns_a_record_from_a_peer_and_reads_the_dht_one_pass_in_four() -> None:
    """B's view shows A (reachable): B's first pass asks A for the record A read from the
    DHT, and B reads no records key; its fourth pass reads the DHT. A peer that answers
    garbage costs the pass nothing: the pass reads the DHT instead."""

    async def main() -> None:
        network = MemoryNetwork(clock=lambda: NOW)
        a, b, liar = Replica(network), Replica(network), Replica(network)
        for replica in (a, b):
            await replica.start()
        await liar.transport.start()  # serves its own get_records (below)
        synchronizer = Identity.generate()
        record = sealed_record(synchronizer, 0, parent=a.replicas.genesis[0])
        await a.transport.store(
            rounds_key(RUN, 0, 0, EPOCH), record_subkey(0, synchronizer.peer_id), record, NOW + 600
        )
        assert 0 in await a.replicas.read_chain(0)  # nobody to ask: A read the DHT
        b.view = {a.transport.peer_id: Heartbeat(peer_id=a.transport.peer_id, status="training")}
        assert 0 in await b.replicas.read_chain(0)
        assert b.rounds_keys_read() == 0
        for _ in range(peer_records.DHT_READ_EVERY - 1):
            await b.replicas.read_chain(0)
        assert b.rounds_keys_read() > 0

        async def garbage(caller: str, request: bytes) -> bytes:
            return b"not records"

        await liar.transport.register_handler(f"{RUN}.{peer_records.RPC_GET_RECORDS}", garbage, 1 << 12)
        c = Replica(network)
        await c.start()
        c.view = {liar.transport.peer_id: Heartbeat(peer_id=liar.transport.peer_id, status="training")}
        assert 0 in await c.replicas.read_chain(0)  # refused reply: the DHT in the same pass
        assert c.rounds_keys_read() > 0

    asyncio.run(main())
