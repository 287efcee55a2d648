"""A learner's side of the network: send a delta with failover, receive and apply updates.

Runs on the peer's event loop, never on the training thread. `contribute` walks the
rendezvous order of (round, fragment): the elected synchronizer first, the next one when
a call fails or times out (failover). Replies carry the round's outer update, which is
applied to the shared `GlobalState`; a learner that is behind fetches the updates it
missed from other peers first. Every fault ends as a logged outcome, never an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2pdiloco import compress, messages, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.election import synchronizer_order
from p2pdiloco.membership import Heartbeat, synchronizer_candidates
from p2pdiloco.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

MAX_CANDIDATES = 3
"""Synchronizers tried for one (round, fragment) before giving up on the window."""
MAX_MOVES = 4
"""`moved` redirects followed for one contribution (a window moves up the order only)."""


def with_unreachable(frame: bytes, unreachable: list[str], limits: wire.WireLimits) -> bytes:
    """The CONTRIBUTION `frame` with `unreachable` set in its meta (failover path only)."""
    message = wire.decode_message(frame, limits)
    if isinstance(message, wire.Rejected):
        return frame
    meta = {**message.meta, "unreachable": list(unreachable)}
    return wire.encode_message(dataclasses.replace(message, meta=meta))


@dataclass(frozen=True)
class Outcome:
    """What became of one contribution."""

    status: str
    """merged, late, no_quorum, rejected, unreachable, behind."""
    round: int
    fragment: int
    synchronizer: str = ""
    weight: float = 0.0
    reason: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    latency_s: float = 0.0
    """From handing the delta to the network to holding the round's result, seconds."""


