"""Goodput simulator: synchronous DP, elastic DP and Decoupled DiLoCo under chip failures.

A discrete-event model of N chips over a horizon of training time (docs/goodput.md has
the model and every assumption). Chip failures are Poisson processes (one chip: mean time
between interruptions `mtbi_chip_s`, one year by default), superposed per failure domain:

    synchronous   one domain of N chips: a failure stops everyone for detection + a
                  whole-job restart, and the job resumes from its last in-memory snapshot
    elastic       N / slice_chips replicas: a failure pauses everyone for detection +
                  reconfiguration (the in-flight step is lost), the others go on without
                  the failed replica, which is re-admitted (one more pause) at the next
                  re-admission point after its repair
    decoupled M   M learner units of N / M chips: a failure stops its unit only (detection
                  + unit restart, back to its last snapshot); merges go on with the units
                  that are up; the whole run stalls only while fewer than `quorum` are up

A failure in a scope that is already down is absorbed by the recovery under way. Every
synchronous step waits for its slowest chip (per-chip jitter, exponential tail); decoupled
units do not wait for each other. Goodput = useful training progress / (N chips x horizon).

    python scripts/simulate_goodput.py [--quick] [--json PATH] [--seed S] [--days D]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

YEAR_S = 365.0 * 86400.0
CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
UNITS = [2, 4, 8, 16]
# Decoupled DiLoCo (arXiv 2604.21428) Table 1 as reported (design.md): goodput per chip count.
PAPER = {
    "synchronous": [0.72, 0.57, 0.38, 0.27, 0.18],
    "elastic": [0.88, 0.80, 0.69, 0.58, 0.40],
    "decoupled_M8": [0.98, 0.96, 0.94, 0.88, 0.80],
    "decoupled_M16": [0.99, 0.98, 0.96, 0.93, 0.86],
}


@dataclass(frozen=True)
class Params:
    """Every knob of the model (seconds unless named otherwise); defaults: docs/goodput.md."""

    mtbi_chip_s: float = YEAR_S  # mean time between interruptions of one chip
    step_s: float = 4.0  # one training step with no straggler
    snapshot_every_s: float = 4.0  # in-memory snapshot cadence (a restart loses the rest)
    detect_s: float = 10.0  # failure -> noticed (collective or heartbeat timeout)
    job_restart_s: float = 50.0  # synchronous: whole-job restart, median (lognormal)
    unit_restart_s: float = 14.0  # decoupled: one unit's restart + state fetch, median
    restart_sigma: float = 0.5  # lognormal shape of every restart and repair time
    reconfigure_s: float = 5.0  # elastic: rebuild the collective without / with a replica
    slice_chips: int = 2048  # elastic: chips per data-parallel replica
    repair_s: float = 30.0  # elastic: failed replica ready to rejoin, median (lognormal)
    readmit_every_s: float = 1800.0  # elastic: re-admission cadence (0: as soon as ready)
    jitter: float = 0.0004  # straggler: a chip's step takes step_s * (1 + Exp(jitter))
    quorum: int = 1  # decoupled: units whose deltas a merge needs (paper default K = 1)

    def scaled_recovery(self, factor: float) -> Params:
        """Every recovery duration (detection, restarts, repair, reconfiguration) x factor."""
        names = ["detect_s", "job_restart_s", "unit_restart_s", "reconfigure_s", "repair_s"]
        return dataclasses.replace(self, **{n: getattr(self, n) * factor for n in names})


# --- failure domains ----------------------------------------------------------------------


def poisson_failures(
    rng: np.random.Generator,
    num_domains: int,
    chips_per_domain: float,
    horizon_s: float,
    mtbi_chip_s: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Failure times and their domain, sorted by (domain, time): each domain a Poisson
    process of rate chips_per_domain / mtbi_chip_s (chips fail independently)."""
    counts = rng.poisson(chips_per_domain / mtbi_chip_s * horizon_s, size=num_domains)
    domain = np.repeat(np.arange(num_domains), counts)
    times = rng.uniform(0.0, horizon_s, size=int(counts.sum()))
    order = np.lexsort((times, domain))
    return times[order], domain[order]


