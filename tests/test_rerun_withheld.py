"""A synchronizer that commits a round, answers "merged" and withholds its update frame
while staying alive must not halt the run (issue 28, items 4 and 10: a low-id holder that
withholds, fake holders).

Peers are wired as in `test_commit` (in-memory transport, real ReplicaSync, Synchronizer
and LearnerLink). The withholder is elected for round 4: it commits, names holders that
never got the frame, answers its learners "merged", and serves neither the frame nor its
state to anyone. A learner books such a delta merged until its replica passes the round;
once the record settles nothing for `void_after_s` (`ReplicaSync.round_unsettled`, the
rule `supersedable` uses) the learner folds it (`Learner._fold_unsettled_merges`) and
resends it past the withholder, and the round's next synchronizer re-runs the round.
`learner_books` below plays that part of the learner's books on the link's outcomes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from test_commit import RUN, Cluster, Node
from test_rerun_held import LIE_ROUND, contribute_all, honest_rounds, scenario, top_of

from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.commit import Held
from p2pdiloco.wire import messages
from p2pdiloco.wire.messages import Outcome

VOID_AFTER_S = 0.5
"""As in `test_rerun_held` (its `scenario` sets it on every replica)."""


def withholding(node: Node, serve_after_s: float | None = None) -> Callable[[], None]:
    """`node` pushes its update to nobody (yet names the holders it "pushed" to) and
    answers every `get_update` and `get_state` with a refusal; with `serve_after_s`, it
    serves again that long after this call (an honest, slow server). Returns what makes
    it serve again."""
    served = dict(node.transport._handlers)
    since = time.monotonic()

    async def fake_push(peer: str, update, timeout_s: float) -> Held | None:
        return Held(peer)  # "acked" without a receipt: a holder that does not hold it

    def refusing(name: str):
        async def refuse(caller: str, request: bytes) -> bytes:
            if serve_after_s is not None and time.monotonic() - since >= serve_after_s:
                return await served[name][0](caller, request)
            return messages.reply(RUN, 0, 0, node.peer_id, messages.Reply.MISSING)

        return refuse

    names = [f"{RUN}.{rpc}" for rpc in (messages.RPC_GET_UPDATE, messages.RPC_GET_STATE)]
    node.sync.committer._push = fake_push
    for name in names:
        node.transport._handlers[name] = (refusing(name), served[name][1])
    return lambda: node.transport._handlers.update({name: served[name] for name in names})


async def learner_books(node: Node, round_id: int, scale: float, patience_s: float) -> list[Outcome]:
    """What a learner does with its delta for `round_id`: send it; booked merged, it waits
    for the replica to pass the round (the take-over decides it), unless the record
    settles nothing here (then folded and resent); late, it is resent after a while."""
    unsettled = getattr(node.replicas, "round_unsettled", lambda fragment, round_id: False)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        outcome = await node.link.contribute(0, round_id, node.frame(scale, round_id=round_id))
        outcomes.append(outcome)
        if outcome.status == messages.Reply.MERGED:
            while node.state.round_of(0) == round_id and not unsettled(0, round_id):
                if time.monotonic() > deadline:
                    return outcomes
                await node.replicas.sync_fragment(0)  # the heartbeat's sync pass
                await asyncio.sleep(VOID_AFTER_S / 10)
            if node.state.round_of(0) > round_id:
                return outcomes  # the take-over decides it by the canonical record
        else:
            if node.state.round_of(0) > round_id:
                return outcomes  # the round closed without it: its work stays local
            await asyncio.sleep(VOID_AFTER_S / 4)  # a learner's retry cadence
    return outcomes


def merged_by(outcomes: list[Outcome]) -> list[str]:
    return [o.synchronizer for o in outcomes if o.status == messages.Reply.MERGED]


def test_a_live_synchronizer_that_withholds_its_update_frame_does_not_halt_the_run() -> None:
    async def body(cluster: Cluster) -> None:
        await honest_rounds(cluster, range(LIE_ROUND))
        withholder = top_of(cluster, LIE_ROUND)
        honest = [n for n in cluster.nodes.values() if n is not withholder]
        serve_again = withholding(withholder)
        before = honest[0].hash()

        started = time.monotonic()
        books = await asyncio.gather(
            *(learner_books(n, LIE_ROUND, 1.0 + i, 20 * VOID_AFTER_S) for i, n in enumerate(honest))
        )
        took = time.monotonic() - started
        withheld = withholder.replicas.committed(0, LIE_ROUND)
        assert withheld is not None and withheld.synchronizer == withholder.peer_id
        # every learner was first told "merged" by the withholder: its record lists them all
        assert all(books[i][0].synchronizer == withholder.peer_id for i in range(len(honest))), books
        for node, outcomes in zip(honest, books, strict=True):
            assert node.state.round_of(0) > LIE_ROUND, (
                f"round {LIE_ROUND} stalled {took:.1f}s: its delta stays booked merged by a record "
                f"nobody serves ({[o.status for o in outcomes]})"
            )
        assert took >= VOID_AFTER_S  # not before void_after_s: an honest slow fetch is not lost

        for node in cluster.nodes.values():
            await node.replicas.sync_fragment(0)
            await node.replicas.sync_fragment(0)
        rerun = honest[0].replicas.committed(0, LIE_ROUND)
        assert isinstance(rerun, RoundRecord)
        assert rerun.supersedes == withheld.digest and rerun.synchronizer != withholder.peer_id
        # merged exactly once: in the re-run, the one record every replica follows
        for node in honest:
            assert node.replicas.committed(0, LIE_ROUND).digest == rerun.digest
        listed = {c[0] for c in rerun.contributors}
        assert len(listed & {n.peer_id for n in honest}) >= 2, rerun.contributors
        for node, outcomes in zip(honest, books, strict=True):
            final = outcomes[-1]
            if final.status == messages.Reply.MERGED and final.synchronizer == withholder.peer_id:
                # the re-run landed while this learner still waited on the withheld record
                # (its own fold not due yet): the take-over finds its delta in no canonical
                # record, so its work stays local, for round 5
                assert node.peer_id not in listed, outcomes
            elif final.status == messages.Reply.MERGED:
                assert final.synchronizer == rerun.synchronizer and node.peer_id in listed, outcomes
            else:
                assert node.peer_id not in listed, outcomes  # its work stays local, for round 5
        hashes = {n.hash() for n in honest}
        assert hashes == {rerun.hash} and rerun.hash != before
        assert withholder.state.applied_hashes[0].get(LIE_ROUND) in (rerun.hash, withheld.hash)

        # the withholder serves again: the run goes on, every replica on one hash
        serve_again()
        await honest_rounds(cluster, range(LIE_ROUND + 1, LIE_ROUND + 2))
        assert len({n.hash() for n in cluster.nodes.values()}) == 1

    scenario(4, body)


def test_an_update_served_after_a_few_seconds_is_merged_once_and_never_re_run() -> None:
    """An honest, slow fetch (the frame arrives before `void_after_s`): the record settles
    the deltas merged, nothing is folded nor re-run."""

    async def body(cluster: Cluster) -> None:
        for node in cluster.nodes.values():
            node.replicas.void_after_s = 10 * VOID_AFTER_S
        await honest_rounds(cluster, range(LIE_ROUND))
        slow = top_of(cluster, LIE_ROUND)
        honest = [n for n in cluster.nodes.values() if n is not slow]
        withholding(slow, serve_after_s=2 * VOID_AFTER_S)

        outcomes = await contribute_all(honest, LIE_ROUND)
        assert {o.status for o in outcomes} <= {messages.Reply.MERGED, messages.Reply.LATE}, outcomes
        record = slow.replicas.committed(0, LIE_ROUND)
        while any(n.state.round_of(0) == LIE_ROUND for n in honest):
            for node in honest:
                assert not node.replicas.round_unsettled(0, LIE_ROUND)
                assert not node.replicas.withheld_by(0, LIE_ROUND)
                await node.replicas.sync_fragment(0)
            await asyncio.sleep(VOID_AFTER_S / 10)
        for node in honest:
            assert node.replicas.committed(0, LIE_ROUND).digest == record.digest
            assert node.hash() == record.hash
        for node, outcome in zip(honest, outcomes, strict=True):
            assert (outcome.status == messages.Reply.MERGED) == (node.peer_id in {c[0] for c in record.contributors})

    scenario(4, body)
