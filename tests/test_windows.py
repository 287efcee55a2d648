"""Window rules: quorum, the Eq. 3 grace window, closing, and screening of deltas."""

from __future__ import annotations

import pytest

from p2pdiloco.protocol.window_rules import (
    RunningMean,
    clamp_tokens,
    grace_window_s,
    quorum_met,
    should_close,
    staleness_rejection,
)


def test_quorum_counts_learners_and_optionally_tokens() -> None:
    assert not quorum_met(1, 100, min_quorum=2)
    assert quorum_met(2, 100, min_quorum=2)
    assert not quorum_met(2, 100, min_quorum=2, min_token_fraction=0.5, expected_tokens=400)
    assert quorum_met(2, 200, min_quorum=2, min_token_fraction=0.5, expected_tokens=400)


def test_grace_is_gamma_times_the_slack_the_overlap_leaves_clamped() -> None:
    # tau * step = 2 * 1.0 s; quorum took 0.5 s, sync 0.3 s: slack 1.2 s, gamma 0.5 -> 0.6 s
    assert grace_window_s(
        step_time_s=1.0,
        overlap_steps=2,
        time_to_quorum_s=0.5,
        sync_time_s=0.3,
        gamma=0.5,
        max_grace_s=5,
    ) == pytest.approx(0.6)
    # no slack left: no grace (K=1 without slack merges at once)
    assert (
        grace_window_s(
            step_time_s=1.0,
            overlap_steps=2,
            time_to_quorum_s=3.0,
            sync_time_s=0.3,
            gamma=0.5,
            max_grace_s=5,
        )
        == 0.0
    )
    # bounded
    assert (
        grace_window_s(
            step_time_s=100.0,
            overlap_steps=2,
            time_to_quorum_s=0.0,
            sync_time_s=0.0,
            gamma=0.9,
            max_grace_s=5,
        )
        == 5.0
    )


def test_window_closes_after_grace_or_at_once_when_everyone_arrived() -> None:
    assert not should_close(now=10.0, quorum_time=None, grace_s=1.0, num_arrived=3, num_expected=3)
    assert not should_close(now=10.5, quorum_time=10.0, grace_s=1.0, num_arrived=2, num_expected=3)
    assert should_close(now=11.0, quorum_time=10.0, grace_s=1.0, num_arrived=2, num_expected=3)
    assert should_close(now=10.0, quorum_time=10.0, grace_s=1.0, num_arrived=3, num_expected=3)


def test_staleness_and_token_claims() -> None:
    assert staleness_rejection(5, 5, 2) is None
    assert staleness_rejection(3, 5, 2) is None
    assert "3 rounds stale" in staleness_rejection(2, 5, 2)
    assert "ahead" in staleness_rejection(6, 5, 2)
    assert clamp_tokens(10**9, steps=10, max_tokens_per_step=1000) == 10_000
    assert clamp_tokens(500, steps=10, max_tokens_per_step=1000) == 500
    assert clamp_tokens(-5, steps=10, max_tokens_per_step=1000) == 0


def test_running_mean() -> None:
    mean = RunningMean(decay=0.5)
    assert mean.get(7.0) == 7.0
    mean.update(2.0)
    mean.update(4.0)
    assert mean.get(0.0) == pytest.approx(3.0)
