"""Screening of untrusted deltas: attacks are clipped or refused, honest deltas kept, and
every decision is the same bits for whoever recomputes it (the auditor).

Run as a script, this file prints hashes of one screening and its merges: the cross-CPU
test compares them under every `ATEN_CPU_CAPABILITY` this machine can run.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.config import replace
from p2pdiloco.outer.screening import (
    Candidate,
    History,
    Screening,
    ScreeningRules,
    bound_tokens,
    clip_threshold,
    dot,
    history_of,
    loo_cosines,
    merge_screened,
    screen,
    trimmed_mean,
)
from p2pdiloco.outer.step import OuterState, merge_mean, outer_step, pseudo_gradient, tensor_norm
from p2pdiloco.sim.common import global_state_of, learner_streams, load_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer

RULES = ScreeningRules()
MAX_TOKENS_PER_STEP = 1024
TOKENS, STEPS = 5120, 10  # an honest claim: 512 tokens per step
SHAPES = {"w": (64, 32), "b": (32,)}


def _vector(generator: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: torch.randn(shape, generator=generator) * scale for n, shape in SHAPES.items()}


def _add(*parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: sum(p[n] for p in parts) for n in SHAPES}


def _times(delta: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {n: t * factor for n, t in delta.items()}


class Swarm:
    """Synthetic honest deltas: a shared descent direction plus each learner's noise
    (pairwise cosine ~0.3, as measured on the tiny model), and an outer momentum that
    carries the same direction under more noise (cosine with a delta ~0.2)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.signal = _vector(self.generator)
        self.momentum = _add(self.signal, _vector(self.generator, 2.0))
        self.params = _vector(self.generator, 10.0)

    def delta(self) -> dict[str, torch.Tensor]:
        return _add(self.signal, _vector(self.generator, 1.5))

    def history(self, rounds: int = 4, learners: int = 4) -> History:
        norms = tuple(tensor_norm(self.delta()) for _ in range(rounds * learners))
        return History(norms=norms, tokens=(TOKENS,) * (rounds * learners))


def _candidates(deltas, tokens=TOKENS, steps=STEPS) -> list[Candidate]:
    return [Candidate(f"peer{i}", d, tokens, steps) for i, d in enumerate(deltas)]


def _screen(candidates, history=None, momentum=None, params=None, **kwargs) -> Screening:
    return screen(
        candidates,
        history or History(),
        RULES,
        momentum,
        params=params,
        max_tokens_per_step=MAX_TOKENS_PER_STEP,
        **kwargs,
    )


# --- norms -------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [100.0, 1000.0])
def test_a_lone_blown_up_delta_is_refused_against_the_history(factor: float) -> None:
    swarm = Swarm(0)
    result = _screen(_candidates([_times(swarm.delta(), factor)]), swarm.history(), swarm.momentum)
    (verdict,) = result.verdicts
    assert result.reference == "history"
    assert not verdict.kept and "refuse bound" in verdict.reason


def test_a_lone_delta_a_few_times_too_large_is_scaled_down_to_the_clip() -> None:
    swarm = Swarm(1)
    history = swarm.history()
    candidates = _candidates([_times(swarm.delta(), 6.0)])
    result = _screen(candidates, history, swarm.momentum)
    (verdict,) = result.verdicts
    assert verdict.kept and verdict.scale < 1.0
    assert result.clip_norm == RULES.clip_factor * statistics.median(history.norms)
    merged = merge_screened(candidates, result, "token")
    assert tensor_norm(merged) == pytest.approx(result.clip_norm, rel=1e-6)
    assert verdict.merged_norm == pytest.approx(result.clip_norm, rel=1e-12)


def test_history_is_the_contributors_of_the_latest_records() -> None:
    records = [[(9.0, 1)], [(1.0, 10), (2.0, 20)], [(3.0, 30)]]
    assert history_of(records, 2) == History(norms=(1.0, 2.0, 3.0), tokens=(10, 20, 30))
    assert history_of(records, 9) == History(norms=(9.0, 1.0, 2.0, 3.0), tokens=(1, 10, 20, 30))


def test_the_window_cannot_lift_the_reference_once_there_is_history() -> None:
    history = History(norms=(1.0, 1.0, 1.0, 1.0))
    clip, source = clip_threshold(history.norms, [1000.0, 1000.0, 1000.0], 3.0, min_history=3)
    assert (clip, source) == (3.0, "history")


