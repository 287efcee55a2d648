"""Helpers for swarm tests: peer command lines and an event log per peer process."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pdiloco.cli import argv

from .harness import PeerProcess, launch_peer_process, start_peer_process, start_peer_processes

TINY_RUN = [  # the package's tiny run with the tests' H and round deadline
    *argv.TINY_RUN,
    "sync.inner_steps=10",
    "sync.round_deadline_s=60",
    # a test starts 3-6 peers, two tests at a time on a 2-core machine: learners training
    # flat out would starve every start, merge and DHT call the test is waiting for
    "train.compute_share=0.2",
]


ADVERSARY = Path(__file__).resolve().parent / "adversary.py"
"""A stranger's program (valid free keys, a stock DHT client): tests/net/adversary.py."""

TRANSPORTS = ["hivemind", "libp2p"]
"""The swarm tests that matter most run on both transports (issue: a second transport):
one model and identical replicas, and a synchronizer's failover. The rest run on the
default (hivemind): the late joiner and the malformed contributions use nothing of the
transport that `test_transport.py` does not check on both (20 MB calls, records, timeouts
of killed peers), and two more libp2p swarms cost the suite about two minutes."""


def on_transport(kind: str) -> list[str]:
    """The `--set` item that puts a run on transport `kind`."""
    return [f"network.transport='{kind}'"]


def join_args(
    *, initial: list[str] | None = None, sets: list[str] = (), flags: list[str] = ()
) -> list[str]:
    """Arguments of `python -m p2pdiloco join` for a tiny test swarm."""
    peers = ["--initial-peers", *initial] if initial else []
    return argv.child_join_args(*peers, *flags, sets=[*TINY_RUN, *sets])


def start_bootstrap(*flags: str) -> PeerProcess:
    return start_peer_process(["-m", "p2pdiloco", "bootstrap", "--events", *flags], ready_timeout_s=180)


def start_learners(
    num: int,
    initial: list[str],
    sets: list[str] = (),
    flags: list[str] = (),
    per_peer=None,
    env_of=None,
) -> list[PeerProcess]:
    """Start `num` learners at the same instant; `per_peer(i)` adds flags for learner i,
    `env_of(i)` environment variables."""
    many = [
        join_args(initial=initial, sets=sets, flags=[*flags, *(per_peer(i) if per_peer else [])])
        for i in range(num)
    ]
    envs = [env_of(i) if env_of else None for i in range(num)]
    return start_peer_processes(many, ready_timeout_s=240, envs=envs)


def launch_adversary(
    boot: PeerProcess, victims: list[str], attacks: str, env: dict[str, str] | None = None
) -> PeerProcess:
    """Launch the adversary against `victims` through the bootstrap's first address,
    running `attacks` (comma-separated names of adversary.py); the caller waits for its
    readiness line (`wait_ready`), which comes once its DHT node has joined."""
    args = [
        str(ADVERSARY), "--run", "local", "--initial-peer", *boot.maddrs[:1],
        "--victims", ",".join(victims), "--attacks", attacks,
    ]  # fmt: skip
    return launch_peer_process(args, env=env)


def adversary_results(
    attacker: PeerProcess, timeout_s: float, on_result: Callable[[dict], None] | None = None
) -> dict[str, dict]:
    """Attack name -> the result line the adversary printed for it, until its `done` line;
    `on_result` sees each result as it arrives (to act between two attacks)."""
    results: dict[str, dict] = {}
    while True:
        try:
            event = attacker.next_event(timeout_s)
        except TimeoutError as exc:  # say where it stood and what it wrote to stderr
            done = ", ".join(results) or "none"
            raise TimeoutError(f"{exc}; attacks done: {done}; stderr tail:\n{attacker.stderr_tail()}") from exc
        if event.get("done"):
            return results
        results[event["attack"]] = event
        if on_result is not None:
            on_result(event)


def applied_hashes_by_round(log: Events) -> dict[tuple[int, int], set[str]]:
    """(fragment, round) -> every hash this peer ever applied for it (a fork shows two)."""
    seen: dict[tuple[int, int], set[str]] = {}
    for e in log.of("applied"):
        seen.setdefault((e["fragment"], e["round"]), set()).add(e["hash"])
    return seen


class Events:
    """Every event a peer printed, kept, so several conditions can be checked on them."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        self.seen: list[dict[str, Any]] = []

    def pump(self, timeout_s: float = 0.05) -> None:
        try:
            self.seen.append(self.peer.next_event(timeout_s))
        except (TimeoutError, EOFError):
            pass

    def drain(self, quiet_s: float = 1.0, max_s: float = 10.0) -> None:
        """Read the events already printed: until none comes for `quiet_s`, or for at most
        `max_s` (a swarm closing rounds every second never goes quiet)."""
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            try:
                self.seen.append(self.peer.next_event(quiet_s))
            except (TimeoutError, EOFError):
                return

    def wait(self, match: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """The first event (seen or new) satisfying `match`; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        while True:
            for event in self.seen[checked:]:
                if match(event):
                    return event
            checked = len(self.seen)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{self.peer.name}: no matching event in {timeout_s}s; last: {self.seen[-5:]}\n{self.peer.stderr_tail(3000)}"
                )
            try:
                self.seen.append(self.peer.next_event(min(remaining, 1.0)))
            except TimeoutError:
                pass
            except EOFError:
                if not any(match(e) for e in self.seen[checked:]):
                    raise

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("event") == kind]

    def hashes(self) -> dict[tuple[int, int], str]:
        """(fragment, round) -> hash after this peer applied that round's update."""
        return {(e["fragment"], e["round"]): e["hash"] for e in self.of("applied")}

    def latest_round(self) -> int:
        """The highest round this peer applied, of any fragment (-1 before the first)."""
        return max((r for (_, r) in self.hashes()), default=-1)


def wait_all(logs: list[Events], match: Callable[[dict[str, Any]], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for log in logs:
        log.wait(match, max(deadline - time.monotonic(), 1.0))


def wait_any(
    logs: list[Events], match: Callable[[dict[str, Any]], bool], timeout_s: float
) -> dict[str, Any]:
    """The first event satisfying `match` in any of the logs; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for log in logs:
            found = next((e for e in log.seen if match(e)), None)
            if found is not None:
                return found
            log.pump(0.2)
    raise TimeoutError(f"no matching event in any of {len(logs)} logs in {timeout_s}s")


def applied(round_id: int, fragment: int = 0) -> Callable[[dict[str, Any]], bool]:
    return lambda e: (
        e.get("event") == "applied" and e["fragment"] == fragment and e["round"] >= round_id
    )
