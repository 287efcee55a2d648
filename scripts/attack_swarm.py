"""The network half of `bench_attack.py`: a real swarm, a real attacker, rounds counted.

For each attack: a bootstrap node and N learners (`p2pdiloco join`, separate processes on
127.0.0.1, the embedded default's quorum, grace and fragments on the tiny model) train
until every learner has applied a round; then a clean window of `window_s` seconds, then
the attacker (tests/net/adversary.py: a stranger's program with fresh, valid identities
and the run's public config) starts its attack and a second window of the same length
follows. Per attack:

    rounds_ratio   rounds committed per minute in the attack window / in the clean window
                   (distinct (fragment, round) applied by any honest learner)
    loss_shift     (held-out loss under attack - clean) / clean, at the same fragment-0
                   round, against a swarm that ran as long with no attacker at all
    honest_lost    honest deltas reported lost (`steps_lost`) in the attack window, beyond
                   those lost in the clean window of the same swarm (churn loses some)
    forks          (fragment, round) pairs whose last applied hash differs between honest
                   learners (must be 0); `repairs` counts replicas that applied a losing
                   rival and repaired (the protocol allows it; the rival rule settles it)

The attacker runs at `nice 19`: on this one machine its own work (its daemons, signing)
would otherwise pass for damage done to the swarm; a real attacker uses its own machines.

A window counts from the attacker's `ready` line, so its start-up is not charged to it.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2pdiloco.cli.argv import TINY_RUN, child_join_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, machine_busy_s, reap_all, tree_cpu_s  # noqa: E402

ADVERSARY = REPO / "tests" / "net" / "adversary.py"
READY_S = 240.0
JOIN_S = 300.0
STOP_S = 30.0
Event = dict[str, Any]


@dataclass(frozen=True)
class NetSetting:
    """Sizes of the networked attack runs (seconds)."""

    learners: int
    window_s: float
    inner_steps: int
    eval_batches: int = 2

    def sets(self) -> list[str]:
        """The run's overrides: the tiny model, the embedded default's sync section
        (quorum, grace, fragments) apart from H, a learner using a fifth of a core."""
        return [*TINY_RUN, f"sync.inner_steps={self.inner_steps}", "train.compute_share=0.3"]


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}


@dataclass
class AttackedSwarm:
    """A bootstrap node, N learners and, for a while, one attacker."""

    setting: NetSetting
    workdir: Path
    boot: Child | None = None
    learners: list[Child] = field(default_factory=list)
    attacker: Child | None = None

    def start(self) -> None:
        self.boot = Child.spawn(
            [sys.executable, "-m", "p2pdiloco", "bootstrap", "--events"], "bootstrap", cwd=REPO, env=_env()
        )
        maddrs = self.boot.wait_ready(READY_S)["maddrs"]
        for i in range(self.setting.learners):
            (self.workdir / f"learner{i}").mkdir(parents=True, exist_ok=True)
            flags = self.learner_flags(i, maddrs, "ckpt", "--wait-peers", str(self.setting.learners))
            args = [sys.executable, *child_join_args(*flags, sets=self.setting.sets())]
            self.learners.append(Child.spawn(args, f"learner{i}", cwd=REPO, env=_env()))
        deadline = time.monotonic() + JOIN_S
        for child in self.learners:
            child.wait_ready(max(deadline - time.monotonic(), 1.0))
        for child in self.learners:
            child.wait_event(lambda e: e.get("event") == "applied", max(deadline - time.monotonic(), 1.0))

    def learner_flags(self, i: int, maddrs: list[str], checkpoints: str, *more: str) -> list[str]:
        """`join` flags of learner `i`: its identity and its checkpoint folder `checkpoints`
        in its own directory, its data shard, `more`, the bootstrap's addresses."""
        own = self.workdir / f"learner{i}"
        return [
            "--eval-batches", str(self.setting.eval_batches), "--identity", str(own / "id.key"),
            "--checkpoint-dir", str(own / checkpoints), "--data-rank", str(i), *more, "--initial-peers", *maddrs,
        ]  # fmt: skip

    @property
    def maddrs(self) -> list[str]:
        assert self.boot is not None and self.boot.report is not None
        return list(self.boot.report["maddrs"])

    def peer_ids(self) -> list[str]:
        return [c.report["peer_id"] for c in self.learners if c.report]

    def launch_attacker(self, attacks: str, timeout_s: float) -> float:
        """Start the attacker on `attacks`; the time it is ready (its DHT node joined)."""
        args = [  # at the lowest CPU priority: on this one machine the attacker's own work
            # (its daemons, signing) must not pass for damage it does to the swarm
            "nice", "-n", "19",
            sys.executable, str(ADVERSARY), "--run", "local", "--initial-peer", self.maddrs[0],
            "--victims", ",".join(sorted(self.peer_ids())), "--attacks", attacks,
        ]  # fmt: skip
        # stdin stays open: the attacker stays in the DHT (its junk reachable) until it closes
        # the long attacks (trickled bodies, floods) last the window and a margin
        lasting = {"SLOW_BODIES_S": f"{self.setting.window_s + 10:g}", "FLOOD_S": f"{self.setting.window_s + 10:g}"}
        # a key the chain named: learner 0's, as a learner turned attacker has its own
        lasting["LATE_RIVAL_KEY"] = str(self.workdir / "learner0" / "id.key")
        self.attacker = Child.spawn(args, "adversary", cwd=REPO, env={**_env(), **lasting}, stdin=True)
        self.attacker.wait_ready(timeout_s)
        return time.time()

    def stop(self) -> None:
        stop_children([*self.learners, self.attacker, self.boot])


