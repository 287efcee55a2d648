"""An in-process fake of the transport, for logic tests only.

`MemoryNetwork` is the "internet": it routes calls between `MemoryTransport`s by peer id
and holds one shared DHT table with expiration on an injectable clock. Faults are
explicit: `kill(peer_id)` makes a peer unreachable, `suspend(peer_id)` makes calls to it
hang until the caller's deadline (like SIGSTOP). It keeps the real transport's semantics
(size limits, concurrency caps, deadlines, error types) but not its timing or chunking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pdiloco.identity import Identity
from p2pdiloco.transport.base import (
    DEFAULT_MAX_BYTES,
    CallTimeout,
    ClockReading,
    Handler,
    PeerUnreachable,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
    Transport,
    TransportClosed,
    TransportStartError,
    admit_call,
    check_size_limit,
)
from p2pdiloco.transport.ratelimit import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_PER_CALLER,
    ConcurrencyLimit,
)
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


class MemoryTransport(Transport):
    """A peer on a `MemoryNetwork`; same interface and error types as the real ones.

    `max_in_flight` / `max_per_caller`: requests one handler runs at once, from everyone /
    from one caller; a request past either cap is refused at once with a `RemoteError`.
    """

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
        ConcurrencyLimit(max_in_flight, max_per_caller)  # validate now, not at registration
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self._in_flight: dict[str, ConcurrencyLimit] = {}
        self.clock_offset_s = clock_offset_s
        """What `read_clock` adds to this peer's time as others read it (a wrong clock;
        the records keep the network's one clock), seconds."""
        self.network = network
        self.record_rules = record_rules
        self._peer_id = peer_id or network.new_peer_id()
        self._identity = network.identity_of(self._peer_id)
        self._client_mode = client_mode
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self._started = asyncio.Event()
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            raise TransportClosed(f"peer {self._peer_id} has a hand-written id and cannot sign")
        return self._identity

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    def visible_maddrs(self) -> list[str]:
        return [] if self._client_mode else [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    async def start(self) -> None:
        if self._closed:
            raise TransportClosed("transport was shut down; create a new one")
        if not self._started.is_set():
            self.network._attach(self)
            self._started.set()
            logger.info("transport_started kind=memory peer_id=%s", self._peer_id)

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.network._detach(self)
            logger.info("transport_shutdown kind=memory peer_id=%s", self._peer_id)

    async def wait_until_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._started.wait(), timeout_s)
        except TimeoutError:
            raise TransportStartError(f"memory transport not started after {timeout_s}s") from None

    def _check_open(self) -> None:
        if self._closed or not self._started.is_set():
            raise TransportClosed(f"transport {self._peer_id} is not running")

    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        check_size_limit("max_request_bytes", max_request_bytes)
        if name in self._handlers:
            raise ValueError(f"handler {name!r} is already registered")
        self._handlers[name] = (handler, max_request_bytes)
        self._in_flight[name] = ConcurrencyLimit(self.max_in_flight, self.max_per_caller)

    async def call(
        self,
        peer_id: str,
        name: str,
        request: bytes,
        timeout_s: float,
        max_response_bytes: int = DEFAULT_MAX_BYTES,
    ) -> bytes:
        self._check_open()
        check_size_limit("max_response_bytes", max_response_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._call(peer_id, name, bytes(request), max_response_bytes)
        except TimeoutError:
            raise CallTimeout(f"call {name} to {peer_id} timed out after {timeout_s}s") from None

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        remote = self.network._route(peer_id)
        if remote is None or (self._client_mode and remote._client_mode):
            raise PeerUnreachable(f"peer {peer_id} is unreachable")
        while self.network.is_suspended(peer_id):  # frozen: the deadline fires
            await asyncio.sleep(0.01)
        if name not in remote._handlers:
            raise RemoteError(f"peer {peer_id} has no handler {name!r}")
        handler, max_request = remote._handlers[name]
        if len(request) > max_request:
            raise RequestTooLarge(
                f"request of {len(request)} bytes exceeds {peer_id}'s limit of {max_request} bytes"
            )
        limit = remote._in_flight[name]
        admit_call(limit, name, peer_id, self._peer_id)
        try:
            response = await handler(self._peer_id, request)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("handler_failed name=%s caller=%s error=%r", name, self._peer_id, e)
            raise RemoteError(
                f"handler {name} on {peer_id} failed: {type(e).__name__}: {e}"
            ) from None
        finally:
            limit.release(self._peer_id)
        if self.network._route(peer_id) is not remote:
            raise PeerUnreachable(f"peer {peer_id} went away during the call")
        if len(response) > max_response:
            raise ResponseTooLarge(
                f"response of {len(response)} bytes exceeds max_response_bytes={max_response}"
            )
        return bytes(response)

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        if self._refused(key, subkey, value, expiration_time):
            return False
        return self.network._store(key, subkey, value, expiration_time)

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        records = self.network._get(key)
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
