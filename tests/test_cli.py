"""The command line as a user runs it: a real process, one-line errors, exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True, timeout=timeout
    )


def test_simulate_writes_json(tmp_path) -> None:
    out = tmp_path / "sim.json"
    proc = run_cli(
        "simulate",
        "--model",
        "tiny",
        "--learners",
        "2",
        "--rounds",
        "2",
        "--inner-steps",
        "5",
        "--set",
        "data.max_files=60",
        "--set",
        "model.seq_len=32",
        "--set",
        "train.batch_size=2",
        "--set",
        "simulate.eval_batches=1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["learners"] == 2 and figures["rounds"] == 2
    assert figures["comm_reduction"] == pytest.approx(5.0)
    assert proc.stdout.strip().splitlines()[-1].startswith("loss_ratio=")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--set", "sync.min_quorum=0"], "sync.min_quorum must be >= 1"),
        (["simulate", "--set", "bogus.x=1"], "unknown config section [bogus]"),
        (["simulate", "--config", "/nonexistent/run.toml"], "does not exist"),
        (
            ["simulate", "--set", "data.source='/nonexistent/corpus'"],
            "data source /nonexistent/corpus does not exist",
        ),
        (["simulate", "--set", "train.device='cuda'"], "cuda"),
        (["simulate", "--learners", "zero"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(args, message) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr


def test_config_prints_effective_toml() -> None:
    proc = run_cli("config", "--set", "sync.inner_steps=33")
    assert proc.returncode == 0
    assert "inner_steps = 33" in proc.stdout