def stop_children(children: list[Child | None]) -> None:
    """Ask every child to leave (SIGTERM: a learner saves its checkpoint), then kill those
    still there after `STOP_S` in all."""
    for child in children:
        if child is not None and child.alive():
            child.request_stop()
    deadline = time.monotonic() + STOP_S
    for child in children:
        if child is not None and child.wait_exit(max(deadline - time.monotonic(), 0.1)) is None:
            child.kill()


def _events(children: list[Child], kind: str, start: float, end: float) -> list[Event]:
    return [e for c in children for e in c.of(kind) if start <= e.get("t", 0.0) < end]


def rounds_per_min(children: list[Child], start: float, end: float) -> float:
    """Distinct (fragment, round) any of `children` applied in [start, end), per minute."""
    done = {(e["fragment"], e["round"]) for e in _events(children, "applied", start, end)}
    return len(done) * 60.0 / max(end - start, 1e-9)


def lost_deltas(children: list[Child], start: float, end: float) -> int:
    """Honest deltas reported lost in [start, end)."""
    return len(_events(children, "steps_lost", start, end))


def lost_reasons(children: list[Child], start: float, end: float) -> dict[str, int]:
    """Honest deltas reported lost in [start, end), by reason (its numbers written #, so
    "delta norm 167.7 is above 161" and "delta norm 90.2 is above 88" count as one)."""
    reasons: dict[str, int] = {}
    for e in _events(children, "steps_lost", start, end):
        key = re.sub(r"\d+(\.\d+)?", "#", str(e.get("reason", "")))[:120] or "unsaid"
        reasons[key] = reasons.get(key, 0) + 1
    return reasons


def round_phases(children: list[Child], start: float, end: float) -> dict[str, float | None]:
    """Where a round's time went in [start, end): the median commit (a synchronizer's
    merge, hold and publish: `round_closed`'s `sync_s`) and the median lag from a round's
    commit to each replica applying it (its synchronizer's own at about 0 included). Which of the two an attack stretches says
    what it costs: the synchronizers' commits, or the replicas' following; the learners'
    inner steps a minute, all together, say whether it took their CPU instead."""
    closed = {(e["fragment"], e["round"]): e for e in _events(children, "round_closed", start, end)}
    commits = [float(e.get("sync_s", 0.0)) for e in closed.values()]
    lags = [
        e["t"] - closed[(e["fragment"], e["round"])]["t"]
        for e in _events(children, "applied", start, end + 120.0)
        if (e.get("fragment"), e.get("round")) in closed
    ]  # fmt: skip
    steps = 0
    for child in children:  # `step` events come every 10 steps, with the learner's count
        counts = [e["step"] for e in child.of("step") if start <= e.get("t", 0.0) < end]
        steps += max(counts) - min(counts) if counts else 0
    return {
        "commit_s": statistics.median(commits) if commits else None,
        "apply_lag_s": statistics.median(lags) if lags else None,
        "steps_per_min": steps * 60.0 / max(end - start, 1e-9),
    }


