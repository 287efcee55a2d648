"""A run outlives any stop (issue 42, item 5), in process with the real roles.

Three peers train a run with a rotating synchronizer; one saves its checkpoint at round 7
and stops, the others go on to round 10 and stop. The DHT's clock (faked: the memory
network's) then moves two hours on, past every record's lifetime, so the DHT holds
nothing of the run. The peers come back with their checkpoints, one with an empty
directory, in every order. Before, the records a checkpoint stands on went back into the
DHT only while they were younger than an hour: each restored peer followed its own
anchored chain (one at 7, one at 10, the empty one at round 0 for good). Now they go back
in resume envelopes and every peer follows one chain from the newest state any of them
holds, with the screening's history, no round applied twice, no fork.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import OuterConfig
from p2pdiloco.identity import Identity
from p2pdiloco.outer.fragment_state import outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.peer.durable import GlobalCheckpoint
from p2pdiloco.protocol.election import rendezvous_score
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.merge import history_of
from p2pdiloco.protocol.rounds import (
    ROUND_RECORD_TTL_S,
    RoundRecord,
    open_record,
    record_subkey,
    records_of,
    rounds_key,
    seal_resumed,
    signed_record,
)
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.trust.record_rules import RunRecordRules
from p2pdiloco.wire.updates import new_update

RUN = "full-stop"
OUTER = OuterConfig()
LIMITS = wire.WireLimits()
CODEC = compress.make_codec("fp32")
RULES = RunRecordRules(RUN, 1)
HISTORY_ROUNDS = 4
STOP_S = 2 * ROUND_RECORD_TTL_S


def fresh_state() -> GlobalState:
    return GlobalState({"w": torch.zeros(4, 4), "b": torch.zeros(4)}, [["w", "b"]], OUTER)


class Clock:
    """The DHT's clock of the memory network, moved by hand (the machine's is not touched)."""

    def __init__(self) -> None:
        self.now = 1.8e9

    def __call__(self) -> float:
        return self.now


class Peer:
    """One peer's replica (state, ReplicaSync) and its checkpoint folder."""

    def __init__(self, swarm: Swarm, peer_id: str, directory: Path) -> None:
        self.swarm = swarm
        self.transport = MemoryTransport(swarm.network, peer_id=peer_id, record_rules=RULES)
        self.peer_id = peer_id
        self.state = fresh_state()
        self.replicas = ReplicaSync(self.transport, RUN, self.state, swarm.members, LIMITS, swarm.worker, void_after_s=0.0)
        self.checkpoint = GlobalCheckpoint(str(directory), RUN, "cfg", self.replicas, LIMITS, lambda e: None)
        self.round_seen: list[int] = []
        """The replica's round after every sync pass: it never goes down."""

    async def start(self) -> None:
        self.checkpoint.restore()
        await self.transport.start()
        await self.replicas.start()
        await self.checkpoint.resume()

    async def stop(self) -> None:
        await self.transport.shutdown()
        self.replicas.server.encoder.shutdown(wait=False)

    def save(self) -> None:
        assert self.checkpoint.save(asyncio.run_coroutine_threadsafe(self.checkpoint.known(), self.swarm.loop).result()) == [0]

    async def commit(self, scale: float) -> None:
        """Commit the next round as its synchronizer (every live peer named a contributor,
        each with a norm: the history later windows screen against)."""
        snapshot = self.state.export_fragment(0)
        grad = {"w": torch.full((4, 4), scale), "b": torch.full((4,), -scale)}
        encoded = {n: CODEC.encode(t) for n, t in grad.items()}
        decoded = {n: CODEC.decode(e) for n, e in encoded.items()}
        advanced = outer_update(snapshot, decoded, OUTER)
        contributors = [(p, 1.0, 64) for p in sorted(self.swarm.live)]
        update = new_update(RUN, snapshot.round, 0, self.peer_id, snapshot.hash, advanced.hash, contributors, encoded)
        record = signed_record(self.transport.identity, RUN, RoundRecord(
            round=snapshot.round, fragment=0, synchronizer=self.peer_id, hash=advanced.hash, parent=snapshot.hash,
            digest=update.digest, contributors=update.contributors, norms=tuple(0.5 for _ in contributors),
            history_from=-1, closed_at=self.transport.now(),
        ))  # fmt: skip
        assert await self.transport.store(
            rounds_key(RUN, 0), record_subkey(record.round, self.peer_id), record.sealed, self.transport.now() + 3600
        )
        assert await self.replicas.install_own(record, update, advanced, tensor_norm(decoded))


