"""A learner's book of its shipped deltas: what is on its way, what merged, what folded,
and what each fate changes in its model; pure.

One delta per fragment is on its way (`in_flight`) against the fragment's current base.
Its fate is decided by the canonical record of its round (or a refusal): **merged** (its
progress leaves the model: the global carries it), **folded** (it stays; the next delta
carries it) or **lost** (refused: it leaves and is reported). Decided deltas are kept a
while (`booked`, `folded`), because a rival record may still win their round: a merged
one then comes back into the model, a folded one that the winner lists leaves it. Each
fragment's `WorkLedger` follows every move, so a claim is always the work its delta
carries (invariant 6). The learner applies the moves to its parameters.

Pure: the book holds tensors and integers and returns what to move; no clock, no network.
`local_work_of` / `local_work_problem`: what a checkpoint keeps of the local progress.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from p2pdiloco.compress import EncodedTensor
from p2pdiloco.protocol.ledger import Claim, Params, WorkLedger, progress_of
from p2pdiloco.wire.messages import NoAnswer

KEPT_PER_FRAGMENT = 16
"""Decided deltas a learner keeps a fragment (merged and folded), to move their progress
back or out if a rival record later takes their round."""

AMBIGUOUS = frozenset(NoAnswer)
"""Outcomes that do not say whether a synchronizer merged the delta: it may still commit.
Such a delta waits for the record of its round, at most `sync.round_deadline_s`."""


class Decision(StrEnum):
    """What the learner decided about a delta it shipped (`DeltaBook.decide`)."""

    MERGED = "merged"
    """In its round's merge: its work left the ledger (the record may still flip it)."""
    FOLDED = "folded"
    """Not merged: its work stays in the local progress, to go out with the next delta."""
    LOST = "lost"
    """Refused for what it is: its work is dropped, and reported lost."""


@dataclass
class InFlight:
    """A delta shipped against the learner's current base, until its fate is decided."""

    future: Any
    """Where the network's answer arrives (a `concurrent.futures.Future[Outcome]`)."""
    target_round: int
    base_round: int
    tokens: int
    steps: int
    tensors: dict[str, EncodedTensor]
    first_step: int = 0
    last_step: int = 0
    progress: Params | None = None
    """`local - base` when it was taken (rebase): what leaves the model once merged."""
    weight: float = 0.0
    """Merge weight the synchronizer reported."""
    reply: str = ""
    """The synchronizer's answer once it came (`failed` for an exception)."""
    replied_at: float = 0.0

    @property
    def claim(self) -> Claim:
        return Claim(self.tokens, self.steps, self.first_step, self.last_step)


@dataclass(frozen=True)
class Fate:
    """A decided delta: what was decided, and the progress to take out of the model now
    (None: nothing moves)."""

    item: InFlight
    kind: Decision
    move_out: Params | None = None


@dataclass(frozen=True)
class Flip:
    """A decided delta a rival record moved: `sign` +1 back into the model (its round
    went to a record without it), -1 out of it (a record lists a delta folded here)."""

    item: InFlight
    sign: int


