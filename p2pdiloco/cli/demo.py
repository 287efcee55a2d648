"""`p2pdiloco demo`: a local swarm on this machine, as separate processes on 127.0.0.1.

A bootstrap node and N learner peers (`p2pdiloco join`) are started in their own
process groups by `p2pdiloco.cli.launcher`, which reads their JSON event lines in background
threads. `LocalSwarm` owns the children: `shutdown()` stops every one of them (SIGTERM,
then SIGKILL of the group), and runs on Ctrl-C too. `follow_plain` and
`follow_dashboard` show the swarm until every learner left; `print_summary` the totals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

from rich.console import Console

from p2pdiloco.cli.argv import set_args
from p2pdiloco.cli.launcher import Child, ChildFailedToStart
from p2pdiloco.config import PeerConfig, RunConfig, config_to_dict
from p2pdiloco.errors import NetworkSetupError

__all__ = [
    "DEMO_RUN",
    "Child",
    "LocalSwarm",
    "child_sets",
    "follow_dashboard",
    "follow_plain",
    "print_summary",
]

DEMO_RUN = [
    "model.preset='small'",
    "model.seq_len=128",
    "train.batch_size=4",
    "train.warmup_steps=10",
    "train.total_steps=400",
    "sync.inner_steps=20",
    "sync.min_quorum=2",
    "data.max_files=400",
]
"""The embedded demo run: the `small` model on the stdlib corpus, H=20, quorum 2."""


def child_sets(config: RunConfig) -> list[str]:
    """`--set` items that give a child peer `config`: every run field, and the `[peer]`
    fields changed from their defaults (the swarm's own join flags come after, and win)."""
    defaults = dataclasses.asdict(PeerConfig())
    return [
        f"{section}.{key}={json.dumps(value)}"
        for section, values in config_to_dict(config).items()
        for key, value in values.items()
        if section != "peer" or value != defaults[key]
    ]


class LocalSwarm:
    """A bootstrap node plus learner peers on 127.0.0.1."""

    def __init__(
        self, num_peers: int, sets: list[str], max_rounds: int, python: str = sys.executable
    ) -> None:
        self.num_peers = num_peers
        self.sets = sets
        self.max_rounds = max_rounds
        self.python = python
        self.bootstrap: Child | None = None
        self.learners: list[Child] = []
        self.bootstrap_maddrs: list[str] = []

    def _spawn(self, name: str, args: list[str]) -> Child:
        return Child.spawn([self.python, "-m", "p2pdiloco", *args], name)

    @staticmethod
    def _wait_ready(child: Child, timeout_s: float) -> dict[str, Any]:
        try:
            return child.wait_ready(timeout_s)
        except ChildFailedToStart:
            last = child.stderr_tail(400).strip().splitlines()[-1:] or "no output"
            raise NetworkSetupError(
                f"{child.name} did not start within {timeout_s:.0f}s: {last}"
            ) from None

    def start(self, timeout_s: float = 300.0) -> None:
        """Start the bootstrap node, then every learner at once; wait until all are ready."""
        # the bootstrap node gets the run's config too: its transport, and its fragments'
        # record keys (it refuses records of keys it does not know)
        self.bootstrap = self._spawn("bootstrap", ["bootstrap", "--events", *set_args(self.sets)])
        self.bootstrap_maddrs = self._wait_ready(self.bootstrap, timeout_s)["maddrs"]
        base = [
            "join",
            "--no-checkpoint",  # a throwaway swarm: never resumes from, nor fills, the data dir
            "--events",
            "--threads",
            "1",
            "--max-rounds",
            str(self.max_rounds),
            "--data-shards",
            str(self.num_peers),
            # start together: no peer closes early rounds alone while the others index data
            "--wait-peers",
            str(self.num_peers),
            "--initial-peers",
            *self.bootstrap_maddrs,
            *set_args(self.sets),
        ]
        self.learners = [
            self._spawn(f"peer{i}", [*base, "--data-rank", str(i)]) for i in range(self.num_peers)
        ]
        deadline = time.monotonic() + timeout_s
        for child in self.learners:
            self._wait_ready(child, max(deadline - time.monotonic(), 1.0))

    def running(self) -> bool:
        return any(child.alive() for child in self.learners)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every child: SIGTERM (clean leave), then SIGKILL of its process group.

        A child that already left by itself (its "stopped" line) is not signalled again.
        """
        children = [*self.learners, *([self.bootstrap] if self.bootstrap else [])]
        for child in children:
            child.request_stop()
        deadline = time.monotonic() + timeout_s
        for child in children:
            child.wait_exit(max(deadline - time.monotonic(), 0.1))
            child.reap()  # whatever it spawned, too

    def replicas_identical(self) -> bool:
        """Whether every (fragment, round) applied by several peers has a single hash."""
        hashes: dict[tuple[int, int], set[str]] = {}
        for child in self.learners:
            for e in child.of("applied"):
                hashes.setdefault((e["fragment"], e["round"]), set()).add(e["hash"])
        return bool(hashes) and all(len(v) == 1 for v in hashes.values())

    def summary(self) -> dict[str, Any]:
        """Totals over the learners' summary events (the demo's --json figures)."""
        summaries = [c.first("summary") for c in self.learners]
        done = [s for s in summaries if s]
        evals = [e for c in self.learners for e in c.of("eval")]
        evals.sort(key=lambda e: (min(e["rounds"]), e.get("t", 0)))
        return {
            "peers": self.num_peers,
            "rounds_completed": max((min(s["rounds"]) for s in done), default=0),
            "tokens": sum(s["tokens"] for s in done),
            "eval_loss_start": evals[0]["eval_loss"] if evals else None,
            "eval_loss_end": evals[-1]["eval_loss"] if evals else None,
            "bytes_sent": sum(s["bytes_sent"] for s in done),
            "bytes_received": sum(s["bytes_received"] for s in done),
            "replicas_identical": self.replicas_identical(),
            "per_peer": [
                {
                    "peer_id": s["peer_id"],
                    "steps": s["steps"],
                    "tokens": s["tokens"],
                    "rounds_contributed": s["rounds_contributed"],
                    "tokens_contributed": s["tokens_contributed"],
                    "bytes_sent": s["bytes_sent"],
                }
                for s in done
            ],
        }


def follow_plain(swarm: LocalSwarm, console: Console) -> None:
    """Without the dashboard: one line per closed round, until every learner left."""
    printed: set[tuple[int, int]] = set()
    while swarm.running():
        for child in swarm.learners:
            for event in child.of("round_closed"):
                key = (event["fragment"], event["round"])
                if key not in printed:
                    printed.add(key)
                    console.print(
                        f"round {event['round'] + 1} fragment {event['fragment']}: {len(event['contributors'])} deltas merged by {child.name}, grace {event['grace_s']:.2f}s"
                    )
        time.sleep(0.5)  # polling the children's event lists, not synchronising


def follow_dashboard(swarm: LocalSwarm, num_fragments: int, transport_kind: str = "hivemind", **view: Any) -> None:
    """The live dashboard, fed by an observer on the swarm's DHT, until every learner left;
    `view`: the run's min_quorum and max_grace_s (`dashboard.Observer`)."""
    from p2pdiloco.cli.dashboard import watch

    observer = PeerConfig(initial_peers=tuple(swarm.bootstrap_maddrs))
    asyncio.run(
        watch(observer, num_fragments, refresh_s=1.0, keep_going=swarm.running, transport_kind=transport_kind, **view)
    )


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    """The demo's closing table: per peer steps, tokens, contributions and bytes."""
    from rich.table import Table

    from p2pdiloco.cli.dashboard import human_bytes, short

    table = Table(title=f"demo: {summary['peers']} peers, {summary['rounds_completed']} rounds")
    for name in (
        "peer",
        "steps",
        "tokens",
        "rounds contributed",
        "tokens contributed",
        "bytes sent",
    ):
        table.add_column(name, justify="left" if name == "peer" else "right")
    for peer in summary["per_peer"]:
        table.add_row(
            short(peer["peer_id"]),
            str(peer["steps"]),
            f"{peer['tokens']:,}",
            str(peer["rounds_contributed"]),
            f"{peer['tokens_contributed']:,}",
            human_bytes(peer["bytes_sent"]),
        )
    console.print(table)
    start, end = summary["eval_loss_start"], summary["eval_loss_end"]
    if start is not None and end is not None:
        console.print(
            f"held-out loss {start:.4f} -> {end:.4f}   bytes sent {human_bytes(summary['bytes_sent'])}   replicas identical: {summary['replicas_identical']}"
        )
