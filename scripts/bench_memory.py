"""Benchmark: memory of a learner and of a synchronizer, and a 150M swarm on this machine.

Two parts, each in its own processes (peak RSS is per process):

  merge   one synchronizer window of M int8 contributions, merged by `merge_round` as the
          synchronizer does it, for M = 2..32: the RSS the held contributions take, and the
          peak on top of that while merging; `lazy` holds them as received (decoded one
          tensor at a time, what the synchronizer does), `eager` decoded to fp32 (what it
          did before). The fragment is the whole model (P = 1, the worst case).
  swarm   a real swarm: a bootstrap node, a full peer (learner + synchronizer, quorum 1)
          and a late joiner in client mode (a learner only) that comes once the run is
          further than a replay reaches, downloads the state and trains with it; every
          process reports its peak RSS (`ru_maxrss`) in its summary. Replicas must agree.

Then a memory model (bytes per parameter from the measurements) for the `1b` preset and
M = 2..32. `--quick` runs the `tiny` model (about 2 minutes); the full setting runs the
`small` model for the merge sweep and `150m` for the swarm (15-20 minutes here).

    python scripts/bench_memory.py [--quick] [--json out/memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco.cli.argv import set_args  # noqa: E402
from p2pdiloco.cli.launcher import Child, reap_all  # noqa: E402
from p2pdiloco.peer.census import status_bytes  # noqa: E402

MiB = 1 << 20
QUICK = {"merge_preset": "tiny", "counts": [2, 4, 8, 16, 32], "swarm_preset": "tiny", "rounds": 4}
FULL = {"merge_preset": "small", "counts": [2, 4, 8, 16, 32], "swarm_preset": "150m", "rounds": 3}
SWARM_SETS = {
    "tiny": ["model.seq_len=64", "train.batch_size=4", "sync.inner_steps=10"],
    "150m": ["model.seq_len=128", "train.batch_size=2", "sync.inner_steps=2"],
}
WAIT_S = 1800
JOIN_AT_ROUND = {"150m": 5}
SWARM_FRAGMENTS = 2


def _env(census: bool = False, mmap_threshold: int = 0) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if mmap_threshold:  # glibc: allocations this large are mmapped, and unmapped when freed
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if census:  # each peer reports its large buffers by owner after every applied round
        from p2pdiloco.peer.census import ENV_VAR

        env[ENV_VAR] = "1"
    return env


class RssSampler:
    """Samples the resident memory of the swarm's processes twice a second, from /proc, so
    a peak can be placed in the run: which event of that peer came last before it."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        self.period_s = period_s
        self.children: list[Child] = []
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for child in list(self.children):
                rss = status_bytes("VmRSS", child.pid)
                if rss is not None:  # None: exited
                    self.samples.setdefault(child.name, []).append((time.time(), rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, child: Child) -> dict[str, Any]:
        """The sampled peak, when it came and the peer's last event before it; the RSS at
        each `applied` event; a timeline of at most 200 points."""
        samples = self.samples.get(child.name, [])
        if not samples:
            return {}
        peak_t, peak = max(samples, key=lambda s: s[1])
        before = [e for e in child.events if e.get("t", 0) <= peak_t and "event" in e]
        last = before[-1] if before else {}
        stride = max(1, len(samples) // 200)
        start = samples[0][0]
        return {
            "sampled_peak_bytes": peak,
            "peak_at_s": round(peak_t - start, 1),
            "event_before_peak": {k: last[k] for k in ("event", "fragment", "round") if k in last},
            "timeline": [(round(t - start, 1), rss) for t, rss in samples[::stride]],
        }


def _status_bytes(field: str) -> int:
    """A `VmRSS`/`VmHWM` line of /proc/self/status, in bytes."""
    found = status_bytes(field)
    if found is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return found


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --- merge: one window, in a child process --------------------------------------------------


def merge_worker(preset: str, count: int, mode: str) -> dict[str, Any]:
    """Peak memory of one window's merge with `count` contributions held as `mode`."""
    import torch

    from p2pdiloco import compress
    from p2pdiloco.config import load_config
    from p2pdiloco.outer.screening import Candidate, History, ScreeningRules
    from p2pdiloco.protocol.merge import merge_round
    from p2pdiloco.training.model import build_model

    torch.set_num_threads(1)
    config = load_config(overrides=[f"model.preset='{preset}'"])
    model = build_model(preset, seed=0, max_seq_len=config.model.seq_len)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    numel = sum(p.numel() for p in params.values())
    codec = compress.make_codec_from_config(config.compress)
    base_rss = _status_bytes("VmRSS")
    gen = torch.Generator().manual_seed(count)
    common = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    candidates = []
    exact = 0
    for i in range(count):
        delta = {n: 1e-3 * (c + 0.5 * torch.randn(c.shape, generator=gen)) for n, c in common.items()}
        encoded = compress.encode_tensors(codec, delta)
        del delta
        held = compress.LazyTensors(encoded) if mode == "lazy" else compress.decode_tensors(encoded)
        exact += held.nbytes if mode == "lazy" else 4 * numel
        candidates.append(Candidate(f"peer-{i:02d}", held, tokens=1000, steps=10))
        del encoded
    del common
    held_rss = _status_bytes("VmRSS")
    exact_peak = _reset_peak()
    start = time.perf_counter()
    result = merge_round(
        candidates,
        history=History(),
        params=params,
        momentum=momentum,
        outer=config.outer,
        sync=config.sync,
        rules=ScreeningRules(),
        max_tokens_per_step=1 << 20,
        outer_codec=compress.make_codec(config.compress.outer_codec),
    )
    merge_s = time.perf_counter() - start
    assert result.decoded is not None and len(result.screening.kept) == count
    peak = _status_bytes("VmHWM")
    return {
        "preset": preset,
        "parameters": numel,
        "contributions": count,
        "mode": mode,
        "held_bytes": held_rss - base_rss,
        "held_exact_bytes": exact,
        "merge_extra_bytes": peak - held_rss,
        "peak_above_base_bytes": peak - base_rss,
        "merge_s": merge_s,
        "exact_peak": exact_peak,
    }


def run_merge(preset: str, counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("lazy", "eager"):
        for count in counts if mode == "lazy" else counts[:-1]:  # eager: its growth shows by 16
            argv = [sys.executable, __file__, "--merge-worker", preset, str(count), mode]
            done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **_env()})
            if done.returncode != 0:
                raise RuntimeError(f"merge worker {preset} M={count} {mode} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"merge {preset} M={count:2d} {mode:5s}: held {row['held_bytes'] / MiB:8.1f} MiB "
                f"({row['held_exact_bytes'] / MiB:.1f} MiB of tensors), "
                f"merge adds {row['merge_extra_bytes'] / MiB:8.1f} MiB, {row['merge_s']:.2f} s",
                flush=True,
            )
    return rows


# --- swarm: real peers ----------------------------------------------------------------------


def _kind(kind: str):
    return lambda e: e.get("event") == kind


def run_swarm(
    preset: str, rounds: int, workdir: Path, census: bool = False, mmap_threshold: int = 0
) -> dict[str, Any]:
    """A full peer and a late client-mode joiner train `preset`; the joiner for `rounds` rounds.
    `census`: the peers report their large buffers by owner after every applied round."""
    sampler = RssSampler()
    sets = [f"model.preset='{preset}'", "train.device='cpu'", f"sync.num_fragments={SWARM_FRAGMENTS}",
            "sync.min_quorum=1", "train.warmup_steps=2", "data.max_files=300",
            *SWARM_SETS[preset]]  # fmt: skip
    # the bootstrap node validates records by the run's config (its fragment count)
    boot_argv = [sys.executable, "-m", "p2pdiloco", "bootstrap", "--events", *set_args(sets)]
    boot = Child.spawn(boot_argv, "boot", cwd=REPO, env=_env())
    maddrs = boot.wait_ready(300)["maddrs"]

    def peer(name: str, *extra: str) -> Child:
        own = workdir / name
        own.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "p2pdiloco", "join", "--no-checkpoint", "--events", "--threads", "1",
                "--eval-batches", "0", "--heartbeat-s", "2",
                "--identity", str(own / "id.key"), "--initial-peers", *maddrs, *extra,
                *set_args(sets)]  # fmt: skip
        child = Child.spawn(argv, name, cwd=REPO, env=_env(census, mmap_threshold))
        sampler.children.append(child)
        return child

    started = time.monotonic()

    def left() -> float:
        return WAIT_S - (time.monotonic() - started)

    full = [peer("peer0", "--data-rank", "0", "--data-shards", "2")]
    # The joiner comes once the updates of round 0 are gone from the peers' stores (bounded
    # by bytes: ~3 kept at 150m) or a replay would be too long, so it downloads the state,
    # and stays for `rounds` more rounds; the full peer trains until it leaves.
    from p2pdiloco.roles.replica import MAX_CATCH_UP_ROUNDS

    join_at = JOIN_AT_ROUND.get(preset, MAX_CATCH_UP_ROUNDS + 2)
    reached = [0, 0]
    while min(reached) < join_at:
        event = full[0].wait_event(_kind("applied"), left())
        reached[event["fragment"]] = max(reached[event["fragment"]], event["round"] + 1)
    joiner = peer("joiner", "--client-mode", "--data-rank", "1", "--data-shards", "2",
                  "--max-rounds", str(max(reached) + rounds))  # fmt: skip
    joiner.wait_event(_kind("summary"), left())
    children = [*full, joiner]
    for child in full:
        child.request_stop()
    for child in full:
        child.wait_event(_kind("summary"), 120)
    summaries = {child.name: child.first("summary") for child in children}
    by_name = {child.name: child for child in children}
    for child in children:
        child.stop(60)
    boot.stop(10)
    sampler.stop()
    applied_hashes: dict[tuple[int, int], set[str]] = {}
    for child in children:
        for e in child.of("applied"):
            if e.get("hash"):
                applied_hashes.setdefault((e["fragment"], e["round"]), set()).add(e["hash"])
    downloads = joiner.of("downloaded")
    out = {
        "preset": preset,
        "rounds": rounds,
        "mmap_threshold": mmap_threshold or None,
        "wall_s": time.monotonic() - started,
        "downloaded_fragments": sorted({e["fragment"] for e in downloads}),
        "replicas_identical": all(len(h) == 1 for h in applied_hashes.values()),
        "rounds_checked": len(applied_hashes),
        "peers": {
            name: {
                "peak_rss_bytes": s["peak_rss_bytes"],
                "heap_free_bytes_at_exit": s.get("heap_free_bytes"),
                "steps": s["steps"],
                "train_s": s.get("train_s"),  # inner steps' time: what a malloc setting costs
                "rounds": s["rounds"],
                "rounds_contributed": s["rounds_contributed"],
                "bytes_sent": s["bytes_sent"],
                "bytes_received": s["bytes_received"],
                **sampler.report(by_name[name]),
                **_census_report(by_name[name]),
            }
            for name, s in summaries.items()
        },
    }
    for name, p in out["peers"].items():
        if "sampled_peak_bytes" in p:
            print(f"swarm {preset} {name}: sampled peak {p['sampled_peak_bytes'] / MiB:.0f} MiB at "
                  f"{p['peak_at_s']} s, after {p['event_before_peak']}", flush=True)  # fmt: skip
        for owner, size in list(p.get("census_at_largest", {}).get("by_owner", {}).items())[:12]:
            print(f"swarm {preset} {name}: census {owner} {size / MiB:.0f} MiB", flush=True)
        print(
            f"swarm {preset} {name}: peak RSS {p['peak_rss_bytes'] / MiB:.0f} MiB "
            f"(heap free at exit {(p['heap_free_bytes_at_exit'] or 0) / MiB:.0f} MiB), "
            f"{p['steps']} steps, rounds {p['rounds']}, contributed {p['rounds_contributed']}",
            flush=True,
        )
    print(
        f"swarm {preset}: joiner downloaded fragments {out['downloaded_fragments']}, "
        f"replicas identical over {out['rounds_checked']} rounds: {out['replicas_identical']}",
        flush=True,
    )
    return out


