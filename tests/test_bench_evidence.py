"""The pure parts of the evidence benchmarks (scripts/bench_wan.py, scripts/bench_memory.py):
how a speed-up crossing and a time to target are read, and one real merge measurement."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


bench_wan = _load("bench_wan")
bench_memory = _load("bench_memory")


def test_the_crossing_rate_is_interpolated_on_log_scales() -> None:
    # 100x at 10 Mbit/s and 1x at 1000: 10x half-way in log rate, at 100 Mbit/s
    assert bench_wan.crossing([10, 1000], [100.0, 1.0]) == pytest.approx(100.0)
    assert bench_wan.crossing([10, 100, 1000], [40.0, 20.0, 5.0]) == pytest.approx(
        100 * 10 ** (1 / 2), rel=1e-9
    )
    assert bench_wan.crossing([10, 100], [20.0, 15.0]) is None  # never crosses
    assert bench_wan.crossing([10, 100], [None, 5.0]) is None  # a rate without a figure


def test_time_to_target_is_the_first_point_at_or_below_it() -> None:
    curve = [{"t": 0, "eval_loss": 5.0}, {"t": 10, "eval_loss": 2.0}, {"t": 20, "eval_loss": 1.5}]
    assert bench_wan.time_to(curve, 2.0) == 10
    assert bench_wan.time_to(curve, 1.0) is None


@pytest.mark.parametrize("setting", [bench_wan.QUICK, bench_wan.FULL])
def test_ddp_and_the_swarm_train_and_evaluate_on_the_same_data(setting) -> None:
    """Both systems must read the same corpus, held-out split, batch and lr schedule (DDP
    once loaded only the setting's own fields, so it trained and was evaluated on the
    whole standard library while the peers read 600 files of it)."""
    from p2pdiloco.config import load_config

    ddp = load_config(overrides=[f"model.preset='{setting['preset']}'", *bench_wan.ddp_sets(setting)])
    peers = load_config(overrides=bench_wan.diloco_sets(setting))
    assert (ddp.data, ddp.model, ddp.train) == (peers.data, peers.model, peers.train)
    assert ddp.data.max_files == 600


def test_an_earlier_ddp_run_is_reused_only_when_it_ran_this_config(tmp_path) -> None:
    setting = bench_wan.FULL
    ddp = {"steps": setting["ddp_steps"], "curve": [], "lone_step_s": 0.5}
    good = {"setting": "full", "preset": "small", "ddp": ddp, "ddp_sets": bench_wan.ddp_sets(setting)}
    path = tmp_path / "wan.json"
    path.write_text(json.dumps(good))
    assert bench_wan.reusable_ddp(path, "full", setting) == ddp
    for bad in (
        {**good, "ddp_sets": None},  # written before DDP read the peers' corpus
        {**good, "ddp_sets": [*bench_wan.ddp_sets(setting), "train.lr=0.01"]},
        {**good, "setting": "quick"},
        {**good, "ddp": {**ddp, "steps": 3}},
        {**good, "ddp": "garbage"},
    ):
        path.write_text(json.dumps(bad))
        assert isinstance(bench_wan.reusable_ddp(path, "full", setting), str), bad
    path.write_text("{not json")
    assert "not a bench_wan JSON" in bench_wan.reusable_ddp(path, "full", setting)
    path.write_text("[1, 2]")
    assert isinstance(bench_wan.reusable_ddp(path, "full", setting), str)


def test_bench_wan_refuses_to_run_without_root_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_wan.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["bench_wan.py", "--quick"])
    assert bench_wan.main() == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "root" in err


def test_a_lazy_window_holds_a_quarter_of_an_eager_one() -> None:
    """One real measurement, as the benchmark takes it (its own process)."""
    rows = {}
    for mode in ("lazy", "eager"):
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "bench_memory.py"), "--merge-worker", "tiny", "3", mode],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    lazy, eager = rows["lazy"], rows["eager"]
    assert eager["held_exact_bytes"] == 3 * 4 * eager["parameters"]
    assert lazy["held_exact_bytes"] < 0.3 * eager["held_exact_bytes"]
    assert lazy["contributions"] == 3


study_quality = _load("study_quality")


def test_a_study_variant_reaches_its_target_at_its_first_evaluation_below_it() -> None:
    assert study_quality.time_to_target([0.0, 5.0, 9.0], [3.0, 2.0, 1.0], 2.0) == 5.0
    assert study_quality.time_to_target([0.0, 5.0], [3.0, 2.5], 2.0) is None
    # every H variant keeps the setting's inner steps, so all compare at equal tokens
    assert "h_10" in study_quality.variants_for("study")
    assert "h13_int4" in study_quality.variants_for("full")
    for setting in study_quality.SETTINGS:
        steps = dict(s.split("=") for s in study_quality.SETTINGS[setting] if "=" in s)
        total = int(steps["sync.inner_steps"]) * int(steps["simulate.rounds"])
        for name, overrides in study_quality.variants_for(setting).items():
            fields = dict(s.split("=") for s in overrides)
            h = int(fields.get("sync.inner_steps", steps["sync.inner_steps"]))
            rounds = int(fields.get("simulate.rounds", steps["simulate.rounds"]))
            assert h * rounds == total, (setting, name)
