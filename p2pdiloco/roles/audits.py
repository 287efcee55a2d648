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
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.outer.fragment import FragmentState
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.download import StateDownload
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError
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

Convicted = Callable[[RoundRecord, str], Awaitable[None]]
"""What the replica does with a proven false merge: `await convicted(record, reason)`."""


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
        self._notices_seen: set[str] = set()
        self.bytes_received = 0

    def should_audit(self, record: RoundRecord, norm: float) -> bool:
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
        """Re-run the audit of every new fraud notice; act only on what we verify ourselves.

        `record_of(fragment, round)` is the record this replica follows (None: none, or
        voided); `convicted` is awaited for each lie verified here.
        """
        if self.auditor is None:
            return
        raw = await self.transport.get(notices_key(self.run))
        for subkey, (value, _expiration) in list(raw.items())[:MAX_NOTICES]:
            if subkey in self._notices_seen:
                continue
            self._notices_seen.add(subkey)
            notice = open_notice(self.run, subkey, value)
            if isinstance(notice, str) or not 0 <= notice.fragment < self.state.num_fragments:
                continue
            record = record_of(notice.fragment, notice.round)
            if record is None or record.digest != notice.digest:
                continue
            snapshot = await self._parent_state(record, notice.auditor, parent_hash)
            if snapshot is None:
                log.warning("fraud notice round=%d by=%s: parent state unavailable, not verified", notice.round, notice.auditor[-8:])
                continue
            result = await self.audit(record, snapshot, chain_of(record.fragment))
            if result.verdict == MISMATCH:
                await convicted(record, f"verified notice of {notice.auditor[-8:]}: {result.reason}")
            elif result.verdict == OK:
                log.warning("false fraud notice round=%d by=%s: the merge checks out", notice.round, notice.auditor[-8:])
                self.on_event({"event": "false_notice", "round": notice.round, "auditor": notice.auditor})

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
