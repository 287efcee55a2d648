"""The synchronizer role: collect deltas for a (round, fragment), close the window, publish.

Any peer that accepts connections can be elected for a (round, fragment). For each open
window it waits for the minimum quorum, then the adaptive grace window of Eq. 3 (or
until every live learner has arrived), screens and merges the deltas, encodes the outer
gradient, applies the *decoded* gradient to its own replica (so every peer applies the
same bits), publishes a round record and answers every waiting learner with the update.
A window that never reaches quorum before its deadline closes with no outer step.
A window that has not reached quorum moves when a better-placed synchronizer appears in
this peer's view (peers that started together first see only themselves, and would
otherwise each hold a window alone until the deadline): its learners are told where to
resend. Moves only go up the rendezvous order, so they end at the top live peer.
Every fault of a contribution becomes a logged rejection; nothing is raised to the peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress, messages, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.election import synchronizer_order
from p2pdiloco.membership import Heartbeat, learners, synchronizer_candidates
from p2pdiloco.messages import RoundRecord
from p2pdiloco.outer import merge, tensor_norm, token_weights
from p2pdiloco.state import GlobalState
from p2pdiloco.transport.base import Transport
from p2pdiloco.windows import (
    RunningMean,
    clamp_tokens,
    grace_window_s,
    norm_outliers,
    quorum_met,
    should_close,
    staleness_rejection,
)

log = logging.getLogger(__name__)

ROUND_RECORD_TTL_S = 3600.0
"""How long round records stay in the DHT, seconds."""
MAX_BATCH_MULTIPLE = 4
"""A learner may claim up to this many times the run's tokens per step (bigger batches)."""


@dataclass
class Contribution:
    """One learner's decoded delta in a window."""

    peer: str
    base_round: int
    tokens: int
    steps: int
    step_time_s: float
    delta: dict[str, torch.Tensor]
    arrived_at: float


@dataclass
class Window:
    """The open (round, fragment) a synchronizer is collecting."""

    round: int
    fragment: int
    opened_at: float
    contributions: dict[str, Contribution] = field(default_factory=dict)
    quorum_at: float | None = None
    arrival: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future | None = None
    unreachable: set[str] = field(default_factory=set)
    """Better-placed synchronizers its learners could not reach (failover): not moved to."""


def unreachable_peers(meta: dict) -> set[str]:
    """The `unreachable` list of a contribution's meta, as a set of peer ids (junk dropped)."""
    listed = meta.get("unreachable") or []
    return {p for p in listed[:64] if isinstance(p, str)}


