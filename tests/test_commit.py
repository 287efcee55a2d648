"""Committing a round: crash points, failover, rival records, holding and serving updates.

Peers are wired as `peer.Peer._build` wires them (GlobalState, ReplicaSync, Synchronizer,
LearnerLink, one worker thread each) on the in-memory transport. A crash is a SIGKILL as
the swarm sees it: the peer leaves the network, calls in flight to it fail at once, it
can no longer call or store, and its commit stops at the phase where its hook is
(the hook never returns). Every wait is on an event or a poll with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from checked_events import CheckedEvents

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig, replace
from p2pdiloco.peer.faults import hook_steps
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord, canonical_chain, records_of, rounds_key
from p2pdiloco.roles.commit import MORE_PUSHES
from p2pdiloco.roles.learner_link import LearnerLink, Outcome
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.synchronizer import Synchronizer
from p2pdiloco.transport.base import PeerUnreachable, RemoteError, TransportClosed
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import seal_contribution
from p2pdiloco.wire.updates import new_update, update_digest

RUN = "commit"
CONFIG = replace(
    RunConfig(),
    sync={"min_quorum": 2, "max_grace_s": 0.2, "round_deadline_s": 5.0, "commit_holders": 1},
    compress={"codec": "fp32", "outer_codec": "fp32"},
)
LIMITS = wire.WireLimits()
SCENARIO_TIMEOUT_S = 9.0
PHASES = ("after_quorum", "during_merge", "after_hold", "after_record", "after_first_reply")
NOT_MERGED = (messages.Reply.LATE, messages.Reply.NO_QUORUM, "unreachable")
"""Outcomes that tell a learner its delta is in no committed record of the round."""


# --- a network where a killed peer is gone at once --------------------------------------


class CrashNetwork(MemoryNetwork):
    """`kill` also drops every call in flight to the peer (its streams die with it) and
    stops the peer from calling or storing; `refuse_records` makes the DHT refuse round
    records (as a real DHT may, on a network fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.killed: set[str] = set()
        self.in_flight: dict[str, dict[asyncio.Task, str]] = {}
        self.refuse_records = False
        self.misreport_records = False
        """Keep round records but answer "not stored" (hivemind's last-replica answer)."""
        self.peak_calls: dict[str, int] = {}
        """Most calls of each RPC name in flight at once, over all peers."""

    def kill(self, peer_id: str) -> None:
        super().kill(peer_id)
        self.killed.add(peer_id)
        for task in list(self.in_flight.get(peer_id, {})):
            task.cancel()

    def calls_to(self, peer_id: str, name: str) -> int:
        return sum(1 for n in self.in_flight.get(peer_id, {}).values() if n == name)

    def _store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        if self.refuse_records and "/rounds/" in key:
            return False
        kept = super()._store(key, subkey, value, expiration_time)
        return kept and not (self.misreport_records and "/rounds/" in key)


class CrashTransport(MemoryTransport):
    network: CrashNetwork

    def __init__(self, network: CrashNetwork, peer_id: str) -> None:
        super().__init__(network, peer_id)
        self.before_rounds_read: Callable[[], Awaitable[None]] | None = None
        """Awaited once, after the next read of round records and before it returns."""

    def _check_open(self) -> None:
        if self.peer_id in self.network.killed:
            raise TransportClosed(f"{self.peer_id} was killed")
        super()._check_open()

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        inner = asyncio.ensure_future(super()._call(peer_id, name, request, max_response))
        calls = self.network.in_flight.setdefault(peer_id, {})
        calls[inner] = name
        now = sum(n == name for flight in self.network.in_flight.values() for n in flight.values())
        self.network.peak_calls[name] = max(self.network.peak_calls.get(name, 0), now)
        try:
            await asyncio.wait({inner})
        except asyncio.CancelledError:  # our own deadline
            inner.cancel()
            raise
        finally:
            calls.pop(inner, None)
        if inner.cancelled():
            raise PeerUnreachable(f"peer {peer_id} died during the call")
        return inner.result()

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        records = await super().get(key, latest)
        gate, self.before_rounds_read = self.before_rounds_read, None
        if gate is not None and key == rounds_key(RUN, 0):
            await gate()
        return records


# --- peers ------------------------------------------------------------------------------


def fresh_state() -> GlobalState:
    params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    return GlobalState(params, [["w", "b"]], CONFIG.outer)


class Node:
    """One peer: replica, replica sync, synchronizer and learner link on one transport."""

    def __init__(self, cluster: Cluster, peer_id: str) -> None:
        self.cluster = cluster
        self.peer_id = peer_id
        self.transport = CrashTransport(cluster.network, peer_id)
        self.view: set[str] = set()
        self.state = fresh_state()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"worker-{peer_id}")
        self.events: list[dict] = CheckedEvents()
        self.phases: list[tuple[str, int]] = []
        self.on_phase: dict[str, Callable[[], Awaitable[None]]] = {}
        self.notified: list[tuple[int, int, RoundRecord]] = []
        self.replicas = ReplicaSync(
            self.transport, RUN, self.state, self.members, LIMITS, self.worker,
            void_after_s=CONFIG.sync.round_deadline_s, on_event=self.events.append,
        )
        self.replicas.on_settled.append(lambda f, r, record: self.notified.append((f, r, record)))
        self.sync = Synchronizer(
            self.transport, RUN, CONFIG, self.state, self.members, LIMITS, self.replicas,
            self.worker, on_event=self.events.append,
        )
        hook_steps(self.sync.committer, self.hook)
        self.link = LearnerLink(self.transport, RUN, CONFIG.sync, self.replicas, self.members, LIMITS)

    def members(self) -> dict[str, Heartbeat]:
        """Heartbeats of the peers this one sees, with their current rounds."""
        return {
            p: Heartbeat(
                peer_id=p, status="training", rounds=tuple(self.cluster.nodes[p].state.rounds)
            )
            for p in sorted(self.view)
        }

    async def hook(self, phase: str, round_id: int, fragment: int) -> None:
        self.phases.append((phase, round_id))
        action = self.on_phase.get(phase)
        if action is not None:
            await action()

    async def die(self) -> None:
        """SIGKILL: off the network at once; this commit never goes on."""
        self.cluster.network.kill(self.peer_id)
        await asyncio.Event().wait()

    def frame(self, scale: float, round_id: int = 0) -> bytes:
        delta = {"w": torch.full((4, 4), scale), "b": torch.full((4,), -scale)}
        message = wire.Message(
            kind=wire.CONTRIBUTION,
            run=RUN,
            round=round_id,
            fragment=0,
            meta={"peer": self.peer_id, "base_round": round_id, "tokens": 64, "steps": 2},
            tensors=compress.encode_tensors(compress.make_codec("fp32"), delta),
        )
        return wire.encode_message(message)

    def contribute(self, scale: float) -> Awaitable[Outcome]:
        return self.link.contribute(0, 0, self.frame(scale))

    def hash(self) -> str:
        return self.state.fragment_hash(0)


