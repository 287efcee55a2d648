"""Swarm-scale simulator: N peers' real protocol code on virtual time (issue 29).

For each N it runs `p2pdiloco.sim.swarm` (the real Membership, ReplicaSync, Synchronizer
and LearnerLink of every peer, on an in-memory network with per-peer links drawn from
`p2pdiloco.sim.links.Population`) and reports, over the measured span, per peer and role
the protocol bytes per second, the busiest DHT key and peer, the round latency and the
goodput. `--agreement` first runs a real swarm (bootstrap + N peer processes on
127.0.0.1, the embedded default) and the simulator on the same setting (loopback links,
the real learners' measured step times), and reports the relative error of each figure.

    python scripts/simulate_swarm.py --quick [--json docs/scale_quick.json] [--agreement]
    python scripts/simulate_swarm.py --sizes 10,100,1000 --seconds 300
    python scripts/simulate_swarm.py --sizes 0 --aggregation 10,30,100 [--preset 150m]

`--aggregation` (issue 29, item 3) runs M learners on the chosen preset's payload (the
simulated model's bytes scaled to the preset's) twice: `before`, one fragment whose
synchronizer pushes the update to every learner; `after`, `AGGREGATION_FRAGMENTS`
fragments over the elected synchronizers, each pushing to its holders and
`commit.MORE_PUSHES` more, the rest fetching from the peers that hold it. It reports the
synchronizer's payload bytes per window and the round latency against M.

`--codec` / `--outer-codec` (e.g. sparse2) set the learners' delta codec and the
synchronizers' update codec of the simulated runs (not of the agreement's real swarm,
which runs the embedded default): the payloads are charged in those codecs' bytes.

The traffic is counted by `p2pdiloco.transport.traffic.Traffic` in both: a real peer's
summary carries its counters, the simulated peers' transports count the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pdiloco.cli.launcher import machine_busy_s, tree_cpu_s  # noqa: E402
from p2pdiloco.config import RunConfig, replace  # noqa: E402
from p2pdiloco.protocol.membership import settle_s  # noqa: E402
from p2pdiloco.sim.links import LOOPBACK, Population, StepTrace  # noqa: E402
from p2pdiloco.sim.swarm import applied_pace, sim_config, simulate  # noqa: E402
from p2pdiloco.transport.traffic import PROTOCOL  # noqa: E402

QUICK_SIZES = (10, 100, 1000)
QUICK_SECONDS = {10: 210.0, 100: 90.0, 1000: 60.0}
"""Measured virtual seconds per N in --quick (after `warmup_s`; N = 1,000 over a short
span: it costs real minutes)."""
AGREEMENT_ROUNDS = 12
AGREEMENT_BUSY_CORES = 1.2
"""Cores the real swarm's training may keep busy in all (`train.compute_share` = this / N):
the rest merges, applies and serves at once, as on volunteers' own machines. Eight
learners training flat out on two cores made the real run CPU-bound (its merges and
applies queued behind training, which the simulator charges no time for): a third fewer
rounds per minute than simulated, records bytes 43-62 % off."""
EPOCH_ROUNDS = 1
"""Rounds per records key of the `after` design: one key per round. With 8, every DHT
read brought the epoch's records so far (3.4 on average, ~7.6 kB each) for the one or two
a replica lacked: at N = 1,000, 7.8 kB/s of protocol per peer at the median, 3.7 MB/s on
the busiest key; with 1, 4.9 kB/s and 0.19 MB/s, the same latency and goodput, no fork
(docs/scale.md)."""
SHARED_MACHINE_CORES = 0.25
"""Above this many cores busy with other work, on average, during the real run, the
machine was shared (a CI worker running other tests, a CPU hog): the simulator, which
charges no time for the CPU, is not expected to follow the real round pace there."""
AGREEMENT_TOLERANCE = 0.10
"""The largest relative error of a simulated figure against real processes before the
simulator's figures at N = 1,000 are not to be trusted (issue 29)."""
AGGREGATION_INNER_STEPS = 512
"""Inner steps per round in `--aggregation` (a 150m run's H is in the hundreds)."""
AGGREGATION_FRAGMENTS = 64
"""Fragments of the `after` design: each window's fan-in is M x (preset bytes / 64)."""
AGGREGATION_SECONDS = 600.0
AGGREGATION_WARMUP_S = 200.0
AGGREGATION_SYNC = {"max_grace_s": 30.0, "round_deadline_s": 120.0}
"""What a 150m run sets beside the embedded default: a fragment's deltas take seconds to
upload, so stragglers get a longer grace, and a window waits longer for its quorum
(`min_quorum`: a quarter of the learners, so one fast learner does not close every
window alone)."""
AGGREGATION_QUORUM_SHARE = 0.25
"""`min_quorum` of the aggregation figure, as a share of M (`--quorum-share`)."""
SYNCHRONIZERS_100MBIT = Population(public_link_mbit=100.0, step_sigma=0.3)
"""The drawn volunteers, the public ones (synchronizer candidates) on 100 Mbit/s links;
machines that train a 150m model within a 3x spread of speed (GPUs, not CPUs)."""
CODECS: dict[str, str] = {}
"""`compress` settings of the simulated runs (`--codec`, `--outer-codec`); empty: int8."""
EVERYONE = 1 << 30
"""`update_pushes` of the `before` design: the synchronizer pushes to every learner."""


