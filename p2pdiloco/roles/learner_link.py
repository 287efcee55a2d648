"""A learner's side of the network: send a delta with failover; settle it by the record.

Runs on the peer's event loop, never on the training thread. `contribute` walks the
rendezvous order of (round, fragment): the elected synchronizer first, the next one when
a call fails or times out (failover), one named in a `moved` reply. Whatever the
synchronizer answered, the committed round record is the truth: a delta is merged when
the canonical record of its round lists it, and a synchronizer that died after
committing is settled by reading that record. Updates are applied through
`ReplicaSync`; every fault ends as a logged outcome, never an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from p2pdiloco import wire
from p2pdiloco.config import SyncConfig
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord, open_record
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.transport.base import PayloadDeadlines, Transport, TransportError
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import seal_contribution
from p2pdiloco.wire.messages import NoAnswer, Outcome

log = logging.getLogger(__name__)

MAX_CANDIDATES = 3
"""Synchronizers tried for one (round, fragment) before giving up on the window."""
MAX_MOVES = 4
"""`moved` redirects followed for one contribution (a window moves up the order only)."""
MAX_PROBED = 16
"""Candidates of an open run probed at once when the chain has not shown them reachable."""
PROBE_S = 3.0
"""Deadline of one reachability probe: what one unreachable candidate costs a round."""


def with_unreachable(frame: bytes, unreachable: list[str], limits: wire.WireLimits) -> bytes:
    """The CONTRIBUTION `frame` with `unreachable` set in its meta (failover path only)."""
    message = wire.decode_message(frame, limits)
    if isinstance(message, wire.Rejected):
        return frame
    meta = {**message.meta, "unreachable": list(unreachable)}
    return wire.encode_message(dataclasses.replace(message, meta=meta))


class LearnerLink:
    """Contributions out, settled by committed records, for one peer."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        sync: SyncConfig,
        replicas: ReplicaSync,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
    ) -> None:
        self.transport = transport
        self.run = run
        self.sync = sync
        self.replicas = replicas
        self.members = members
        self.limits = limits
        self.bytes_received = 0
        self.deadlines = PayloadDeadlines()
        """Call deadlines by the frame's size (a simulated peer scales them to its preset)."""

    def call_timeout_s(self, frame_bytes: int) -> float:
        """A live synchronizer answers by its deadline plus grace, merge and commit time,
        plus moving the contribution in and an update of its size out to a holder (twice,
        if the first holder fails) on a slow link; only a dead or frozen one runs past
        this (then: failover)."""
        sync = self.sync
        return self.deadlines.for_frame(sync.round_deadline_s + sync.max_grace_s + 30.0, 3 * frame_bytes)

    def overall_timeout_s(self, frame_bytes: int) -> float:
        """Bound on one contribution, every candidate and move included."""
        return 2 * self.call_timeout_s(frame_bytes) + 30.0

    def candidates(self, round_id: int, fragment: int) -> list[str]:
        """Failover order of synchronizers for (round, fragment) in this peer's view: in an
        open run with committed rounds, only peers the canonical chain shows reachable."""
        members = self.replicas.entitlement.candidates(self.members(), fragment, round_id)
        return synchronizer_order(self.run, round_id, fragment, members)

    async def reachable_candidates(self, round_id: int, fragment: int) -> tuple[list[str], list[str]]:
        """(candidates to try, in order; candidates skipped as unreachable).

        In an open run, a candidate the chain has not shown reachable (any candidate before
        the first committed round, when free identities with a heartbeat are candidates
        too) is probed first, all at once, each within PROBE_S: an address nobody can
        reach costs the round one probe, not a whole call timeout."""
        skipped = self.skipped(round_id, fragment)
        order = [p for p in self.candidates(round_id, fragment) if p not in skipped]
        entitlement = self.replicas.entitlement
        if entitlement.admission.synchronizers != "open":
            return order[:MAX_CANDIDATES], skipped
        proven = entitlement.proven(fragment, round_id) or frozenset()
        head = order[:MAX_PROBED]
        unproven = [p for p in head if p not in proven and p != self.transport.peer_id]
        readings = await asyncio.gather(*(self.transport.read_clock(p, PROBE_S) for p in unproven))
        dead = {p for p, reading in zip(unproven, readings, strict=True) if reading is None}
        if dead:
            log.info("skipped unreachable candidates round=%d fragment=%d count=%d", round_id, fragment, len(dead))
        return [p for p in head if p not in dead][:MAX_CANDIDATES], [*skipped, *(p for p in head if p in dead)]

    def skipped(self, round_id: int, fragment: int) -> list[str]:
        """Live synchronizers a delta for (round, fragment) goes past, reported to the next
        one as unreachable (so it neither moves the window back to them nor answers that
        they are better placed): the synchronizer of a record this replica held past
        `void_after_s` for this round (`ReplicaSync.withheld_by`: alive, it answers "late",
        and only the round's next synchronizer may re-run it), and those this peer does not
        elect because their out-of-line update could not be verified (`Entitlement.distrust`)."""
        entitlement, members = self.replicas.entitlement, self.members()
        withheld = self.replicas.withheld_by(fragment, round_id)
        distrusted = sorted(p for p in members if entitlement.is_distrusted(p))
        skipped = list(dict.fromkeys([withheld, *distrusted] if withheld else distrusted))
        if withheld:
            log.info(
                "round held: delta sent past its synchronizer round=%d fragment=%d synchronizer=%s",
                round_id, fragment, withheld[-8:],
            )  # fmt: skip
        return skipped

    async def contribute(self, fragment: int, target_round: int, frame: bytes) -> Outcome:
        """Send one CONTRIBUTION frame for `target_round`, bounded by `overall_timeout_s`."""
        started = time.monotonic()
        try:
            return await asyncio.wait_for(
                self._contribute(fragment, target_round, frame, started), self.overall_timeout_s(len(frame))
            )
        except TimeoutError:
            settled = await self._settle_by_record(fragment, target_round, "", started, len(frame), 0)
            return settled or Outcome(
                NoAnswer.UNREACHABLE, target_round, fragment, reason="contribution timed out",
                latency_s=time.monotonic() - started,
            )

    async def _contribute(self, fragment: int, target_round: int, frame: bytes, started: float) -> Outcome:
        pending, unreachable = await self.reachable_candidates(target_round, fragment)
        if unreachable:
            frame = with_unreachable(frame, unreachable, self.limits)
        tried: list[str] = []
        moves = 0
        while pending:
            candidate = pending.pop(0)
            tried.append(candidate)
            try:
                raw = await self.transport.call(
                    candidate,
                    f"{self.run}.{messages.RPC_CONTRIBUTE}",
                    seal_contribution(self.transport.identity, self.run, frame),
                    timeout_s=self.call_timeout_s(len(frame)),
                    max_response_bytes=1 << 20,
                )
            except TransportError as exc:
                log.warning(
                    "synchronizer failed peer=%s round=%d fragment=%d error=%r; failing over",
                    candidate[-8:], target_round, fragment, exc,
                )
                # It may have died after committing: the record then settles the delta.
                settled = await self._settle_by_record(fragment, target_round, candidate, started, len(frame), 0)
                if settled is not None:
                    return settled
                unreachable.append(candidate)
                frame = with_unreachable(frame, unreachable, self.limits)
                continue
            self.bytes_received += len(raw)
            reply = messages.decode_reply(raw, self.limits, self.run)
            if isinstance(reply, wire.Rejected):
                reason = reply.reason
                log.warning("bad reply peer=%s reason=%r", candidate[-8:], reason)
                continue
            status = reply.meta["status"]
            if status == messages.Reply.BEHIND:
                continue
            if status == messages.Reply.MOVED:
                moved_to = str(reply.meta.get("moved_to", ""))
                if moves < MAX_MOVES and moved_to and moved_to not in unreachable:
                    moves += 1
                    pending = [moved_to, *(p for p in pending if p != moved_to)]
                continue
            record = open_record(self.run, reply.meta["record"]) if "record" in reply.meta else None
            if record is not None and not self.replicas.entitlement.entitled(record):
                record = None
            if status in (messages.Reply.MERGED, messages.Reply.LATE):
                asked = (target_round, fragment)
                of_this_round = record is not None and (record.round, record.fragment) == asked
                if of_this_round:
                    await self.replicas.apply_committed(record)
                if not of_this_round or status == messages.Reply.LATE:
                    # late: the swarm is past the round, maybe by several; follow the chain
                    # to its head, not only to this round, or every next delta is late too
                    await self.replicas.sync_fragment(fragment)
                record = self.replicas.committed(fragment, target_round) or record
                status = self._status_by_record(record, status)
            weight = record.weight_of(self.transport.peer_id) if record is not None else None
            return Outcome(
                status, target_round, fragment, candidate, float(weight or 0.0),
                str(reply.meta.get("reason", "")), len(frame), len(raw), time.monotonic() - started,
            )
        return Outcome(NoAnswer.UNREACHABLE, target_round, fragment, reason=f"tried {len(tried)} synchronizers")

    def _status_by_record(self, record: RoundRecord | None, claimed: str) -> str:
        """merged when the canonical record lists this peer, late when it does not, or
        when the record settles nothing here (`ReplicaSync.unsettled`: its update held
        unverified, or unfetchable past `void_after_s`): the delta then waits in the local
        progress, and is resent to the round's re-run (if the update verifies or arrives
        after all, the record settles it merged, `round_settled`)."""
        if record is None:
            return claimed
        if self.replicas.unsettled(record):
            return messages.Reply.LATE
        return messages.Reply.MERGED if record.weight_of(self.transport.peer_id) is not None else messages.Reply.LATE

    async def _settle_by_record(
        self, fragment: int, round_id: int, synchronizer: str, started: float, sent: int, received: int
    ) -> Outcome | None:
        """The outcome of a delta for a round that is already committed, else None."""
        try:
            chain = await self.replicas.read_chain(fragment)
        except TransportError:
            return None
        record = chain.get(round_id)
        if record is None or self.replicas.unsettled(record):
            return None  # not committed, or it settles nothing here: the round is still open
        await self.replicas.sync_fragment(fragment, chain)
        status = self._status_by_record(record, messages.Reply.LATE)
        return Outcome(
            status, round_id, fragment, record.synchronizer or synchronizer,
            float(record.weight_of(self.transport.peer_id) or 0.0), "settled by the round record",
            sent, received, time.monotonic() - started,
        )
