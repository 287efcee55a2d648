"""A synchronizer that commits an outsized update and refuses audits while staying alive
must not halt the run (issue 28, item 7, liveness).

Peers are wired as in `test_commit` (in-memory transport, real ReplicaSync, Synchronizer
and LearnerLink). The liar is elected for round 4, commits its merge scaled x10 and
answers every `get_contributions` with a refusal. It stays alive and, being past round 4
on its own branch, answers round-4 deltas "late". The honest replicas hold the update
(they cannot verify it); once they held it `void_after_s` they send their round-4 deltas
past the liar, the next synchronizer re-runs the round with a record that supersedes the
liar's, and every peer follows it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from test_audit import auditing, lying
from test_commit import Cluster, Node

from p2pdiloco.wire import messages

VOID_AFTER_S = 0.5
"""How long a replica holds a round before it may be re-run (test scale)."""
TIMEOUT_S = 60.0
LIE_ROUND = 4


def scenario(count: int, body: Callable[[Cluster], Awaitable[None]]) -> None:
    async def main() -> None:
        cluster = Cluster(count)
        try:
            await cluster.start()
            for node in cluster.nodes.values():
                node.replicas.void_after_s = VOID_AFTER_S
                auditing(node, 0.0)  # no sampled audits: only out-of-line updates are audited
            await asyncio.wait_for(body(cluster), TIMEOUT_S)
        finally:
            for node in cluster.nodes.values():
                for task in list(node.sync._tasks) + list(node.sync.committer.tasks):
                    task.cancel()
            await asyncio.sleep(0)
            cluster.close()

    asyncio.run(main())


def top_of(cluster: Cluster, round_id: int) -> Node:
    """The peer elected for (round, fragment 0), as every peer sees it (an open run elects
    among the peers its chain shows reachable)."""
    (top,) = {node.link.candidates(round_id, 0)[0] for node in cluster.nodes.values()}
    return cluster.nodes[top]


async def contribute_all(nodes: list[Node], round_id: int) -> list[messages.Outcome]:
    return await asyncio.gather(
        *(
            n.link.contribute(0, round_id, n.frame(1.0 + i, round_id=round_id))
            for i, n in enumerate(nodes)
        )
    )


async def honest_rounds(cluster: Cluster, rounds: range) -> None:
    for round_id in rounds:
        top = top_of(cluster, round_id)
        others = [n for n in cluster.nodes.values() if n is not top]
        outcomes = await contribute_all(others, round_id)
        assert messages.Reply.MERGED in {o.status for o in outcomes}, outcomes  # a third may be late
        for node in cluster.nodes.values():
            assert await node.replicas.sync_fragment(0)
            assert node.state.round_of(0) == round_id + 1


def refusing_audits_counted(node: Node) -> list[int]:
    """`node` refuses every `get_contributions`; the list counts the calls it got."""
    calls = [0]

    def refuse(*args):
        calls[0] += 1
        return None

    node.sync.committer.kept.get = refuse
    return calls


def test_a_live_synchronizer_refusing_audits_of_its_outsized_update_does_not_halt_the_run() -> None:
    async def body(cluster: Cluster) -> None:
        await honest_rounds(cluster, range(LIE_ROUND))
        liar = top_of(cluster, LIE_ROUND)
        honest = [n for n in cluster.nodes.values() if n is not liar]
        lying(liar, factor=10.0)
        calls = refusing_audits_counted(liar)
        before = honest[0].hash()

        # the lie: every honest replica holds it (never applies it), the liar is past it
        first = await contribute_all(honest, LIE_ROUND)
        lie = liar.replicas.committed(0, LIE_ROUND)
        assert (
            lie is not None
            and lie.synchronizer == liar.peer_id
            and liar.state.round_of(0) == LIE_ROUND + 1
        )
        for node in honest:
            await node.replicas.sync_fragment(0)
            assert node.state.round_of(0) == LIE_ROUND and node.hash() == before
            assert lie.digest in node.replicas.audits.unverified_since
        # a held record settles nothing: the delta is not booked merged in the lie
        assert messages.Reply.MERGED not in {o.status for o in first}, first

        # the held round is retried with a back-off, not on every pass
        asked = calls[0]
        for _ in range(20):
            for node in honest:
                await node.replicas.sync_fragment(0)
        assert calls[0] - asked <= len(honest), (asked, calls[0])

        # the liar is not elected by the peers that hold its update, for any round
        for node in honest:
            for round_id in range(LIE_ROUND, LIE_ROUND + 20):
                assert liar.peer_id not in node.link.candidates(round_id, 0)

        # the learners retry (as a learner does after "late"); past void_after_s the round
        # is re-run by another synchronizer, within bounded time
        started = time.monotonic()
        while True:
            outcomes = await contribute_all(honest, LIE_ROUND)
            if messages.Reply.MERGED in {o.status for o in outcomes}:
                break
            # bounded, with room for a loaded machine: a re-run synchronizer may wait out its
            # quorum deadline (5 s) once when the learners go past the liar a pass apart
            assert time.monotonic() - started < 40 * VOID_AFTER_S, outcomes
            await asyncio.sleep(VOID_AFTER_S / 4)  # a learner's retry cadence, not a sync
        assert liar.peer_id not in {o.synchronizer for o in outcomes if o.status == messages.Reply.MERGED}
        for node in cluster.nodes.values():
            await node.replicas.sync_fragment(0)
            await node.replicas.sync_fragment(0)
        rerun = honest[0].replicas.committed(0, LIE_ROUND)
        assert rerun.supersedes == lie.digest and rerun.synchronizer != liar.peer_id
        hashes = {n.hash() for n in cluster.nodes.values()}
        assert hashes == {rerun.hash}, [
            (n.peer_id[-6:], n.state.round_of(0)) for n in cluster.nodes.values()
        ]

        # and the run goes on
        outcomes = await contribute_all(honest, LIE_ROUND + 1)
        assert messages.Reply.MERGED in {o.status for o in outcomes}, outcomes
        for node in honest:
            assert await node.replicas.sync_fragment(0)
        assert len({n.hash() for n in honest}) == 1

    scenario(4, body)


def test_a_held_update_that_verifies_later_is_applied_and_its_synchronizer_trusted_again() -> None:
    """A refusal that passes (the synchronizer serves its contributions on a later try):
    the update is applied, and the synchronizer may be elected again."""

    async def body(cluster: Cluster) -> None:
        await honest_rounds(cluster, range(LIE_ROUND))
        big = top_of(cluster, LIE_ROUND)
        honest = [n for n in cluster.nodes.values() if n is not big]
        kept_get = big.sync.committer.kept.get
        big.sync.committer.kept.get = lambda *args: None  # a transient refusal
        for node in honest:  # after a stretch of tiny updates, an honest one is out of line
            node.replicas.audits.recent_norms[0].extend([1e-3] * 8)
        outcomes = await contribute_all(honest, LIE_ROUND)
        assert messages.Reply.MERGED not in {o.status for o in outcomes}, outcomes
        for node in honest:
            assert node.state.round_of(0) == LIE_ROUND
        for node in honest:
            assert big.peer_id not in node.link.candidates(LIE_ROUND + 1, 0)
            node.replicas.audits.clock = lambda: time.monotonic() + 3600.0  # the back-off passed
        big.sync.committer.kept.get = kept_get
        for node in honest:
            assert await node.replicas.sync_fragment(0)
            assert node.state.round_of(0) == LIE_ROUND + 1
            assert big.peer_id in node.link.candidates(LIE_ROUND + 1, 0)
        assert len({n.hash() for n in cluster.nodes.values()}) == 1

    scenario(4, body)


def test_a_round_applied_meanwhile_is_not_held_nor_its_synchronizer_distrusted() -> None:
    """Two paths apply a round at once (a learner's call and the sync pass): the one that
    audits after the other installed has the next round's state at hand. That is a local
    race: the update must not be held, nor its synchronizer distrusted (it was, in the
    networked test: an honest re-run's synchronizer was flagged by this race)."""

    async def body(cluster: Cluster) -> None:
        await honest_rounds(cluster, range(LIE_ROUND))
        synchronizer = top_of(cluster, LIE_ROUND)
        honest = [n for n in cluster.nodes.values() if n is not synchronizer]
        auditor = honest[0]
        auditor.replicas.audits.recent_norms[0].extend([1e-3] * 8)  # the round is out of line
        outcomes = await contribute_all(honest[1:], LIE_ROUND)
        assert messages.Reply.MERGED in {o.status for o in outcomes}, outcomes
        assert await auditor.replicas.sync_fragment(0)  # audited (OK) and applied
        record = auditor.replicas.committed(0, LIE_ROUND)
        # the slower path, whose audit starts once the replica is past the round
        assert await auditor.replicas._apply_record(record)
        assert not [e for e in auditor.events if e["event"] == "unverified"]
        assert not auditor.replicas.entitlement.is_distrusted(synchronizer.peer_id)

    scenario(4, body)
