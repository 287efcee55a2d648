"""A run outlives every one of its peers (issue 28, item 15: "the model dies with its swarm").

Three peers with identities and checkpoint directories train to round 3 or more; all stop
cleanly (SIGINT, exit 0), their bootstrap node too, so the DHT forgets the run. Two come
back together with their checkpoints, the third later with an empty directory, two hours later by
their clocks (issue 42, item 5: each process's `time.time` shifted, tests/net/skewed_peer.py;
the machine's clock is not touched), past the hour a round record lives: the run goes on
from the rounds they saved (not round 0), the records and hashes of the first life still
hold, no round is applied twice, and the screening judges the first rounds against the
rounds before the stop. Before, the records they republished were refused as too old: the
run went on from the newest peer's own chain, and its first windows had no history.
"""

from __future__ import annotations

import signal
from pathlib import Path

from .harness import launch_peer_process
from .swarm_util import (
    Events,
    applied,
    applied_hashes_by_round,
    join_args,
    start_bootstrap,
    start_learners,
    wait_all,
)

ROUND_WAIT_S = 300
SETS = ["sync.num_fragments=2"]
SKEWED = Path(__file__).resolve().parent / "skewed_peer.py"
LATER = {"P2PDILOCO_TEST_CLOCK_OFFSET_S": "7200"}
"""The second life's clocks: two hours on, every process of it alike."""


def own(tmp_path: Path, i: int, directory: str = "ckpt") -> list[str]:
    """Learner i's identity and checkpoint directory (frequent saves: the test is short)."""
    return [
        "--identity", str(tmp_path / f"id{i}.key"),
        "--checkpoint-dir", str(tmp_path / f"{directory}{i}"),
        "--checkpoint-every-s", "2",
    ]  # fmt: skip


def later(args: list[str]):
    """A peer process of the second life: `args` ("-m p2pdiloco ...") run with its clock
    two hours on."""
    peer = launch_peer_process([str(SKEWED), *args[2:]], env=LATER)
    peer.wait_ready(240)
    return peer


def later_many(many: list[list[str]]) -> list:
    """`later` for several peers launched at the same instant."""
    peers = [launch_peer_process([str(SKEWED), *args[2:]], env=LATER) for args in many]
    for peer in peers:
        peer.wait_ready(240)
    return peers


def restart(tmp_path: Path, i: int, initial: list[str], directory: str = "ckpt") -> Events:
    return Events(later(join_args(initial=initial, sets=SETS, flags=own(tmp_path, i, directory))))


def stop_all(logs: list[Events]) -> None:
    """SIGINT every peer at once; each leaves cleanly (exit 0) and saves on the way out."""
    for log in logs:
        assert log.peer.request_stop(signal.SIGINT)
    for log in logs:
        assert log.peer.wait_exit(180) == 0, log.peer.stderr_tail(3000)
        log.drain(0.5)


def test_a_run_resumes_from_its_checkpoints_after_every_peer_stopped(tmp_path: Path) -> None:
    boot = start_bootstrap()
    first = [
        Events(p)
        for p in start_learners(3, boot.maddrs, sets=SETS, per_peer=lambda i: own(tmp_path, i))
    ]
    wait_all(first, applied(2, fragment=0), ROUND_WAIT_S)
    wait_all(first, applied(2, fragment=1), ROUND_WAIT_S)
    stop_all(first)
    boot.stop()
    saved = [log.of("checkpoint_saved")[-1]["global_rounds"] for log in first]
    assert all(min(rounds) >= 3 for rounds in saved), saved
    before = applied_hashes_by_round_all(first)

    # a fresh DHT two hours later: nothing of the run is left but what the peers saved
    boot = later(["-m", "p2pdiloco", "bootstrap", "--events"])
    # the two with checkpoints together: one whose last save came a round before the
    # other's, back alone, would commit that round anew before the other's records of it
    # are back, and a live round outranks a restored one (the operators' guide: start the
    # newest first; `docs/operate.md`)
    a, b = (Events(p) for p in later_many(
        [join_args(initial=boot.maddrs, sets=SETS, flags=own(tmp_path, i)) for i in (0, 1)]
    ))  # fmt: skip
    for log, rounds in ((a, saved[0]), (b, saved[1])):
        assert log.wait(lambda e: e.get("event") == "resumed", ROUND_WAIT_S)["rounds"] == rounds
    a.wait(lambda e: e.get("event") == "republished", ROUND_WAIT_S)
    c = restart(tmp_path, 2, boot.maddrs, directory="empty")  # its own identity, nothing on disk
    assert (
        c.wait(lambda e: e.get("event", "").startswith("checkpoint_"), ROUND_WAIT_S)["event"]
        == "checkpoint_none"
    )
    second = [a, b, c]

    head = [max(rounds[f] for rounds in saved) for f in range(2)]
    for f in range(2):
        wait_all(second, applied(head[f] + 1, fragment=f), ROUND_WAIT_S)
    for log in second:
        log.drain(0.5)

    # the empty one took the saved state from a restarted peer, never round 0's
    downloads = c.of("downloaded")
    assert downloads and all(e["round"] >= min(min(r) for r in saved) for e in downloads), downloads
    assert not any(log.of("checkpoint_refused") for log in second)
    for log in (a, b):  # a restored replica applies only rounds after its own
        restored = log.of("resumed")[0]["rounds"]
        assert all(e["round"] >= restored[e["fragment"]] for e in log.of("applied")), log.of(
            "applied"
        )
    # one hash per (fragment, round) across both lives and all peers: no round applied twice
    # with another result, none lost (the rounds go on from the saved head, not from 0)
    after = applied_hashes_by_round_all(second)
    assert all(len(hashes) == 1 for hashes in after.values()), after
    for key in set(before) & set(after):
        assert before[key] == after[key], key
    for f in range(2):
        assert (f, head[f]) in after and (f, 0) not in after
    # the screening has its history again: the first rounds closed after the restart
    # judged deltas against the rounds before them (before: their records had expired)
    for f in range(2):
        closed = sorted((e["round"], e.get("history_from", -1)) for log in second for e in log.of("round_closed")
                        if e["fragment"] == f)  # fmt: skip
        assert closed and closed[0][1] >= 0, closed
    for log in second:
        log.peer.stop(120)


def applied_hashes_by_round_all(logs: list[Events]) -> dict[tuple[int, int], set[str]]:
    """(fragment, round) -> every hash any of these peers applied for it."""
    merged: dict[tuple[int, int], set[str]] = {}
    for log in logs:
        for key, hashes in applied_hashes_by_round(log).items():
            merged.setdefault(key, set()).update(hashes)
    return merged