def forks(children: list[Child]) -> int:
    """(fragment, round) pairs whose last applied hash differs between honest learners:
    replicas that stayed apart (a replica that applied a losing rival and repaired, as the
    protocol allows, is counted by `repairs`, not here)."""
    last: dict[tuple[int, int], set[str]] = {}
    for child in children:
        mine: dict[tuple[int, int], str] = {}
        for e in child.of("applied"):
            mine[(e["fragment"], e["round"])] = e["hash"]
        for key, hash_ in mine.items():
            last.setdefault(key, set()).add(hash_)
    return sum(1 for hashes in last.values() if len(hashes) > 1)


def on_attacker_states(children: list[Child], attacker: Child | None) -> int:
    """Honest learners' state downloads of a state the attacker served under a round it
    was not captured at (its `served_hash`, relabelled): replicas the attacker moved."""
    if attacker is None:
        return 0
    served = {
        e["served_hash"]: e.get("captured_round") for e in attacker.events if e.get("served_hash")
    } | {e["hash"]: e.get("round") for e in attacker.events if e.get("forged_state_captured")}
    return sum(
        1 for child in children for e in child.of("downloaded")
        if e.get("hash") in served and e.get("round") != served[e["hash"]]
    )  # fmt: skip


def repairs(children: list[Child], start: float, end: float) -> int:
    """Replicas that found themselves on a losing branch in [start, end) and repaired."""
    return len(_events(children, "repair", start, end))


def eval_by_round(children: list[Child]) -> dict[int, float]:
    """Held-out loss by fragment-0 round: the mean over the learners that reported it."""
    by_round: dict[int, list[float]] = {}
    for child in children:
        for e in child.of("eval"):
            if e.get("rounds"):
                by_round.setdefault(e["rounds"][0], []).append(e["eval_loss"])
    return {r: statistics.fmean(v) for r, v in by_round.items()}


def loss_at_common_round(attacked: dict[int, float], clean: dict[int, float]) -> tuple[int, float, float] | None:
    """(round, attacked loss, clean loss) at the highest fragment-0 round both reached."""
    common = sorted(set(attacked) & set(clean))
    return (common[-1], attacked[common[-1]], clean[common[-1]]) if common else None


def cpu_split(swarm: AttackedSwarm) -> dict[str, float]:
    """CPU seconds so far: the learners' processes (with their DHT processes and p2pd
    daemons), the attacker's, and the whole machine's."""
    return {
        "learners": sum(tree_cpu_s(c.pid) for c in swarm.learners),
        "attacker": tree_cpu_s(swarm.attacker.pid) if swarm.attacker is not None else 0.0,
        "machine": machine_busy_s(),
    }