class Cluster:
    def __init__(self, count: int) -> None:
        self.network = CrashNetwork()
        ids = [self.network.new_peer_id() for _ in range(count)]
        self.order = synchronizer_order(RUN, 0, 0, ids)
        """Peer ids best-placed first for (round 0, fragment 0)."""
        self.nodes = {p: Node(self, p) for p in self.order}

    def __getitem__(self, index: int) -> Node:
        return self.nodes[self.order[index]]

    async def start(self) -> None:
        for node in self.nodes.values():
            await node.transport.start()
            await node.replicas.start()
            await node.sync.start()
            node.view = set(self.nodes)

    def dht_records(self) -> dict[tuple[int, str], RoundRecord]:
        """The well-formed round records of fragment 0 in the shared DHT."""
        return records_of(RUN, self.network._get(rounds_key(RUN, 0)), 0)

    def close(self) -> None:
        for node in self.nodes.values():
            node.worker.shutdown(wait=True, cancel_futures=True)


def scenario(count: int, body: Callable[[Cluster], Awaitable[None]]) -> None:
    """Run `body` on a started cluster of `count` peers, bounded in time."""

    async def main() -> None:
        cluster = Cluster(count)
        try:
            await cluster.start()
            await asyncio.wait_for(body(cluster), SCENARIO_TIMEOUT_S)
        finally:
            for node in cluster.nodes.values():
                for task in list(node.sync._tasks) + list(node.sync.committer.tasks):
                    task.cancel()
            await asyncio.sleep(0)
            cluster.close()

    asyncio.run(main())


