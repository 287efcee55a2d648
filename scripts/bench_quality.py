"""Benchmark: DiLoCo's held-out loss against synchronous data parallel at equal tokens.

Runs the in-process simulator (M learners, H inner steps, outer Nesterov) and the
synchronous baseline (gradients of the same M micro-batches averaged every step) in one
run on the embedded corpus, then the merge rules side by side and M = 1, 2, 4.

`--mode decoupled` runs the swarm's schedule instead of lockstep DiLoCo
(`p2pdiloco.sim.decoupled`); `--heterogeneous` makes two of four learners half as fast, with
K = 1 and the grace window. `--agreement` also runs a real swarm (`p2pdiloco join`
processes on 127.0.0.1) and the decoupled simulator on its measured schedule, and reports
how far apart their held-out losses end.

    python scripts/bench_quality.py --quick --json out/quality.json
    python scripts/bench_quality.py --json out/quality.json --plot docs/quality_loss.png
    python scripts/bench_quality.py --quick --mode decoupled --heterogeneous --agreement

The last line printed is a one-line summary. Full setting: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from p2pdiloco.config import RunConfig, load_config, replace
from p2pdiloco.sim.common import DeltaChannel, fp32_channel
from p2pdiloco.sim.simulate import SimulationResult, codec_channel, simulate
from p2pdiloco.training.data import Corpus

QUICK = [
    "model.preset='tiny'",
    "model.seq_len=64",
    "data.max_files=300",
    "train.batch_size=16",
    "train.warmup_steps=4",
    "sync.inner_steps=5",
    "simulate.rounds=4",
    "simulate.eval_batches=4",
]
"""Quick setting (~1 min): 1024 tokens a learner step (the quality rule's batch, scaled
down), 20 steps a learner."""
FULL = [
    "model.preset='tiny'",
    "model.seq_len=128",
    "train.batch_size=32",
    "train.warmup_steps=20",
    "sync.inner_steps=26",
    "simulate.rounds=20",
    "simulate.eval_batches=4",
]
"""Full setting: tiny (0.84M parameters), 4096 tokens a learner step, 520 steps a learner:
8.5M tokens (10 per parameter); H = 26 gives >= 100x fewer bytes with int8 deltas."""


HETEROGENEOUS = ["simulate.speeds='1,1,0.5,0.5'", "sync.min_quorum=1"]
"""Two learners at full speed, two at half; K = 1 with the grace window (Eq. 3)."""
AGREEMENT = [
    "model.preset='tiny'",
    "model.seq_len=64",
    "data.max_files=300",
    "train.batch_size=4",
    "train.warmup_steps=10",
    "train.device='cpu'",
    "sync.inner_steps=20",
]
"""The agreement check: real learners (tiny), 10 rounds; K and the learner count are
`--agreement-quorums` / `--agreement-learners` (default: 3 learners, K = 3)."""
AGREEMENT_LEARNERS, AGREEMENT_ROUNDS, AGREEMENT_EVAL_BATCHES = 3, 10, 8


def make_channel(config: RunConfig, codec_name: str) -> DeltaChannel:
    """The path a delta takes: fp32 as is, or through a codec (with error feedback)."""
    if codec_name == "fp32":
        return fp32_channel
    return codec_channel(config, codec_name)


def figures(result: SimulationResult) -> dict:
    """The JSON figures of one simulation."""
    out = {
        "learners": result.learners,
        "inner_steps": result.inner_steps,
        "rounds": result.rounds,
        "merge": result.merge_rule,
        "tokens": result.tokens,
        "tokens_per_param": result.tokens / result.num_parameters,
        "mode": result.mode,
        "schedule": result.schedule,
        "diloco_eval_loss": result.diloco_eval_loss,
        "comm_reduction": result.comm_reduction,
        "diloco_curve": {"tokens": result.diloco.tokens, "eval_loss": result.diloco.eval_loss},
    }
    if result.sync is not None:
        out["sync_eval_loss"] = result.sync_eval_loss
        out["loss_ratio"] = result.diloco_eval_loss / result.sync_eval_loss
        out["sync_curve"] = {"tokens": result.sync.tokens, "eval_loss": result.sync.eval_loss}
    return out


CODEC_RUNS = [
    ("fp32", True),
    ("int8", True),
    ("int4", True),
    ("fp4", True),
    ("topk", True),
    ("topk", False),
    ("int4", False),
]
"""(codec, error feedback) pairs of the codec sweep."""


def codec_sweep(config: RunConfig, corpus: Corpus, main_result: dict) -> dict:
    """DiLoCo's loss with each delta codec, next to the same synchronous baseline."""
    out = {}
    fp32_loss = None
    for codec, feedback in CODEC_RUNS:
        run_config = replace(
            config, simulate={"baseline": False}, compress={"error_feedback": feedback}
        )
        result = simulate(run_config, corpus=corpus, channel=make_channel(run_config, codec))
        loss = result.diloco_eval_loss
        fp32_loss = loss if codec == "fp32" else fp32_loss
        name = codec if feedback or codec == "fp32" else f"{codec}_no_ef"
        out[name] = {
            "diloco_eval_loss": loss,
            "loss_ratio": loss / main_result["sync_eval_loss"],
            "vs_fp32": loss / fp32_loss if fp32_loss else None,
            "bytes_per_learner": result.diloco_bytes_per_learner,
            "comm_reduction": result.comm_reduction,
        }
    return out


