"""The libp2p transport's records: a one-hop DHT of our own (on the trio thread).

py-libp2p's Kademlia stores one value per key and cannot list subkeys, but the swarm needs
`{subkey: (value, expiration)}` dictionaries whose entries expire on their own. So every
server peer keeps a `RecordTable`; a record is stored on, and read from, the `REPLICAS`
server peers closest to its key (XOR distance of hashes, Kademlia's metric) among those
this peer knows (`SwarmPeers`). Every record is checked with the run's rules when a peer
asks to store it and when one returns it, as hivemind's validators do. A client-mode peer
keeps no records.

A replica is a stranger (issue 28, item 9): its answer is checked record by record before
it is merged with the others, so junk with a far expiration cannot out-rank, and so hide,
an honest record; and a get or store answers with what arrived by its deadline (sooner
once most replicas have answered), so one silent replica cannot make it return nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgpack
import trio

from p2pdiloco.transport.base import Handler, TransportError
from p2pdiloco.transport.libp2p_peers import CallPeer, SwarmPeers
from p2pdiloco.transport.records import Records, RecordTable, RefusalLog

RECORDS_STORE = "~records.store"
RECORDS_GET = "~records.get"
RECORDS_TIME = "~records.time"
"""The record store's own RPCs (a `~` name cannot collide with a run's); `time` answers
the peer's clock (`read_clock`: records expire by it)."""
REPLICAS = 20
"""Server peers a record is stored on (Kademlia's k)."""
READ_FANOUT = REPLICAS
"""Closest replicas (besides this peer's own table) a `get` asks. All of them: a store
made before its peer knew the others reached only some replicas, and records are not
republished, so reading fewer could miss one for good (asking 3 was not measurably
cheaper in a 4-peer swarm)."""
MAX_RECORD_REQUEST = 2 << 20
"""Bytes of one request to the transport's own RPCs."""
MAX_RECORDS_RESPONSE = 16 << 20
"""Bytes of one `get` answer."""
SETTLE_SHARE = 0.1
"""Once more than half the replicas asked have answered (or failed), a get or store waits
for the others at most this share of its deadline (at least 1 s): a silent replica costs
a few seconds, not the whole deadline."""


def distance(key: str, peer_id: str) -> int:
    """Kademlia's XOR metric between a record key and a peer id (of their SHA-256 hashes)."""
    digest = lambda text: int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")  # noqa: E731
    return digest(key) ^ digest(peer_id)


class RecordStore:
    """This peer's share of the records, and stores/gets fanned out to the closest peers.

    `call` makes one call on the trio thread; `timeout_s` bounds one get or store (all its
    replicas together: it answers with what arrived by then); `rules`: the run's record rules (None: every record is accepted); `now`: the clock
    records expire by, s.
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
        key = msgpack.unpackb(request, raw=False)
        if not isinstance(key, str):
            raise ValueError("a record query is a key (str)")
        return msgpack.packb({s: [v, e] for s, (v, e) in self.table.get(key, self.now()).items()})

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
        usual case (every replica answers the same records) checks each record once."""
        now = self.now()
        for subkey, (value, expiration) in answer.items():
            old = into.get(subkey)
            if old is not None and old[1] >= expiration:
                continue
            if expiration <= now or self.refusal(key, subkey, value, expiration):
                continue
            into[subkey] = (value, expiration)

    @property
    def settle_s(self) -> float:
        """How long a get or store waits for the last replicas once most have answered, s."""
        return max(1.0, SETTLE_SHARE * self.timeout_s)

    async def ask_replicas(self, peers: list[str], ask: Callable[[str], Any]) -> None:
        """Run `await ask(peer)` for every peer at once; return once all are done, or
        `settle_s` after more than half are, or at the deadline `timeout_s` (the rest are
        cancelled: what arrived is the answer)."""
        if not peers:
            return
        finished = 0
        most, all_done = trio.Event(), trio.Event()

        async def one(peer: str) -> None:
            nonlocal finished
            try:
                await ask(peer)
            finally:
                finished += 1
                if 2 * finished > len(peers):
                    most.set()
                if finished == len(peers):
                    all_done.set()

        with trio.move_on_after(self.timeout_s):
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(one, peer)
                await most.wait()
                with trio.move_on_after(self.settle_s):
                    await all_done.wait()
                nursery.cancel_scope.cancel()

    def closest(self, key: str) -> list[str]:
        """The REPLICAS server peers (this one included) closest to `key`."""
        me = self.peers.me
        candidates = list(self.peers.known) + ([] if self.client_mode else [me])
        return sorted(candidates, key=lambda p: distance(key, p))[:REPLICAS]

    async def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        """Store on the closest replicas at once; True if one of them kept the record
        (by the deadline: a silent replica does not make the store fail)."""
        request = msgpack.packb([key, subkey, value, expiration])
        accepted = []

        async def one(peer: str) -> None:
            if peer == self.peers.me:
                accepted.append(self.table.store(key, subkey, value, expiration, self.now()))
                return
            with suppress(TransportError, TimeoutError, trio.TooSlowError):
                accepted.append(await self.call(peer, RECORDS_STORE, request, 16) == b"\x01")

        await self.ask_replicas(self.closest(key), one)
        return any(accepted)

    async def get(self, key: str) -> Records:
        """Ask the closest replicas at once; per subkey, the valid record that expires last
        (each answer checked with the run's rules before it is merged)."""
        request = msgpack.packb(key)
        found: Records = {}

        async def one(peer: str) -> None:
            if peer == self.peers.me:
                self.merge_valid(key, found, self.table.get(key, self.now()))
                return
            with suppress(TransportError, TimeoutError, trio.TooSlowError, ValueError, msgpack.UnpackException):
                raw = await self.call(peer, RECORDS_GET, request, MAX_RECORDS_RESPONSE)
                answer = msgpack.unpackb(raw, raw=False)
                if isinstance(answer, dict):
                    self.merge_valid(key, found, {
                        s: (r[0], float(r[1])) for s, r in answer.items()
                        if isinstance(s, str) and isinstance(r, list) and len(r) == 2
                        and isinstance(r[0], bytes) and isinstance(r[1], float | int)
                    })  # fmt: skip

        closest = self.closest(key)
        me = self.peers.me
        remote = [p for p in closest if p != me][:READ_FANOUT]
        await self.ask_replicas(([me] if me in closest else []) + remote, one)
        return found
