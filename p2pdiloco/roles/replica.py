"""Keep this peer's replica on the canonical chain: follow, fetch, apply, repair.

`sync_fragment` reads the fragment's round records, picks the canonical chain
(`rounds.canonical_chain`), applies its updates in order (fetched by digest from the
record's holders, its synchronizer or any live peer; decoded once, applied through
`outer.fragment.outer_update`, checked against the record's signed hash), and repairs by
state download when this replica sits on a losing branch or is too far behind. Learners
hear of each round it passed through `on_settled`, with the canonical record.

The parts it composes do the rest: `serving.UpdateServer` (hold and serve frames and
state), `download.StateDownload` (verified state download), `audits.Audits` (audit,
convict, verify notices) and `trust.entitlement.Entitlement` (who may synchronize).

All heavy work (decode, outer step, hash, export, import) runs on one worker thread,
never on the event loop; every network wait has a deadline. Faults are logged and the
round is retried on the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from p2pdiloco import wire
from p2pdiloco.outer.fragment import FragmentState, outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.membership import Heartbeat, synchronizer_candidates
from p2pdiloco.protocol.rounds import RoundRecord, canonical_chain, records_of, rounds_key
from p2pdiloco.roles.audits import Audits
from p2pdiloco.roles.download import StateDownload
from p2pdiloco.roles.serving import UpdateServer
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError, transfer_timeout_s
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import MISMATCH, Auditor, AuditResult
from p2pdiloco.trust.entitlement import Entitlement
from p2pdiloco.wire import messages
from p2pdiloco.wire.updates import Update, parse_update

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 30.0
"""Deadline of one `get_update` call, seconds, plus its expected bytes (int8: about one a
parameter) at the slowest expected link (`transfer_timeout_s`)."""
MAX_FETCH_PEERS = 6
"""Peers asked for one update before this sync pass gives up on it."""
MAX_CATCH_UP_ROUNDS = 8
"""Behind by more rounds than this: download the fragment's state instead of replaying."""
NOTIFY_ROUNDS = 64
"""Rounds behind the replica's own whose records learners are still told of."""


def decoded_with_norm(update: Update) -> tuple[dict[str, torch.Tensor], float]:
    """The update's outer gradient, decoded once, and its L2 norm (worker thread);
    ValueError when it does not decode or is not finite."""
    decoded = update.decode()
    return decoded, tensor_norm(decoded)


class ResultMismatch(ValueError):
    """An update whose result does not hash to what its round record signs."""


