"""When a synchronizer closes a (round, fragment) window and which deltas enter the merge.

Pure rules, with time passed in (`now`): the quorum test, the adaptive grace window of
Decoupled DiLoCo Eq. 3, and the screening of contributions (staleness, norm outliers,
token claims). The networked `synchronizer` calls these and owns the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p2pdiloco.config import MAX_WINDOW_DELTAS


def quorum_met(
    num_arrived: int,
    tokens_arrived: int,
    *,
    min_quorum: int,
    min_token_fraction: float = 0.0,
    expected_tokens: int = 0,
) -> bool:
    """K learners have reported and, if asked, a fraction of the expected tokens too."""
    if num_arrived < min_quorum:
        return False
    if min_token_fraction > 0.0 and expected_tokens > 0:
        return tokens_arrived >= min_token_fraction * expected_tokens
    return True


def grace_window_s(
    *,
    step_time_s: float,
    overlap_steps: int,
    time_to_quorum_s: float,
    sync_time_s: float,
    gamma: float,
    max_grace_s: float,
) -> float:
    """Eq. 3: `clamp(gamma * (tau * step_time - (time_to_quorum + sync_time)), 0, max_grace)`.

    Wait for stragglers only inside the slack that the tau steps of overlapped compute
    leave free, so no learner ever blocks on the synchronizer.
    """
    inputs = (step_time_s, overlap_steps, time_to_quorum_s, sync_time_s, gamma, max_grace_s)
    if any(math.isnan(x) for x in inputs):
        return 0.0  # a poisoned estimate must never hold a window open (or busy-spin a wait)
    slack = overlap_steps * step_time_s - (time_to_quorum_s + sync_time_s)
    grace = min(max(gamma * slack, 0.0), max_grace_s)
    return grace if math.isfinite(grace) else 0.0  # NaN from 0 * inf, or an unbounded max


def overlap_steps_of(overlap_steps: int, inner_steps: int, on_receive: str) -> int:
    """tau of Eq. 3: the inner steps learners really overlap with one synchronisation.

    With `rebase` a learner never waits and loses nothing while its delta is away: it
    keeps stepping until its next ship, H steps later, and a wait inside that cycle costs
    it no step (they are rebased under the update). So tau is H (the configured
    `overlap_steps` if larger). With `overwrite`/`mix` the steps taken while waiting are
    thrown away, so only the configured tau is free. Before (tau = 2 for every mode) the
    slack was negative whenever a commit took longer than two steps: grace was always 0
    and with K < N half the deltas were late by construction.
    """
    if on_receive == "rebase":
        return max(overlap_steps, inner_steps)
    return overlap_steps


def _finite(value: object) -> bool:
    """A real number that is neither NaN nor infinite (bools are not numbers here)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def should_close(
    *,
    now: float,
    quorum_time: float | None,
    grace_s: float,
    num_arrived: int,
    num_expected: int,
) -> bool:
    """Close once quorum is met and the grace has passed, or at once when all expected arrived."""
    if quorum_time is None:
        return False
    return num_arrived >= num_expected or now >= quorum_time + grace_s


@dataclass
class RunningMean:
    """Exponential moving average of an observed duration (seconds)."""

    value: float | None = None
    decay: float = 0.7

    def update(self, sample: float) -> float | None:
        """Fold in one duration; a NaN, infinite or negative one is not a measurement and
        is ignored, so one bad sample cannot poison the mean for good. Returns the mean."""
        if not _finite(sample) or sample < 0:
            return self.value
        self.value = (
            sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample
        )
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


def staleness_rejection(base_round: int, current_round: int, max_staleness: int) -> str | None:
    """Reason to reject a delta by its base round, or None when it may be merged."""
    if base_round > current_round:
        return f"base round {base_round} is ahead of the current round {current_round}"
    if current_round - base_round > max_staleness:
        return f"base round {base_round} is {current_round - base_round} rounds stale (max {max_staleness})"
    return None


def clamp_tokens(claimed: int, steps: int, max_tokens_per_step: int) -> int:
    """A learner's self-reported tokens, bounded by what its steps can have processed."""
    return max(0, min(claimed, steps * max_tokens_per_step))


# --- the window's life as a state machine ------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """What the window knows of one accepted delta (the tensors live with the caller)."""

    tokens: int
    steps: int
    step_time_s: float
    at: float