def test_without_history_the_lower_median_of_the_window_is_the_reference() -> None:
    assert clip_threshold([], [1.0, 500.0], 3.0) == (3.0, "window")
    assert clip_threshold([], [1.0, 2.0, 500.0], 3.0) == (6.0, "window")
    assert clip_threshold([], [7.0], 3.0) == (math.inf, "none")


def test_in_round_zero_the_parameter_norm_bounds_a_lone_delta() -> None:
    swarm = Swarm(2)
    honest = swarm.delta()
    first = _screen(_candidates([honest]), params=swarm.params)
    assert first.verdicts[0].kept and first.verdicts[0].scale == 1.0
    assert any("no norm history" in note for note in first.notes)
    assert first.clip_norm == RULES.max_param_ratio * tensor_norm(swarm.params)
    huge = _screen(_candidates([_times(honest, 1000.0)]), params=swarm.params)
    assert not huge.verdicts[0].kept


def test_non_finite_and_zero_deltas_are_refused_with_a_reason_never_an_exception() -> None:
    swarm = Swarm(3)
    nan, inf, zero = swarm.delta(), swarm.delta(), _times(swarm.delta(), 0.0)
    nan["w"][3, 3] = float("nan")
    inf["b"][0] = float("inf")
    huge = _times(swarm.delta(), 3e37)  # finite fp32, squares overflow nothing in float64
    honest = [swarm.delta() for _ in range(3)]
    history = History(norms=(float("nan"), float("inf"), -1.0, *swarm.history().norms))
    result = _screen(_candidates([nan, inf, zero, huge, *honest]), history, swarm.momentum)
    reasons = [v.reason for v in result.verdicts]
    assert reasons[0] == reasons[1] == "delta norm is not finite"
    assert reasons[2] == "delta is zero"
    assert "refuse bound" in reasons[3]
    assert [v.kept for v in result.verdicts[4:]] == [True] * 3
    assert math.isfinite(result.clip_norm)


def test_a_delta_of_another_layout_is_refused_not_raised() -> None:
    swarm = Swarm(12)
    odd = {"w": torch.ones(32, 64), "b": torch.ones(32)}
    extra = {**swarm.delta(), "x": torch.ones(3)}
    result = _screen(
        _candidates([odd, extra, swarm.delta()]), swarm.history(), swarm.momentum, swarm.params
    )
    assert [v.reason for v in result.verdicts[:2]] == ["delta layout differs from the fragment"] * 2
    assert result.verdicts[2].kept


# --- direction ---------------------------------------------------------------------------


def test_a_flipped_delta_is_refused_beside_two_honest_ones_without_momentum() -> None:
    swarm = Swarm(4)
    honest = [swarm.delta() for _ in range(3)]
    result = _screen(_candidates([_times(honest[0], -1.0), honest[1], honest[2]]))
    flipped, *others = result.verdicts
    assert not flipped.kept and "other deltas" in flipped.reason
    assert all(v.kept for v in others)


def test_a_flipped_delta_is_refused_alone_against_the_momentum() -> None:
    swarm = Swarm(5)
    honest = swarm.delta()
    result = _screen(_candidates([_times(honest, -1.0)]), swarm.history(), swarm.momentum)
    assert not result.verdicts[0].kept and "momentum" in result.verdicts[0].reason
    assert result.verdicts[0].momentum_cosine < RULES.momentum_min_cosine
    kept = _screen(_candidates([honest]), swarm.history(), swarm.momentum)
    assert kept.verdicts[0].kept and kept.verdicts[0].momentum_cosine > 0.1


def test_one_attacker_does_not_drag_honest_deltas_out_with_it() -> None:
    # Leave-one-out with the flipped delta inside: the honest cosines drop, but the worst
    # is refused first and the rest recomputed without it.
    swarm = Swarm(6)
    honest = [swarm.delta() for _ in range(4)]
    attack = _times(honest[0], -2.5)
    result = _screen(_candidates([attack, *honest[1:]]), swarm.history())
    assert [v.kept for v in result.verdicts] == [False, True, True, True]


