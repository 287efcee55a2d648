"""What a replica serves: update frames (held before a commit, kept after it) and a
fragment's whole state in parts, for joiners and repairing peers.

- `hold_update`: a synchronizer pushes its update frame here *before* committing; this
  peer validates and keeps it (not applied: only a round record commits it);
- `get_update`: a kept frame, byte for byte, by digest (or the latest of a round);
- `get_state`: one part of a fragment's state, all parts of a download from one snapshot.

Encoding a part runs on the worker thread; a first part (what costs) is rate-limited per
caller.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.outer.fragment import FragmentState
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport
from p2pdiloco.transport.ratelimit import RateLimiter
from p2pdiloco.wire import messages
from p2pdiloco.wire.state_transfer import encode_part, part_count
from p2pdiloco.wire.updates import Update, UpdateStore, parse_update

log = logging.getLogger(__name__)


class UpdateServer:
    """Holds update frames and serves them, and the state, to other peers."""

    def __init__(
        self, transport: Transport, run: str, state: GlobalState, limits: wire.WireLimits, worker: ThreadPoolExecutor
    ) -> None:
        self.transport = transport
        self.run = run
        self.state = state
        self.limits = limits
        self.worker = worker
        self.store = UpdateStore()
        self._serving: dict[int, FragmentState] = {}
        """Per fragment, the snapshot whose parts are being served (replaced once stale)."""
        self.state_limiter = RateLimiter(rate_per_s=1 / 30, burst=2 * state.num_fragments + 2)

    async def start(self) -> None:
        for name, handler, max_request in (
            (messages.RPC_HOLD_UPDATE, self.rpc_hold_update, self.limits.max_frame_bytes),
            (messages.RPC_GET_UPDATE, self.rpc_get_update, 1 << 16),
            (messages.RPC_GET_STATE, self.rpc_get_state, 1 << 16),
        ):
            await self.transport.register_handler(f"{self.run}.{name}", handler, max_request)

    def _reply(self, round_id: int, fragment: int, status: str, **meta: object) -> bytes:
        return messages.reply(self.run, round_id, fragment, self.transport.peer_id, status, **meta)

    async def rpc_hold_update(self, caller: str, request: bytes) -> bytes:
        """A synchronizer asks us to hold its update before it commits the round."""
        update = parse_update(request, self.limits, self.run, self.state.layouts)
        if isinstance(update, wire.Rejected):
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], update.reason)
            return self._reply(-1, 0, messages.REJECTED, reason=update.reason)
        if update.synchronizer != caller:
            reason = "update names another synchronizer"
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], reason)
            return self._reply(update.round, update.fragment, messages.REJECTED, reason=reason)
        self.store.put(update)
        return self._reply(update.round, update.fragment, messages.HELD, digest=update.digest)

    def _small_request(self, request: bytes, kind: str) -> wire.Message | bytes:
        """A valid request of `kind` for one of our fragments, or the rejection to answer."""
        msg = wire.decode_message(request, self.limits)
        if isinstance(msg, wire.Rejected) or msg.kind != kind or not 0 <= msg.fragment < self.state.num_fragments:
            return self._reply(0, 0, messages.REJECTED, reason=f"bad {kind}")
        return msg

    async def rpc_get_update(self, caller: str, request: bytes) -> bytes:
        """The update frame of (round, fragment) with the requested digest, byte for byte."""
        msg = self._small_request(request, messages.UPDATE_REQUEST)
        if isinstance(msg, bytes):
            return msg
        digest = msg.meta.get("digest")
        if isinstance(digest, str) and digest:
            update: Update | None = self.store.get(msg.fragment, digest)
        else:
            found = self.store.of_round(msg.fragment, msg.round)
            update = found[-1] if found else None
        if update is None:
            return self._reply(msg.round, msg.fragment, messages.MISSING)
        return update.frame

    async def rpc_get_state(self, caller: str, request: bytes) -> bytes:
        """One part of one fragment's global parameters and optimizer state, for a joiner.

        The parts of one download come from one snapshot (kept while it is current), so
        they agree. Rate-limited per caller on what costs: a first part or a new snapshot
        (a small request costs ~12 bytes a parameter to answer)."""
        msg = self._small_request(request, wire.STATE_REQUEST)
        if isinstance(msg, bytes):
            return msg
        part = int(msg.meta.get("part", 0))
        cached = self._serving.get(msg.fragment)
        fresh = cached is not None and cached.round == self.state.round_of(msg.fragment)
        if (part == 0 or not fresh) and not self.state_limiter.allow(caller):
            log.warning("rpc_rejected reason=rate_limited name=get_state caller=%s", caller[-8:])
            return self._reply(0, 0, messages.REJECTED, reason="get_state rate limited")
        loop = asyncio.get_running_loop()
        frame = await loop.run_in_executor(self.worker, self._encode_state, msg.fragment, part)
        if frame is None:
            return self._reply(msg.round, msg.fragment, messages.REJECTED, reason=f"no part {part}")
        return frame

    def _encode_state(self, fragment: int, part: int) -> bytes | None:
        """Part `part` of the fragment's current snapshot (worker thread)."""
        snapshot = self._serving.get(fragment)
        if snapshot is None or snapshot.round != self.state.round_of(fragment):
            snapshot = self._serving[fragment] = self.state.export_fragment(fragment)
        frame = encode_part(self.run, self.transport.peer_id, snapshot, part, self.limits)
        if part == part_count(snapshot, self.limits) - 1:
            # the last part served: the copy (8-12 bytes a parameter) goes until the next
            # download; a joiner still reading an earlier part gets a fresh snapshot and
            # refuses the mix (PartsAssembler), then starts over
            self._serving.pop(fragment, None)
        return frame