def real_swarm(sets: list[str], learners: int, rounds: int, eval_batches: int) -> dict:
    """A bootstrap node and `learners` real peers on 127.0.0.1 until `rounds` rounds; the
    held-out loss of learner 0's global model after the last round and each learner's
    measured step time and steps."""
    from p2pdiloco.cli.launcher import Child

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = [sys.executable, "-m", "p2pdiloco"]
    set_args = sum((["--set", s] for s in sets), [])
    boot = Child.spawn([*argv, "bootstrap", "--events", *set_args], "boot", env=env)
    peers: list[Child] = []
    try:
        maddrs = boot.wait_ready(300)["maddrs"]
        peers = [
            Child.spawn(
                [*argv, "join", "--events", "--threads", "1", "--max-rounds", str(rounds),
                 "--data-shards", str(learners), "--data-rank", str(i), "--wait-peers", str(learners),
                 "--eval-batches", str(eval_batches if i == 0 else 0), "--initial-peers", *maddrs, *set_args],
                f"peer{i}", env=env,
            )  # fmt: skip
            for i in range(learners)
        ]
        for peer in peers:
            peer.wait_event(lambda e: e.get("event") == "summary", 1800)
        evals = [e for e in peers[0].of("eval") if e["rounds"][0] >= rounds]
        summaries = [peer.first("summary") for peer in peers]
        for peer in peers:
            peer.stop(60)
    finally:
        boot.stop(10)
    return {
        "eval_loss": (evals or peers[0].of("eval"))[-1]["eval_loss"],
        "step_s": [s["train_s"] / max(s["steps"], 1) for s in summaries],
        "steps": [s["steps"] for s in summaries],
        "latency_s": statistics.median([x for s in summaries for x in s["latencies_s"]] or [0.0]),
        # close to commit on the synchronizers (merge, hold, record): the simulator's sync_s
        "sync_s": statistics.median(
            [e["sync_s"] for peer in peers for e in peer.of("round_closed") if "sync_s" in e] or [0.0]
        ),
        "grace_s": statistics.median([e["grace_s"] for peer in peers for e in peer.of("round_closed")] or [0.0]),
        # steps carried by committed deltas / steps computed (one fragment: fragment-steps)
        "work_efficiency": sum(s.get("steps_contributed", 0) for s in summaries)
        / max(sum(s["steps"] for s in summaries), 1),
        "rounds": max(max(s["rounds"]) for s in summaries),
    }