def cores_busy(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores kept busy between two `cpu_split`s, by whom (`other`: the bootstrap node and
    everything else on the machine). On one machine an attacker's own CPU is the victims'
    loss too; on the internet it is not, so an attack's cost is read against this."""
    busy = {k: (after[k] - before[k]) / max(seconds, 1e-9) for k in before}
    busy["other"] = busy.pop("machine") - busy["learners"] - busy["attacker"]
    return busy


def run_swarm(setting: NetSetting, attacks: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    """One swarm: a clean window, then (with `attacks`) an attacked window of the same length."""
    with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
        swarm = AttackedSwarm(setting, Path(tmp))
        try:
            swarm.start()
            clean_start, clean_cpu = time.time(), cpu_split(swarm)
            time.sleep(setting.window_s)
            clean_end, attack_cpu = time.time(), cpu_split(swarm)
            attack_start = clean_end
            result: list[Event] = []
            if attacks:
                attack_start = swarm.launch_attacker(attacks, READY_S)
                attack_cpu = cpu_split(swarm)  # the attacker's start-up is not its attack
            time.sleep(setting.window_s)
            attack_end, end_cpu = time.time(), cpu_split(swarm)
            if swarm.attacker is not None:  # what it reported by the window's end, results last
                result = swarm.attacker.events
            figures = {
                "clean_rounds_per_min": rounds_per_min(swarm.learners, clean_start, clean_end),
                "attack_rounds_per_min": rounds_per_min(swarm.learners, attack_start, attack_end),
                "clean_lost": lost_deltas(swarm.learners, clean_start, clean_end),
                "attack_lost": lost_deltas(swarm.learners, attack_start, attack_end),
                "lost_reasons": lost_reasons(swarm.learners, clean_start, attack_end),
                "forks": forks(swarm.learners),
                "on_attacker_states": on_attacker_states(swarm.learners, swarm.attacker),
                "repairs": repairs(swarm.learners, attack_start, attack_end),
                "clean_repairs": repairs(swarm.learners, clean_start, clean_end),
                "cores_busy": {
                    "clean": cores_busy(clean_cpu, attack_cpu, clean_end - clean_start),
                    "attacked": cores_busy(attack_cpu, end_cpu, attack_end - attack_start),
                },
                "phases": {
                    "clean": round_phases(swarm.learners, clean_start, clean_end),
                    "attacked": round_phases(swarm.learners, attack_start, attack_end),
                },
                "eval": eval_by_round(swarm.learners),
                "crashed": [c.name for c in swarm.learners if not c.alive()],
                "attacker": result[-8:],
            }
            log(
                f"  {attacks or 'clean':22s} rounds/min clean {figures['clean_rounds_per_min']:.1f} "
                f"attacked {figures['attack_rounds_per_min']:.1f}, lost {figures['clean_lost']}->"
                f"{figures['attack_lost']}, forks {figures['forks']}"
            )
            return figures
        finally:
            swarm.stop()
            reap_all()


SKEWED_PEER = REPO / "tests" / "net" / "skewed_peer.py"
LATER_S = 7200.0
"""How far on the second life's clocks are (`full_stop`): past the hour a round record lives."""


def _second_life(swarm: AttackedSwarm) -> tuple[Child, list[Child]]:
    """A fresh bootstrap node and the same learners (identities, checkpoints; the last with
    an empty directory), every process with its clock `LATER_S` on (tests/net/skewed_peer.py;
    the machine's clock is not touched)."""
    env = {**_env(), "P2PDILOCO_TEST_CLOCK_OFFSET_S": f"{LATER_S:g}"}
    boot = Child.spawn([sys.executable, str(SKEWED_PEER), "bootstrap", "--events"], "bootstrap2", cwd=REPO, env=env)
    maddrs = boot.wait_ready(READY_S)["maddrs"]
    learners = []
    for i in range(swarm.setting.learners):
        flags = swarm.learner_flags(i, maddrs, "empty" if i == swarm.setting.learners - 1 else "ckpt")
        args = [sys.executable, str(SKEWED_PEER), *child_join_args(*flags, sets=swarm.setting.sets())[2:]]
        learners.append(Child.spawn(args, f"learner{i}b", cwd=REPO, env=env))
    for child in learners:
        child.wait_ready(JOIN_S)
    return boot, learners


def run_full_stop(setting: NetSetting, log: Callable[[str], None]) -> dict[str, Any]:
    """Issue 42, item 5, as a benchmark: a clean window; then every peer and the bootstrap
    node stop (SIGTERM, each saves its checkpoint), and all come back with clocks two hours
    on, past every record's life, the last learner with an empty directory; the second
    window counts from the first round applied after the restart. `forks` spans both
    lives; `rewinds`: rounds a restarted peer applied below the rounds its checkpoint held
    (applied twice); `history`: whether the first round closed after the restart had
    screening history (`history_from` >= 0)."""
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as tmp:
        swarm = AttackedSwarm(setting, Path(tmp))
        second: list[Child] = []
        boot2 = None
        try:
            swarm.start()
            clean_start = time.time()
            time.sleep(setting.window_s)
            clean_end = time.time()
            swarm.stop()
            first = swarm.learners
            saved = [c.of("checkpoint_saved")[-1]["global_rounds"] if c.of("checkpoint_saved") else [] for c in first]
            boot2, second = _second_life(swarm)
            first_applied = second[0].wait_event(lambda e: e.get("event") == "applied", JOIN_S)
            time.sleep(setting.window_s)
            # the second life's events carry its clocks' time, LATER_S on
            attack_start = first_applied["t"]
            attack_end = attack_start + setting.window_s
            rewound = [  # the last one came back with nothing: it has nothing to rewind
                [child.name, e["fragment"], e["round"], rounds[e["fragment"]]]
                for child, rounds in zip(second[:-1], saved[:-1], strict=True) if rounds
                for e in child.of("applied") if e["round"] < rounds[e["fragment"]]
            ]  # fmt: skip
            rewinds = len(rewound)
            closed = sorted(
                (e["t"], e.get("history_from", -1)) for c in second for e in c.of("round_closed")
            )  # fmt: skip
            figures = {
                "clean_rounds_per_min": rounds_per_min(first, clean_start, clean_end),
                "attack_rounds_per_min": rounds_per_min(second, attack_start, attack_end),
                "clean_lost": lost_deltas(first, clean_start, clean_end),
                "attack_lost": lost_deltas(second, attack_start, attack_end),
                "lost_reasons": lost_reasons(second, attack_start, attack_end),
                "forks": forks([*first, *second]),
                "rewinds": rewinds,
                "rewound": rewound[:8],
                "history": bool(closed) and closed[0][1] >= 0,
                "restart_s": attack_start - LATER_S - clean_end,
                "repairs": repairs(second, attack_start, attack_end),
                "clean_repairs": repairs(first, clean_start, clean_end),
                "eval": eval_by_round([*first, *second]),
                "crashed": [c.name for c in second if not c.alive()],
                "attacker": [],
            }
            log(
                f"  {'full_stop':22s} rounds/min clean {figures['clean_rounds_per_min']:.1f} "
                f"after the restart {figures['attack_rounds_per_min']:.1f} ({figures['restart_s']:.0f} s to the "
                f"first round), forks {figures['forks']}, rewinds {rewinds}, history {figures['history']}"
            )
            return figures
        finally:
            stop_children([*second, boot2])
            swarm.stop()
            reap_all()


def attack_figures(attacked: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's per-attack figures from an attacked swarm and a clean reference swarm."""
    ratio = attacked["attack_rounds_per_min"] / max(attacked["clean_rounds_per_min"], 1e-9)
    common = loss_at_common_round(attacked["eval"], reference["eval"])
    return {
        "rounds_ratio": ratio,
        "loss_shift": (common[1] - common[2]) / common[2] if common else None,
        "loss_round": common[0] if common else None,
        "honest_lost": max(attacked["attack_lost"] - attacked["clean_lost"], 0),
        "honest_lost_raw": attacked["attack_lost"],
        "forks": attacked["forks"],
        **{k: attacked[k] for k in ("rewinds", "rewound", "history", "restart_s", "lost_reasons") if k in attacked},
        "on_attacker_states": attacked.get("on_attacker_states", 0),
        "repairs": {"clean": attacked["clean_repairs"], "attacked": attacked["repairs"]},
        "crashed": attacked["crashed"],
        "rounds_per_min": {"clean": attacked["clean_rounds_per_min"], "attacked": attacked["attack_rounds_per_min"]},
        "phases": attacked.get("phases"),
        "cores_busy": attacked.get("cores_busy"),
        "attacker": attacked["attacker"],
    }
