"""The XLA check (scripts/check_xla.py) and the inner step on XLA.

Its bookkeeping is tested everywhere; the inner step itself only where torch_xla is
installed (the XLA environment of scripts/setup_xla_env.sh, with PJRT_DEVICE=CPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2pdiloco.config import TrainConfig
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_xla.py"
_spec = importlib.util.spec_from_file_location("check_xla", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

HAS_XLA = importlib.util.find_spec("torch_xla") is not None


def step(n: int, t: float = 0.0) -> dict:
    return {"event": "step", "step": n, "t": t}


def test_warm_up_ends_at_the_first_step_after_every_fragment_came_back_and_was_evaluated() -> None:
    events = [
        {"event": "eval"},
        step(10),
        {"event": "applied", "fragment": 0},
        {"event": "eval"},  # fragment 1 has not come back yet: its write graph is not compiled
        step(20),
        {"event": "applied", "fragment": 1},
        step(30),
        {"event": "applied", "fragment": 0},
        {"event": "eval"},
        step(40),
    ]
    assert check.warm_step(events, num_fragments=2) == 40
    with pytest.raises(RuntimeError, match="never warmed up"):
        check.warm_step(events[:6], num_fragments=2)


def test_expected_reads_count_ships_evals_and_log_points_after_the_warm_step() -> None:
    events = [
        {"event": "shipped", "fragment": 0},  # before the window: not counted
        step(10),
        {"event": "shipped", "fragment": 0},
        {"event": "shipped", "fragment": 1},
        {"event": "eval"},
        step(20),
        {"event": "resent", "fragment": 1},  # a resend reads nothing: the delta is on the host
        {"event": "shipped", "fragment": 1},
        step(30),
        {"event": "shipped", "fragment": 0},  # after the last step event: not counted
    ]
    tensors_of = {0: 14, 1: 16}
    assert check.expected_reads(events, 10, tensors_of, eval_batches=2) == 14 + 16 + 2 + 2


def test_step_times_are_seconds_per_step_between_log_points() -> None:
    events = [step(10, 0.0), step(20, 1.0), step(30, 3.0)]
    assert check.step_times_s(events, 20) == [pytest.approx(0.2)]


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_the_check_says_how_to_get_torch_xla_when_it_is_missing() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "scripts/setup_xla_env.sh" in done.stdout


@pytest.mark.skipif(not HAS_XLA, reason="needs torch_xla (scripts/setup_xla_env.sh)")
def test_xla_inner_steps_compile_once_and_never_read_the_device() -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from p2pdiloco.training.devices import device_stats
    from p2pdiloco.training.train import resolve_device

    device = resolve_device("xla")
    config = TrainConfig(device="xla", batch_size=2, warmup_steps=2, total_steps=50)
    trainer = InnerTrainer(build_model("tiny", max_seq_len=16), config, device)
    generator = torch.Generator().manual_seed(0)
    batches = iter(lambda: torch.randint(0, 256, (2, 17), generator=generator), None)
    names = [n for n, _ in trainer.model.named_parameters()][:3]

    def write_some() -> None:
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if name in names:
                    p.copy_(torch.zeros(p.shape).to(device))
        trainer.params_written(names)

    for _ in range(3):  # warm-up: the step graph, a write, a loss read
        trainer.step(batches)
    write_some()
    assert trainer.read_loss() is not None
    before = device_stats(device)
    for _ in range(5):
        trainer.step(batches)
    write_some()
    trainer.step(batches)
    after_steps = device_stats(device)
    loss = trainer.read_loss()
    after_read = device_stats(device)
    assert after_steps["xla_compiles"] == before["xla_compiles"]
    assert after_steps["xla_host_reads"] == before["xla_host_reads"], "a step read the device"
    assert after_read["xla_host_reads"] == after_steps["xla_host_reads"] + 1
    assert loss is not None and loss > 0
    staged = trainer.host.stage(dict(trainer.model.named_parameters())).wait()
    assert all(t.device.type == "cpu" for t in staged.values())
