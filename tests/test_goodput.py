"""The goodput simulator (scripts/simulate_goodput.py): properties of the failure model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "simulate_goodput.py"
_spec = importlib.util.spec_from_file_location("simulate_goodput", SCRIPT)
sim = importlib.util.module_from_spec(_spec)
sys.modules["simulate_goodput"] = sim  # dataclasses look their module up by name
_spec.loader.exec_module(sim)

DAY_S = 86400.0
STRATEGIES = ["synchronous", "elastic", *(f"decoupled_M{m}" for m in sim.UNITS)]


def reference_outages(times, domain, duration_s, horizon_s):
    """The absorption rule, one failure at a time: (domain, start, end) of every outage."""
    found, down_until = [], {}
    for t, d, c in zip(times, domain, duration_s, strict=True):
        if t >= down_until.get(d, -1.0):
            down_until[d] = t + c
            found.append((d, t, min(t + c, horizon_s)))
    return found


@pytest.mark.parametrize("seed", range(5))
def test_outages_absorb_failures_while_down_like_a_plain_loop(seed) -> None:
    rng = np.random.default_rng(seed)
    times, domain = sim.poisson_failures(rng, 7, 1.0, 1000.0, 20.0)
    cost = rng.uniform(1.0, 60.0, len(times))
    out = sim.outages(times, domain, cost, 1000.0, 4.0)
    got = list(zip(out.domain.tolist(), out.start_s.tolist(), out.end_s.tolist(), strict=True))
    assert got == reference_outages(times, domain, cost, 1000.0)
    assert 0 < len(got) < len(times)  # some failures were absorbed, not all


def test_chain_follows_next_pointers_to_the_end() -> None:
    nxt = np.array([2, 3, 5, 4, 6, 6])  # 0 -> 2 -> 5 -> end
    assert sim.chain_from_first(nxt).tolist() == [0, 2, 5]
    assert sim.chain_from_first(np.array([], dtype=np.int64)).tolist() == []


def test_a_merge_needs_the_quorum_of_units_up() -> None:
    # Unit 0 down [10, 15), unit 1 down [12, 17): with K = 2 nothing merges from 10 to 17.
    times, dom, cost = np.array([10.0, 12.0]), np.array([0, 1]), np.array([5.0, 5.0])
    k1 = sim.unit_time(times, dom, cost, 2, 1, 30.0, np.inf)
    k2 = sim.unit_time(times, dom, cost, 2, 2, 30.0, np.inf)
    assert k1.live_s == pytest.approx(60.0 - 10.0)
    assert k1.useful_s == pytest.approx(50.0 - 10.0 - 12.0)  # lost: all since t = 0
    assert k2.useful_s == pytest.approx(k1.useful_s - 2.0 - 2.0)  # [10,12) and [15,17): 1 up


def test_without_failures_or_stragglers_every_strategy_trains_all_the_time() -> None:
    params = sim.Params(mtbi_chip_s=1e30, jitter=0.0)
    for strategy in STRATEGIES:
        assert sim.goodput(strategy, 1_200_000, DAY_S, params, 0) == pytest.approx(1.0)


def test_stragglers_alone_cost_the_expected_max_of_the_chips() -> None:
    params = sim.Params(jitter=0.001)
    n = 10_000
    expected = 1.0 / (1.0 + params.jitter * np.sum(1.0 / np.arange(1, n + 1)))  # E max = H_n
    got = sim.straggler_factor(np.random.default_rng(0), n, params, 200_000)
    assert got == pytest.approx(expected, abs=2e-4)


def test_synchronous_goodput_falls_with_every_doubling_of_chips() -> None:
    values = [sim.goodput("synchronous", c, DAY_S, sim.Params(), 0) for c in sim.CHIPS]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize("chips", [600_000, 1_200_000, 2_400_000])
def test_decoupled_beats_elastic_beats_synchronous_at_scale(chips) -> None:
    g = {s: sim.goodput(s, chips, DAY_S, sim.Params(), 0) for s in STRATEGIES}
    assert g["decoupled_M8"] > g["elastic"] > g["synchronous"]
    assert g["decoupled_M16"] > g["decoupled_M8"] > g["decoupled_M4"] > g["decoupled_M2"]


def test_shorter_recovery_and_rarer_failures_both_help() -> None:
    base = sim.Params()
    for strategy in ("synchronous", "elastic", "decoupled_M8"):
        g = sim.goodput(strategy, 1_200_000, DAY_S, base, 0)
        assert sim.goodput(strategy, 1_200_000, DAY_S, base.scaled_recovery(0.5), 0) > g
        rarer = dataclasses.replace(base, mtbi_chip_s=2 * base.mtbi_chip_s)
        assert sim.goodput(strategy, 1_200_000, DAY_S, rarer, 0) > g


def test_a_seed_fixes_every_figure() -> None:
    params = sim.Params()
    for strategy in STRATEGIES:
        a = sim.goodput(strategy, 300_000, DAY_S, params, 7)
        assert sim.goodput(strategy, 300_000, DAY_S, params, 7) == a
    other = [sim.goodput(s, 300_000, DAY_S, params, 8) for s in STRATEGIES]
    assert other != [sim.goodput(s, 300_000, DAY_S, params, 7) for s in STRATEGIES]


def test_default_parameters_keep_the_shape_of_the_papers_table() -> None:
    for strategy, reference in sim.PAPER.items():
        for chips, paper in zip(sim.CHIPS, reference, strict=True):
            assert sim.goodput(strategy, chips, 2 * DAY_S, sim.Params(), 0) == pytest.approx(
                paper, abs=0.06
            ), (strategy, chips)


def test_quick_run_writes_the_table_the_paper_and_the_calibration(tmp_path) -> None:
    out = tmp_path / "goodput.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("simulate_goodput quick:")
    report = json.loads(out.read_text())
    chips = [str(c) for c in sim.CHIPS]
    assert set(report["goodput"]) == set(STRATEGIES)
    assert all(list(row) == chips for row in report["goodput"].values())
    assert set(report["paper"]) == set(report["abs_diff"]) == set(sim.PAPER)
    for strategy, row in report["abs_diff"].items():
        for c in chips:
            assert row[c] == pytest.approx(
                abs(report["goodput"][strategy][c] - report["paper"][strategy][c])
            )
    for label in ("decoupled", "synchronous"):
        assert {"replay", "poisson", "measured"} <= set(report["calibration"][label])
    assert report["wall_s_per_chips"]["1200000"] < 60.0
    assert {"max_abs_diff", "params", "sensitivity_1.2M", "wall_s"} <= set(report)