@pytest.mark.parametrize("seed", range(10))
def test_honest_windows_are_kept_whole(seed: int) -> None:
    swarm = Swarm(100 + seed)
    for size in (1, 2, 3, 5, 8):
        result = _screen(
            _candidates([swarm.delta() for _ in range(size)]),
            swarm.history(),
            swarm.momentum,
            params=swarm.params,
        )
        assert result.refused == {}, result.refused
        assert all(v.scale == 1.0 for v in result.verdicts)


@pytest.fixture
def one_thread():
    """The tiny model trains fastest on one thread, and the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_honest_deltas_of_a_real_tiny_training_are_all_kept(
    tiny_config, tiny_corpus, one_thread
) -> None:
    """Three learners, three rounds of the tiny model, screened and merged as a
    synchronizer would: nothing refused, and the run learns."""
    config = replace(tiny_config, simulate={"learners": 3}, train={"total_steps": 30})
    base = build_model("tiny", seed=0, max_seq_len=config.model.seq_len)
    global_params = global_state_of(base)
    trainers = [
        InnerTrainer(copy.deepcopy(base), config.train, torch.device("cpu")) for _ in range(3)
    ]
    streams = learner_streams(config, tiny_corpus, 3)
    state, norms, tokens = OuterState(), [], []
    for round_id in range(3):
        candidates = []
        for rank, trainer in enumerate(trainers):
            load_params(trainer.model, global_params)
            claimed = sum(
                trainer.step(streams[rank]).tokens for _ in range(config.sync.inner_steps)
            )
            delta = pseudo_gradient(global_params, dict(trainer.model.named_parameters()))
            candidates.append(Candidate(f"learner{rank}", delta, claimed, config.sync.inner_steps))
        result = screen(
            candidates,
            History(tuple(norms[-12:]), tuple(tokens[-12:])),
            RULES,
            state.momentum,
            params=global_params,
            max_tokens_per_step=config.train.batch_size * config.model.seq_len,
            max_weight_share=config.outer.max_weight_share,
        )
        assert result.refused == {}, (round_id, result.refused)
        if round_id > 0:
            assert all(v.momentum_cosine > RULES.momentum_min_cosine for v in result.verdicts)
        merged = merge_screened(candidates, result, "token")
        outer_step(global_params, merged, state, lr=config.outer.lr, momentum=config.outer.momentum)
        norms += [v.merged_norm for v in result.kept]
        tokens += [v.tokens for v in result.kept]
    assert tokens == [config.sync.inner_steps * config.train.batch_size * config.model.seq_len] * 9


# --- tokens and weights --------------------------------------------------------------------


def test_token_claims_are_bounded_by_steps_history_and_window() -> None:
    history = (5000, 5120, 5120, 5200)
    assert bound_tokens([5120, 10**12], [10, 10], history, 2.0, 1024) == [5120, 10240]
    assert bound_tokens([10**12], [10**9], history, 2.0, 1024) == [10240]
    assert bound_tokens([9000], [2], history, 2.0, 1024) == [2048]  # two steps' worth
    # no history: the lower median of the window; a claim alone: its steps only
    assert bound_tokens([5120, 5120, 10**9], [10] * 3, [], 2.0, 10**6) == [5120, 5120, 10240]
    assert bound_tokens([10**9], [10], [], 2.0, 10**6) == [10**7]
    assert bound_tokens([-5, 100], [10, -1], [], 2.0, 1024) == [0, 0]


def test_two_sybils_claiming_a_billion_steps_get_no_more_than_the_cap() -> None:
    swarm = Swarm(7)
    honest = _candidates([swarm.delta() for _ in range(2)])
    sybils = [Candidate(f"sybil{i}", swarm.delta(), 10**12, 10**9) for i in range(2)]
    result = _screen([*honest, *sybils], swarm.history(), swarm.momentum, max_weight_share=0.5)
    weights = [v.weight for v in result.verdicts]
    assert math.fsum(weights) == pytest.approx(1.0)
    assert all(w <= 0.5 for w in weights)
    assert weights[2] + weights[3] < 1e-3  # the steps they claimed make their tokens thin
    # the best a Sybil can claim: the token bound at the densest step rate
    bound = 2 * TOKENS
    sybils = [
        Candidate(f"sybil{i}", swarm.delta(), bound, bound // MAX_TOKENS_PER_STEP) for i in range(2)
    ]
    result = _screen([*honest, *sybils], swarm.history(), swarm.momentum, max_weight_share=0.4)
    assert all(v.weight <= 0.4 + 1e-12 for v in result.verdicts)
    assert result.verdicts[2].tokens == bound


def test_work_less_claims_are_refused() -> None:
    swarm = Swarm(8)
    result = _screen(
        [Candidate("lazy", swarm.delta(), 0, 10), Candidate("idle", swarm.delta(), 100, 0)]
    )
    assert [v.reason for v in result.verdicts] == ["contribution claims no work"] * 2


# --- determinism -------------------------------------------------------------------------


def _bits(result: Screening) -> list[tuple]:
    def hexed(x):
        return None if x is None else float(x).hex()

    return [
        (
            v.peer,
            v.kept,
            v.reason,
            hexed(v.norm),
            hexed(v.scale),
            v.tokens,
            hexed(v.weight),
            hexed(v.momentum_cosine),
            hexed(v.loo_cosine),
        )
        for v in result.verdicts
    ]


def test_the_same_inputs_give_the_same_bits_and_order_does_not_matter() -> None:
    swarm = Swarm(9)
    deltas = [swarm.delta() for _ in range(5)]
    deltas[1] = _times(deltas[1], 7.0)  # clipped
    deltas[3] = _times(deltas[3], -1.0)  # refused
    candidates = [
        Candidate(f"peer{i}", d, TOKENS + 100 * i, STEPS + i, staleness=i % 2)
        for i, d in enumerate(deltas)
    ]
    kwargs = dict(params=swarm.params, max_weight_share=0.3, staleness_discount=0.5)
    history = swarm.history()
    first = _screen(candidates, history, swarm.momentum, **kwargs)
    second = _screen(copy.deepcopy(candidates), history, swarm.momentum, **kwargs)
    assert _bits(first) == _bits(second)
    assert first.verdicts[1].scale < 1.0 and not first.verdicts[3].kept
    for rule in ("token", "radial", "trimmed"):
        a = merge_screened(candidates, first, rule, trim_fraction=0.25)
        b = merge_screened(candidates, second, rule, trim_fraction=0.25)
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    order = list(range(5))
    random.Random(0).shuffle(order)
    shuffled = _screen(
        [candidates[i] for i in order],
        History(tuple(reversed(history.norms)), history.tokens),
        swarm.momentum,
        **kwargs,
    )
    assert _bits(shuffled) == [_bits(first)[i] for i in order]
    assert shuffled.clip_norm == first.clip_norm


def test_dot_is_symmetric_and_close_to_float64() -> None:
    generator = torch.Generator().manual_seed(10)
    a = {"x": torch.randn(100_003, generator=generator), "y": torch.randn(7, generator=generator)}
    b = {"y": torch.randn(7, generator=generator), "x": torch.randn(100_003, generator=generator)}
    assert dot(a, b) == dot(b, a)
    exact = sum(float(a[n].double() @ b[n].double()) for n in a)
    assert dot(a, b) == pytest.approx(exact, rel=1e-12)


def test_leave_one_out_cosines_match_the_pairwise_definition() -> None:
    generator = torch.Generator().manual_seed(11)
    deltas = [
        {"x": torch.randn(70_001, generator=generator), "y": torch.randn(5, generator=generator)}
        for _ in range(5)
    ]
    norms = [tensor_norm(d) for d in deltas]
    flat = [torch.cat([d["x"], d["y"]]).double() for d in deltas]
    units = [f / f.norm() for f in flat]
    got = loo_cosines(deltas, norms, range(5))
    for i in range(5):
        others = sum(units[j] for j in range(5) if j != i)
        expected = float(units[i] @ others / others.norm())
        assert got[i] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the order of summation is the caller's: another order, the same values to rounding
    assert loo_cosines(deltas, norms, [4, 2, 0, 1, 3]) == pytest.approx(got, rel=1e-12)


def test_leave_one_out_is_undefined_where_the_others_cancel_out() -> None:
    generator = torch.Generator().manual_seed(12)
    a = {"x": torch.randn(1000, generator=generator)}
    b = {"x": -a["x"]}
    c = {"x": torch.randn(1000, generator=generator)}
    deltas = [a, b, c]
    got = loo_cosines(deltas, [tensor_norm(d) for d in deltas], range(3))
    assert got[2] is None and got[0] is not None and got[1] is not None


# --- trimmed mean --------------------------------------------------------------------------


def test_trimmed_mean_drops_the_extremes_per_coordinate() -> None:
    deltas = [
        {"w": torch.tensor([1.0, 2.0, -3.0])},
        {"w": torch.tensor([2.0, 1000.0, -2.0])},
        {"w": torch.tensor([3.0, 3.0, -1000.0])},
        {"w": torch.tensor([-1000.0, 4.0, -4.0])},
    ]
    merged = trimmed_mean(deltas, 0.25)
    assert torch.equal(merged["w"], torch.tensor([1.5, 3.5, -3.5]))
    assert torch.equal(trimmed_mean(deltas[::-1], 0.25)["w"], merged["w"])
    assert torch.allclose(trimmed_mean(deltas, 0.0)["w"], merge_mean(deltas)["w"])
    with pytest.raises(ValueError):
        trimmed_mean(deltas, 0.5)


def test_trimmed_merge_applies_the_clip_scales() -> None:
    swarm = Swarm(11)
    candidates = _candidates([swarm.delta() for _ in range(4)] + [_times(swarm.delta(), 8.0)])
    result = _screen(candidates, swarm.history(), swarm.momentum)
    assert result.verdicts[4].kept and result.verdicts[4].scale < 1.0
    merged = merge_screened(candidates, result, "trimmed", trim_fraction=0.2)
    assert set(merged) == set(SHAPES) and all(torch.isfinite(t).all() for t in merged.values())


# --- rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_factor", 0.5),
        ("refuse_factor", 0.9),
        ("max_param_ratio", 0.0),
        ("history_rounds", 0),
        ("min_history", 0),
        ("momentum_min_cosine", 1.5),
        ("loo_min_cosine", -2.0),
        ("min_loo_peers", 2),
        ("token_factor", 0.5),
    ],
)
def test_rules_name_the_field_they_refuse(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"screening.{field}"):
        ScreeningRules(**{field: value})


# --- the same bits on every CPU ----------------------------------------------------------


def _portable_window() -> tuple[list[Candidate], History, dict[str, torch.Tensor]]:
    """Honest deltas, a flipped one and a blown-up one, from numpy's portable generator
    (torch.randn draws other numbers under other kernel sets)."""
    rng = np.random.default_rng(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    signal = randn(100_001)
    deltas = [{"w": signal + randn(100_001) * 1.5, "b": randn(17)} for _ in range(6)]
    deltas[2] = _times(deltas[2], -1.0)
    deltas[4] = _times(deltas[4], 7.0)
    momentum = {"w": signal + randn(100_001) * 2.0, "b": randn(17)}
    candidates = [
        Candidate(f"p{i}", d, 5000 + i, 10, staleness=i % 2) for i, d in enumerate(deltas)
    ]
    return candidates, History((700.0, 710.0, 690.0, 720.0), (5000,) * 4), momentum


def _worker() -> None:
    candidates, history, momentum = _portable_window()
    result = screen(
        candidates, history, RULES, momentum, max_tokens_per_step=1024, max_weight_share=0.3
    )
    print("capability", torch.backends.cpu.get_cpu_capability())
    print("verdicts", _bits(result))
    for rule in ("token", "radial", "trimmed"):
        merged = merge_screened(candidates, result, rule, trim_fraction=0.2)
        digest = hashlib.sha256(b"".join(merged[n].numpy().tobytes() for n in sorted(merged)))
        print("merge", rule, digest.hexdigest())


def _capabilities() -> list[str | None]:
    own = torch.backends.cpu.get_cpu_capability()
    return (
        [None, "default"]
        + (["avx2"] if own in ("AVX2", "AVX512") else [])
        + (["avx512"] if own == "AVX512" else [])
    )


def _run_worker(capability: str | None, threads: int = 1) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    env["OMP_NUM_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_screening_and_merges_are_the_same_bits_on_every_kernel_set() -> None:
    runs = {cap: _run_worker(cap) for cap in _capabilities()}
    runs["two threads"] = _run_worker(None, threads=2)
    assert runs["default"][0] == "capability DEFAULT"
    reference = runs[None]
    assert "False" in reference[1]  # the flipped delta was refused: the check has teeth
    for name, lines in runs.items():
        assert lines[1:] == reference[1:], f"{name} differs from the unset kernel set"


if __name__ == "__main__":
    _worker()
