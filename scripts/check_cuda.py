"""Measure a learner on a CUDA GPU: tokens/s, the share of time it waits on the swarm, and
peak memory, for the `small` and `150m` presets.

    python scripts/check_cuda.py [--quick] [--json out/cuda.json] [--presets small,150m]

For each preset, two runs of the same inner loop (bf16 autocast, fp32 master weights):

  lone   the `InnerTrainer` alone, in this process: no network, no shipping;
  swarm  a one-peer swarm (`p2pdiloco join --new-run`, quorum 1) as a child process: it
         stages a fragment every H/P steps (pinned, async copy), encodes and ships it,
         synchronises the round itself, applies the outer step and takes the fragment back.

wait_share = 1 - swarm tokens/s / lone tokens/s: the share of the training stream's time
lost to the swarm's work on the training thread. Throughput is timed between the loop's
log points after warm-up (a log point reads the loss, so it waits for the device).

Without a GPU it says so and exits 0 (nothing to measure). `--device cpu --presets tiny`
runs the same measurement on the CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

import torch  # noqa: E402

from p2pdiloco.cli.argv import set_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, reap_all  # noqa: E402
from p2pdiloco.config import load_config  # noqa: E402
from p2pdiloco.training.data import Corpus, learner_batches  # noqa: E402
from p2pdiloco.training.model import build_model  # noqa: E402
from p2pdiloco.training.train import InnerTrainer, resolve_device  # noqa: E402

SETTINGS = {
    # preset: micro-batch, sequence length, inner steps H, fragments P, measured steps
    "tiny": {"batch_size": 8, "seq_len": 64, "inner_steps": 20, "num_fragments": 2, "steps": 60},
    "small": {
        "batch_size": 32,
        "seq_len": 256,
        "inner_steps": 50,
        "num_fragments": 5,
        "steps": 300,
    },
    "150m": {
        "batch_size": 16,
        "seq_len": 1024,
        "inner_steps": 50,
        "num_fragments": 5,
        "steps": 200,
    },
}
WARMUP_STEPS = 10
WAIT_S = 900


def run_sets(preset: str, device: str) -> list[str]:
    s = SETTINGS[preset]
    return [
        f"model.preset='{preset}'",
        f"model.seq_len={s['seq_len']}",
        "data.max_files=3000",
        f"train.batch_size={s['batch_size']}",
        f"train.device='{device}'",
        "train.warmup_steps=20",
        f"sync.inner_steps={s['inner_steps']}",
        f"sync.num_fragments={s['num_fragments']}",
        "sync.min_quorum=1",
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_lone(preset: str, device_name: str, steps: int) -> dict:
    """The inner loop alone: tokens/s after warm-up, and peak memory."""
    config = load_config(None, run_sets(preset, device_name))
    device = resolve_device(device_name)
    corpus = Corpus.from_config(config.data)
    batches = learner_batches(
        corpus, 0, 1, config.train.batch_size, config.model.seq_len, config.train.seed
    )
    model = build_model(preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    trainer = InnerTrainer(model, config.train, device)
    tokens = 0
    for _ in range(WARMUP_STEPS):
        trainer.step(batches)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(steps):
        tokens += trainer.step(batches).tokens
    trainer.read_loss()  # waits for the device, as the loop's log points do
    synchronize(device)
    elapsed_s = time.perf_counter() - started
    figures = {"tokens_per_s": tokens / elapsed_s, "step_s": elapsed_s / steps}
    if device.type == "cuda":
        figures["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the swarm child gets the whole GPU
    return figures


def run_swarm(preset: str, device_name: str, steps: int) -> dict:
    """A one-peer swarm as a child process: tokens/s between log points after warm-up."""
    argv = [sys.executable, "-m", "p2pdiloco", "join", "--new-run", "--no-checkpoint", "--events"]
    argv += ["--eval-batches", "0", "--max-steps", str(steps + 2 * WARMUP_STEPS)]
    if device_name == "cpu":
        argv += ["--threads", "1"]  # as the lone run: one core each, comparable
    argv += set_args(run_sets(preset, device_name))
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child = Child.spawn(argv, f"swarm-{preset}", cwd=REPO, env={"PYTHONPATH": pythonpath})
    child.wait_ready(300)
    child.wait_event(lambda e: e.get("event") == "stopped", WAIT_S)
    code = child.stop()
    if code != 0:
        raise RuntimeError(f"the swarm peer exited {code}:\n{child.stderr_tail(3000)}")
    summary = child.first("summary") or {}
    marks = [e for e in child.of("step") if e["step"] >= 2 * WARMUP_STEPS]
    first, last = marks[0], marks[-1]
    tokens_per_step = summary["tokens"] / max(summary["steps"], 1)
    elapsed_s = last["t"] - first["t"]
    figures = {
        "tokens_per_s": (last["step"] - first["step"]) * tokens_per_step / elapsed_s,
        "step_s": elapsed_s / (last["step"] - first["step"]),
        "rounds": summary.get("rounds"),
        "bytes_sent": summary.get("bytes_sent"),
    }
    finished = child.first("trainer_finished") or {}
    if "peak_memory_bytes" in finished:
        figures["peak_memory_bytes"] = finished["peak_memory_bytes"]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,150m", help="comma-separated model presets")
    parser.add_argument("--device", default="cuda", help="cuda (or cpu, to check the script)")
    parser.add_argument("--quick", action="store_true", help="a third of the steps")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_cuda skipped: no CUDA GPU is visible here (nothing to measure)")
        return 0
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = {}
    try:
        for preset in args.presets.split(","):
            steps = SETTINGS[preset]["steps"] // (3 if args.quick else 1)
            lone = run_lone(preset, args.device, steps)
            swarm = run_swarm(preset, args.device, steps)
            results[preset] = {
                "lone": lone,
                "swarm": swarm,
                "wait_share": 1.0 - swarm["tokens_per_s"] / lone["tokens_per_s"],
            }
    finally:
        reap_all()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    line = []
    for preset, r in results.items():
        peak = r["swarm"].get("peak_memory_bytes", 0) / 2**30
        print(
            f"{preset:6} lone {r['lone']['tokens_per_s']:10.0f} tok/s   "
            f"swarm {r['swarm']['tokens_per_s']:10.0f} tok/s   "
            f"wait share {r['wait_share']:6.1%}   peak {peak:6.2f} GiB"
        )
        line.append(f"{preset} {r['swarm']['tokens_per_s']:.0f} tok/s wait {r['wait_share']:.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": name, "results": results}, indent=2))
    print(f"check_cuda on {name}: " + "; ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
