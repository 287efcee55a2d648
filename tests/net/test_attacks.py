"""Attacks on a live run, by a stranger's program, fail: real peers, real processes.

A 3-peer run trains; an attacker joins its DHT (tests/net/adversary.py) and forges
heartbeats and round records in the honest peers' names, overwrites whole keys with plain
values, adds 1000 fake members, floods `get_state`, and sends replayed, unsigned, forged,
junk, wrong-layout, NaN-meta and shape-bomb contributions. Then: no honest peer crashed, every attack was
refused (never merged), the forged records changed nobody's view, and the run went on
closing rounds with identical replicas and every honest learner still a member.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import start_peer_process
from .swarm_util import Events, applied, start_bootstrap, start_learners, wait_all

pytestmark = pytest.mark.timeout(900)

ROUND_WAIT_S = 300
ADVERSARY = Path(__file__).resolve().parent / "adversary.py"
ATTACKS = "forged_heartbeats,plain_values,fake_members,forged_records,bad_contributions,state_flood"


def latest_round(log: Events) -> int:
    return max((r for (_, r) in log.hashes()), default=-1)


def test_a_strangers_attacks_are_refused_and_the_run_keeps_closing_rounds() -> None:
    boot = start_bootstrap()
    peers = start_learners(3, boot.maddrs, sets=["sync.min_quorum=2"], flags=["--max-rounds", "9"])
    logs = [Events(p) for p in peers]
    honest = sorted(p.peer_id for p in peers)
    wait_all(logs, applied(1), ROUND_WAIT_S)

    attacker = start_peer_process(
        [
            str(ADVERSARY), "--run", "local", "--initial-peer", *boot.maddrs[:1],
            "--victims", ",".join(honest), "--attacks", ATTACKS,
        ],
        ready_timeout_s=180,
    )
    results = {}
    while True:
        event = attacker.next_event(600)
        if event.get("done"):
            break
        results[event["attack"]] = event
    for name, result in results.items():
        assert "error" not in result, (name, result)
    # no malicious contribution was ever merged or held by an honest synchronizer
    for case, replies in results["bad_contributions"]["replies"].items():
        assert set(replies) == {"rejected"}, (case, replies)
    assert results["state_flood"]["refused"] >= 1

    # the run goes on: two more rounds after the attacks, on every peer
    after = max(latest_round(log) for log in logs)
    wait_all(logs, applied(after + 2), ROUND_WAIT_S)
    for log in logs:
        log.drain(quiet_s=1.0, max_s=5.0)
    # no honest peer died; replicas identical; nobody followed a forged record
    assert all(p.poll() is None or p.returncode == 0 for p in peers)
    tables = [log.hashes() for log in logs]
    for key in set.intersection(*(set(t) for t in tables)):
        assert len({t[key] for t in tables}) == 1, key
    assert max(latest_round(log) for log in logs) < 100
    # the forged "leaving" heartbeats evicted nobody: every honest learner kept contributing
    closed = [e for log in logs for e in log.of("round_closed") if e["round"] > after]
    assert closed and set().union(*(e["contributors"] for e in closed)) == set(honest)
    assert not any(attacker.peer_id in e["contributors"] for log in logs for e in log.of("round_closed"))
    # the DHT validators refused the forged values, and said so
    refusals = "".join(Path(p.stderr_path).read_text(errors="replace") for p in [boot, *peers])
    assert "dht_record_refused" in refusals
    attacker.stop()
    for peer in peers:
        assert peer.stop() == 0