async def poll(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `condition()` holds, yielding to the loop; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.001)


# --- a synchronizer dies at each phase of its commit ------------------------------------


@pytest.mark.parametrize("heartbeat", ["still_seen", "expired"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_synchronizer_killed_at_any_commit_phase_leaves_one_round_and_loses_no_delta(
    phase: str, heartbeat: str
) -> None:
    async def body(cluster: Cluster) -> None:
        doomed, second, third = cluster[0], cluster[1], cluster[2]

        async def crash() -> None:
            if phase == "after_first_reply":
                # the transport delivers the first answer before the process dies
                await poll(lambda: cluster.network.calls_to(doomed.peer_id, f"{RUN}.contribute") < 2)
            if heartbeat == "expired":
                for node in (second, third):
                    node.view.discard(doomed.peer_id)
            await doomed.die()

        doomed.on_phase[phase] = crash
        outcomes = dict(
            zip(
                (second.peer_id, third.peer_id),
                await asyncio.gather(second.contribute(1.0), third.contribute(3.0)),
                strict=True,
            )
        )
        assert (phase, 0) in doomed.phases
        assert doomed.peer_id in cluster.network.killed

        # exactly one record of round 0 in the DHT, and it is the canonical one
        records = [r for (round_id, _), r in cluster.dht_records().items() if round_id == 0]
        assert len(records) == 1, records
        (committed,) = records
        genesis = second.replicas.genesis[0]
        assert canonical_chain(RUN, records, genesis) == {0: committed}
        committed_before_crash = phase in ("after_record", "after_first_reply")
        assert committed.synchronizer == (doomed if committed_before_crash else second).peer_id
        assert committed.parent == genesis

        # every survivor holds that round's result, bit for bit
        for node in (second, third):
            assert node.state.round_of(0) == 1
            assert node.hash() == committed.hash
            assert node.replicas.committed(0, 0) == committed

        # each learner's delta is merged in the committed round, or it was told otherwise
        for peer, outcome in outcomes.items():
            assert outcome.round == 0
            if committed.weight_of(peer) is not None:
                assert outcome.status == messages.Reply.MERGED, outcome
                assert outcome.weight == committed.weight_of(peer)
            else:
                assert outcome.status in NOT_MERGED, outcome
        # with the same two learners alive on both sides of the failover, nothing is lost
        assert {c[0] for c in committed.contributors} == set(outcomes)
        assert all(o.status == messages.Reply.MERGED for o in outcomes.values())
        # after the next heartbeat's sync, each survivor's learner was told that record
        for node in (second, third):
            assert await node.replicas.sync_fragment(0)
            assert node.hash() == committed.hash
            assert [rec for _, r, rec in node.notified if r == 0] == [committed]

        # the survivors go on: round 1 is built on that record, no round is skipped
        next_outcomes = await asyncio.gather(
            second.link.contribute(0, 1, second.frame(0.5, round_id=1)),
            third.link.contribute(0, 1, third.frame(0.25, round_id=1)),
        )
        assert [o.status for o in next_outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
        chain = canonical_chain(RUN, cluster.dht_records().values(), genesis)
        assert sorted(chain) == [0, 1]
        assert chain[0] == committed and chain[1].parent == committed.hash
        assert second.hash() == third.hash() == chain[1].hash

    scenario(3, body)


@pytest.mark.parametrize("phase", ["after_quorum", "during_merge", "after_hold", "after_record"])
def test_a_synchronizer_that_leaves_while_closing_a_round_finishes_it_first(phase: str) -> None:
    """Ctrl-C (or its own learner reaching `--max-rounds`) at any phase of a commit: the
    round it already closed is merged, committed and answered before it goes; nothing is
    left for the next synchronizer to redo."""

    async def body(cluster: Cluster) -> None:
        leaving, a, b = cluster[0], cluster[1], cluster[2]
        shutdowns: list[asyncio.Task] = []

        async def leave() -> None:
            shutdowns.append(asyncio.ensure_future(leaving.sync.shutdown(finish_s=5.0)))
            await asyncio.sleep(0)  # the shutdown starts while the commit is at this phase

        leaving.on_phase[phase] = leave
        outcomes = await asyncio.gather(a.contribute(1.0), b.contribute(3.0))
        await asyncio.wait_for(shutdowns[0], 5.0)
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED], outcomes
        (committed,) = [r for (round_id, _), r in cluster.dht_records().items() if round_id == 0]
        assert committed.synchronizer == leaving.peer_id
        assert [e["round"] for e in leaving.events if e["event"] == "round_closed"] == [0]
        assert not leaving.sync.windows and not leaving.sync._tasks

    scenario(3, body)


def test_a_synchronizer_that_leaves_while_collecting_tells_its_learners_at_once() -> None:
    async def body(cluster: Cluster) -> None:
        leaving, a = cluster[0], cluster[1]
        sealed = seal_contribution(a.transport.identity, RUN, a.frame(1.0))
        waiting = asyncio.ensure_future(leaving.sync.rpc_contribute(a.peer_id, sealed))
        await poll(lambda: (0, 0) in leaving.sync.windows)
        await asyncio.wait_for(leaving.sync.shutdown(finish_s=5.0), 1.0)
        reply = wire.decode_message(await asyncio.wait_for(waiting, 1.0), LIMITS)
        assert reply.meta["status"] == messages.Reply.NO_QUORUM, reply.meta
        assert "leaving" in reply.meta["reason"]
        assert not cluster.dht_records()

    scenario(3, body)


def test_the_update_goes_to_one_holder_at_a_time_and_a_failed_push_is_replaced() -> None:
    """On a slow uplink concurrent pushes share it: with R = 1 only one push runs before the
    commit, and a holder that fails (here: both contributors die) is replaced by the next."""

    async def body(cluster: Cluster) -> None:
        synchronizer, first, second, bystander = cluster[0], cluster[1], cluster[2], cluster[3]

        async def contributors_die() -> None:
            for node in (first, second):
                cluster.network.kill(node.peer_id)

        synchronizer.on_phase["during_merge"] = contributors_die
        for node in (first, second):  # their calls die with them: nothing to await
            task = asyncio.ensure_future(node.contribute(1.0))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await poll(lambda: ("after_record", 0) in synchronizer.phases, timeout_s=20)
        (committed,) = [r for (round_id, _), r in cluster.dht_records().items() if round_id == 0]
        assert committed.holders == (bystander.peer_id,)
        assert cluster.network.peak_calls[f"{RUN}.{messages.RPC_HOLD_UPDATE}"] == 1
        assert bystander.replicas.store.get(0, committed.digest) is not None

    scenario(4, body)


def test_the_synchronizer_pushes_a_committed_update_to_a_bounded_number_of_peers() -> None:
    """Issue 29, item 3: after its holders, the synchronizer pushes the update to at most
    `MORE_PUSHES` more learners, not to the whole swarm; the rest fetch it from those."""
    count = 2 + CONFIG.sync.commit_holders + MORE_PUSHES + 3

    async def body(cluster: Cluster) -> None:
        synchronizer, a, b = cluster[0], cluster[1], cluster[2]
        outcomes = await asyncio.gather(a.contribute(1.0), b.contribute(3.0))
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED], outcomes
        await poll(lambda: not synchronizer.sync.committer.tasks, timeout_s=20)
        (committed,) = [r for (round_id, _), r in cluster.dht_records().items() if round_id == 0]
        others = [n for n in cluster.nodes.values() if n is not synchronizer]
        pushed = [n for n in others if n.replicas.store.get(0, committed.digest) is not None]
        assert len(pushed) == CONFIG.sync.commit_holders + MORE_PUSHES, len(pushed)
        for node in others:  # the rest fetch it from the peers that hold it
            await node.replicas.sync_fragment(0)
        assert {n.hash() for n in cluster.nodes.values()} == {committed.hash}

    scenario(count, body)


def test_a_delta_arriving_during_the_merge_is_told_it_is_late() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, a, b = cluster[0], cluster[1], cluster[2]
        merging, release = asyncio.Event(), asyncio.Event()

        async def hold_the_merge() -> None:
            merging.set()
            await release.wait()

        synchronizer.on_phase["during_merge"] = hold_the_merge
        contributions = asyncio.gather(a.contribute(1.0), b.contribute(3.0))
        await merging.wait()
        window, refused = synchronizer.sync.windows[(0, 0)], asyncio.Event()
        accept = window.machine.accept

        def noted_accept(*args):
            refusal = accept(*args)
            if refusal == "window is closing":
                refused.set()
            return refusal

        window.machine.accept = noted_accept
        late = asyncio.ensure_future(
            synchronizer.transport.call(
                synchronizer.peer_id,
                f"{RUN}.{messages.RPC_CONTRIBUTE}",
                seal_contribution(synchronizer.transport.identity, RUN, synchronizer.frame(2.0)),
                5.0,
            )
        )
        await refused.wait()  # it is answered once the commit is over, with the record
        release.set()
        reply = wire.decode_message(await late, LIMITS)
        assert reply.meta["status"] == messages.Reply.LATE
        assert reply.meta["reason"] == "window is closing"
        outcomes = await contributions
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
        (record,) = cluster.dht_records().values()
        assert reply.meta["record"] == record.sealed
        assert record.weight_of(synchronizer.peer_id) is None
        assert {c[0] for c in record.contributors} == {a.peer_id, b.peer_id}

    scenario(3, body)


def test_a_contribution_naming_another_peer_is_rejected() -> None:
    """Auditors check a contribution's signature against the peer it names: a learner that
    names someone else would make the synchronizer's honest merge look forged."""

    async def body(cluster: Cluster) -> None:
        synchronizer, honest, liar = cluster[0], cluster[1], cluster[2]
        forged = liar.frame(1.0).replace(liar.peer_id.encode(), honest.peer_id.encode())
        assert forged != liar.frame(1.0)
        raw = await liar.transport.call(
            synchronizer.peer_id,
            f"{RUN}.{messages.RPC_CONTRIBUTE}",
            seal_contribution(liar.transport.identity, RUN, forged),
            5.0,
        )
        reply = wire.decode_message(raw, LIMITS)
        assert reply.meta["status"] == messages.Reply.REJECTED
        assert reply.meta["reason"] == "contribution names another peer"

    scenario(3, body)


# --- split views: two records for one round ---------------------------------------------


async def split_round(cluster: Cluster) -> tuple[RoundRecord, RoundRecord, dict[str, Outcome]]:
    """Two synchronizers, each seeing only itself and its learner, both commit round 0.

    Both check for a rival record before either stores its own (the DHT has not shown
    the other's yet), so two records of round 0 exist. Returns (winner, loser, outcomes).
    """
    x, y, lx, ly = cluster[0], cluster[1], cluster[2], cluster[3]
    for node, view in ((x, {x, lx}), (lx, {x, lx}), (y, {y, ly}), (ly, {y, ly})):
        node.view = {n.peer_id for n in view}
    both_checked = asyncio.Event()
    checked: set[str] = set()

    def rival_check_meets_the_other(node: Node) -> Callable[[], Awaitable[None]]:
        async def gate() -> None:
            checked.add(node.peer_id)
            if len(checked) == 2:
                both_checked.set()
            await both_checked.wait()

        async def arm() -> None:
            node.transport.before_rounds_read = gate

        return arm

    for node in (x, y):
        node.on_phase["after_hold"] = rival_check_meets_the_other(node)
    results = await asyncio.gather(
        x.contribute(1.0), lx.contribute(2.0), y.contribute(-1.0), ly.contribute(5.0)
    )
    outcomes = dict(zip((x.peer_id, lx.peer_id, y.peer_id, ly.peer_id), results, strict=True))
    records = cluster.dht_records()
    assert set(records) == {(0, x.peer_id), (0, y.peer_id)}
    return records[(0, x.peer_id)], records[(0, y.peer_id)], outcomes


def test_split_views_two_records_every_peer_ends_on_the_canonical_winner() -> None:
    async def body(cluster: Cluster) -> None:
        x, y, lx, ly = cluster[0], cluster[1], cluster[2], cluster[3]
        winner, loser, outcomes = await split_round(cluster)
        genesis = x.replicas.genesis[0]
        assert winner.parent == loser.parent == genesis
        assert winner.hash != loser.hash
        assert canonical_chain(RUN, [loser, winner], genesis) == {0: winner}
        # each side applied its own synchronizer's update
        assert x.hash() == lx.hash() == winner.hash
        assert y.hash() == ly.hash() == loser.hash
        assert outcomes[lx.peer_id].status == messages.Reply.MERGED
        # the views heal; the next heartbeat syncs every fragment
        for node in cluster.nodes.values():
            node.view = set(cluster.nodes)
        for node in cluster.nodes.values():
            assert await node.replicas.sync_fragment(0)
        for node in cluster.nodes.values():
            assert node.state.round_of(0) == 1
            assert node.hash() == winner.hash
            assert node.replicas.committed(0, 0) == winner
        repaired = [e for e in y.events + ly.events if e["event"] == "repair"]
        assert len(repaired) == 2
        # the loser's contributors find their deltas missing from the winning record
        for peer in (y.peer_id, ly.peer_id):
            assert winner.weight_of(peer) is None
            assert loser.weight_of(peer) is not None
        for node in (y, ly):  # their learners are told the winner, which lacks them
            last = [rec for _, r, rec in node.notified if r == 0][-1]
            assert last == winner and last.weight_of(node.peer_id) is None
        for node in (x, lx):
            assert winner.weight_of(node.peer_id) == outcomes[node.peer_id].weight

    scenario(4, body)


def test_after_split_views_heal_every_learner_is_told_only_the_winning_record() -> None:
    async def body(cluster: Cluster) -> None:
        winner, _, _ = await split_round(cluster)
        for node in cluster.nodes.values():
            node.view = set(cluster.nodes)
        for node in cluster.nodes.values():
            assert await node.replicas.sync_fragment(0)
        # both records were in the DHT before any learner was answered: nobody's learner
        # may be told that round 0 committed the loser's update
        for node in cluster.nodes.values():
            assert [rec for _, r, rec in node.notified if r == 0] == [winner], node.peer_id

    scenario(4, body)


# --- the commit point is the stored record ----------------------------------------------


def test_a_delta_is_reported_merged_only_when_its_record_is_in_the_dht() -> None:
    async def body(cluster: Cluster) -> None:
        cluster.network.refuse_records = True
        outcomes = await asyncio.gather(cluster[1].contribute(1.0), cluster[2].contribute(3.0))
        assert not cluster.dht_records()
        assert all(o.status != messages.Reply.MERGED for o in outcomes), outcomes

    scenario(3, body)


def test_a_record_the_dht_kept_but_reported_not_stored_is_a_commit() -> None:
    """A DHT whose nodes disagree answers "not stored" although one of them kept the
    record: the round is committed all the same, so its learners are told merged (not
    "no quorum", which would have them resend a delta the chain already holds)."""

    async def body(cluster: Cluster) -> None:
        cluster.network.misreport_records = True
        outcomes = await asyncio.gather(cluster[1].contribute(1.0), cluster[2].contribute(3.0))
        (committed,) = cluster.dht_records().values()
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED], outcomes
        assert committed.synchronizer == cluster[0].peer_id
        assert [e["round"] for e in cluster[0].events if e["event"] == "round_closed"] == [0]

    scenario(3, body)


