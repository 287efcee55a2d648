"""Keep this peer's replica on the canonical chain: follow, fetch, apply, repair.

`sync_fragment` reads the fragment's round records, picks the canonical chain
(`rounds.canonical_chain`), applies its updates in order (fetched by digest from the
record's holders, its synchronizer or any live peer; decoded once, applied through
`outer.fragment_state.outer_update`, checked against the record's signed hash), and repairs by
state download when this replica sits on a losing branch or is too far behind. Learners
hear of each round it passed through `on_settled`, with the canonical record.

No decision that forks is taken here from local timing alone: an update nobody
serves is never voided locally. The fetch rotates through every peer that may hold it;
a replica that still cannot get it downloads a state at the chain's head instead; and
only when that fails for `void_after_s` may this peer, as the round's synchronizer, re-run
the round with a record that names the one it supersedes (`supersedable`): every peer then
skips the original alike (`rounds.superseded_digests`, by signed times). The network is
never waited on under a fragment's install lock, so a slow donor or holder never delays
the synchronizer's own install.

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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from p2pdiloco import wire
from p2pdiloco.outer.fragment_state import FragmentState, outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.election import rendezvous_order
from p2pdiloco.protocol.membership import Heartbeat, learners, past_round, synchronizer_candidates
from p2pdiloco.protocol.rounds import (
    FINALITY_DEPTH,
    ROUND_RECORD_TTL_S,
    RoundRecord,
    canonical_chain,
    final_point,
    records_of,
    rounds_key,
    superseded_digests,
)
from p2pdiloco.roles import peer_records
from p2pdiloco.roles.audit_gate import Audits, Gate
from p2pdiloco.roles.download import StateDownload, span_of, vouched_by_signers
from p2pdiloco.roles.serving import UpdateServer
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import PayloadDeadlines, Transport, TransportError
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import Auditor, AuditResult
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
MAX_AVAILABILITY_ROUNDS = 2 * MAX_CATCH_UP_ROUNDS
"""Longest span of one signer's records whose updates a replica fetches to see they exist
before it takes a state from any donor (`span_available`)."""
NAMED_APPLIED_ROUNDS = 64
"""Rounds whose named peers a replica remembers as possible independent donors."""
NOTIFY_ROUNDS = 64
"""Rounds behind the replica's own whose records learners are still told of."""


def decoded_with_norm(update: Update) -> tuple[dict[str, torch.Tensor], float]:
    """The update's outer gradient, decoded once, and its L2 norm (worker thread);
    ValueError when it does not decode or is not finite."""
    decoded = update.decode()
    return decoded, tensor_norm(decoded)


class ResultMismatch(ValueError):
    """An update whose result does not hash to what its round record signs."""


class ReplicaMoved(ValueError):
    """This replica is not (or no longer) at the update's parent: a local race, retried."""


