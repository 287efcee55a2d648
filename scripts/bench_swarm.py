"""Benchmark: a swarm of peers on loopback against lone learners with no network.

Both phases run the same model, data and number of inner steps as four OS processes on
this machine, one torch thread each, so they compete for the CPU the same way; the only
difference is the network (DHT, synchronizer windows, codecs, merges). Figures:

    compute_utilization   swarm learner inner-step throughput / lone learner's (target >= 0.95)
    round_latency_s       median time from a learner's send to its receipt of the result
    bytes_sent_per_round_per_peer, rounds, replicas_identical

    python scripts/bench_swarm.py --quick --json out/swarm.json [--transport libp2p]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco.cli.argv import set_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, wait_all_ready  # noqa: E402

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
    from p2pdiloco.training.data import Corpus, learner_batches
    from p2pdiloco.training.model import build_model
    from p2pdiloco.training.train import InnerTrainer

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


def _spawn(argv: list[str], name: str, stdin: bool = False) -> Child:
    """`python <argv>` from the checkout, in its own process group."""
    return Child.spawn([sys.executable, *argv], name, cwd=REPO, env=_env(), stdin=stdin)


def _finish(children: list[Child], deadline: float) -> list[int | None]:
    """Each child's exit code, waiting until `deadline`; SIGKILL of the group after it."""
    codes = []
    for child in children:
        code = child.wait_exit(deadline - time.monotonic())
        codes.append(code if code is not None else child.kill())
    return codes


def _report_failures(children: list[Child], codes: list[int | None]) -> None:
    """Name each child that left no summary, with the end of its stderr."""
    for child, code in zip(children, codes, strict=True):
        if child.first("summary") is None:
            print(
                f"bench_swarm: {child.name} exited {code} without a summary; stderr tail:",
                file=sys.stderr,
            )
            print(child.stderr_tail(2000), file=sys.stderr)


def run_lone(sets: list[str], steps: int, num: int, timeout_s: float) -> list[dict | None]:
    """`num` lone learners, released together once all are ready; their summaries."""
    children = [
        _spawn(
            [
                __file__,
                "--lone-worker",
                "--rank",
                str(i),
                "--steps",
                str(steps),
                *set_args(sets),
            ],
            f"lone{i}",
            stdin=True,
        )
        for i in range(num)
    ]
    try:
        deadline = time.monotonic() + timeout_s
        wait_all_ready(children, timeout_s)
        for child in children:
            child.write_line("go")
        codes = _finish(children, deadline)
        _report_failures(children, codes)
        return [child.first("summary") for child in children]
    finally:
        for child in children:
            child.reap()


def run_swarm(sets: list[str], steps: int, num: int, timeout_s: float) -> list[list[dict]]:
    """A bootstrap node and `num` peers that leave after `steps`; each peer's events."""
    boot = _spawn(["-m", "p2pdiloco", "bootstrap", "--events", *set_args(sets)], "bootstrap")
    peers: list[Child] = []
    try:
        deadline = time.monotonic() + timeout_s
        maddrs = boot.wait_ready(timeout_s)["maddrs"]
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
            *set_args(sets),
        ]
        peers = [_spawn([*args, "--data-rank", str(i)], f"peer{i}") for i in range(num)]
        codes = _finish(peers, deadline)
        _report_failures(peers, codes)
        return [list(peer.events) for peer in peers]
    finally:
        boot.stop(30)
        for child in [*peers, boot]:
            child.reap()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--transport", choices=("hivemind", "libp2p"), default="hivemind")
    parser.add_argument("--lone-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lone_worker:
        lone_worker(args.overrides, args.steps, args.rank)
        return 0

    setting = QUICK if args.quick else FULL
    sets = [*setting["sets"], *COMMON, f"network.transport='{args.transport}'", *args.overrides]
    steps = setting["steps"]
    started = time.time()
    lone = run_lone(sets, steps, args.peers, timeout_s=1800)
    swarm_logs = run_swarm(sets, steps, args.peers, timeout_s=1800)
    summaries = [next((e for e in log if e.get("event") == "summary"), None) for log in swarm_logs]
    if any(s is None for s in [*lone, *summaries]):
        print("bench_swarm: a learner did not finish (stderr tails above)", file=sys.stderr)
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
        "transport": args.transport,
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
        f"bench_swarm {report['setting']} transport={args.transport}: peers={report['peers']} rounds={report['rounds']} "
        f"compute_utilization={report['compute_utilization']:.3f} round_latency_s={report['round_latency_s']:.2f} "
        f"bytes/round/peer={report['bytes_sent_per_round_per_peer']:.0f} replicas_identical={report['replicas_identical']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