# --- holding and serving update frames --------------------------------------------------


def update_frame(synchronizer: str, parent: str) -> bytes:
    tensors = compress.encode_tensors(
        compress.make_codec("fp32"), {"w": torch.ones(4, 4), "b": torch.ones(4)}
    )
    return new_update(RUN, 0, 0, synchronizer, parent, "new-hash", [("a", 1.0, 64)], tensors).frame


async def hold(caller: Node, holder: Node, frame: bytes) -> wire.Message:
    raw = await caller.transport.call(
        holder.peer_id, f"{RUN}.{messages.RPC_HOLD_UPDATE}", frame, 5.0
    )
    reply = wire.decode_message(raw, LIMITS)
    assert not isinstance(reply, wire.Rejected)
    return reply


async def get_update(caller: Node, server: Node, digest: str | None) -> bytes:
    meta = {"peer": caller.peer_id} | ({"digest": digest} if digest is not None else {})
    request = wire.encode_message(
        wire.Message(kind=messages.UPDATE_REQUEST, run=RUN, round=0, fragment=0, meta=meta)
    )
    return await caller.transport.call(server.peer_id, f"{RUN}.{messages.RPC_GET_UPDATE}", request, 5.0)


def test_hold_update_refuses_a_frame_that_names_another_synchronizer_than_the_caller() -> None:
    async def body(cluster: Cluster) -> None:
        caller, holder, other = cluster[0], cluster[1], cluster[2]
        frame = update_frame(other.peer_id, holder.replicas.genesis[0])
        reply = await hold(caller, holder, frame)
        assert reply.meta["status"] == messages.Reply.REJECTED
        assert reply.meta["reason"] == "update names another synchronizer"
        assert holder.replicas.store.get(0, update_digest(frame)) is None
        missing = wire.decode_message(await get_update(caller, holder, update_digest(frame)), LIMITS)
        assert missing.meta["status"] == messages.Reply.MISSING

    scenario(3, body)


