"""A replica's audits: recompute a committed merge from its signed contributions before
applying it (sampled, and always when it is out of line), convict a proven liar, and
verify the fraud notices other peers publish before acting on them (docs/security.md).

What an audit computes is `trust.audit.Auditor` (pure); this module fetches what it needs
(contributions from the synchronizer, a parent state from the notifying auditor) and acts
on the verdict: the liar is banned here (`Entitlement`), its record voided by the replica.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

from p2pdiloco import wire
from p2pdiloco.outer.fragment_state import FragmentState
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.download import StateDownload
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.transport.ratelimit import RateLimiter
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
from p2pdiloco.trust.entitlement import Entitlement
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import decode_contribution_list, encode_audit_request

log = logging.getLogger(__name__)

SUSPICION_FACTOR = 3.0
"""An update whose outer gradient is this many times the median norm of the last applied
ones is always audited before it is applied, whatever the sampled share."""
NORM_HISTORY = 8
MIN_NORM_HISTORY = 3
FETCH_TIMEOUT_S = 30.0
"""Deadline of one `get_contributions` call, seconds."""
MAX_NOTICES = 64
"""Fraud notices read at once."""
NOTICE_READ_INTERVAL_S = 10.0
"""The run's fraud notices are read at most this often (not on every sync pass)."""
MAX_VERIFICATIONS_PER_READ = 1
"""Notices verified per read: each may download a fragment from its notifier."""
MAX_TRIES_PER_RECORD = 2
"""Notices from peers the chain never named verified per accused record, at most (one that
checks out, OK or mismatch, ends it: the verdict is ours). A notifier the chain named gets
one try of its own on each record, first: two Sybil notices that fail to check out must not
use up the tries an honest auditor's notice needs."""
NOTICES_PER_NOTIFIER_PER_S = 1 / 600
"""A notifier's notices are verified at most this often, after a burst of two."""
MAX_NOTICES_SEEN = 1 << 16
RETRY_FIRST_S = 2.0
"""A held update (`Audits.unverified`) is audited again after this long, then after twice
as long each time, up to `RETRY_MAX_S`: not on every sync pass (each try is a
`get_contributions` call to a synchronizer that refused the last one)."""
RETRY_MAX_S = 30.0
DISTRUST_S = 3600.0
"""How long a synchronizer whose out-of-line update this peer could not verify is not
elected here (unless the update verifies meanwhile): a round record's lifetime."""

Convicted = Callable[[RoundRecord, str], Awaitable[None]]
"""What the replica does with a proven false merge: `await convicted(record, reason)`."""


def sampling_divisor(listed: int, live_learners: int) -> int:
    """What a peer divides `audit_share` by: the live learners it sees, which every
    apply a round, at most the contributions the record lists (a synchronizer can only
    lower it, and be audited more), at least one."""
    return max(1, min(listed, live_learners))


class Gate(Enum):
    """What the audit gate says of a committed update (`Audits.judge`)."""

    APPLY = "apply"
    """Audited OK, or not sampled and in line: apply it."""
    HOLD = "hold"
    """Out of line and not verified: not applied now; audited again after a back-off."""
    CONVICTED = "convicted"
    """Its merge is proven false: never applied, its synchronizer banned."""
    MOVED = "moved"
    """The replica moved past the record's parent meanwhile: nothing to judge here."""


