"""Keep this peer's replica on the canonical chain: hold, serve, fetch, apply, repair.

One module owns everything that moves committed updates between replicas:

- `rpc_hold_update`: a synchronizer pushes its update frame here *before* committing;
  this peer validates and keeps it (not applied: only a round record commits it);
- `rpc_get_update` / `rpc_get_state`: serve kept update frames byte for byte, and a
  fragment's full state to joiners and repairing peers;
- `sync_fragment`: read the fragment's round records, pick the canonical chain
  (`rounds.canonical_chain`), apply its updates in order (fetched by digest from the
  record's holders, its synchronizer or any live peer), and repair by state download
  when this replica sits on a losing branch or is too far behind.

All heavy work (decode, outer step, hash, export, import) runs on one worker thread,
never on the event loop; every network wait has a deadline. Faults are logged and the
round is retried on the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from p2pdiloco import wire
from p2pdiloco.outer.fragment import FragmentState, outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.membership import Heartbeat, synchronizer_candidates
from p2pdiloco.protocol.rounds import RoundRecord, canonical_chain, records_of, rounds_key
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError, transfer_timeout_s
from p2pdiloco.transport.ratelimit import RateLimiter
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import (
    MISMATCH,
    NOTICE_TTL_S,
    OK,
    UNVERIFIABLE,
    Auditor,
    AuditResult,
    FraudNotice,
    notice_subkey,
    notices_key,
    open_notice,
    seal_notice,
)
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import decode_contribution_list, encode_audit_request
from p2pdiloco.wire.state_transfer import (
    MAX_PART_ELEMENTS,
    PartsAssembler,
    decode_part,
    encode_part,
    part_count,
)
from p2pdiloco.wire.updates import Update, UpdateStore, parse_update

log = logging.getLogger(__name__)

SUSPICION_FACTOR = 3.0
"""An update whose outer gradient is this many times the median norm of the last applied
ones is always audited before it is applied, whatever the sampled share."""
NORM_HISTORY = 8
MIN_NORM_HISTORY = 3


FETCH_TIMEOUT_S = 30.0
"""Deadline of one `get_update` call, seconds, plus its expected bytes (int8: about one a
parameter) at the slowest expected link (`transfer_timeout_s`)."""
STATE_TIMEOUT_S = 120.0
"""Deadline of one `get_state` call, seconds, plus a whole part (fp32) at that link."""
MAX_FETCH_PEERS = 6
"""Peers asked for one update before this sync pass gives up on it."""
MAX_CATCH_UP_ROUNDS = 8
"""Behind by more rounds than this: download the fragment's state instead of replaying."""


class ResultMismatch(ValueError):
    """An update whose result does not hash to what its round record signs."""