@dataclass(frozen=True)
class Wait:
    """Nothing to do before `until` (or the next arrival, or a membership change)."""

    until: float


@dataclass(frozen=True)
class Close:
    """Quorum met and grace over (or everyone arrived): merge now."""

    grace_s: float


@dataclass(frozen=True)
class Move:
    """No quorum yet and a better-placed synchronizer is live: send the learners there."""

    to: str


@dataclass(frozen=True)
class Expire:
    """The deadline passed without quorum: no outer step this round."""

    reason: str


Action = Wait | Close | Move | Expire

RECHECK_S = 1.0
"""Longest wait before re-reading the membership (who is expected, who is top), seconds."""


@dataclass
class WindowMachine:
    """One (round, fragment) window: accept deltas, then wait / close / move / expire.

    Pure: time comes in as `now`, the live membership as arguments; the networked
    synchronizer owns the clock, the tensors and the replies. Once `closing` is set no
    delta is accepted (it would otherwise be lost in a merge that already started). The
    `max_arrivals`-th delta sets it and the window closes at once, since its record
    could not name one more (free identities flooding one window cannot make its round
    unpublishable; `sync.min_quorum` is at most that size, so a full window has quorum).
    """

    round: int
    fragment: int
    opened_at: float
    deadline_s: float
    min_quorum: int
    min_token_fraction: float = 0.0
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    quorum_at: float | None = None
    grace_s: float = 0.0
    closing: bool = False
    max_arrivals: int = MAX_WINDOW_DELTAS

    @property
    def full(self) -> bool:
        return len(self.arrivals) >= self.max_arrivals

    def accept(self, peer: str, tokens: int, steps: int, step_time_s: float, now: float) -> str | None:
        """Admit one delta; returns the reason it is refused, or None."""
        if self.closing:
            return "window is closing"
        if peer in self.arrivals:
            return "already contributed to this window"
        for name, count in (("tokens", tokens), ("steps", steps)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                return f"{name} must be an int >= 0"
        if not _finite(step_time_s) or step_time_s < 0:
            step_time_s = 0.0
        self.arrivals[peer] = Arrival(tokens, steps, step_time_s, now)
        self.closing = self.full
        return None

    def next_action(
        self,
        now: float,
        *,
        expected: set[str],
        better_placed: str | None,
        step_time_s: float,
        sync_time_s: float,
        overlap_steps: int,
        gamma: float,
        max_grace_s: float,
    ) -> Action:
        """What the synchronizer should do now.

        `expected`: live learners (those who arrived count too); `better_placed`: the peer
        above this one in the rendezvous order of the window, if any; `step_time_s`: the
        observed inner-step time (falls back to the slowest arrival's claim, bounded).
        """
        tokens = sum(a.tokens for a in self.arrivals.values())
        expected = expected | set(self.arrivals)
        if self.quorum_at is None:
            expected_tokens = int(tokens / max(len(self.arrivals), 1) * len(expected))
            if quorum_met(
                len(self.arrivals),
                tokens,
                min_quorum=self.min_quorum,
                min_token_fraction=self.min_token_fraction,
                expected_tokens=expected_tokens,
            ):
                self.quorum_at = now
                self.grace_s = grace_window_s(
                    step_time_s=step_time_s,
                    overlap_steps=overlap_steps,
                    time_to_quorum_s=now - self.opened_at,
                    sync_time_s=sync_time_s,
                    gamma=gamma,
                    max_grace_s=max_grace_s,
                )
        if should_close(
            now=now,
            quorum_time=self.quorum_at,
            grace_s=self.grace_s,
            num_arrived=len(self.arrivals),
            num_expected=len(expected),
        ) or self.full:  # a full window gets no more (min_quorum <= its size: config)
            self.closing = True
            return Close(self.grace_s)
        if self.quorum_at is None:
            if better_placed is not None:
                self.closing = True
                return Move(better_placed)
            if now >= self.opened_at + self.deadline_s:
                self.closing = True
                return Expire(
                    f"{len(self.arrivals)} of {self.min_quorum} learners before the deadline"
                )
            until = self.opened_at + self.deadline_s
        else:
            until = self.quorum_at + self.grace_s
        if not _finite(until):
            until = now  # never hand the caller a NaN deadline: recheck at once
        return Wait(min(until, now + RECHECK_S))
