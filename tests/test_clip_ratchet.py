"""The clip cannot be ratcheted up through the history (issue 28, item 6).

A round record lists its kept deltas' norms, and the next windows clip at `clip_factor`
times their median. Listed as merged, a learner alone in each window (K = 1, no grace)
sent a delta just under the refuse bound, got clipped to 3x the reference, and that 3x
became the next reference: 3 -> ~7,500 in 20 rounds. A record now lists at most the
reference its window was screened against (`screening.history_norms`).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from p2pdiloco.outer.screening import (
    HISTORY_GROWTH,
    Candidate,
    ScreeningRules,
    history_norms,
    history_of,
    screen,
)
from p2pdiloco.outer.step import tensor_norm

RULES = ScreeningRules()
TOKENS, STEPS = 5120, 10


def _direction(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    raw = {"w": torch.randn(64, 32, generator=generator), "b": torch.randn(32, generator=generator)}
    norm = tensor_norm(raw)
    return {n: t / norm for n, t in raw.items()}


def _honest_direction(seed: int) -> dict[str, torch.Tensor]:
    """A shared descent direction plus each learner's noise (pairwise cosine ~0.5)."""
    shared, own = _direction(0), _direction(seed)
    raw = {n: shared[n] + own[n] for n in shared}
    norm = tensor_norm(raw)
    return {n: t / norm for n, t in raw.items()}


def _of_norm(direction: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    return {n: t * norm for n, t in direction.items()}


def _honest_records(rounds: int = 4, learners: int = 3) -> list[list[tuple[float, int]]]:
    return [[(1.0, TOKENS)] * learners for _ in range(rounds)]


def _attack(records: list[list[tuple[float, int]]], rounds: int, colluders: int) -> list[float]:
    """`colluders` learners alone in each of `rounds` windows, each sending a delta just
    under the refuse bound; every record lists what the synchronizer lists. The clips."""
    clips = []
    for round_id in range(rounds):
        history = history_of(records, RULES.history_rounds)
        probe = screen(
            [Candidate("probe", _of_norm(_direction(0), 1.0), TOKENS, STEPS)],
            history, RULES, None, max_tokens_per_step=1024,
        )  # fmt: skip
        size = probe.refuse_norm * 0.99
        candidates = [
            Candidate(f"attacker{i}", _of_norm(_direction(round_id * 8 + i), size), TOKENS, STEPS)
            for i in range(colluders)
        ]
        result = screen(candidates, history, RULES, None, max_tokens_per_step=1024)
        assert all(v.kept for v in result.verdicts), result.refused
        clips.append(result.clip_norm)
        records.append([(v.history_norm, v.tokens) for v in result.kept])
    return clips


def test_a_learner_alone_in_each_window_cannot_ratchet_the_clip() -> None:
    clips = _attack(_honest_records(), rounds=20, colluders=1)
    start = RULES.clip_factor * 1.0
    # before: 3, 3, 3, 6, 9, 13.5, ... 7,543 after 20 rounds
    assert max(clips) <= start * (1 + 1e-9), clips


def test_two_colluders_in_each_window_lift_the_clip_at_most_the_growth_factor_a_round() -> None:
    clips = _attack(_honest_records(), rounds=12, colluders=2)
    for before, after in zip(clips, clips[1:], strict=False):
        assert after <= before * HISTORY_GROWTH * (1 + 1e-9), clips
    # the median of four rounds lags: ~1.17x a round (3 -> 15 in 12), where 1.5x gave 390
    assert clips[-1] <= RULES.clip_factor * 1.2**12, clips


def test_honest_norms_that_grow_are_followed_without_being_clipped() -> None:
    """A warm-up: three learners whose norms grow 15% a round are never clipped, and the
    clip follows them."""
    records = _honest_records()
    for round_id in range(20):
        norm = 1.15 ** (round_id + 1)
        history = history_of(records, RULES.history_rounds)
        candidates = [
            Candidate(f"learner{i}", _of_norm(_honest_direction(100 + i), norm * (1 + 0.05 * i)), TOKENS, STEPS)
            for i in range(3)
        ]
        result = screen(candidates, history, RULES, None, max_tokens_per_step=1024)
        assert all(v.kept and v.scale == 1.0 for v in result.verdicts), (round_id, result.clip_norm)
        records.append([(v.history_norm, v.tokens) for v in result.kept])
    assert statistics.median(n for n, _ in records[-1]) > 1.15**15


def test_listed_norms_are_capped_at_the_window_reference() -> None:
    assert history_norms([9.0], 3.0, 3.0) == [1.0]  # alone: at most the reference
    assert history_norms([0.5], 3.0, 3.0) == [0.5]  # a smaller one lowers it
    assert history_norms([9.0, 0.5], 3.0, 3.0) == [HISTORY_GROWTH, 0.5]
    assert history_norms([9.0], math.inf, 3.0) == [9.0]  # no bound known: as merged


@pytest.mark.parametrize("factor", [1.0, 2.0, 2.9])
def test_an_honest_delta_under_the_clip_lists_its_own_norm(factor: float) -> None:
    history = history_of(_honest_records(), RULES.history_rounds)
    candidates = [Candidate("a", _of_norm(_direction(1), factor), TOKENS, STEPS)]
    (verdict,) = screen(candidates, history, RULES, None, max_tokens_per_step=1024).verdicts
    assert verdict.merged_norm == pytest.approx(factor)
    assert verdict.history_norm == pytest.approx(min(factor, 1.0))
