"""Benchmark: SIGKILL and restart learners of a live swarm, decoupled against synchronous.

Both configurations run under the same fault schedule.

N learners (`p2pdiloco join`, real processes, each with its own identity key and
checkpoint directory) train the tiny model on loopback. After a fault-free warm-up of W
seconds comes a chaos phase of W seconds: every T seconds one learner's whole process
group is SIGKILLed (every other kill the peer holding a window, else a seeded random one)
and restarted D seconds later with the same identity and checkpoint. Decoupled rounds use
the embedded default's quorum (K = 1) and grace; the same schedule then runs against a
synchronous baseline (`sync.min_quorum` = N, `sync.max_grace_s=0`: every round waits for
every learner). Figures per configuration and phase (Decoupled DiLoCo's definitions):

    goodput            tokens of inner steps carried by the deltas of the rounds committed
                       in the phase, each step once (a claim equals the work its delta
                       carries) / (N learners x phase length x fault-free tokens/s per
                       learner): downtime, rejoining, stalls, redone and lost work all
                       count against it
    goodput_bound      1 - the share of learner-time the kills took down (kill to restart),
                       which no design can recover; goodput_bound_to_training counts until
                       the restarted process trains again (process start-up, join, state)
    work_efficiency    tokens computed in the phase that reached a committed round (by the
                       step ranges each merged delta carries) / tokens computed in it
    lost_steps         steps reported lost by reason (refused, non_finite, overwrite, ...),
                       and "crash": steps computed, never merged, not reported (the local
                       progress of a killed process), over the whole run
    rounds_per_min_*, longest_stall_s (fragment 0), split_rounds, divergences, rejoin_s

    python scripts/bench_chaos.py --quick --json out/chaos.json [--dump out/chaos-raw.json]
    python scripts/bench_chaos.py --analyze out/chaos-raw.json   # the figures again, no run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco.cli.argv import TINY_RUN, child_join_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, ChildFailedToStart, reap_all  # noqa: E402

Event = dict[str, Any]

ROUND_DEADLINE_S = 20.0
TINY = [*TINY_RUN, f"sync.round_deadline_s={ROUND_DEADLINE_S:g}"]  # H comes per setting
READY_S = 240.0
JOIN_S = 300.0
STOP_S = 40.0
SHIPPED = re.compile(r"shipped fragment=(\d+) round=(\d+) base=-?\d+ tokens=(\d+)")
NOTABLE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback|^\S*(Error|Exception)\b")
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} |^\w{3} \d\d \d\d:\d\d:\d\d\.\d{3} ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Setting:
    """Sizes of one benchmark setting (seconds)."""

    name: str
    learners: int
    phase_s: float
    kill_every_s: float
    down_s: float
    tail_s: float  # after the chaos phase: time left for the last restarts to apply a round
    inner_steps: int  # H (the full setting uses the embedded default's)


QUICK = Setting("quick", learners=4, phase_s=25.0, kill_every_s=8.0, down_s=3.0, tail_s=30.0, inner_steps=10)
FULL = Setting("full", learners=6, phase_s=120.0, kill_every_s=20.0, down_s=10.0, tail_s=60.0, inner_steps=50)


def kill_offsets(setting: Setting) -> list[float]:
    """Kill times within the chaos phase: T/2, 3T/2, ... while the restart still falls in it."""
    offsets, k = [], 0
    while (k + 0.5) * setting.kill_every_s + setting.down_s <= setting.phase_s:
        offsets.append((k + 0.5) * setting.kill_every_s)
        k += 1
    return offsets


def _env() -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _sleep_until(t: float) -> None:
    """Wait for a point of the fault schedule (wall clock, as the peers' event stamps)."""
    time.sleep(max(0.0, t - time.time()))


# --- the swarm ----------------------------------------------------------------------------


@dataclass
class Incarnation:
    """One process of one learner: the first start or a restart after a kill."""

    learner: int
    child: Child
    spawned_t: float
    killed_t: float | None = None
    exit_code: int | None = None


@dataclass
class Swarm:
    """A bootstrap node and N learners with fixed identities and checkpoint directories."""

    setting: Setting
    sets: list[str]
    workdir: Path
    boot: Child | None = None
    maddrs: list[str] = field(default_factory=list)
    incarnations: list[Incarnation] = field(default_factory=list)

    def start(self) -> float:
        """Start everything; the time every learner has joined and begins training."""
        self.boot = Child.spawn(
            [sys.executable, "-m", "p2pdiloco", "bootstrap", "--events"],
            "bootstrap",
            cwd=REPO,
            env=_env(),
        )
        self.maddrs = self.boot.wait_ready(READY_S)["maddrs"]
        for i in range(self.setting.learners):
            self.spawn(i, first=True)
        deadline = time.monotonic() + JOIN_S
        joined = []
        for inc in self.incarnations:
            joined.append(inc.child.wait_event(_kind("joined"), deadline - time.monotonic()))
        return max(e["t"] for e in joined)

    def spawn(self, learner: int, first: bool = False) -> Incarnation:
        """Start learner `learner` (again), with its identity and checkpoint directory."""
        own = self.workdir / f"learner{learner}"
        own.mkdir(parents=True, exist_ok=True)  # the identity file's directory must exist
        flags = [
            "--eval-batches", "0",
            "--identity", str(own / "id.key"),
            "--checkpoint-dir", str(own / "ckpt"),
            "--checkpoint-every-s", "2",
            "--data-rank", str(learner),
            "--initial-peers", *self.maddrs,
        ]  # fmt: skip
        if first:
            flags += ["--wait-peers", str(self.setting.learners)]
        args = [sys.executable, *child_join_args(*flags, sets=self.sets)]
        n = sum(1 for inc in self.incarnations if inc.learner == learner)
        child = Child.spawn(args, f"learner{learner}.{n}", cwd=REPO, env=_env())
        inc = Incarnation(learner, child, time.time())
        self.incarnations.append(inc)
        return inc

    def current(self, learner: int) -> Incarnation:
        """The learner's latest process."""
        return [inc for inc in self.incarnations if inc.learner == learner][-1]

    def kill(self, learner: int) -> Incarnation:
        """SIGKILL the learner's whole process group (a machine dying)."""
        inc = self.current(learner)
        inc.killed_t = time.time()
        inc.exit_code = inc.child.kill()
        return inc

    def holder(self) -> int | None:
        """The learner holding a window: the latest `window_open` whose round has not closed,
        else the synchronizer of the latest `round_closed` (None if neither is alive)."""
        closed: set[tuple[int, int]] = set()
        for inc in self.incarnations:
            for e in [*inc.child.of("round_closed"), *inc.child.of("applied")]:
                closed.add((e["fragment"], e["round"]))
        alive = {i: self.current(i) for i in range(self.setting.learners)}
        alive = {i: inc for i, inc in alive.items() if inc.killed_t is None and inc.child.alive()}
        opens = [
            (e["t"], i) for i, inc in alive.items() for e in inc.child.of("window_open")
            if (e["fragment"], e["round"]) not in closed
        ]  # fmt: skip
        if opens:
            return max(opens)[1]
        last = [(e["t"], i) for i, inc in alive.items() for e in inc.child.of("round_closed")]
        return max(last)[1] if last else None

    def stop(self) -> None:
        """SIGTERM every live learner at once, SIGKILL those still running after STOP_S."""
        live = [inc for inc in self.incarnations if inc.exit_code is None]
        for inc in live:
            inc.child.request_stop()
        deadline = time.monotonic() + STOP_S
        for inc in live:
            code = inc.child.wait_exit(deadline - time.monotonic())
            inc.exit_code = code if code is not None else inc.child.kill()
        if self.boot is not None:
            self.boot.stop(10)

    def record(self) -> list[dict[str, Any]]:
        """Every incarnation's events, shipped-token log lines and notable stderr lines
        (read before the children are reaped, which deletes their stderr files)."""
        out = []
        for inc in self.incarnations:
            shipped, errors, warnings = _read_stderr(inc.child)
            out.append(
                {
                    "learner": inc.learner,
                    "name": inc.child.name,
                    "spawned_t": inc.spawned_t,
                    "killed_t": inc.killed_t,
                    "exit_code": inc.exit_code,
                    "events": list(inc.child.events),
                    "shipped": shipped,
                    "stderr_errors": errors,
                    "stderr_warnings": warnings,
                }
            )
        return out


def _kind(kind: str) -> Callable[[Event], bool]:
    return lambda e: e.get("event") == kind


def _read_stderr(child: Child) -> tuple[list[list[float]], dict[str, int], dict[str, int]]:
    """[fragment, round, tokens, time] of each shipped delta (the learner logs the exact
    tokens it claims; time from the log stamp), error and traceback lines and warnings,
    each counted by shape (stamps, numbers and peer ids blanked)."""
    shipped: list[list[float]] = []
    errors: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    if child.stderr_path is None:
        return shipped, {}, {}
    try:
        text = Path(child.stderr_path).read_text(errors="replace")
    except OSError:
        return shipped, {}, {}
    in_traceback = False
    for line in text.splitlines():
        line = ANSI.sub("", line)
        if m := SHIPPED.search(line):
            shipped.append([int(m[1]), int(m[2]), int(m[3]), _log_time(line)])
            in_traceback = False
        elif NOTABLE.search(line) or in_traceback and line.startswith(" "):
            in_traceback = in_traceback or "Traceback" in line or line.startswith(" ")
            if len(errors) < 60 or STAMP.sub("", line) in errors:
                errors[STAMP.sub("", line)] += 1
        elif " WARNING " in line or "[WARNING]" in line:
            in_traceback = False
            message = re.split(r" WARNING |\[WARNING\]", line, maxsplit=1)[-1]
            message = re.sub(r"peer=\S+", "peer=P", message)
            warnings[re.sub(r"(?<![A-Za-z])\d+(\.\d+)?", "N", message)] += 1
        else:
            in_traceback = False
    return shipped, dict(errors), dict(warnings)


def _log_time(line: str) -> float:
    """The epoch time of a log line stamped `2026-01-02 03:04:05,678` (local time); nan if none."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return float("nan")


def run_config(setting: Setting, sets: list[str], seed: int, label: str) -> dict[str, Any]:
    """One configuration: warm-up, chaos phase, tail; the raw record for `analyze`."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix=f"bench-chaos-{label}-") as tmp:
        swarm = Swarm(setting, sets, Path(tmp))
        kills: list[dict[str, Any]] = []
        try:
            print(f"bench_chaos {label}: starting {setting.learners} learners", file=sys.stderr)
            t0 = swarm.start()
            chaos_t = t0 + setting.phase_s
            print(f"bench_chaos {label}: all joined, warm-up {setting.phase_s:g}s", file=sys.stderr)
            for k, offset in enumerate(kill_offsets(setting)):
                _sleep_until(chaos_t + offset)
                pick = rng.randrange(setting.learners)  # drawn every kill: same victims in both
                victim, why = (swarm.holder(), "holder") if k % 2 == 0 else (None, "random")
                if victim is None:
                    victim, why = pick, "random" if why == "random" else "random (no holder)"
                killed = swarm.kill(victim)
                _sleep_until(killed.killed_t + setting.down_s)
                back = swarm.spawn(victim)
                kills.append(
                    {
                        "learner": victim,
                        "why": why,
                        "t": killed.killed_t,
                        "restart_t": back.spawned_t,
                    }
                )
                print(f"bench_chaos {label}: killed learner{victim} ({why})", file=sys.stderr)
            _sleep_until(chaos_t + setting.phase_s)
            _wait_rejoined(swarm, time.monotonic() + setting.tail_s)
            swarm.stop()
            return {
                "label": label,
                "setting": setting.name,
                "learners": setting.learners,
                "sets": sets,
                "t0": t0,
                "phase_s": setting.phase_s,
                "kills": kills,
                "incarnations": swarm.record(),
            }
        finally:
            for inc in swarm.incarnations:
                if inc.child.alive():
                    inc.child.kill()
            reap_all()


def _wait_rejoined(swarm: Swarm, deadline: float) -> None:
    """Until every restarted process applied a round, or `deadline` (monotonic)."""
    restarted = [inc for inc in swarm.incarnations if inc.child.name.split(".")[1] != "0"]
    while time.monotonic() < deadline:
        if all(inc.child.of("applied") or not inc.child.alive() for inc in restarted):
            return
        time.sleep(0.2)  # polling the children's event lists, which their reader threads fill


# --- figures ------------------------------------------------------------------------------


def _steps_curve(inc: dict[str, Any]) -> list[tuple[float, float]]:
    """(time, inner steps done) of one process: the start of training (`joined`, at the
    step a checkpoint restored), every 10th step, the summary, and for a killed process the
    steps since its last report, at its own pace (at most 9: reports come every 10 steps)."""
    events = inc["events"]
    joined = next((e for e in events if e.get("event") == "joined"), None)
    if joined is None:
        return []
    loaded = next((e for e in events if e.get("event") == "checkpoint_loaded"), None)
    points = [(joined["t"], float(loaded["step"] if loaded else 0))]
    for e in events:
        if e.get("event") == "step" and e["t"] >= joined["t"]:
            points.append((e["t"], float(e["step"])))
        elif e.get("event") == "summary":
            points.append((e["t"], float(e["steps"])))
    points.sort()
    killed = inc["killed_t"]
    if killed is not None and len(points) >= 2 and killed > points[-1][0]:
        (ta, sa), (tb, sb) = points[0], points[-1]
        rate = (sb - sa) / max(tb - ta, 1e-9)
        points.append((killed, sb + min(rate * (killed - tb), 9.0)))
    return points


def _at(points: list[tuple[float, float]], t: float) -> float:
    """Steps done by time t, linear between reports (none before the first)."""
    if not points or t <= points[0][0]:
        return points[0][1] if points else 0.0
    for (ta, sa), (tb, sb) in zip(points, points[1:], strict=False):
        if t <= tb:
            return sa + (sb - sa) * (t - ta) / max(tb - ta, 1e-9)
    return points[-1][1]


def _tokens_per_step(incs: list[dict[str, Any]], sets: list[str]) -> float:
    """From the summaries of processes that left cleanly; else batch x seq_len."""
    for inc in incs:
        for e in inc["events"]:
            if e.get("event") == "summary" and e.get("steps"):
                return e["tokens"] / e["steps"]
    values = dict(item.split("=", 1) for item in sets)
    return float(int(values["train.batch_size"]) * int(values["model.seq_len"]))


def _claims(
    incs: list[dict[str, Any]],
    peer_of: dict[int, str | None],
    close_t: dict[tuple[int, int], float],
) -> dict[tuple[str, int, int], int]:
    """(peer, fragment, round) -> tokens of the delta of that peer the round merged.

    A peer may send several deltas to one round (a resend, a fresh one while the update is
    on its way, a restarted process); a window keeps a peer's first delta and refuses the
    rest, and none sent after the close is merged: so the earliest one sent before the
    round closed (the earliest at all when the log has no time).
    """
    sent: dict[tuple[str, int, int], list[tuple[float, int]]] = {}
    for inc in incs:
        for f, r, tokens, *stamp in inc["shipped"]:
            t = stamp[0] if stamp and stamp[0] == stamp[0] else float("-inf")  # nan: no time
            sent.setdefault((peer_of[id(inc)], int(f), int(r)), []).append((t, int(tokens)))
    claims = {}
    for key, items in sent.items():
        before = [x for x in items if x[0] <= close_t.get(key[1:], float("inf"))] or items
        claims[key] = min(before, key=lambda x: x[0])[1]
    return claims


def analyze(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one configuration from its raw record."""
    incs, t0, w = run["incarnations"], run["t0"], run["phase_s"]
    warm, chaos = (t0, t0 + w), (t0 + w, t0 + 2 * w)
    events = [(inc, e) for inc in incs for e in inc["events"]]
    peer_of = {
        id(inc): next((e["peer_id"] for e in inc["events"] if "ready" in e), None) for inc in incs
    }

    # when each (fragment, round) closed: its first round_closed or applied anywhere
    close_t: dict[tuple[int, int], float] = {}
    closed_by: dict[tuple[int, int], Event] = {}
    hashes: dict[tuple[int, int], set[str]] = {}
    for _, e in events:
        if e.get("event") in ("round_closed", "applied"):
            key = (e["fragment"], e["round"])
            close_t[key] = min(close_t.get(key, e["t"]), e["t"])
        if e.get("event") == "round_closed":
            key = (e["fragment"], e["round"])
            if key not in closed_by or e["t"] < closed_by[key]["t"]:
                closed_by[key] = e
        if e.get("event") == "applied":
            hashes.setdefault((e["fragment"], e["round"]), set()).add(e["hash"])
    num_fragments = max((f for f, _ in close_t), default=0) + 1

    shipped = _claims(incs, peer_of, close_t)
    by_peer: dict[str, list[int]] = {}
    for (peer, _, _), tokens in shipped.items():
        by_peer.setdefault(peer, []).append(tokens)

    tps = _tokens_per_step(incs, run["sets"])
    curves = [_steps_curve(inc) for inc in incs]
    n_learners = run["learners"]

    def merged_in(key: tuple[int, int]) -> tuple[int, int]:
        """(tokens, deltas) the canonical round `key` merged, as its synchronizer logged
        the claims (a dump from before round_closed carried tokens: the shipped lines)."""
        closed = closed_by[key]
        if "tokens" in closed:
            return sum(closed["tokens"]), len(closed["contributors"])
        total = 0
        for peer in closed["contributors"]:
            tokens = shipped.get((peer, *key))
            total += int(statistics.median(by_peer.get(peer, [0]))) if tokens is None else tokens
        return total, len(closed["contributors"])

    def computed_in(a: float, b: float) -> float:
        return tps * sum(_at(c, b) - _at(c, a) for c in curves) * num_fragments

    back_at: dict[int, float] = {}
    """id(kill) -> when its restarted process began training again (its `joined`)."""
    for kill in run["kills"]:
        for inc in incs:
            if inc["learner"] == kill["learner"] and inc["spawned_t"] == kill["restart_t"]:
                joined = next((e["t"] for e in inc["events"] if e.get("event") == "joined"), None)
                if joined is not None:
                    back_at[id(kill)] = joined
    rate_fault_free = computed_in(*warm) / (n_learners * w)
    """Tokens per second per learner when nothing fails (per fragment, as claims count)."""

    merged_steps_at = _merged_step_times(incs, peer_of, closed_by, curves)

    def phase(a: float, b: float) -> dict[str, Any]:
        keys = [k for k, t in close_t.items() if a <= t < b]
        # progress the swarm made in the phase: the work its committed rounds carried
        merged_closed = sum(merged_in(k)[0] for k in keys if k in closed_by)
        # the work done in the phase that reached a committed round (whenever it closed)
        merged_tokens = tps * sum(1 for t in merged_steps_at if a <= t < b) if merged_steps_at else merged_closed
        computed = computed_in(a, b)
        capacity = n_learners * (b - a) * rate_fault_free
        down = sum(
            max(0.0, min(k["restart_t"], b) - max(k["t"], a)) for k in run["kills"]
        )
        # ... and until the restarted process trains again (start-up, join, state download)
        out = sum(max(0.0, min(back_at.get(id(k), b), b) - max(k["t"], a)) for k in run["kills"])
        f0 = sorted(t for (f, _), t in close_t.items() if f == 0 and a <= t < b)
        gaps = [y - x for x, y in zip([a, *f0], [*f0, b], strict=True)]
        stale = [x for k in keys if k in closed_by for x in closed_by[k].get("staleness", [])]
        return {
            "goodput": merged_closed / capacity if capacity else None,
            "goodput_bound": 1.0 - down / (n_learners * (b - a)),
            "goodput_bound_to_training": 1.0 - out / (n_learners * (b - a)),
            "work_efficiency": merged_tokens / computed if computed else None,
            "merged_tokens": merged_closed,
            "merged_tokens_of_phase_work": round(merged_tokens),
            "computed_tokens": round(computed),
            "capacity_tokens": round(capacity),
            "deltas_merged": sum(merged_in(k)[1] for k in keys if k in closed_by),
            "staleness_mean": statistics.mean(stale) if stale else None,
            "staleness_max": max(stale, default=None),
            "rounds": len(f0),
            "rounds_per_min": len(f0) / ((b - a) / 60.0),
            "longest_stall_s": max(gaps),
            "rounds_without_close_event": sum(1 for k in keys if k not in closed_by),
        }

    fault_free, chaotic = phase(*warm), phase(*chaos)
    rejoin = []
    for kill in run["kills"]:
        back = next(
            (
                inc
                for inc in incs
                if inc["learner"] == kill["learner"] and inc["spawned_t"] == kill["restart_t"]
            ),
            None,
        )
        first = (
            next((e["t"] for e in back["events"] if e.get("event") == "applied"), None)
            if back
            else None
        )
        if first is not None:
            rejoin.append(first - kill["restart_t"])
    statuses = Counter(
        e["status"] for _, e in events
        if e.get("event") == "contributed" and chaos[0] <= e["t"] < chaos[1]
    )  # fmt: skip
    unexpected = [
        f"{inc['name']} exit {inc['exit_code']}" for inc in incs
        if inc["killed_t"] is None and inc["exit_code"] not in (0, None)
    ]  # fmt: skip
    return {
        "kills": len(run["kills"]),
        "kills_of_holders": sum(1 for k in run["kills"] if k["why"] == "holder"),
        "goodput": chaotic["goodput"],
        "goodput_fault_free": fault_free["goodput"],
        "goodput_bound": chaotic["goodput_bound"],
        "goodput_to_bound": (
            chaotic["goodput"] / chaotic["goodput_bound"] if chaotic["goodput"] is not None else None
        ),
        "goodput_bound_to_training": chaotic["goodput_bound_to_training"],
        "goodput_to_bound_to_training": (
            chaotic["goodput"] / chaotic["goodput_bound_to_training"]
            if chaotic["goodput"] is not None
            else None
        ),
        "work_efficiency": chaotic["work_efficiency"],
        "work_efficiency_fault_free": fault_free["work_efficiency"],
        "lost_steps": _lost_steps(incs, peer_of, closed_by, curves, num_fragments),
        "staleness_mean": chaotic["staleness_mean"],
        "staleness_mean_fault_free": fault_free["staleness_mean"],
        "rounds_per_min_chaos": chaotic["rounds_per_min"],
        "rounds_per_min_fault_free": fault_free["rounds_per_min"],
        "longest_stall_s": chaotic["longest_stall_s"],
        "longest_stall_s_fault_free": fault_free["longest_stall_s"],
        "split_rounds": sum(1 for v in hashes.values() if len(v) > 1),
        "divergences": sum(1 for _, e in events if e.get("event") == "diverged"),
        "repairs": sum(1 for _, e in events if e.get("event") == "repair"),
        "rejoin_s": statistics.median(rejoin) if rejoin else None,
        "rejoins": [round(x, 1) for x in rejoin],
        "rejoins_missing": len(run["kills"]) - len(rejoin),
        "tokens_per_step": tps,
        "phases": {"fault_free": fault_free, "chaos": chaotic},
        "contributions_chaos": dict(statuses),
        "unexpected_exits": unexpected,
        "stderr_errors": _merged_counts(incs, "stderr_errors", 40),
        "stderr_warnings": _merged_counts(incs, "stderr_warnings", 15),
    }


def _merged_step_times(
    incs: list[dict[str, Any]],
    peer_of: dict[int, str | None],
    closed_by: dict[tuple[int, int], Event],
    curves: list[list[tuple[float, float]]],
) -> list[float]:
    """When each step carried by a committed delta was computed (one time per
    fragment-step), from the deltas' step ranges in `round_closed` and the step curve of
    the process that shipped them (the one whose `shipped` event names that range).
    Empty for a dump from before round_closed carried step ranges."""
    shippers: dict[tuple[str | None, int, int, int, int], int] = {}
    for index, inc in enumerate(incs):
        for e in inc["events"]:
            if e.get("event") == "shipped" and "first_step" in e:
                key = (peer_of[id(inc)], e["fragment"], e["round"], e["first_step"], e["last_step"])
                shippers[key] = index
    times: list[float] = []
    for (fragment, round_id), closed in closed_by.items():
        for peer, step_range in zip(closed["contributors"], closed.get("step_ranges", []), strict=False):
            first, last = step_range
            index = shippers.get((peer, fragment, round_id, first, last))
            if index is None or not curves[index]:
                continue
            times.extend(_time_of_step(curves[index], k) for k in range(first, last + 1))
    return times


def _time_of_step(points: list[tuple[float, float]], step: float) -> float:
    """When a process finished step `step`, linear between its reports."""
    for (ta, sa), (tb, sb) in zip(points, points[1:], strict=False):
        if sa <= step <= sb:
            return ta + (tb - ta) * (step - sa) / max(sb - sa, 1e-9)
    return points[-1][0] if step > points[-1][1] else points[0][0]


def _lost_steps(
    incs: list[dict[str, Any]],
    peer_of: dict[int, str | None],
    closed_by: dict[tuple[int, int], Event],
    curves: list[list[tuple[float, float]]],
    num_fragments: int,
) -> dict[str, int]:
    """Steps lost over the whole run, by reason (fragment-steps: a step counts once per
    fragment, as each fragment's deltas carry it). The learners report what they throw
    away; "crash" is the rest of the conservation: computed - merged - still local -
    undecided at the end - reported. Negative would mean a step counted twice."""
    lost: Counter[str] = Counter()
    for inc in incs:
        for e in inc["events"]:
            if e.get("event") == "steps_lost":
                lost[str(e["reason"]).split(":")[0]] += int(e["steps"])
    computed: Counter[str] = Counter()
    for inc, curve in zip(incs, curves, strict=True):
        if curve:
            computed[peer_of[id(inc)]] += round(curve[-1][1] - curve[0][1]) * num_fragments
    merged: Counter[str] = Counter()
    for closed in closed_by.values():
        for peer, steps in zip(closed["contributors"], closed.get("steps", []), strict=False):
            merged[peer] += int(steps)
    left: Counter[str] = Counter()
    for inc in incs:
        summary = next((e for e in inc["events"] if e.get("event") == "summary"), None)
        if summary is not None:
            left[peer_of[id(inc)]] += sum(summary.get("local_steps", [])) + sum(
                summary.get("undecided_steps", {}).values()
            )
    unaccounted = sum(computed.values()) - sum(merged.values()) - sum(left.values()) - sum(lost.values())
    return {**lost, "crash": unaccounted, "computed": sum(computed.values()),
            "merged": sum(merged.values()), "local_at_end": sum(left.values())}  # fmt: skip


def _merged_counts(incs: list[dict[str, Any]], key: str, limit: int) -> dict[str, int]:
    """Line -> count over all processes, in order of first appearance (an old dump holds a
    list of lines)."""
    total: Counter[str] = Counter()
    for inc in incs:
        found = inc[key]
        for line, n in (found if isinstance(found, dict) else Counter(found)).items():
            total[STAMP.sub("", line)] += n
    return dict(list(total.items())[:limit])


def report(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The output JSON: both configurations, the targets, which the decoupled run met."""
    figures = {label: analyze(run) for label, run in runs.items()}
    targets = {
        "split_rounds": 0,
        "divergences": 0,
        "longest_stall_s_max": 2 * ROUND_DEADLINE_S,
        "work_efficiency_fault_free_min": 0.95,
        "work_efficiency_min": 0.90,
        "goodput_min_ratio_to_bound": 0.95,
    }

    def at_least(value: float | None, floor: float) -> bool:
        return value is not None and value >= floor

    def met(f: dict[str, Any]) -> dict[str, bool]:
        return {
            "split_rounds": f["split_rounds"] == 0,
            "divergences": f["divergences"] == 0,
            "longest_stall_s": f["longest_stall_s"] <= targets["longest_stall_s_max"],
            "work_efficiency_fault_free": at_least(f["work_efficiency_fault_free"], 0.95),
            "work_efficiency": at_least(f["work_efficiency"], 0.90),
            "goodput_to_bound": at_least(f["goodput_to_bound"], 0.95),
        }

    first = next(iter(runs.values()))
    out: dict[str, Any] = {
        "setting": first["setting"],
        "learners": first["learners"],
        **{k: v for k, v in figures["decoupled"].items() if not isinstance(v, dict | list)},
        "decoupled": figures["decoupled"],
        "synchronous": figures["synchronous"],
        "goodput_measure": (
            "tokens carried by the deltas of the rounds committed in the phase (the claims in "
            "round_closed) / (N learners x phase length x the fault-free phase's tokens/s per "
            "learner); work_efficiency: tokens computed in the phase that any committed round "
            "carries (each merged delta's step range, timed by its process's step events) / "
            "tokens computed in the phase"
        ),
        "targets": targets,
        "met": met(figures["decoupled"]),
        "met_synchronous": met(figures["synchronous"]),
    }
    return out


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary_line(out: dict[str, Any]) -> str:
    d, s = out["decoupled"], out["synchronous"]

    def part(name: str, f: dict[str, Any]) -> str:
        return (
            f"{name} goodput={_fmt(f['goodput'])} (bound {_fmt(f['goodput_bound'])}) "
            f"work_eff={_fmt(f['work_efficiency'])}/{_fmt(f['work_efficiency_fault_free'])} "
            f"rounds/min={_fmt(f['rounds_per_min_chaos'], '.1f')}/"
            f"{_fmt(f['rounds_per_min_fault_free'], '.1f')} "
            f"stall={_fmt(f['longest_stall_s'], '.1f')}s split={f['split_rounds']} "
            f"diverged={f['divergences']} rejoin={_fmt(f['rejoin_s'], '.1f')}s"
        )

    met = sum(out["met"].values())
    return (
        f"bench_chaos {out['setting']}: learners={out['learners']} kills={d['kills']} "
        f"{part('decoupled', d)} | {part('synchronous', s)} | targets met {met}/{len(out['met'])}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random victims")
    parser.add_argument("--dump", type=Path, help="also write the raw events here")
    parser.add_argument("--analyze", type=Path, help="recompute the figures from a --dump file")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    started = time.time()
    if args.analyze:
        runs = json.loads(args.analyze.read_text())
    else:
        setting = QUICK if args.quick else FULL
        n = setting.learners
        h = f"sync.inner_steps={setting.inner_steps}"
        base = [*TINY, h, *args.overrides]  # the embedded default's quorum and grace
        sync = [*TINY, h, f"sync.min_quorum={n}", "sync.max_grace_s=0", *args.overrides]
        runs = {}
        try:
            for label, sets in (("decoupled", base), ("synchronous", sync)):
                runs[label] = run_config(setting, sets, args.seed, label)
        except (ChildFailedToStart, TimeoutError, EOFError) as exc:
            print(f"bench_chaos: a process failed: {exc}", file=sys.stderr)
            return 1
        finally:
            reap_all()
        if args.dump:
            args.dump.parent.mkdir(parents=True, exist_ok=True)
            args.dump.write_text(json.dumps(runs) + "\n")
    out = report(runs)
    if not args.analyze:
        out["wall_s"] = round(time.time() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(summary_line(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
