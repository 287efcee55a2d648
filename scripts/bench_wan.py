"""Benchmark: p2pdiloco against synchronous DDP over shaped links, one namespace per learner.

Four learners, each in its own network namespace, joined by veth pairs to a bridge in a
fifth namespace (which also holds the bootstrap node). Every learner's link is shaped with
`tc tbf` in both directions (its veth's egress and the bridge port's egress) to RATE
Mbit/s. Both systems run the same model, the same per-learner batch and the same data
shards over the same links:

  ddp        `torch.distributed` DDP (gloo): every step all-reduces the fp32 gradients.
  p2pdiloco  `p2pdiloco join` peers: H inner steps, then an int8 delta to the round's
             synchronizer, which merges and sends the outer update back; learners do not wait.

Figures, per rate: wall-clock to the target held-out loss (the loss DDP reaches at its
end), bytes each learner put on the wire (the bridge port's counters, everything
included: DHT, heartbeats, state), compute utilisation (steps x a lone step's time /
wall-clock), and `speedup` = DDP time / p2pdiloco time. DDP's loss after a step does not
depend on the link, so DDP trains its whole run once, at the fastest rate, and at the
other rates times `--ddp-timing-steps` steps: its curve there is the same losses at the
measured step time. p2pdiloco trains in full at every rate (its schedule depends on it).

The script creates every namespace, link and qdisc it uses (names start with `p2pw`) and
removes them on exit, on Ctrl-C and on SIGTERM; it must run as root. Latency cannot be
added here (`netem` is absent): the links have bandwidth limits only.

    sudo python scripts/bench_wan.py [--quick] [--json out/wan.json] [--plot docs/wan.png]
        [--rates 10,100,1000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco.cli.argv import set_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, reap_all  # noqa: E402

LEARNERS = 4
PREFIX = "p2pw"
BRIDGE_NS = f"{PREFIX}-br"
SUBNET = "10.77.0"
BRIDGE_IP = f"{SUBNET}.254"
DDP_PORT = 29517
QUICK = {
    "preset": "tiny",
    "sets": ["model.seq_len=64", "train.batch_size=8", "sync.inner_steps=20"],
    "ddp_steps": 120,
    "diloco_steps": 480,
    "eval_every": 20,
    "timing_steps": 4,
}
FULL = {
    "preset": "small",
    "sets": ["model.seq_len=64", "train.batch_size=4", "sync.inner_steps=50"],
    "ddp_steps": 150,
    "diloco_steps": 600,
    "eval_every": 25,
    "timing_steps": 3,
}
"""`diloco_steps` is a cap: the p2pdiloco run stops once it reaches DDP's final loss."""
COMMON = [
    # both systems read these (the corpus, its held-out split, the warm-up); DDP ignores the
    # sync and outer fields
    "train.device='cpu'",
    "train.warmup_steps=20",
    "data.max_files=600",
    # K = all: the learners are equally fast here (a quorum of 2 of 4 merged half the
    # deltas each round and the rest a round late, and lost ~0.5 nats in the quick setting)
    f"sync.min_quorum={LEARNERS}",
    # the outer setting our quality sweep found best at this scale (docs/benchmarks.md)
    "outer.lr=0.8",
    "outer.momentum=0.5",
]
EVAL_BATCHES = 4
WAIT_S = 3600


def learner_ns(i: int) -> str:
    return f"{PREFIX}-{i}"


def learner_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# --- the network --------------------------------------------------------------------------


def sh(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def in_ns(ns: str, *argv: str, check: bool = True) -> str:
    return sh("ip", "netns", "exec", ns, *argv, check=check)


def teardown() -> None:
    """Remove every namespace this script may have made (their veths and qdiscs go too)."""
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name == BRIDGE_NS or name.startswith(f"{PREFIX}-"):
            sh("ip", "netns", "del", name, check=False)


def setup() -> None:
    """A bridge namespace and one namespace per learner, each on its own veth pair."""
    teardown()
    sh("ip", "netns", "add", BRIDGE_NS)
    in_ns(BRIDGE_NS, "ip", "link", "set", "lo", "up")
    in_ns(BRIDGE_NS, "ip", "link", "add", "br0", "type", "bridge")
    in_ns(BRIDGE_NS, "ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", "br0")
    in_ns(BRIDGE_NS, "ip", "link", "set", "br0", "up")
    for i in range(LEARNERS):
        ns, inner, outer = learner_ns(i), f"{PREFIX}v{i}", f"{PREFIX}b{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", BRIDGE_NS)
        in_ns(BRIDGE_NS, "ip", "link", "set", outer, "master", "br0", "up")
        in_ns(ns, "ip", "link", "set", "lo", "up")
        in_ns(ns, "ip", "addr", "add", f"{learner_ip(i)}/24", "dev", inner)
        in_ns(ns, "ip", "link", "set", inner, "up")