def scaled_config(n: int, design: str) -> RunConfig:
    """The embedded default's protocol; `after`: membership sharded about one shard per 8
    peers and round records under one key per round (`EPOCH_ROUNDS`, docs/scale.md); `before`: one key each."""
    if design == "before":
        return sim_config(compress=CODECS)
    shards = 1 << max(0, min(10, round(math.log2(max(n / 8, 1)))))
    return replace(
        sim_config(compress=CODECS),
        network={"member_shards": shards, "record_epoch_rounds": EPOCH_ROUNDS},
    )


def warmup_s(config: RunConfig) -> float:
    """Virtual seconds before the measured span: the joins (30 s), and with sharded
    membership one settle period more (`membership.settle_s`, 260 s at 128 shards), so
    the span measures a swarm whose elections count settled peers only. A swarm that has
    just started elects among everyone (nobody is settled yet); that start is not the
    steady state a public run lives in."""
    network = config.network
    return 30.0 + settle_s(network.member_shards, config.peer.heartbeat_s)


def run_sizes(
    sizes: list[int], seconds: dict[int, float], seed: int, design: str
) -> dict[str, Any]:
    by_n: dict[str, Any] = {}
    for n in sizes:
        started = time.perf_counter()
        config = scaled_config(n, design)
        warmup = warmup_s(config)
        figures = simulate(
            n,
            warmup + seconds[n],
            config=config,
            population=Population(),
            seed=seed,
            warmup_s=warmup,
        )
        entry = figures.as_dict()
        entry["real_s"] = round(time.perf_counter() - started, 1)
        entry["member_shards"] = config.network.member_shards
        entry["record_epoch_rounds"] = config.network.record_epoch_rounds
        by_n[str(n)] = entry
        print(
            f"N={n}: protocol {entry['protocol_bytes_per_s_per_peer']['p50'] / 1e3:.1f} kB/s/peer p50 "
            f"(p90 {entry['protocol_bytes_per_s_per_peer']['p90'] / 1e3:.1f}, max "
            f"{entry['protocol_bytes_per_s_per_peer']['max'] / 1e3:.1f}, max of the peers there "
            f"all along {entry['protocol_bytes_per_s_per_peer']['max_whole_span'] / 1e3:.1f}), busiest key "
            f"{entry['busiest_key_bytes_per_s'] / 1e6:.2f} MB/s, busiest peer "
            f"{entry['busiest_peer_bytes_per_s'] / 1e6:.2f} MB/s, round latency {entry['round_latency_s']:.2f} s, "
            f"goodput {entry['goodput']:.2f} ({entry['real_s']} s real)",
            flush=True,
        )
    return by_n


def preset_parameters(preset: str) -> int:
    """Parameters of a model preset, counted on the meta device (nothing allocated)."""
    import torch

    from p2pdiloco.training.model import build_model, count_parameters

    with torch.device("meta"):
        return count_parameters(build_model(preset))


