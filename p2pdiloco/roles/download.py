"""A fragment's state from other peers, for a joiner, a replica too far behind, or one on
a losing branch: downloaded in parts, verified by hash against the canonical chain.

hivemind's state download trusts the highest claimed round and one donor; here a state
counts only when its checked copies hash to a record of the canonical chain at (or within
`MAX_DONOR_LAG_ROUNDS` of) the chain's head: a donor can make a download fail, never land,
and never roll a joiner back to an older state of the chain. A state is refused at its
first part when it names another round or hash (a stale donor costs one part, not a
fragment). A hash is only what the record's signer says: a state is taken only where the
records it skips were signed by more than one key, or from a donor independent of them
(`unvouched`, docs/security.md "No state without proof"). Donors are spread over, at most
`MAX_DONORS` are tried, and the whole download has one deadline. Nothing here takes the replica's lock: `fetch_verified` only downloads
and checks; the replica installs under its lock afterwards, after checking again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.outer.fragment_state import FragmentState
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import PayloadDeadlines, Transport, TransportError
from p2pdiloco.wire import messages
from p2pdiloco.wire.state_transfer import MAX_PART_ELEMENTS, PartsAssembler, decode_part

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 120.0
"""Deadline of one `get_state` call, seconds, plus a whole part (fp32) at that link."""
MAX_DONORS = 4
"""Donors one download tries before it gives up (the next sync pass tries others)."""
MAX_DONOR_LAG_ROUNDS = 1
"""Rounds below the chain's head a downloaded state may stand at (a donor that has not yet
applied the newest round): an older state of the chain is refused."""


MIN_SPAN_SIGNERS = 2
"""Distinct synchronizers the records a download skips must have signed for the state to
be taken from any donor (`unvouched`)."""


def span_of(chain: dict[int, RoundRecord], applied: dict[int, str]) -> list[RoundRecord]:
    """The records of `chain` a state download at its head makes this replica skip
    without checking them itself: from the first round, at or above the oldest one it
    holds a hash of (`applied`: round -> hash after it), whose record it did not apply,
    on (pure). A joiner with nothing skips the whole chain."""
    floor = min(applied, default=-1)
    skipped = sorted(r for r in chain if r >= floor and applied.get(r) != chain[r].hash)
    return [chain[r] for r in range(skipped[0], max(chain) + 1) if r in chain] if skipped else []


def vouched_by_signers(span: list[RoundRecord], known: Collection[str]) -> bool:
    """Whether the span's signatures alone tie its state to this replica's history: it
    knows nobody (a joiner with nothing: only the chain's rules), or `MIN_SPAN_SIGNERS`
    distinct keys it `known`s signed the span (pure; `unvouched`)."""
    return not known or len({r.synchronizer for r in span} & set(known)) >= MIN_SPAN_SIGNERS


def unvouched(span: list[RoundRecord], donor: str, known: Collection[str]) -> str:
    """Why the state at the end of `span` may not be installed from `donor`, or "" (pure).

    A replica that downloads skips the updates of `span`: nothing it checked ties the
    state to its own history, only the span's signatures. One key alone could sign
    records whose updates exist nowhere and serve the state their last one names (a
    proven peer in an open run, after one merged contribution). So the state is taken
    only when the span was signed by `MIN_SPAN_SIGNERS` distinct synchronizers that this
    replica `known`s (named by a record it applied itself: a key the span's own records
    name, a Sybil its first signer made a contributor, does not count), or from a donor
    that signed none of it and that it knows (a peer the run merged before: a free
    identity cannot vouch). A replica that knows nobody (a joiner with nothing) has no
    history to tie a state to: it takes the one the chain names (docs/security.md). The
    replica passes no span at all when it fetched every update of the span (they exist,
    for its audits and everyone's: `ReplicaSync.span_available`). Otherwise it replays
    the span's updates, each hash-checked, or stays where it is."""
    if vouched_by_signers(span, known):
        return ""
    if donor in {r.synchronizer for r in span}:
        return "the donor signed every record the state would skip"
    if donor not in known:
        return "one key signed every record the state would skip and no round this replica applied named the donor"
    return ""


def acceptable_state(round_id: int, hash_: str, chain: dict[int, RoundRecord]) -> RoundRecord | str:
    """The record a state at `round_id` (after round_id - 1) with `hash_` stands on, or why
    it is refused: it must hash to the chain's record of its round and be no older than
    `MAX_DONOR_LAG_ROUNDS` below the chain's head (pure)."""
    if not chain:
        return "no chain to check the state against"
    head = max(chain) + 1
    record = chain.get(round_id - 1)
    if record is None or record.hash != hash_:
        return f"state of round {round_id} is not on the canonical chain"
    if round_id < head - MAX_DONOR_LAG_ROUNDS:
        return f"state of round {round_id} is stale: the chain's head is {head}"
    return record


class StateDownload:
    """Downloads fragments' states into one replica."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        worker: ThreadPoolExecutor,
        on_event: Callable[[dict], None],
    ) -> None:
        self.transport = transport
        self.run = run
        self.state = state
        self.members = members
        self.limits = limits
        self.worker = worker
        self.on_event = on_event
        self.bytes_received = 0
        self.deadlines = PayloadDeadlines()
        """Download deadlines by the fragment's size (a simulated peer scales them)."""

    def donors(self, fragment: int, head: int = 0) -> list[str]:
        """Live learners that accept connections and hold the fragment past round 0: those
        whose heartbeat says they reached `head` (less the lag allowed) first, each group in
        an order that differs from peer to peer (joiners spread over donors), then `MAX_DONORS`
        of them."""
        me, members = self.transport.peer_id, self.members()
        holding = [
            p
            for p, beat in members.items()
            if p != me
            and beat.role == "learner"
            and not beat.client_mode
            and len(beat.rounds) > fragment
            and beat.rounds[fragment] > 0
        ]

        def spread(peer: str) -> int:
            return zlib.crc32(f"{me}/{fragment}/{peer}".encode())

        current = sorted((p for p in holding if members[p].rounds[fragment] >= head - MAX_DONOR_LAG_ROUNDS), key=spread)
        behind = sorted((p for p in holding if members[p].rounds[fragment] < head - MAX_DONOR_LAG_ROUNDS),
                        key=lambda p: (-members[p].rounds[fragment], spread(p)))  # fmt: skip
        return (current + behind)[:MAX_DONORS]

    async def fetch_verified(
        self,
        fragment: int,
        chain: dict[int, RoundRecord],
        span: list[RoundRecord] | None = None,
        known: Collection[str] = (),
    ) -> tuple[FragmentState, RoundRecord, str] | None:
        """A state of `fragment` at the head of `chain` (`acceptable_state`), its copies
        checked and hashed against the chain's record: (the state, its record, the donor),
        or None. Only donors that vouch for `span`, the records the download skips
        (`unvouched`, with the peers this replica `known`s), are asked. Installs nothing
        and takes no lock; at most `MAX_DONORS` donors, each with a deadline, and one
        deadline for all."""
        if not chain:
            return None
        head = max(chain) + 1
        donors = self.donors(fragment, head)
        if span is not None:
            refused = {d: why for d in donors if (why := unvouched(span, d, known))}
            if refused:
                log.warning(
                    "state of fragment=%d round=%d refused from donors=%s reason=%r",
                    fragment, head, [d[-8:] for d in refused], next(iter(refused.values())),
                )  # fmt: skip
            donors = [d for d in donors if d not in refused]
        if not donors:
            log.warning("no donor for fragment=%d round=%d", fragment, head)
            return None
        # one donor gets at most a whole fragment's time at the slowest expected link
        # (parameters, momentum, sums: 12 bytes a parameter); the download twice that
        per_donor_s = self.deadlines.for_elements(STATE_TIMEOUT_S, 12 * self.state.sizes[fragment])
        deadline = time.monotonic() + 2 * per_donor_s
        loop = asyncio.get_running_loop()

        def refusal(round_id: int, hash_: str) -> str:
            verdict = acceptable_state(round_id, hash_, chain)
            return verdict if isinstance(verdict, str) else ""

        for donor in donors:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("state download out of time fragment=%d round=%d", fragment, head)
                return None
            try:
                state = await asyncio.wait_for(self.fetch(donor, fragment, head, refusal), min(left, per_donor_s))
            except TimeoutError:
                log.warning("state download out of time donor=%s fragment=%d", donor[-8:], fragment)
                continue
            if state is None:
                continue
            record = acceptable_state(state.round, state.hash, chain)
            if isinstance(record, str):
                log.warning("state from donor=%s refused reason=%r", donor[-8:], record)
                continue
            checked = await loop.run_in_executor(self.worker, self.state.verified_copy, state)
            if checked is None:
                log.warning("state from donor=%s does not hash to its claim: refused", donor[-8:])
                continue
            log.info("downloaded fragment=%d round=%d donor=%s hash=%s", fragment, state.round, donor[-8:], state.hash[:12])
            return checked, record, donor
        return None

    def announce(self, state: FragmentState, donor: str) -> None:
        """The `downloaded` event of an installed state."""
        self.on_event(
            {"event": "downloaded", "fragment": state.fragment, "round": state.round, "donor": donor, "hash": state.hash}
        )

    async def fetch(
        self, donor: str, fragment: int, head: int, refusal: Callable[[int, str], str] | None = None
    ) -> FragmentState | None:
        """Every part of `fragment`'s state from `donor`, or None (logged) when it fails.
        `refusal(round, hash)`, when given, is asked at the first part: a state it refuses
        is not downloaded further."""
        me = self.transport.peer_id
        assembler = PartsAssembler(fragment, self.state.fragments[fragment])
        elements = self.state.sizes[fragment]
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
                    timeout_s=self.deadlines.for_elements(STATE_TIMEOUT_S, 4 * min(MAX_PART_ELEMENTS, 2 * elements)),
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning("state download failed donor=%s error=%r", donor[-8:], exc)
                return None
            self.bytes_received += len(raw)
            piece = await loop.run_in_executor(
                self.worker, decode_part, raw, self.run, fragment, self.state.layouts[fragment], self.limits
            )
            reason = piece if isinstance(piece, str) else assembler.add(piece)
            if not reason and refusal is not None and assembler.next_part == 1:
                reason = refusal(piece.round, piece.hash)
            if reason:
                log.warning("state from donor=%s refused reason=%r", donor[-8:], reason[:200])
                return None
        state = assembler.state()
        if isinstance(state, str):
            log.warning("state from donor=%s refused reason=%r", donor[-8:], state)
            return None
        return state