class Swarm:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.network = MemoryNetwork(self.clock)
        self.worker = ThreadPoolExecutor(1)
        self.tmp_path = tmp_path
        self.ids = sorted(self.network.new_peer_id() for _ in range(3))
        self.peers: dict[str, Peer] = {}
        self.live: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def members(self) -> dict[str, Heartbeat]:
        return {
            p: Heartbeat(peer_id=p, status="training", rounds=tuple(self.peers[p].state.rounds)) for p in sorted(self.live)
        }

    async def start(self, peer_id: str, directory: Path | None = None) -> Peer:
        directory = directory or self.tmp_path / peer_id[-8:]
        directory.mkdir(parents=True, exist_ok=True)
        peer = Peer(self, peer_id, directory)
        self.peers[peer_id] = peer
        self.live.add(peer_id)
        await peer.start()
        return peer

    async def stop(self, peer_id: str) -> None:
        self.live.discard(peer_id)
        await self.peers[peer_id].stop()

    async def sync(self, passes: int = 6) -> None:
        """Sync passes of every live peer, each advancing the clock a little (a round's
        time: what the heartbeat loop does, minus the waiting)."""
        for _ in range(passes):
            for peer_id in sorted(self.live):
                peer = self.peers[peer_id]
                await peer.replicas.sync_fragment(0)
                peer.round_seen.append(peer.state.round_of(0))
            self.clock.now += 5.0

    async def rounds(self, count: int, salt: float = 0.0, by: str | None = None) -> None:
        """`count` rounds, the synchronizer rotating over the live peers by round, or `by`
        (`salt` changes the updates: another branch)."""
        for _ in range(count):
            live = sorted(self.live)
            round_id = self.peers[live[0]].state.round_of(0)
            await self.peers[by or live[round_id % len(live)]].commit(0.01 * (round_id + 1) + salt)
            await self.sync(2)


async def _train_then_stop(swarm: Swarm) -> tuple[str, str]:
    """Rounds 0-9 with every peer, B saved at 7 and stopped there; A saved at 10; C's
    folder emptied. Returns (A's hash at 10, the hash at 7)."""
    a, b, c = swarm.ids
    for peer_id in swarm.ids:
        await swarm.start(peer_id)
    await swarm.rounds(7)
    assert {swarm.peers[p].state.round_of(0) for p in swarm.ids} == {7}
    at_seven = swarm.peers[b].state.current_hash(0)
    await asyncio.to_thread(swarm.peers[b].save)
    await swarm.stop(b)
    await swarm.rounds(3)
    assert swarm.peers[a].state.round_of(0) == 10
    await asyncio.to_thread(swarm.peers[a].save)
    newest = swarm.peers[a].state.current_hash(0)
    for peer_id in (a, c):
        await swarm.stop(peer_id)
    return newest, at_seven