def not_an_update(caller: Node) -> list[bytes]:
    """Frames a holder must refuse: junk, a contribution, an update of another layout."""
    wrong_shape = new_update(
        RUN, 0, 0, caller.peer_id, "p", "h", [],
        compress.encode_tensors(compress.make_codec("fp32"), {"w": torch.ones(2), "b": torch.ones(4)}),
    ).frame
    return [b"", b"junk", caller.frame(1.0), wrong_shape]


def test_hold_update_never_keeps_a_frame_that_is_not_an_update_of_this_fragment() -> None:
    async def body(cluster: Cluster) -> None:
        caller, holder = cluster[0], cluster[1]
        for frame in not_an_update(caller):
            try:
                reply = await hold(caller, holder, frame)
            except RemoteError:
                continue  # refused: see the junk-request tests below
            assert reply.meta["status"] == messages.Reply.REJECTED
        assert holder.replicas.store.of_round(0, 0) == []

    scenario(2, body)


REPLY_ROUND_MINUS_ONE = (
    "replies to undecodable requests are built with messages.reply(run, -1, ...), which "
    "wire.encode_message refuses (round must be >= 0): the handler raises ValueError and "
    "the caller gets RemoteError instead of a REJECTED reply"
)


def test_hold_update_answers_a_frame_that_is_not_an_update_with_a_rejection() -> None:
    async def body(cluster: Cluster) -> None:
        caller, holder = cluster[0], cluster[1]
        for frame in not_an_update(caller):
            assert (await hold(caller, holder, frame)).meta["status"] == messages.Reply.REJECTED

    scenario(2, body)