class LearnerLink:
    """Contributions out, updates in, for one peer."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        config: RunConfig,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
    ) -> None:
        self.transport = transport
        self.run = run
        self.config = config
        self.state = state
        self.members = members
        self.limits = limits
        self._apply_lock = asyncio.Lock()
        self.bytes_received = 0
        self.diverged: set[int] = set()
        """Fragments whose replica no longer matches the swarm: re-download their state."""

    def candidates(self, round_id: int, fragment: int) -> list[str]:
        """Failover order of synchronizers for (round, fragment) in this peer's view."""
        return synchronizer_order(
            self.run, round_id, fragment, synchronizer_candidates(self.members())
        )

    async def contribute(self, fragment: int, target_round: int, frame: bytes) -> Outcome:
        """Send one CONTRIBUTION frame addressed to `target_round`; apply the reply's update.

        Walks the candidates in rendezvous order; a synchronizer that answers `moved` names
        a better-placed one, which is tried next (at most MAX_MOVES times). Candidates that
        could not be reached are listed in the frame, so the next one does not move back.
        """
        # A live synchronizer always answers by its window deadline plus grace and merge
        # time; only a dead or frozen one runs past this (then: failover).
        timeout_s = self.config.sync.round_deadline_s + self.config.sync.max_grace_s + 30.0
        pending = self.candidates(target_round, fragment)[:MAX_CANDIDATES]
        tried: list[str] = []
        unreachable: list[str] = []
        moves = 0
        started = time.monotonic()
        while pending:
            candidate = pending.pop(0)
            tried.append(candidate)
            try:
                raw = await self.transport.call(
                    candidate,
                    f"{self.run}.{messages.RPC_CONTRIBUTE}",
                    frame,
                    timeout_s=timeout_s,
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning(
                    "synchronizer failed peer=%s round=%d fragment=%d error=%r; failing over",
                    candidate[-8:],
                    target_round,
                    fragment,
                    exc,
                )
                unreachable.append(candidate)
                frame = with_unreachable(frame, unreachable, self.limits)
                continue
            self.bytes_received += len(raw)
            reply = wire.decode_message(raw, self.limits)
            if isinstance(reply, wire.Rejected) or reply.kind != messages.CONTRIBUTE_REPLY:
                reason = (
                    reply.reason if isinstance(reply, wire.Rejected) else f"unexpected {reply.kind}"
                )
                log.warning("bad reply peer=%s reason=%r", candidate[-8:], reason)
                continue
            status = reply.meta["status"]
            if status == messages.BEHIND:
                continue
            if status == messages.MOVED:
                moved_to = str(reply.meta.get("moved_to", ""))
                if moves < MAX_MOVES and moved_to and moved_to not in unreachable:
                    moves += 1
                    pending = [moved_to, *(p for p in pending if p != moved_to)]
                continue
            weight = 0.0
            if status == messages.MERGED:
                weight = dict((p, w) for p, w in reply.meta.get("contributors", [])).get(
                    self.transport.peer_id, 0.0
                )
            if status in (messages.MERGED, messages.LATE) and reply.tensors:
                await self.apply(fragment, target_round, reply, source=candidate)
            return Outcome(
                status,
                target_round,
                fragment,
                candidate,
                float(weight),
                str(reply.meta.get("reason", "")),
                len(frame),
                len(raw),
                time.monotonic() - started,
            )
        return Outcome(
            "unreachable", target_round, fragment, reason=f"tried {len(tried)} synchronizers"
        )

    async def apply(
        self, fragment: int, round_id: int, update: wire.Message, source: str = ""
    ) -> bool:
        """Apply the update of (round_id, fragment) once, catching up first if behind."""
        async with self._apply_lock:
            current = self.state.round_of(fragment)
            if current > round_id:
                return True  # already applied (e.g. we were its synchronizer)
            if current < round_id and not await self._catch_up(
                fragment, round_id, preferred=source
            ):
                return False
            return self._apply_now(fragment, round_id, update)

    def _apply_now(self, fragment: int, round_id: int, update: wire.Message) -> bool:
        try:
            decoded = compress.decode_tensors(update.tensors)
            new_hash = self.state.apply_update(fragment, round_id, decoded)
        except ValueError as exc:
            log.warning(
                "update refused round=%d fragment=%d reason=%r", round_id, fragment, str(exc)
            )
            return False
        expected = update.meta.get("hash")
        if expected and expected != new_hash:
            log.error(
                "replica diverged round=%d fragment=%d ours=%s theirs=%s",
                round_id,
                fragment,
                new_hash[:12],
                str(expected)[:12],
            )
            self.diverged.add(fragment)
        if isinstance(update.meta.get("hash"), str):
            self.state.remember_update(fragment, round_id, wire.encode_message(update))
        log.info("applied update round=%d fragment=%d hash=%s", round_id, fragment, new_hash[:12])
        return True

    async def fetch_update(
        self, fragment: int, round_id: int, preferred: str = ""
    ) -> wire.Message | None:
        """The update of (round_id, fragment) from any live peer that keeps it."""
        request = wire.encode_message(
            wire.Message(
                kind=messages.UPDATE_REQUEST,
                run=self.run,
                round=round_id,
                fragment=fragment,
                meta={"peer": self.transport.peer_id},
            )
        )
        peers = [p for p in synchronizer_candidates(self.members()) if p != self.transport.peer_id]
        if preferred in peers:
            peers.remove(preferred)
            peers.insert(0, preferred)
        for peer in peers:
            try:
                raw = await self.transport.call(
                    peer,
                    f"{self.run}.{messages.RPC_GET_UPDATE}",
                    request,
                    timeout_s=30.0,
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError:
                continue
            self.bytes_received += len(raw)
            msg = wire.decode_message(raw, self.limits)
            if (
                isinstance(msg, wire.Rejected)
                or msg.kind != wire.OUTER_UPDATE
                or msg.round != round_id
                or msg.fragment != fragment
            ):
                continue
            return msg
        return None

    async def _catch_up(self, fragment: int, target: int, preferred: str = "") -> bool:
        """Fetch and apply the updates between our round and `target` (exclusive)."""
        while (current := self.state.round_of(fragment)) < target:
            update = await self.fetch_update(fragment, current, preferred)
            if update is None:
                log.warning(
                    "cannot catch up fragment=%d round=%d: no peer keeps the update",
                    fragment,
                    current,
                )
                return False
            if not self._apply_now(fragment, current, update):
                return False
        return True

    async def catch_up_to(self, fragment: int, target: int) -> bool:
        """Public catch-up (the maintenance loop calls it when round records run ahead)."""
        async with self._apply_lock:
            return await self._catch_up(fragment, target)
