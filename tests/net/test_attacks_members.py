"""Sybil heartbeats and replayed heartbeats do not halt an open run (issue 28, items 1 and
12, and its "measured on main": 30 valid Sybil heartbeats closed 0 rounds in 90 s).

A 3-learner run without a manifest (open admission) trains; a stranger with a stock
hivemind DHT client publishes 30 heartbeats of free, valid Ed25519 identities with the
run's config hash and unreachable addresses, and replays the honest peers' captured old
heartbeats with a far expiration. The run keeps closing rounds, no Sybil synchronizes or
contributes, and the replicas stay identical.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from p2pdiloco.transport.records import MAX_KEY_BYTES, MAX_OWNER_BYTES

from .harness import start_peer_processes, write_identity
from .swarm_util import (
    Events,
    adversary_results,
    applied,
    applied_hashes_by_round,
    join_args,
    launch_adversary,
    start_bootstrap,
    start_learners,
    wait_all,
    wait_any,
)

pytestmark = pytest.mark.timeout(900)

ROUND_WAIT_S = 300
HIJACK_S = 30
"""How long the hijack lasts: rounds close every few seconds even on a loaded machine."""


def test_sybils_replayed_beats_and_hijack_records_do_not_halt_an_open_run(tmp_path) -> None:
    """One open run of 3 learners, one stranger with a stock DHT client and free keys.
    First (issue 42, item 1) the key of a fourth learner, merged once and gone since,
    signs for 20 s late rivals of old rounds its key out-ranks the elected synchronizer
    in (it was no candidate then), with the right parent and a current close time: before,
    every replica dropped the rounds after such a rival and waited for a state nobody has;
    now the rounds are final and every replica goes on. Then 30 Sybil heartbeats with the
    run's config hash; every honest peer's captured old beat replayed with a far
    expiration; then, for 30 s, a record for each new round signed by a fresh key ground
    to out-rank the honest synchronizers (the right parent, an update that exists
    nowhere). Before: 0 rounds in 90 s (Sybils), and no round after the first hijacked
    one. Last (issue 42, item 4) the named key floods the round key with 500 records of
    ~5 KiB for rounds ahead (2.7 MB), 40 free keys one each: each DHT node keeps the named key's
    newest 512 KiB. Now every peer goes on applying honest rounds with identical hashes."""
    boot = start_bootstrap()
    named_key = tmp_path / "named.key"
    named = write_identity(named_key)
    everyone = start_learners(
        4, boot.maddrs, sets=["sync.min_quorum=2"], flags=["--max-rounds", "500"],
        per_peer=lambda i: ["--identity", str(named_key)] if i == 3 else [],
    )  # fmt: skip
    peers, leaver = everyone[:3], everyone[3]
    assert leaver.peer_id == named
    logs = [Events(p) for p in everyone]
    wait_any(logs, lambda e: e.get("event") == "round_closed" and named in e["contributors"], ROUND_WAIT_S)
    leaver.request_stop(signal.SIGTERM)  # merged once: the chain names it; then it leaves
    assert leaver.wait_exit(60) == 0
    logs = logs[:3]
    honest = sorted(p.peer_id for p in peers)
    wait_all(logs, applied(1), ROUND_WAIT_S)
    before_late = max(log.latest_round() for log in logs)

    attacker = launch_adversary(
        boot, honest, "late_rivals,sybil_heartbeats,replayed_beats,hijacked_rounds,record_flood",
        env={"LATE_RIVAL_KEY": str(named_key), "HIJACK_S": str(HIJACK_S)},
    )  # fmt: skip
    attacker.wait_ready(180)
    before_hijack = None

    def on_result(event: dict) -> None:
        nonlocal before_hijack
        if event["attack"] == "late_rivals":  # the rivals stay in the DHT: rounds went on
            for log in logs:
                log.drain(quiet_s=0.5, max_s=2.0)
            assert min(log.latest_round() for log in logs) > before_late, "a late rival stalled a replica"
        if event["attack"] == "replayed_beats":  # the hijack starts now, for HIJACK_S
            for log in logs:
                log.drain(quiet_s=0.5, max_s=2.0)
            before_hijack = max(log.latest_round() for log in logs)

    results = adversary_results(attacker, 600, on_result)
    for name, result in results.items():
        assert "error" not in result, (name, result)
    assert results["sybil_heartbeats"]["stored"] >= 30 and results["sybil_heartbeats"]["config_hash"]
    assert results["replayed_beats"]["replayed"] >= 1
    assert results["hijacked_rounds"]["records_signed"] >= 3  # it had new heads to hijack
    assert results["late_rivals"]["records_signed"] >= 1, results["late_rivals"]  # it out-ranked some
    flood = results["record_flood"]  # item 4: the key's room is shared; the flood paid for it
    assert flood["stored"] >= flood["signed"] // 2 and flood["record_bytes"] > 4_000, flood
    # each DHT node keeps the flooder's share at most; a stock get merges the answers of
    # several nodes, which may keep slightly different records (one got a store another
    # missed): their union stays far below the 2.7 MB flooded (526 KB seen for a 512 KiB share)
    assert flood["read_own_bytes"] <= 2 * MAX_OWNER_BYTES and flood["read_bytes"] <= MAX_KEY_BYTES, flood
    for log in logs:
        log.drain(quiet_s=1.0, max_s=5.0)
    # during the hijack records, every peer went on applying honest rounds
    assert before_hijack is not None and min(log.latest_round() for log in logs) >= before_hijack + 3
    tables = [log.hashes() for log in logs]
    for key in set.intersection(*(set(t) for t in tables)):
        assert len({t[key] for t in tables}) == 1, key
    hijacked = {f"{r:032x}" for r in range(0, before_hijack + 10_000)}
    assert not any(h in hijacked or h.startswith("late") for t in tables for h in t.values())
    # the late rivals (still in the DHT) rewound nobody: each replica applies 3 more rounds
    # (by rank alone each dropped to a rival and waited for a state nobody has)
    wait_all(logs, applied(max(log.latest_round() for log in logs) + 3), ROUND_WAIT_S)
    for log in logs:
        assert all(len(hashes) == 1 for hashes in applied_hashes_by_round(log).values())
    closed = [e for log in logs for e in log.of("round_closed") if e["round"] > before_hijack]
    assert closed
    # only honest peers closed rounds (these are their own logs) and contributed to them
    contributors = set().union(*(e["contributors"] for e in closed))
    assert len(contributors) >= 2 and contributors <= set(honest)
    assert all(p.popen.poll() is None for p in peers)
    attacker.stop()
    for peer in peers:
        peer.request_stop(signal.SIGTERM)
    assert [peer.wait_exit(60) for peer in peers] == [0] * len(peers)


SKEWED = Path(__file__).resolve().parent / "skewed_peer.py"
MERGE_WAIT_ROUNDS = 18
"""Rounds after the step within which each skewed peer's delta must be merged by another
peer's window (one in three rounds is its own; a loaded machine makes deltas miss some)."""


