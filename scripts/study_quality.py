"""Quality study: which outer optimizer, warm start, H, inner lr, merge rule, quorum and
on-receive rule close the gap between the swarm and synchronous data parallel.

Every variant is a list of `--set` overrides on one setting. Each runs the decoupled
simulator alone (DiLoCo only); the synchronous baseline of the setting runs once, since
it depends on neither the outer optimizer nor the schedule, and every variant keeps the
setting's total inner steps, so all are compared at equal tokens. Variants run in
parallel processes (`--jobs`), each with its share of the CPU threads.

    python scripts/study_quality.py --setting study --json out/study.json
    python scripts/study_quality.py --setting study --only outer_0.7_0.6 rda_1_0 --json out/s.json

The last line printed is a one-line summary; the table is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import FULL  # noqa: E402  (the full setting is bench_quality's)

SETTINGS = {
    "quick": [
        "model.preset='tiny'", "model.seq_len=64", "data.max_files=300", "train.batch_size=16",
        "train.warmup_steps=4", "sync.inner_steps=5", "simulate.rounds=4", "simulate.eval_batches=4",
    ],
    "study": [
        "model.preset='tiny'", "model.seq_len=64", "train.batch_size=8", "train.warmup_steps=25",
        "sync.inner_steps=25", "simulate.rounds=20", "simulate.eval_batches=8",
    ],
    "full": FULL,
    "study_b32": [
        "model.preset='tiny'", "model.seq_len=64", "train.batch_size=32", "train.warmup_steps=6",
        "sync.inner_steps=10", "simulate.rounds=12", "simulate.eval_batches=2",
    ],
}  # fmt: skip
"""The study setting: tiny, seq 64, batch 8, 500 inner steps a learner (2M tokens, ~5 min
a variant on one core); study_b32 the same tokens in batches four times larger (120
steps a learner, H = 10); quick and full are bench_quality's settings."""

HETEROGENEOUS = ["simulate.speeds='1,1,0.5,0.5'"]
BASELINES = {"sync": [], "sync_lr_x0.5": ["train.lr=0.0015"], "sync_lr_x2": ["train.lr=0.006"]}
"""Synchronous data parallel at the setting's lr, at half and at twice it: every variant
is compared with the best of them (`--baselines` picks which run)."""


def _variants() -> dict[str, list[str]]:
    """Name -> overrides. H variants keep H x rounds (the setting's 500 steps)."""
    best = ["outer.lr=0.7", "outer.momentum=0.6"]
    out: dict[str, list[str]] = {
        "diloco_default": ["outer.lr=0.7", "outer.momentum=0.9"],
        "outer_1_0": ["outer.lr=1.0", "outer.momentum=0"],
        "outer_1.6_0": ["outer.lr=1.6", "outer.momentum=0"],
        "outer_0.7_0.6": best,
        "outer_0.8_0.5": ["outer.lr=0.8", "outer.momentum=0.5"],
        "rda_1_0": ["outer.merge='radial'", "outer.lr=1.0", "outer.momentum=0"],
        "rda_0.7_0.6": ["outer.merge='radial'", *best],
        "mean_0.7_0.6": ["outer.merge='mean'", *best],
        "inner_lr_x0.5": [*best, "train.lr=0.0015"],
        "inner_lr_x0.7": [*best, "train.lr=0.002"],
        "inner_lr_x0.5_rda_1_0": ["outer.merge='radial'", "outer.lr=1.0", "outer.momentum=0", "train.lr=0.0015"],
        "inner_lr_x2": [*best, "train.lr=0.006"],
        "warm_10": [*best, "sync.warm_steps=50", "sync.warm_inner_steps=5"],
        "warm_20": [*best, "sync.warm_steps=100", "sync.warm_inner_steps=5"],
        "h_10": [*best, "sync.inner_steps=10", "simulate.rounds=50"],
        "h_50": [*best, "sync.inner_steps=50", "simulate.rounds=10"],
        "h_100": [*best, "sync.inner_steps=100", "simulate.rounds=5"],
        "rebase": [*best, "sync.on_receive='rebase'", "simulate.jitter=0.3"],
        "overwrite_jitter": [*best, "simulate.jitter=0.3"],
        # results that take 3 steps to come back: the steps taken meanwhile are dropped
        # (overwrite) or kept on top of the result (rebase)
        "latency_overwrite": ["outer.lr=1.0", "outer.momentum=0", "simulate.sync_s=3", "simulate.jitter=0.3"],
        "latency_rebase": [
            "outer.lr=1.0", "outer.momentum=0", "simulate.sync_s=3", "simulate.jitter=0.3",
            "sync.on_receive='rebase'",
        ],
    }
    for rule in ("mean", "token", "radial"):
        for quorum in (1, 4):  # K = 1 with the grace window, or K = all
            out[f"het_{rule}_k{quorum}"] = [
                "outer.lr=1.0", "outer.momentum=0", *HETEROGENEOUS, f"outer.merge='{rule}'",
                f"sync.min_quorum={quorum}",
            ]  # fmt: skip
    return out


