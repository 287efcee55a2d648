"""The libp2p transport's records: a Kademlia-routed DHT of our own (on the trio thread).

py-libp2p's Kademlia stores one value per key and cannot list subkeys, but the swarm needs
`{subkey: (value, expiration)}` dictionaries whose entries expire on their own. So every
server peer keeps a `RecordTable`, and a record lives on the `REPLICAS` server peers
closest to its key (XOR distance of hashes, Kademlia's metric and k) in the whole swarm,
found by an iterative lookup (`libp2p_routing.find_closest`) over the peers each peer
knows (`SwarmPeers`, a routing table of O(log N) peers). A `get` is that lookup with the
records riding on its answers (Kademlia's FIND_VALUE); a `store` is a lookup, then the
record sent to the closest peers that answered. Every record is checked with the run's
rules when a peer asks to store it and when one returns it, as hivemind's validators do.
A client-mode peer keeps no records.

Records outlive their first replicas: a peer republishes the live records it stored
itself every `REPUBLISH_S` to the peers closest to their keys *now*, so peers that joined
closer since then hold them and peers that left take nothing with them.

A replica is a stranger: its answer is checked record by record before
it is merged with the others, so junk with a far expiration cannot out-rank, and so hide,
an honest record; and every replica has its own deadline, well under the get's or store's
(which then answers with what arrived), so one silent replica cannot make it return
nothing, nor cost more than its own deadline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from p2pdiloco.transport.base import Handler, transfer_timeout_s
from p2pdiloco.transport.libp2p_peers import BUCKET_SIZE, CallPeer, SwarmPeers
from p2pdiloco.transport.libp2p_routing import QUERY_FAULTS, find_closest, parse_answer
from p2pdiloco.transport.records import Records, RecordTable, RefusalLog, within_room

logger = logging.getLogger(__name__)

RECORDS_STORE = "~records.store"
RECORDS_GET = "~records.get"
RECORDS_TIME = "~records.time"
"""The record store's own RPCs (a `~` name cannot collide with a run's); `time` answers
the peer's clock (`read_clock`: records expire by it)."""
REPLICAS = 20
"""Server peers a record is stored on and read from (Kademlia's k)."""
MAX_RECORD_REQUEST = 2 << 20
"""Bytes of one request to the transport's own RPCs."""
MAX_RECORDS_RESPONSE = 16 << 20
"""Bytes of one `get` answer."""
PER_REPLICA_SHARE = 1 / 6
"""One replica's deadline, as a share of a get's or store's (at least 1 s): 5 s of 30 s.
A silent replica costs that, in parallel with the others; the rest of the deadline is
for the lookup's later rounds."""
CLOSEST_FRESH_S = 10.0
"""A store reuses the closest peers a lookup of the same key found this recently (a
heartbeat's store follows the previous beat's get of its key), s."""
MAX_CLOSEST_CACHED = 256
"""Keys whose closest peers are remembered (least recently used dropped)."""
REPUBLISH_S = 300.0
"""A record this peer stored and did not store again for this long is stored again on
the peers closest to its key now, s (round records live an hour: 12 times in their life)."""
SELF_LOOKUP_S = 60.0
"""Period of the lookup of this peer's own id, which keeps its neighbours knowing it and
it knowing them, s (and once right after joining)."""
MAX_OWN, MAX_OWN_BYTES = 1024, 32 << 20
"""Records (and their bytes) this peer remembers to republish, the least recently stored
dropped first."""
REPUBLISH_AT_ONCE = 4
"""Keys republished at once."""


@dataclass
class Own:
    """A record this peer stored itself: republished while it lives."""

    value: bytes
    expiration: float
    stored_at: float
    """trio time of the last store (or republish)."""