class DeltaBook:
    """The deltas of one learner, per fragment, from shipped to decided and settled."""

    def __init__(self, num_fragments: int) -> None:
        self.ledgers = [WorkLedger() for _ in range(num_fragments)]
        """Per fragment, the work in the local progress: the next claim."""
        self.in_flight: dict[int, InFlight] = {}
        """Per fragment, the one delta shipped against the current base, until decided."""
        self.booked: dict[tuple[int, int], InFlight] = {}
        """Deltas decided merged, kept in case a rival record without them wins their round."""
        self.folded: dict[tuple[int, int], InFlight] = {}
        """Deltas decided folded, kept in case a rival record with them wins their round."""
        self.closed_round: dict[int, tuple[int, float]] = {}
        """Per fragment, the latest round a synchronizer answered `late` for, and when."""
        self.due: set[int] = set()
        """Fragments whose ship came while the previous delta was undecided: shipped as soon
        as it is (their steps are not lost, only later)."""

    def count(self, tokens: int, step: int) -> None:
        """One inner step: its work is in every fragment's local progress."""
        for ledger in self.ledgers:
            ledger.count(tokens, step)

    def closed_lately(self, fragment: int, base_round: int, now: float, patience_s: float) -> bool:
        """Whether the swarm closed the round of `base_round` less than `patience_s` ago
        (a synchronizer said `late`) while the replica has not followed yet."""
        closed_round, closed_at = self.closed_round.get(fragment, (-1, 0.0))
        return closed_round >= base_round and now - closed_at < patience_s

    def decide(self, fragment: int, kind: Decision, moved: bool = False) -> Fate:
        """The fate of the delta on its way for `fragment`. `moved`: the take-over already
        took a merged delta's progress out (`take_over` with `leaving`)."""
        item = self.in_flight.pop(fragment)
        key = (fragment, item.target_round)
        progress, item.progress = item.progress, None  # from now on only the encoded tensors
        ledger = self.ledgers[fragment]
        if kind == Decision.LOST:
            ledger.leave(item.claim)
            return Fate(item, Decision.LOST, progress)
        if kind == Decision.MERGED:
            ledger.leave(item.claim)
            self.folded.pop(key, None)  # one delta of ours a round: an earlier one is not it
            self.booked[key] = item
            return Fate(item, Decision.MERGED, None if moved else progress)
        self.folded[key] = item
        return Fate(item, Decision.FOLDED)

    def undecided_past(self, now: float, patience_s: float) -> list[int]:
        """Fragments whose delta got an ambiguous answer more than `patience_s` ago."""
        return [
            f for f, item in self.in_flight.items()
            if item.reply in AMBIGUOUS and now - item.replied_at > patience_s
        ]  # fmt: skip

    def settle(self, fragment: int, round_id: int, contributors: frozenset[str], me: str) -> Flip | None:
        """The canonical record of (fragment, round) lists `contributors`: the flip it
        makes of a delta decided here otherwise, if any (ledgers already moved)."""
        key = (fragment, round_id)
        listed = me in contributors
        undecided = self.in_flight.get(fragment)
        if undecided is not None and undecided.target_round == round_id:
            return None  # the take-over decides it by the same record
        if key in self.booked and not listed:
            item = self.booked.pop(key)
            if item.tensors:
                self.ledgers[fragment].come_back(item.claim)
            return Flip(item, +1)
        if key in self.folded and listed and key not in self.booked:
            item = self.booked[key] = self.folded.pop(key)
            if item.tensors:
                self.ledgers[fragment].leave(item.claim)
            return Flip(item, -1)
        return None

    def prune(self, rounds: list[int], max_staleness_rounds: int) -> None:
        """Bound what decided deltas hold. One whose base is more than
        `max_staleness_rounds` behind its fragment's round (`rounds`) will not see a rival
        any more that could still matter: its encoded tensors go (at `150m` one is 76 MB).
        At most `KEPT_PER_FRAGMENT` of each kind a fragment stay."""
        for kept in (self.booked, self.folded):
            count: dict[int, int] = {}
            for key in sorted(kept, key=lambda k: -k[1]):  # newest rounds first
                fragment, item = key[0], kept[key]
                count[fragment] = count.get(fragment, 0) + 1
                if count[fragment] > KEPT_PER_FRAGMENT:
                    del kept[key]
                elif item.tensors and rounds[fragment] - item.base_round > max_staleness_rounds:
                    item.tensors = {}


Bases = Mapping[int, tuple[int, Mapping[str, torch.Tensor]]]
"""Per fragment, the (round, global parameters) a learner's local progress stands on."""


def local_work_of(params: Mapping[str, torch.Tensor], bases: Bases, book: DeltaBook) -> dict:
    """Per fragment, the local work no committed round holds: `theta - base` minus the
    progress of the delta on its way (if that one merges after a crash it is in the
    global state; if not, it is lost with the crash), and its ledger less that claim.
    What a checkpoint keeps so a restart loses only the steps since it was taken."""
    work: dict[int, dict] = {}
    for fragment, (_round, base) in bases.items():
        item = book.in_flight.get(fragment)
        carried = item.progress if item is not None and item.progress is not None else None
        progress = progress_of(params, base)
        if carried is not None:
            progress = {n: local - carried[n] for n, local in progress.items()}
        ledger = book.ledgers[fragment]
        claim = item.claim if item is not None and carried is not None else None
        work[fragment] = {
            "progress": progress,
            "tokens": ledger.tokens - (claim.tokens if claim else 0),
            "steps": ledger.steps - (claim.steps if claim else 0),
            "last_step": ledger.last_step,
        }
    return work


def local_work_problem(work: object, bases: Bases) -> str | None:
    """Why checkpointed `work` (`local_work_of`) does not fit these bases (None: it does):
    every fragment, tensors of the model's names and shapes, finite, counters >= 0."""
    if not isinstance(work, dict) or set(work) != set(bases):
        return "no local work for this fragment layout"
    for fragment, saved in work.items():
        names = bases[fragment][1]
        if not isinstance(saved, dict) or not isinstance(saved.get("progress"), dict):
            return f"fragment {fragment}: malformed"
        progress = saved["progress"]
        if set(progress) != set(names) or any(
            not isinstance(progress[n], torch.Tensor) or progress[n].shape != names[n].shape
            or not bool(torch.isfinite(progress[n]).all())
            for n in names
        ):
            return f"fragment {fragment}: tensors do not match the model"
        counts = [saved.get(k) for k in ("tokens", "steps", "last_step")]
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            return f"fragment {fragment}: bad counters"
    return None