VARIANTS = _variants()

SETTING_VARIANTS = {
    "full": {
        # H = 13 with int4 deltas: the same >= 100x fewer bytes as H = 26 with int8
        "h13_int4": ["sync.inner_steps=13", "simulate.rounds=40", "compress.codec='int4'"],
        "h13_int4_inner_lr_x0.67": [
            "sync.inner_steps=13", "simulate.rounds=40", "compress.codec='int4'", "train.lr=0.002",
        ],
        "inner_lr_x0.67": ["train.lr=0.002"],
        # the best outer step of the batch-8 sweep (lr 0.8 / Nesterov 0.5: 1.069 against
        # 1.107 for plain averaging at 50 rounds), tried with 40 rounds at this batch
        "h13_int4_outer_0.8_0.5": [
            "sync.inner_steps=13", "simulate.rounds=40", "compress.codec='int4'",
            "outer.merge='token'", "outer.lr=0.8", "outer.momentum=0.5",
        ],
        "h13_int4_outer_1.3_0": [
            "sync.inner_steps=13", "simulate.rounds=40", "compress.codec='int4'",
            "outer.merge='token'", "outer.lr=1.3", "outer.momentum=0",
        ],
        # H = 1: the learners' parameters averaged after every step, each with its own
        # AdamW; is the gap locality (H) or the per-learner optimizer? (fp32: no codec)
        "h1_fp32": [
            "sync.inner_steps=1", "simulate.rounds=520", "simulate.eval_every_rounds=26",
            "compress.codec='fp32'", "outer.merge='token'", "outer.lr=1.0", "outer.momentum=0",
        ],
        "h1_fp32_outer_2": [
            "sync.inner_steps=1", "simulate.rounds=520", "simulate.eval_every_rounds=26",
            "compress.codec='fp32'", "outer.merge='token'", "outer.lr=2.0", "outer.momentum=0",
        ],
        # short rounds with sparse deltas (top k, error feedback) to stay at >= 100x:
        # H = 1 with the top 1% (~130x smaller than fp32), H = 4 with the top 5% (~27x)
        "h1_topk1": [
            "sync.inner_steps=1", "simulate.rounds=520", "simulate.eval_every_rounds=26",
            "compress.codec='topk'", "compress.topk_fraction=0.01", "outer.merge='token'",
            "outer.lr=1.0", "outer.momentum=0",
        ],
        "h4_topk5": [
            "sync.inner_steps=4", "simulate.rounds=130", "simulate.eval_every_rounds=13",
            "compress.codec='topk'", "compress.topk_fraction=0.05", "outer.merge='token'",
            "outer.lr=1.0", "outer.momentum=0",
        ],
    },
}  # fmt: skip
"""Variants that only make sense in one setting (their H x rounds is that setting's)."""


def _total_steps(overrides: list[str], setting: list[str]) -> int:
    """H x rounds of a variant on a setting (the variant's values win)."""
    fields = dict(s.split("=", 1) for s in [*setting, *overrides] if "=" in s)
    return int(fields["sync.inner_steps"]) * int(fields["simulate.rounds"])


def variants_for(setting: str) -> dict[str, list[str]]:
    """The variants a setting can run: its own, and the shared ones that keep its H x
    rounds (the shared H variants are written for the study setting's 500 steps)."""
    total = _total_steps([], SETTINGS[setting])
    shared = {n: o for n, o in VARIANTS.items() if _total_steps(o, SETTINGS[setting]) == total}
    return {**shared, **SETTING_VARIANTS.get(setting, {})}


