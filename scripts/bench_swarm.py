"""Benchmark: a swarm of peers on loopback against lone learners with no network.

Both phases run the same model, data and number of inner steps as four OS processes on
this machine, one torch thread each, so they compete for the CPU the same way; the only
difference is the network (DHT, synchronizer windows, codecs, merges). Figures:

    compute_utilization   swarm learner inner-step throughput / lone learner's (target >= 0.95)
    round_latency_s       median time from a learner's send to its receipt of the result
    bytes_sent_per_round_per_peer, rounds, replicas_identical

    python scripts/bench_swarm.py --quick --json out/swarm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

QUICK = {
    "sets": [
        "model.preset='tiny'",
        "model.seq_len=64",
        "train.batch_size=4",
        "sync.inner_steps=20",
        "data.max_files=200",
    ],
    "steps": 160,
}
FULL = {
    "sets": [
        "model.preset='tiny'",
        "model.seq_len=128",
        "train.batch_size=8",
        "sync.inner_steps=50",
        "data.max_files=600",
    ],
    "steps": 600,
}
COMMON = ["train.device='cpu'", "sync.min_quorum=2"]


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def lone_worker(sets: list[str], steps: int, rank: int) -> None:
    """One learner with no network: the same inner loop, timed the same way."""
    import torch

    from p2pdiloco.config import load_config
    from p2pdiloco.data import Corpus, learner_batches
    from p2pdiloco.model import build_model
    from p2pdiloco.train import InnerTrainer

    torch.set_num_threads(1)
    config = load_config(None, sets)
    corpus = Corpus.from_config(config.data)
    batches = learner_batches(
        corpus, rank, 1, config.train.batch_size, config.model.seq_len, config.train.seed
    )
    trainer = InnerTrainer(
        build_model(config.model.preset, max_seq_len=config.model.seq_len),
        config.train,
        torch.device("cpu"),
    )
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # the start barrier: every lone learner begins at once, as the peers do
    started = time.monotonic()
    for _ in range(steps):
        trainer.step(batches)
    print(
        json.dumps({"event": "summary", "steps": steps, "loop_s": time.monotonic() - started}),
        flush=True,
    )


def _read_events(proc: subprocess.Popen) -> list[dict]:
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def run_lone(sets: list[str], steps: int, num: int) -> list[dict]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--lone-worker",
                "--rank",
                str(i),
                "--steps",
                str(steps),
                *sum((["--set", s] for s in sets), []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=REPO,
        )
        for i in range(num)
    ]
    for proc in procs:
        assert proc.stdout is not None
        proc.stdout.readline()  # {"ready": true}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return [next(e for e in _read_events(p) if e.get("event") == "summary") for p in procs]


def run_swarm(sets: list[str], steps: int, num: int, timeout_s: float) -> list[list[dict]]:
    boot = subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco", "bootstrap", "--events"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=REPO,
        start_new_session=True,
    )
    try:
        assert boot.stdout is not None
        maddrs = json.loads(boot.stdout.readline())["maddrs"]
        args = [
            "-m",
            "p2pdiloco",
            "join",
            "--events",
            "--threads",
            "1",
            "--eval-batches",
            "0",
            "--max-steps",
            str(steps),
            "--wait-peers",
            str(num),
            "--initial-peers",
            *maddrs,
        ]
        for item in sets:
            args += ["--set", item]
        procs = [
            subprocess.Popen(
                [sys.executable, *args, "--data-rank", str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=_env(),
                cwd=REPO,
                start_new_session=True,
            )
            for i in range(num)
        ]
        deadline = time.monotonic() + timeout_s
        logs = []
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
            logs.append(_read_events(proc))
        return logs
    finally:
        boot.terminate()
        try:
            boot.wait(30)
        except subprocess.TimeoutExpired:
            boot.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--lone-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lone_worker:
        lone_worker(args.overrides, args.steps, args.rank)
        return 0

    setting = QUICK if args.quick else FULL
    sets = [*setting["sets"], *COMMON, *args.overrides]
    steps = setting["steps"]
    started = time.time()
    lone = run_lone(sets, steps, args.peers)
    swarm_logs = run_swarm(sets, steps, args.peers, timeout_s=1800)
    summaries = [next((e for e in log if e.get("event") == "summary"), None) for log in swarm_logs]
    if any(s is None for s in summaries):
        print("bench_swarm: a peer did not finish; see its stderr", file=sys.stderr)
        return 1
    lone_rate = statistics.mean(s["steps"] / s["loop_s"] for s in lone)
    swarm_rate = statistics.mean(s["steps"] / s["loop_s"] for s in summaries)
    latencies = [x for s in summaries for x in s["latencies_s"]]
    hashes: dict[tuple[int, int], set[str]] = {}
    for log in swarm_logs:
        for e in log:
            if e.get("event") == "applied":
                hashes.setdefault((e["fragment"], e["round"]), set()).add(e["hash"])
    report = {
        "setting": "quick" if args.quick else "full",
        "peers": args.peers,
        "inner_steps_per_peer": steps,
        "rounds": min(min(s["rounds"]) for s in summaries),
        "compute_utilization": swarm_rate / lone_rate,
        "swarm_steps_per_s": swarm_rate,
        "swarm_train_fraction": statistics.mean(s["train_s"] / s["loop_s"] for s in summaries),
        "lone_steps_per_s": lone_rate,
        "round_latency_s": statistics.median(latencies) if latencies else None,
        "bytes_sent_per_round_per_peer": statistics.mean(
            s["bytes_sent"] / max(s["rounds_contributed"], 1) for s in summaries
        ),
        "rounds_contributed": [s["rounds_contributed"] for s in summaries],
        "replicas_identical": bool(hashes) and all(len(v) == 1 for v in hashes.values()),
        "wall_s": round(time.time() - started, 1),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"bench_swarm {report['setting']}: peers={report['peers']} rounds={report['rounds']} "
        f"compute_utilization={report['compute_utilization']:.3f} round_latency_s={report['round_latency_s']:.2f} "
        f"bytes/round/peer={report['bytes_sent_per_round_per_peer']:.0f} replicas_identical={report['replicas_identical']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