def aggregation(
    learners: list[int], preset: str, seed: int, designs_run: tuple[str, ...] = ("before", "after"),
    quorum_share: float = AGGREGATION_QUORUM_SHARE,
) -> dict[str, Any]:
    """Synchronizer payload bytes per window and round latency against M learners, on
    `preset`'s bytes, for the `before` and `after` designs (module docstring); each
    window's `min_quorum` is `quorum_share` of M (at least 2)."""
    params = preset_parameters(preset)
    designs = {"before": (1, EVERYONE), "after": (AGGREGATION_FRAGMENTS, None)}
    out: dict[str, Any] = {"preset": preset, "parameters": params, "quorum_share": quorum_share, "by_design": {}}
    for design, (fragments, pushes) in designs.items():
        if design not in designs_run:
            continue
        rows: dict[str, Any] = {}
        for m in learners:
            started = time.perf_counter()
            config = replace(
                scaled_config(m, "after"),
                sync={
                    **AGGREGATION_SYNC, "inner_steps": AGGREGATION_INNER_STEPS,
                    "num_fragments": fragments, "min_quorum": max(2, int(m * quorum_share)),
                },
            )
            figures = simulate(
                m, AGGREGATION_SECONDS, config=config, population=SYNCHRONIZERS_100MBIT,
                seed=seed, warmup_s=AGGREGATION_WARMUP_S,
                update_pushes=pushes, preset_params=params,
            )  # fmt: skip
            row = {
                "fragments": fragments,
                "synchronizer_bytes_per_window": figures.synchronizer_bytes_per_window,
                "synchronizer_bytes_per_round": {
                    k: v * fragments for k, v in figures.synchronizer_bytes_per_window.items()
                },
                "round_latency_s": figures.round_latency_s,
                "busiest_link_use": figures.busiest_link_use,
                "goodput": figures.goodput,
                "rounds": figures.rounds,
                "windows": figures.windows,
                "forks": figures.forks,
                "real_s": round(time.perf_counter() - started, 1),
            }
            rows[str(m)] = row
            per_window = row["synchronizer_bytes_per_window"].get("p50", math.nan)
            use = row["busiest_link_use"].get("public", math.nan)
            print(
                f"aggregation {design} M={m} F={fragments}: synchronizer p50 "
                f"{per_window / 1e6:.0f} MB per window, busiest public link {use:.0%}, round latency "
                f"{row['round_latency_s']:.1f} s, goodput {row['goodput']:.2f}, "
                f"{row['windows']} windows ({row['real_s']} s real)",
                flush=True,
            )
        out["by_design"][design] = rows
    return out


def real_swarm(n: int, rounds: int) -> dict[str, Any]:
    """A bootstrap node and `n` real peers (embedded default, tiny preset, training at most
    `AGREEMENT_BUSY_CORES` cores in all) on 127.0.0.1 until `rounds` rounds; each peer's
    summary (traffic counters, steps, step time)."""
    from p2pdiloco.cli.launcher import Child

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "p2pdiloco"]
    share = min(1.0, AGREEMENT_BUSY_CORES / n)
    sets = ["--set", "model.preset='tiny'", "--set", "sync.inner_steps=20"]
    peer_sets = [*sets, "--set", f"train.compute_share={share:.3f}"]
    boot = Child.spawn([*argv, "bootstrap", "--events", *sets], "boot", env=env)
    peers: list[Any] = []
    busy_before, started = machine_busy_s(), time.monotonic()
    try:
        maddrs = boot.wait_ready(300)["maddrs"]
        peers = [
            Child.spawn(
                [
                    *argv,
                    "join",
                    "--events",
                    "--threads",
                    "1",
                    "--max-rounds",
                    str(rounds),
                    "--no-checkpoint",
                    "--data-shards",
                    str(n),
                    "--data-rank",
                    str(i),
                    "--wait-peers",
                    str(n),
                    "--eval-batches",
                    "0",
                    "--initial-peers",
                    *maddrs,
                    *peer_sets,
                ],
                f"peer{i}",
                env=env,
            )  # fmt: skip
            for i in range(n)
        ]
        for peer in peers:
            peer.wait_event(lambda e: e.get("event") == "summary", 1800)
        summaries = [peer.first("summary") for peer in peers]
        closes = [e for peer in peers for e in peer.of("round_closed")]
        applied = [[[e["fragment"], e["round"], e["t"]] for e in peer.of("applied")] for peer in peers]
        steps = [[[e["t"], e["step"]] for e in peer.of("step")] for peer in peers]
        # before they stop: their DHT processes and daemons are still there to count
        ours = sum(tree_cpu_s(child.popen.pid) for child in [boot, *peers])
        others = (machine_busy_s() - busy_before - ours) / (time.monotonic() - started)
        for peer in peers:
            peer.stop(60)
    finally:
        boot.stop(10)
    return {
        "summaries": summaries, "closes": len(closes), "other_cores": max(others, 0.0),
        "applied": applied, "steps": steps,
    }  # fmt: skip


