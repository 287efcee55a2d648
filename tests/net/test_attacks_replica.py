"""A stale donor cannot roll a joiner back (issue 28, item 8), with real peer processes.

A 3-learner open run trains. A stranger (tests/net/adversary.py `stale_donor`, with its own
fresh identity) downloads a real, valid state from an honest peer, then beats as a learner
at the chain's head and serves that state, now old, to every `get_state`. Once the run has
moved on past a replay's reach, a fourth learner joins with an empty state, with an
identity for which the attacker is the first donor it tries. It reaches the head from an
honest donor: it never installs the stale state, its hashes agree with the others', the
attacker did serve it a first part and it was refused as stale, and no honest peer
crashed. Before the fix the joiner took the first canonical state it got, most advanced
claim first: the attacker's.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2pdiloco.identity import Identity, save_identity
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.roles.download import MAX_DONOR_LAG_ROUNDS, StateDownload
from p2pdiloco.roles.replica import MAX_CATCH_UP_ROUNDS

from .harness import start_peer_process
from .swarm_util import (
    Events,
    applied,
    join_args,
    launch_adversary,
    start_bootstrap,
    start_learners,
    wait_all,
)

pytestmark = pytest.mark.timeout(1500)

ROUND_WAIT_S = 300


def joiner_identity(path: Path, attacker: str, honest: list[str], head: int) -> str:
    """Write, to `path`, a fresh identity whose download of fragment 0 tries `attacker`
    first (as `StateDownload.donors` orders donors that all claim the head); its peer id.
    One key in four or so: the donor order is spread per downloader."""
    beats = {
        p: Heartbeat(peer_id=p, status="training", rounds=(head,)) for p in [*honest, attacker]
    }
    while True:
        identity = Identity.generate()
        me = SimpleNamespace(
            transport=SimpleNamespace(peer_id=identity.peer_id), members=lambda: beats
        )
        if StateDownload.donors(me, 0, head)[0] == attacker:
            save_identity(identity, path)
            return identity.peer_id


def wait_attacker(attacker, key: str, timeout_s: float) -> dict:
    """The attacker's next output line carrying `key` (progress lines are skipped)."""
    return attacker.next_event(timeout_s, lambda e: key in e)


def test_a_stale_donor_at_the_claimed_head_does_not_roll_a_joiner_back(tmp_path: Path) -> None:
    boot = start_bootstrap()
    sets = ["sync.min_quorum=2"]
    peers = start_learners(3, boot.maddrs, sets=sets, flags=["--max-rounds", "500"])
    logs = [Events(p) for p in peers]
    honest = sorted(p.peer_id for p in peers)
    wait_all(logs, applied(1), ROUND_WAIT_S)

    stop_file = tmp_path / "stop"
    attacker = launch_adversary(
        boot, honest, "stale_donor", env={"STALE_DONOR_S": "1200", "STALE_DONOR_STOP_FILE": str(stop_file)}
    )
    attacker.wait_ready(180)
    captured = wait_attacker(attacker, "stale_donor_captured", ROUND_WAIT_S)
    stale_round = int(captured["rounds"]["0"])
    stale_hash = captured["hashes"]["0"]

    # the run moves on: the captured state is two rounds behind the head or more, and the
    # head is further than a replay reaches (the joiner must download)
    wait_all(logs, applied(max(stale_round + 2, MAX_CATCH_UP_ROUNDS + 2)), ROUND_WAIT_S)
    for log in logs:
        log.drain(quiet_s=0.5, max_s=3.0)
    head_at_join = max(log.latest_round() for log in logs) + 1  # a state's round: after head - 1
    assert head_at_join - MAX_DONOR_LAG_ROUNDS > stale_round
    identity_path = tmp_path / "joiner.key"
    joiner_id = joiner_identity(identity_path, attacker.peer_id, honest, head_at_join)
    joiner = Events(
        start_peer_process(
            join_args(initial=boot.maddrs, sets=sets, flags=["--identity", str(identity_path)]),
            ready_timeout_s=240,
        )
    )
    assert joiner.peer.peer_id == joiner_id

    download = joiner.wait(
        lambda e: e.get("event") == "downloaded" and e["fragment"] == 0, ROUND_WAIT_S
    )
    joiner.wait(applied(download["round"] + 1), ROUND_WAIT_S)
    wait_all(logs, applied(download["round"] + 1), ROUND_WAIT_S)
    stop_file.touch()
    result = wait_attacker(attacker, "attack", 120)
    for log in [*logs, joiner]:
        log.drain(quiet_s=1.0, max_s=5.0)

    # the attacker was tried by the joiner (first) and served it its old state's first part
    assert "error" not in result, result
    assert joiner_id in result["callers"], result
    assert result["claimed"]["0"] >= head_at_join, result
    refusals = Path(joiner.peer.stderr_path).read_text(errors="replace")
    assert f"donor={attacker.peer_id[-8:]} refused" in refusals and "is stale" in refusals, (
        refusals[-3000:]
    )
    # the joiner never installed the stale state: every download is at the head it found
    for event in joiner.of("downloaded"):
        assert event["donor"] != attacker.peer_id and event["hash"] != stale_hash, event
        assert event["round"] >= head_at_join - MAX_DONOR_LAG_ROUNDS, (
            event,
            head_at_join,
            stale_round,
        )
    # ... and it is the honest state: the hash the others applied there, and the same
    # hashes since, on every replica
    tables = [log.hashes() for log in [*logs, joiner]]
    installed_at = (0, download["round"] - 1)
    assert {t[installed_at] for t in tables[:-1] if installed_at in t} == {download["hash"]}
    for key in set.intersection(*(set(t) for t in tables)):
        assert len({t[key] for t in tables}) == 1, key
    assert any(key in tables[-1] for key in set.intersection(*(set(t) for t in tables[:-1])))
    # nobody crashed
    assert all(p.popen.poll() is None for p in [*peers, joiner.peer])
    attacker.stop()
    for peer in [*peers, joiner.peer]:
        peer.request_stop(signal.SIGTERM)
    assert [peer.wait_exit(60) for peer in [*peers, joiner.peer]] == [0] * (len(peers) + 1)
