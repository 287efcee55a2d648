"""Closing a window: a commit in four named steps, in this order (docs/protocol.md argues
each crash point):

1. `merge`: screen and merge the deltas, encode the update frame, and compute the result
   on a copy of the fragment (worker thread; the replica is not touched);
2. `hold`: push the frame to the live learners (`hold_update`) until `sync.commit_holders`
   of them keep it;
3. `publish`: check that no rival record of the round exists, then store the round
   record, which names the holders and the frame's digest: **the commit point**;
4. install the result in the replica and `answer_first` / answer every waiting learner.

A crash before 3 leaves no record: learners fail over and the round is re-run. A crash
after 3 leaves a record whose update the holders serve. Fault injection wraps these
steps from the outside (`peer.faults.crash_between_steps`); nothing here knows of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.outer.fragment_state import FragmentState, outer_update
from p2pdiloco.outer.screening import ScreeningRules
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.election import rendezvous_order
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.merge import RoundMerge, history_of, max_tokens_per_step, merge_round
from p2pdiloco.protocol.rounds import (
    ROUND_RECORD_TTL_S,
    RoundRecord,
    attested_records,
    counted_records,
    receipt_valid,
    record_subkey,
    records_of,
    rounds_key,
    signed_record,
    skipped_on_chain,
    standing_key,
)
from p2pdiloco.protocol.window_rules import RunningMean
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.window import Window
from p2pdiloco.transport.base import PayloadDeadlines, Transport, TransportError
from p2pdiloco.transport.ratelimit import RateLimiter
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import (
    ContributionStore,
    contribution_digest,
    decode_audit_request,
    encode_contribution_list,
)
from p2pdiloco.wire.updates import Update, new_update

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 20.0
"""Deadline for a holder to take an update, seconds, plus the update's bytes at the
slowest expected link (`transfer_timeout_s`)."""
BACKGROUND_PUSHES = 2
"""Pushes to further learners at once, after the commit holders acked: each one shares
the synchronizer's uplink with the rest."""
MORE_PUSHES = 8
"""Learners the synchronizer pushes the committed update to beyond its holders. The rest
fetch it from the peers that hold it (`ReplicaSync._fetch_order`, each fetcher in an order
of its own), so what a synchronizer uploads per round is bounded by (holders + this)
frames, not one frame per peer of the swarm."""


COMMITTED_ELSEWHERE = "round committed elsewhere"
"""`publish`: a rival record of the round exists; ours is not stored (learners: late)."""
NOT_STORED = "round record not stored"
"""`publish`: the DHT kept no record; nothing is committed (learners: no quorum)."""
NOT_PROVEN = "no record of this chain names this synchronizer"
"""`publish`: an open run's failover window at a peer the chain never named: its record
would be UNPROVEN, skipped by every other peer (`rounds.skipped_on_chain`); not committed
(learners: no quorum)."""


@dataclass(frozen=True)
class Held:
    """A peer that took the update to hold (step 2), and its signed receipt for it
    (`rounds.sign_receipt`; b"" where it sent none that verifies)."""

    peer: str
    receipt: bytes = b""


@dataclass(frozen=True)
class Merged:
    """What step 1 computed: the merge, and (when something was kept and the replica is
    still at the round) the advanced fragment, its update and the update's norm."""

    result: RoundMerge
    history_first: int
    advanced: FragmentState | None = None
    update: Update | None = None
    norm: float = 0.0


MORE_HOLDERS_GRACE_S = 2.0
"""Once one holder acked, how long (at least) the others may still take: the update is
safe with one copy beside the synchronizer's, more are a margin, not a condition."""

HOLDERS_SALT = "holders"
"""Mixed into the rendezvous hash that orders holders, so the order differs from the
synchronizer election's (`election.rendezvous_score`)."""