def real_applied(summaries: list[dict[str, Any]], applied: list[list[list[float]]]) -> dict:
    """When each real peer applied each (fragment, round), in seconds from the start of
    its traffic span (its summary's instant less `traffic_s`): `applied_pace`'s input."""
    instants: dict[tuple[int, int], list[float]] = {}
    for summary, events in zip(summaries, applied, strict=True):
        start = summary["t"] - summary["traffic_s"]
        for fragment, round_id, t in events:
            instants.setdefault((int(fragment), int(round_id)), []).append(t - start)
    return instants


def real_traces(summaries: list[dict[str, Any]], steps: list[list[list[float]]]) -> list[StepTrace] | None:
    """Each real learner's (seconds since the start of its traffic span, steps done), from
    its `step` events: what the simulated learners replay. None where a saved run lacks
    them (kept since issue 42's CI run) or a learner logged fewer than two."""
    traces = []
    for summary, events in zip(summaries, steps, strict=True):
        start = summary["t"] - summary["traffic_s"]
        points = sorted({int(step): t - start for t, step in events}.items())
        if len(points) < 2:
            return None
        traces.append(StepTrace(tuple((t, step) for step, t in points)))
    return traces


def real_figures(summaries: list[dict[str, Any]], applied: list[list[list[float]]]) -> dict[str, float]:
    protocol = [
        sum(s["traffic"][c][d] for c in PROTOCOL for d in ("up", "down")) / s["traffic_s"]
        for s in summaries
    ]
    membership = [sum(s["traffic"]["membership"].values()) / s["traffic_s"] for s in summaries]
    records = [sum(s["traffic"]["records"].values()) / s["traffic_s"] for s in summaries]
    return {
        "protocol_bytes_per_s_per_peer": statistics.median(protocol),
        "membership_bytes_per_s_per_peer": statistics.median(membership),
        "records_bytes_per_s_per_peer": statistics.median(records),
        "goodput": decided_goodput(summaries),
        "rounds_per_min": applied_pace(real_applied(summaries, applied), 0.0, math.inf),
    }


def decided_goodput(summaries: list[dict[str, Any]]) -> float:
    """Steps merged / steps whose fate is decided, over the real peers (fragment-steps: a
    step counts once per fragment). A peer exits at `--max-rounds` with a delta in flight
    and the steps since its last ship still local: neither is merged nor lost yet. The
    simulator's `goodput_decided` leaves out its in-flight and folded-back deltas the
    same way."""
    merged = decided = 0
    for s in summaries:
        local = s.get("local_steps") or []  # a run saved before stop 39 lacks both
        fragments = max(len(local), 1)
        undecided = sum(local) + sum((s.get("undecided_steps") or {}).values())
        merged += s["steps_contributed"]
        decided += s["steps"] * fragments - undecided
    return merged / decided if decided > 0 else math.nan


def agreement(
    n: int, saved: dict[str, Any] | None = None, rounds: int = AGREEMENT_ROUNDS, replay_steps: bool = True
) -> dict[str, Any]:
    """Real processes, then the simulator on their setting (`saved`: a previous run's
    real summaries, to re-simulate without running the real swarm again). `replay_steps`:
    the simulated learners replay the real ones' steps over time (`StepTrace`); False:
    each trains at its real mean step time throughout (`--mean-steps`)."""
    real = saved if saved else real_swarm(n, rounds)
    summaries = saved["real_peers"] if saved else real["summaries"]
    applied = real.get("applied") or [[] for _ in summaries]  # kept since stop 40
    measured = real_figures(summaries, applied)
    # a learner's whole loop per step (training, shipping, applying): its real pace
    step_times = [s["loop_s"] / max(s["steps"], 1) for s in summaries]
    span = statistics.median(s["traffic_s"] for s in summaries)
    traces = real_traces(summaries, real.get("steps") or [[] for _ in summaries]) if replay_steps else None
    config = sim_config(inner_steps=20)
    figures = simulate(
        n, span, config=config, population=LOOPBACK, warmup_s=0.0, step_times_s=step_times,
        step_traces=traces,
    )
    simulated = {
        "protocol_bytes_per_s_per_peer": figures.protocol_bytes_per_s_per_peer["p50"],
        "membership_bytes_per_s_per_peer": sum(figures.by_category["membership"].values()),
        "records_bytes_per_s_per_peer": sum(figures.by_category["records"].values()),
        "goodput": figures.goodput_decided,
        "rounds_per_min": figures.rounds_per_min,
    }
    errors = {k: abs(simulated[k] - v) / v if v else None for k, v in measured.items()}
    kept = (
        "steps", "train_s", "loop_s", "traffic_s", "rounds", "steps_contributed", "traffic",
        "local_steps", "undecided_steps", "lost_steps", "t",
    )  # fmt: skip
    return {
        "n": n,
        "real": measured,
        "simulated": simulated,
        "relative_error": errors,
        "agrees": all(e is not None and e <= AGREEMENT_TOLERANCE for e in errors.values()),
        "other_cores": real.get("other_cores"),
        "applied": applied,
        "steps": real.get("steps"),
        "replayed_steps": traces is not None,
        "real_peers": [{k: s.get(k) for k in kept} for s in summaries],
    }


