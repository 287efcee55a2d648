"""What a replica serves: update frames (held before a commit, kept after it) and a
fragment's whole state in parts, for joiners and repairing peers.

- `hold_update`: a synchronizer pushes its update frame here *before* committing; this
  peer validates and holds it (not applied: only a round record commits it), only from a
  peer the round's election could have picked, and apart from the frames it keeps, a
  few per sender (`hold_refusal`, `ServedFrames`);
- `get_update`: a kept frame, byte for byte, by digest (or the latest of a round);
- `get_state`: one part of a fragment's state, all parts of a download from one snapshot.

Every reader is a stranger: `get_state` parts and `get_update` frames
are rate-limited per caller (a token bucket each), and a state part is copied and encoded
on a thread of its own, at most `MAX_STATE_JOBS` at once (past that: refused, "busy"),
never on the worker that merges and applies, so a reader cannot delay a round.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.outer.fragment_state import FragmentState
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.rounds import sign_receipt
from p2pdiloco.roles import peer_records
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport
from p2pdiloco.transport.ratelimit import RateLimiter
from p2pdiloco.wire import messages
from p2pdiloco.wire.state_transfer import encode_part, part_budget, part_count
from p2pdiloco.wire.updates import Update, UpdateStore, parse_update

log = logging.getLogger(__name__)

STATE_REFILL_S = 30.0
"""A caller may download the whole state once every this many seconds (after a burst of
two downloads): what a joiner or a repairing peer needs, and a bound on what a flood costs."""
MAX_STATE_JOBS = 2
"""State parts copied or encoded at once, from all callers; past this a request is refused
at once ("busy": the joiner tries another donor), never queued."""
UPDATE_FETCHES_PER_S = 2.0
"""Update frames per fragment per second one caller may fetch, sustained (rounds close
seconds apart; a lagging peer catching up spends the burst)."""


MAX_HELD_PER_SENDER = 2
"""Frames one synchronizer may have held here per fragment (its round, and a re-run): a
further one replaces its own oldest, never another sender's."""
MAX_HELD_PER_FRAGMENT = 16
"""Held frames per fragment from all senders (the first `HOLD_FAILOVER_DEPTH` of the
order for each of the rounds `hold_refusal` admits); past it the sender holding the most
loses its oldest, so one with a single frame (the honest case) loses it last."""
HOLD_FAILOVER_DEPTH = 4
"""A frame is held only from a peer among the first this many of the round's
synchronizer order (the elected one and its failovers), as this peer sees the members."""
HOLD_ROUNDS_AHEAD = 2
"""A frame is held for rounds from the fragment's current one - 1 to this many ahead (a
holder lagging a round or two behind its synchronizer still holds)."""
RECORD_READS_PER_S = 2.0
"""`get_records` answered per caller and fragment per second, on average (a replica asks
at most once per sync pass, one pass per beat)."""


def hold_refusal(
    run: str, round_id: int, fragment: int, caller: str, current_round: int, candidates: list[str]
) -> str:
    """Why a `hold_update` from `caller` for (round, fragment) is refused ("": held).

    Only the round's synchronizer pushes its update before committing, so only a peer the
    election could have picked for a round near ours: among the first
    `HOLD_FAILOVER_DEPTH` of `synchronizer_order` over the candidates this peer sees plus
    the caller (a synchronizer missing from our view is ranked as if it were in it). Any
    identity used to be held, and a flood evicted genuine frames.
    """
    if not current_round - 1 <= round_id <= current_round + HOLD_ROUNDS_AHEAD:
        return f"round {round_id} is not near this replica's {current_round}"
    order = synchronizer_order(run, round_id, fragment, [*candidates, caller])
    if caller not in order[:HOLD_FAILOVER_DEPTH]:
        return "caller is not a synchronizer of this round"
    return ""


