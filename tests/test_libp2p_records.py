"""The libp2p transport's one-hop record store and peer list against lying, silent and
unreachable replicas (issue 28, item 9), in process: fake calls on trio's mock clock.

- a replica's answer is checked with the run's rules before it is merged, so junk with a
  far expiration does not hide an honest record;
- a get or store answers with what arrived: a silent replica costs a few seconds, never
  the whole answer;
- a peer that failed is quarantined and, once it calls again, counts only after a probe.
"""

from __future__ import annotations

import msgpack
import trio
import trio.testing

from p2pdiloco.identity import Identity
from p2pdiloco.transport.base import PeerUnreachable
from p2pdiloco.transport.libp2p_peers import MAX_FAILURES, QUARANTINE_S, Known, SwarmPeers
from p2pdiloco.transport.libp2p_records import RECORDS_GET, RECORDS_STORE, RecordStore
from p2pdiloco.transport.records import MAX_OWNER_BYTES

TIMEOUT_S = 30.0
NOW = 1000.0


class JunkRules:
    """The run's rules, reduced: a value b"junk" is refused."""

    def check(self, key: str, subkey: str, value: bytes, expiration: float, now: float) -> str | None:
        return "junk signature" if value == b"junk" else None


def make_store(behaviours: dict[str, str]) -> RecordStore:
    """A store that knows one replica per entry of `behaviours` (honest, liar, silent)."""

    async def call(peer: str, name: str, request: bytes, max_response: int) -> bytes:
        behaviour = behaviours[peer]
        if behaviour == "silent":
            await trio.sleep_forever()
        if name == RECORDS_STORE:
            return b"\x01"
        assert name == RECORDS_GET
        if behaviour == "liar":
            return msgpack.packb({"hb": [b"junk", NOW + 1e6]})
        return msgpack.packb({"hb": [b"honest", NOW + 60], "other": [b"o", NOW + 30]})

    peers = SwarmPeers([], call, TIMEOUT_S)
    peers.me = "me"
    peers.known = {peer: Known([]) for peer in behaviours}
    return RecordStore(peers, call, True, JunkRules(), TIMEOUT_S, lambda: NOW)


def run_timed(fn, *args):
    """(result, seconds on the mock clock) of `await fn(*args)`."""

    async def main():
        started = trio.current_time()
        result = await fn(*args)
        return result, trio.current_time() - started

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_replica_answering_junk_with_a_far_expiration_does_not_hide_the_honest_record() -> None:
    store = make_store({"honest-1": "honest", "liar": "liar", "honest-2": "honest"})
    found, _ = run_timed(store.get, "key")
    assert found == {"hb": (b"honest", NOW + 60), "other": (b"o", NOW + 30)}


def test_one_silent_replica_costs_a_few_seconds_not_the_answer() -> None:
    store = make_store({"a": "honest", "b": "honest", "c": "silent"})
    found, took_s = run_timed(store.get, "key")
    assert found["hb"] == (b"honest", NOW + 60)
    assert took_s < TIMEOUT_S / 2  # settled after most answered, not at the deadline

    stored, took_s = run_timed(store.store, "key", "s", b"v", NOW + 10)
    assert stored and took_s < TIMEOUT_S / 2


def test_with_most_replicas_silent_a_get_answers_what_arrived_by_its_deadline() -> None:
    store = make_store({"a": "honest", "b": "silent", "c": "silent", "d": "silent"})
    found, took_s = run_timed(store.get, "key")
    assert found["hb"] == (b"honest", NOW + 60)
    assert took_s <= TIMEOUT_S + 1e-6


def test_every_replica_answering_at_once_costs_no_wait() -> None:
    store = make_store({"a": "honest", "b": "honest"})
    found, took_s = run_timed(store.get, "key")
    assert found["hb"][0] == b"honest" and took_s == 0