def shape(rate_mbit: float) -> None:
    """Token-bucket limit of `rate_mbit` on both directions of every learner's link."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(rate_bytes / 100))  # 10 ms of traffic, at least 16 KiB
    spec = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    for i in range(LEARNERS):
        in_ns(learner_ns(i), "tc", "qdisc", "replace", "dev", f"{PREFIX}v{i}", "root", *spec)
        in_ns(BRIDGE_NS, "tc", "qdisc", "replace", "dev", f"{PREFIX}b{i}", "root", *spec)


def sent_bytes() -> list[int]:
    """Bytes each learner has sent (the bridge port receives them)."""
    return [
        int(in_ns(BRIDGE_NS, "cat", f"/sys/class/net/{PREFIX}b{i}/statistics/rx_bytes"))
        for i in range(LEARNERS)
    ]


# --- DDP -----------------------------------------------------------------------------------


def ddp_worker(rank: int, preset: str, sets: list[str], steps: int, eval_every: int) -> None:
    """One DDP rank: a lone step time first, then `steps` synchronous steps; rank 0 evaluates."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from p2pdiloco.config import load_config
    from p2pdiloco.training.data import Corpus, heldout_batches, learner_batches
    from p2pdiloco.training.model import build_model
    from p2pdiloco.training.train import InnerTrainer, LossOf, evaluate

    torch.set_num_threads(1)
    config = load_config(overrides=[f"model.preset='{preset}'", *sets])
    t, m = config.train, config.model
    corpus = Corpus.from_config(config.data)
    batches = learner_batches(corpus, rank, LEARNERS, t.batch_size, m.seq_len, t.seed)
    eval_set = heldout_batches(corpus, EVAL_BATCHES, t.batch_size, m.seq_len)
    model = build_model(preset, seed=t.seed, max_seq_len=m.seq_len)
    lone = InnerTrainer(copy.deepcopy(model), t, torch.device("cpu"))
    lone.step(batches)  # warm-up
    started = time.perf_counter()
    for _ in range(3):
        lone.step(batches)
    lone_step_s = (time.perf_counter() - started) / 3
    del lone
    batches = learner_batches(corpus, rank, LEARNERS, t.batch_size, m.seq_len, t.seed)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{learner_ip(0)}:{DDP_PORT}", rank=rank, world_size=LEARNERS
    )
    trainer = InnerTrainer(model, t, torch.device("cpu"))
    trainer.loss_module = DistributedDataParallel(LossOf(trainer.model))
    dist.barrier()
    curve = []
    eval_s = 0.0
    t0 = time.time()
    if rank == 0:
        curve.append({"t": 0.0, "step": 0, "eval_loss": evaluate(trainer.model, eval_set, trainer.device)})
    for step in range(1, steps + 1):
        trainer.step(batches)
        if rank == 0 and (step % eval_every == 0 or step == steps):
            e0 = time.time()
            loss = evaluate(trainer.model, eval_set, trainer.device)
            eval_s += time.time() - e0
            curve.append({"t": time.time() - t0 - eval_s, "step": step, "eval_loss": loss})
    dist.barrier()
    wall_s = time.time() - t0 - eval_s
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "lone_step_s": lone_step_s, "wall_s": wall_s, "steps": steps, "curve": curve}))


def ddp_sets(setting: dict[str, Any]) -> list[str]:
    """The overrides a DDP rank loads after the preset: the same corpus, held-out split,
    batch and schedule as the p2pdiloco peers (`diloco_sets`)."""
    return [*COMMON, *setting["sets"]]


def diloco_sets(setting: dict[str, Any], extra: list[str] | None = None) -> list[str]:
    """The overrides every p2pdiloco peer (and the bootstrap node) runs with; `extra` are
    the swarm's own (`--set`), which DDP has no use for."""
    return [f"model.preset='{setting['preset']}'", *COMMON, *setting["sets"], *(extra or [])]


