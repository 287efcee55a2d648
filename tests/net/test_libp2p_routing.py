"""Routed records on real libp2p peers: separate processes on 127.0.0.1
(tests/net/libp2p_routing_peer.py; py-libp2p stays out of the pytest process).

k = 3 replicas among 6-9 peers, so that a record does not sit on every peer and a read
can only find it through the routing (the in-process tests in tests/test_libp2p_routing.py show
the same at a few hundred peers):

- a peer that knows only the bootstrap peer reads a record stored by a peer it never met,
  on replicas it never met; then with one replica frozen (SIGSTOP) and one killed, a read
  still answers within about one per-replica deadline, far under the get's;
- a record outlives its first replicas: its owner republishes it to peers that joined
  closer to its key, and it is read from them once the first ones are gone.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from net.harness import (
    PeerProcess,
    start_peer_process,
    start_peer_processes,
    write_identity,
)

pytestmark = pytest.mark.timeout(420)

PEER = Path(__file__).resolve().parent / "libp2p_routing_peer.py"
READY_S = 150
REPLICAS = 3
PER_REPLICA_S = 5.0
DHT_TIMEOUT_S = 60.0
WAIT_S = 120


def distance(key: str, peer_id: str) -> int:
    """The transport's metric (libp2p_peers.distance), not imported: it is the contract."""
    digest = lambda text: int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")  # noqa: E731
    return digest(key) ^ digest(peer_id)


def identities(tmp_path: Path, count: int) -> dict[str, Path]:
    """`count` identity files by peer id, written before any peer starts."""
    paths = {}
    for index in range(count):
        path = tmp_path / f"peer-{index}.key"
        paths[write_identity(path)] = path
    return paths


def args(path: Path, *initial: PeerProcess, extra: tuple[str, ...] = ()) -> list[str]:
    line = [str(PEER), "--identity", str(path), "--replicas", str(REPLICAS)]
    line += ["--per-replica-s", str(PER_REPLICA_S), "--dht-timeout", str(DHT_TIMEOUT_S)]
    for peer in initial:
        line += ["--initial-peer", peer.maddrs[0]]
    return line + list(extra)


def ask(peer: PeerProcess, op: str, **fields) -> dict:
    reply = peer.request({"op": op, **fields}, DHT_TIMEOUT_S + 60)
    assert reply.get("ok"), reply
    return reply


def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    """Poll `condition()` (a question to the peers) until true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.5)  # polling with a deadline


def knows_all(peer: PeerProcess, others: list[PeerProcess]) -> bool:
    return {o.peer_id for o in others} <= set(ask(peer, "known")["known"])


def test_a_newcomer_reads_through_the_routing_and_a_dead_replica_costs_one_deadline(tmp_path):
    keys = identities(tmp_path, 7)
    key = "run/round/7"
    # the replicas are the 3 closest to the key; the bootstrap, the writer and the reader
    # are none of them: only routing takes the record there and back
    order = sorted(keys, key=lambda p: distance(key, p))
    replica_ids, (bootstrap_id, writer_id, reader_id, other_id) = order[:REPLICAS], order[REPLICAS:]
    ids = [bootstrap_id, writer_id, other_id, *replica_ids]

    bootstrap = start_peer_process(args(keys[bootstrap_id]), READY_S)
    others = start_peer_processes([args(keys[p], bootstrap) for p in ids[1:]], READY_S)
    by_id = {p.peer_id: p for p in [bootstrap, *others]}
    writer = by_id[writer_id]
    wait_until(lambda: knows_all(bootstrap, others), "the bootstrap peer knows every peer")

    stored = ask(writer, "store", key=key, subkey="sync", value="the record", ttl_s=600)
    assert stored["stored"], stored
    assert all(
        ask(by_id[r], "held", key=key)["records"] == {"sync": "the record"} for r in replica_ids
    )
    assert ask(bootstrap, "held", key=key)["records"] == {}

    reader = start_peer_process(args(keys[reader_id], bootstrap, extra=("--no-gossip",)), READY_S)
    assert ask(reader, "known")["known"] == [bootstrap_id]  # it met nobody else
    found = ask(reader, "get", key=key)
    assert {s: v for s, (v, _) in found["records"].items()} == {"sync": "the record"}, found

    # one replica frozen (its sockets stay open: only a deadline ends a question to it),
    # one killed: the read answers from the third within about one per-replica deadline
    by_id[replica_ids[0]].suspend()
    by_id[replica_ids[1]].kill()
    found = ask(reader, "get", key=key)
    assert {s: v for s, (v, _) in found["records"].items()} == {"sync": "the record"}, found
    assert found["elapsed_s"] < PER_REPLICA_S + 15 < DHT_TIMEOUT_S / 2, found
    by_id[replica_ids[0]].resume()


def test_a_record_outlives_its_first_replicas_through_republish(tmp_path):
    keys = identities(tmp_path, 9)
    key = "run/round/42"
    # by distance to the key: three newcomers closest, then the first replicas, then the rest
    order = sorted(keys, key=lambda p: distance(key, p))
    newcomer_ids, first_ids, rest_ids = order[:3], order[3:6], order[6:]
    bootstrap_id, writer_id = rest_ids[:2]
    republish = ("--republish-s", "3")

    bootstrap = start_peer_process(args(keys[bootstrap_id], extra=republish), READY_S)
    early = start_peer_processes(
        [args(keys[p], bootstrap, extra=republish) for p in [writer_id, *first_ids]], READY_S
    )
    by_id = {p.peer_id: p for p in [bootstrap, *early]}
    wait_until(lambda: knows_all(bootstrap, early), "the bootstrap peer knows every peer")
    assert ask(by_id[writer_id], "store", key=key, subkey="sync", value="kept", ttl_s=900)["stored"]
    assert all(ask(by_id[p], "held", key=key)["records"] == {"sync": "kept"} for p in first_ids)

    late = start_peer_processes(
        [args(keys[p], bootstrap, extra=republish) for p in newcomer_ids], READY_S
    )
    # nothing but the owner's republish can put the record on them
    wait_until(
        lambda: all(ask(p, "held", key=key)["records"] == {"sync": "kept"} for p in late),
        "the record republished to the peers now closest to its key",
    )
    for peer_id in first_ids:
        by_id[peer_id].kill()
    reader = start_peer_process(args(keys[rest_ids[2]], bootstrap, extra=("--no-gossip",)), READY_S)
    found = ask(reader, "get", key=key)
    assert {s: v for s, (v, _) in found["records"].items()} == {"sync": "kept"}, found