class ReplicaSync:
    """Follows the canonical chain of every fragment for one peer, and composes the parts
    that serve, download and audit for it."""

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
        self.run = run
        self.state = state
        self.members = members
        self.limits = limits
        self.worker = worker
        self.void_after_s = void_after_s
        self.on_event = on_event
        self.rivals_visible = rivals_visible
        """Whether records of others are followed at a round (off only under the
        split-view fault injection, which makes this peer commit a round alone)."""
        self.entitlement = Entitlement(run, admission or Admission(), transport.now)
        self.server = UpdateServer(transport, run, state, limits, worker)
        self.downloads = StateDownload(transport, run, state, members, limits, worker, on_event)
        self.audits = Audits(
            transport, run, state, limits, worker, self.entitlement, self.downloads, on_event, auditor, audit_share
        )
        self.genesis = [state.current_hash(f) for f in range(state.num_fragments)]
        self.chains: list[dict[int, RoundRecord]] = [{} for _ in state.fragments]
        """The canonical chain of each fragment as last read from the DHT."""
        self.applied: list[dict[int, str]] = [{} for _ in state.fragments]
        """Digest of the update this replica applied for each round (chain bookkeeping)."""
        self.void: set[str] = set()
        """Digests of committed updates nobody could serve for `void_after_s`, or proven
        false, or that cannot be applied: skipped."""
        self._unfetchable_since: dict[str, float] = {}
        self._locks = [asyncio.Lock() for _ in state.fragments]
        self._fetched_bytes = 0
        self.on_settled: list[Callable[[int, int, RoundRecord], None]] = []
        """Called as `(fragment, round, record)` with the canonical record of each round
        this replica passed, as read from the DHT (again if it changes), so learners
        settle their deltas by what the swarm committed, not by what one peer said."""
        self._notified: list[dict[int, str]] = [{} for _ in state.fragments]

    async def start(self) -> None:
        await self.server.start()

    @property
    def store(self):
        """The update frames this peer holds (`serving.UpdateServer.store`)."""
        return self.server.store

    def keep(self, update: Update) -> None:
        """Keep an update frame to serve (this peer's own, or one pushed or fetched)."""
        self.server.store.put(update)

    @property
    def bytes_received(self) -> int:
        """Bytes this replica received: updates, states and audited contributions."""
        return self._fetched_bytes + self.downloads.bytes_received + self.audits.bytes_received

    # --- the chain ------------------------------------------------------------------------

    async def read_chain(self, fragment: int) -> dict[int, RoundRecord]:
        """The canonical chain of `fragment` from the DHT records (bounded by the transport)."""
        raw = await self.transport.get(rounds_key(self.run, fragment))
        records = records_of(self.run, raw, fragment, self.entitlement.entitled).values()
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
                self.audits.recent_norms[fragment].append(norm)
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

    async def apply_committed(self, record: RoundRecord) -> bool:
        """Apply the committed round `record` (named in a synchronizer's reply: its update
        is usually held here already, pushed by the synchronizer before it committed)."""
        fragment = record.fragment
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
            decoded, norm = await loop.run_in_executor(self.worker, decoded_with_norm, update)
        except ValueError as exc:
            return self._refuse(record, f"update does not decode: {exc}")
        if self.audits.should_audit(record, norm):
            snapshot = await loop.run_in_executor(self.worker, self.state.export_fragment, record.fragment)
            result = await self.audit(record, snapshot)
            if result.verdict == MISMATCH:
                await self._convicted(record, result.reason)
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
        self.audits.recent_norms[record.fragment].append(norm)
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

    async def audit(self, record: RoundRecord, snapshot: FragmentState) -> AuditResult:
        """Recompute `record`'s merge on `snapshot` (its parent state); never raises."""
        return await self.audits.audit(record, snapshot, self.chains[record.fragment])

    async def _convicted(self, record: RoundRecord, reason: str) -> None:
        """A proven false merge: never applied, its synchronizer banned, the run told."""
        self.void.add(record.digest)
        self.chains[record.fragment].pop(record.round, None)
        await self.audits.convict(record, reason)

    async def check_notices(self) -> None:
        """Verify the run's new fraud notices; a proven lie is voided and the chain re-read."""

        def record_of(fragment: int, round_id: int) -> RoundRecord | None:
            record = self.chains[fragment].get(round_id)
            return None if record is None or record.digest in self.void else record

        async def convicted(record: RoundRecord, reason: str) -> None:
            await self._convicted(record, reason)
            await self.sync_fragment(record.fragment)

        await self.audits.check_notices(record_of, lambda f: self.chains[f], self.parent_hash, convicted)

    def _notify_settled(self, fragment: int, chain: dict[int, RoundRecord]) -> None:
        """Tell learners which record the DHT's canonical chain holds for each round this
        replica passed; again if a later read finds another record (a rival won)."""
        current = self.state.round_of(fragment)
        notified = self._notified[fragment]
        for round_id in sorted(r for r in chain if current - NOTIFY_ROUNDS <= r < current):
            record = chain[round_id]
            if notified.get(round_id) != record.digest:
                notified[round_id] = record.digest
                for listener in list(self.on_settled):
                    listener(fragment, round_id, record)
        for old in [r for r in notified if r < current - NOTIFY_ROUNDS]:
            del notified[old]

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
                    timeout_s=transfer_timeout_s(FETCH_TIMEOUT_S, self.state.sizes[record.fragment]),
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError:
                continue
            self._fetched_bytes += len(raw)
            update = parse_update(raw, self.limits, self.run, self.state.layouts)
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

    async def _download(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """The fragment's state from a donor on `chain`, verified by hash (`StateDownload`)."""
        record = await self.downloads.download(fragment, chain)
        if record is None:
            return False
        self.applied[fragment] = {record.round: record.digest}
        return True