def lognormal(rng: np.random.Generator, median_s: float, sigma: float, size: int) -> np.ndarray:
    """Durations (s) with the given median and log-space standard deviation."""
    return median_s * np.exp(sigma * rng.standard_normal(size))


def chain_from_first(nxt: np.ndarray) -> np.ndarray:
    """Indices reached from index 0 by following `nxt` (nxt[i] > i; len(nxt) means past the
    end), in order. Pointer doubling: log2(chain length) numpy passes, no loop over events."""
    n = len(nxt)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    jump = np.append(nxt, n)  # past the end maps to itself
    nodes = np.zeros(1, dtype=np.int64)
    while True:
        # nodes = {nxt^k(0) : k < L}, jump = nxt^L  ->  append {nxt^k(0) : L <= k < 2L}
        ahead = jump[nodes]
        ahead = ahead[ahead < n]
        if len(ahead) == 0:
            return nodes
        nodes = np.concatenate([nodes, ahead])
        jump = jump[jump]


@dataclass
class Outages:
    """The outages of a set of failure domains, clipped to [0, horizon_s]."""

    first: np.ndarray  # index of the failure (in the input) that started each outage
    start_s: np.ndarray
    end_s: np.ndarray
    domain: np.ndarray
    lost_s: np.ndarray  # progress since the domain's last snapshot, lost at each outage

    def down_s(self, num_domains: int) -> np.ndarray:
        """Time each domain spent down."""
        return np.bincount(self.domain, self.end_s - self.start_s, minlength=num_domains)


def outages(
    times: np.ndarray,
    domain: np.ndarray,
    duration_s: np.ndarray,
    horizon_s: float,
    snapshot_every_s: float,
) -> Outages:
    """Which failures start an outage and what each costs. `times` sorted by (domain, time);
    a failure while its domain is down is absorbed by the recovery under way. The domains
    are laid end to end on one time axis, each shifted past the longest outage of the one
    before, so that one chain walks all of them."""
    if len(times) == 0:
        empty = np.zeros(0)
        return Outages(np.zeros(0, np.int64), empty, empty, np.zeros(0, np.int64), empty)
    span = horizon_s + float(duration_s.max()) + 1.0
    key = domain * span + times
    nxt = np.searchsorted(key, key + duration_s, side="right")  # first failure after it ends
    first = chain_from_first(nxt)
    start, dom = times[first], domain[first]
    end = np.minimum(start + duration_s[first], horizon_s)
    prev_end = np.concatenate([[0.0], end[:-1]])
    prev_end[np.r_[True, dom[1:] != dom[:-1]]] = 0.0  # a domain's first outage: up since 0
    lost = np.mod(start - prev_end, snapshot_every_s)  # restored from a snapshot every so often
    return Outages(first, start, end, dom, lost)