def _census_report(child: Child) -> dict[str, Any]:
    """The peer's census at the applied round where its RSS was largest (`--census`)."""
    censuses = [e for e in child.of("memory") if e.get("rss_bytes")]
    if not censuses:
        return {}
    largest = max(censuses, key=lambda e: e["rss_bytes"])
    keep = ("fragment", "round", "rss_bytes", "heap_free_bytes", "owned_bytes", "unowned_tensor_bytes", "by_owner")
    return {"census_at_largest": {k: largest.get(k) for k in keep}, "censuses": len(censuses)}


# --- the memory model ----------------------------------------------------------------------


def parameter_count(preset: str) -> int:
    import torch

    from p2pdiloco.training.model import build_model, count_parameters

    with torch.device("meta"):
        return count_parameters(build_model(preset, max_seq_len=128))


# The model's constants live in the package, where `p2pdiloco doctor` and `join`'s
# preflight check a machine against them (p2pdiloco/peer/preflight.py documents each one).
from p2pdiloco.peer.preflight import (  # noqa: E402
    INT8_BYTES_PER_PARAM,
    LEARNER_BYTES_PER_FRAGMENT_PARAM,
    LEARNER_BYTES_PER_PARAM,
    RUNTIME_BASE_BYTES,
    SYNC_BYTES_PER_FRAGMENT_PARAM,
)