class ReplicaSync:
    """Serves and follows the canonical chain of every fragment for one peer."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        worker: ThreadPoolExecutor,
        void_after_s: float,
        on_event: Callable[[dict], None] = lambda event: None,
        rivals_visible: Callable[[int], bool] = lambda round_id: True,
        admission: Admission | None = None,
        auditor: Auditor | None = None,
        audit_share: float = 0.0,
    ) -> None:
        self.transport = transport
        self.rivals_visible = rivals_visible
        """Whether records of others are followed at a round (off only under the
        split-view fault injection, which makes this peer commit a round alone)."""
        self.admission = admission or Admission()
        self.auditor = auditor
        self._serving: dict[int, FragmentState] = {}
        """Per fragment, the snapshot whose parts are being served (replaced once stale)."""
        self.state_limiter = RateLimiter(rate_per_s=1 / 30, burst=2 * state.num_fragments + 2)
        self.audit_share = audit_share
        """Expected audits of each round across the swarm: each peer that applies a round
        recomputes it with probability `audit_share / contributors` (see security.md)."""
        self.recent_norms = [deque(maxlen=NORM_HISTORY) for _ in state.fragments]
        """Outer-gradient norms of the last applied updates, per fragment (the same on
        every replica: they follow the same chain)."""
        self.banned: dict[str, int] = {}
        """Synchronizers proven to have published a false merge, with the round of the
        first proven lie: not elected again, and none of their records from then on count
        (earlier ones were applied and checked like any other)."""
        self._notices_seen: set[str] = set()
        self.run = run
        self.state = state
        self.members = members
        self.limits = limits
        self.worker = worker
        self.void_after_s = void_after_s
        self.on_event = on_event
        self.store = UpdateStore()
        self.shapes = [
            {n: tuple(state.params[n].shape) for n in names} for names in state.fragments
        ]
        self.genesis = [state.current_hash(f) for f in range(state.num_fragments)]
        self._sizes = [sum(math.prod(shape) for shape in shapes.values()) for shapes in self.shapes]
        self.chains: list[dict[int, RoundRecord]] = [{} for _ in state.fragments]
        """The canonical chain of each fragment as last read from the DHT."""
        self.applied: list[dict[int, str]] = [{} for _ in state.fragments]
        """Digest of the update this replica applied for each round (chain bookkeeping)."""
        self.void: set[str] = set()
        """Digests of committed updates nobody could serve for `void_after_s`: skipped."""
        self._unfetchable_since: dict[str, float] = {}
        self._locks = [asyncio.Lock() for _ in state.fragments]
        self.bytes_received = 0
        self.on_committed: list[Callable[[int, int, RoundRecord], None]] = []
        """Called as `(fragment, round, record)` with the canonical record of each round
        this replica passed, as read from the DHT (again if it changes), so learners
        settle their deltas by what the swarm committed, not by what one peer said."""
        self._notified: list[dict[int, str]] = [{} for _ in state.fragments]

    # --- serving ------------------------------------------------------------------------

    async def start(self) -> None:
        max_update = self.limits.max_frame_bytes
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_HOLD_UPDATE}", self.rpc_hold_update, max_update
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_UPDATE}", self.rpc_get_update, 1 << 16
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_STATE}", self.rpc_get_state, 1 << 16
        )

    def keep(self, update: Update) -> None:
        """Keep an update frame to serve (this peer's own, or one pushed or fetched)."""
        self.store.put(update)

    async def rpc_hold_update(self, caller: str, request: bytes) -> bytes:
        """A synchronizer asks us to hold its update before it commits the round."""
        update = parse_update(request, self.limits, self.run, self.shapes)
        if isinstance(update, wire.Rejected):
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], update.reason)
            return messages.reply(
                self.run, -1, 0, self.transport.peer_id, messages.REJECTED, reason=update.reason
            )
        if update.synchronizer != caller:
            reason = "update names another synchronizer"
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], reason)
            return messages.reply(
                self.run, update.round, update.fragment, self.transport.peer_id,
                messages.REJECTED, reason=reason,
            )
        self.keep(update)
        return messages.reply(
            self.run, update.round, update.fragment, self.transport.peer_id, messages.HELD,
            digest=update.digest,
        )

    def _small_request(self, request: bytes, kind: str) -> wire.Message | bytes:
        """A valid request of `kind` for one of our fragments, or the rejection to answer."""
        msg = wire.decode_message(request, self.limits)
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != kind
            or not 0 <= msg.fragment < self.state.num_fragments
        ):
            return messages.reply(
                self.run, 0, 0, self.transport.peer_id, messages.REJECTED, reason=f"bad {kind}"
            )
        return msg

    async def rpc_get_update(self, caller: str, request: bytes) -> bytes:
        """The update frame of (round, fragment) with the requested digest, byte for byte."""
        msg = self._small_request(request, messages.UPDATE_REQUEST)
        if isinstance(msg, bytes):
            return msg
        digest = msg.meta.get("digest")
        if isinstance(digest, str) and digest:
            update = self.store.get(msg.fragment, digest)
        else:
            found = self.store.of_round(msg.fragment, msg.round)
            update = found[-1] if found else None
        if update is None:
            return messages.reply(
                self.run, msg.round, msg.fragment, self.transport.peer_id, messages.MISSING
            )
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
            return messages.reply(
                self.run, 0, 0, self.transport.peer_id, messages.REJECTED, reason="get_state rate limited"
            )
        loop = asyncio.get_running_loop()
        frame = await loop.run_in_executor(self.worker, self._encode_state, msg.fragment, part)
        if frame is None:
            return messages.reply(
                self.run, msg.round, msg.fragment, self.transport.peer_id, messages.REJECTED,
                reason=f"no part {part}",
            )
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

    # --- who is entitled -----------------------------------------------------------------

    def may_synchronize(self, beat: Heartbeat) -> bool:
        """Whether the run entitles this live peer to be elected synchronizer."""
        if beat.peer_id in self.banned:
            return False
        refusal = self.admission.synchronizer_refusal(
            self.run, beat.peer_id, beat.certificates, self.transport.now()
        )
        return refusal is None

    def entitled(self, record: RoundRecord) -> bool:
        """Whether the run entitled the record's synchronizer to commit it."""
        if record.round >= self.banned.get(record.synchronizer, record.round + 1):
            return False
        refusal = self.admission.synchronizer_refusal(
            self.run, record.synchronizer, record.certificates, record.closed_at
        )
        return refusal is None

    # --- reading the chain --------------------------------------------------------------

    async def read_chain(self, fragment: int) -> dict[int, RoundRecord]:
        """The canonical chain of `fragment` from the DHT records (bounded by the transport)."""
        raw = await self.transport.get(rounds_key(self.run, fragment))
        records = records_of(self.run, raw, fragment, self.entitled).values()
        chain = canonical_chain(self.run, records, self.genesis[fragment], frozenset(self.void))
        self.chains[fragment] = chain
        return chain

    def parent_hash(self, fragment: int, round_id: int) -> str | None:
        """The fragment's hash before round `round_id` on this replica (None if unknown)."""
        if round_id == 0:
            return self.genesis[fragment]
        # applied_hashes holds the hash after each applied round: no hashing on the loop
        return self.state.applied_hashes[fragment].get(round_id - 1)

    async def install_own(self, record: RoundRecord, update: Update, advanced: FragmentState, norm: float) -> bool:
        """Install a result this peer committed as synchronizer (no decode, no fetch, no hash:
        `advanced` is the `outer_update` whose hash the record signs)."""
        fragment = record.fragment
        async with self._locks[fragment]:
            self.keep(update)
            self.chains[fragment][record.round] = record
            loop = asyncio.get_running_loop()
            installed = await loop.run_in_executor(self.worker, self.state.install, advanced, update.parent)
            if installed:
                self.applied[fragment][record.round] = record.digest
                self.recent_norms[fragment].append(norm)
            return installed

    def committed(self, fragment: int, round_id: int) -> RoundRecord | None:
        """The canonical record of (round, fragment) as last read, if any."""
        return self.chains[fragment].get(round_id)

    def contributors_of(self, fragment: int, round_id: int) -> dict[str, float] | None:
        """Peer -> merge weight of the record this replica applied (or last read) for the
        round, or None when none is known (any thread: one dict read)."""
        record = self.chains[fragment].get(round_id)
        return None if record is None else {c[0]: float(c[1]) for c in record.contributors}

    def _on_canonical_branch(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """True unless some round this replica applied differs from the chain's record."""
        if any(digest in self.void for digest in self.applied[fragment].values()):
            return False  # we applied an update since proven false
        ours = self.state.applied_hashes[fragment]
        for round_id, record in chain.items():
            if round_id in ours and ours[round_id] != record.hash:
                return False
        current = self.state.round_of(fragment)
        if current > 0 and current - 1 in chain and (current - 1) not in ours:
            return False
        return True

    # --- following the chain ------------------------------------------------------------

    async def sync_fragment(self, fragment: int, chain: dict[int, RoundRecord] | None = None) -> bool:
        """Bring `fragment` to the head of its canonical chain; True when there."""
        async with self._locks[fragment]:
            if not self.rivals_visible(self.state.round_of(fragment)):
                return False
            if chain is None:
                chain = await self.read_chain(fragment)
            if not chain:
                return True
            head = max(chain) + 1
            if not self._on_canonical_branch(fragment, chain):
                log.warning("replica on a losing branch fragment=%d: repairing", fragment)
                self.on_event({"event": "repair", "fragment": fragment})
                if not await self._download(fragment, chain):
                    return False
            current = self.state.round_of(fragment)
            if head - current > MAX_CATCH_UP_ROUNDS or (current < head and current not in chain):
                if not await self._download(fragment, chain):
                    return False
            while (current := self.state.round_of(fragment)) < head:
                if await self._apply_record(chain[current]):
                    continue
                # An old update nobody holds any more (update stores are bounded by bytes,
                # a `150m` peer keeps ~3): the state instead, verified by hash like any.
                if not (chain[current].digest in self._unfetchable_since and head - current >= 2
                        and await self._download(fragment, chain)):  # fmt: skip
                    self._notify_settled(fragment, chain)
                    return False
            self._notify_settled(fragment, chain)
            return True

    async def apply_committed(self, record: RoundRecord, hint: Update | None = None) -> bool:
        """Apply the committed round `record` (e.g. named in a synchronizer's reply)."""
        fragment = record.fragment
        if hint is not None:
            self.keep(hint)
        async with self._locks[fragment]:
            if self.state.round_of(fragment) > record.round:
                return self.state.applied_hashes[fragment].get(record.round) == record.hash
            if self.state.round_of(fragment) == record.round and (
                record.parent == self.parent_hash(fragment, record.round)
            ):
                self.chains[fragment].setdefault(record.round, record)
                return await self._apply_record(record)
        # behind, or the record is not on our branch: follow the DHT's canonical chain
        return await self.sync_fragment(fragment)

    async def _apply_record(self, record: RoundRecord) -> bool:
        update = await self._fetch(record)
        if update is None:
            return False
        # the record applied is the one a learner asks about once the round is passed
        self.chains[record.fragment][record.round] = record
        loop = asyncio.get_running_loop()
        try:
            decoded = await loop.run_in_executor(self.worker, update.decode)
        except ValueError as exc:
            return self._refuse(record, f"update does not decode: {exc}")
        norm = await loop.run_in_executor(self.worker, tensor_norm, decoded)
        if self._should_audit(record, norm):
            snapshot = self.state.export_fragment(record.fragment)
            result = await self.audit(record, snapshot)
            if result.verdict == MISMATCH:
                await self._convict(record, result.reason)
                return False
        try:
            await loop.run_in_executor(self.worker, self._apply, update, decoded, record.hash)
        except ResultMismatch as exc:
            # a lie of the synchronizer, or this replica left the chain unnoticed
            self.on_event({"event": "diverged", "fragment": record.fragment, "round": record.round})
            return self._refuse(record, str(exc))
        except ValueError as exc:
            return self._refuse(record, str(exc))
        self.applied[record.fragment][record.round] = record.digest
        self.recent_norms[record.fragment].append(norm)
        return True

    def _refuse(self, record: RoundRecord, reason: str) -> bool:
        """A committed update this replica cannot apply: skipped from now on (False)."""
        log.warning("update refused round=%d fragment=%d reason=%r", record.round, record.fragment, reason)
        self.void.add(record.digest)
        return False

    def _apply(self, update: Update, decoded: dict[str, torch.Tensor], signed_hash: str) -> None:
        """Apply one decoded update (worker thread): the one hash taken is the result's.

        The result is computed on a copy first: an update whose result does not hash to
        its record's signed hash never touches the replica. The parent is checked against
        the hash this replica recorded when it reached the round, not hashed again.
        """
        if self.state.current_hash(update.fragment) != update.parent:
            raise ValueError("update's parent is not this replica's state")
        advanced = outer_update(self.state.export_fragment(update.fragment), decoded, self.state.outer)
        if advanced.hash != signed_hash:
            raise ResultMismatch("update's result does not match its record's signed hash")
        if not self.state.install(advanced, update.parent):
            raise ValueError("replica moved during the update")

    # --- audits ---------------------------------------------------------------------------

    def _should_audit(self, record: RoundRecord, norm: float) -> bool:
        """Sampled (`audit_share` audits a round, spread over its contributors), and always
        when the update is out of line with the last ones: a lie big enough to hurt is
        checked by every peer before it is applied."""
        if self.auditor is None or record.synchronizer == self.transport.peer_id:
            return False
        recent = self.recent_norms[record.fragment]
        if len(recent) >= MIN_NORM_HISTORY and norm > SUSPICION_FACTOR * statistics.median(recent):
            log.info(
                "update out of line round=%d fragment=%d norm=%.4g median=%.4g: auditing",
                record.round, record.fragment, norm, statistics.median(recent),
            )
            return True
        return random.random() < self.audit_share / max(1, len(record.contributions))

    async def fetch_contributions(self, record: RoundRecord) -> list[bytes] | None:
        """The signed contributions of `record`'s round, from its synchronizer (None: not served)."""
        expected = len(record.contributions) + len(record.refused)
        try:
            raw = await self.transport.call(
                record.synchronizer,
                f"{self.run}.{messages.RPC_GET_CONTRIBUTIONS}",
                encode_audit_request(record.round, record.fragment),
                timeout_s=FETCH_TIMEOUT_S,
                max_response_bytes=self.limits.max_frame_bytes,
            )
        except TransportError as exc:
            log.info("contributions not served round=%d by=%s error=%r", record.round, record.synchronizer[-8:], exc)
            return None
        self.bytes_received += len(raw)
        items = decode_contribution_list(raw, max(expected, 1), self.limits.max_frame_bytes)
        return None if isinstance(items, str) else items

    async def audit(self, record: RoundRecord, snapshot: FragmentState) -> AuditResult:
        """Recompute `record`'s merge on `snapshot` (its parent state); never raises."""
        contributions = await self.fetch_contributions(record)
        if contributions is None:
            return AuditResult(UNVERIFIABLE, "contributions not served")
        loop = asyncio.get_running_loop()
        chain = dict(self.chains[record.fragment])
        try:
            result = await loop.run_in_executor(
                self.worker, self.auditor.check, record, contributions, snapshot, chain
            )
        except Exception as exc:  # noqa: BLE001 - an audit fault is not an accusation
            log.exception("audit failed round=%d fragment=%d", record.round, record.fragment)
            return AuditResult(UNVERIFIABLE, f"audit fault: {exc}")
        log.info(
            "audit round=%d fragment=%d synchronizer=%s verdict=%s reason=%r",
            record.round, record.fragment, record.synchronizer[-8:], result.verdict, result.reason,
        )
        self.on_event(
            {"event": "audited", "fragment": record.fragment, "round": record.round,
             "synchronizer": record.synchronizer, "verdict": result.verdict, "reason": result.reason}
        )
        return result

    async def _convict(self, record: RoundRecord, reason: str) -> None:
        """A proven false merge: never apply it, never trust its synchronizer, tell the run."""
        log.error(
            "false merge proven round=%d fragment=%d synchronizer=%s reason=%r",
            record.round, record.fragment, record.synchronizer, reason,
        )
        self.void.add(record.digest)
        self.banned[record.synchronizer] = min(record.round, self.banned.get(record.synchronizer, record.round))
        self.chains[record.fragment].pop(record.round, None)
        self.on_event(
            {"event": "convicted", "fragment": record.fragment, "round": record.round,
             "synchronizer": record.synchronizer, "reason": reason}
        )
        notice = FraudNotice(record.fragment, record.round, record.synchronizer, record.digest, self.transport.peer_id)
        self._notices_seen.add(notice_subkey(record.fragment, record.round, notice.auditor))
        await self.transport.store(
            notices_key(self.run),
            notice_subkey(record.fragment, record.round, notice.auditor),
            seal_notice(self.transport.identity, self.run, notice),
            self.transport.now() + NOTICE_TTL_S,
        )

    async def check_notices(self) -> None:
        """Re-run the audit of every new fraud notice; act only on what we verify ourselves."""
        if self.auditor is None:
            return
        raw = await self.transport.get(notices_key(self.run))
        for subkey, (value, _expiration) in list(raw.items())[:64]:
            if subkey in self._notices_seen:
                continue
            self._notices_seen.add(subkey)
            notice = open_notice(self.run, subkey, value)
            if isinstance(notice, str) or not 0 <= notice.fragment < len(self.chains):
                continue
            record = self.chains[notice.fragment].get(notice.round)
            if record is None or record.digest != notice.digest or record.digest in self.void:
                continue
            snapshot = await self._parent_state(record, notice.auditor)
            if snapshot is None:
                log.warning("fraud notice round=%d by=%s: parent state unavailable, not verified", notice.round, notice.auditor[-8:])
                continue
            result = await self.audit(record, snapshot)
            if result.verdict == MISMATCH:
                await self._convict(record, f"verified notice of {notice.auditor[-8:]}: {result.reason}")
                await self.sync_fragment(record.fragment)
            elif result.verdict == OK:
                log.warning("false fraud notice round=%d by=%s: the merge checks out", notice.round, notice.auditor[-8:])
                self.on_event({"event": "false_notice", "round": notice.round, "auditor": notice.auditor})

    async def _parent_state(self, record: RoundRecord, donor: str) -> FragmentState | None:
        """The fragment's state at `record.parent`: ours if we are there, else the donor's
        (the notifying auditor stopped there), verified by its hash on a scratch copy."""
        fragment = record.fragment
        if self.state.round_of(fragment) == record.round and self.parent_hash(fragment, record.round) == record.parent:
            return self.state.export_fragment(fragment)
        state = await self._download_from(donor, fragment, record.round)
        loop = asyncio.get_running_loop()
        if state is None or state.hash != record.parent or state.round != record.round:
            return None
        try:
            checked = await loop.run_in_executor(self.worker, self.state.checked_copy, state)
        except (ValueError, KeyError):
            return None
        # the checked fp32 copies, not the donor's tensors: the audit applies a merge to them
        return checked if checked.hash == state.hash else None

    def _notify_settled(self, fragment: int, chain: dict[int, RoundRecord]) -> None:
        """Tell learners which record the DHT's canonical chain holds for each round this
        replica passed; again if a later read finds another record (a rival won)."""
        current = self.state.round_of(fragment)
        notified = self._notified[fragment]
        for round_id in sorted(r for r in chain if current - 64 <= r < current):
            record = chain[round_id]
            if notified.get(round_id) != record.digest:
                notified[round_id] = record.digest
                for listener in list(self.on_committed):
                    listener(fragment, round_id, record)
        for old in [r for r in notified if r < current - 64]:
            del notified[old]

    def _elements(self, fragment: int) -> int:
        """Parameters of `fragment` (sizes a transfer's deadline)."""
        return self._sizes[fragment]

    async def _fetch(self, record: RoundRecord) -> Update | None:
        """The update frame a record names, from our store or a holder; verified by digest."""
        kept = self.store.get(record.fragment, record.digest)
        if kept is not None:
            return kept
        me = self.transport.peer_id
        live = [p for p in synchronizer_candidates(self.members()) if p != me]
        order = [record.synchronizer, *record.holders, *live]
        peers = list(dict.fromkeys(p for p in order if p != me))[:MAX_FETCH_PEERS]
        request = wire.encode_message(
            wire.Message(
                kind=messages.UPDATE_REQUEST,
                run=self.run,
                round=record.round,
                fragment=record.fragment,
                meta={"peer": me, "digest": record.digest},
            )
        )
        for peer in peers:
            try:
                raw = await self.transport.call(
                    peer,
                    f"{self.run}.{messages.RPC_GET_UPDATE}",
                    request,
                    timeout_s=transfer_timeout_s(FETCH_TIMEOUT_S, self._elements(record.fragment)),
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError:
                continue
            self.bytes_received += len(raw)
            update = parse_update(raw, self.limits, self.run, self.shapes)
            if isinstance(update, wire.Rejected) or update.digest != record.digest:
                continue
            self.keep(update)
            self._unfetchable_since.pop(record.digest, None)
            return update
        first = self._unfetchable_since.setdefault(record.digest, time.monotonic())
        log.warning(
            "cannot fetch update fragment=%d round=%d digest=%s from %d peers",
            record.fragment, record.round, record.digest[:12], len(peers),
        )
        if time.monotonic() - first >= self.void_after_s:
            # Nobody live serves it: nobody can have applied it; the round is re-run.
            log.warning("round voided fragment=%d round=%d", record.fragment, record.round)
            self.void.add(record.digest)
            self.on_event({"event": "voided", "fragment": record.fragment, "round": record.round})
        return None

    # --- state download -----------------------------------------------------------------

    async def _download(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """Fetch the fragment's state from donors on the canonical chain; verify by hash."""
        wanted = {record.hash: record for record in chain.values()}
        head = max(chain) + 1
        me = self.transport.peer_id
        members = self.members()
        donors = sorted(
            (
                p
                for p, beat in members.items()
                if p != me
                and beat.role == "learner"
                and not beat.client_mode
                and len(beat.rounds) > fragment
                and beat.rounds[fragment] > 0
            ),
            key=lambda p: -members[p].rounds[fragment],
        )
        if not donors:
            log.warning("no donor for fragment=%d round=%d", fragment, head)
            return False
        start = fragment % len(donors)  # spread a joiner's downloads over donors
        loop = asyncio.get_running_loop()
        for donor in donors[start:] + donors[:start]:
            state = await self._download_from(donor, fragment, head)
            if state is None:
                continue
            record = wanted.get(state.hash)
            if record is None or record.round != state.round - 1:
                log.warning(
                    "state from donor=%s round=%d is not on the canonical chain: refused",
                    donor[-8:], state.round,
                )
                continue
            try:
                local_hash = await loop.run_in_executor(self.worker, self.state.import_verified, state)
            except ValueError as exc:
                log.warning("state from donor=%s refused reason=%r", donor[-8:], str(exc))
                continue
            if local_hash != state.hash:
                log.warning("state from donor=%s does not hash to its claim: refused", donor[-8:])
                continue
            self.applied[fragment] = {state.round - 1: record.digest}
            log.info(
                "downloaded fragment=%d round=%d donor=%s hash=%s",
                fragment, state.round, donor[-8:], state.hash[:12],
            )
            self.on_event(
                {
                    "event": "downloaded",
                    "fragment": fragment,
                    "round": state.round,
                    "donor": donor,
                    "hash": state.hash,
                }
            )
            return True
        return False

    async def _download_from(self, donor: str, fragment: int, head: int) -> FragmentState | None:
        """Every part of `fragment`'s state from `donor`, or None (logged) when it fails."""
        me = self.transport.peer_id
        assembler = PartsAssembler(fragment, self.state.fragments[fragment])
        loop = asyncio.get_running_loop()
        while not assembler.complete:
            request = wire.encode_message(
                wire.Message(
                    kind=wire.STATE_REQUEST, run=self.run, round=head, fragment=fragment,
                    meta={"peer": me, "part": assembler.next_part},
                )
            )
            try:
                raw = await self.transport.call(
                    donor,
                    f"{self.run}.{messages.RPC_GET_STATE}",
                    request,
                    timeout_s=transfer_timeout_s(STATE_TIMEOUT_S, 4 * min(MAX_PART_ELEMENTS, 2 * self._elements(fragment))),
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning("state download failed donor=%s error=%r", donor[-8:], exc)
                return None
            self.bytes_received += len(raw)
            piece = await loop.run_in_executor(
                self.worker, decode_part, raw, self.run, fragment, self.shapes[fragment], self.limits
            )
            reason = piece if isinstance(piece, str) else assembler.add(piece)
            if reason:
                log.warning("state from donor=%s refused reason=%r", donor[-8:], reason[:200])
                return None
        state = assembler.state()
        if isinstance(state, str):
            log.warning("state from donor=%s refused reason=%r", donor[-8:], state)
            return None
        return state