def time_to_target(times: list[float], losses: list[float], target: float) -> float | None:
    """Simulated time of the first evaluation at or below `target` (None: never)."""
    return next((t for t, x in zip(times, losses, strict=True) if x <= target), None)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_one(setting: list[str], overrides: list[str], baseline: bool) -> dict:
    """One simulation in this process: the decoupled DiLoCo run, or the baseline alone."""
    from p2pdiloco.config import load_config, replace
    from p2pdiloco.sim.simulate import baseline_alone, codec_channel, simulate
    from p2pdiloco.training.data import Corpus

    started = time.time()
    config = load_config(None, [*setting, "simulate.mode='decoupled'", *overrides])
    corpus = Corpus.from_config(config.data)
    if baseline:
        curve, tokens, _ = baseline_alone(config, corpus)
        return {"eval_loss": curve.eval_loss[-1], "tokens": tokens, "wall_s": time.time() - started,
                "curve": {"tokens": curve.tokens, "eval_loss": curve.eval_loss}}  # fmt: skip
    config = replace(config, simulate={"baseline": False})
    result = simulate(config, corpus=corpus, channel=codec_channel(config, config.compress.codec))
    return {
        "eval_loss": result.diloco_eval_loss, "tokens": result.tokens,
        "comm_reduction": result.comm_reduction, "schedule": result.schedule,
        "wall_s": time.time() - started,
        "curve": {"tokens": result.diloco.tokens, "eval_loss": result.diloco.eval_loss},
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="study")
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes")
    parser.add_argument(
        "--baselines", nargs="*", default=list(BASELINES), help=f"of {', '.join(BASELINES)}"
    )
    parser.add_argument("--json", type=Path, help="write (and extend) the figures here")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="override for every run"
    )
    args = parser.parse_args()
    variants = variants_for(args.setting)
    names = args.only or list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(variants)}")
    setting = [*SETTINGS[args.setting], *args.overrides]
    report = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    if report.get("setting_overrides") != setting:
        report = {"setting": args.setting, "setting_overrides": setting, "variants": {}}
    report.setdefault("baselines", {})
    threads = max(1, (os.cpu_count() or 1) // max(args.jobs, 1))
    tasks = {n: (BASELINES[n], True) for n in args.baselines if n not in report["baselines"]}
    tasks.update({n: (variants[n], False) for n in names})

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    with ProcessPoolExecutor(args.jobs, get_context("spawn"), _init_worker, (threads,)) as pool:
        futures = {pool.submit(run_one, setting, sets, base): name for name, (sets, base) in tasks.items()}
        for future in as_completed(futures):
            name = futures[future]
            try:
                out = future.result()
            except Exception as exc:  # a variant that cannot run is reported, the rest go on
                print(f"{name}: failed: {exc}", file=sys.stderr)
                continue
            if name in BASELINES:
                report["baselines"][name] = {"overrides": BASELINES[name], **out}
            else:
                report["variants"][name] = {"overrides": variants[name], **out}
            print(f"{name}: eval_loss={out['eval_loss']:.4f} ({out['wall_s']:.0f}s)", flush=True)
            save()
    reference = min(report["baselines"], key=lambda n: report["baselines"][n]["eval_loss"])
    report["reference"] = reference
    base = report["baselines"][reference]["eval_loss"]
    for entry in report["variants"].values():
        entry["loss_ratio"] = entry["eval_loss"] / base
    het = {n: e for n, e in report["variants"].items() if n.startswith("het_") and e.get("schedule")}
    if het:
        # wall-clock (simulated) to the loss every heterogeneous variant reaches
        target = max(e["eval_loss"] for e in het.values())
        report["het_target_loss"] = target
        for entry in het.values():
            entry["time_to_target_s"] = time_to_target(
                entry["schedule"]["eval_times_s"], entry["curve"]["eval_loss"], target
            )
    save()
    ranked = sorted(report["variants"].items(), key=lambda kv: kv[1]["loss_ratio"])
    for name, entry in ranked:
        extra = f" to_target={entry['time_to_target_s']}s" if "time_to_target_s" in entry else ""
        print(f"  {name:24s} loss_ratio={entry['loss_ratio']:.4f} comm={entry.get('comm_reduction', 0):.0f}x{extra}")
    best_name, best = ranked[0]
    print(f"study_quality {args.setting}: {reference}={base:.4f} best={best_name} loss_ratio={best['loss_ratio']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