def run_ddp(setting: dict[str, Any], steps: int) -> dict[str, Any]:
    """DDP over the namespaces for `steps` steps: rank 0's curve, step time, utilisation."""
    before = sent_bytes()
    procs = []
    for rank in range(LEARNERS):
        argv = ["ip", "netns", "exec", learner_ns(rank), sys.executable, __file__, "--ddp-worker",
                str(rank), str(steps), str(setting["eval_every"]), setting["preset"], *ddp_sets(setting)]  # fmt: skip
        procs.append(
            # gloo would take the address the host name resolves to (loopback): name the link
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **_env(), "GLOO_SOCKET_IFNAME": f"{PREFIX}v{rank}"})  # fmt: skip
        )
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=WAIT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"DDP rank failed ({proc.returncode}):\n{err[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # one rank failing leaves the others waiting for it forever
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    sent = [a - b for a, b in zip(sent_bytes(), before, strict=True)]
    wall_s = max(r["wall_s"] for r in reports)
    lone_step_s = sum(r["lone_step_s"] for r in reports) / LEARNERS
    return {
        "steps": steps,
        "wall_s": wall_s,
        "step_s": wall_s / steps,
        "lone_step_s": lone_step_s,
        "utilization": min(1.0, lone_step_s * steps / wall_s),
        "bytes_sent_per_learner": sum(sent) / LEARNERS,
        "curve": reports[0]["curve"],
    }


# --- p2pdiloco -----------------------------------------------------------------------------


def run_diloco(
    setting: dict[str, Any], steps: int, target: float, workdir: Path, extra: list[str] | None = None
) -> dict[str, Any]:
    """Four `p2pdiloco join` peers, one per namespace, until learner 0's global model
    reaches `target` held-out loss or `steps` inner steps each."""
    sets = diloco_sets(setting, extra)
    # the bootstrap node gets the run's config too: it validates records by it
    boot_argv = ["ip", "netns", "exec", BRIDGE_NS, sys.executable, "-m", "p2pdiloco", "bootstrap",
                 "--events", "--host", BRIDGE_IP, *set_args(sets)]  # fmt: skip
    boot = Child.spawn(boot_argv, "boot", cwd=REPO, env=_env())
    try:
        maddrs = boot.wait_ready(300)["maddrs"]
        before = sent_bytes()
        peers = []
        for i in range(LEARNERS):
            own = workdir / f"learner{i}"
            own.mkdir(parents=True, exist_ok=True)
            argv = ["ip", "netns", "exec", learner_ns(i), sys.executable, "-m", "p2pdiloco", "join",
                    "--no-checkpoint", "--events", "--threads", "1", "--host", learner_ip(i), "--heartbeat-s", "2",
                    "--eval-batches", str(EVAL_BATCHES if i == 0 else 0), "--max-steps", str(steps),
                    "--wait-peers", str(LEARNERS), "--data-rank", str(i), "--data-shards", str(LEARNERS),
                    "--identity", str(own / "id.key"), "--initial-peers", *maddrs,
                    *set_args(sets)]  # fmt: skip
            peers.append(Child.spawn(argv, f"learner{i}", cwd=REPO, env=_env()))
        while True:  # learner 0 evaluates the global model after each round
            event = peers[0].wait_event(lambda e: e.get("event") in ("eval", "summary"), WAIT_S)
            if event["event"] == "summary" or event["eval_loss"] <= target:
                break
        for child in peers:
            child.request_stop()
        summaries = []
        for child in peers:  # learner 0's may be the one that ended the loop above
            if child.first("summary") is None:
                child.wait_event(lambda e: e.get("event") == "summary", WAIT_S)
            summaries.append(child.first("summary"))
        sent = [a - b for a, b in zip(sent_bytes(), before, strict=True)]
        evals = peers[0].of("eval")
        applied: dict[tuple[int, int], set[str]] = {}
        for child in peers:
            for e in child.of("applied"):
                applied.setdefault((e["fragment"], e["round"]), set()).add(e.get("hash", ""))
        for child in peers:
            child.stop(60)
    finally:
        boot.stop(10)
    t0 = evals[0]["t"]
    curve = [{"t": e["t"] - t0, "rounds": e["rounds"], "eval_loss": e["eval_loss"]} for e in evals]
    wall_s = max(s["loop_s"] for s in summaries)
    return {
        "steps": sum(s["steps"] for s in summaries) / LEARNERS,
        "wall_s": wall_s,
        "bytes_sent_per_learner": sum(sent) / LEARNERS,
        "rounds": [s["rounds"] for s in summaries],
        "rounds_contributed": [s["rounds_contributed"] for s in summaries],
        "curve": curve,
        # every (fragment, round) that more than one learner applied, with one hash
        "replicas_identical": all(len(h) == 1 for h in applied.values()),
    }