MAX_EPOCHS_PER_READ = 8
"""With record epochs: most epochs one read fetches (a replica far behind catches up by the
state download, which reads the head's epochs)."""


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
        epoch_rounds: int = 0,
    ) -> None:
        self.transport = transport
        self.epoch_rounds = epoch_rounds
        """Rounds per records key (`network.record_epoch_rounds`; 0: one key per fragment)."""
        self._raw_records: list[dict[str, tuple[bytes, float]]] = [{} for _ in state.fragments]
        """With epochs: every record read so far (subkey -> sealed, expiration), until it
        expires: the chain is computed over these, a read brings only the new epochs'."""
        self._epochs_read = [0 for _ in state.fragments]
        """With epochs: per fragment, the replica's epoch at the last read (read again from there)."""
        self._epochs_this_pass: list[set[int]] = [set() for _ in state.fragments]
        """With epochs: per fragment, the epochs the last pass read (`_parent_epochs_unread`)."""
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
        self.server.records = lambda fragment, from_round: peer_records.served(
            self._raw_records[fragment], from_round, self.transport.now(), self.epoch_rounds
        )
        self._record_passes = [0 for _ in state.fragments]
        """With epochs: sync passes per fragment (every `DHT_READ_EVERY`th reads the DHT)."""
        self._records_from_peers: set[int] = set()
        """Fragments whose records a peer has served us (told once, as an event)."""
        self.server.synchronizers = lambda: synchronizer_candidates(
            self.members(), self.entitlement.may_synchronize, self.entitlement.proven_anywhere()
        )
        self.server.named = self.entitlement.proven_anywhere
        self.downloads = StateDownload(transport, run, state, members, limits, worker, on_event)
        self.deadlines = PayloadDeadlines()
        """Fetch deadlines by the fragment's size (a simulated peer scales them)."""
        self.audits = Audits(
            transport, run, state, limits, worker, self.entitlement, self.downloads, on_event, auditor, audit_share
        )
        self.audits.live_learners = lambda: learners(self.members())
        self.genesis = [state.current_hash(f) for f in range(state.num_fragments)]
        self.chains: list[dict[int, RoundRecord]] = [{} for _ in state.fragments]
        """The canonical chain of each fragment as last read from the DHT."""
        self.entitlement.follow(self.chains)
        self.applied: list[dict[int, str]] = [{} for _ in state.fragments]
        """Digest of the update this replica applied for each round (chain bookkeeping)."""
        self.void: set[str] = set()
        """Digests of committed updates nobody could serve for `void_after_s`, or proven
        false, or that cannot be applied: skipped."""
        self._reported_superseded: set[str] = set()
        self._unfetchable_since: dict[str, float] = {}
        """Digest -> when (monotonic) this replica first failed to get a committed update
        by any means: only ever lets this peer re-run the round (`supersedable`)."""
        self._fetch_cursor: dict[str, int] = {}
        """Digest -> how many of the peers that may hold it were asked already (rotation)."""
        self._locks = [asyncio.Lock() for _ in state.fragments]
        """Per fragment, held only to install (never across a network wait)."""
        self._passes = [asyncio.Lock() for _ in state.fragments]
        """Per fragment, held through one sync pass (its fetches and downloads), so two
        passes do not fetch the same thing twice; installs do not wait on it."""
        self._fetched_bytes = 0
        self.on_settled: list[Callable[[int, int, RoundRecord], None]] = []
        """Called as `(fragment, round, record)` with the canonical record of each round
        this replica passed, as read from the DHT (again if it changes), so learners
        settle their deltas by what the swarm committed, not by what one peer said."""
        self._notified: list[dict[int, str]] = [{} for _ in state.fragments]
        self._named_applied: list[dict[int, frozenset[str]]] = [{} for _ in state.fragments]
        """Per fragment, round -> the peers named by the record this replica applied (the
        last `NAMED_APPLIED_ROUNDS`): donors it may take a state from (`download.unvouched`)."""
        self._finals: list[tuple[int, str] | None] = [None for _ in state.fragments]
        """Per fragment, (round, hash after it) of the highest round final here (`final`)."""

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
        raw = await self._read_records(fragment)
        records = records_of(self.run, raw, fragment, self.entitlement.entitled).values()
        missing = self._parent_epochs_unread(fragment, records)
        if missing:  # a branch whose link is in an epoch read before: read it again
            raw = await self._read_epochs(fragment, missing)
            records = records_of(self.run, raw, fragment, self.entitlement.entitled).values()
        records = [*records, *self._applied_records(fragment, {(r.round, r.synchronizer) for r in records})]
        chain = canonical_chain(
            self.run, records, self.genesis[fragment], frozenset(self.void),
            anchor=self.anchor(fragment), supersede_after_s=self.void_after_s,
            open_run=self.open_run, final=self.final(fragment),
        )  # fmt: skip
        self.chains[fragment] = chain
        self._report_superseded(records)
        return chain

    def _applied_records(self, fragment: int, present: set[tuple[int, str]]) -> list[RoundRecord]:
        """The records of rounds this replica applied that the DHT did not return (still
        entitled): a replica never needs the DHT to remember what it applied. A key the
        chain named that floods the round key with rounds far ahead evicts its own older
        records at every DHT node (`records.make_room`); without these, the holes broke the
        chain after a replica's final round and it followed the flood's (a bench swarm
        committed 6 rounds a minute instead of 136)."""
        hashes = self.state.applied_hashes[fragment]
        return [
            r for r in list(self.chains[fragment].values())
            if (r.round, r.synchronizer) not in present and hashes.get(r.round) == r.hash and self.entitlement.entitled(r)
        ]  # fmt: skip

    async def _read_records(self, fragment: int) -> dict[str, tuple[bytes, float]]:
        """The fragment's records: its one key whole, or (with epochs) the keys of this
        replica's epoch and the next, and of the head the live members claim when that is
        further on, merged into the records read before (expired ones dropped)."""
        if self.epoch_rounds <= 0:
            return await self.transport.get(rounds_key(self.run, fragment))
        self._record_passes[fragment] += 1
        if self._record_passes[fragment] % peer_records.DHT_READ_EVERY:
            from_peer = await self._records_from_peer(fragment)
            if from_peer is not None:
                return from_peer
        size = self.epoch_rounds
        ours = self.state.round_of(fragment) // size
        # every epoch from the last one read on (a replica that advanced by a learner's
        # reply still gets the records it skipped: the chain rules need the ancestry)
        since = self._epochs_read[fragment]
        epochs = set(range(max(since, ours - MAX_EPOCHS_PER_READ + 2), ours + 2))
        claimed = [b.rounds[fragment] for b in self.members().values() if len(b.rounds) > fragment]
        head = max(claimed, default=0) // size
        if head > ours + 1:  # behind: the head's epochs too (the state download needs them)
            epochs |= {head - 1, head}
        self._epochs_read[fragment] = ours
        self._epochs_this_pass[fragment] = epochs
        return await self._read_epochs(fragment, epochs)

    async def _records_from_peer(self, fragment: int) -> dict[str, tuple[bytes, float]] | None:
        """The records read so far plus those one reachable peer holds of this replica's
        epoch and the next (`peer_records`); None when no peer answered (read the DHT)."""
        me, round_id = self.transport.peer_id, self.state.round_of(fragment)
        peer = peer_records.records_source(me, self.members(), fragment, round_id, self._record_passes[fragment])
        if peer is None:
            return None
        try:
            raw = await self.transport.call(
                peer, f"{self.run}.{peer_records.RPC_GET_RECORDS}",
                peer_records.records_request(self.run, fragment, round_id, me),
                timeout_s=peer_records.RECORDS_TIMEOUT_S, max_response_bytes=peer_records.MAX_REPLY_BYTES,
            )  # fmt: skip
        except TransportError:
            return None
        sealed = peer_records.parse_records_reply(raw, self.limits, self.run)
        if isinstance(sealed, str):
            log.info("records refused peer=%s reason=%r", peer[-8:], sealed)
            return None
        kept, now = self._raw_records[fragment], self.transport.now()
        rounds = peer_records.asked_rounds(round_id, self.epoch_rounds)
        added = peer_records.admit(kept, sealed, self.run, fragment, rounds, ROUND_RECORD_TTL_S, now)
        if fragment not in self._records_from_peers:
            self._records_from_peers.add(fragment)  # once: a pass every beat would flood the events
            self.on_event(
                {"event": "records_from_peer", "fragment": fragment, "peer": peer, "records": len(sealed), "new": added}
            )
        self._epochs_this_pass[fragment] = set()
        return {s: v for s, v in kept.items() if v[1] >= now}

    async def _read_epochs(self, fragment: int, epochs: set[int]) -> dict[str, tuple[bytes, float]]:
        """The records of `epochs`, merged into those read before (expired ones dropped)."""
        size = self.epoch_rounds
        keys = [rounds_key(self.run, fragment, epoch * size, size) for epoch in sorted(epochs)]
        kept = self._raw_records[fragment]
        for found in await asyncio.gather(*(self.transport.get(key) for key in keys)):
            kept.update(found)
        now = self.transport.now()
        for subkey in [s for s, (_, expiration) in kept.items() if expiration < now]:
            del kept[subkey]
        return dict(kept)

    def _parent_epochs_unread(self, fragment: int, records: Iterable[RoundRecord]) -> set[int]:
        """Epochs (not read this pass, at most `MAX_EPOCHS_PER_READ` back) holding the
        parent round of a record whose parent no record read shows.

        A rival record stored late in an epoch this replica had moved past was never read;
        the branch built on it then looked like a free start here (counted from its start),
        while the peers that had read it counted it from round 0: two parts of the swarm
        followed two branches for good (simulated at N = 1,000). Reading the parent's epoch
        again lets every replica compare the same branches."""
        if self.epoch_rounds <= 0:
            return set()
        size, records = self.epoch_rounds, list(records)
        known = {(r.round, r.hash) for r in records}
        floor = self.state.round_of(fragment) // size - MAX_EPOCHS_PER_READ
        read = self._epochs_this_pass[fragment]
        return {
            (r.round - 1) // size for r in records
            if r.round > 0 and (r.round - 1, r.parent) not in known
            and floor <= (r.round - 1) // size and (r.round - 1) // size not in read
        }  # fmt: skip

    def _report_superseded(self, records) -> None:  # noqa: ANN001 - RoundRecords just read
        """A `voided` event, once per record, for each committed round a signed re-run
        replaced (nobody could serve or verify its update): what the metrics count."""
        superseded = superseded_digests(records, self.void_after_s)
        for record in records:
            if record.digest in superseded and record.digest not in self._reported_superseded:
                self._reported_superseded.add(record.digest)
                self.on_event({"event": "voided", "fragment": record.fragment, "round": record.round})

    @property
    def open_run(self) -> bool:
        """Whether anyone may synchronize: records then count only as `rounds.record_standing`
        allows, since any free identity can sign one."""
        return self.entitlement.admission.synchronizers == "open"

    def anchor(self, fragment: int) -> tuple[int, str] | None:
        """(last round this replica applied, its hash after it): where its chain may go on
        even when every older record expired (`canonical_chain`)."""
        round_id = self.state.round_of(fragment) - 1
        if round_id < 0:
            return None
        hash_ = self.state.applied_hashes[fragment].get(round_id)
        return None if hash_ is None else (round_id, hash_)

    def final(self, fragment: int) -> tuple[int, str] | None:
        """(round, hash after it) of the highest round of `fragment` this replica applied
        `FINALITY_DEPTH` rounds on (`rounds.final_point`), or None. It only moves up: a
        state download (which forgets the hashes before it) keeps it, and no record at or
        below it changes the chain this replica follows (`canonical_chain(final=...)`)."""
        last = self.state.round_of(fragment) - 1
        hashes = self.state.applied_hashes[fragment]  # .get: atomic beside the worker's writes
        recent = {r: h for r in range(last - FINALITY_DEPTH, last + 1) if (h := hashes.get(r)) is not None}
        found, kept = final_point(recent), self._finals[fragment]
        if found is not None and (kept is None or found[0] > kept[0]):
            self._finals[fragment] = kept = found
        return kept

    def supersedable(self, fragment: int, round_id: int) -> str:
        """Digest of the canonical record of (round, fragment) that this peer, as the
        round's synchronizer, may re-run in place of, or "".

        Only a record whose update this replica has failed to get by any means (fetch
        from every peer that may hold it, then state download) for `void_after_s`, while
        still at that round, and whose own signed `closed_at` is that old by the DHT's
        clock: the re-run's record (closed now) then passes `rounds.superseded_digests` on
        every peer.
        """
        record = self.chains[fragment].get(round_id)
        if record is None or self.state.round_of(fragment) != round_id:
            return ""
        since = self._unfetchable_since.get(record.digest, self.audits.unverified_since.get(record.digest))
        if since is None or time.monotonic() - since < self.void_after_s:
            return ""
        if self.transport.now() < record.closed_at + self.void_after_s:
            return ""
        return record.digest

    def withheld_by(self, fragment: int, round_id: int) -> str:
        """The synchronizer of the record of (round, fragment) that this replica may see
        re-run (`supersedable`: held unverified, or unfetchable, past `void_after_s`), or "".

        Its learners send their deltas for the round past it, as if it were unreachable:
        alive, it answers them "late" (it is past the round on its own branch), and the
        round's next synchronizer, which alone may re-run it, would never get a window."""
        digest = self.supersedable(fragment, round_id)
        record = self.chains[fragment].get(round_id)
        return record.synchronizer if digest and record is not None else ""

    def holds(self, record: RoundRecord) -> bool:
        """Whether this replica holds `record`'s update unverified: it follows it only once
        an audit says OK, so the record settles nothing yet."""
        return self.audits.held(record) and self.state.applied_hashes[record.fragment].get(record.round) != record.hash

    def unsettled(self, record: RoundRecord) -> bool:
        """Whether `record` settles nothing here yet: its update is held unverified
        (`holds`), or it could not be got by any means past `void_after_s`, by the rule
        `supersedable` uses (a synchronizer that commits, answers "merged" and withholds
        its frame). Its learners' deltas then stay local, to be resent to the round's
        re-run; if the update arrives after all, the record settles them (`round_settled`).
        An honest fetch that takes a few seconds is never this: only past `void_after_s`."""
        if self.holds(record):
            return True
        return self.supersedable(record.fragment, record.round) == record.digest

    def round_unsettled(self, fragment: int, round_id: int) -> bool:
        """Whether this replica is still at (round, fragment) and its record settles nothing
        (`unsettled`): a delta booked merged by it goes back to the local work (any thread:
        dict reads)."""
        record = self.chains[fragment].get(round_id)
        return record is not None and self.unsettled(record)

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
                self._applied(record)
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
        """Bring `fragment` to the head of its canonical chain; True when there.

        One pass at a time per fragment; the network (records, updates, states) is waited
        on outside the install lock, and every install checks again where the replica is.
        """
        async with self._passes[fragment]:
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
                # far behind, a state is cheaper than the updates; refused (no donor vouches
                # for the records it would skip), the updates are replayed where they can be
                if not await self._download(fragment, chain) and current not in chain:
                    return False
            while (current := self.state.round_of(fragment)) < head and current in chain:
                if await self._apply_record(chain[current]):
                    continue
                # Nobody served the update (stores are bounded by bytes, a `150m` peer keeps
                # ~3; its holders may have died): if a peer says it is past the round, the
                # state instead, verified by hash like any. Never a local void.
                held = chain[current].digest in self.audits.unverified_since  # not past it by a state either
                if not held and self._others_past(fragment, current) and await self._download(fragment, chain):
                    if self.state.round_of(fragment) > current:
                        continue
                self._notify_settled(fragment, chain)
                return False
            self._notify_settled(fragment, chain)
            return self.state.round_of(fragment) >= head

    def _others_past(self, fragment: int, round_id: int) -> bool:
        """Whether some live peer's heartbeat says it applied (round, fragment)."""
        me = self.transport.peer_id
        return any(
            p != me and len(beat.rounds) > fragment and beat.rounds[fragment] > round_id
            for p, beat in self.members().items()
        )

    async def apply_committed(self, record: RoundRecord) -> bool:
        """Apply the committed round `record` (named in a synchronizer's reply: its update
        is usually held here already, pushed by the synchronizer before it committed)."""
        fragment = record.fragment
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
        if not self.audits.retry_due(record):
            return False  # held, and its next audit is not due yet (back-off)
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
        gate, why = await self.audits.judge(
            record, norm, lambda: loop.run_in_executor(self.worker, self.state.export_fragment, record.fragment),
            self.chains[record.fragment],
        )  # fmt: skip
        if gate is Gate.CONVICTED:
            await self._convicted(record, why)
            return False
        if gate is Gate.HOLD:
            return False
        if gate is Gate.MOVED:
            return self.state.applied_hashes[record.fragment].get(record.round) == record.hash
        if update.parent != record.parent:
            return self._refuse(record, "update's parent is not its record's")
        async with self._locks[record.fragment]:  # the network is behind us: install only
            if self.state.round_of(record.fragment) != record.round:
                # the replica moved meanwhile (its own commit, a download): nothing to do here
                return self.state.applied_hashes[record.fragment].get(record.round) == record.hash
            try:
                await loop.run_in_executor(self.worker, self._apply, update, decoded, record.hash)
            except ResultMismatch as exc:
                # a lie of the synchronizer, or this replica left the chain unnoticed
                self.on_event({"event": "diverged", "fragment": record.fragment, "round": record.round})
                return self._refuse(record, str(exc))
            except ReplicaMoved as exc:
                # this replica's state, not the update's fault: retried, never voided
                log.info("update not applied round=%d fragment=%d reason=%r", record.round, record.fragment, str(exc))
                return False
            except ValueError as exc:
                return self._refuse(record, str(exc))
            self._applied(record)
        self.audits.recent_norms[record.fragment].append(norm)
        return True

    def _applied(self, record: RoundRecord) -> None:
        """Book `record` as applied here (its update hash-checked, or this peer's own)."""
        self.applied[record.fragment][record.round] = record.digest
        named = self._named_applied[record.fragment]
        named[record.round] = record.named
        for old in [r for r in named if r <= record.round - NAMED_APPLIED_ROUNDS]:
            del named[old]

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
            raise ReplicaMoved("update's parent is not this replica's state")
        advanced = outer_update(self.state.export_fragment(update.fragment), decoded, self.state.outer)
        if advanced.hash != signed_hash:
            raise ResultMismatch("update's result does not match its record's signed hash")
        if not self.state.install(advanced, update.parent):
            raise ReplicaMoved("replica moved during the update")

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

    def _fetch_order(self, record: RoundRecord) -> list[str]:
        """Every peer that may hold `record`'s update, likeliest first: its holders and the
        live peers whose heartbeat says they applied the round (they kept the frame they
        applied), in an order of this fetcher's own; then its synchronizer; then the other
        live peers.

        Each fetcher starts at a different peer that has the frame (rendezvous hash over
        this peer's id), and more peers have it as the round spreads, so serving a round
        to N peers costs no single peer N frames. The synchronizer,
        which pushed it to its holders and a few more (`commit.MORE_PUSHES`), is asked
        only after them."""
        me, members = self.transport.peer_id, self.members()
        live = synchronizer_candidates(members)
        past = past_round(members, live, record.fragment, record.round)
        having = rendezvous_order(
            f"{record.digest}/{me}", record.round, record.fragment, {*record.holders, *past} - {record.synchronizer}
        )
        order = [*having, record.synchronizer, *live]
        return list(dict.fromkeys(p for p in order if p != me))

    async def _fetch(self, record: RoundRecord) -> Update | None:
        """The update frame a record names, from our store or a peer; verified by digest.

        One pass asks at most `MAX_FETCH_PEERS`; the next pass goes on where it stopped, so
        over passes every peer that may hold it is asked (never the same six forever).
        Failing is never a void: `sync_fragment` downloads a state instead, and the round
        is re-run only by a record every peer can check (`supersedable`).
        """
        kept = self.store.get(record.fragment, record.digest)
        if kept is not None:
            # a frame held for its synchronizer is committed now: kept, out of the held
            # quotas a `hold_update` flood (or the sender's next frames) would evict it from
            self.keep(kept)
            return kept
        me = self.transport.peer_id
        order = self._fetch_order(record)
        cursor = self._fetch_cursor.get(record.digest, 0)
        peers = [order[(cursor + i) % len(order)] for i in range(min(MAX_FETCH_PEERS, len(order)))]
        self._fetch_cursor[record.digest] = cursor + len(peers)
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
                    timeout_s=self.deadlines.for_elements(FETCH_TIMEOUT_S, self.state.sizes[record.fragment]),
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
            self._fetch_cursor.pop(record.digest, None)
            return update
        self._unfetchable_since.setdefault(record.digest, time.monotonic())
        log.warning(
            "cannot fetch update fragment=%d round=%d digest=%s from %d of %d peers",
            record.fragment, record.round, record.digest[:12], len(peers), len(order),
        )
        return None

    async def span_available(self, span: list[RoundRecord], known: frozenset[str]) -> bool:
        """Whether every update of `span` (records a state download would skip) exists:
        each fetched and checked against its record's digest, so the state the last one
        names is open to every replica's audit (an honest race lost after a partition).
        Spans the signatures vouch for (`download.vouched_by_signers`) need no check;
        spans longer than `MAX_AVAILABILITY_ROUNDS` are not checked (a donor must vouch)."""
        if not span or vouched_by_signers(span, known):
            return True
        if len(span) > MAX_AVAILABILITY_ROUNDS:
            return False
        for record in span:
            if await self._fetch(record) is None:
                return False
        return True

    async def _download(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """The fragment's state from a donor at the head of `chain`, verified by hash and
        vouched for (`download.unvouched`: the records it skips were signed by more than
        one key, or the donor is independent of them; `StateDownload.fetch_verified`, no
        lock held), then installed under the install lock if it still moves this replica
        forward or onto the chain; True if installed (or the replica got there meanwhile)."""
        applied = dict(self.state.applied_hashes[fragment])
        span = span_of(chain, applied)
        # peers named by the rounds this replica applied: those it booked, and those of the
        # chain whose result it holds (after a restart, the checkpoint's round)
        mine = (r.named for r in chain.values() if applied.get(r.round) == r.hash)
        known = frozenset().union(*self._named_applied[fragment].values(), *mine)
        if await self.span_available(span, known):
            got = await self.downloads.fetch_verified(fragment, chain)
        else:
            got = await self.downloads.fetch_verified(fragment, chain, span, known)
        if got is None:
            return False
        checked, record, donor = got
        loop = asyncio.get_running_loop()
        async with self._locks[fragment]:
            on_chain = self._on_canonical_branch(fragment, chain)
            if on_chain and self.state.round_of(fragment) >= checked.round:
                return True  # got there meanwhile (its own commit, an applied update)
            await loop.run_in_executor(self.worker, self.state.install_download, checked)
            self.applied[fragment] = {record.round: record.digest}
            for passed in (r for r in chain.values() if r.round < checked.round):
                self._unfetchable_since.pop(passed.digest, None)  # got past it: not re-run
        self.downloads.announce(checked, donor)
        return True