@pytest.mark.parametrize("order", list(itertools.permutations("ABC")), ids="".join)
def test_after_a_stop_longer_than_the_record_lifetime_every_peer_follows_one_chain_from_the_newest_state(
    tmp_path, order
) -> None:
    async def main() -> None:
        swarm = Swarm(tmp_path)
        swarm.loop = asyncio.get_running_loop()
        try:
            newest, _ = await _train_then_stop(swarm)
            swarm.clock.now += STOP_S  # every record of the run has expired
            assert swarm.network._get(rounds_key(RUN, 0)) == {}
            by_name = dict(zip("ABC", swarm.ids, strict=True))
            for name in order:
                empty = tmp_path / "empty" if name == "C" else None  # C comes back with nothing
                await swarm.start(by_name[name], empty)
                await swarm.sync(3)
            await swarm.sync(12)
            peers = [swarm.peers[p] for p in swarm.ids]
            assert [p.state.round_of(0) for p in peers] == [10, 10, 10], [p.state.round_of(0) for p in peers]
            assert {p.state.current_hash(0) for p in peers} == {newest}
            # the screening has its history again: the rounds before the next window are on
            # every replica's chain (before: none, the records had expired)
            for peer in peers:
                assert history_of(peer.replicas.chains[0], 10, HISTORY_ROUNDS)[1] == 10 - HISTORY_ROUNDS
            # the run goes on as one chain: two more rounds, applied once each, everywhere
            await swarm.rounds(2)
            assert {p.state.round_of(0) for p in peers} == {12}
            assert len({p.state.current_hash(0) for p in peers}) == 1
            assert len({tuple(sorted((r, rec.hash) for r, rec in p.replicas.chains[0].items())) for p in peers}) == 1
            for peer in peers:  # no replica moved backwards (a restart begins at its checkpoint)
                assert peer.round_seen == sorted(peer.round_seen)
        finally:
            for peer_id in list(swarm.live):
                await swarm.stop(peer_id)
            swarm.worker.shutdown(wait=True, cancel_futures=True)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_resume_envelope_carries_the_synchronizers_record_and_the_rules_check_both() -> None:
    network_clock = Clock()
    synchronizer, resumer, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    record = signed_record(synchronizer, RUN, RoundRecord(
        round=5, fragment=0, synchronizer=synchronizer.peer_id, hash="h" * 32, parent="p" * 32,
        closed_at=network_clock.now - STOP_S,
    ))  # fmt: skip
    now, key, subkey = network_clock.now, rounds_key(RUN, 0), record_subkey(5, synchronizer.peer_id)
    # the plain record closed two hours ago: refused, as ever
    assert RULES.check(key, subkey, record.sealed, now + 60, now) is not None
    resumed = seal_resumed(resumer, RUN, record, now)
    assert RULES.check(key, subkey, resumed, now + ROUND_RECORD_TTL_S, now) is None
    opened = open_record(RUN, resumed)
    assert opened == record and opened.sealed == record.sealed  # the synchronizer's bytes
    assert (opened.resumed_at, opened.resumed_by) == (now, resumer.peer_id)
    # an envelope can vouch for no record its synchronizer did not sign
    forged = signed_record(stranger, RUN, RoundRecord(
        round=5, fragment=0, synchronizer=stranger.peer_id, hash="x" * 32, parent="p" * 32, closed_at=record.closed_at,
    ))  # fmt: skip
    tampered = forged.sealed[:-1] + bytes([forged.sealed[-1] ^ 1])
    bad = seal_resumed(resumer, RUN, RoundRecord(round=5, fragment=0, synchronizer=stranger.peer_id, hash="x",
                                                  sealed=tampered), now)  # fmt: skip
    assert open_record(RUN, bad) is None
    # a resume in the past lives no longer than a record: not a way to keep one forever
    stale = seal_resumed(resumer, RUN, record, now - STOP_S)
    assert RULES.check(key, subkey, stale, now + 60, now) is not None
    # another run's envelope, or one whose signer's bytes were changed, opens to nothing
    assert open_record("another-run", resumed) is None
    assert open_record(RUN, resumed[:-1] + bytes([resumed[-1] ^ 1])) is None
    assert records_of(RUN, {subkey: (resumed, now + 60)}, 0) == {(5, synchronizer.peer_id): record}


def test_a_peer_back_later_with_an_older_branch_of_its_own_follows_the_chain_the_others_went_on_with(tmp_path) -> None:
    """Restarts far apart: B (saved at 7) and C (empty) come back and commit three rounds,
    final for them, before A comes back with its rounds 7-9. A's resumed records are
    rivals of theirs with the same parent: a live chain outranks a restored history
    (`rounds.rivalry_key`), so A leaves its own state for theirs. The keys are drawn so
    that by rank alone A's record wins: A then kept its own chain and the run had two
    final histories."""

    async def main() -> None:
        swarm = Swarm(tmp_path)
        while rendezvous_score(RUN, 7, 0, swarm.ids[2]) < rendezvous_score(RUN, 7, 0, swarm.ids[1]):
            swarm = Swarm(tmp_path)  # keys where A's record of round 7 (C's) out-ranks B's by rank alone
        swarm.loop = asyncio.get_running_loop()
        try:
            await _train_then_stop(swarm)
            swarm.clock.now += STOP_S
            a, b, c = swarm.ids
            await swarm.start(b)
            await swarm.start(c, tmp_path / "empty")
            await swarm.sync(4)
            assert {swarm.peers[p].state.round_of(0) for p in (b, c)} == {7}
            # not A's rounds 7-9 (C synchronized round 7): a branch of their own, rivals of
            # A's records with the same parent and another signer
            await swarm.rounds(3, salt=0.003, by=b)
            went_on = swarm.peers[b].state.current_hash(0)
            await swarm.start(a)
            await swarm.sync(12)
            peers = [swarm.peers[p] for p in swarm.ids]
            assert {p.state.round_of(0) for p in peers} == {10}
            assert {p.state.current_hash(0) for p in peers} == {went_on}
            await swarm.rounds(1)
            assert len({p.state.current_hash(0) for p in peers}) == 1
        finally:
            for peer_id in list(swarm.live):
                await swarm.stop(peer_id)
            swarm.worker.shutdown(wait=True, cancel_futures=True)

    asyncio.run(asyncio.wait_for(main(), 120))