class Audits:
    """Audits the rounds one replica applies, and the notices others publish."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        state: GlobalState,
        limits: wire.WireLimits,
        worker: ThreadPoolExecutor,
        entitlement: Entitlement,
        downloads: StateDownload,
        on_event: Callable[[dict], None],
        auditor: Auditor | None = None,
        audit_share: float = 0.0,
    ) -> None:
        self.transport = transport
        self.run = run
        self.state = state
        self.limits = limits
        self.worker = worker
        self.entitlement = entitlement
        self.downloads = downloads
        self.on_event = on_event
        self.auditor = auditor
        self.audit_share = audit_share
        """Expected audits of each round across the swarm: each peer that applies a round
        recomputes it with probability `audit_share / contributors` (see security.md)."""
        self.recent_norms = [deque(maxlen=NORM_HISTORY) for _ in state.fragments]
        """Outer-gradient norms of the last applied updates, per fragment (the same on
        every replica: they follow the same chain)."""
        self.unverified_since: dict[str, float] = {}
        """Digest -> when (monotonic) an update that must be verified first failed to be."""
        self.live_learners: Callable[[], list[str]] = lambda: []
        """Live learners this peer sees: notices count only from them; their number
        divides the audit share (`should_audit`)."""
        self.clock: Callable[[], float] = time.monotonic
        self._retries: dict[str, tuple[int, float]] = {}
        """Digest of a held update -> (audits tried, when the next one is due, by `clock`)."""
        self._notices_seen: set[str] = set()
        self._notices_read_at: float | None = None
        self._records_verified: set[tuple[int, int, str]] = set()
        """(fragment, round, digest) of the records a notice made us verify (OK or mismatch)."""
        self._notice_tries: dict[tuple[int, int, str], int] = {}
        """(fragment, round, digest) -> notices from unnamed notifiers tried on that record."""
        self._named_tries: set[tuple[tuple[int, int, str], str]] = set()
        """(record key, notifier) tried, for notifiers the chain named (one try each)."""
        self.notice_limiter = RateLimiter(rate_per_s=NOTICES_PER_NOTIFIER_PER_S, burst=2)
        self.notice_verifications = 0
        """Notices verified so far (each may have downloaded a fragment)."""
        self.bytes_received = 0

    def out_of_line(self, record: RoundRecord, norm: float) -> bool:
        """Whether the update's outer-gradient norm is more than `SUSPICION_FACTOR` times
        the median of the last applied ones: then it is applied only once an audit
        verified it (`must_verify`)."""
        recent = self.recent_norms[record.fragment]
        return len(recent) >= MIN_NORM_HISTORY and norm > SUSPICION_FACTOR * statistics.median(recent)

    def must_verify(self, record: RoundRecord, norm: float) -> bool:
        """An out-of-line update of another synchronizer, on a peer that audits: held until
        an audit says OK (applied unaudited when the synchronizer refuses
        `get_contributions`, a lie big enough to hurt would pass by refusing audits)."""
        if self.auditor is None or record.synchronizer == self.transport.peer_id:
            return False
        return self.out_of_line(record, norm)

    def should_audit(self, record: RoundRecord, norm: float) -> bool:
        """Always when the update must be verified (`must_verify`), else sampled:
        `audit_share` audits a round across the swarm, each peer with probability
        `audit_share / n`, n the live learners this peer sees (each applies the round),
        at most the record's contributors. Not the record's count alone: a synchronizer
        that listed many contributions would make itself almost never audited."""
        if self.auditor is None or record.synchronizer == self.transport.peer_id:
            return False
        if self.must_verify(record, norm):
            log.info(
                "update out of line round=%d fragment=%d norm=%.4g median=%.4g: auditing",
                record.round, record.fragment, norm, statistics.median(self.recent_norms[record.fragment]),
            )
            return True
        return random.random() < self.audit_share / sampling_divisor(len(record.contributions), len(self.live_learners()))

    async def judge(
        self,
        record: RoundRecord,
        norm: float,
        parent_state: Callable[[], Awaitable[FragmentState]],
        chain: dict[int, RoundRecord],
    ) -> tuple[Gate, str]:
        """The one question a replica asks before applying `record`'s update (outer-gradient
        norm `norm`): apply it, hold it, or never (a proven lie). Sampled or out of line,
        the merge is recomputed on the parent state (`parent_state`, read only when an audit
        runs); a verified record lifts any distrust, one that must be verified and cannot
        be is held and its next audit backs off. (what, why) with why empty unless held
        or convicted."""
        if not self.should_audit(record, norm):
            return Gate.APPLY, ""
        snapshot = await parent_state()
        if (snapshot.round, snapshot.hash) != (record.round, record.parent):
            # the replica moved meanwhile (a learner's call or another pass applied the
            # round): a local race, not a reason to hold the update or distrust its
            # synchronizer (the audit would say "not the round's parent")
            return Gate.MOVED, ""
        result = await self.audit(record, snapshot, chain)
        if result.verdict == MISMATCH:
            return Gate.CONVICTED, result.reason
        if result.verdict == OK:
            self.verified(record)
        elif self.must_verify(record, norm):
            self.unverified(record, result.reason)
            return Gate.HOLD, result.reason  # tried again next pass, re-run past void_after_s
        return Gate.APPLY, ""

    def unverified(self, record: RoundRecord, reason: str) -> None:
        """An update that must be verified and could not be (its synchronizer did not serve
        its contributions, or the record claims no history the chain holds): not applied;
        from now on the round counts as one this replica cannot get (`unverified_since`),
        which lets its next synchronizer re-run it once `void_after_s` passed by the
        record's signed time, as for an update nobody serves (this peer's learner then
        sends its delta for the round past the record's synchronizer,
        `ReplicaSync.withheld_by`). The next audit waits (`retry_due`), and the
        synchronizer is not elected here meanwhile (`Entitlement.distrust`)."""
        first = self.unverified_since.setdefault(record.digest, time.monotonic())
        tries, _ = self._retries.get(record.digest, (0, 0.0))
        wait_s = min(RETRY_FIRST_S * 2**tries, RETRY_MAX_S)
        self._retries[record.digest] = (tries + 1, self.clock() + wait_s)
        # Not elected here meanwhile: it would hold the next round it is elected for the
        # same way. Local only (a refusal proves nothing to others): no notice, and its
        # records count as before; lifted if this update verifies (`verified`).
        self.entitlement.distrust(record.synchronizer, DISTRUST_S)
        log.warning(
            "out-of-line update not verified round=%d fragment=%d synchronizer=%s reason=%r held_s=%.0f"
            " next_try_s=%.0f",
            record.round, record.fragment, record.synchronizer[-8:], reason, time.monotonic() - first, wait_s,
        )
        self.on_event(
            {"event": "unverified", "fragment": record.fragment, "round": record.round,
             "synchronizer": record.synchronizer, "reason": reason}
        )

    def retry_due(self, record: RoundRecord) -> bool:
        """Whether a held update may be audited again now (always, for one not held):
        tries back off exponentially, capped at `RETRY_MAX_S`."""
        retry = self._retries.get(record.digest)
        return retry is None or self.clock() >= retry[1]

    def held(self, record: RoundRecord) -> bool:
        """Whether `record`'s update is held here: it must be verified and was not."""
        return record.digest in self.unverified_since

    def verified(self, record: RoundRecord) -> None:
        """An audit of `record` said OK: not held any more, and if it was, its
        synchronizer is trusted again."""
        self._retries.pop(record.digest, None)
        if self.unverified_since.pop(record.digest, None) is not None:
            self.entitlement.trust_again(record.synchronizer)

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

    async def audit(self, record: RoundRecord, snapshot: FragmentState, chain: dict[int, RoundRecord]) -> AuditResult:
        """Recompute `record`'s merge on `snapshot` (its parent state); never raises."""
        assert self.auditor is not None, "an audit needs an auditor"
        contributions = await self.fetch_contributions(record)
        if contributions is None:
            return AuditResult(UNVERIFIABLE, "contributions not served")
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self.worker, self.auditor.check, record, contributions, snapshot, dict(chain)
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

    async def convict(self, record: RoundRecord, reason: str) -> None:
        """A proven false merge: never trust its synchronizer again, and tell the run."""
        log.error(
            "false merge proven round=%d fragment=%d synchronizer=%s reason=%r",
            record.round, record.fragment, record.synchronizer, reason,
        )
        self.entitlement.ban(record.synchronizer, record.round)
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

    async def check_notices(
        self, record_of: Callable[[int, int], RoundRecord | None], chain_of: Callable[[int], dict[int, RoundRecord]],
        parent_hash: Callable[[int, int], str | None], convicted: Convicted,
    ) -> None:
        """Verify the run's new fraud notices; act only on what we verify ourselves.

        `record_of(fragment, round)` is the record this replica follows (None: none, or
        voided); `convicted` is awaited for each lie verified here.

        A notice is a claim anyone can sign, and verifying one may download a whole
        fragment from its notifier; every peer used to do it for each new notice, on
        every sync pass, so a hundred identities made every peer download a hundred
        fragments. Now the notices are read at most every
        `NOTICE_READ_INTERVAL_S`; a notice counts only from a live learner, within
        its notifier's rate (`NOTICES_PER_NOTIFIER_PER_S`), for the record this replica
        follows; each record is verified once (OK or mismatch: never again), tried at most
        `MAX_TRIES_PER_RECORD` times for notifiers the chain never named and once for each
        one it named (theirs first); at most `MAX_VERIFICATIONS_PER_READ` verifications
        run per read.
        """
        if self.auditor is None:
            return
        now = self.clock()
        if self._notices_read_at is not None and now - self._notices_read_at < NOTICE_READ_INTERVAL_S:
            return
        self._notices_read_at = now
        raw = await self.transport.get(notices_key(self.run))
        live = set(self.live_learners())
        named = frozenset().union(
            *(r.named for f in range(self.state.num_fragments) for r in chain_of(f).values())
        )
        verifications = 0
        # notices of peers the chain named first: a flood of strangers' waits behind them
        ordered = sorted(raw.items(), key=lambda item: (str(item[0]).rpartition("/")[2] not in named, str(item[0])))
        for subkey, (value, _expiration) in ordered[:MAX_NOTICES]:
            if verifications >= MAX_VERIFICATIONS_PER_READ:
                break  # the rest waits for the next read (not marked seen)
            notice = self._notice_to_verify(subkey, value, live, record_of, named)
            if notice is None:
                continue
            record = record_of(notice.fragment, notice.round)
            assert record is not None  # checked by _notice_to_verify
            verifications += 1
            key = (record.fragment, record.round, record.digest)
            if notice.auditor in named:
                self._named_tries.add((key, notice.auditor))
            else:
                self._notice_tries[key] = self._notice_tries.get(key, 0) + 1
            verdict = await self._verify_notice(record, notice, chain_of, parent_hash, convicted)
            if verdict in (OK, MISMATCH):
                self._records_verified.add(key)

    def _notice_to_verify(
        self, subkey: object, value: object, live: set[str], record_of: Callable[[int, int], RoundRecord | None],
        named: frozenset[str] = frozenset(),
    ) -> FraudNotice | None:
        """The notice under `subkey` if it is worth a verification now, else None (and,
        unless only the rate stood in its way, never looked at again)."""
        if not isinstance(subkey, str) or subkey in self._notices_seen:
            return None
        notice = open_notice(self.run, subkey, value)
        if isinstance(notice, str) or not 0 <= notice.fragment < self.state.num_fragments:
            self._remember_seen(subkey)
            return None
        record = record_of(notice.fragment, notice.round)
        key = None if record is None else (record.fragment, record.round, record.digest)
        if (
            record is None or record.digest != notice.digest or notice.auditor not in live
            or key in self._records_verified or self._tries_spent(key, notice.auditor, named)
        ):  # fmt: skip
            self._remember_seen(subkey)
            return None
        if not self.notice_limiter.allow(notice.auditor):
            return None  # this notifier's rate is spent: maybe on a later read
        self._remember_seen(subkey)
        return notice

    def _tries_spent(self, key: tuple[int, int, str], auditor: str, named: frozenset[str]) -> bool:
        """Whether `auditor`'s notice on the record `key` may no longer be tried: a named
        notifier's own try, or the strangers' shared `MAX_TRIES_PER_RECORD`."""
        if auditor in named:
            return (key, auditor) in self._named_tries
        return self._notice_tries.get(key, 0) >= MAX_TRIES_PER_RECORD

    def _remember_seen(self, subkey: str) -> None:
        self._notices_seen.add(subkey)
        if len(self._notices_seen) > MAX_NOTICES_SEEN:
            self._notices_seen.clear()  # bounded memory; old notices are re-checked cheaply

    async def _verify_notice(
        self, record: RoundRecord, notice: FraudNotice, chain_of: Callable[[int], dict[int, RoundRecord]],
        parent_hash: Callable[[int, int], str | None], convicted: Convicted,
    ) -> str:
        """Re-run the audit a notice claims failed; the verdict."""
        self.notice_verifications += 1
        snapshot = await self._parent_state(record, notice.auditor, parent_hash)
        if snapshot is None:
            log.warning("fraud notice round=%d by=%s: parent state unavailable, not verified", notice.round, notice.auditor[-8:])
            return UNVERIFIABLE
        result = await self.audit(record, snapshot, chain_of(record.fragment))
        if result.verdict == MISMATCH:
            await convicted(record, f"verified notice of {notice.auditor[-8:]}: {result.reason}")
        elif result.verdict == OK:
            log.warning("false fraud notice round=%d by=%s: the merge checks out", notice.round, notice.auditor[-8:])
            self.on_event({"event": "false_notice", "round": notice.round, "auditor": notice.auditor})
        return result.verdict

    async def _parent_state(
        self, record: RoundRecord, donor: str, parent_hash: Callable[[int, int], str | None]
    ) -> FragmentState | None:
        """The fragment's state at `record.parent`: ours if we are there, else the donor's
        (the notifying auditor stopped there), verified by its hash on a checked copy."""
        fragment = record.fragment
        loop = asyncio.get_running_loop()
        if self.state.round_of(fragment) == record.round and parent_hash(fragment, record.round) == record.parent:
            return await loop.run_in_executor(self.worker, self.state.export_fragment, fragment)
        state = await self.downloads.fetch(donor, fragment, record.round)
        if state is None or state.hash != record.parent or state.round != record.round:
            return None
        try:
            checked = await loop.run_in_executor(self.worker, self.state.checked_copy, state)
        except (ValueError, KeyError):
            return None
        # the checked fp32 copies, not the donor's tensors: the audit applies a merge to them
        return checked if checked.hash == state.hash else None