def holder_order(
    run: str,
    round_id: int,
    fragment: int,
    synchronizer: str,
    contributors: list[str],
    members: Mapping[str, Heartbeat],
) -> list[str]:
    """The peers a synchronizer asks to hold its update, in order: the round's
    contributors, then the other live learners, each group by rendezvous hash over
    (run, round, fragment, peer).

    Only peers whose heartbeat says they accept connections (not `client_mode`, not
    leaving): a holder nobody can dial holds nothing for the run. The order was the
    contributors' by peer id, so the lowest id was the sole holder of every round it
    contributed to, and an identity ground to a low id could hold (and withhold) every
    update; by hash, it is first in about one round in N.
    """
    reachable = {
        p for p, b in members.items()
        if b.role == "learner" and not b.client_mode and b.status != "leaving" and p != synchronizer
    }  # fmt: skip

    salted = f"{run}/{HOLDERS_SALT}"
    first = rendezvous_order(salted, round_id, fragment, reachable & set(contributors))
    return first + rendezvous_order(salted, round_id, fragment, reachable - set(first))


class Committer:
    """Commits the windows one synchronizer closes."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        config: RunConfig,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        replicas: ReplicaSync,
        worker: ThreadPoolExecutor,
        limits: wire.WireLimits,
        on_event: Callable[[dict], None],
        rivals_visible: Callable[[int], bool],
        certificates: tuple[bytes, ...],
        screening_rules: ScreeningRules,
    ) -> None:
        self.transport = transport
        self.run = run
        self.config = config
        self.state = state
        self.members = members
        self.replicas = replicas
        self.worker = worker
        self.limits = limits
        self.on_event = on_event
        self.rivals_visible = rivals_visible
        self.certificates = certificates
        """This peer's operator certificates, shown in its round records."""
        self.screening_rules = screening_rules
        self.outer_codec = compress.make_codec_from_config(config.compress, outer=True)
        self.max_tokens_per_step = max_tokens_per_step(config)
        self.kept = ContributionStore()
        """Signed contributions of the rounds this peer committed, served to auditors."""
        self.audit_limiter = RateLimiter(rate_per_s=state.num_fragments, burst=4 * state.num_fragments + 4)
        """Contribution lists served per caller: an auditor asks once per audited round
        (at most one a fragment a second, sustained); a flood is refused."""
        self.sync_time = RunningMean()
        self.deadlines = PayloadDeadlines()
        """Push deadlines by the update's size (a simulated peer scales them to its preset)."""
        self.more_pushes = MORE_PUSHES
        """Learners pushed the update beyond its holders (`MORE_PUSHES`; the simulator
        sweeps it)."""
        self.tasks: set[asyncio.Task] = set()
        """Background pushes still running after their commit."""

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def rpc_get_contributions(self, caller: str, request: bytes) -> bytes:
        """The signed contributions of a round this peer committed (for auditors)."""
        asked = decode_audit_request(request)
        if isinstance(asked, str):
            raise ValueError(asked)
        kept = self.kept.get(*asked)
        if kept is None:
            raise LookupError(f"contributions of round {asked[0]} fragment {asked[1]} are not kept here")
        if not self.audit_limiter.allow(caller):
            raise PermissionError("get_contributions rate limited")
        return encode_contribution_list(kept)

    # --- 1. merge ---------------------------------------------------------------------------

    async def merge(self, window: Window, grace_s: float) -> Merged:
        """Step 1, on the worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, self._merge, window, grace_s)

    def _merge(self, window: Window, grace_s: float) -> Merged:
        snapshot = self.state.export_fragment(window.fragment)
        history, history_first = history_of(
            self.replicas.chains[window.fragment], window.round, self.screening_rules.history_rounds
        )
        result = merge_round(
            list(window.candidates.values()),
            history=history,
            params=snapshot.params,
            momentum=snapshot.momentum,
            outer=self.config.outer,
            sync=self.config.sync,
            rules=self.screening_rules,
            max_tokens_per_step=self.max_tokens_per_step,
            outer_codec=self.outer_codec,
        )
        if not result.quorate:
            return Merged(result, history_first)
        if snapshot.round != window.round:  # a rival's update was applied meanwhile
            return Merged(result, history_first)
        advanced = outer_update(snapshot, result.decoded, self.config.outer)
        contributors = [(v.peer, float(v.weight), v.tokens) for v in result.screening.kept]
        update = new_update(
            self.run, window.round, window.fragment, self.peer_id, snapshot.hash, advanced.hash,
            contributors, result.encoded, grace_s,
        )
        return Merged(result, history_first, advanced, update, tensor_norm(result.decoded))

    # --- 2. hold ----------------------------------------------------------------------------

    async def hold(self, update: Update) -> list[Held] | None:
        """Step 2: push the update to live learners until `commit_holders` keep it (or the
        targets run out, or a short grace after the first ack); who holds it, with each
        holder's receipt (b"" where it sent none), or None if nobody does.

        Contributors first (they need it anyway), then the other live learners, each group
        in `holder_order` (reachable peers only, by rendezvous hash). Only as
        many pushes as holders are still needed run at once (a failed one is replaced by
        the next target), so on a slow uplink the first holder gets the whole of it; once
        enough acked, the other learners get it in the background, `BACKGROUND_PUSHES` at
        a time, so more peers hold it: at most `MORE_PUSHES` of them, the rest of the swarm
        fetches from those (the synchronizer's upload per round stays bounded as N grows).
        """
        self.replicas.keep(update)
        targets = holder_order(
            self.run, update.round, update.fragment, self.peer_id, [c[0] for c in update.contributors], self.members()
        )
        need = min(self.config.sync.commit_holders, len(targets))
        if need == 0:
            return []
        timeout_s = self.deadlines.for_update(HOLD_TIMEOUT_S, len(update.frame))
        holders: list[Held] = []
        queue = list(targets)  # not tried yet: a failed push is not repeated
        running: set[asyncio.Future] = set()
        deadline = time.monotonic() + 2 * timeout_s  # one failed wave, then its replacement
        while len(holders) < need and (queue or running) and time.monotonic() < deadline:
            while queue and len(running) < need - len(holders):
                running.add(asyncio.ensure_future(self._push(queue.pop(0), update, timeout_s)))
            done, running = await asyncio.wait(
                running, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
            )
            acked = [held for held in (task.result() for task in done) if held is not None]
            if acked and not holders:  # one copy is safe: the others get a short grace only
                deadline = min(deadline, time.monotonic() + max(MORE_HOLDERS_GRACE_S, timeout_s / 4))
            holders += acked
        for task in running:
            task.cancel()
        if not holders:  # a holder that is dead or unreachable must not fail the round
            return None
        if queue:
            task = asyncio.ensure_future(self._push_rest(queue[:self.more_pushes], update, timeout_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return list(holders)

    async def _push(self, peer: str, update: Update, timeout_s: float) -> Held | None:
        """Hand the update to `peer` to hold; its id and receipt (b"" when it sent no valid
        one) once it acked the digest, else None."""
        try:
            raw = await self.transport.call(
                peer, f"{self.run}.{messages.RPC_HOLD_UPDATE}", update.frame,
                timeout_s=timeout_s, max_response_bytes=1 << 16,
            )
        except TransportError as exc:
            log.info("hold failed peer=%s error=%r", peer[-8:], exc)
            return None
        reply = messages.decode_reply(raw, self.limits, self.run)
        if (
            not isinstance(reply, wire.Rejected)
            and reply.meta.get("status") == messages.Reply.HELD
            and reply.meta.get("digest") == update.digest
        ):
            receipt = reply.meta.get("receipt", b"")
            valid = isinstance(receipt, bytes) and receipt_valid(
                self.run, peer, update.round, update.fragment, update.digest, receipt
            )
            return Held(peer, receipt if valid else b"")
        return None

    async def _push_rest(self, peers: list[str], update: Update, timeout_s: float) -> None:
        """After the commit: the update to the other learners, a few at a time."""
        slots = asyncio.Semaphore(BACKGROUND_PUSHES)

        async def one(peer: str) -> None:
            async with slots:
                await self._push(peer, update, timeout_s)

        await asyncio.gather(*(one(p) for p in peers))

    # --- 3. publish -------------------------------------------------------------------------

    def record_of(self, window: Window, merged: Merged, held: list[Held], grace_s: float) -> RoundRecord:
        """The signed round record that commits `merged` (not stored yet): its holders with
        a receipt first, so the receipts line up with them."""
        update, screening = merged.update, merged.result.screening
        assert update is not None, "a record names an update"
        held = sorted(held, key=lambda h: not h.receipt)
        record = RoundRecord(
            round=window.round,
            fragment=window.fragment,
            synchronizer=self.peer_id,
            hash=update.hash,
            parent=update.parent,
            digest=update.digest,
            holders=tuple(h.peer for h in held),
            receipts=tuple(h.receipt for h in held if h.receipt),
            contributors=update.contributors,
            contributions=tuple(contribution_digest(window.sealed[v.peer]) for v in screening.kept),
            norms=tuple(v.history_norm for v in screening.kept),
            refused=tuple(contribution_digest(window.sealed[p]) for p in sorted(screening.refused)),
            history_from=merged.history_first,
            grace_s=grace_s,
            closed_at=self.transport.now(),
            certificates=self.certificates,
            # a re-run of a round whose update nobody could serve names the record it replaces
            supersedes=self.replicas.supersedable(window.fragment, window.round),
        )
        return signed_record(self.transport.identity, self.run, record)

    async def committed_elsewhere(self, round_id: int, fragment: int, ours: RoundRecord | None = None) -> bool:
        """True when another synchronizer already committed (round, fragment) in a way
        this one yields to (a failover race): a counted record of the round on the same
        parent, unless that record's update is not attested (`rounds.attested_records`)
        while ours is, or, before ours exists (`ours` None: a window about to open), may
        be. A rival only its signer vouches for loses to an attested record on every
        peer, so yielding to it would only leave the round to a record nobody may serve."""
        if not self.rivals_visible(round_id):
            return False
        raw = await self.transport.get(rounds_key(self.run, fragment, round_id, self.replicas.epoch_rounds))
        parent = self.replicas.parent_hash(fragment, round_id)
        rerun_of = self.replicas.supersedable(fragment, round_id)  # this peer re-runs it
        records = list(records_of(self.run, raw, fragment, self.replicas.entitlement.entitled).values())
        rivals = [
            r for r in counted_records(records, self.replicas.open_run, self.replicas.void_after_s)
            if r.round == round_id and r.parent == parent and r.digest != rerun_of
        ]  # fmt: skip
        if not rivals:
            return False
        chain = list(self.replicas.chains[fragment].values())
        attested = attested_records(self.run, [*chain, *records, *([ours] if ours is not None else [])])
        if ours is not None and standing_key(ours) not in attested:
            return True
        return any(standing_key(r) in attested for r in rivals)

    def unproven(self, round_id: int, fragment: int, closes_by: float) -> bool:
        """Whether a record of ours for (round, fragment), closed as late as `closes_by`
        (swarm time), would still be skipped by an open run's canonical rules
        (`rounds.skipped_on_chain`): no record of the chain names this peer and the parent
        is too recent for a takeover. Asked when a delta would open a window here, so the
        learner goes to a peer whose record counts at once (`Synchronizer.rpc_contribute`)
        instead of waiting out a window whose commit `publish` refuses (`NOT_PROVEN`)."""
        parent = self.replicas.parent_hash(fragment, round_id)
        if parent is None:
            return False
        probe = RoundRecord(
            round=round_id, fragment=fragment, synchronizer=self.peer_id, hash="", parent=parent, closed_at=closes_by
        )
        return self._skipped(probe)

    def _skipped(self, record: RoundRecord) -> bool:
        """Whether an open run's canonical rules would skip `record` on top of this
        replica's chain of its fragment (`rounds.skipped_on_chain`)."""
        chain = self.replicas.chains[record.fragment].values()
        return self.replicas.open_run and skipped_on_chain(chain, record, self.replicas.void_after_s)

    async def publish(self, window: Window, merged: Merged, record: RoundRecord) -> str:
        """Step 3, the commit point: "" once the record is stored, else why not
        (`COMMITTED_ELSEWHERE`, `NOT_PROVEN` or `NOT_STORED`)."""
        if await self.committed_elsewhere(window.round, window.fragment, record):
            return COMMITTED_ELSEWHERE
        if self._skipped(record):
            return NOT_PROVEN
        # kept before the record is stored: a peer that reads the record at once may audit
        # it at once (an out-of-line update it cannot verify is held, its synchronizer
        # distrusted); kept for a record that did not get stored, they are never asked for
        self.kept.put(window.round, window.fragment, [window.sealed[c.peer] for c in merged.result.candidates])
        if not await self._store_record(record):
            return NOT_STORED
        return ""

    async def _store_record(self, record: RoundRecord) -> bool:
        """Store the round's record. A DHT may answer "not stored" for a record that some of
        its nodes did keep (hivemind reports its last replica's answer), so a refusal is
        checked by reading the record back."""
        key = rounds_key(self.run, record.fragment, record.round, self.replicas.epoch_rounds)
        subkey = record_subkey(record.round, self.peer_id)
        if await self.transport.store(key, subkey, record.sealed, self.transport.now() + ROUND_RECORD_TTL_S):
            return True
        found = (await self.transport.get(key)).get(subkey)
        if found is not None and found[0] == record.sealed:
            log.info("round record reported not stored but found round=%d fragment=%d", record.round, record.fragment)
            return True
        return False

    # --- 4. install and answer --------------------------------------------------------------

    async def install(self, record: RoundRecord, merged: Merged) -> None:
        """Step 4: the result becomes this replica's (no decode, no hash)."""
        assert merged.update is not None and merged.advanced is not None, "only a merge is installed"
        await self.replicas.install_own(record, merged.update, merged.advanced, merged.norm)

    async def answer_first(self, window: Window, reply: bytes) -> None:
        """The first waiting learner hears of the commit (the others right after)."""
        for peer in window.waiters:
            if window.answer(peer, reply):
                return

    def report(self, window: Window, merged: Merged, record: RoundRecord, grace_s: float, elapsed: float) -> None:
        """The log line and the `round_closed` event of a committed round."""
        update, result = merged.update, merged.result
        assert update is not None, "a committed round has an update"
        refused = result.screening.refused
        log.info(
            "round closed round=%d fragment=%d merged=%d refused=%d holders=%d grace_s=%.2f sync_s=%.3f hash=%s",
            window.round, window.fragment, len(result.screening.kept), len(refused), len(record.holders),
            grace_s, elapsed, update.hash[:12],
        )
        claimed = {c.peer: c for c in result.candidates}
        self.on_event(
            {
                "event": "round_closed",
                "round": window.round,
                "fragment": window.fragment,
                "contributors": [c[0] for c in update.contributors],
                "weights": [c[1] for c in update.contributors],
                # the work each merged delta carries, as claimed (goodput is counted from these)
                "tokens": [claimed[c[0]].tokens for c in update.contributors],
                "steps": [claimed[c[0]].steps for c in update.contributors],
                "staleness": [claimed[c[0]].staleness for c in update.contributors],
                "step_ranges": [list(window.step_ranges.get(c[0], (0, 0))) for c in update.contributors],
                "refused": sorted(refused),
                "holders": list(record.holders),
                "grace_s": grace_s,
                "sync_s": elapsed,
                "hash": update.hash,
                "clip_norm": result.screening.clip_norm,
                # the first round whose norms the screening judged against (-1: none)
                "history_from": record.history_from,
            }
        )