def test_honest_peers_whose_clocks_step_30_s_either_way_still_see_and_are_seen(tmp_path) -> None:
    """Issue 28, item 3: a peer 8 s behind was invisible (its beats arrived expired) and
    one ahead saw nobody and elected itself. Two of three learners have their clocks step,
    one by +30 s and one by -30 s, once they have joined (each in its own process:
    tests/net/skewed_peer.py; hivemind refuses a join more than 3 s off): the run goes on with one chain, and each skewed
    peer's deltas are merged by the others' windows after the step."""
    boot = start_bootstrap()
    many = [join_args(initial=boot.maddrs, flags=["--max-rounds", "500"]) for _ in range(3)]
    for i in (1, 2):
        many[i] = [str(SKEWED), *many[i][2:]]  # "-m p2pdiloco join ..." -> "skewed_peer.py join ..."
    step_file = tmp_path / "step"
    envs = [None] + [
        {"P2PDILOCO_TEST_CLOCK_OFFSET_S": str(offset_s), "P2PDILOCO_TEST_CLOCK_STEP_FILE": str(step_file)}
        for offset_s in (-30.0, 30.0)
    ]
    peers = start_peer_processes(many, ready_timeout_s=240, envs=envs)
    logs = [Events(p) for p in peers]
    wait_all(logs, applied(1), ROUND_WAIT_S)
    step_file.touch()  # the two clocks step now, mid-run
    stepped_at = max(log.latest_round() for log in logs)

    def merged_by_others(me: int) -> bool:
        skewed = peers[me].peer_id
        return any(
            skewed in e["contributors"]
            for i, log in enumerate(logs) if i != me for e in log.of("round_closed") if e["round"] > stepped_at + 2
        )  # fmt: skip

    # about a third of the rounds are the skewed peer's own, and on a loaded machine a
    # delta may miss a window (folded into the next): wait for the merge, bounded
    for target in range(stepped_at + 6, stepped_at + 6 + MERGE_WAIT_ROUNDS, 3):
        wait_all(logs, applied(target), ROUND_WAIT_S)
        for log in logs:
            log.drain(quiet_s=1.0, max_s=5.0)
        if merged_by_others(1) and merged_by_others(2):
            break
    tables = [log.hashes() for log in logs]
    for key in set.intersection(*(set(t) for t in tables)):
        assert len({t[key] for t in tables}) == 1, key
    for me in (1, 2):
        assert merged_by_others(me), f"{peers[me].peer_id[-8:]} was never merged"
    assert all(p.popen.poll() is None for p in peers)
    for peer in peers:
        peer.request_stop(signal.SIGTERM)
    assert [peer.wait_exit(60) for peer in peers] == [0] * len(peers)
