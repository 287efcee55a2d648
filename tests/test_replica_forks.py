"""Fork safety of the replica (issue 28, items 4 and 8), in process on the memory transport.

Every decision that forks (void, chain start, donor choice) is computed the same by every
peer from signed data, never from local timing alone:

- an update whose synchronizer and holders died is fetched from the peers that applied
  it (the fetch rotates through every peer that may hold it), never voided locally;
- a lagging peer whose update was evicted everywhere downloads the state at the head;
- a round nobody can serve is re-run by a record naming the one it supersedes, which
  every peer then follows alike;
- a stale donor cannot roll a joiner back, and a slow donor never holds the install lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import OuterConfig
from p2pdiloco.identity import Identity
from p2pdiloco.outer.fragment_state import outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import (
    FINALITY_DEPTH,
    RoundRecord,
    record_subkey,
    rounds_key,
    signed_record,
)
from p2pdiloco.roles import download
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire.updates import Update, new_update

RUN = "forks"
OUTER = OuterConfig()
LIMITS = wire.WireLimits()
TIMEOUT_S = 30.0
CODEC = compress.make_codec("fp32")


def fresh_state() -> GlobalState:
    return GlobalState({"w": torch.zeros(4, 4), "b": torch.zeros(4)}, [["w", "b"]], OUTER)


class Peer:
    """One replica (state + ReplicaSync) on the memory network."""

    def __init__(self, swarm: Swarm, void_after_s: float) -> None:
        self.swarm = swarm
        self.transport = MemoryTransport(swarm.network)
        self.peer_id = self.transport.peer_id
        self.state = fresh_state()
        self.voided: list[tuple[int, int]] = []
        self.replicas = ReplicaSync(
            self.transport, RUN, self.state, self.members, LIMITS, swarm.worker, void_after_s=void_after_s,
            on_event=lambda e: self.voided.append((e["fragment"], e["round"])) if e["event"] == "voided" else None,
        )

    def members(self) -> dict[str, Heartbeat]:
        """Heartbeats of the live peers, with their current rounds (as they publish them)."""
        return {
            p: Heartbeat(peer_id=p, status="training", rounds=tuple(peer.state.rounds))
            for p, peer in self.swarm.peers.items()
            if p not in self.swarm.dead
        }

    def hash(self) -> str:
        return self.state.current_hash(0)

    def commit(
        self, scale: float, holders: tuple[str, ...] = (), supersedes: str = "", named: tuple[str, ...] = ()
    ) -> tuple[RoundRecord, Update]:
        """Commit the next round as its synchronizer: the update kept here, the signed
        record stored in the DHT (installed by `install_own` by the caller). `named`: other
        contributors the record names (in an open run, each may then synchronize)."""
        snapshot = self.state.export_fragment(0)
        grad = {"w": torch.full((4, 4), scale), "b": torch.full((4,), -scale)}
        encoded = {n: CODEC.encode(t) for n, t in grad.items()}
        decoded = {n: CODEC.decode(e) for n, e in encoded.items()}
        advanced = outer_update(snapshot, decoded, OUTER)
        update = new_update(
            RUN, snapshot.round, 0, self.peer_id, snapshot.hash, advanced.hash,
            [(self.peer_id, 1.0, 64), *((peer, 1.0, 64) for peer in named)], encoded,
        )  # fmt: skip
        record = RoundRecord(
            round=snapshot.round, fragment=0, synchronizer=self.peer_id, hash=advanced.hash, parent=snapshot.hash,
            digest=update.digest, holders=holders, contributors=update.contributors,
            closed_at=self.transport.now(), supersedes=supersedes,
        )
        record = signed_record(self.transport.identity, RUN, record)
        self.swarm.network._store(
            rounds_key(RUN, 0), record_subkey(record.round, self.peer_id), record.sealed, self.transport.now() + 3600
        )
        self._advanced = (advanced, tensor_norm(decoded))
        return record, update

    async def install(self, record: RoundRecord, update: Update) -> None:
        advanced, norm = self._advanced
        assert await self.replicas.install_own(record, update, advanced, norm)


class Swarm:
    def __init__(self, count: int, void_after_s: float = 0.0) -> None:
        self.network = MemoryNetwork()
        self.worker = ThreadPoolExecutor(1)
        self.dead: set[str] = set()
        peers = [Peer(self, void_after_s) for _ in range(count)]
        self.peers = {p.peer_id: p for p in peers}
        self.by_id = sorted(peers, key=lambda p: p.peer_id)
        """Peers in peer-id order: the order a fetch asks live peers in."""

    async def start(self) -> None:
        for peer in self.peers.values():
            await peer.transport.start()
            await peer.replicas.start()

    def kill(self, *peers: Peer) -> None:
        for peer in peers:
            self.dead.add(peer.peer_id)
            self.network.kill(peer.peer_id)

    def live(self) -> list[Peer]:
        return [p for p in self.by_id if p.peer_id not in self.dead]


def scenario(count: int, body: Callable[[Swarm], Awaitable[None]], void_after_s: float = 0.0) -> None:
    async def main() -> None:
        swarm = Swarm(count, void_after_s)
        try:
            await swarm.start()
            await asyncio.wait_for(body(swarm), TIMEOUT_S)
        finally:
            swarm.worker.shutdown(wait=True, cancel_futures=True)

    asyncio.run(main())


async def sync_all(peers: list[Peer], passes: int = 4) -> None:
    """A few sync passes of every peer (what the heartbeat loop does, minus the waiting)."""
    for _ in range(passes):
        for peer in peers:
            await peer.replicas.sync_fragment(0)


# --- item 4: no local, permanent void ---------------------------------------------------


def test_peers_fetch_from_those_that_applied_when_synchronizer_and_holder_die() -> None:
    """Synchronizer and its only holder die after 2 of 8 peers fetched: the other six get
    the update from those two (fetch rotation), nobody voids it: one branch."""

    async def body(swarm: Swarm) -> None:
        peers = swarm.by_id
        # the two that fetched sort last: a fetch that asks the same first six never finds them
        synchronizer, holder, fetchers = peers[0], peers[1], peers[-2:]
        record, update = synchronizer.commit(1.0, holders=(holder.peer_id,))
        await synchronizer.install(record, update)
        holder.replicas.keep(update)
        for peer in fetchers:
            assert await peer.replicas.sync_fragment(0)
        swarm.kill(synchronizer, holder)
        await sync_all(swarm.live())
        hashes = {p.hash() for p in swarm.live()}
        assert hashes == {record.hash}, "the swarm split into branches"
        assert all(not p.replicas.void for p in swarm.live())

    scenario(12, body)


def test_a_lagging_peer_whose_update_was_evicted_everywhere_downloads_the_state() -> None:
    """Its update is no longer held by anyone, but peers are past the round: it catches up
    by a verified state download, and never voids a good record."""

    async def body(swarm: Swarm) -> None:
        synchronizer, *others = swarm.by_id
        lagging = others[-1]
        for scale in (1.0, 2.0, 3.0):
            # the others are the learners the rounds merged: donors independent of round 3
            record, update = synchronizer.commit(scale, named=tuple(p.peer_id for p in others))
            await synchronizer.install(record, update)
            await sync_all(others, passes=1)
        # one more round the lagging peer misses, then every update frame is evicted
        record, update = synchronizer.commit(4.0)
        await synchronizer.install(record, update)
        await sync_all(others[:-1], passes=1)
        for peer in swarm.peers.values():
            peer.replicas.server.store.__init__()  # evicted (stores are bounded by bytes)
        assert lagging.state.round_of(0) == 3
        await sync_all([lagging], passes=2)
        assert lagging.state.round_of(0) == 4 and lagging.hash() == record.hash
        assert not lagging.replicas.void

    scenario(4, body)


def test_a_round_nobody_can_serve_is_re_run_by_a_superseding_record_every_peer_follows() -> None:
    """The synchronizer and its holder die before anyone fetched: after `void_after_s` the
    next synchronizer re-runs the round with a record naming the lost one; every peer
    follows it (signed data), including the replicas that had applied the lost update."""

    async def body(swarm: Swarm) -> None:
        synchronizer, holder, rerunner, *rest = swarm.by_id
        # it merged the others' deltas: those it can later take the re-run's state from
        lost, update = synchronizer.commit(1.0, holders=(holder.peer_id,), named=tuple(p.peer_id for p in rest))
        await synchronizer.install(lost, update)
        holder.replicas.keep(update)
        swarm.kill(synchronizer, holder)
        await sync_all(swarm.live(), passes=1)
        assert {p.state.round_of(0) for p in swarm.live()} == {0}  # nobody could get it
        assert all(not p.replicas.void for p in swarm.live())  # and nobody voided it
        assert rerunner.replicas.supersedable(0, 0) == lost.digest
        rerun, again = rerunner.commit(2.0, supersedes=lost.digest)
        await rerunner.install(rerun, again)
        await sync_all(swarm.live())
        assert {p.hash() for p in swarm.live()} == {rerun.hash}
        for peer in swarm.live():
            assert (await peer.replicas.read_chain(0))[0].digest == rerun.digest
            assert peer.voided == [(0, 0)]  # the re-run is counted once (the metric)
        # the synchronizer had applied the lost update: back on the network, it repairs to
        # the re-run (a state download), so there is one branch, not two
        assert synchronizer.hash() == lost.hash
        swarm.dead.discard(synchronizer.peer_id)
        swarm.network._attach(synchronizer.transport)
        assert await synchronizer.replicas.sync_fragment(0)
        assert synchronizer.hash() == rerun.hash

    scenario(5, body, void_after_s=0.0)


def test_no_re_run_while_the_lost_record_is_younger_than_void_after_s_by_signed_time() -> None:
    async def body(swarm: Swarm) -> None:
        synchronizer, other = swarm.by_id
        lost, update = synchronizer.commit(1.0)
        await synchronizer.install(lost, update)
        swarm.kill(synchronizer)
        await sync_all([other], passes=1)
        assert other.replicas.supersedable(0, 0) == ""  # an hour to wait, by signed times

    scenario(2, body, void_after_s=3600.0)


# --- item 8: donors ---------------------------------------------------------------------


def test_a_stale_donor_serving_a_valid_old_state_is_not_accepted_when_a_newer_head_exists() -> None:
    async def body(swarm: Swarm) -> None:
        synchronizer, stale, joiner = swarm.by_id
        for scale in (1.0, 2.0):
            record, update = synchronizer.commit(scale)
            await synchronizer.install(record, update)
            await sync_all([stale], passes=1)
        for scale in (3.0, 4.0, 5.0):
            record, update = synchronizer.commit(scale)
            await synchronizer.install(record, update)
        head = record
        swarm.kill(synchronizer)  # only the stale donor is left, and it lies about its round
        real_members = joiner.members

        def lying_members() -> dict[str, Heartbeat]:
            beats = real_members()
            beats[stale.peer_id] = Heartbeat(peer_id=stale.peer_id, status="training", rounds=(5,))
            return beats

        joiner.replicas.downloads.members = lying_members
        chain = await joiner.replicas.read_chain(0)
        assert max(chain) == head.round and stale.state.round_of(0) == 2
        assert await joiner.replicas.downloads.fetch_verified(0, chain) is None
        assert not await joiner.replicas._download(0, chain)
        assert joiner.state.round_of(0) == 0  # not rolled back to round 2's state

    scenario(3, body)


def test_a_slow_donor_does_not_hold_the_install_lock() -> None:
    async def body(swarm: Swarm) -> None:
        synchronizer, donor, joiner = swarm.by_id
        for scale in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0):
            record, update = synchronizer.commit(scale)
            await synchronizer.install(record, update)
        await sync_all([donor], passes=1)
        swarm.kill(synchronizer)
        swarm.network.suspend(donor.peer_id)  # answers nothing until the caller's deadline
        downloading = asyncio.ensure_future(joiner.replicas.sync_fragment(0))
        for _ in range(200):
            await asyncio.sleep(0)  # let the pass read the chain and reach its download
        assert not downloading.done() and joiner.state.round_of(0) == 0
        # the local install path (a synchronizer's own commit) does not wait for the donor
        await asyncio.wait_for(joiner.replicas._locks[0].acquire(), 1.0)
        joiner.replicas._locks[0].release()
        downloading.cancel()

    scenario(3, body)


def test_a_round_is_served_by_the_peers_that_hold_it_not_by_its_synchronizer_alone() -> None:
    """Issue 29, item 3: 16 peers fetch a round held by its synchronizer and two holders.
    Each fetcher starts at a peer of its own among those that have the frame, so the
    synchronizer serves none of them (it pushed to its holders already) and no holder
    serves every fetcher; every peer applies the one update."""

    async def body(swarm: Swarm) -> None:
        peers = swarm.by_id
        synchronizer, holders, fetchers = peers[0], peers[1:3], peers[3:]
        record, update = synchronizer.commit(1.0, holders=tuple(h.peer_id for h in holders))
        await synchronizer.install(record, update)
        for holder in holders:
            holder.replicas.keep(update)
        for peer in [*fetchers, *holders]:
            assert await peer.replicas.sync_fragment(0)
        assert {p.hash() for p in peers} == {record.hash}

        def frames_served(peer: Peer) -> int:
            return peer.transport.traffic.bytes[("updates", "up")] // len(update.frame)

        assert frames_served(synchronizer) == 0, "the synchronizer served the swarm alone"
        served = [frames_served(p) for p in peers[1:]]
        assert sum(served) == len(fetchers)
        assert max(served) < len(fetchers) // 2, f"one peer served most fetchers: {served}"

    scenario(19, body)


# --- finality (issue 42, item 1) ----------------------------------------------------------


def test_a_late_rival_that_outranks_a_final_round_rewinds_no_replica() -> None:
    """An attacker the chain named once (a merged contribution in round 1) signs, after 8
    rounds, a record for round 2 with the right parent, a current close time and a key
    ground to out-rank its synchronizer. By rank alone every replica would drop rounds 3-7
    and go after a state that record names; a replica holds round 2 final (it applied
    `FINALITY_DEPTH` rounds on it), so nothing changes for any of them."""

    async def body(swarm: Swarm) -> None:
        synchronizer, *others = swarm.by_id
        attacker = Identity.generate()
        while synchronizer_order(RUN, 2, 0, [attacker.peer_id, synchronizer.peer_id])[0] != attacker.peer_id:
            attacker = Identity.generate()
        parents = {}
        for round_id in range(8):
            parents[round_id] = synchronizer.hash()
            record, update = synchronizer.commit(1.0 + round_id, named=(attacker.peer_id,) if round_id == 1 else ())
            await synchronizer.install(record, update)
            await sync_all(others, passes=1)
        head = synchronizer.hash()
        assert {p.hash() for p in swarm.live()} == {head} and {p.state.round_of(0) for p in swarm.live()} == {8}
        assert 8 - 1 - FINALITY_DEPTH >= 2  # round 2 is final on every replica
        rival = signed_record(
            attacker, RUN,
            RoundRecord(
                round=2, fragment=0, synchronizer=attacker.peer_id, hash="f" * 64, parent=parents[2],
                digest="d" * 64, contributors=((attacker.peer_id, 1.0, 64),), closed_at=synchronizer.transport.now(),
            ),
        )  # fmt: skip
        swarm.network._store(
            rounds_key(RUN, 0), record_subkey(2, attacker.peer_id), rival.sealed, synchronizer.transport.now() + 3600
        )
        for peer in swarm.live():
            # the rule by rank alone (what a replica did before finality) follows the rival
            peer.replicas.final = lambda fragment: None
            rewound = await peer.replicas.read_chain(0)
            assert rewound[2].synchronizer == attacker.peer_id and max(rewound) == 2
            del peer.replicas.final  # the method again
            assert (await peer.replicas.read_chain(0))[2].digest != rival.digest
        await sync_all(swarm.live())
        for peer in swarm.live():
            chain = await peer.replicas.read_chain(0)
            assert max(chain) == 7 and chain[2].synchronizer == synchronizer.peer_id
            assert peer.state.round_of(0) == 8 and peer.hash() == head

    scenario(3, body)


def test_records_the_dht_forgot_of_rounds_a_replica_applied_do_not_break_its_chain() -> None:
    """A key the chain named floods the round key with a chain of rounds far ahead; at
    every DHT node its own share then keeps those and drops its older records, the honest
    rounds it synchronized among them. A replica still has the records it applied: before,
    the hole after its final round sent it to the usual rules over everything past it, and
    it followed the flood's long chain (a bench swarm committed 6 rounds a minute, not 136)."""

    async def body(swarm: Swarm) -> None:
        synchronizer, *others = swarm.by_id
        for round_id in range(8):
            record, update = synchronizer.commit(1.0 + round_id)
            await synchronizer.install(record, update)
            await sync_all(others, passes=1)
        head = synchronizer.hash()
        key = rounds_key(RUN, 0)
        records = swarm.network._dht._records[key]
        for round_id in (5, 6):  # evicted at the DHT nodes
            del records[record_subkey(round_id, synchronizer.peer_id)]
        parent = "a" * 64
        for round_id in range(20, 60):  # the flood's own chain, from nowhere
            flood = signed_record(synchronizer.transport.identity, RUN, RoundRecord(
                round=round_id, fragment=0, synchronizer=synchronizer.peer_id, hash=f"{round_id:064x}",
                parent=parent, digest="d" * 64, closed_at=synchronizer.transport.now(),
            ))  # fmt: skip
            swarm.network._store(key, record_subkey(round_id, synchronizer.peer_id), flood.sealed,
                                 synchronizer.transport.now() + 3600)  # fmt: skip
            parent = flood.hash
        for peer in swarm.live():
            chain = await peer.replicas.read_chain(0)
            assert max(chain) == 7 and chain[7].hash == head, sorted(chain)
        await sync_all(swarm.live())
        assert {p.state.round_of(0) for p in swarm.live()} == {8} and {p.hash() for p in swarm.live()} == {head}

    scenario(3, body)


