"""Both real transports (hivemind, libp2p) between real OS processes on 127.0.0.1.

Every test runs once per transport. The transports are imported only in the children
(tests/net/transport_peer.py): hivemind and py-libp2p cannot share a process.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from .harness import (
    TRANSPORT_PEER,
    PeerFailedToStart,
    PeerProcess,
    free_port,
    pid_alive,
    start_peer_process,
    start_peer_processes,
    write_identity,
)

pytestmark = pytest.mark.timeout(240)

TRANSPORTS = ["hivemind", "libp2p"]

READY_S = 120
MB = 1_000_000


@pytest.fixture(params=TRANSPORTS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def peer_args(kind: str, *initial: PeerProcess, extra: tuple[str, ...] = ()) -> list[str]:
    args = [str(TRANSPORT_PEER), "--transport", kind]
    for peer in initial:
        args += ["--initial-peer", peer.maddrs[0]]
    return args + list(extra)


def call(caller: PeerProcess, callee: PeerProcess, name: str, num_bytes: int, **options) -> dict:
    timeout_s = options.pop("timeout_s", 60)
    command = {"op": "call", "peer": callee.peer_id, "name": name, "num_bytes": num_bytes}
    return caller.request({**command, "timeout_s": timeout_s, **options}, timeout_s + 30)


def test_call_moves_20mb_byte_exactly_and_refuses_oversize_requests(kind):
    first = start_peer_process(peer_args(kind, extra=("--max-request-bytes", str(30 * MB))), READY_S)
    second, third = start_peer_processes([peer_args(kind, first), peer_args(kind, first)], READY_S)

    sized = call(second, first, "size", 20 * MB, seed=7)
    assert sized["ok"], sized
    assert json.loads(sized["response"]) == {
        "num_bytes": 20 * MB,
        "sha256": sized["request_sha256"],
        "caller": second.peer_id,
    }
    echoed = call(third, second, "echo", 20 * MB, seed=8)
    assert echoed["ok"] and echoed["echo_matches"] and echoed["num_bytes"] == 20 * MB, echoed

    refused = call(third, first, "echo", 40 * MB)
    assert not refused["ok"] and refused["error"] == "RequestTooLarge", refused
    too_big = call(third, first, "echo", 2 * MB, max_response_bytes=MB)
    assert not too_big["ok"] and too_big["error"] == "ResponseTooLarge", too_big
    missing = call(third, first, "no-such-handler", 10)
    assert not missing["ok"] and missing["error"] == "RemoteError", missing

    still_serving = call(third, first, "echo", MB)
    assert still_serving["ok"] and still_serving["echo_matches"], still_serving
    assert first.alive()


def test_calls_to_killed_or_frozen_peers_fail_within_their_timeout(kind):
    first = start_peer_process(peer_args(kind), READY_S)
    doomed, frozen = start_peer_processes([peer_args(kind, first), peer_args(kind, first)], READY_S)
    warm = call(first, doomed, "echo", 1000)
    assert warm["ok"], warm
    assert call(first, frozen, "echo", 1000)["ok"]

    doomed.kill()
    frozen.suspend()
    command = {"op": "call", "name": "echo", "num_bytes": MB, "timeout_s": 10}
    first.send({**command, "peer": doomed.peer_id, "id": "doomed"})  # both calls at once
    first.send({**command, "peer": frozen.peer_id, "id": "frozen"})
    for target in ("doomed", "frozen"):
        failed = first.next_event(40, lambda event, target=target: event.get("id") == target)
        assert not failed["ok"], failed
        # killed: the connection is reset, PeerUnreachable at once; frozen: CallTimeout
        assert failed["error"] in {"PeerUnreachable", "CallTimeout"}, failed
        assert failed["elapsed_s"] < 10 + 3, failed
    frozen.resume()
    assert call(first, frozen, "echo", 1000, timeout_s=30)["ok"], "a resumed peer serves again"


def wait_for_records(peer: PeerProcess, key: str, done, timeout_s: float = 60) -> dict:
    """Poll `get(key)` on `peer` until `done(records)` (polling with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = peer.request({"op": "get", "key": key}, 60)["records"]
        if done(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def test_dht_records_with_subkeys_cross_processes_and_expire(kind):
    first = start_peer_process(peer_args(kind), READY_S)
    second = start_peer_process(peer_args(kind, first), READY_S)
    put = {"op": "store", "key": "members"}
    assert first.request({**put, "subkey": "a", "value": "alpha", "ttl_s": 120}, 60)["stored"]
    assert second.request({**put, "subkey": "b", "value": "beta", "ttl_s": 4}, 60)["stored"]

    records = wait_for_records(first, "members", lambda r: {"a", "b"} <= r.keys())
    assert records["a"][0] == "alpha" and records["b"][0] == "beta", records
    records = wait_for_records(second, "members", lambda r: "b" not in r)
    assert set(records) == {"a"}, f"the 4 s record should have expired: {records}"


def test_four_peers_started_at_the_same_instant_form_one_swarm(kind, tmp_path):
    # The first peer's address is known in advance (identity + port), so all four launch
    # at once and the others may dial it before it listens: they must not start alone.
    seed_id = write_identity(tmp_path / "seed.key")
    port = free_port()
    seed = ["--identity", str(tmp_path / "seed.key"), "--port", str(port)]
    joiner = ["--initial-peer", f"/ip4/127.0.0.1/tcp/{port}/p2p/{seed_id}"]
    peers = start_peer_processes(
        [[str(TRANSPORT_PEER), "--transport", kind, *seed]]
        + [[str(TRANSPORT_PEER), "--transport", kind, *joiner]] * 3, READY_S
    )
    assert peers[0].peer_id == seed_id
    for peer in peers:
        put = {"op": "store", "key": "swarm", "subkey": peer.peer_id, "value": "hi"}
        assert peer.request({**put, "ttl_s": 120}, 60)["stored"]
    everyone = {peer.peer_id for peer in peers}
    for peer in peers:
        records = wait_for_records(peer, "swarm", lambda r: everyone <= r.keys())
        assert set(records) == everyone, f"{peer.name} sees only {sorted(records)}"


def test_identity_persists_and_shutdown_leaves_no_daemon(kind, tmp_path):
    identity = tmp_path / "peer.key"
    peer = start_peer_process(peer_args(kind, extra=("--identity", str(identity))), READY_S)
    first_id = peer.peer_id
    daemons = peer.p2pd_pids()
    assert identity.is_file() and len(daemons) == (1 if kind == "hivemind" else 0)
    assert peer.stop(timeout_s=60) == 0
    assert not any(pid_alive(pid) for pid in daemons), "p2pd outlived its peer"
    assert peer.group_pids() == []

    again = start_peer_process(peer_args(kind, extra=("--identity", str(identity))), READY_S)
    assert again.peer_id == first_id
    again.send({"op": "shutdown"})
    assert again.next_event(60, lambda e: e.get("event") == "shutdown")["peer_id"] == first_id


def test_port_in_use_is_a_clear_address_in_use_error(kind):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(PeerFailedToStart) as failure:
            start_peer_process(peer_args(kind, extra=("--port", str(port))), READY_S)
    assert failure.value.report["error"] == "AddressInUse"
    assert str(port) in failure.value.report["message"]


def test_a_peer_killed_alone_takes_its_dht_process_and_daemon_with_it(kind):
    if kind == "libp2p":
        pytest.skip("one process per peer: no DHT process or daemon to outlive it")
    peer = start_peer_process(peer_args(kind), READY_S)
    spawned = [pid for pid in peer.group_pids() if pid != peer.pid]
    assert peer.p2pd_pids() and len(spawned) >= 2, "a DHT process and a p2pd"
    peer.kill(group=False)
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in spawned) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling with a deadline
    assert not any(pid_alive(pid) for pid in spawned), "orphans outlived their peer"


def test_one_key_file_is_one_peer_id_on_both_transports(tmp_path):
    identity = tmp_path / "peer.key"
    ids = []
    for kind in TRANSPORTS:
        peer = start_peer_process(peer_args(kind, extra=("--identity", str(identity))), READY_S)
        ids.append(peer.peer_id)
        assert peer.stop(timeout_s=60) == 0
    assert ids[0] == ids[1]


@pytest.mark.parametrize("seed_kind,joiner_kind", [("hivemind", "libp2p"), ("libp2p", "hivemind")])
def test_a_peer_of_the_other_transport_cannot_join_and_says_so(seed_kind, joiner_kind):
    seed = start_peer_process(peer_args(seed_kind), READY_S)
    args = peer_args(joiner_kind, seed, extra=("--startup-timeout", "20"))
    with pytest.raises(PeerFailedToStart) as failure:
        start_peer_process(args, READY_S)
    report = failure.value.report
    assert report["error"] == "TransportStartError", report
    assert "network.transport" in report["message"], report
    assert seed.alive()


def test_a_client_mode_peer_calls_and_uses_the_records_without_listening(kind):
    first = start_peer_process(peer_args(kind), READY_S)
    client = start_peer_process(peer_args(kind, first, extra=("--client-mode",)), READY_S)
    if kind == "libp2p":
        assert client.maddrs == [], "a client-mode peer has no listening address"
    echoed = call(client, first, "echo", MB, seed=3)
    assert echoed["ok"] and echoed["echo_matches"], echoed
    put = {"op": "store", "key": "members", "subkey": "c", "value": "from-client", "ttl_s": 120}
    assert client.request(put, 60)["stored"]
    records = wait_for_records(first, "members", lambda r: "c" in r)
    assert records["c"][0] == "from-client", records
    assert wait_for_records(client, "members", lambda r: "c" in r)["c"][0] == "from-client"
