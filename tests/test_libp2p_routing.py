"""The libp2p transport's routed records in one process: a few hundred `RecordStore`s
and their routing tables (`SwarmPeers`), joined one by one through a bootstrap peer as
real peers join, talking through fake calls on trio's mock clock (no py-libp2p import:
the real-network tests are in tests/net/test_libp2p_routing.py).

- a lookup finds the true closest peers of a key while each peer knows O(log N) others;
- a peer that knows only the bootstrap reads a record stored by a peer it never met;
- a silent replica costs one per-replica deadline, never the whole get;
- records move to the peers closest to their keys now when their owner republishes;
- lying answers (junk, fake ids close to the key) do not derail a lookup.
"""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pdiloco.identity import Identity
from p2pdiloco.transport import libp2p_records
from p2pdiloco.transport.base import PeerUnreachable, RemoteError
from p2pdiloco.transport.libp2p_peers import (
    BUCKET_SIZE,
    MAX_FAILURES,
    RECORDS_PEERS,
    Known,
    SwarmPeers,
    bucket_of,
    distance,
)
from p2pdiloco.transport.libp2p_records import RECORDS_GET, REPUBLISH_S, RecordStore
from p2pdiloco.transport.libp2p_routing import MAX_QUERIES

TIMEOUT_S = 30.0
EPOCH = 1000.0


def ids(count: int, seed: int) -> list[str]:
    """`count` real peer ids, the same for the same `seed` (Ed25519 keys from its bytes)."""
    rng = random.Random(seed)
    return [
        Identity.from_key(Ed25519PrivateKey.from_private_bytes(rng.randbytes(32))).peer_id
        for _ in range(count)
    ]


class Swarm:
    """Peers in one process: `call` dispatches to the callee's handlers as the transport
    would (a handler's exception arrives as RemoteError) if the caller dials the callee's
    real address; dead peers refuse, frozen ones never answer."""

    def __init__(self) -> None:
        self.stores: dict[str, RecordStore] = {}
        self.handlers: dict[str, dict] = {}
        self.dead: set[str] = set()
        self.frozen: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.liars: dict[str, list] = {}
        """Peers that answer every lookup naming these items."""

    @staticmethod
    def maddr(peer_id: str, index: int) -> str:
        return f"/ip4/10.{index // 250}.{index % 250}.1/tcp/4001/p2p/{peer_id}"

    def add(self, peer_id: str, initial: list[str], client_mode: bool = False) -> RecordStore:
        async def call(peer: str, name: str, request: bytes, max_response: int) -> bytes:
            self.calls[peer_id] += 1
            if peer in self.dead or peer not in self.handlers:
                raise PeerUnreachable(f"cannot dial {peer}")
            dialled = self.stores[peer_id].peers.addresses_of(peer) or []
            if self.stores[peer].peers.maddrs[0].rpartition("/p2p/")[0] not in dialled:
                raise PeerUnreachable(f"nobody answers as {peer} at {dialled}")
            if peer in self.frozen:
                await trio.sleep_forever()
            if peer in self.liars and name == RECORDS_GET:
                return msgpack.packb([{}, self.liars[peer]])
            try:
                return await self.handlers[peer][name](peer_id, request)
            except Exception as exc:  # noqa: BLE001 - as the framing reports it
                raise RemoteError(f"{type(exc).__name__}: {exc}") from None

        peers = SwarmPeers(initial, call, TIMEOUT_S)
        peers.me = peer_id
        peers.maddrs = [] if client_mode else [self.maddr(peer_id, len(self.stores))]
        store = RecordStore(peers, call, client_mode, None, TIMEOUT_S, now)
        self.stores[peer_id] = store
        if not client_mode:
            self.handlers[peer_id] = {**store.handlers(), RECORDS_PEERS: peers.serve_peers}
        return store

    async def join(self, peer_id: str, client_mode: bool = False) -> RecordStore:
        """Start a peer as the transport does: bootstrap from the first peer, then look up
        its own id."""
        first = next(iter(self.stores), None)
        initial = [] if first is None else self.stores[first].peers.maddrs
        store = self.add(peer_id, initial, client_mode)
        await store.peers.bootstrap()
        await store.lookup(peer_id)
        return store

    def known_as(self, peer_id: str) -> Known:
        """A routing-table entry for `peer_id` (its address without `/p2p/`)."""
        return Known([self.stores[peer_id].peers.maddrs[0].rpartition("/p2p/")[0]])

    def true_closest(self, key: str, count: int) -> list[str]:
        live = [p for p in self.handlers if p not in self.dead and p not in self.frozen]
        return sorted(live, key=lambda p: distance(key, p))[:count]


def now() -> float:
    return EPOCH + trio.current_time()


def run(main):
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def joined_swarm(count: int) -> Swarm:
    swarm = Swarm()
    for peer_id in ids(count, count):
        await swarm.join(peer_id)
    return swarm


# ---- the routing table --------------------------------------------------------------