# ---- peers --------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_unreachable_peer_is_not_learned_again_without_a_probe() -> None:
    unreachable = Identity.generate().peer_id
    maddrs = [f"/ip4/10.9.9.9/tcp/4001/p2p/{unreachable}"]
    probes: list[str] = []

    async def call(peer: str, name: str, request: bytes, max_response: int) -> bytes:
        probes.append(peer)
        raise PeerUnreachable(f"cannot dial {peer}")

    clock = FakeClock()
    peers = SwarmPeers([], call, TIMEOUT_S, clock=clock)
    peers.me = Identity.generate().peer_id

    async def main() -> None:
        # it calls us announcing an address nobody can dial: learned (it called us)
        await peers.serve_peers(unreachable, msgpack.packb(maddrs))
        assert unreachable in peers.known
        for _ in range(MAX_FAILURES):
            await peers.refresh_once()
        assert unreachable not in peers.known  # forgotten: it kept failing
        # it calls again at once: quarantined, not learned
        await peers.serve_peers(unreachable, msgpack.packb(maddrs))
        assert unreachable not in peers.known and unreachable not in peers.candidates
        # after the quarantine it is a candidate, and the probe decides
        clock.now += QUARANTINE_S + 1
        await peers.serve_peers(unreachable, msgpack.packb(maddrs))
        assert unreachable not in peers.known and unreachable in peers.candidates
        probes.clear()
        await peers.refresh_once()
        assert probes == [unreachable]
        assert unreachable not in peers.known and unreachable not in peers.candidates
        # a second failure doubles the quarantine
        clock.now += QUARANTINE_S + 1
        await peers.serve_peers(unreachable, msgpack.packb(maddrs))
        assert unreachable not in peers.candidates

    trio.run(main)


def test_a_peer_that_failed_counts_again_once_its_probe_answers() -> None:
    flaky = Identity.generate().peer_id
    maddrs = [f"/ip4/127.0.0.1/tcp/4001/p2p/{flaky}"]
    reachable = False

    async def call(peer: str, name: str, request: bytes, max_response: int) -> bytes:
        if not reachable:
            raise PeerUnreachable("down")
        return msgpack.packb([])

    clock = FakeClock()
    peers = SwarmPeers([], call, TIMEOUT_S, clock=clock)
    peers.me = Identity.generate().peer_id

    async def main() -> None:
        nonlocal reachable
        await peers.serve_peers(flaky, msgpack.packb(maddrs))
        for _ in range(MAX_FAILURES):
            await peers.refresh_once()
        assert flaky not in peers.known
        reachable = True
        clock.now += QUARANTINE_S + 1
        await peers.serve_peers(flaky, msgpack.packb(maddrs))
        await peers.refresh_once()
        assert flaky in peers.known

    trio.run(main)


def test_a_replica_answering_megabytes_from_one_owner_costs_the_checks_of_its_share_only() -> None:
    """A stranger's replica answers 600 records of 5 KiB, all one owner's (subkeys
    `<round>/<owner>`, 3 MB): each is checked by the rules (a signature check in a run)
    only within the share a table would keep for that owner, not all 600."""
    checked: list[str] = []

    class CountingRules:
        def check(self, key: str, subkey: str, value: bytes, expiration: float, now: float) -> str | None:
            checked.append(subkey)
            return None

    flood = {f"{n}/flooder": [bytes(5 * 1024), NOW + 60 + n] for n in range(600)}

    async def call(peer: str, name: str, request: bytes, max_response: int) -> bytes:
        return msgpack.packb(flood)

    peers = SwarmPeers([], call, TIMEOUT_S)
    peers.me = "me"
    peers.known = {"stranger": Known([])}
    store = RecordStore(peers, call, True, CountingRules(), TIMEOUT_S, lambda: NOW)
    found, _ = run_timed(store.get, "key")
    share = MAX_OWNER_BYTES // (5 * 1024)
    assert 0 < len(found) <= share
    assert len(checked) <= share < len(flood) // 4