def reusable_ddp(path: Path, setting_name: str, setting: dict[str, Any]) -> dict[str, Any] | str:
    """DDP's full run from an earlier JSON, or why it cannot stand in for this one."""
    try:
        earlier = json.loads(path.read_text())
        ddp, sets = earlier["ddp"], earlier.get("ddp_sets")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"not a bench_wan JSON ({exc})"
    if earlier.get("setting") != setting_name or earlier.get("preset") != setting["preset"]:
        return f"it is the {earlier.get('setting')!r} setting of {earlier.get('preset')!r}"
    if sets != ddp_sets(setting) or not isinstance(ddp, dict) or ddp.get("steps") != setting["ddp_steps"]:
        return "its DDP ran another config (or predates `ddp_sets`, when DDP read another corpus)"
    return ddp


# --- figures -------------------------------------------------------------------------------


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Wall-clock of the first point of `curve` at or below `target`."""
    return next((p["t"] for p in curve if p["eval_loss"] <= target), None)


def crossing(rates: list[float], speedups: list[float | None], level: float = 10.0) -> float | None:
    """The rate (Mbit/s) at which the speed-up crosses `level`, by log-log interpolation."""
    points = [(r, s) for r, s in zip(rates, speedups, strict=True) if s]
    for (r0, s0), (r1, s1) in zip(points, points[1:], strict=False):
        if (s0 - level) * (s1 - level) <= 0 and s0 != s1:
            f = (math.log(level) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return None


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for index, row in enumerate(out["rates"]):
        rate, color = row["rate_mbit"], f"C{index}"  # one colour a link: dashed DDP, solid ours
        ddp = [p for p in row["ddp_curve"] if p["t"] > 0]  # a log axis: from the first step
        ax.plot([p["t"] for p in ddp], [p["eval_loss"] for p in ddp], "--", color=color,
                label=f"DDP {rate:g} Mbit/s")  # fmt: skip
        dl = [p for p in row["p2pdiloco"]["curve"] if p["t"] > 0]
        ax.plot([p["t"] for p in dl], [p["eval_loss"] for p in dl], "-o", ms=3, color=color,
                label=f"p2pdiloco {rate:g} Mbit/s")  # fmt: skip
    ax.axhline(out["target_loss"], color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("wall-clock (s, log)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"{out['preset']}, {LEARNERS} learners, tbf-shaped links")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--rates", default="10,100,1000", help="Mbit/s, comma-separated")
    parser.add_argument("--replot", type=Path, help="only redraw --plot from this JSON")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[],
        help="a config override for the p2pdiloco peers only (e.g. sync.on_receive='rebase')",
    )  # fmt: skip
    parser.add_argument(
        "--ddp-from", type=Path,
        help="take DDP's full run (its curve, target and bytes) from this earlier JSON of the same "
        "setting and only time DDP's steps at each rate: its losses do not depend on the link",
    )  # fmt: skip
    parser.add_argument(
        "--diloco-steps", type=int, help="cap on each p2pdiloco learner's steps (default: the setting's)"
    )
    parser.add_argument("--ddp-worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        rank, steps, eval_every, preset, *sets = args.ddp_worker
        ddp_worker(int(rank), preset, sets, int(steps), int(eval_every))
        return 0
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or Path("wan_loss.png"))
        return 0
    if os.geteuid() != 0:
        print("bench_wan: must run as root (it creates network namespaces and tc qdiscs)", file=sys.stderr)
        return 2
    setting = QUICK if args.quick else FULL
    if args.diloco_steps:
        setting = {**setting, "diloco_steps": args.diloco_steps}
    rates = sorted(float(r) for r in args.rates.split(","))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    out: dict[str, Any] = {"setting": "quick" if args.quick else "full", "preset": setting["preset"],
                           "learners": LEARNERS, "sets": [*COMMON, *setting["sets"], *args.overrides],
                           "ddp_sets": ddp_sets(setting), "diloco_steps": setting["diloco_steps"]}  # fmt: skip
    reused = None
    if args.ddp_from:
        reused = reusable_ddp(args.ddp_from, out["setting"], setting)
        if isinstance(reused, str):
            print(f"bench_wan: --ddp-from {args.ddp_from}: {reused}", file=sys.stderr)
            return 2
    try:
        setup()
        if reused is not None:
            ddp_full = reused
            out["ddp_from"] = str(args.ddp_from)
        else:
            shape(rates[-1])
            print(f"DDP, {setting['ddp_steps']} steps at {rates[-1]:g} Mbit/s", flush=True)
            ddp_full = run_ddp(setting, setting["ddp_steps"])
        target = ddp_full["curve"][-1]["eval_loss"]
        steps_to_target = next(p["step"] for p in ddp_full["curve"] if p["eval_loss"] <= target)
        out["ddp"] = ddp_full
        out["target_loss"] = target
        out["rates"] = []
        with tempfile.TemporaryDirectory(prefix="p2pdiloco-wan-") as tmp:
            for rate in rates:
                shape(rate)
                if rate == rates[-1] and reused is None:
                    ddp = ddp_full
                else:
                    print(f"DDP timing, {setting['timing_steps']} steps at {rate:g} Mbit/s", flush=True)
                    ddp = run_ddp(setting, setting["timing_steps"])
                    ddp["bytes_sent_per_learner"] *= setting["ddp_steps"] / setting["timing_steps"]
                step_s = ddp["step_s"]
                ddp_curve = [{**p, "t": p["step"] * step_s} for p in ddp_full["curve"]]
                print(f"p2pdiloco, up to {setting['diloco_steps']} steps at {rate:g} Mbit/s", flush=True)
                dl = run_diloco(setting, setting["diloco_steps"], target, Path(tmp) / f"r{rate:g}", args.overrides)
                ddp_time = steps_to_target * step_s
                dl_time = time_to(dl["curve"], target)
                dl_bytes_equal_tokens = dl["bytes_sent_per_learner"] * setting["ddp_steps"] / max(dl["steps"], 1)
                row = {
                    "rate_mbit": rate,
                    "ddp_step_s": step_s,
                    "ddp_time_to_target_s": ddp_time,
                    "ddp_utilization": min(1.0, ddp_full["lone_step_s"] / step_s),
                    "ddp_bytes_per_learner": ddp_full["bytes_sent_per_learner"],
                    "ddp_curve": ddp_curve,
                    "p2pdiloco": dl,
                    "p2pdiloco_time_to_target_s": dl_time,
                    "p2pdiloco_utilization": min(1.0, ddp_full["lone_step_s"] * dl["steps"] / dl["wall_s"]),
                    "p2pdiloco_bytes_per_learner_equal_tokens": dl_bytes_equal_tokens,
                    "bytes_reduction": ddp_full["bytes_sent_per_learner"] / max(dl_bytes_equal_tokens, 1.0),
                    "speedup": ddp_time / dl_time if dl_time else None,
                    "replicas_identical": dl["replicas_identical"],
                }
                out["rates"].append(row)
                if args.json:  # after every rate: an interrupted run keeps what it measured
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(out, indent=2))
                print(
                    f"{rate:g} Mbit/s: DDP {step_s:.2f} s/step, to target {ddp_time:.0f} s; p2pdiloco to "
                    f"target {dl_time if dl_time is None else round(dl_time)} s, speedup "
                    f"{row['speedup'] and round(row['speedup'], 2)}, bytes/learner "
                    f"{row['bytes_reduction']:.0f}x fewer, utilization DDP {row['ddp_utilization']:.2f} "
                    f"p2pdiloco {row['p2pdiloco_utilization']:.2f}",
                    flush=True,
                )
        out["speedup_crosses_10_at_mbit"] = crossing(rates, [r["speedup"] for r in out["rates"]])
    except KeyboardInterrupt:
        print("bench_wan: interrupted, removing the namespaces", file=sys.stderr)
        return 130
    finally:
        reap_all()
        teardown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
