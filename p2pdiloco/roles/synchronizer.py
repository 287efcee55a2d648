"""The synchronizer role: collect deltas for a (round, fragment), merge, commit, answer.

Any peer that accepts connections can be elected for a (round, fragment). A window's
life is the pure `windows.WindowMachine` (wait for quorum, grace, close, move, expire);
this module owns the clock, the tensors and the network. Closing a window is a commit
in four steps, in this order (docs/protocol.md argues each crash point):

1. screen and merge the deltas, encode the update frame and compute the result on a
   copy of the fragment (worker thread; the replica is not touched);
2. push the frame to the live learners (`hold_update`) until `sync.commit_holders`
   of them keep it;
3. check that no rival record of the round exists, then store the round record, which
   names the holders and the frame's digest: **the commit point**;
4. install the result in the replica and answer every waiting learner.

A crash before 3 leaves no record: learners fail over and the round is re-run. A crash
after 3 leaves a record whose update the holders serve. Every fault of a contribution
becomes a logged rejection; nothing is raised to the peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.outer.fragment import outer_update
from p2pdiloco.outer.screening import Candidate, ScreeningRules
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import Heartbeat, learners, synchronizer_candidates
from p2pdiloco.protocol.merge import history_of, max_tokens_per_step, merge_round
from p2pdiloco.protocol.rounds import (
    RoundRecord,
    record_subkey,
    records_of,
    rounds_key,
    signed_record,
)
from p2pdiloco.protocol.windows import (
    Close,
    Expire,
    Move,
    RunningMean,
    Wait,
    WindowMachine,
    clamp_tokens,
    overlap_steps_of,
    staleness_rejection,
)
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError, transfer_timeout_s
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import (
    ContributionStore,
    contribution_digest,
    decode_audit_request,
    encode_contribution_list,
    open_contribution,
)
from p2pdiloco.wire.updates import Update, new_update

log = logging.getLogger(__name__)

ROUND_RECORD_TTL_S = 3600.0
"""How long round records stay in the DHT, seconds."""
HOLD_TIMEOUT_S = 20.0
"""Deadline for a holder to take an update, seconds, plus the update's bytes at the
slowest expected link (`transfer_timeout_s`)."""
BACKGROUND_PUSHES = 2
"""Pushes to further learners at once, after the commit holders acked: each one shares
the synchronizer's uplink with the rest."""

Hook = Callable[[str, int, int], Awaitable[None]]
"""`await hook(phase, round, fragment)` at each phase of a commit (fault injection)."""


async def no_hook(phase: str, round_id: int, fragment: int) -> None:
    """The production hook: nothing happens between phases."""