class RecordStore:
    """This peer's share of the records, and stores/gets routed to the closest peers.

    `call` makes one call on the trio thread; `timeout_s` bounds one get or store (its
    lookup and replicas together: it answers with what arrived by then); `rules`: the
    run's record rules (None: every record is accepted); `now`: the clock records expire
    by, s.
    """

    def __init__(
        self,
        peers: SwarmPeers,
        call: CallPeer,
        client_mode: bool,
        rules: Any,
        timeout_s: float,
        now: Callable[[], float],
    ) -> None:
        self.peers = peers
        self.call = call
        self.client_mode = client_mode
        self.rules = rules
        self.timeout_s = timeout_s
        self.now = now
        self.table = RecordTable()
        self._refused = RefusalLog()
        self.own: OrderedDict[tuple[str, str], Own] = OrderedDict()
        """Records this peer stored, by (key, subkey): republished while they live."""
        self._own_bytes = 0
        self._closest: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()
        """Per key, (trio time, the closest peers a lookup found then)."""

    def handlers(self) -> dict[str, Handler]:
        """The RPCs this store serves, by name."""
        return {RECORDS_STORE: self._serve_store, RECORDS_GET: self._serve_get, RECORDS_TIME: self._serve_time}

    async def _serve_time(self, caller: str, request: bytes) -> bytes:
        return msgpack.packb(self.now())

    async def _serve_store(self, caller: str, request: bytes) -> bytes:
        if self.client_mode:
            return b"\x00"
        key, subkey, value, expiration = msgpack.unpackb(request, raw=False)
        if not (isinstance(key, str) and isinstance(subkey, str) and isinstance(value, bytes)):
            raise ValueError("a record is [key: str, subkey: str, value: bytes, expiration: float]")
        if not isinstance(expiration, float | int) or self.refusal(key, subkey, value, expiration):
            return b"\x00"
        return b"\x01" if self.table.store(key, subkey, value, float(expiration), self.now()) else b"\x00"

    async def _serve_get(self, caller: str, request: bytes) -> bytes:
        """A lookup's question `[key, with_records, caller's addresses]`: answers
        `[records (if asked), the known peers closest to key]` and learns the caller (a
        server peer announces its addresses). A bare key (str) gets the records alone."""
        query = msgpack.unpackb(request, raw=False)
        if isinstance(query, str):
            return msgpack.packb(self._records_of(query))
        if not (isinstance(query, list) and len(query) == 3 and isinstance(query[0], str)):
            raise ValueError("a record query is [key: str, with_records: bool, addresses: list]")
        key, with_records, announced = query
        if isinstance(announced, list) and announced:
            self.peers.learn(caller, announced)
        closer = self.peers.closest_known(key, BUCKET_SIZE, exclude=caller)
        records = self._records_of(key) if with_records is True else {}
        return msgpack.packb([records, [[p, self.peers.known[p].maddrs] for p in closer]])

    def _records_of(self, key: str) -> dict[str, list]:
        return {s: [v, e] for s, (v, e) in self.table.get(key, self.now()).items()}

    def refusal(self, key: str, subkey: str, value: bytes, expiration: float) -> str | None:
        """Why the run's rules refuse a record (logged, counted), or None."""
        if self.rules is None:
            return None
        reason = self.rules.check(key, subkey, value, expiration, self.now())
        if reason is not None:
            self._refused.note(reason)
        return reason

    def live(self, key: str, found: Records) -> Records:
        """The records of `found` (under `key`) that have not expired and pass the rules."""
        now = self.now()
        return {s: r for s, r in found.items() if r[1] > now and not self.refusal(key, s, r[0], r[1])}

    def merge_valid(self, key: str, into: Records, answer: Records) -> None:
        """Merge one replica's `answer` into `into`: per subkey the record that expires last
        among those that pass the rules. A record is checked only if it would win, so the
        usual case (every replica answers the same records) checks each record once; and
        only within the room a table would give it (`within_room`), so a stranger's answer
        of megabytes from one owner costs the checks of that owner's share, not of all."""
        now = self.now()
        for subkey, (value, expiration) in within_room(answer).items():
            old = into.get(subkey)
            if old is not None and old[1] >= expiration:
                continue
            if expiration <= now or self.refusal(key, subkey, value, expiration):
                continue
            into[subkey] = (value, expiration)

    @property
    def per_replica_s(self) -> float:
        """One replica's deadline within a get or store, s."""
        return max(1.0, PER_REPLICA_SHARE * self.timeout_s)

    async def lookup(self, key: str, with_records: Records | None = None, within_s: float | None = None) -> list[str]:
        """The REPLICAS server peers closest to `key` in the swarm that answered (this one
        included unless in client mode), within `within_s` (default `timeout_s`). With
        `with_records`, every answer's records under `key` are merged into it (each
        checked with the rules)."""
        request = msgpack.packb([key, with_records is not None, self.peers.maddrs])

        async def ask(peer: str) -> list:
            raw = await self.call(peer, RECORDS_GET, request, MAX_RECORDS_RESPONSE)
            records, named = parse_answer(raw)
            if with_records is not None:
                self.merge_valid(key, with_records, {
                    s: (r[0], float(r[1])) for s, r in records.items()
                    if isinstance(s, str) and isinstance(r, list) and len(r) == 2
                    and isinstance(r[0], bytes) and isinstance(r[1], float | int)
                })  # fmt: skip
            return named

        closest = await find_closest(
            key, self.peers, ask, REPLICAS, self.per_replica_s, within_s or self.timeout_s, not self.client_mode
        )
        self._closest[key] = (trio.current_time(), closest)
        self._closest.move_to_end(key)
        while len(self._closest) > MAX_CLOSEST_CACHED:
            self._closest.popitem(last=False)
        return closest

    def closest(self, key: str) -> list[str] | None:
        """The closest peers a lookup of `key` found within CLOSEST_FRESH_S, None if none."""
        cached = self._closest.get(key)
        if cached is None or trio.current_time() - cached[0] > CLOSEST_FRESH_S:
            return None
        return cached[1]

    async def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        """Store on the closest replicas (a lookup, unless a recent one of `key` is at
        hand); True if one of them kept the record by the deadline (a silent replica does
        not make the store fail). The record is republished while it lives."""
        self._remember(key, subkey, value, expiration)
        started = trio.current_time()
        # the lookup leaves the sends at least one replica's deadline of the store's
        replicas = self.closest(key) or await self.lookup(key, within_s=self.timeout_s - self.send_s(value))
        within_s = max(self.timeout_s - (trio.current_time() - started), self.send_s(value))
        return await self._store_on(replicas, key, subkey, value, expiration, within_s)

    def _remember(self, key: str, subkey: str, value: bytes, expiration: float) -> None:
        """Keep a record this peer stores, to republish it (bounded in records and bytes)."""
        old = self.own.pop((key, subkey), None)
        self._own_bytes += len(value) - (len(old.value) if old is not None else 0)
        self.own[(key, subkey)] = Own(value, expiration, trio.current_time())
        while len(self.own) > MAX_OWN or self._own_bytes > MAX_OWN_BYTES:
            self._own_bytes -= len(self.own.popitem(last=False)[1].value)

    def send_s(self, value: bytes) -> float:
        """One replica's deadline to take a record of `value`, s."""
        return min(transfer_timeout_s(self.per_replica_s, len(value)), self.timeout_s / 2)

    async def _store_on(
        self, replicas: list[str], key: str, subkey: str, value: bytes, expiration: float, within_s: float
    ) -> bool:
        """Send one record to `replicas` at once, each within its own deadline, all within
        `within_s`; True if one kept it."""
        request = msgpack.packb([key, subkey, value, expiration])
        accepted = []

        async def one(peer: str) -> None:
            if peer == self.peers.me:
                accepted.append(self.table.store(key, subkey, value, expiration, self.now()))
                return
            try:
                with trio.fail_after(self.send_s(value)):
                    accepted.append(await self.call(peer, RECORDS_STORE, request, 16) == b"\x01")
            except QUERY_FAULTS:
                self.peers.failed(peer)

        with trio.move_on_after(within_s):
            async with trio.open_nursery() as nursery:
                for peer in replicas:
                    nursery.start_soon(one, peer)
        return any(accepted)

    async def get(self, key: str) -> Records:
        """Per subkey, the valid record that expires last among this peer's own table and
        the answers of a lookup of `key` (each checked with the run's rules before it is
        merged): what arrived by the deadline."""
        found: Records = {}
        if not self.client_mode:
            self.merge_valid(key, found, self.table.get(key, self.now()))
        await self.lookup(key, found)
        return found

    # ---- upkeep ------------------------------------------------------------------------

    async def self_lookup_loop(self) -> None:
        """Look up this peer's own id now and every SELF_LOOKUP_S: the peers closest to
        it learn it (it announces its addresses), and it learns them."""
        while True:
            try:
                await self.lookup(self.peers.me)
            except Exception:  # noqa: BLE001 - upkeep is skipped, never the transport's end
                logger.exception("self_lookup_failed")
            await trio.sleep(SELF_LOOKUP_S)  # a period, not synchronisation

    async def republish_loop(self) -> None:
        """Every REPUBLISH_S, `republish_once`."""
        while True:
            await trio.sleep(REPUBLISH_S)  # a period, not synchronisation
            try:
                await self.republish_once()
            except Exception:  # noqa: BLE001 - upkeep is skipped, never the transport's end
                logger.exception("republish_failed")

    async def republish_once(self) -> int:
        """Store again, on the peers closest to their keys now, the live records this peer
        stored and has not stored again for REPUBLISH_S; returns how many were due."""
        now, since = self.now(), trio.current_time() - REPUBLISH_S
        due: dict[str, list[tuple[str, Own]]] = {}
        for (key, subkey), own in list(self.own.items()):
            if own.expiration <= now:
                del self.own[(key, subkey)]
                self._own_bytes -= len(own.value)
            elif own.stored_at <= since:
                due.setdefault(key, []).append((subkey, own))
        limiter = trio.CapacityLimiter(REPUBLISH_AT_ONCE)

        async def republish(key: str, records: list[tuple[str, Own]]) -> None:
            async with limiter:
                replicas = await self.lookup(key)
                for subkey, own in records:
                    own.stored_at = trio.current_time()
                    await self._store_on(replicas, key, subkey, own.value, own.expiration, self.timeout_s)

        async with trio.open_nursery() as nursery:
            for key, records in due.items():
                nursery.start_soon(republish, key, records)
        if due:
            logger.debug("records_republished keys=%d records=%d", len(due), sum(map(len, due.values())))
        return sum(map(len, due.values()))