def with_fixed_string_hashes() -> None:
    """Run again under PYTHONHASHSEED=0 unless already: the order of a set of peer ids
    follows Python's per-process string hash, and with it the order events run in, so
    one seed repeats its figures only when the hash is fixed too."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    with_fixed_string_hashes()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="N = 10, 100, 1000 over short virtual spans"
    )
    parser.add_argument("--sizes", default="", help="comma-separated N (default: the quick ones)")
    parser.add_argument(
        "--seconds", type=float, default=0.0,
        help="measured virtual seconds per N, after the warm-up (default: per N)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--agreement", default="", help="comma-separated N of real swarms to compare (e.g. 4,8)"
    )
    parser.add_argument(
        "--design",
        choices=("after", "before"),
        default="after",
        help="after: sharded membership and record epochs; before: one key each",
    )
    parser.add_argument(
        "--aggregation", default="", help="comma-separated M of the aggregation figure"
    )
    parser.add_argument("--preset", default="150m", help="model preset of --aggregation")
    parser.add_argument(
        "--aggregation-designs", default="before,after", help="which designs --aggregation runs"
    )
    parser.add_argument(
        "--quorum-share", type=float, default=AGGREGATION_QUORUM_SHARE,
        help="min_quorum of --aggregation as a share of M (at least 2)",
    )
    parser.add_argument("--codec", help="the simulated learners' delta codec (default int8)")
    parser.add_argument("--outer-codec", help="the simulated synchronizers' update codec")
    parser.add_argument("--real-from", type=Path, help="re-simulate the agreement of a saved --json")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--mean-steps", action="store_true",
        help="agreement: simulated learners train at the real ones' mean step time, not their trace",
    )
    args = parser.parse_args()
    CODECS.update({"codec": args.codec} if args.codec else {})
    CODECS.update({"outer_codec": args.outer_codec} if args.outer_codec else {})
    sizes = [int(x) for x in args.sizes.split(",") if x and x != "0"]
    if not sizes and not args.sizes:
        sizes = list(QUICK_SIZES)
    seconds = {n: args.seconds or QUICK_SECONDS.get(n, 120.0) for n in sizes}
    result: dict[str, Any] = {
        "setting": "quick" if args.quick else "custom",
        "seed": args.seed,
        "design": args.design,
        "compress": dict(CODECS),
    }
    result["by_n"] = run_sizes(sizes, seconds, args.seed, args.design)
    if args.agreement:
        result["agreement"] = {}
        saved = json.loads(args.real_from.read_text())["agreement"] if args.real_from else {}
        for n in (int(x) for x in args.agreement.split(",")):
            entry = agreement(n, saved.get(str(n)), replay_steps=not args.mean_steps)
            result["agreement"][str(n)] = entry
            print(f"agreement N={n}: " + ", ".join(
                f"{k} real {entry['real'][k]:.4g} sim {entry['simulated'][k]:.4g}" for k in entry["real"]
            ), flush=True)  # fmt: skip
    if args.aggregation:
        result["aggregation"] = aggregation(
            [int(x) for x in args.aggregation.split(",")], args.preset, args.seed,
            tuple(args.aggregation_designs.split(",")), args.quorum_share,
        )
    if args.json and result["by_n"] is not None:
        args.json.write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