@dataclass
class Window:
    """An open (round, fragment): the pure machine plus the decoded deltas and waiters."""

    machine: WindowMachine
    candidates: dict[str, Candidate] = field(default_factory=dict)
    """peer -> its decoded delta with its signed claims (tokens, steps, staleness)."""
    waiters: dict[str, asyncio.Future] = field(default_factory=dict)
    arrival: asyncio.Event = field(default_factory=asyncio.Event)
    unreachable: set[str] = field(default_factory=set)
    """Better-placed synchronizers its learners could not reach (failover): not moved to."""
    sealed: dict[str, bytes] = field(default_factory=dict)
    """peer -> its signed contribution, as received (kept for auditors once committed)."""
    step_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    """peer -> (first, last) of the learner's own steps its delta says it carries (for
    the round_closed event only: goodput is attributed to when the work was done)."""
    closing: asyncio.Task | None = None
    """The task merging and committing it once the machine closed it (a leaving peer
    lets it finish)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.machine.round, self.machine.fragment)


def unreachable_peers(meta: dict) -> set[str]:
    """The `unreachable` list of a contribution's meta, as a set of peer ids (junk dropped)."""
    listed = meta.get("unreachable") or []
    return {p for p in listed[:64] if isinstance(p, str)}


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
        hook: Hook = no_hook,
        on_event: Callable[[dict], None] = lambda event: None,
        rivals_visible: Callable[[int], bool] = lambda round_id: True,
        certificates: tuple[bytes, ...] = (),
        screening_rules: ScreeningRules | None = None,
    ) -> None:
        self.transport = transport
        self.certificates = certificates
        """This peer's operator certificates, shown in its round records."""
        self.rivals_visible = rivals_visible
        """Whether this peer looks for rival records of a round (off only under the
        split-view fault injection, to force two commits of one round in tests)."""
        self.run = run
        self.config = config
        self.state = state
        self.members = members
        self.limits = limits
        self.replicas = replicas
        self.worker = worker
        self.hook = hook
        self.on_event = on_event
        self.outer_codec = compress.make_codec_from_config(config.compress, outer=True)
        self.windows: dict[tuple[int, int], Window] = {}
        self.step_time = RunningMean()
        self.sync_time = RunningMean()
        self.num_rejected = 0
        self.max_tokens_per_step = max_tokens_per_step(config)
        self._tasks: set[asyncio.Task] = set()
        self.screening_rules = screening_rules or ScreeningRules()
        self.kept = ContributionStore()
        """Signed contributions of the rounds this peer committed, served to auditors."""

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def holding(self) -> list[int]:
        """Fragments with a window open here."""
        return sorted({f for (_, f) in self.windows})

    async def start(self) -> None:
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_CONTRIBUTE}", self.rpc_contribute, self.limits.max_frame_bytes + 256
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_CONTRIBUTIONS}", self.rpc_get_contributions, 256
        )

    async def rpc_get_contributions(self, caller: str, request: bytes) -> bytes:
        """The signed contributions of a round this peer committed (for auditors)."""
        asked = decode_audit_request(request)
        if isinstance(asked, str):
            raise ValueError(asked)
        kept = self.kept.get(*asked)
        if kept is None:
            raise LookupError(f"contributions of round {asked[0]} fragment {asked[1]} are not kept here")
        return encode_contribution_list(kept)

    async def shutdown(self, finish_s: float = 20.0) -> None:
        """Leave. A window still collecting is answered "leaving" (its learners resend to the
        next synchronizer); one already closed gets `finish_s` to merge and commit, so a
        peer that leaves does not throw away a merge the swarm would have to redo, nor stop
        between storing a round's record and answering its learners."""

        def answer_leaving(windows: list[Window]) -> None:
            for window in windows:
                self._finish(window, self._reply(window, messages.NO_QUORUM, reason="synchronizer is leaving"))

        answer_leaving([w for w in self.windows.values() if w.closing is None])
        closing = [w.closing for w in self.windows.values() if w.closing is not None]
        if closing:
            await asyncio.wait(closing, timeout=finish_s)
        answer_leaving(list(self.windows.values()))  # still closing: out of time
        for task in list(self._tasks):
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
        return messages.reply(self.run, round_id, fragment, self.peer_id, messages.REJECTED, reason=reason)

    def _status(self, round_id: int, fragment: int, status: str, **meta: object) -> bytes:
        return messages.reply(self.run, round_id, fragment, self.peer_id, status, **meta)

    async def rpc_contribute(self, caller: str, request: bytes) -> bytes:
        """A learner's delta: validate it, add it to the open window, answer when it closes."""
        frame = open_contribution(self.run, caller, request, self.limits.max_frame_bytes + 256)
        if isinstance(frame, str):
            return self._reject(-1, -1, frame, caller)
        refusal = self._learner_refusal(caller)
        if refusal:
            return self._reject(-1, -1, refusal, caller)
        msg = wire.decode_message(frame, self.limits)
        if isinstance(msg, wire.Rejected):
            return self._reject(-1, -1, msg.reason, caller)
        if msg.kind != wire.CONTRIBUTION or msg.run != self.run:
            return self._reject(msg.round, msg.fragment, f"unexpected {msg.kind} for run {msg.run!r}", caller)
        if msg.meta.get("peer") != caller:
            # Auditors check the signature against the named peer: a frame naming someone
            # else would make an honest merge look forged.
            return self._reject(msg.round, msg.fragment, "contribution names another peer", caller)
        if not 0 <= msg.fragment < self.state.num_fragments:
            return self._reject(msg.round, msg.fragment, f"no fragment {msg.fragment}", caller)
        fragment, target = msg.fragment, msg.round
        current = self.state.round_of(fragment)
        if target > current:
            return self._status(target, fragment, messages.BEHIND, reason=f"synchronizer at round {current}")
        if target < current:
            return self._late_reply(target, fragment, "round already closed")
        step_time_s = msg.meta.get("step_time_s", 0.0)
        if not isinstance(step_time_s, int | float) or not math.isfinite(step_time_s) or step_time_s < 0:
            return self._reject(target, fragment, "step_time_s must be a finite number >= 0", caller)
        base_round = int(msg.meta["base_round"])
        reason = staleness_rejection(base_round, current, self.config.sync.max_staleness_rounds)
        if reason:
            return self._reject(target, fragment, reason, caller)
        reason = self._check_layout(fragment, msg)
        if reason:
            return self._reject(target, fragment, reason, caller)
        unreachable = unreachable_peers(msg.meta)
        window = self.windows.get((target, fragment))
        if window is None:
            moved_to = self.elected_elsewhere(target, fragment, unreachable)
            if moved_to:
                return self._moved_reply(target, fragment, moved_to)
            if await self._committed_elsewhere(target, fragment):
                return self._late_reply(target, fragment, "round already closed elsewhere")
        loop = asyncio.get_running_loop()
        layout = {n: tuple(self.state.params[n].shape) for n in self.state.fragments[fragment]}
        delta = await loop.run_in_executor(self.worker, wire.lazy_tensors, msg, layout)
        if isinstance(delta, wire.Rejected):
            return self._reject(target, fragment, delta.reason, caller)
        if self.state.round_of(fragment) != target:
            return self._late_reply(target, fragment, "round closed while decoding")
        window = self._window(target, fragment)
        steps = int(msg.meta["steps"])
        tokens = clamp_tokens(int(msg.meta["tokens"]), steps, self.max_tokens_per_step)
        refusal = window.machine.accept(caller, tokens, steps, float(step_time_s), time.monotonic())
        if refusal == "window is closing":
            return self._late_reply(target, fragment, refusal)
        if refusal:
            return self._reject(target, fragment, refusal, caller)
        window.unreachable |= unreachable
        window.step_ranges[caller] = (int(msg.meta.get("first_step", 0)), int(msg.meta.get("last_step", 0)))
        window.candidates[caller] = Candidate(
            caller, delta, int(msg.meta["tokens"]), steps, staleness=target - base_round
        )
        window.sealed[caller] = request
        waiter = loop.create_future()
        window.waiters[caller] = waiter
        window.arrival.set()
        log.info(
            "contribution peer=%s round=%d fragment=%d base=%d arrived=%d",
            caller[-8:], target, fragment, base_round, len(window.candidates),
        )
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.config.sync.round_deadline_s * 2)
        except TimeoutError:
            return self._status(target, fragment, messages.NO_QUORUM, reason="window did not close in time")

    def _learner_refusal(self, caller: str) -> str | None:
        """Why the run does not admit `caller`'s contributions (None: it does)."""
        admission = self.replicas.entitlement.admission
        if admission.learners == "open":
            return None
        beat = self.members().get(caller)
        certificates = beat.certificates if beat is not None else ()
        refusal = admission.learner_refusal(self.run, caller, certificates, self.transport.now())
        return f"learner not admitted: {refusal}" if refusal else None

    def elected_elsewhere(self, round_id: int, fragment: int, unreachable: set[str] = frozenset()) -> str | None:
        """The peer above us in the rendezvous order of (round, fragment), or None if we top it.

        Peers a learner reported unreachable are skipped, so failover past a dead
        synchronizer whose heartbeat has not expired yet still finds a window here.
        """
        candidates = set(synchronizer_candidates(self.members(), self.replicas.entitlement.may_synchronize)) - unreachable
        candidates.add(self.peer_id)
        top = synchronizer_order(self.run, round_id, fragment, candidates)[0]
        return None if top == self.peer_id else top

    def _moved_reply(self, round_id: int, fragment: int, moved_to: str) -> bytes:
        return self._status(
            round_id, fragment, messages.MOVED, moved_to=moved_to,
            reason=f"{moved_to[-8:]} is the synchronizer of this round",
        )

    async def _committed_elsewhere(self, round_id: int, fragment: int) -> bool:
        """True when some synchronizer already committed (round, fragment) (failover race)."""
        if not self.rivals_visible(round_id):
            return False
        raw = await self.transport.get(rounds_key(self.run, fragment))
        parent = self.replicas.parent_hash(fragment, round_id)
        return any(
            r.round == round_id and r.parent == parent
            for r in records_of(self.run, raw, fragment, self.replicas.entitlement.entitled).values()
        )

    def _check_layout(self, fragment: int, msg: wire.Message) -> str | None:
        names = self.state.fragments[fragment]
        if set(msg.tensors) != set(names):
            return f"delta tensors do not match fragment {fragment}"
        for name in names:
            expected = tuple(self.state.params[name].shape)
            if tuple(msg.tensors[name].shape) != expected:
                return f"tensor {name} has shape {tuple(msg.tensors[name].shape)}, expected {expected}"
        return None

    def _late_reply(self, round_id: int, fragment: int, reason: str) -> bytes:
        """LATE, with the committed record of the round when known, so the learner settles."""
        record = self.replicas.committed(fragment, round_id)
        return self._status(
            round_id, fragment, messages.LATE, reason=reason,
            record=record.sealed if record is not None and record.sealed else None,
        )

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
                    sync_time_s=self.sync_time.get(0.0),
                    overlap_steps=overlap_steps_of(sync.overlap_steps, sync.inner_steps, sync.on_receive),
                    gamma=sync.grace_gamma,
                    max_grace_s=sync.max_grace_s,
                )
                if isinstance(action, Close):
                    window.closing = asyncio.current_task()
                    await self._commit(window, action.grace_s)
                    return
                if isinstance(action, Move):
                    self._move(window, action.to)
                    return
                if isinstance(action, Expire):
                    log.warning("no quorum round=%d fragment=%d reason=%r", machine.round, machine.fragment, action.reason)
                    self._finish(window, self._reply(window, messages.NO_QUORUM, reason=action.reason))
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
            self._finish(window, self._reply(window, messages.NO_QUORUM, reason=f"synchronizer fault: {exc}"))

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

    # --- closing: merge, hold, commit, answer -------------------------------------------

    async def _commit(self, window: Window, grace_s: float) -> None:
        m = window.machine
        started = time.monotonic()
        await self.hook("after_quorum", m.round, m.fragment)
        loop = asyncio.get_running_loop()
        merging = loop.run_in_executor(self.worker, self._merge, window, grace_s)
        await self.hook("during_merge", m.round, m.fragment)
        result, advanced, update, norm, history_first = await merging
        refused = result.screening.refused
        for peer, reason in refused.items():
            self._reject(m.round, m.fragment, reason, peer)
            waiter = window.waiters.get(peer)
            if waiter is not None and not waiter.done():
                waiter.set_result(self._reply(window, messages.REJECTED, reason=reason))
        kept = result.screening.kept
        if len(kept) < self.config.sync.min_quorum:
            self._finish(window, self._reply(window, messages.NO_QUORUM, reason="too few acceptable deltas"))
            return
        if update is None:
            self._finish(window, self._late_reply(m.round, m.fragment, "round closed during the merge"))
            return
        self.replicas.keep(update)
        holders = await self._hold(update)
        if holders is None:
            self._finish(window, self._reply(window, messages.NO_QUORUM, reason="too few peers held the update"))
            return
        await self.hook("after_hold", m.round, m.fragment)
        record = RoundRecord(
            round=m.round,
            fragment=m.fragment,
            synchronizer=self.peer_id,
            hash=update.hash,
            parent=update.parent,
            digest=update.digest,
            holders=tuple(holders),
            contributors=update.contributors,
            contributions=tuple(contribution_digest(window.sealed[v.peer]) for v in kept),
            norms=tuple(v.merged_norm for v in kept),
            refused=tuple(contribution_digest(window.sealed[p]) for p in sorted(refused)),
            history_from=history_first,
            grace_s=grace_s,
            closed_at=self.transport.now(),
            certificates=self.certificates,
        )
        record = signed_record(self.transport.identity, self.run, record)
        if await self._committed_elsewhere(m.round, m.fragment):
            log.warning("rival record round=%d fragment=%d: not committing ours", m.round, m.fragment)
            self._finish(window, self._late_reply(m.round, m.fragment, "round committed elsewhere"))
            return
        stored = await self._store_record(record)
        if not stored:
            # No record, no commit: nothing is installed, the learners' bases did not move.
            log.warning("round record not stored round=%d fragment=%d", m.round, m.fragment)
            self._finish(window, self._reply(window, messages.NO_QUORUM, reason="round record not stored"))
            return
        self.kept.put(m.round, m.fragment, [window.sealed[c.peer] for c in result.candidates])
        await self.hook("after_record", m.round, m.fragment)
        await self.replicas.install_own(record, update, advanced, norm)
        elapsed = time.monotonic() - started
        self.sync_time.update(elapsed)
        for arrival in m.arrivals.values():
            self.step_time.update(arrival.step_time_s)
        log.info(
            "round closed round=%d fragment=%d merged=%d refused=%d holders=%d grace_s=%.2f sync_s=%.3f hash=%s",
            m.round, m.fragment, len(kept), len(refused), len(holders), grace_s, elapsed, update.hash[:12],
        )
        claimed = {c.peer: c for c in result.candidates}
        self.on_event(
            {
                "event": "round_closed",
                "round": m.round,
                "fragment": m.fragment,
                "contributors": [c[0] for c in update.contributors],
                "weights": [c[1] for c in update.contributors],
                # the work each merged delta carries, as claimed (goodput is counted from these)
                "tokens": [claimed[c[0]].tokens for c in update.contributors],
                "steps": [claimed[c[0]].steps for c in update.contributors],
                "staleness": [claimed[c[0]].staleness for c in update.contributors],
                "step_ranges": [list(window.step_ranges.get(c[0], (0, 0))) for c in update.contributors],
                "refused": sorted(refused),
                "holders": list(holders),
                "grace_s": grace_s,
                "sync_s": elapsed,
                "hash": update.hash,
                "clip_norm": result.screening.clip_norm,
            }
        )
        reply = self._reply(window, messages.MERGED, digest=update.digest, record=record.sealed)
        self.windows.pop(window.key, None)
        for index, waiter in enumerate(window.waiters.values()):
            if not waiter.done():
                waiter.set_result(reply)
                if index == 0:
                    await self.hook("after_first_reply", m.round, m.fragment)

    def _merge(self, window: Window, grace_s: float):
        """Screen, weigh, merge, encode, and the result on a copy of the fragment (worker thread).

        Returns (merge, advanced state, update, its outer-gradient norm, first history
        round); the state and update are None when nothing was kept or the replica moved
        past the round meanwhile (a rival's update was applied).
        """
        m = window.machine
        snapshot = self.state.export_fragment(m.fragment)
        history, history_first = history_of(
            self.replicas.chains[m.fragment], m.round, self.screening_rules.history_rounds
        )
        result = merge_round(
            list(window.candidates.values()),
            history=history,
            params=snapshot.params,
            momentum=snapshot.momentum,
            outer=self.config.outer,
            sync=self.config.sync,
            rules=self.screening_rules,
            max_tokens_per_step=self.max_tokens_per_step,
            outer_codec=self.outer_codec,
        )
        if result.decoded is None or len(result.screening.kept) < self.config.sync.min_quorum:
            return result, None, None, 0.0, history_first
        if snapshot.round != m.round:
            return result, None, None, 0.0, history_first
        advanced = outer_update(snapshot, result.decoded, self.config.outer)
        contributors = [(v.peer, float(v.weight), v.tokens) for v in result.screening.kept]
        update = new_update(
            self.run, m.round, m.fragment, self.peer_id, snapshot.hash, advanced.hash,
            contributors, result.encoded, grace_s,
        )
        return result, advanced, update, tensor_norm(result.decoded), history_first

    async def _hold(self, update: Update) -> list[str] | None:
        """Push the update to live learners until `commit_holders` keep it; None if too few.

        Contributors first (they need it anyway), then the other live learners. Only as
        many pushes as holders are still needed run at once (a failed one is replaced by
        the next target), so on a slow uplink the first holder gets the whole of it; once
        enough acked, the other learners get it in the background, `BACKGROUND_PUSHES` at
        a time, so more peers hold it.
        """
        me = self.peer_id
        contributors = [c[0] for c in update.contributors if c[0] != me]
        others = [p for p in learners(self.members()) if p != me and p not in contributors]
        targets = contributors + others
        need = min(self.config.sync.commit_holders, len(targets))
        if need == 0:
            return []
        timeout_s = transfer_timeout_s(HOLD_TIMEOUT_S, len(update.frame))
        holders: list[str] = []
        queue = list(targets)  # not tried yet: a failed push is not repeated
        running: set[asyncio.Future] = set()
        deadline = time.monotonic() + 2 * timeout_s  # one failed wave, then its replacement
        while len(holders) < need and (queue or running) and time.monotonic() < deadline:
            while queue and len(running) < need - len(holders):
                running.add(asyncio.ensure_future(self._push(queue.pop(0), update, timeout_s)))
            done, running = await asyncio.wait(
                running, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
            )
            holders += [peer for peer in (task.result() for task in done) if peer is not None]
        for task in running:
            task.cancel()
        if len(holders) < need:
            return None
        if queue:
            task = asyncio.ensure_future(self._push_rest(queue, update, timeout_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return list(holders)

    async def _store_record(self, record: RoundRecord) -> bool:
        """Store the round's record: the commit point. A DHT may answer "not stored" for a
        record that some of its nodes did keep (hivemind reports its last replica's
        answer), so a refusal is checked by reading the record back."""
        key, subkey = rounds_key(self.run, record.fragment), record_subkey(record.round, self.peer_id)
        if await self.transport.store(key, subkey, record.sealed, self.transport.now() + ROUND_RECORD_TTL_S):
            return True
        found = (await self.transport.get(key)).get(subkey)
        if found is not None and found[0] == record.sealed:
            log.info("round record reported not stored but found round=%d fragment=%d", record.round, record.fragment)
            return True
        return False

    async def _push(self, peer: str, update: Update, timeout_s: float) -> str | None:
        """Hand the update to `peer` to hold; its id once it acked the digest, else None."""
        try:
            raw = await self.transport.call(
                peer,
                f"{self.run}.{messages.RPC_HOLD_UPDATE}",
                update.frame,
                timeout_s=timeout_s,
                max_response_bytes=1 << 16,
            )
        except TransportError as exc:
            log.info("hold failed peer=%s error=%r", peer[-8:], exc)
            return None
        reply = messages.decode_reply(raw, self.limits, self.run)
        if (
            not isinstance(reply, wire.Rejected)
            and reply.meta.get("status") == messages.HELD
            and reply.meta.get("digest") == update.digest
        ):
            return peer
        return None

    async def _push_rest(self, peers: list[str], update: Update, timeout_s: float) -> None:
        """After the commit: the update to the other learners, a few at a time."""
        slots = asyncio.Semaphore(BACKGROUND_PUSHES)

        async def one(peer: str) -> None:
            async with slots:
                await self._push(peer, update, timeout_s)

        await asyncio.gather(*(one(p) for p in peers))
