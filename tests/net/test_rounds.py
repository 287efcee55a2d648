"""The round protocol under faults that strike at a named moment, with real processes.

A synchronizer is SIGKILLed (with its DHT process and p2pd daemon) at each phase of a
commit; the survivors must apply one update per round, the same hash for every round,
and keep closing rounds. Peers on different CPU kernel sets must never diverge. A peer
restarted with its identity and checkpoint rejoins the running swarm.
"""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.peer.faults import CRASH_PHASES

from .harness import start_peer_process
from .swarm_util import (
    Events,
    applied,
    applied_hashes_by_round,
    join_args,
    start_bootstrap,
    start_learners,
    wait_all,
    wait_any,
)
from .test_swarm import assert_replicas_identical

pytestmark = pytest.mark.timeout(900)

ROUND_WAIT_S = 300
FAST_RUN = ["sync.round_deadline_s=20"]


def assert_one_update_per_round(logs: list[Events]) -> None:
    """No peer ever applied two different updates for one (fragment, round)."""
    for log in logs:
        forks = {k: v for k, v in applied_hashes_by_round(log).items() if len(v) > 1}
        assert not forks, f"{log.peer.name} applied two updates for {sorted(forks)}"


@pytest.mark.parametrize("phase", CRASH_PHASES)
def test_synchronizer_killed_at_each_commit_phase_leaves_one_chain(phase: str) -> None:
    boot = start_bootstrap()
    peers = start_learners(
        3,
        boot.maddrs,
        sets=FAST_RUN,
        flags=["--wait-peers", "3"],
        per_peer=lambda i: ["--crash-at", phase] if i == 0 else [],
    )
    logs = [Events(p) for p in peers]
    crash = logs[0].wait(lambda e: e.get("event") == "crashing", ROUND_WAIT_S)
    assert crash["phase"] == phase
    crashed_round = crash["round"]
    survivors = logs[1:]
    # the round the dead synchronizer held, and two more, close on every survivor
    wait_all(survivors, applied(crashed_round + 2), ROUND_WAIT_S)
    assert_one_update_per_round(survivors)
    assert_replicas_identical(survivors, min_common=3)
    for log in survivors:
        rounds = sorted(r for (f, r) in log.hashes() if f == 0)
        assert rounds == list(range(rounds[0], rounds[-1] + 1)), "no round skipped"
    for log in survivors:
        assert log.peer.stop() == 0


def test_peers_on_different_cpu_kernels_stay_bit_identical() -> None:
    native = torch.backends.cpu.get_cpu_capability()
    boot = start_bootstrap()
    peers = start_learners(
        4,
        boot.maddrs,
        flags=["--wait-peers", "4"],
        env_of=lambda i: {"ATEN_CPU_CAPABILITY": "default"} if i % 2 == 0 else {},
    )
    logs = [Events(p) for p in peers]
    wait_all(logs, applied(3), ROUND_WAIT_S)
    for log in logs:
        log.drain(0.5)
    joined = {tuple(log.of("joined")[0]["hashes"]) for log in logs}
    assert len(joined) == 1, f"initial models differ across kernels ({native} vs default)"
    assert not any(log.of("diverged") or log.of("repair") for log in logs)
    assert_replicas_identical(logs, min_common=4)
    for log in logs:
        assert log.peer.stop() == 0


def test_restarted_peer_with_its_checkpoint_rejoins_without_its_bootstrap_node(tmp_path) -> None:
    boot = start_bootstrap()
    identity, checkpoints = tmp_path / "id.key", tmp_path / "ckpt"
    own = ["--identity", str(identity), "--checkpoint-dir", str(checkpoints), "--checkpoint-every-s", "1"]
    others = start_learners(2, boot.maddrs, sets=["sync.min_quorum=2"])
    victim = Events(
        start_peer_process(join_args(initial=boot.maddrs, sets=["sync.min_quorum=2"], flags=own), ready_timeout_s=240)
    )
    logs = [Events(p) for p in others]
    victim.wait(lambda e: e.get("event") == "checkpoint_saved", ROUND_WAIT_S)
    victim.wait(applied(1), ROUND_WAIT_S)
    victim.peer.kill()
    # the swarm goes on without it and without its only bootstrap node; the peer comes
    # back with the same id and checkpoint and finds the swarm through the peers it saw
    boot.kill()
    wait_all(logs, applied(3), ROUND_WAIT_S)
    back = Events(
        start_peer_process(join_args(initial=boot.maddrs, sets=["sync.min_quorum=2"], flags=own), ready_timeout_s=240)
    )
    assert back.peer.peer_id == victim.peer.peer_id
    loaded = back.wait(lambda e: e.get("event", "").startswith("checkpoint_"), ROUND_WAIT_S)
    assert loaded["event"] == "checkpoint_loaded" and loaded["step"] > 0
    joined = back.wait(lambda e: e.get("event") == "joined", ROUND_WAIT_S)
    back.wait(applied(joined["rounds"][0]), ROUND_WAIT_S)
    wait_any([back], applied(joined["rounds"][0] + 1), ROUND_WAIT_S)
    wait_all(logs, applied(joined["rounds"][0] + 1), ROUND_WAIT_S)
    assert_replicas_identical([*logs, back])
    assert back.peer.stop() == 0


def test_two_synchronizers_commit_one_round_and_one_update_survives_everywhere() -> None:
    boot = start_bootstrap()
    # both peers see only themselves for round 0 and ignore rival records: each commits
    # round 0 with its own delta; the canonical-chain rule must keep one everywhere
    peers = start_learners(
        2, boot.maddrs, flags=["--wait-peers", "2", "--split-view-rounds", "1"]
    )
    logs = [Events(p) for p in peers]
    wait_all(logs, applied(3), ROUND_WAIT_S)
    for log in logs:
        log.drain(0.5)
    closed_0 = [e for log in logs for e in log.of("round_closed") if e["round"] == 0]
    assert len(closed_0) == 2, "the fault made both peers commit round 0"
    repaired = [log for log in logs if log.of("repair")]
    assert len(repaired) == 1, "exactly the replica that applied the losing update repaired"
    (loser_log,) = repaired
    (winner_log,) = [log for log in logs if log is not loser_log]
    winner = next(e for e in closed_0 if e["hash"] == winner_log.hashes()[(0, 0)])
    loser = next(e for e in closed_0 if e is not winner)
    assert loser["contributors"] == [loser_log.peer.peer_id]
    # after its repair (a verified download of round D's state) the loser holds the
    # winner's chain: every round both applied from there on has one hash
    first = loser_log.of("downloaded")[0]["round"] - 1
    ours, theirs = winner_log.hashes(), loser_log.hashes()
    common = sorted(k for k in set(ours) & set(theirs) if k[1] >= first)
    assert common, "the two replicas share rounds after the repair"
    for key in common:
        assert ours[key] == theirs[key], f"replicas differ at {key}"
    # no contribution lost or doubled: the loser's round-0 delta, merged only in the
    # losing update, comes back into its learner's local progress (or was never booked)
    reported = [
        e
        for e in loser_log.of("delta_unmerged") + loser_log.of("delta_folded")
        if e["fragment"] == 0 and e["round"] == 0
    ]
    assert reported, "the delta merged only in the losing update went back to its learner"
    for log in logs:
        assert log.peer.stop() == 0
