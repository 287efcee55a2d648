"""The in-process simulator: both runs learn, on equal tokens, with the bytes accounted."""

from __future__ import annotations

import pytest

from p2pdiloco.config import replace
from p2pdiloco.sim.simulate import simulate
from p2pdiloco.training.model import build_model, count_parameters


def test_diloco_and_sync_both_learn_on_equal_tokens(tiny_config, tiny_corpus) -> None:
    result = simulate(tiny_config, corpus=tiny_corpus)
    assert result.diloco.tokens == result.sync.tokens
    assert result.tokens == 2 * 3 * 10 * 4 * 64
    assert result.diloco_eval_loss < result.diloco.eval_loss[0] - 1.0
    assert result.sync_eval_loss < result.sync.eval_loss[0] - 1.0
    params = count_parameters(build_model("tiny"))
    assert result.diloco_bytes_per_learner == 3 * params * 4
    assert result.sync_bytes_per_learner == 30 * params * 4
    assert result.comm_reduction == pytest.approx(10.0)


@pytest.mark.parametrize("rule", ["mean", "radial"])
def test_every_merge_rule_trains(tiny_config, tiny_corpus, rule) -> None:
    config = replace(tiny_config, outer={"merge": rule}, simulate={"baseline": False, "rounds": 2})
    result = simulate(config, corpus=tiny_corpus)
    assert result.sync is None and result.comm_reduction > 0
    assert result.diloco_eval_loss < result.diloco.eval_loss[0] - 0.5


def test_one_learner_with_outer_lr_one_and_no_momentum_equals_plain_training(
    tiny_config, tiny_corpus
) -> None:
    # DiLoCo with M=1, outer SGD(lr=1, mu=0) is just the inner optimizer run for H*T steps.
    config = replace(
        tiny_config,
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        simulate={"learners": 1, "rounds": 2},
    )
    result = simulate(config, corpus=tiny_corpus)
    assert result.diloco.eval_loss == pytest.approx(result.sync.eval_loss, rel=1e-4)


def test_codec_channel_sends_fewer_bytes_and_still_trains(tiny_config, tiny_corpus) -> None:
    from p2pdiloco.sim.simulate import codec_channel

    config = replace(tiny_config, simulate={"baseline": False, "rounds": 2})
    fp32 = simulate(config, corpus=tiny_corpus)
    int8 = simulate(config, corpus=tiny_corpus, channel=codec_channel(config, "int8"))
    assert int8.diloco_bytes_per_learner < 0.3 * fp32.diloco_bytes_per_learner
    assert int8.diloco_eval_loss == pytest.approx(fp32.diloco_eval_loss, rel=0.02)


def test_a_warm_start_adds_short_rounds_and_keeps_the_total_steps(tiny_config, tiny_corpus) -> None:
    from p2pdiloco.sim.simulate import round_lengths

    config = replace(tiny_config, sync={"warm_steps": 4, "warm_inner_steps": 2})
    # 30 steps in all: 2 warm rounds of 2, then as many rounds of H = 10 as fit in 26
    assert round_lengths(config) == [2, 2, 10, 10]
    assert round_lengths(tiny_config) == [10, 10, 10]
    warm = simulate(replace(config, simulate={"baseline": False}), corpus=tiny_corpus)
    assert warm.tokens == 2 * 24 * 4 * 64  # 2 learners x 24 steps x batch 4 x 64 tokens
    assert warm.diloco_bytes_per_learner == 4 * count_parameters(build_model("tiny")) * 4
    assert len(warm.diloco.eval_loss) == 1 + 4


def test_the_baseline_takes_its_own_learning_rate_when_given_one(tiny_config, tiny_corpus) -> None:
    from p2pdiloco.sim.simulate import run_sync_baseline
    from p2pdiloco.training.data import heldout_batches

    config = replace(tiny_config, simulate={"rounds": 1})
    eval_set = heldout_batches(tiny_corpus, 2, 4, 64)
    plain = run_sync_baseline(config, tiny_corpus, eval_set)[0].eval_loss
    same = replace(config, simulate={"baseline_lr": config.train.lr})
    assert run_sync_baseline(same, tiny_corpus, eval_set)[0].eval_loss == plain
    other = replace(config, simulate={"baseline_lr": 3 * config.train.lr})
    assert run_sync_baseline(other, tiny_corpus, eval_set)[0].eval_loss != plain