def test_a_bucket_keeps_at_most_bucket_size_peers_and_the_table_stays_small() -> None:
    (me,) = ids(1, 11)
    peers = SwarmPeers([], None, TIMEOUT_S)  # type: ignore[arg-type]
    peers.me = me
    for index, other in enumerate(ids(400, 1)):
        peers.learn(other, [Swarm.maddr(other, index)])
    per_bucket = Counter(bucket_of(me, p) for p in peers.known)
    assert max(per_bucket.values()) == BUCKET_SIZE
    # half of all ids fall in bucket 0, a quarter in bucket 1...: a few buckets fill up
    assert len(peers.known) < 120 and per_bucket[0] == BUCKET_SIZE


# ---- lookups -----------------------------------------------------------------------


def test_lookups_find_the_true_closest_peers_with_tables_of_log_n_peers() -> None:
    count = 256

    async def main() -> None:
        swarm = await joined_swarm(count)
        sizes = [len(s.peers.known) for s in swarm.stores.values()]
        # each peer knows O(log N): far fewer than all (bucket 0 alone would hold 128)
        assert max(sizes) < count // 2, sizes
        rng = random.Random(5)
        for trial in range(20):
            key = f"run/round/{trial}"
            asker = swarm.stores[rng.choice(list(swarm.stores))]
            asked_before = swarm.calls[asker.peers.me]
            found = await asker.lookup(key)
            asked = swarm.calls[asker.peers.me] - asked_before
            assert found == swarm.true_closest(key, libp2p_records.REPLICAS), trial
            assert asked <= 3 * libp2p_records.REPLICAS, (trial, asked)

    run(main)


def test_a_peer_that_knows_only_the_bootstrap_reads_a_record_of_a_peer_it_never_met() -> None:
    async def main() -> None:
        swarm = await joined_swarm(100)
        bootstrap, writer = list(swarm.stores)[0], list(swarm.stores)[-1]
        key = next(
            k
            for k in (f"key-{i}" for i in range(1000))
            if bootstrap not in swarm.true_closest(k, libp2p_records.REPLICAS)
            and writer not in swarm.true_closest(k, libp2p_records.REPLICAS)
        )
        assert await swarm.stores[writer].store(key, "w", b"value", EPOCH + 3600)
        holders = [p for p, s in swarm.stores.items() if s.table.get(key, now())]
        assert sorted(holders) == sorted(swarm.true_closest(key, libp2p_records.REPLICAS))

        (newcomer,) = ids(1, 2)
        reader = swarm.add(newcomer, [])
        reader.peers.known = {bootstrap: swarm.known_as(bootstrap)}
        found = await reader.get(key)
        assert found == {"w": (b"value", EPOCH + 3600)}
        assert writer not in reader.peers.known and writer not in reader.peers.heard

    run(main)


def test_a_silent_replica_costs_one_per_replica_deadline_not_the_get() -> None:
    async def main() -> None:
        swarm = await joined_swarm(96)
        writer, reader = list(swarm.stores)[1], list(swarm.stores)[2]
        key = "run/members"
        assert await swarm.stores[writer].store(key, "w", b"beat", EPOCH + 600)
        replicas = swarm.true_closest(key, libp2p_records.REPLICAS)
        swarm.frozen.update(p for p in replicas[:3] if p not in (writer, reader))
        store = swarm.stores[reader]
        started = trio.current_time()
        found = await store.get(key)
        took_s = trio.current_time() - started
        assert found == {"w": (b"beat", EPOCH + 600)}
        assert store.per_replica_s <= took_s <= store.per_replica_s + 1e-6  # in parallel
        assert took_s < TIMEOUT_S / 4

    run(main)


def test_a_dead_known_peer_is_forgotten_after_failing_lookups() -> None:
    async def main() -> None:
        swarm = await joined_swarm(48)
        asker = swarm.stores[list(swarm.stores)[0]]
        victim = next(p for p in asker.peers.known if p != asker.peers.me)
        swarm.dead.add(victim)
        for _ in range(MAX_FAILURES):
            await asker.lookup(victim)  # the victim is the closest known to its own id
        assert victim not in asker.peers.known and asker.peers.quarantined(victim)
        # quarantined: a peer that names it again does not make it asked
        asked = swarm.calls[asker.peers.me]
        await asker.lookup(victim)
        assert victim not in asker.peers.heard
        assert swarm.calls[asker.peers.me] - asked < 3 * libp2p_records.REPLICAS

    run(main)


def test_records_are_republished_to_the_peers_closest_now(monkeypatch) -> None:
    monkeypatch.setattr(libp2p_records, "REPLICAS", 4)

    async def main() -> None:
        swarm = await joined_swarm(40)
        writer = list(swarm.stores)[0]
        key = "run/round/7"
        assert await swarm.stores[writer].store(key, "sync", b"record", EPOCH + 3600)
        first = swarm.true_closest(key, 4)
        # newcomers closer to the key than all its first replicas join; then those leave
        nearest = distance(key, first[0])
        closer = [p for p in ids(800, 3) if distance(key, p) < nearest][:4]
        assert len(closer) == 4
        for peer_id in closer:
            await swarm.join(peer_id)
        swarm.dead.update(p for p in first if p != writer)
        reader = swarm.stores[closer[0]]
        reader.table = type(reader.table)()  # only what the network holds counts
        assert await reader.get(key) == {}  # lost with its replicas: not republished yet

        await trio.sleep(REPUBLISH_S)
        assert await swarm.stores[writer].republish_once() == 1
        holders = {p for p, s in swarm.stores.items() if s.table.get(key, now())}
        assert set(closer) <= holders
        assert (await swarm.stores[closer[-1]].get(key))["sync"][0] == b"record"

    run(main)