def memory_model(merge_rows: list[dict[str, Any]], swarm: dict[str, Any], fragments: int) -> dict[str, Any]:
    """The analytical model, checked against the measurements, projected to `1b` and M = 2..32."""
    lazy = [r for r in merge_rows if r["mode"] == "lazy"]
    swarm_params = parameter_count(swarm["preset"])

    def learner(n: int) -> float:
        return RUNTIME_BASE_BYTES + n * (LEARNER_BYTES_PER_PARAM + LEARNER_BYTES_PER_FRAGMENT_PARAM / fragments)

    def window(n_fragment: int, m: int) -> float:
        return n_fragment * (m * INT8_BYTES_PER_PARAM + SYNC_BYTES_PER_FRAGMENT_PARAM)

    joiner = swarm["peers"]["joiner"]["peak_rss_bytes"]
    full_peer = max(p["peak_rss_bytes"] for n, p in swarm["peers"].items() if n != "joiner")
    out: dict[str, Any] = {
        "fragments": fragments,
        "learner_measured_bytes": joiner,
        "learner_model_bytes": learner(swarm_params),
        "full_peer_measured_bytes": full_peer,
        "full_peer_model_bytes": learner(swarm_params) + window(swarm_params // fragments, 2),
        "merge_window_measured": [
            {"contributions": r["contributions"], "bytes": r["held_exact_bytes"] + r["merge_extra_bytes"],
             "model_bytes": window(r["parameters"], r["contributions"])}
            for r in lazy
        ],  # fmt: skip
        "projections": [],
    }
    for preset in ("150m", "1b"):
        n = parameter_count(preset)
        for m in (2, 4, 8, 16, 32):
            out["projections"].append(
                {
                    "preset": preset,
                    "parameters": n,
                    "contributions": m,
                    "learner_bytes": learner(n),
                    "synchronizer_window_bytes": window(n // fragments, m),
                    "eager_window_bytes": window(n // fragments, m) + (4 - INT8_BYTES_PER_PARAM) * m * n / fragments,
                }
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-swarm", action="store_true", help="the merge sweep only")
    parser.add_argument("--skip-merge", action="store_true", help="the swarm only (no memory model)")
    parser.add_argument(
        "--census", action="store_true", help="peers report their large buffers by owner (p2pdiloco.peer.census)"
    )
    parser.add_argument(
        "--mmap-threshold", type=int, default=0, metavar="BYTES",
        help="peers' glibc MALLOC_MMAP_THRESHOLD_ (0: glibc's dynamic default)",
    )  # fmt: skip
    parser.add_argument("--merge-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge_worker:
        preset, count, mode = args.merge_worker
        print(json.dumps(merge_worker(preset, int(count), mode)))
        return 0
    setting = QUICK if args.quick else FULL
    out: dict[str, Any] = {"setting": "quick" if args.quick else "full"}
    if not args.skip_merge:
        out["merge"] = run_merge(setting["merge_preset"], setting["counts"])
    if not args.skip_swarm:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="p2pdiloco-memory-") as tmp:
            try:
                out["swarm"] = run_swarm(
                    setting["swarm_preset"], setting["rounds"], Path(tmp), args.census, args.mmap_threshold
                )
            finally:
                reap_all()
    if "swarm" in out and "merge" in out:
        out["model"] = memory_model(out["merge"], out["swarm"], SWARM_FRAGMENTS)
        m = out["model"]
        print(
            f"model check {setting['swarm_preset']}: learner measured {m['learner_measured_bytes'] / MiB:.0f} "
            f"MiB, model {m['learner_model_bytes'] / MiB:.0f} MiB; full peer measured "
            f"{m['full_peer_measured_bytes'] / MiB:.0f} MiB, model {m['full_peer_model_bytes'] / MiB:.0f} MiB"
        )
        for row in out["model"]["projections"]:
            print(
                f"model {row['preset']} P={SWARM_FRAGMENTS} M={row['contributions']:2d}: learner "
                f"{row['learner_bytes'] / 2**30:.1f} GiB, synchronizer window "
                f"{row['synchronizer_window_bytes'] / 2**30:.1f} GiB (eager "
                f"{row['eager_window_bytes'] / 2**30:.1f} GiB)"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    ok = "swarm" not in out or out["swarm"]["replicas_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