class ServedFrames(UpdateStore):
    """The frames a replica serves: those it keeps (its own, fetched, committed) and, apart
    and bounded per sender, those held for synchronizers before their commit, so frames
    pushed to hold can never evict a frame it keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, OrderedDict[str, tuple[str, Update]]] = {}
        """Per fragment, digest -> (sender, frame), oldest first."""

    def hold(self, update: Update, sender: str) -> None:
        """Hold `update` for `sender` (its synchronizer), within the quotas."""
        held = self.held.setdefault(update.fragment, OrderedDict())
        held[update.digest] = (sender, update)
        held.move_to_end(update.digest)
        own = [d for d, (s, _) in held.items() if s == sender]
        for digest in own[: max(0, len(own) - MAX_HELD_PER_SENDER)]:
            del held[digest]
        while len(held) > MAX_HELD_PER_FRAGMENT:
            counts = Counter(s for s, _ in held.values())
            most = max(counts.values())
            oldest = next(d for d, (s, _) in held.items() if counts[s] == most)
            del held[oldest]

    def put(self, update: Update) -> None:
        """Keep `update` (it was committed, fetched or is our own): a held copy moves into
        the kept frames and their bounds, so held frames are only those not committed yet."""
        super().put(update)
        self.held.get(update.fragment, {}).pop(update.digest, None)

    def get(self, fragment: int, digest: str) -> Update | None:
        kept = super().get(fragment, digest)
        if kept is not None:
            return kept
        held = self.held.get(fragment, {}).get(digest)
        return None if held is None else held[1]

    def of_round(self, fragment: int, round_id: int) -> list[Update]:
        held = [u for _, u in self.held.get(fragment, {}).values() if u.round == round_id]
        kept = super().of_round(fragment, round_id)
        return held + [u for u in kept if u.digest not in {h.digest for h in held}]


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
        self.store = ServedFrames()
        self.synchronizers: Callable[[], list[str]] = lambda: []
        """The peers this replica sees as synchronizer candidates (`hold_refusal`)."""
        self.named: Callable[[], frozenset[str]] = frozenset
        """The peers the chain named (set by the replica): a synchronizer missing from this
        view may still push a hold; any other caller outside the candidates may not."""
        self.records: Callable[[int, int], list[bytes]] = lambda fragment, from_round: []
        """The sealed records this peer holds of (fragment) from a round on (set by the
        replica: `peer_records.served` over what it read)."""
        self.records_limiter = RateLimiter(rate_per_s=RECORD_READS_PER_S * state.num_fragments, burst=8 * state.num_fragments)
        """`get_records` answered per caller."""
        self._serving: dict[int, FragmentState] = {}
        """Per fragment, the snapshot whose parts are being served (replaced once stale)."""
        self.state_limiter = RateLimiter(rate_per_s=1 / STATE_REFILL_S, burst=2 * state.num_fragments + 2)
        """New snapshots (a first part) per caller."""
        parts = self.state_parts()
        self.part_limiter = RateLimiter(rate_per_s=parts / STATE_REFILL_S, burst=2 * parts)
        """Every part per caller: two whole downloads at once, then one per STATE_REFILL_S."""
        self.update_limiter = RateLimiter(
            rate_per_s=UPDATE_FETCHES_PER_S * state.num_fragments,
            burst=2 * self.store.max_per_fragment * state.num_fragments + 8,
        )
        """Frames served per caller (a miss is free)."""
        self.state_jobs = 0
        """State parts being copied or encoded now (at most MAX_STATE_JOBS)."""
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2pdiloco-serve")
        """Copies and encodes state parts, beside the worker that merges and applies (the
        copy takes the state's lock, so it sees one consistent state)."""

    def state_parts(self) -> int:
        """Parts of the whole state (parameters, momentum and sums of every fragment), at most."""
        budget = part_budget(self.limits)
        return sum(math.ceil(3 * size / budget) + 2 for size in self.state.sizes)

    async def start(self) -> None:
        for name, handler, max_request in (
            (messages.RPC_HOLD_UPDATE, self.rpc_hold_update, self.limits.max_frame_bytes),
            (messages.RPC_GET_UPDATE, self.rpc_get_update, 1 << 16),
            (messages.RPC_GET_STATE, self.rpc_get_state, 1 << 16),
            (peer_records.RPC_GET_RECORDS, self.rpc_get_records, 1 << 12),
        ):
            await self.transport.register_handler(f"{self.run}.{name}", handler, max_request)

    def _reply(self, round_id: int, fragment: int, status: str, **meta: object) -> bytes:
        return messages.reply(self.run, round_id, fragment, self.transport.peer_id, status, **meta)

    async def rpc_hold_update(self, caller: str, request: bytes) -> bytes:
        """A synchronizer asks us to hold its update before it commits the round."""
        update = parse_update(request, self.limits, self.run, self.state.layouts)
        if isinstance(update, wire.Rejected):
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], update.reason)
            return self._reply(-1, 0, messages.Reply.REJECTED, reason=update.reason)
        candidates = self.synchronizers()
        if update.synchronizer != caller:
            reason = "update names another synchronizer"
        elif caller not in candidates and caller not in self.named():
            reason = "caller may not synchronize"
        else:
            reason = hold_refusal(
                self.run, update.round, update.fragment, caller, self.state.round_of(update.fragment), candidates
            )
        if reason:
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], reason)
            return self._reply(update.round, update.fragment, messages.Reply.REJECTED, reason=reason)
        self.store.hold(update, caller)
        receipt = sign_receipt(self.transport.identity, self.run, update.round, update.fragment, update.digest)
        return self._reply(update.round, update.fragment, messages.Reply.HELD, digest=update.digest, receipt=receipt)

    async def rpc_get_records(self, caller: str, request: bytes) -> bytes:
        """The round records this peer holds of a fragment from a round on
        (`peer_records`: a replica asks a peer three passes in four, not the DHT key)."""
        msg = self._small_request(request, peer_records.RECORDS_REQUEST)
        if isinstance(msg, bytes):
            return msg
        if not self.records_limiter.allow(caller):
            log.warning("rpc_rejected reason=rate_limited name=get_records caller=%s", caller[-8:])
            return self._reply(msg.round, msg.fragment, messages.Reply.REJECTED, reason="get_records rate limited")
        sealed = self.records(msg.fragment, msg.round)
        return peer_records.records_reply(self.run, msg.fragment, self.transport.peer_id, sealed)

    def _small_request(self, request: bytes, kind: str) -> wire.Message | bytes:
        """A valid request of `kind` for one of our fragments, or the rejection to answer."""
        msg = wire.decode_message(request, self.limits)
        if isinstance(msg, wire.Rejected) or msg.kind != kind or not 0 <= msg.fragment < self.state.num_fragments:
            return self._reply(0, 0, messages.Reply.REJECTED, reason=f"bad {kind}")
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
            return self._reply(msg.round, msg.fragment, messages.Reply.MISSING)
        if not self.update_limiter.allow(caller):
            log.warning("rpc_rejected reason=rate_limited name=get_update caller=%s", caller[-8:])
            return self._reply(msg.round, msg.fragment, messages.Reply.REJECTED, reason="get_update rate limited")
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
        if self.state_jobs >= MAX_STATE_JOBS:
            log.info("rpc_rejected reason=busy name=get_state caller=%s", caller[-8:])
            return self._reply(0, 0, messages.Reply.REJECTED, reason="get_state busy")
        if not self.part_limiter.allow(caller) or ((part == 0 or not fresh) and not self.state_limiter.allow(caller)):
            log.warning("rpc_rejected reason=rate_limited name=get_state caller=%s", caller[-8:])
            return self._reply(0, 0, messages.Reply.REJECTED, reason="get_state rate limited")
        self.state_jobs += 1
        try:
            loop = asyncio.get_running_loop()
            frame = await loop.run_in_executor(self.encoder, self._encode_state, msg.fragment, part)
        finally:
            self.state_jobs -= 1
        if frame is None:
            return self._reply(msg.round, msg.fragment, messages.Reply.REJECTED, reason=f"no part {part}")
        return frame

    def _encode_state(self, fragment: int, part: int) -> bytes | None:
        """Part `part` of the fragment's current snapshot (the encoder thread)."""
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