@pytest.mark.parametrize("rpc", [messages.RPC_GET_UPDATE, messages.RPC_GET_STATE, messages.RPC_CONTRIBUTE])
def test_a_junk_request_is_answered_with_a_rejection_not_a_handler_failure(rpc: str) -> None:
    async def body(cluster: Cluster) -> None:
        caller, server = cluster[0], cluster[1]
        raw = await caller.transport.call(server.peer_id, f"{RUN}.{rpc}", b"junk", 5.0)
        reply = wire.decode_message(raw, LIMITS)
        assert reply.meta["status"] == messages.Reply.REJECTED

    scenario(2, body)


def test_a_learner_whose_frame_is_garbage_is_told_rejected_by_the_first_synchronizer() -> None:
    async def body(cluster: Cluster) -> None:
        garbage = b"P2PD" + bytes(20)
        outcome = await cluster[1].link.contribute(0, 0, garbage)
        # today: every synchronizer's handler fails, the learner fails over through all of
        # them and reports "unreachable" while each counted a rejection
        assert outcome.status == messages.Reply.REJECTED, outcome
        assert sum(node.sync.num_rejected for node in cluster.nodes.values()) == 1

    scenario(3, body)


def test_a_held_frame_is_served_byte_for_byte_by_its_digest_and_is_not_applied() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, holder, reader = cluster[0], cluster[1], cluster[2]
        frame = update_frame(synchronizer.peer_id, holder.replicas.genesis[0])
        digest = update_digest(frame)
        reply = await hold(synchronizer, holder, frame)
        assert reply.meta["status"] == messages.Reply.HELD
        assert reply.meta["digest"] == digest
        assert holder.state.round_of(0) == 0  # held, not applied: only a record commits it
        assert await get_update(reader, holder, digest) == frame
        assert await get_update(reader, holder, None) == frame  # by round, without a digest
        missing = wire.decode_message(await get_update(reader, holder, "0" * 32), LIMITS)
        assert missing.meta["status"] == messages.Reply.MISSING

    scenario(3, body)


def test_hold_update_refuses_a_caller_this_replica_could_not_elect_whatever_its_key_ranks() -> None:
    """The audit: a hold ranked its caller among this replica's candidates without asking
    whether it may synchronize at all, so a stranger with a free key (no heartbeat, never
    named by the chain) was held whenever its key ranked among the first few."""

    async def body(cluster: Cluster) -> None:
        holder = cluster[1]
        stranger = MemoryTransport(cluster.network)
        await stranger.start()
        frame = update_frame(stranger.peer_id, holder.replicas.genesis[0])
        raw = await stranger.call(holder.peer_id, f"{RUN}.{messages.RPC_HOLD_UPDATE}", frame, 5.0)
        reply = wire.decode_message(raw, LIMITS)
        assert reply.meta["status"] == messages.Reply.REJECTED
        assert reply.meta["reason"] == "caller may not synchronize"
        assert holder.replicas.store.get(0, update_digest(frame)) is None
        # a peer it could elect is still held (the first of the round's order)
        first = cluster[0]
        reply = await hold(first, holder, update_frame(first.peer_id, holder.replicas.genesis[0]))
        assert reply.meta["status"] == messages.Reply.HELD

    scenario(3, body)
