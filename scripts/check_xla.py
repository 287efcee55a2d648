"""Check: a learner on XLA trains in a swarm beside a CPU learner, and XLA is used well.

Run it with the interpreter of the XLA environment (`scripts/setup_xla_env.sh`); on a
machine without a TPU, XLA's CPU backend stands in (PJRT_DEVICE=CPU, the default here):

    VENV/bin/python scripts/check_xla.py [--quick] [--json out/xla.json]
    PJRT_DEVICE=TPU python scripts/check_xla.py            # on a TPU VM

It starts a bootstrap node and two tiny learners on 127.0.0.1, one with
`train.device=xla` and one with `train.device=cpu` (by default the same interpreter;
`--cpu-python` runs it with another, e.g. the main environment's newer torch), with a
quorum of two so every round merges both. Then it checks that

  * both replicas hold the same global hash after every round they both applied;
  * the XLA learner's compile count is flat after warm-up (once each fragment came back
    and was evaluated): the inner step is one graph, and writing a received fragment
    into the replica does not change it;
  * the loss is not read every step: device-to-host reads per step, net of the reads
    that shipping fragments and evaluating account for, stay far below one.

Exit 0 when all hold, 1 when one does not, 2 when torch_xla is missing. The last line
is a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco.cli.argv import child_join_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, reap_all, wait_all_ready  # noqa: E402
from p2pdiloco.protocol.fragments import partition_fragments  # noqa: E402
from p2pdiloco.training.model import build_model  # noqa: E402

INNER_STEPS = 10
NUM_FRAGMENTS = 2
EVAL_BATCHES = 2
SETS = [
    "model.preset='tiny'",
    "model.seq_len=32",
    "data.max_files=60",
    "train.batch_size=2",
    "train.warmup_steps=5",
    f"sync.inner_steps={INNER_STEPS}",
    f"sync.num_fragments={NUM_FRAGMENTS}",
    "sync.min_quorum=2",
    "sync.round_deadline_s=120",
]
WAIT_S = 600
MAX_UNEXPLAINED_READS_PER_STEP = 0.5
"""A loss read every step would add 1.0; boundary effects of the window stay below this."""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, **(extra or {})}


def join_argv(python: str, device: str, maddrs: list[str], max_rounds: int) -> list[str]:
    flags = ["--wait-peers", "2", "--eval-batches", str(EVAL_BATCHES), "--max-rounds", str(max_rounds)]
    sets = [*SETS, f"train.device='{device}'"]
    return [python, *child_join_args(*flags, "--initial-peers", *maddrs, sets=sets)]


def wait_stopped(child: Child, timeout_s: float) -> None:
    child.wait_event(lambda e: e.get("event") == "stopped", timeout_s)


Events = list[dict]


def of(events: Events, kind: str) -> Events:
    return [e for e in events if e.get("event") == kind]


def hashes(events: Events) -> dict[tuple[int, int], str]:
    return {(e["fragment"], e["round"]): e["hash"] for e in of(events, "applied")}


def step_times_s(events: Events, after_step: int) -> list[float]:
    """Seconds per inner step between consecutive step events from `after_step` on."""
    steps = [e for e in of(events, "step") if e["step"] >= after_step]
    return [
        (b["t"] - a["t"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:], strict=False)
    ]


def warm_step(events: Events, num_fragments: int) -> int:
    """The first step event after every fragment came back once and was then evaluated:
    by then every graph the loop runs (step, fragment writes, evaluation) was compiled."""
    seen: set[int] = set()
    evaluated = False
    for event in events:
        kind = event.get("event")
        if kind == "applied":
            seen.add(event["fragment"])
        elif kind == "eval" and len(seen) == num_fragments:
            evaluated = True
        elif kind == "step" and evaluated:
            return event["step"]
    raise RuntimeError("the XLA learner never warmed up (no round of every fragment)")


def expected_reads(
    events: Events, first_step: int, tensors_of: dict[int, int], eval_batches: int
) -> int:
    """Device-to-host reads the loop makes on purpose after step event `first_step` up to
    the last step event: each fragment shipped (one per tensor), each held-out batch
    evaluated, each loss read at a log point. A resend reuses the delta on the host."""
    start = next(
        i for i, e in enumerate(events) if e.get("event") == "step" and e["step"] == first_step
    )
    end = max(i for i, e in enumerate(events) if e.get("event") == "step")
    window = events[start + 1 : end + 1]
    shipped = sum(tensors_of[e["fragment"]] for e in of(window, "shipped"))
    resent = sum(tensors_of[e["fragment"]] for e in of(window, "resent"))
    return shipped - resent + eval_batches * len(of(window, "eval")) + len(of(window, "step"))


def run_check(args: argparse.Namespace) -> dict:
    model = build_model("tiny", max_seq_len=32)
    fragments = partition_fragments(
        {n: p.numel() for n, p in model.named_parameters()}, NUM_FRAGMENTS
    )
    tensors_of = {f: len(names) for f, names in enumerate(fragments)}
    xla_env = _env({"PJRT_DEVICE": os.environ["PJRT_DEVICE"]})
    boot = Child.spawn(
        [sys.executable, "-m", "p2pdiloco", "bootstrap", "--events"], "boot", env=_env()
    )
    boot.wait_ready(180)
    maddrs = boot.report["maddrs"]
    xla = Child.spawn(join_argv(sys.executable, "xla", maddrs, args.rounds), "xla", env=xla_env)
    cpu = Child.spawn(join_argv(args.cpu_python, "cpu", maddrs, args.rounds), "cpu", env=_env())
    wait_all_ready([xla, cpu], 300)
    for child in (xla, cpu):
        wait_stopped(child, WAIT_S)
    codes = [xla.stop(), cpu.stop(), boot.stop()]

    ours, theirs = hashes(xla.events), hashes(cpu.events)
    common = sorted(set(ours) & set(theirs))
    mismatched = [key for key in common if ours[key] != theirs[key]]
    warm = warm_step(xla.events, NUM_FRAGMENTS)
    steps_after = [e for e in xla.of("step") if e["step"] >= warm]
    at_warm, last = steps_after[0], steps_after[-1]
    final = xla.first("trainer_finished") or last
    span = last["step"] - at_warm["step"]
    reads = last["xla_host_reads"] - at_warm["xla_host_reads"]
    unexplained = reads - expected_reads(xla.events, warm, tensors_of, EVAL_BATCHES)
    xla_summary, cpu_summary = xla.first("summary") or {}, cpu.first("summary") or {}
    figures = {
        "pjrt_device": xla_env["PJRT_DEVICE"],
        "exit_codes": codes,
        "rounds_in_common": len(common),
        "hash_mismatches": len(mismatched),
        "warm_step": warm,
        "steps_after_warmup": span,
        "compiles_at_warmup": at_warm["xla_compiles"],
        "compiles_at_end": final["xla_compiles"],
        "compiles_after_warmup": final["xla_compiles"] - at_warm["xla_compiles"],
        "executions_per_step": (last["xla_executions"] - at_warm["xla_executions"]) / max(span, 1),
        "host_reads_per_step": reads / max(span, 1),
        "unexplained_host_reads_per_step": unexplained / max(span, 1),
        "xla_step_s": statistics.median(step_times_s(xla.events, warm) or [float("nan")]),
        "cpu_step_s": statistics.median(step_times_s(cpu.events, warm) or [float("nan")]),
        "xla_rounds_contributed": xla_summary.get("rounds_contributed", 0),
        "cpu_rounds_contributed": cpu_summary.get("rounds_contributed", 0),
    }
    failures = []
    if any(code != 0 for code in codes):
        failures.append(f"a process exited with {codes}")
    if len(common) < args.rounds * NUM_FRAGMENTS or mismatched:
        failures.append(f"global hashes: {len(common)} rounds in common, differ at {mismatched}")
    if figures["compiles_after_warmup"] != 0:
        failures.append(f"{figures['compiles_after_warmup']} compilations after warm-up")
    if figures["unexplained_host_reads_per_step"] > MAX_UNEXPLAINED_READS_PER_STEP:
        failures.append("the loop reads the device every step")
    if not figures["xla_rounds_contributed"]:
        failures.append("the XLA learner's deltas were never merged")
    figures["failures"] = failures
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds per fragment")
    parser.add_argument("--quick", action="store_true", help="6 rounds per fragment")
    parser.add_argument("--cpu-python", default=sys.executable, help="interpreter of the CPU peer")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 6
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # XLA's CPU backend unless told otherwise
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        print("torch_xla is not installed here: run scripts/setup_xla_env.sh, then its python")
        return 2
    try:
        figures = run_check(args)
    finally:
        reap_all()
    for key, value in figures.items():
        print(f"{key:34} {value:.4f}" if isinstance(value, float) else f"{key:34} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))
    verdict = "ok" if not figures["failures"] else "FAILED: " + "; ".join(figures["failures"])
    print(
        f"check_xla {verdict}: {figures['rounds_in_common']} rounds identical, "
        f"{figures['compiles_after_warmup']} compiles after warm-up "
        f"(of {figures['compiles_at_end']}), {figures['xla_step_s'] * 1000:.1f} ms/step on XLA "
        f"vs {figures['cpu_step_s'] * 1000:.1f} ms on CPU"
    )
    return 0 if not figures["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
