"""Command lines of the `python -m p2pdiloco` children that the demo, tests and scripts start.

One place for what they all pass: `--set` flags from a list of overrides, the flags of a
`join` whose events the parent reads, and the tiny run that trains in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["TINY_RUN", "child_join_args", "set_args"]

TINY_RUN: tuple[str, ...] = (
    "model.preset='tiny'",
    "model.seq_len=32",
    "data.max_files=60",
    "train.batch_size=2",
    "train.device='cpu'",
    "train.warmup_steps=5",
)
"""`--set` overrides of a tiny run on the CPU: a few peers train rounds in seconds. Each user
adds its own H and round deadline (tests/net/swarm_util.py, scripts/bench_chaos.py)."""


def set_args(items: Iterable[str]) -> list[str]:
    """`--set ITEM` for each config override in `items` (`section.key=value`)."""
    return [arg for item in items for arg in ("--set", item)]


def child_join_args(*flags: str, sets: Iterable[str] = ()) -> list[str]:
    """Arguments after the interpreter of a `join` child whose events its parent reads:
    JSON events on stdout, one torch thread, a heartbeat every second; then `sets` as
    `--set` flags, then `flags`. Checkpoints are off (a throwaway swarm must not fill, nor
    resume from, the user's data directory) unless `sets` or `flags` name a folder."""
    base = ["-m", "p2pdiloco", "join", "--events", "--heartbeat-s", "1", "--threads", "1"]
    return [*base, *set_args(["peer.checkpoint_dir='none'", *sets]), *flags]
