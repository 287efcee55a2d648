"""Peers behind a NAT router, in network namespaces: they find out by themselves that nobody
can dial them, learn as client-mode learners, keep the one global state, and rejoin; and
a public host reaches one of them through the relay circuit it announces.

The lab (`netns.NatLab`): a bootstrap node and two public learners on a public LAN, two
learners behind a router that masquerades their home network and drops connections
from outside. Every peer is a real `python -m p2pdiloco` process on the hivemind
transport inside its namespace; none is told it sits behind NAT. Skipped unless run as
root with `ip netns` working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from .netns import ROUTER_WAN_IP, Host, NatLab, launch_in, netns_problem
from .swarm_util import TINY_RUN, Events, applied, join_args, wait_all
from .test_swarm import assert_replicas_identical

pytestmark = pytest.mark.timeout(1200)

SETS = ["sync.min_quorum=2", "sync.num_fragments=1"]
READY_S = 240
ROUND_WAIT_S = 180
STATUS_S = 120
RELAY_WAIT_S = 720
"""How long a NAT'd peer may take to announce its relay slot: with one relay candidate
p2pd's autorelay reserves after its boot delay (3 minutes: it waits for more); if that
reservation fails, the peer renews its transport after `relay_slot.PATIENCE_S` (5 min)
and tries again."""
PROBE_S = 120
"""How long the probe tries the announced circuit address."""
RELAY_PROBE = Path(__file__).with_name("relay_probe.py")


@pytest.fixture
def lab():
    problem = netns_problem()
    if problem:
        pytest.skip(f"no network namespaces here: {problem}")
    with NatLab(num_public=3, num_private=2) as made:
        yield made
    assert not made.leftovers(), "the lab's namespaces were not all removed"


def start_learner(
    host: Host, initial: list[str], name: str, identity: Path | None = None
) -> Events:
    """A tiny learner listening on `host`'s address (port chosen by the system)."""
    flags = ["--host", host.ip, "--port", "0"]
    flags += ["--identity", str(identity)] if identity else []
    return Events(launch_in(host, join_args(initial=initial, sets=SETS, flags=flags), name))


def reachability(log: Events) -> dict:
    """The peer's one `reachability` event (printed before its readiness line)."""
    found = log.peer.of("reachability")
    assert len(found) == 1, (log.peer.name, found, log.peer.stderr_tail(2000))
    return found[0]


def merged_contribution(after_round: int = -1):
    """A match for a delta of this peer merged into a round after `after_round`."""
    return lambda e: (
        e.get("event") == "contributed" and e["status"] == "merged" and e["round"] > after_round
    )


def heartbeats_seen_from(host: Host, initial: list[str], peer_ids: set[str]) -> dict[str, dict]:
    """The heartbeats of `peer_ids`, read by `p2pdiloco status --json` from inside `host`
    (read again, a few times at most, while one is missing: on a loaded machine a beat
    may be late for a moment)."""
    args = ["-m", "p2pdiloco", "status", "--json", "--initial-peers", *initial]
    args += [arg for item in [*TINY_RUN, *SETS] for arg in ("--set", item)]
    deadline = time.monotonic() + STATUS_S
    while True:
        out = subprocess.run(
            host.argv([sys.executable, *args]), capture_output=True, text=True, timeout=STATUS_S
        )
        beats = {p["peer_id"]: p for p in json.loads(out.stdout or "{}").get("peers", [])}
        if peer_ids <= set(beats) or time.monotonic() > deadline:
            return beats


def cmdline(pid: int) -> list[str]:
    with suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return []


def p2pd_flags(log: Events) -> set[str]:
    """The command-line flags of the p2pd daemons of this peer's process group."""
    return {flag for pid in log.peer.p2pd_pids() for flag in cmdline(pid)}