@pytest.mark.parametrize(
    ("vouching", "restarted"), [(True, False), (False, False), (True, True)],
    ids=["vouched", "by-hash-alone", "after-a-restart"],
)  # fmt: skip
def test_a_signer_whose_updates_exist_nowhere_cannot_hand_replicas_its_own_state(
    vouching: bool, restarted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer the chain named once signs records for the next 10 rounds whose updates
    exist nowhere (every other one with a free key it names), the last naming the hash of
    a state it made, and serves that state.
    The honest replicas are then more than `MAX_CATCH_UP_ROUNDS` behind and cannot fetch
    the updates. By hash alone (what a download checked before; `by-hash-alone` turns the
    rule off) every one of them, the honest synchronizer included, installs the
    attacker's state. A state is taken only from a donor that vouches for the records it
    skips (`download.unvouched`): nobody installs it, and the round's synchronizer re-runs
    the round, which every replica follows. `after-a-restart`: the learner kept only its
    checkpoint's round, and still knows who that round named."""
    if not vouching:
        monkeypatch.setattr(download, "unvouched", lambda span, donor, known: "")

    async def body(swarm: Swarm) -> None:
        synchronizer, learner, attacker = swarm.by_id
        for round_id in range(4):
            named = (learner.peer_id, attacker.peer_id) if round_id == 1 else (learner.peer_id,)
            record, update = synchronizer.commit(1.0 + round_id, named=named)
            await synchronizer.install(record, update)
            await sync_all([learner, attacker], passes=1)
        honest = synchronizer.hash()
        if restarted:  # what a replica holds after a restart from its checkpoint at round 4
            learner.replicas._named_applied[0].clear()
            learner.state.applied_hashes[0] = {3: honest}
        # the attacker's branch: real states (so the last hash is one it can serve), update
        # digests of nothing, records signed by its own key and, every other round, by a
        # free key its records name as a contributor (a second signer costs it nothing)
        sybil = Identity.generate()
        state, first = attacker.state.export_fragment(0), None
        for round_id in range(4, 14):
            grad = {"w": torch.full((4, 4), 50.0), "b": torch.full((4,), 50.0)}
            parent, state = state.hash, outer_update(state, grad, OUTER)
            signer = sybil if round_id % 2 else attacker.transport.identity
            forged = signed_record(
                signer, RUN,
                RoundRecord(
                    round=round_id, fragment=0, synchronizer=signer.peer_id, hash=state.hash, parent=parent,
                    digest=f"{round_id:064x}", contributors=((signer.peer_id, 1.0, 64), (sybil.peer_id, 1.0, 64)),
                    closed_at=attacker.transport.now(),
                ),
            )  # fmt: skip
            first = first or forged
            swarm.network._store(
                rounds_key(RUN, 0), record_subkey(round_id, signer.peer_id), forged.sealed,
                attacker.transport.now() + 3600,
            )  # fmt: skip
        attacker.state.install_download(state)  # served at round 14, as its heartbeat says
        honest_peers = [synchronizer, learner]
        await sync_all(honest_peers)
        for peer in honest_peers:
            assert (await peer.replicas.read_chain(0))[13].synchronizer in (attacker.peer_id, sybil.peer_id)
        if not vouching:
            assert {p.hash() for p in honest_peers} == {state.hash}  # the attacker's model
            return
        assert {(p.state.round_of(0), p.hash()) for p in honest_peers} == {(4, honest)}
        # the round's synchronizer re-runs round 4 (nobody could get its update): one chain
        assert synchronizer.replicas.supersedable(0, 4) == first.digest
        rerun, again = synchronizer.commit(9.0, supersedes=first.digest, named=(learner.peer_id,))
        await synchronizer.install(rerun, again)
        await sync_all(honest_peers)
        for peer in honest_peers:
            assert max(await peer.replicas.read_chain(0)) == 4 and peer.hash() == rerun.hash

    scenario(3, body)