def up_count(out: Outages, num_domains: int, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Breakpoints 0 = t_0 <= ... <= t_k = horizon_s and the number of domains up on each
    segment [t_i, t_i+1)."""
    t = np.concatenate([out.start_s, out.end_s])
    delta = np.concatenate([-np.ones(len(out.start_s)), np.ones(len(out.end_s))])
    order = np.argsort(t, kind="stable")
    bounds = np.concatenate([[0.0], t[order], [horizon_s]])
    up = num_domains + np.concatenate([[0.0], np.cumsum(delta[order])])
    return bounds, up


def straggler_factor(rng: np.random.Generator, chips: float, p: Params, samples: int) -> float:
    """step_s / mean step time when every step waits for the slowest of `chips` chips, each
    taking step_s * (1 + Exp(jitter)). The max of n Exp(1) is drawn exactly by inverting its
    CDF (1 - e^-x)^n, so no per-chip array is built."""
    if p.jitter == 0.0:
        return 1.0
    u = rng.random(samples)
    worst = -np.log(-np.expm1(np.log(u) / chips))
    return float(1.0 / np.mean(1.0 + p.jitter * worst))


# --- the three strategies -----------------------------------------------------------------


def synchronous(rng: np.random.Generator, chips: int, horizon_s: float, p: Params) -> float:
    """One domain: every failure stops the whole job for detection + a job restart."""
    times, dom = poisson_failures(rng, 1, chips, horizon_s, p.mtbi_chip_s)
    cost = p.detect_s + lognormal(rng, p.job_restart_s, p.restart_sigma, len(times))
    out = outages(times, dom, cost, horizon_s, p.snapshot_every_s)
    useful = horizon_s - out.down_s(1)[0] - out.lost_s.sum()
    return max(useful, 0.0) / horizon_s * straggler_factor(rng, chips, p, 4096)


@dataclass(frozen=True)
class UnitTime:
    """Unit-seconds of a decoupled run: merged progress and time the units were up."""

    useful_s: float
    live_s: float
    total_s: float  # units x horizon


def unit_time(
    times: np.ndarray,
    dom: np.ndarray,
    cost_s: np.ndarray,
    units: int,
    quorum: int,
    horizon_s: float,
    snapshot_every_s: float,
) -> UnitTime:
    """Given the failures of M units and their recovery times: a down unit contributes
    nothing, merges go on while >= quorum units are up, and the whole run stalls (the up
    units' progress is not merged) while fewer are."""
    out = outages(times, dom, cost_s, horizon_s, snapshot_every_s)
    bounds, up = up_count(out, units, horizon_s)
    stalled = up < min(quorum, units)
    stalled_s = float(np.sum((up * np.diff(bounds))[stalled]))
    live = units * horizon_s - float(out.down_s(units).sum())
    useful = max(live - float(out.lost_s.sum()) - stalled_s, 0.0)
    return UnitTime(useful, live, units * horizon_s)


def decoupled(
    rng: np.random.Generator, chips: int, units: int, horizon_s: float, p: Params
) -> float:
    """M units of N / M chips: a failure stops its unit only."""
    times, dom = poisson_failures(rng, units, chips / units, horizon_s, p.mtbi_chip_s)
    cost = p.detect_s + lognormal(rng, p.unit_restart_s, p.restart_sigma, len(times))
    ut = unit_time(times, dom, cost, units, p.quorum, horizon_s, p.snapshot_every_s)
    factors = [straggler_factor(rng, chips / units, p, 1024) for _ in range(units)]
    return ut.useful_s / ut.total_s * float(np.mean(factors))  # units never wait for each other


def elastic(rng: np.random.Generator, chips: int, horizon_s: float, p: Params) -> float:
    """Replicas of slice_chips: the job trains on the replicas present, and pauses for every
    departure (detection + reconfiguration, in-flight step lost) and re-admission point."""
    num_slices = max(1, round(chips / p.slice_chips))
    times, dom = poisson_failures(rng, num_slices, chips / num_slices, horizon_s, p.mtbi_chip_s)
    ready = times + p.detect_s + lognormal(rng, p.repair_s, p.restart_sigma, len(times))
    readmit = ready
    if p.readmit_every_s > 0:  # ready replicas wait for the next re-admission point
        readmit = np.ceil(ready / p.readmit_every_s) * p.readmit_every_s
    absent = outages(times, dom, readmit - times, horizon_s, np.inf)
    bounds, up = up_count(absent, num_slices, horizon_s)
    share = up / num_slices  # of the ideal throughput, on each segment
    progress = np.concatenate([[0.0], np.cumsum(share * np.diff(bounds))])  # at each bound

    # Global pauses: every departure, and every re-admission point with replicas waiting.
    # A pause that begins during another is absorbed by it.
    joins = np.unique(absent.end_s[absent.end_s < horizon_s])
    leaves = absent.start_s
    pause_t = np.concatenate([leaves, joins])
    pause_cost = np.concatenate(
        [np.full(len(leaves), p.detect_s + p.reconfigure_s), np.full(len(joins), p.reconfigure_s)]
    )
    departure = np.arange(len(pause_t)) < len(leaves)
    order = np.argsort(pause_t, kind="stable")
    pause_t, pause_cost, departure = pause_t[order], pause_cost[order], departure[order]
    pauses = outages(pause_t, np.zeros(len(pause_t), np.int64), pause_cost, horizon_s, p.step_s)
    at = lambda t: np.interp(t, bounds, progress)  # noqa: E731
    paused = float(np.sum(at(pauses.end_s) - at(pauses.start_s)))
    # A departure loses the step in flight on every replica present (time since the last
    # resume, modulo step_s); a re-admission waits for a step boundary and loses nothing.
    seg = np.clip(np.searchsorted(bounds, pauses.start_s, side="right") - 1, 0, len(share) - 1)
    lost = float(np.sum((pauses.lost_s * share[seg])[departure[pauses.first]]))
    useful = max(progress[-1] - paused - lost, 0.0)
    return useful / horizon_s * straggler_factor(rng, chips, p, 4096)


STRATEGY_CODE = {"synchronous": 1, "elastic": 2, **{f"decoupled_M{m}": 10 + m for m in UNITS}}


def goodput(strategy: str, chips: int, horizon_s: float, p: Params, seed: int) -> float:
    """One cell of the table; its own random stream, so a cell does not depend on the others."""
    rng = np.random.default_rng([seed, chips, STRATEGY_CODE[strategy]])
    if strategy == "synchronous":
        return synchronous(rng, chips, horizon_s, p)
    if strategy == "elastic":
        return elastic(rng, chips, horizon_s, p)
    return decoupled(rng, chips, int(strategy.removeprefix("decoupled_M")), horizon_s, p)


# --- calibration against scripts/bench_chaos.py ---------------------------------------------


@dataclass(frozen=True)
class ChaosSetting:
    """A bench_chaos setting, read from scripts/bench_chaos.py and docs/benchmarks.md."""

    name: str
    learners: int
    phase_s: float  # chaos phase
    kill_every_s: float  # one learner of the swarm SIGKILLed every T seconds
    down_s: float  # killed -> restarted
    rejoin_s: float = 7.0  # restart -> first applied round (measured median)
    checkpoint_every_s: float = 2.0  # --checkpoint-every-s

    def kill_times_s(self) -> list[float]:
        """T/2, 3T/2, ... while the restart still falls in the phase (bench_chaos.kill_offsets)."""
        kills, k = [], 0
        while (k + 0.5) * self.kill_every_s + self.down_s <= self.phase_s:
            kills.append((k + 0.5) * self.kill_every_s)
            k += 1
        return kills


CHAOS_QUICK = ChaosSetting("quick", learners=4, phase_s=25.0, kill_every_s=8.0, down_s=3.0, rejoin_s=7.0)
CHAOS_FULL = ChaosSetting("full", learners=6, phase_s=120.0, kill_every_s=20.0, down_s=10.0, rejoin_s=15.3)
# Measured (docs/benchmarks.md, "Chaos"; docs/chaos_quick.json, docs/chaos_full.json): the
# paper's goodput in the chaos phase and in the fault-free warm-up, decoupled at the embedded
# default's K = 1, synchronous at K = N.
CHAOS_MEASURED = {
    "quick": {"decoupled": (0.733, 0.803), "synchronous": (0.159, 0.912)},
    "full": {"decoupled": (0.767, 0.963), "synchronous": (0.088, 0.944)},
}


def calibrate(setting: ChaosSetting, seed: int, poisson_horizon_s: float) -> dict[str, Any]:
    """The model at bench_chaos's small N: one chip per learner unit (N = M = learners); its
    decoupled run merges on quorum K = max(2, N // 2), its synchronous baseline on K = N
    (every round waits for every learner). A killed learner is out for down_s + rejoin_s.
    Two ways: the kill schedule replayed (each kill a different learner, as long as there
    are learners left) and Poisson kills at the same rate over a long horizon."""
    s = setting
    outage_s = s.down_s + s.rejoin_s
    kills = np.asarray(s.kill_times_s())
    victims = np.arange(len(kills)) % s.learners
    order = np.lexsort((kills, victims))
    rng = np.random.default_rng([seed, s.learners])
    poisson = poisson_failures(rng, s.learners, 1.0, poisson_horizon_s, s.learners * s.kill_every_s)
    runs = {
        "replay": (kills[order], victims[order], s.phase_s),
        "poisson": (*poisson, poisson_horizon_s),
    }
    out: dict[str, Any] = {
        "setting": dataclasses.asdict(s),
        "kill_times_s": kills.tolist(),
        "outage_s": outage_s,
    }
    for label, quorum in (("decoupled", 1), ("synchronous", s.learners)):  # bench_chaos's K
        row: dict[str, Any] = {"quorum": quorum}
        for mode, (t, d, h) in runs.items():
            ut = unit_time(
                t, d, np.full(len(t), outage_s), s.learners, quorum, h, s.checkpoint_every_s
            )
            row[mode] = {
                "goodput": ut.useful_s / ut.total_s,  # useful / ideal
                "merged_over_computed": ut.useful_s / ut.live_s,  # bench_chaos's measure
            }
        if s.name in CHAOS_MEASURED:
            chaos, fault_free = CHAOS_MEASURED[s.name][label]
            # bench_chaos's goodput is the paper's (work merged in the phase / the learners'
            # capacity), as the model's useful / ideal; the model has no fault-free loss
            # (start-up, the last cycle in flight), so compare chaos / fault-free.
            model = row["replay"]["goodput"]
            row["measured"] = {
                "goodput": chaos,
                "goodput_fault_free": fault_free,
                "chaos_over_fault_free": chaos / fault_free,
            }
            row["model_chaos_over_fault_free"] = model
            row["model_goodput_given_measured_fault_free"] = model * fault_free
            row["abs_diff_chaos_over_fault_free"] = abs(model - chaos / fault_free)
        out[label] = row
    return out


# --- the run --------------------------------------------------------------------------------


def run_table(
    chips_list: list[int], strategies: list[str], horizon_s: float, p: Params, seed: int
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    table: dict[str, dict[str, float]] = {s: {} for s in strategies}
    wall: dict[str, float] = {}
    for chips in chips_list:
        started = time.perf_counter()
        for strategy in strategies:
            table[strategy][str(chips)] = goodput(strategy, chips, horizon_s, p, seed)
        wall[str(chips)] = time.perf_counter() - started
    return table, wall


def sensitivity(chips: int, horizon_s: float, p: Params, seed: int) -> list[dict[str, Any]]:
    """Goodput at `chips` with MTBI and every recovery duration scaled, and with other quorums."""
    rows = []
    for mtbi_years in (0.5, 1.0, 2.0):
        for scale in (0.5, 1.0, 2.0):
            q = dataclasses.replace(p.scaled_recovery(scale), mtbi_chip_s=mtbi_years * YEAR_S)
            rows.append(
                {
                    "mtbi_years": mtbi_years,
                    "recovery_scale": scale,
                    **{
                        s: goodput(s, chips, horizon_s, q, seed)
                        for s in ("synchronous", "elastic", "decoupled_M8")
                    },
                }
            )
    for quorum in (4, 8):
        q = dataclasses.replace(p, quorum=quorum)
        rows.append(
            {"quorum": quorum, "decoupled_M8": goodput("decoupled_M8", chips, horizon_s, q, seed)}
        )
    for readmit in (0.0, 3600.0):
        q = dataclasses.replace(p, readmit_every_s=readmit)
        rows.append(
            {"readmit_every_s": readmit, "elastic": goodput("elastic", chips, horizon_s, q, seed)}
        )
    for jitter in (0.0, 0.002):
        q = dataclasses.replace(p, jitter=jitter)
        rows.append(
            {
                "jitter": jitter,
                **{
                    s: goodput(s, chips, horizon_s, q, seed)
                    for s in ("synchronous", "decoupled_M8")
                },
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "  -  " if x is None else f"{100 * x:5.1f}"


def print_table(table: dict[str, dict[str, float]]) -> None:
    """Goodput in %, the paper's figure in brackets where it reports one."""
    print(f"{'strategy':<15}" + "".join(f"{c / 1e6:>8.2f}M (paper)" for c in CHIPS))
    for strategy, row in table.items():
        paper = PAPER.get(strategy, [None] * len(CHIPS))
        cells = [
            f"{_pct(row[str(c)])}% ({_pct(ref).strip():>4})"
            for c, ref in zip(CHIPS, paper, strict=True)
        ]
        print(f"{strategy:<15}" + "".join(f"{c:>17}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 simulated day instead of 7")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--days", type=float, help="simulated training time (default 7, quick 1)")
    args = parser.parse_args()
    started = time.perf_counter()
    p = Params()
    horizon_s = 86400.0 * (args.days or (1.0 if args.quick else 7.0))
    strategies = ["synchronous", "elastic", *(f"decoupled_M{m}" for m in UNITS)]

    table, wall = run_table(CHIPS, strategies, horizon_s, p, args.seed)
    print(
        f"goodput (%) over {horizon_s / 86400:g} simulated days, MTBI {p.mtbi_chip_s / YEAR_S:g} "
        f"year per chip; paper's Table 1 in brackets"
    )
    print_table(table)
    diff = {
        s: {str(c): abs(table[s][str(c)] - ref[i]) for i, c in enumerate(CHIPS)}
        for s, ref in PAPER.items()
    }
    worst = max(max(row.values()) for row in diff.values())
    print(
        "wall s per chip count: " + ", ".join(f"{int(c) / 1e6:g}M {w:.2f}" for c, w in wall.items())
    )

    cal = calibrate(CHAOS_QUICK, args.seed, 2e5 if args.quick else 2e6)
    forecast = calibrate(CHAOS_FULL, args.seed, 2e5 if args.quick else 2e6)
    for name, setting, result in (("quick", CHAOS_QUICK, cal), ("full", CHAOS_FULL, forecast)):
        print(
            f"calibration vs bench_chaos {name} (N = M = {setting.learners}, a kill every "
            f"{setting.kill_every_s:g} s, each out {setting.down_s + setting.rejoin_s:g} s);"
            " goodput (useful / ideal), measured as chaos / fault-free:"
        )
        for label in ("decoupled", "synchronous"):
            row = result[label]
            print(
                f"  {label:<11} K={row['quorum']}: model {row['replay']['goodput']:.2f} "
                f"(replayed kills), {row['poisson']['goodput']:.2f} (Poisson kills); "
                f"measured {row['measured']['chaos_over_fault_free']:.2f} "
                f"({row['measured']['goodput']:.2f} / {row['measured']['goodput_fault_free']:.2f})"
            )

    sens = sensitivity(1_200_000, horizon_s, p, args.seed)
    print("sensitivity at 1.2M chips (sync / elastic / decoupled M=8, %):")
    for row in sens[:9]:
        print(
            f"  MTBI {row['mtbi_years']:>3g} y, recovery x{row['recovery_scale']:<3g}: "
            f"{_pct(row['synchronous'])} / {_pct(row['elastic'])} / {_pct(row['decoupled_M8'])}"
        )
    for row in sens[9:]:
        knob = next(iter(row))
        print(
            f"  {knob}={row[knob]:g}: "
            + ", ".join(f"{k} {_pct(v).strip()}" for k, v in list(row.items())[1:])
        )

    total = time.perf_counter() - started
    out = {
        "quick": args.quick,
        "seed": args.seed,
        "horizon_days": horizon_s / 86400,
        "params": dataclasses.asdict(p),
        "chips": CHIPS,
        "goodput": table,
        "paper": {s: {str(c): ref[i] for i, c in enumerate(CHIPS)} for s, ref in PAPER.items()},
        "abs_diff": diff,
        "max_abs_diff": worst,
        "wall_s_per_chips": wall,
        "calibration": cal,
        "forecast_chaos_full": forecast,
        "sensitivity_1.2M": sens,
        "wall_s": total,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    m8 = table["decoupled_M8"]["1200000"]
    print(
        f"simulate_goodput {'quick' if args.quick else 'full'}: 1.2M chips sync="
        f"{table['synchronous']['1200000']:.2f} elastic={table['elastic']['1200000']:.2f} "
        f"decoupled_M8={m8:.2f} (paper 0.27/0.58/0.88) max|diff vs Table 1|={worst:.3f} "
        f"1.2M wall={wall['1200000']:.2f}s total={total:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