def agreement(corpus: Corpus, learners: int = AGREEMENT_LEARNERS, quorum: int = AGREEMENT_LEARNERS) -> dict:
    """A real swarm and the decoupled simulator on the schedule it measured: how far apart
    their held-out losses end (relative). The simulator gets the real learners' step times
    (as speeds), their mean step count as its length, the synchronizers' median commit
    time as `sync_s` and half of what the median send-to-result latency leaves after it and
    the median grace as `link_s`; the data shards, seeds, schedule of the learning rate and the
    held-out batches are the same."""
    total_steps = AGREEMENT_ROUNDS * 20
    sets = [*AGREEMENT, f"train.total_steps={total_steps}", f"sync.min_quorum={quorum}"]
    real = real_swarm(sets, learners, AGREEMENT_ROUNDS, AGREEMENT_EVAL_BATCHES)
    fastest = min(real["step_s"])
    speeds = ",".join(f"{fastest / s:.3f}" for s in real["step_s"])
    config = load_config(None, [
        *sets, "simulate.mode='decoupled'", f"simulate.learners={learners}",
        f"simulate.rounds={round(statistics.mean(real['steps']) / 20)}", "simulate.baseline=false",
        f"simulate.eval_batches={AGREEMENT_EVAL_BATCHES}", f"simulate.speeds='{speeds}'",
        f"simulate.step_time_s={fastest}", f"simulate.sync_s={real['sync_s']}",
        f"simulate.link_s={max(real['latency_s'] - real['sync_s'] - real['grace_s'], 0.0) / 2:.4f}",
    ])  # fmt: skip
    simulated = simulate(config, corpus=corpus, channel=make_channel(config, config.compress.codec))
    simulated_efficiency = simulated.schedule["work_efficiency"]
    return {
        "learners": learners,
        "min_quorum": quorum,
        "real_eval_loss": real["eval_loss"],
        "simulated_eval_loss": simulated.diloco_eval_loss,
        "relative_difference": abs(simulated.diloco_eval_loss - real["eval_loss"]) / real["eval_loss"],
        "real_work_efficiency": real["work_efficiency"],
        "simulated_work_efficiency": simulated_efficiency,
        "work_efficiency_difference": abs(simulated_efficiency - real["work_efficiency"]),
        "real_rounds": real["rounds"],
        "simulated_rounds": simulated.schedule["rounds"],
        "real_step_s": real["step_s"],
        "real_steps": real["steps"],
        "real_latency_s": real["latency_s"],
        "real_sync_s": real["sync_s"],
        "real_grace_s": real["grace_s"],
        "simulated_schedule": simulated.schedule,
    }


def _baseline_worker(config: RunConfig) -> tuple[list[int], list[float], int]:
    """The synchronous baseline in a process of its own, on one thread."""
    import torch

    from p2pdiloco.sim.simulate import baseline_alone

    torch.set_num_threads(1)
    curve, _, sent = baseline_alone(config)
    return curve.tokens, curve.eval_loss, sent


def main_simulation(config: RunConfig, corpus: Corpus, channel: DeltaChannel, jobs: int) -> SimulationResult:
    """DiLoCo and its baseline: one after the other, or (`--jobs 2`) side by side, one
    thread each, which on two cores takes ~15% less time. The same figures either way."""
    if jobs < 2 or not config.simulate.baseline:
        return simulate(config, corpus=corpus, channel=channel)
    import dataclasses
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import torch

    from p2pdiloco.sim.common import LossCurve

    with ProcessPoolExecutor(1, get_context("spawn")) as pool:
        baseline = pool.submit(_baseline_worker, config)
        torch.set_num_threads(1)
        result = simulate(replace(config, simulate={"baseline": False}), corpus=corpus, channel=channel)
        tokens, losses, sent = baseline.result()
    return dataclasses.replace(
        result, sync=LossCurve(list(tokens), list(losses)), sync_bytes_per_learner=sent
    )


