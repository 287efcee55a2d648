"""Which server peers a libp2p peer knows, and how it learns them (on the trio thread).

The known peers are this peer's Kademlia routing table: a peer is kept in the bucket of
the length of the prefix its hash shares with ours (SHA-256 of the peer ids' text, the
metric of the records' keys), at most `BUCKET_SIZE` per bucket. So a peer knows about
`BUCKET_SIZE * log2(N)` of N peers, most of them near itself, and a lookup
(`libp2p_routing.py`) walks towards any key in O(log N) hops; in a swarm of a few dozen
every bucket has room and every peer knows every other. A full bucket keeps the peers it
has (old peers that still answer are the likeliest to stay) until one fails.

Peers learn each other from the bootstrap peers first, then by a periodic exchange of
known peers (`~records.peers`) and by the lookups themselves (a peer learns who asks it,
and asks the peers it is told of). A peer counts as known only once it answered under its
own, authenticated id (or called us, announcing its addresses); one that another peer
merely named is a candidate, probed before it counts. Everything is bounded: known peers,
candidates, peers shared in one exchange, probes at once; a known peer that keeps failing
is forgotten.

A forgotten peer (or a candidate whose probe failed) is quarantined: for a while (doubling
with each failure, capped) nobody can make us learn it again, neither by naming it nor by
calling us; after that, a peer that failed before counts again only once it answered a
probe (an unreachable peer re-learned without a probe would cost every get a dead
replica, for ever).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache

import msgpack
import multiaddr
import trio

from p2pdiloco.backoff import backoff_delays
from p2pdiloco.identity import is_peer_id
from p2pdiloco.transport.base import RemoteError, TransportError, TransportStartError

logger = logging.getLogger(__name__)

CallPeer = Callable[[str, str, bytes, int], Awaitable[bytes]]
"""One call on the trio thread: `(peer_id, rpc_name, request, max_response_bytes) -> response`."""

RECORDS_PEERS = "~records.peers"
"""The exchange of known peers (a `~` name cannot collide with a run's RPC)."""
REFRESH_S = 5.0
"""Period of the known-peers exchange."""
MAX_KNOWN = 1024
"""Known peers at most (all buckets together: a bound that buckets reach only past any
real swarm)."""
BUCKET_SIZE = 20
"""Known peers per bucket (Kademlia's k)."""
MAX_HEARD = 1024
"""Addresses of peers met in lookups and not (yet) known, least recently used dropped."""
MAX_SHARED = 64
"""Known peers sent in one exchange."""
MAX_CANDIDATES = 256
MAX_PROBES = 8
"""Candidates probed at once after an exchange."""
MAX_FAILURES = 3
"""Consecutive failed exchanges before a peer is forgotten."""
QUARANTINE_S, QUARANTINE_CAP_S = 30.0, 900.0
"""How long a forgotten peer is not learned again: doubling with each failure, capped, s."""
MAX_STRIKES_KEPT = 4096
"""Failed peers remembered (the least recently failed is forgotten first)."""
BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S = 0.25, 4.0
"""Waits between bootstrap attempts (`backoff_delays`: doubling, jittered), s."""
MAX_EXCHANGE_RESPONSE = 16 << 20
"""Bytes one exchange's answer may carry."""
EXCHANGE_FAULTS = (TransportError, TimeoutError, trio.TooSlowError, ValueError, TypeError, msgpack.UnpackException)
"""What an exchange with a peer that is gone, slow or lying raises."""


@lru_cache(maxsize=1 << 16)
def key_digest(text: str) -> int:
    """The 256-bit position of a key or a peer id on the records' ring (SHA-256 of its text)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")


def distance(key: str, peer_id: str) -> int:
    """Kademlia's XOR metric between a record key and a peer id (of their SHA-256 hashes)."""
    return key_digest(key) ^ key_digest(peer_id)


def bucket_of(me: str, peer_id: str) -> int:
    """The bucket `peer_id` falls in from `me`: the length of their hashes' common prefix."""
    return 256 - distance(me, peer_id).bit_length()


@dataclass
class Known:
    """A known server peer: its addresses (without `/p2p/`) and its failed exchanges in a row."""

    maddrs: list[str]
    failures: int = 0


def split_maddr(text: str) -> tuple[str, str] | None:
    """(address without /p2p, peer id) of a bootstrap multiaddr, None if malformed."""
    address, sep, peer = text.rpartition("/p2p/")
    if not sep or not is_peer_id(peer):
        return None
    try:
        multiaddr.Multiaddr(address)
    except Exception:  # noqa: BLE001 - any malformed text
        return None
    return address, peer


class SwarmPeers:
    """The server peers this peer knows and the candidates it was told of.

    `call` makes one call on the trio thread; `timeout_s` bounds one exchange. The
    transport sets `me` (this peer's id) once its identity is loaded and `maddrs` (the
    addresses it announces, empty in client mode) once it listens.
    """

    def __init__(
        self, initial_peers: list[str], call: CallPeer, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.initial_peers = initial_peers
        self.call = call
        self.timeout_s = timeout_s
        self.clock = clock
        self.me = ""
        self.maddrs: list[str] = []
        self.known: dict[str, Known] = {}
        """Server peers that answered us (or called us) under their own, authenticated id."""
        self.candidates: dict[str, list[str]] = {}
        """Peers another peer told us of: known only once they answer a probe themselves."""
        self.bootstrap_error = ""
        """Why the last bootstrap attempt failed ("" before one failed)."""
        self.strikes: OrderedDict[str, tuple[int, float]] = OrderedDict()
        """Peers that failed: (failures so far, clock time their quarantine ends)."""
        self.recheck: list[str] = []
        """Callers that failed before: probed at the next refresh before they count."""
        self.heard: OrderedDict[str, list[str]] = OrderedDict()
        """Addresses of peers a lookup met and did not make known (about to be asked, or
        answered into a full bucket): dialable, not counted."""

    def addresses_of(self, peer_id: str) -> list[str] | None:
        """The addresses we know `peer_id` at (known, candidate or heard), None if none."""
        known = self.known.get(peer_id)
        if known is not None:
            return known.maddrs
        return self.candidates.get(peer_id) or self.heard.get(peer_id)

    # ---- the routing table -----------------------------------------------------------

    def has_room(self, peer_id: str) -> bool:
        """Whether `peer_id` may become known: its bucket and the table have room."""
        if len(self.known) >= MAX_KNOWN:
            return False
        bucket = bucket_of(self.me, peer_id)
        return sum(1 for p in self.known if bucket_of(self.me, p) == bucket) < BUCKET_SIZE

    def _admit(self, peer_id: str, maddrs: list[str]) -> bool:
        """Make `peer_id` known at `maddrs` if it is, or if its bucket has room."""
        entry = self.known.get(peer_id)
        if entry is None and not self.has_room(peer_id):
            return False
        if entry is None:
            self.known[peer_id] = Known(maddrs)
        else:
            entry.maddrs = maddrs
        self.candidates.pop(peer_id, None)
        self.heard.pop(peer_id, None)
        return True

    def closest_known(self, key: str, count: int, exclude: str = "") -> list[str]:
        """The `count` known peers closest to `key` (not `exclude`), closest first."""
        target = key_digest(key)
        return heapq.nsmallest(
            count, (p for p in self.known if p != exclude), key=lambda p: key_digest(p) ^ target
        )

    def named(self, item: object) -> tuple[str, list[str]] | None:
        """(peer id, addresses) of one `[peer_id, [address, ...]]` another peer named,
        None if malformed, this peer, or quarantined (addresses without `/p2p/`). A peer we
        have addresses of keeps them: a third party does not move it elsewhere."""
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            return None
        other, maddrs = item
        if not isinstance(other, str) or other == self.me or self.quarantined(other):
            return None
        had = self.addresses_of(other)
        if had:
            return other, had
        good = self._addresses(other, [f"{a}/p2p/{other}" for a in maddrs if isinstance(a, str)])
        return (other, good) if good else None

    def hear(self, peer_id: str, maddrs: list[str]) -> None:
        """Remember where a lookup is about to ask `peer_id` (unless known already)."""
        if peer_id in self.known or peer_id in self.candidates:
            return
        self.heard[peer_id] = maddrs
        self.heard.move_to_end(peer_id)
        while len(self.heard) > MAX_HEARD:
            self.heard.popitem(last=False)

    def answered(self, peer_id: str) -> None:
        """`peer_id` answered a query under its own id: its probe passed (known if its
        bucket has room), and a known one's failures start over."""
        entry = self.known.get(peer_id)
        if entry is not None:
            entry.failures = 0
            return
        maddrs = self.candidates.get(peer_id) or self.heard.get(peer_id)
        if maddrs and not self._admit(peer_id, maddrs) and peer_id in self.candidates:
            self.heard[peer_id] = self.candidates.pop(peer_id)

    def failed(self, peer_id: str) -> None:
        """`peer_id` did not answer a query: a known peer is forgotten (and quarantined)
        after MAX_FAILURES in a row, a candidate at once; a peer a lookup only heard of is
        dropped, not quarantined: another peer may have named it at an address it made up,
        and must not get an honest peer shunned that way."""
        entry = self.known.get(peer_id)
        if entry is not None:
            entry.failures += 1
            if entry.failures >= MAX_FAILURES:
                self.forget(peer_id)
        elif peer_id in self.candidates:
            self.forget(peer_id)
        else:
            self.heard.pop(peer_id, None)

    async def serve_peers(self, caller: str, request: bytes) -> bytes:
        """Learn the caller (if it announces addresses) and share up to MAX_SHARED known peers."""
        announced = msgpack.unpackb(request, raw=False)
        if isinstance(announced, list) and announced:
            self.learn(caller, announced)
        shared = [[p, k.maddrs] for p, k in self.known.items() if p != caller]
        random.shuffle(shared)
        return msgpack.packb(shared[:MAX_SHARED])

    def learn(self, peer_id: str, maddrs: object) -> None:
        """Remember a server peer that called us under its own id, at the addresses it
        announced (well-formed ones that name it, bounded). One that failed before is
        ignored while quarantined, then only a candidate until a probe answers."""
        good = self._addresses(peer_id, maddrs)
        if not good or self.quarantined(peer_id):
            return
        if peer_id in self.strikes and peer_id not in self.known:
            if peer_id not in self.candidates and len(self.candidates) < MAX_CANDIDATES > len(self.recheck):
                self.candidates[peer_id] = good
                self.recheck.append(peer_id)
            return
        self._admit(peer_id, good)

    def quarantined(self, peer_id: str) -> bool:
        """Whether `peer_id` failed recently enough not to be learned again yet."""
        strike = self.strikes.get(peer_id)
        return strike is not None and self.clock() < strike[1]

    def forget(self, peer_id: str) -> None:
        """Drop a peer that failed (known or candidate) and quarantine it."""
        self.known.pop(peer_id, None)
        self.candidates.pop(peer_id, None)
        self.heard.pop(peer_id, None)
        failures = self.strikes.pop(peer_id, (0, 0.0))[0] + 1
        hold_s = min(QUARANTINE_S * 2 ** min(failures - 1, 16), QUARANTINE_CAP_S)
        self.strikes[peer_id] = (failures, self.clock() + hold_s)
        while len(self.strikes) > MAX_STRIKES_KEPT:
            self.strikes.popitem(last=False)
        logger.info("peer_forgotten peer_id=%s failures=%d quarantine_s=%g", peer_id, failures, hold_s)

    def _addresses(self, peer_id: object, maddrs: object) -> list[str]:
        """The well-formed `/p2p/<peer_id>` multiaddrs of `maddrs`, without that suffix."""
        if peer_id == self.me or not is_peer_id(peer_id) or not isinstance(maddrs, list):
            return []
        return [
            a.rpartition("/p2p/")[0]
            for a in maddrs[:8]
            if isinstance(a, str) and len(a) < 256 and split_maddr(a) == (a.rpartition("/p2p/")[0], peer_id)
        ]

    async def bootstrap(self) -> None:
        """Learn the swarm from the initial peers: retried until one answers."""
        seeds = [s for s in map(split_maddr, self.initial_peers) if s is not None]
        if self.initial_peers and not seeds:
            raise TransportStartError(f"no usable initial peer in {', '.join(self.initial_peers)}")
        for address, peer in seeds:
            if peer != self.me:
                self.known.setdefault(peer, Known([address]))
        last_error = ""
        delays = backoff_delays(BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S)
        while seeds:
            for _, peer in seeds:
                try:
                    await self._probe_all(await self._exchange(peer))
                    return
                except RemoteError as exc:
                    if "no handler" in str(exc):
                        raise TransportStartError(
                            f"initial peer {peer} does not speak p2pdiloco's libp2p record protocol: it runs "
                            "another transport (every peer of a run must use the run's network.transport)"
                        ) from None
                    last_error = str(exc)
                except (TransportError, TimeoutError, trio.TooSlowError, ValueError, msgpack.UnpackException) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
            self.bootstrap_error = last_error
            logger.info("bootstrap_retry error=%s", last_error)
            # back-off between attempts, jittered (peers do not retry in lockstep); start()'s
            # deadline bounds them
            await trio.sleep(next(delays))

    async def _exchange(self, peer: str) -> list[str]:
        """Swap known peers with `peer` (which becomes known: it answered under its id);
        returns the new candidates it named. Raises one of EXCHANGE_FAULTS."""
        with trio.fail_after(self.timeout_s):
            raw = await self.call(peer, RECORDS_PEERS, msgpack.packb(self.maddrs), MAX_EXCHANGE_RESPONSE)
        if peer in self.candidates:
            self.answered(peer)
        shared = msgpack.unpackb(raw, raw=False)
        fresh = []
        for item in shared[:MAX_SHARED] if isinstance(shared, list) else []:
            named = self.named(item)
            if named is None or len(self.candidates) >= MAX_CANDIDATES:
                continue
            other, good = named
            if other in self.known or other in self.candidates or not self.has_room(other):
                continue
            self.candidates[other] = good
            fresh.append(other)
        return fresh

    async def try_exchange(self, peer: str) -> bool:
        """`_exchange`, then probe up to MAX_PROBES of the candidates it named; False if
        `peer` did not answer (a candidate that does not answer is dropped)."""
        try:
            fresh = await self._exchange(peer)
        except EXCHANGE_FAULTS:
            if peer in self.candidates:
                self.forget(peer)
            return False
        await self._probe_all(fresh)
        return True

    async def _probe_all(self, fresh: list[str]) -> None:
        """Probe up to MAX_PROBES new candidates at once; the others are dropped (named
        again, they get another chance), so candidates never fill with peers nobody probes."""
        for candidate in fresh[MAX_PROBES:]:
            self.candidates.pop(candidate, None)
        async with trio.open_nursery() as nursery:
            for candidate in fresh[:MAX_PROBES]:
                nursery.start_soon(self._probe, candidate)

    async def _probe(self, candidate: str) -> None:
        try:
            await self._exchange(candidate)
        except EXCHANGE_FAULTS:
            self.forget(candidate)

    async def refresh_loop(self) -> None:
        """Every REFRESH_S, `refresh_once`."""
        while True:
            await trio.sleep(REFRESH_S)  # a period, not synchronisation
            await self.refresh_once()

    async def refresh_once(self) -> None:
        """Swap known peers with a few; forget (and quarantine) those that keep failing;
        probe the callers that failed before and called again."""
        if not self.known:
            for address, peer in filter(None, map(split_maddr, self.initial_peers)):
                if peer != self.me:
                    self.known[peer] = Known([address])  # the operator's seeds: always retried
        recheck, self.recheck = self.recheck[:MAX_PROBES], self.recheck[MAX_PROBES:]
        await self._probe_all([p for p in recheck if p in self.candidates])
        for peer in random.sample(list(self.known), min(3, len(self.known))):
            answered = await self.try_exchange(peer)
            entry = self.known.get(peer)
            if entry is not None:
                entry.failures = 0 if answered else entry.failures + 1
                if entry.failures >= MAX_FAILURES:
                    self.forget(peer)
