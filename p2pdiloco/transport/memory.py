"""An in-process fake of the transport, for logic tests only.

`MemoryNetwork` is the "internet": it routes calls between `MemoryTransport`s by peer id
and holds one shared DHT table with expiration on an injectable clock. Faults are
explicit: `kill(peer_id)` makes a peer unreachable, `suspend(peer_id)` makes calls to it
hang until the caller's deadline (like SIGSTOP), and a peer in `behind_nat` refuses fresh
connections (`dial_fresh`) while calls over the ones it opened still work. It keeps the
real transport's semantics (size limits, concurrency caps, deadlines, error types) but
not its timing or chunking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pdiloco.identity import Identity
from p2pdiloco.transport.base import (
    ClockReading,
    PeerUnreachable,
    TransportBase,
    TransportClosed,
    TransportStartError,
    check_response_size,
)
from p2pdiloco.transport.ratelimit import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_PER_CALLER
from p2pdiloco.transport.records import RecordTable

logger = logging.getLogger(__name__)


class MemoryNetwork:
    """Shared routing table, DHT and clock for a set of `MemoryTransport`s."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._peers: dict[str, MemoryTransport] = {}
        self._suspended: set[str] = set()
        self._dht = RecordTable()
        self._identities: dict[str, Identity] = {}
        self.behind_nat: set[str] = set()
        """Peers no fresh connection reaches (`dial_fresh` fails): a NAT in front of them."""

    def new_peer_id(self) -> str:
        """A fresh, unique peer id (a real Ed25519 one: records on this network are signed)."""
        identity = Identity.generate()
        self._identities[identity.peer_id] = identity
        return identity.peer_id

    def identity_of(self, peer_id: str) -> Identity | None:
        """The key behind a peer id made by `new_peer_id` (None for a hand-written id)."""
        return self._identities.get(peer_id)

    def kill(self, peer_id: str) -> None:
        """Take a peer off the network at once (like SIGKILL): calls to it fail."""
        self._peers.pop(peer_id, None)
        self._suspended.discard(peer_id)

    def suspend(self, peer_id: str) -> None:
        """Freeze a peer (like SIGSTOP): calls to it hang until the caller's deadline."""
        self._suspended.add(peer_id)

    def resume(self, peer_id: str) -> None:
        """Undo `suspend`."""
        self._suspended.discard(peer_id)

    def is_suspended(self, peer_id: str) -> bool:
        return peer_id in self._suspended

    def _attach(self, transport: MemoryTransport) -> None:
        if transport.peer_id in self._peers:
            raise TransportStartError(f"peer id {transport.peer_id} is already on this network")
        self._peers[transport.peer_id] = transport

    def _detach(self, transport: MemoryTransport) -> None:
        if self._peers.get(transport.peer_id) is transport:
            del self._peers[transport.peer_id]

    def _route(self, peer_id: str) -> MemoryTransport | None:
        return self._peers.get(peer_id)

    def _store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        return self._dht.store(key, subkey, value, expiration_time, self.clock())

    def _get(self, key: str) -> dict[str, tuple[bytes, float]]:
        return self._dht.get(key, self.clock())


class MemoryTransport(TransportBase):
    """A peer on a `MemoryNetwork`; same interface and error types as the real ones.

    `max_in_flight` / `max_per_caller`: requests one handler runs at once, from everyone /
    from one caller; a request past either cap is refused at once with a `RemoteError`.
    """

    kind = "memory"
    serves_before_start = True

    def __init__(
        self,
        network: MemoryNetwork,
        peer_id: str | None = None,
        client_mode: bool = False,
        record_rules=None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_per_caller: int = DEFAULT_MAX_PER_CALLER,
        clock_offset_s: float = 0.0,
    ) -> None:
        super().__init__(client_mode, max_in_flight, max_per_caller)
        self.clock_offset_s = clock_offset_s
        """What `read_clock` adds to this peer's time as others read it (a wrong clock;
        the records keep the network's one clock), seconds."""
        self.network = network
        self.record_rules = record_rules
        self._peer_id = peer_id or network.new_peer_id()
        self._identity = network.identity_of(self._peer_id)

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            raise TransportClosed(f"peer {self._peer_id} has a hand-written id and cannot sign")
        return self._identity

    def visible_maddrs(self) -> list[str]:
        return [] if self._client_mode else [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    async def _start(self) -> None:
        self.network._attach(self)

    async def _stop(self) -> None:
        self.network._detach(self)

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        remote = self.network._route(peer_id)
        if remote is None or (self._client_mode and remote._client_mode):
            raise PeerUnreachable(f"peer {peer_id} is unreachable")
        while self.network.is_suspended(peer_id):  # frozen: the deadline fires
            await asyncio.sleep(0.01)
        response = await remote._serve_in_process(self._peer_id, name, request)
        if self.network._route(peer_id) is not remote:
            raise PeerUnreachable(f"peer {peer_id} went away during the call")
        return check_response_size(response, max_response)

    async def observed_addrs(self, peer_id: str) -> list[str]:
        return [f"/memory/{peer_id}"] if self.network._route(peer_id) is not None else []

    async def dial_fresh(self, peer_id: str, maddrs: list[str], timeout_s: float) -> str | None:
        remote = self.network._route(peer_id)
        if remote is None:
            return "no such peer"
        if remote._client_mode or peer_id in self.network.behind_nat:
            return "connection refused"
        if not set(maddrs) & set(remote.visible_maddrs()):
            return "nobody listens there"
        while self.network.is_suspended(peer_id):  # frozen: the caller's deadline fires
            await asyncio.sleep(0.01)
        return ""

    async def restart_as_client(self) -> bool:
        self._client_mode = True
        return True

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        if self._refused(key, subkey, value, expiration_time):
            return False
        self.traffic.stored(key, len(value) + len(subkey))
        return self.network._store(key, subkey, value, expiration_time)

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        records = self.network._get(key)
        self.traffic.read(key, records)
        return {s: r for s, r in records.items() if not self._refused(key, s, r[0], r[1])}

    def _refused(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        """Apply the run's record rules, as hivemind's validator hook does on real peers."""
        if self.record_rules is None:
            return False
        reason = self.record_rules.check(key, subkey, value, expiration_time, self.now())
        if reason is not None:
            logger.warning("dht_record_refused key=%s reason=%r", key, reason)
        return reason is not None

    def now(self) -> float:
        return self.network.clock()

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        remote = self.network._route(peer_id)
        if self._closed or remote is None or self.network.is_suspended(peer_id):
            return None
        now = self.network.clock()
        return ClockReading(peer_id, now + self.clock_offset_s, now + remote.clock_offset_s, now + self.clock_offset_s)