class Synchronizer:
    """Serves `contribute` / `get_update` / `get_state` for one run on one peer."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        config: RunConfig,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        on_event: Callable[[dict], None] = lambda event: None,
    ) -> None:
        self.transport = transport
        self.run = run
        self.config = config
        self.state = state
        self.members = members
        self.limits = limits
        self.on_event = on_event
        self.outer_codec = compress.make_codec_from_config(config.compress, outer=True)
        self.windows: dict[tuple[int, int], Window] = {}
        self.closed: dict[tuple[int, int], bytes] = {}
        self.step_time = RunningMean()
        self.sync_time = RunningMean()
        self.num_rejected = 0
        self.max_tokens_per_step = (
            config.train.batch_size
            * config.train.grad_accum
            * config.model.seq_len
            * MAX_BATCH_MULTIPLE
        )
        self._tasks: set[asyncio.Task] = set()

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def holding(self) -> list[int]:
        """Fragments with a window open here."""
        return sorted({f for (_, f) in self.windows})

    async def start(self) -> None:
        max_request = self.limits.max_frame_bytes
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_CONTRIBUTE}", self.rpc_contribute, max_request
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_UPDATE}", self.rpc_get_update, 1 << 16
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_STATE}", self.rpc_get_state, 1 << 16
        )

    async def shutdown(self) -> None:
        for window in list(self.windows.values()):
            if window.result and not window.result.done():
                window.result.set_result(
                    self._reply(window, messages.NO_QUORUM, reason="synchronizer is leaving")
                )
        for task in list(self._tasks):
            task.cancel()

    # --- rpc ----------------------------------------------------------------------------

    def _reject(self, msg_round: int, fragment: int, reason: str, peer: str = "?") -> bytes:
        self.num_rejected += 1
        log.warning(
            "rejected contribution peer=%s round=%d fragment=%d reason=%r",
            peer[-8:],
            msg_round,
            fragment,
            reason,
        )
        self.on_event(
            {
                "event": "rejected",
                "peer": peer,
                "round": msg_round,
                "fragment": fragment,
                "reason": reason,
            }
        )
        return messages.reply(
            self.run, msg_round, fragment, self.peer_id, messages.REJECTED, reason=reason
        )

    async def rpc_contribute(self, caller: str, request: bytes) -> bytes:
        """A learner's delta: validate it, add it to the open window, answer when it closes."""
        msg = wire.decode_message(request, self.limits)
        if isinstance(msg, wire.Rejected):
            return self._reject(-1, -1, msg.reason, caller)
        if msg.kind != wire.CONTRIBUTION or msg.run != self.run:
            return self._reject(
                msg.round, msg.fragment, f"unexpected {msg.kind} for run {msg.run!r}", caller
            )
        if not 0 <= msg.fragment < self.state.num_fragments:
            return self._reject(msg.round, msg.fragment, f"no fragment {msg.fragment}", caller)
        fragment, target = msg.fragment, msg.round
        current = self.state.round_of(fragment)
        if target > current:
            return messages.reply(
                self.run,
                target,
                fragment,
                self.peer_id,
                messages.BEHIND,
                reason=f"synchronizer at round {current}",
            )
        if target < current:
            return self._late_reply(target, fragment)
        unreachable = unreachable_peers(msg.meta)
        if (target, fragment) not in self.windows:
            moved_to = self.elected_elsewhere(target, fragment, unreachable)
            if moved_to:
                return self._moved_reply(target, fragment, moved_to)
        base_round = int(msg.meta["base_round"])
        reason = staleness_rejection(base_round, current, self.config.sync.max_staleness_rounds)
        if reason:
            return self._reject(target, fragment, reason, caller)
        delta = wire.decode_tensors(msg)
        if isinstance(delta, wire.Rejected):
            return self._reject(target, fragment, delta.reason, caller)
        reason = self._check_layout(fragment, delta)
        if reason:
            return self._reject(target, fragment, reason, caller)
        if (target, fragment) not in self.windows and await self._already_closed(target, fragment):
            return messages.reply(
                self.run,
                target,
                fragment,
                self.peer_id,
                messages.LATE,
                reason="round already closed elsewhere",
            )
        window = self._window(target, fragment)
        window.unreachable |= unreachable
        if caller in window.contributions:
            return self._reject(target, fragment, "already contributed to this window", caller)
        steps = int(msg.meta["steps"])
        window.contributions[caller] = Contribution(
            peer=caller,
            base_round=base_round,
            tokens=clamp_tokens(int(msg.meta["tokens"]), steps, self.max_tokens_per_step),
            steps=steps,
            step_time_s=float(msg.meta.get("step_time_s", 0.0) or 0.0),
            delta=delta,
            arrived_at=time.monotonic(),
        )
        window.arrival.set()
        log.info(
            "contribution peer=%s round=%d fragment=%d base=%d arrived=%d",
            caller[-8:],
            target,
            fragment,
            base_round,
            len(window.contributions),
        )
        assert window.result is not None
        try:
            return await asyncio.wait_for(
                asyncio.shield(window.result), self.config.sync.round_deadline_s * 2
            )
        except TimeoutError:
            return messages.reply(
                self.run,
                target,
                fragment,
                self.peer_id,
                messages.NO_QUORUM,
                reason="window did not close in time",
            )

    def elected_elsewhere(
        self, round_id: int, fragment: int, unreachable: set[str] = frozenset()
    ) -> str | None:
        """The peer above us in the rendezvous order of (round, fragment), or None if we top it.

        Peers a learner reported unreachable are skipped, so failover past a dead
        synchronizer whose heartbeat has not expired yet still finds a window here.
        """
        candidates = set(synchronizer_candidates(self.members())) - unreachable
        candidates.add(self.peer_id)
        top = synchronizer_order(self.run, round_id, fragment, candidates)[0]
        return None if top == self.peer_id else top

    def _moved_reply(self, round_id: int, fragment: int, moved_to: str) -> bytes:
        return messages.reply(
            self.run,
            round_id,
            fragment,
            self.peer_id,
            messages.MOVED,
            moved_to=moved_to,
            reason=f"{moved_to[-8:]} is the synchronizer of this round",
        )

    async def _already_closed(self, round_id: int, fragment: int) -> bool:
        """True when another synchronizer already published (round, fragment) (failover race)."""
        records = await self.transport.get(messages.rounds_key(self.run, fragment))
        return str(round_id) in records

    def _check_layout(self, fragment: int, delta: dict[str, torch.Tensor]) -> str | None:
        names = self.state.fragments[fragment]
        if set(delta) != set(names):
            return f"delta tensors do not match fragment {fragment}"
        for name in names:
            if tuple(delta[name].shape) != tuple(self.state.params[name].shape):
                return f"tensor {name} has shape {tuple(delta[name].shape)}, expected {tuple(self.state.params[name].shape)}"
        return None

    def _late_reply(self, round_id: int, fragment: int) -> bytes:
        encoded = self.state.encoded_update(fragment, round_id)
        if encoded is None:
            return messages.reply(
                self.run,
                round_id,
                fragment,
                self.peer_id,
                messages.LATE,
                reason="update no longer kept",
            )
        update = wire.decode_message(encoded, self.limits)
        assert not isinstance(update, wire.Rejected)
        return messages.reply(
            self.run,
            round_id,
            fragment,
            self.peer_id,
            messages.LATE,
            tensors=update.tensors,
            hash=update.meta.get("hash"),
        )

    def _parse_request(self, request: bytes, kind: str) -> wire.Message | None:
        """A small request of `kind` for one of our fragments, or None (logged) if it is not."""
        msg = wire.decode_message(request, self.limits)
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != kind
            or not 0 <= msg.fragment < self.state.num_fragments
        ):
            reason = (
                msg.reason
                if isinstance(msg, wire.Rejected)
                else f"{msg.kind} for fragment {msg.fragment}"
            )
            log.warning("rejected request kind=%s reason=%r", kind, reason)
            return None
        return msg

    async def rpc_get_update(self, caller: str, request: bytes) -> bytes:
        """The encoded update of (round, fragment) from this replica's history."""
        msg = self._parse_request(request, messages.UPDATE_REQUEST)
        if msg is None:
            return messages.reply(
                self.run, -1, 0, self.peer_id, messages.REJECTED, reason="bad update request"
            )
        encoded = self.state.encoded_update(msg.fragment, msg.round)
        if encoded is None:
            return messages.reply(self.run, msg.round, msg.fragment, self.peer_id, messages.MISSING)
        return encoded

    async def rpc_get_state(self, caller: str, request: bytes) -> bytes:
        """One fragment's global parameters and momentum, for a joining peer."""
        msg = self._parse_request(request, wire.STATE_REQUEST)
        if msg is None:
            return messages.reply(
                self.run, -1, 0, self.peer_id, messages.REJECTED, reason="bad state request"
            )
        loop = asyncio.get_running_loop()
        snapshot = await loop.run_in_executor(None, self.state.export_fragment, msg.fragment)
        fp32 = compress.make_codec("fp32")
        tensors = {f"p/{n}": fp32.encode(t) for n, t in snapshot.params.items()}
        tensors.update({f"m/{n}": fp32.encode(t) for n, t in snapshot.momentum.items()})
        message = wire.Message(
            kind=messages.STATE_REPLY,
            run=self.run,
            round=snapshot.round,
            fragment=snapshot.fragment,
            meta={"peer": self.peer_id, "hash": snapshot.hash},
            tensors=tensors,
        )
        return wire.encode_message(message)

    # --- windows ------------------------------------------------------------------------

    def _window(self, round_id: int, fragment: int) -> Window:
        key = (round_id, fragment)
        window = self.windows.get(key)
        if window is None:
            window = Window(round=round_id, fragment=fragment, opened_at=time.monotonic())
            window.result = asyncio.get_running_loop().create_future()
            self.windows[key] = window
            task = asyncio.create_task(self._run_window(window))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.on_event({"event": "window_open", "round": round_id, "fragment": fragment})
        return window

    async def _run_window(self, window: Window) -> None:
        """Wait for quorum, then grace; close; answer everyone. Never raises."""
        sync = self.config.sync
        deadline = window.opened_at + sync.round_deadline_s
        grace_s = 0.0
        try:
            while True:
                now = time.monotonic()
                arrived = list(window.contributions.values())
                expected = set(learners(self.members())) | set(window.contributions)
                expected_tokens = int(
                    sum(c.tokens for c in arrived) / max(len(arrived), 1) * len(expected)
                )
                if window.quorum_at is None and quorum_met(
                    len(arrived),
                    sum(c.tokens for c in arrived),
                    min_quorum=sync.min_quorum,
                    min_token_fraction=sync.min_token_fraction,
                    expected_tokens=expected_tokens,
                ):
                    window.quorum_at = now
                    step_time = self.step_time.get(
                        max((c.step_time_s for c in arrived), default=0.0)
                    )
                    grace_s = grace_window_s(
                        step_time_s=step_time,
                        overlap_steps=sync.overlap_steps,
                        time_to_quorum_s=now - window.opened_at,
                        sync_time_s=self.sync_time.get(0.0),
                        gamma=sync.grace_gamma,
                        max_grace_s=sync.max_grace_s,
                    )
                    log.info(
                        "quorum round=%d fragment=%d arrived=%d expected=%d grace_s=%.2f",
                        window.round,
                        window.fragment,
                        len(arrived),
                        len(expected),
                        grace_s,
                    )
                if should_close(
                    now=now,
                    quorum_time=window.quorum_at,
                    grace_s=grace_s,
                    num_arrived=len(arrived),
                    num_expected=len(expected),
                ):
                    await self._close(window, grace_s)
                    return
                if window.quorum_at is None:
                    moved_to = self.elected_elsewhere(
                        window.round, window.fragment, window.unreachable
                    )
                    if moved_to:
                        self._move(window, moved_to)
                        return
                if window.quorum_at is None and now >= deadline:
                    log.warning(
                        "no quorum round=%d fragment=%d arrived=%d needed=%d",
                        window.round,
                        window.fragment,
                        len(arrived),
                        sync.min_quorum,
                    )
                    self._finish(
                        window,
                        self._reply(
                            window,
                            messages.NO_QUORUM,
                            reason=f"{len(arrived)} of {sync.min_quorum} learners before the deadline",
                        ),
                    )
                    return
                wake_at = window.quorum_at + grace_s if window.quorum_at is not None else deadline
                window.arrival.clear()
                try:
                    # Re-check at least every second: membership (the expected set) changes too.
                    await asyncio.wait_for(
                        window.arrival.wait(), timeout=min(max(wake_at - now, 0.01), 1.0)
                    )
                except TimeoutError:
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a window fault is a skipped round, not a crash
            log.exception("window failed round=%d fragment=%d", window.round, window.fragment)
            self._finish(
                window, self._reply(window, messages.NO_QUORUM, reason=f"synchronizer fault: {exc}")
            )

    def _move(self, window: Window, moved_to: str) -> None:
        """Close a window without quorum, telling its learners where to resend."""
        log.info(
            "window moved round=%d fragment=%d to=%s arrived=%d",
            window.round,
            window.fragment,
            moved_to[-8:],
            len(window.contributions),
        )
        self.on_event(
            {
                "event": "window_moved",
                "round": window.round,
                "fragment": window.fragment,
                "to": moved_to,
            }
        )
        self._finish(window, self._moved_reply(window.round, window.fragment, moved_to))

    def _reply(self, window: Window, status: str, **meta) -> bytes:
        return messages.reply(self.run, window.round, window.fragment, self.peer_id, status, **meta)

    def _finish(self, window: Window, reply: bytes) -> None:
        self.windows.pop((window.round, window.fragment), None)
        if window.result and not window.result.done():
            window.result.set_result(reply)

    def _screen(self, window: Window) -> tuple[list[Contribution], dict[str, str]]:
        """Contributions that enter the merge, and the reason for each one left out."""
        arrived = list(window.contributions.values())
        norms = [tensor_norm(c.delta) for c in arrived]
        outliers = norm_outliers(norms, self.config.sync.norm_outlier_factor)
        kept, refused = [], {}
        for contribution, norm, outlier in zip(arrived, norms, outliers, strict=True):
            if outlier:
                refused[contribution.peer] = f"delta norm {norm:.3g} is far from the others' median"
            elif contribution.tokens <= 0 or contribution.steps <= 0:
                refused[contribution.peer] = "contribution claims no work"
            else:
                kept.append(contribution)
        return kept, refused

    async def _close(self, window: Window, grace_s: float) -> None:
        started = time.monotonic()
        kept, refused = self._screen(window)
        for peer, reason in refused.items():
            self.num_rejected += 1
            log.warning(
                "rejected contribution peer=%s round=%d fragment=%d reason=%r",
                peer[-8:],
                window.round,
                window.fragment,
                reason,
            )
            self.on_event(
                {
                    "event": "rejected",
                    "peer": peer,
                    "round": window.round,
                    "fragment": window.fragment,
                    "reason": reason,
                }
            )
        if len(kept) < self.config.sync.min_quorum:
            self._finish(
                window, self._reply(window, messages.NO_QUORUM, reason="too few acceptable deltas")
            )
            return
        loop = asyncio.get_running_loop()
        encoded_update, new_hash, weights = await loop.run_in_executor(
            None, self._merge_and_apply, window, kept
        )
        elapsed = time.monotonic() - started
        self.sync_time.update(elapsed)
        for contribution in kept:
            self.step_time.update(contribution.step_time_s)
        contributors = [(c.peer, w, c.tokens) for c, w in zip(kept, weights, strict=True)]
        record = RoundRecord(
            round=window.round,
            fragment=window.fragment,
            synchronizer=self.peer_id,
            hash=new_hash,
            contributors=contributors,
            grace_s=grace_s,
            closed_at=self.transport.now(),
        )
        stored = await self.transport.store(
            messages.rounds_key(self.run, window.fragment),
            str(window.round),
            record.encode(),
            self.transport.now() + ROUND_RECORD_TTL_S,
        )
        log.info(
            "round closed round=%d fragment=%d merged=%d refused=%d grace_s=%.2f sync_s=%.3f hash=%s stored=%s",
            window.round,
            window.fragment,
            len(kept),
            len(refused),
            grace_s,
            elapsed,
            new_hash[:12],
            stored,
        )
        self.on_event(
            {
                "event": "round_closed",
                "round": window.round,
                "fragment": window.fragment,
                "contributors": [c.peer for c in kept],
                "weights": weights,
                "refused": sorted(refused),
                "grace_s": grace_s,
                "hash": new_hash,
            }
        )
        update = wire.decode_message(encoded_update, self.limits)
        assert not isinstance(update, wire.Rejected)
        by_peer = dict(zip((c.peer for c in kept), weights, strict=True))
        reply_bytes = self._reply(
            window,
            messages.MERGED,
            tensors=update.tensors,
            hash=new_hash,
            contributors=[[p, w] for p, w in by_peer.items()],
        )
        self._finish(window, reply_bytes)

    def _merge_and_apply(
        self, window: Window, kept: list[Contribution]
    ) -> tuple[bytes, str, list[float]]:
        """Weights, merge, encode, apply the decoded update here. Runs in a worker thread."""
        outer = self.config.outer
        current = window.round
        weights = token_weights(
            [c.tokens for c in kept],
            [c.steps for c in kept],
            max_share=outer.max_weight_share,
            staleness=[current - c.base_round for c in kept],
            staleness_discount=self.config.sync.staleness_discount,
        )
        embeddings = frozenset(
            n for n in self.state.fragments[window.fragment] if n.startswith("embed.")
        )
        merged = merge(
            outer.merge,
            [c.delta for c in kept],
            weights,
            norm=outer.radial_norm,
            plain_mean_names=embeddings,
        )
        encoded = {name: self.outer_codec.encode(t) for name, t in merged.items()}
        message = wire.Message(
            kind=wire.OUTER_UPDATE,
            run=self.run,
            round=window.round,
            fragment=window.fragment,
            meta={
                "peer": self.peer_id,
                "contributors": [c.peer for c in kept],
                "tokens": sum(c.tokens for c in kept),
            },
            tensors=encoded,
        )
        decoded = {name: compress.decode_tensor(e) for name, e in encoded.items()}
        new_hash = self.state.apply_update(window.fragment, window.round, decoded)
        message.meta["hash"] = new_hash
        frame = wire.encode_message(message)
        self.state.remember_update(window.fragment, window.round, frame)
        return frame, new_hash, weights
