"""The inner loop: schedule, devices, accumulation, clipping and that loss falls."""

from __future__ import annotations

import itertools

import pytest
import torch

from p2pdiloco.config import TrainConfig
from p2pdiloco.errors import DeviceError
from p2pdiloco.training.data import learner_batches
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import (
    InnerTrainer,
    evaluate,
    lr_at,
    make_inner_optimizer,
    resolve_device,
)


def test_schedule_warms_up_linearly_then_decays_to_the_floor() -> None:
    config = TrainConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(1e-4)
    assert lr_at(9, config) == pytest.approx(1e-3)
    assert lr_at(10, config) == pytest.approx(1e-3)
    assert lr_at(60, config) == pytest.approx(0.55e-3)
    assert lr_at(110, config) == pytest.approx(1e-4)
    assert lr_at(10_000, config) == pytest.approx(1e-4)
    values = [lr_at(s, config) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_no_warmup() -> None:
    assert lr_at(0, TrainConfig(lr=2e-3, warmup_steps=0, total_steps=10)) == pytest.approx(2e-3)


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            resolve_device("cuda")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        with pytest.raises(DeviceError, match=r"pip install 'p2pdiloco\[tpu\]'"):
            resolve_device("xla")


def test_weight_decay_only_on_matrices() -> None:
    groups = make_inner_optimizer(build_model("tiny"), TrainConfig(weight_decay=0.1)).param_groups
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0


def test_accumulation_counts_tokens_and_loss_falls(tiny_corpus) -> None:
    config = TrainConfig(
        device="cpu", batch_size=4, grad_accum=2, lr=3e-3, warmup_steps=2, total_steps=40
    )
    trainer = InnerTrainer(build_model("tiny", max_seq_len=64), config, torch.device("cpu"))
    batches = learner_batches(tiny_corpus, 0, 1, 4, 32, seed=0)
    eval_set = [next(learner_batches(tiny_corpus, 5, 1, 4, 32, seed=9)) for _ in range(2)]
    before = evaluate(trainer.model, eval_set, torch.device("cpu"))
    results = [trainer.step(batches) for _ in range(30)]
    assert all(r.tokens == 2 * 4 * 32 for r in results)
    assert trainer.step_index == 30
    assert evaluate(trainer.model, eval_set, torch.device("cpu")) < before - 1.0


def test_gradient_clipping_bounds_the_update() -> None:
    torch.manual_seed(0)
    config = TrainConfig(
        device="cpu", lr=0.5, warmup_steps=0, grad_clip=1e-6, weight_decay=0.0, beta1=0.0, beta2=0.0
    )
    trainer = InnerTrainer(build_model("tiny", max_seq_len=16), config, torch.device("cpu"))
    grads = []

    def record_and_step(*args, **kwargs):
        grads.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in trainer.model.parameters())))
        return original(*args, **kwargs)

    original = trainer.optimizer.step
    trainer.optimizer.step = record_and_step  # type: ignore[method-assign]
    trainer.step(iter([torch.randint(0, 256, (2, 17))]))
    assert float(grads[0]) <= 1e-6 * 1.01