def plot(main: dict, path: Path) -> None:
    """Held-out loss against tokens for DiLoCo and synchronous DP (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: pip install 'p2pdiloco[bench]' to plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(
        main["sync_curve"]["tokens"],
        main["sync_curve"]["eval_loss"],
        label="synchronous DP",
        marker="o",
    )
    ax.plot(
        main["diloco_curve"]["tokens"],
        main["diloco_curve"]["eval_loss"],
        label=f"DiLoCo M={main['learners']} H={main['inner_steps']}",
        marker="s",
    )
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"{main['merge']} merge, comm reduction {main['comm_reduction']:.0f}x")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute on 2 CPU cores")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--plot", type=Path, help="write a PNG of loss against tokens here")
    parser.add_argument(
        "--codec", default="fp32", help="delta codec for the DiLoCo runs (fp32, int8, ...)"
    )
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument(
        "--jobs", type=int, default=1, help="2: the baseline in a second process, beside DiLoCo"
    )
    parser.add_argument(
        "--no-sweeps", action="store_true", help="skip the merge-rule and learner-count sweeps"
    )
    parser.add_argument(
        "--codec-sweep", action="store_true", help="DiLoCo with every codec against one baseline"
    )
    parser.add_argument("--mode", choices=("lockstep", "decoupled"), default="lockstep")
    parser.add_argument(
        "--heterogeneous", action="store_true", help="two learners at half speed, K = 1 (decoupled)"
    )
    parser.add_argument(
        "--agreement", action="store_true", help="also a real swarm against the simulator (minutes)"
    )
    parser.add_argument(
        "--agreement-learners", type=int, default=AGREEMENT_LEARNERS, help="real learners of the agreement check"
    )
    parser.add_argument(
        "--agreement-quorums", default=str(AGREEMENT_LEARNERS),
        help="comma-separated K of the agreement check, one real swarm each (e.g. 1,2)",
    )  # fmt: skip
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config override"
    )
    args = parser.parse_args()
    if args.heterogeneous and args.mode != "decoupled":
        parser.error("--heterogeneous needs --mode decoupled (lockstep has no speeds)")

    started = time.time()
    config = load_config(
        None,
        [
            *(QUICK if args.quick else FULL), f"simulate.learners={args.learners}",
            f"simulate.mode='{args.mode}'", *(HETEROGENEOUS if args.heterogeneous else []), *args.overrides,
        ],
    )  # fmt: skip
    corpus = Corpus.from_config(config.data)
    channel = make_channel(config, args.codec)
    main_result = figures(main_simulation(config, corpus, channel, args.jobs))
    report = {
        **main_result, "codec": args.codec, "setting": "quick" if args.quick else "full",
        "heterogeneous": args.heterogeneous, "inner_lr": config.train.lr,
        "baseline_lr": config.simulate.baseline_lr or config.train.lr,
        "outer": {"lr": config.outer.lr, "momentum": config.outer.momentum, "merge": config.outer.merge},
        "batch_tokens": config.train.batch_size * config.model.seq_len,
    }  # fmt: skip

    if args.codec_sweep:
        report["codecs"] = codec_sweep(config, corpus, main_result)
    if not args.no_sweeps:
        # Merge rules side by side (the baseline does not depend on the rule).
        report["rules"] = {
            main_result["merge"]: {
                "diloco_eval_loss": main_result["diloco_eval_loss"],
                "loss_ratio": main_result["loss_ratio"],
            }
        }
        for rule in ("mean", "token", "radial"):
            if rule in report["rules"]:
                continue
            rule_config = replace(config, outer={"merge": rule}, simulate={"baseline": False})
            loss = simulate(
                rule_config, corpus=corpus, channel=make_channel(rule_config, args.codec)
            ).diloco_eval_loss
            report["rules"][rule] = {
                "diloco_eval_loss": loss,
                "loss_ratio": loss / main_result["sync_eval_loss"],
            }
        # Learner counts: each with its own baseline on the same M micro-batches.
        report["learner_counts"] = {
            str(args.learners): {
                k: main_result[k] for k in ("diloco_eval_loss", "sync_eval_loss", "loss_ratio")
            }
        }
        for count in (1, 2, 4):
            if str(count) in report["learner_counts"]:
                continue
            count_config = replace(config, simulate={"learners": count})
            result = figures(
                simulate(
                    count_config, corpus=corpus, channel=make_channel(count_config, args.codec)
                )
            )
            report["learner_counts"][str(count)] = {
                k: result[k] for k in ("diloco_eval_loss", "sync_eval_loss", "loss_ratio")
            }

    if args.agreement:
        checks = [
            agreement(corpus, args.agreement_learners, int(k)) for k in args.agreement_quorums.split(",")
        ]
        report["agreement"] = checks[0]
        report["agreements"] = checks
    report["wall_s"] = round(time.time() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(main_result, args.plot)
    print(
        f"bench_quality {report['setting']} {args.mode}{' heterogeneous' if args.heterogeneous else ''}: "
        f"M={report['learners']} H={report['inner_steps']} codec={args.codec} "
        f"diloco={report['diloco_eval_loss']:.4f} sync={report['sync_eval_loss']:.4f} "
        f"loss_ratio={report['loss_ratio']:.4f} comm_reduction={report['comm_reduction']:.0f}x wall={report['wall_s']}s"
        + (f" agreement={report['agreement']['relative_difference']:.4f}" if args.agreement else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
