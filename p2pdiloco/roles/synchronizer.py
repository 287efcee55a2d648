"""The synchronizer role: collect deltas for a (round, fragment), then commit the window.

Any peer that accepts connections can be elected for a (round, fragment). A window's
life is the pure `windows.WindowMachine` (wait for quorum, grace, close, move, expire);
what enters it is decided by the pure `intake.check_contribution`; closing it is a commit
in four steps (`commit.Committer`). This module owns the clock and the network between
them. Every fault of a contribution becomes a logged rejection; nothing is raised to the
peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.config import RunConfig
from p2pdiloco.outer.screening import Candidate, ScreeningRules
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.intake import Accepted, Refused, check_contribution
from p2pdiloco.protocol.membership import Heartbeat, learners
from p2pdiloco.protocol.window_rules import (
    Close,
    Expire,
    Move,
    RunningMean,
    Wait,
    WindowMachine,
    clamp_tokens,
    overlap_steps_of,
)
from p2pdiloco.roles.commit import COMMITTED_ELSEWHERE, NOT_PROVEN, Committer
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.window import Window
from p2pdiloco.transport.base import Transport
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import (
    open_contribution,
)

log = logging.getLogger(__name__)

CATCH_UP_S = 15.0
"""Longest a contribution from a learner a round ahead waits for this synchronizer's sync
pass (`Synchronizer._caught_up`); past it, the learner is answered "behind"."""


class Synchronizer:
    """Serves `contribute` for one run on one peer and commits the windows it closes."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        config: RunConfig,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        replicas: ReplicaSync,
        worker: ThreadPoolExecutor,
        on_event: Callable[[dict], None] = lambda event: None,
        rivals_visible: Callable[[int], bool] = lambda round_id: True,
        certificates: tuple[bytes, ...] = (),
        screening_rules: ScreeningRules | None = None,
    ) -> None:
        self.transport = transport
        self.run = run
        self.config = config
        self.state = state
        self.members = members
        self.limits = limits
        self.replicas = replicas
        self.worker = worker
        self.on_event = on_event
        self.committer = Committer(
            transport, run, config, state, members, replicas, worker, limits, on_event,
            rivals_visible, certificates, screening_rules or ScreeningRules(),
        )
        self.windows: dict[tuple[int, int], Window] = {}
        self.step_time = RunningMean()
        self.num_rejected = 0
        self._tasks: set[asyncio.Task] = set()
        self._catching_up: dict[int, asyncio.Future] = {}
        """Fragment -> the sync pass learners ahead of us wait on (`_caught_up`)."""

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def kept(self):
        """Signed contributions of the rounds this peer committed (`Committer.kept`)."""
        return self.committer.kept

    def holding(self) -> list[int]:
        """Fragments with a window open here."""
        return sorted({f for (_, f) in self.windows})

    async def start(self) -> None:
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_CONTRIBUTE}", self.rpc_contribute, self.limits.max_frame_bytes + 256
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_CONTRIBUTIONS}", self.committer.rpc_get_contributions, 256
        )

    async def shutdown(self, finish_s: float = 20.0) -> None:
        """Leave. A window still collecting is answered "leaving" (its learners resend to the
        next synchronizer); one already closed gets `finish_s` to merge and commit, so a
        peer that leaves does not throw away a merge the swarm would have to redo, nor stop
        between storing a round's record and answering its learners."""

        def answer_leaving(windows: list[Window]) -> None:
            for window in windows:
                self._finish(window, self._reply(window, messages.Reply.NO_QUORUM, reason="synchronizer is leaving"))

        answer_leaving([w for w in self.windows.values() if w.closing is None])
        closing = [w.closing for w in self.windows.values() if w.closing is not None]
        if closing:
            await asyncio.wait(closing, timeout=finish_s)
        answer_leaving(list(self.windows.values()))  # still closing: out of time
        for task in list(self._tasks) + list(self.committer.tasks):
            task.cancel()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- rpc ----------------------------------------------------------------------------

    def _reject(self, round_id: int, fragment: int, reason: str, peer: str = "?") -> bytes:
        self.num_rejected += 1
        log.warning(
            "rejected contribution peer=%s round=%d fragment=%d reason=%r",
            peer[-8:], round_id, fragment, reason,
        )
        self.on_event(
            {"event": "rejected", "peer": peer, "round": round_id, "fragment": fragment, "reason": reason}
        )
        return messages.reply(self.run, round_id, fragment, self.peer_id, messages.Reply.REJECTED, reason=reason)

    def _status(self, round_id: int, fragment: int, status: str, **meta: object) -> bytes:
        return messages.reply(self.run, round_id, fragment, self.peer_id, status, **meta)

    async def rpc_contribute(self, caller: str, request: bytes) -> bytes:
        """A learner's delta: check it, add it to the open window, answer when it closes."""
        frame = open_contribution(self.run, caller, request, self.limits.max_frame_bytes + 256)
        if isinstance(frame, str):
            return self._reject(-1, -1, frame, caller)
        beat = self.members().get(caller)
        refusal = self.replicas.entitlement.learner_refusal(caller, beat.certificates if beat is not None else ())
        if refusal:
            return self._reject(-1, -1, refusal, caller)
        msg = wire.decode_message(frame, self.limits)
        def check() -> Accepted | Refused:
            sync = self.config.sync
            return check_contribution(msg, caller, self.run, self.state.rounds, self.state.layouts, sync.max_staleness_rounds)

        checked = check()
        if isinstance(checked, Refused) and checked.status == messages.Reply.BEHIND and await self._caught_up(checked.fragment):
            checked = check()  # against the rounds the pass reached
        if isinstance(checked, Refused):
            return self._refused(checked, caller)
        assert not isinstance(msg, wire.Rejected)
        target, fragment = checked.round, checked.fragment
        if (target, fragment) not in self.windows:
            moved_to = self.elected_elsewhere(target, fragment, checked.unreachable)
            if moved_to:
                return self._moved_reply(target, fragment, moved_to)
            closes_by = self.transport.now() + self.config.sync.round_deadline_s
            if self.committer.unproven(target, fragment, closes_by):
                return self._unproven_reply(target, fragment, checked.unreachable)
            if await self.committer.committed_elsewhere(target, fragment):
                return self._late_reply(target, fragment, "round already closed elsewhere")
        loop = asyncio.get_running_loop()
        delta = await loop.run_in_executor(self.worker, wire.lazy_tensors, msg, self.state.layouts[fragment])
        if isinstance(delta, wire.Rejected):
            return self._reject(target, fragment, delta.reason, caller)
        if self.state.round_of(fragment) != target:
            return self._late_reply(target, fragment, "round closed while decoding")
        window = self._window(target, fragment)
        tokens = clamp_tokens(checked.tokens, checked.steps, self.committer.max_tokens_per_step)
        refusal = window.machine.accept(caller, tokens, checked.steps, checked.step_time_s, time.monotonic())
        if refusal == "window is closing":
            return await self._reply_after_close(window)
        if refusal:
            return self._reject(target, fragment, refusal, caller)
        window.unreachable |= checked.unreachable
        window.step_ranges[caller] = (checked.first_step, checked.last_step)
        window.candidates[caller] = Candidate(
            caller, delta, checked.tokens, checked.steps, staleness=target - checked.base_round
        )
        window.sealed[caller] = request
        waiter = loop.create_future()
        window.waiters[caller] = waiter
        window.arrival.set()
        log.info(
            "contribution peer=%s round=%d fragment=%d base=%d arrived=%d",
            caller[-8:], target, fragment, checked.base_round, len(window.candidates),
        )
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.config.sync.round_deadline_s * 2)
        except TimeoutError:
            return self._status(target, fragment, messages.Reply.NO_QUORUM, reason="window did not close in time")

    async def _caught_up(self, fragment: int) -> bool:
        """A learner is a round ahead of us: follow the chain now (one pass per fragment
        for every caller, bounded by `CATCH_UP_S`) instead of answering "behind". True
        when the pass ended in time.

        We are elected for a round whose parent we have not applied yet: the record of the
        parent reaches its contributors in the reply, the rest of the swarm (us) at its
        next sync pass. Answered "behind", every learner of the round went on to the next
        candidate, which sent it back here ("moved"), until it gave up: at N = 1,000 a
        third of the contribution replies were "behind" and the rounds lost tens of
        seconds to it."""
        task = self._catching_up.get(fragment)
        if task is None or task.done():
            task = asyncio.ensure_future(self.replicas.sync_fragment(fragment))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._catching_up[fragment] = task
        done, _ = await asyncio.wait({task}, timeout=CATCH_UP_S)
        return bool(done)

    def _refused(self, refused: Refused, caller: str) -> bytes:
        """The answer to a contribution `check_contribution` refused."""
        if refused.status == messages.Reply.REJECTED:
            return self._reject(refused.round, refused.fragment, refused.reason, caller)
        if refused.status == messages.Reply.LATE:
            return self._late_reply(refused.round, refused.fragment, refused.reason)
        return self._status(refused.round, refused.fragment, refused.status, reason=refused.reason)

    def elected_elsewhere(self, round_id: int, fragment: int, unreachable: set[str] = frozenset()) -> str | None:
        """The peer above us in the rendezvous order of (round, fragment), or None if we top it.

        Peers a learner reported unreachable are skipped, so failover past a dead
        synchronizer whose heartbeat has not expired yet still finds a window here.
        """
        candidates = set(self.replicas.entitlement.candidates(self.members(), fragment, round_id)) - unreachable
        candidates.add(self.peer_id)
        top = synchronizer_order(self.run, round_id, fragment, candidates)[0]
        return None if top == self.peer_id else top

    def _unproven_reply(self, round_id: int, fragment: int, unreachable: set[str]) -> bytes:
        """The answer to a delta that would open a window whose record nobody counts (an
        open run's failover to a peer the chain never named, `Committer.unproven`): moved
        to the best-placed peer the chain does name, or no quorum at once when the learner
        reached none of them (it folds the delta into its next one, as after a window that
        ended without a commit, without waiting for one)."""
        named = set(self.replicas.entitlement.candidates(self.members(), fragment, round_id))
        others = named - unreachable - {self.peer_id}
        if others:
            return self._moved_reply(round_id, fragment, synchronizer_order(self.run, round_id, fragment, others)[0])
        return self._status(round_id, fragment, messages.Reply.NO_QUORUM, reason=NOT_PROVEN)

    def _moved_reply(self, round_id: int, fragment: int, moved_to: str) -> bytes:
        return self._status(
            round_id, fragment, messages.Reply.MOVED, moved_to=moved_to,
            reason=f"{moved_to[-8:]} is the synchronizer of this round",
        )

    def _late_reply(self, round_id: int, fragment: int, reason: str) -> bytes:
        """LATE, with the committed record of the round when known, so the learner settles."""
        record = self.replicas.committed(fragment, round_id)
        return self._status(
            round_id, fragment, messages.Reply.LATE, reason=reason,
            record=record.sealed if record is not None and record.sealed else None,
        )

    async def _reply_after_close(self, window: Window) -> bytes:
        """The answer to a delta that arrived while its window was being committed, given
        once the commit is over: `late` with the round's record, so the learner applies
        the round at once and its next delta goes to the next one, or `no_quorum` when the
        window ended without a commit here (the round is still open: the learner folds the
        delta and sends it again). Answered at once, `late` carried no record yet (it was
        not stored), and the learner's replica, which had nothing to follow, stayed at the
        round until a round deadline passed, while the rest of the swarm went on.
        """
        with contextlib.suppress(TimeoutError):  # full: its task may not have run the close yet
            await asyncio.wait_for(window.ended.wait(), self.config.sync.round_deadline_s * 2)
        committed = self.replicas.committed(window.fragment, window.round) is not None
        if not committed and self.state.round_of(window.fragment) == window.round:
            return self._reply(window, messages.Reply.NO_QUORUM, reason="window closed without a commit")
        return self._late_reply(window.round, window.fragment, "window is closing")

    # --- windows ------------------------------------------------------------------------

    def _window(self, round_id: int, fragment: int) -> Window:
        key = (round_id, fragment)
        window = self.windows.get(key)
        if window is None:
            sync = self.config.sync
            machine = WindowMachine(
                round=round_id,
                fragment=fragment,
                opened_at=time.monotonic(),
                deadline_s=sync.round_deadline_s,
                min_quorum=sync.min_quorum,
                min_token_fraction=sync.min_token_fraction,
            )
            window = Window(machine)
            self.windows[key] = window
            self._spawn(self._run_window(window))
            self.on_event({"event": "window_open", "round": round_id, "fragment": fragment})
        return window

    async def _run_window(self, window: Window) -> None:
        """Drive the window's machine until it closes, moves or expires. Never raises."""
        sync, machine = self.config.sync, window.machine
        try:
            while True:
                arrived = machine.arrivals.values()
                claimed = max((a.step_time_s for a in arrived), default=0.0)
                action = machine.next_action(
                    time.monotonic(),
                    expected=set(learners(self.members())),
                    better_placed=self.elected_elsewhere(machine.round, machine.fragment, window.unreachable),
                    step_time_s=self.step_time.get(claimed),
                    sync_time_s=self.committer.sync_time.get(0.0),
                    overlap_steps=overlap_steps_of(sync.overlap_steps, sync.inner_steps, sync.on_receive),
                    gamma=sync.grace_gamma,
                    max_grace_s=sync.max_grace_s,
                )
                if isinstance(action, Close):
                    window.closing = asyncio.current_task()
                    await self._close(window, action.grace_s)
                    return
                if isinstance(action, Move):
                    self._move(window, action.to)
                    return
                if isinstance(action, Expire):
                    log.warning("no quorum round=%d fragment=%d reason=%r", machine.round, machine.fragment, action.reason)
                    self._finish(window, self._reply(window, messages.Reply.NO_QUORUM, reason=action.reason))
                    return
                assert isinstance(action, Wait)
                window.arrival.clear()
                try:
                    await asyncio.wait_for(window.arrival.wait(), timeout=max(action.until - time.monotonic(), 0.01))
                except TimeoutError:
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a window fault is a skipped round, not a crash
            log.exception("window failed round=%d fragment=%d", machine.round, machine.fragment)
            self._finish(window, self._reply(window, messages.Reply.NO_QUORUM, reason=f"synchronizer fault: {exc}"))
        finally:
            window.ended.set()

    def _move(self, window: Window, moved_to: str) -> None:
        """Close a window without quorum, telling its learners where to resend."""
        m = window.machine
        log.info("window moved round=%d fragment=%d to=%s arrived=%d", m.round, m.fragment, moved_to[-8:], len(window.candidates))
        self.on_event({"event": "window_moved", "round": m.round, "fragment": m.fragment, "to": moved_to})
        self._finish(window, self._moved_reply(m.round, m.fragment, moved_to))

    def _reply(self, window: Window, status: str, **meta: object) -> bytes:
        return self._status(window.machine.round, window.machine.fragment, status, **meta)

    def _finish(self, window: Window, reply: bytes) -> None:
        """Answer every waiter of the window (the same bytes for all) and forget it."""
        self.windows.pop(window.key, None)
        for waiter in window.waiters.values():
            if not waiter.done():
                waiter.set_result(reply)

    # --- closing: the commit's steps (commit.Committer) -------------------------------------

    async def _close(self, window: Window, grace_s: float) -> None:
        """Commit a window the machine closed, and answer its learners."""
        started, committer = time.monotonic(), self.committer
        merged = await committer.merge(window, grace_s)
        screening = merged.result.screening
        for peer, reason in screening.refused.items():
            self._reject(window.round, window.fragment, reason, peer)
            window.answer(peer, self._reply(window, messages.Reply.REJECTED, reason=reason))
        if not merged.result.quorate:
            self._finish(window, self._reply(window, messages.Reply.NO_QUORUM, reason="too few acceptable deltas"))
            return
        if merged.update is None:
            self._finish(window, self._late_reply(window.round, window.fragment, "round closed during the merge"))
            return
        holders = await committer.hold(merged.update)
        if holders is None:
            self._finish(window, self._reply(window, messages.Reply.NO_QUORUM, reason="too few peers held the update"))
            return
        record = committer.record_of(window, merged, holders, grace_s)
        failure = await committer.publish(window, merged, record)
        if failure:
            # No record, no commit: nothing is installed, the learners' bases did not move.
            log.warning("%s round=%d fragment=%d: not committed", failure, window.round, window.fragment)
            late = failure == COMMITTED_ELSEWHERE
            self._finish(window, self._late_reply(window.round, window.fragment, failure) if late
                         else self._reply(window, messages.Reply.NO_QUORUM, reason=failure))  # fmt: skip
            return
        await committer.install(record, merged)
        elapsed = time.monotonic() - started
        committer.sync_time.update(elapsed)
        for arrival in window.machine.arrivals.values():
            self.step_time.update(arrival.step_time_s)
        committer.report(window, merged, record, grace_s, elapsed)
        reply = self._reply(window, messages.Reply.MERGED, digest=merged.update.digest, record=record.sealed)
        self.windows.pop(window.key, None)
        await committer.answer_first(window, reply)
        window.answer_all(reply)