def test_a_record_stored_again_recently_is_not_republished() -> None:
    async def main() -> None:
        swarm = await joined_swarm(8)
        store = swarm.stores[list(swarm.stores)[3]]
        assert await store.store("k", "s", b"v", EPOCH + 3600)
        await trio.sleep(REPUBLISH_S / 2)
        assert await store.republish_once() == 0
        await trio.sleep(REPUBLISH_S / 2)
        assert await store.store("k", "s", b"v2", EPOCH + 3700)  # the owner's own refresh
        assert await store.republish_once() == 0
        await trio.sleep(EPOCH + 3700 - now())
        assert await store.republish_once() == 0 and not store.own  # expired: dropped

    run(main)


# ---- lying and malformed answers ----------------------------------------------------


def test_a_liar_naming_fake_ids_close_to_the_key_does_not_derail_a_lookup() -> None:
    async def main() -> None:
        swarm = await joined_swarm(64)
        key = "run/members"
        fakes = sorted(ids(400, 4), key=lambda p: distance(key, p))[:30]
        liar = swarm.true_closest(key, 1)[0]
        swarm.liars[liar] = [[f, ["/ip4/10.99.0.1/tcp/1"]] for f in fakes] + [
            [1, 2],
            "junk",
            [liar, 7],
        ]
        asker = swarm.stores[list(swarm.stores)[5]]
        found = await asker.lookup(key)
        # the fakes fail (nobody runs them) and are dropped; the liar answered, so it counts
        assert found == swarm.true_closest(key, libp2p_records.REPLICAS)
        assert not set(fakes) & (set(asker.peers.known) | set(asker.peers.heard))
        assert swarm.calls[asker.peers.me] <= MAX_QUERIES

        # naming an honest peer at an address it made up gets nobody to shun that peer
        honest = swarm.true_closest(key, 2)[1]
        swarm.liars[liar] = [[honest, ["/ip4/10.99.0.2/tcp/1"]]]
        reader = swarm.add(ids(1, 13)[0], [])
        reader.peers.known = {liar: swarm.known_as(liar)}
        await reader.lookup(key)
        assert not reader.peers.quarantined(honest)

    run(main)


@pytest.mark.parametrize(
    "request_",
    [b"\xc1", msgpack.packb(7), msgpack.packb(["k"]), msgpack.packb([1, True, []])],
)
def test_a_malformed_query_is_refused_not_served(request_: bytes) -> None:
    async def main() -> None:
        swarm = await joined_swarm(2)
        serve = swarm.handlers[list(swarm.stores)[0]][RECORDS_GET]
        with pytest.raises((ValueError, msgpack.UnpackException)):
            await serve(list(swarm.stores)[1], request_)

    run(main)


def test_a_bare_key_query_still_gets_the_records_alone() -> None:
    async def main() -> None:
        swarm = await joined_swarm(3)
        first, second = list(swarm.stores)[:2]
        assert await swarm.stores[first].store("k", "s", b"v", EPOCH + 60)
        holder = next(p for p, s in swarm.stores.items() if s.table.get("k", now()))
        answer = await swarm.handlers[holder][RECORDS_GET](second, msgpack.packb("k"))
        assert msgpack.unpackb(answer) == {"s": [b"v", EPOCH + 60]}

    run(main)


def test_a_client_mode_peer_reads_and_writes_through_the_servers() -> None:
    async def main() -> None:
        swarm = await joined_swarm(30)
        (peer_id,) = ids(1, 12)
        client = await swarm.join(peer_id, client_mode=True)
        assert await client.store("k", "c", b"from a client", EPOCH + 60)
        assert not client.table.get("k", now())  # it keeps none itself
        assert all(client.peers.me not in s.peers.known for s in swarm.stores.values())
        other = swarm.stores[list(swarm.stores)[7]]
        assert (await other.get("k"))["c"][0] == b"from a client"

    run(main)


def test_the_records_kept_for_republishing_are_bounded_in_bytes(monkeypatch) -> None:
    monkeypatch.setattr(libp2p_records, "MAX_OWN_BYTES", 10_000)

    async def main() -> None:
        swarm = await joined_swarm(4)
        store = swarm.stores[list(swarm.stores)[1]]
        for index in range(30):
            await store.store(f"k{index}", "s", bytes(1000), EPOCH + 3600)
        assert len(store.own) == 10 and set(store.own) == {(f"k{i}", "s") for i in range(20, 30)}
        await store.store("k29", "s", bytes(10), EPOCH + 3700)  # a smaller refresh: room again
        await store.store("k30", "s", bytes(900), EPOCH + 3600)
        assert len(store.own) == 11

    run(main)