def test_peers_behind_nat_become_client_learners_and_keep_one_state(lab, tmp_path) -> None:
    boot = launch_in(lab.public[0], ["-m", "p2pdiloco", "bootstrap", "--events",
                                     "--host", lab.public[0].ip, "--port", "0"], "boot")  # fmt: skip
    boot.wait_ready(READY_S)
    initial = boot.maddrs
    public = [start_learner(h, initial, f"public{i}") for i, h in enumerate(lab.public[1:])]
    keys = [tmp_path / f"nat{i}.key" for i in range(2)]
    nat = [start_learner(h, initial, f"nat{i}", keys[i]) for i, h in enumerate(lab.private)]
    for log in public + nat:
        log.peer.wait_ready(READY_S)

    # 1. each found out by itself: the bootstrap saw the NAT'd ones call from the router
    for log in public:
        event = reachability(log)
        assert event["reachable"] and not event["client_mode"], event
    for log in nat:
        event = reachability(log)
        assert not event["reachable"] and event["client_mode"], event
        assert ROUTER_WAN_IP in event["reason"] and "NAT" in event["reason"], event
        assert "client-mode learner" in Path(log.peer.stderr_path).read_text()

    # 2. they contribute, and every replica applies the same rounds
    for log in nat:
        log.wait(merged_contribution(), ROUND_WAIT_S)
    wait_all(public + nat, applied(2), ROUND_WAIT_S)
    assert_replicas_identical(public + nat, min_common=2)

    # 3. their heartbeats say client mode: never elected, never a holder
    nat_ids = {log.peer.peer_id for log in nat}
    beats = heartbeats_seen_from(lab.public[1], initial, {log.peer.peer_id for log in public + nat})
    assert all(beats[p]["client_mode"] and not beats[p]["maddrs"] for p in nat_ids), beats
    assert not any(beats[log.peer.peer_id]["client_mode"] for log in public)
    # their daemons run as DHT clients that take a relay slot at once (our dial-back said
    # private); the public ones serve; the bootstrap node relays (known public)
    for log in nat:
        flags = p2pd_flags(log)
        assert {"-dhtClient=1", "-relay=1", "-autoRelay=1", "-forceReachabilityPrivate=1"} <= flags
        assert f"-trustedRelays={initial[0]}" in flags, flags  # the bootstrap node first
    for log in public:
        assert {"-dhtServer=1", "-relay=1", "-autoRelay=0"} <= p2pd_flags(log)
    assert "-forceReachabilityPublic=1" in {f for pid in boot.p2pd_pids() for f in cmdline(pid)}
    for log in nat:
        assert not log.of("round_closed"), "a peer behind NAT synchronized a round"
    for log in public:
        for closed in log.of("round_closed"):
            assert not nat_ids & set(closed["holders"]), closed

    # 4. one dies; started again (same identity), it finds the NAT again and contributes
    last = max(r for (_f, r) in public[0].hashes())
    nat[0].peer.kill()
    again = start_learner(lab.private[0], initial, "nat0-again", keys[0])
    again.peer.wait_ready(READY_S)
    assert again.peer.peer_id == nat[0].peer.peer_id
    assert reachability(again)["client_mode"]
    again.wait(merged_contribution(after_round=last), ROUND_WAIT_S)
    survivors = [*public, nat[1], again]
    top = max(r for (_f, r) in again.hashes())
    wait_all(survivors, applied(top), ROUND_WAIT_S)
    assert_replicas_identical(survivors, min_common=1)
    assert_replicas_identical([*public, nat[0]], min_common=2)  # its life before the kill

    # 5. a public host reaches a NAT'd peer through the relay it announced, and only so (the
    # router drops what comes in; the probe dials the circuit address alone). Its relays
    # are public peers: the bootstrap node (at once) or a public learner (once AutoNAT
    # calls it public).
    slot = nat[1].wait(lambda e: e.get("event") == "relay_slot", RELAY_WAIT_S)
    print(f"relay slot after {slot.get('waited_s')} s: {slot['addresses']}")  # for docs/join.md
    relay = slot["addresses"][0].split("/p2p-circuit")[0]
    public_ids = {boot.peer_id} | {log.peer.peer_id for log in public}
    assert relay.rsplit("/p2p/", 1)[1] in public_ids, slot
    probe = subprocess.run(
        lab.public[1].argv([sys.executable, str(RELAY_PROBE), lab.public[1].ip, relay, nat[1].peer.peer_id, str(PROBE_S)]),
        capture_output=True, text=True, timeout=PROBE_S + 60,
    )  # fmt: skip
    lines = probe.stdout.strip().splitlines()
    assert lines, probe.stderr[-2000:]
    reached = json.loads(lines[-1])
    assert reached["reached"], reached
