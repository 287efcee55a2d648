"""When a synchronizer closes a (round, fragment) window and which deltas enter the merge.

Pure rules, with time passed in (`now`): the quorum test, the adaptive grace window of
Decoupled DiLoCo Eq. 3, and the screening of contributions (staleness, norm outliers,
token claims). The networked `synchronizer` calls these and owns the clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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
    slack = overlap_steps * step_time_s - (time_to_quorum_s + sync_time_s)
    return min(max(gamma * slack, 0.0), max_grace_s)


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

    def update(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample
        )
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


def norm_outliers(norms: Sequence[float], factor: float) -> list[bool]:
    """Which deltas are outliers: norm above factor x median or below median / factor.

    With fewer than three deltas there is no majority to tell who is off, so none is
    flagged by norm (they still pass the finiteness and shape checks of `wire`).
    """
    if len(norms) < 3:
        return [False] * len(norms)
    median = statistics.median(norms)
    if median <= 0.0:
        return [n > 0.0 for n in norms]
    return [n > factor * median or n < median / factor for n in norms]


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
