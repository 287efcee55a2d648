"""The narrow transport interface every networked part of p2pdiloco talks to.

A transport gives a peer three things and nothing more:

- an identity (`peer_id`, the signing key `identity`, `visible_maddrs()`),
- request/response RPC carrying opaque bytes (`register_handler`, `call`), moved in
  bounded chunks with a size limit on each side and a deadline on every call,
- expiring DHT records under (key, subkey) (`store`, `get`) on a shared clock (`now`).

Faults are raised as one exception tree, so a caller catches `TransportError` and turns
it into a `Rejected(reason)` or a skipped round, never a crash or a hang:

    TransportError              base of every peer and network fault
    ├── PeerUnreachable         no route / connection refused / peer gone mid-call
    ├── CallTimeout             the call's deadline `timeout_s` passed
    ├── RemoteError             the remote handler failed or refused the request
    │   └── RequestTooLarge     the request exceeded the remote's `max_request_bytes`
    ├── ResponseTooLarge        the response exceeded our `max_response_bytes`
    ├── TransportClosed         the local transport is not started or already shut down
    └── TransportStartError     the local transport could not start (also NetworkSetupError)
        ├── AddressInUse        the listen port is already taken
        └── ClockSkew           the initial peers refused us: our clock is too far from theirs

Besides, `read_clock(peer_id)` asks a peer its DHT time (`p2pdiloco doctor` and `join`
compare clocks with it); a transport that cannot ask returns None.

`TransportBase` is what the implementations share, written once: the start/shutdown
state, the table of served handlers, and `call()`'s checks, deadline and self-calls.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.identity import Identity
from p2pdiloco.transport.ratelimit import ConcurrencyLimit
from p2pdiloco.transport.traffic import Traffic

logger = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[bytes]]
"""An RPC handler: `(caller_peer_id, request_bytes) -> response_bytes`."""

CHUNK_BYTES = 1 << 20
"""Payloads move in chunks of at most this many bytes (1 MiB)."""

DEFAULT_MAX_BYTES = 64 << 20
"""Default request/response size limit, bytes (64 MiB)."""

MIN_LINK_BYTES_PER_S = 250_000
"""The slowest link a peer is expected to have (2 Mbit/s): deadlines of calls that move
a payload grow with its size at this rate, so a 10 MB update is not cut off at 20 s on a
10 Mbit/s home uplink shared by three pushes (measured: rounds never committed)."""


def transfer_timeout_s(base_s: float, nbytes: int) -> float:
    """A call's deadline: `base_s` for the work, plus `nbytes` at `MIN_LINK_BYTES_PER_S`."""
    return base_s + max(nbytes, 0) / MIN_LINK_BYTES_PER_S


@dataclass(frozen=True)
class PayloadDeadlines:
    """The deadline of a payload call by the size the caller measures (`transfer_timeout_s`),
    for the three sizes the roles measure: an update frame's bytes (the committer's pushes),
    a contribution frame's bytes (the learner link) and a fragment's parameter count (the
    update fetch, the state download). A real peer uses the sizes as they are; a simulated
    peer of a larger preset than the small model it runs says how much larger (its one
    declared seam for deadlines, set on each role as `deadlines`)."""

    update_scale: float = 1.0
    frame_scale: float = 1.0
    element_scale: float = 1.0

    def for_update(self, base_s: float, nbytes: int) -> float:
        return transfer_timeout_s(base_s, int(nbytes * self.update_scale))

    def for_frame(self, base_s: float, nbytes: int) -> float:
        return transfer_timeout_s(base_s, int(nbytes * self.frame_scale))

    def for_elements(self, base_s: float, nbytes: int) -> float:
        """`nbytes`: bytes computed from a parameter count (scaled as the count is)."""
        return transfer_timeout_s(base_s, int(nbytes * self.element_scale))


class TransportError(Exception):
    """A peer or network fault; callers catch this and carry on."""


class PeerUnreachable(TransportError):
    """The peer could not be reached or dropped the stream mid-call."""


class CallTimeout(TransportError):
    """The call did not complete within its `timeout_s`."""


class RemoteError(TransportError):
    """The remote handler raised, refused the request or does not exist."""


class RequestTooLarge(RemoteError):
    """The remote refused a request larger than its `max_request_bytes`."""


class ResponseTooLarge(TransportError):
    """The response was larger than the caller's `max_response_bytes`; it was not read."""


class TransportClosed(TransportError):
    """The local transport is not started or has been shut down."""


class TransportStartError(TransportError, NetworkSetupError):
    """The local transport could not start; the message says why and what to do."""


class AddressInUse(TransportStartError):
    """The requested listen address (host:port) is already in use."""


class ClockSkew(TransportStartError):
    """The initial peers refused this peer because its clock is too far from theirs."""

    def __init__(self, message: str, offset_s: float) -> None:
        super().__init__(message)
        self.offset_s = offset_s
        """Their clock minus ours, seconds (positive: ours is behind)."""


@dataclass(frozen=True)
class ClockReading:
    """One exchange of DHT time with a peer, NTP's way: our clock when we asked, theirs
    when they answered, ours when the answer came (DHT seconds)."""

    peer_id: str
    sent_s: float
    remote_s: float
    received_s: float

    @property
    def offset_s(self) -> float:
        """Their clock minus ours, seconds (positive: ours is behind), taking the answer
        to have been written halfway through the round trip."""
        return self.remote_s - (self.sent_s + self.received_s) / 2

    @property
    def error_s(self) -> float:
        """Bound on `offset_s`'s error: half the round trip, seconds."""
        return max(self.received_s - self.sent_s, 0.0) / 2


def check_size_limit(name: str, value: int) -> int:
    """Validate a byte limit given by the caller; returns it."""
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
    return value


class Transport(ABC):
    """One peer's view of the network (asyncio; use from a single event loop)."""

    @abstractmethod
    async def start(self) -> None:
        """Join the network; returns once the peer can serve and call."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Leave the network and release every resource. Idempotent, never raises."""

    @abstractmethod
    async def wait_until_ready(self, timeout_s: float) -> None:
        """Wait until `start()` completed; raises `TransportStartError` after `timeout_s`."""

    @property
    @abstractmethod
    def peer_id(self) -> str:
        """This peer's id (base58 libp2p peer id for real transports)."""

    @property
    @abstractmethod
    def identity(self) -> Identity:
        """This peer's signing key; `identity.peer_id == peer_id`."""

    @property
    @abstractmethod
    def client_mode(self) -> bool:
        """True when this peer cannot accept incoming connections (behind NAT)."""

    @abstractmethod
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with `/p2p/<peer_id>`) other peers can bootstrap from."""

    @abstractmethod
    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        """Serve RPC `name`; requests over `max_request_bytes` are refused unread."""

    @abstractmethod
    async def call(
        self,
        peer_id: str,
        name: str,
        request: bytes,
        timeout_s: float,
        max_response_bytes: int = DEFAULT_MAX_BYTES,
    ) -> bytes:
        """Call RPC `name` on `peer_id`; raises a `TransportError` within ~`timeout_s`."""

    @abstractmethod
    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        """Publish `value` under (key, subkey) until `expiration_time` (DHT time, s).

        Returns False when the network refused it (expired, or a record with a later
        expiration already exists under that subkey); never raises on network faults.
        """

    @abstractmethod
    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        """Records under `key`: `{subkey: (value, expiration_time)}`, empty if none/unreachable."""

    @abstractmethod
    def now(self) -> float:
        """The DHT clock, seconds (wall time shared by all peers)."""

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        """Ask `peer_id` its DHT time; None when it did not answer within `timeout_s` or
        this transport cannot ask (never raises a TransportError)."""
        return None

    # ---- reachability (transport/dialback.py, peer/reachability.py) ------------------

    async def observed_addrs(self, peer_id: str) -> list[str]:
        """Where `peer_id`'s open connections to this peer come from, as the network shows
        them (multiaddrs without `/p2p/`); [] when there is none or this transport cannot
        tell. Never raises."""
        return []

    async def dial_fresh(self, peer_id: str, maddrs: list[str], timeout_s: float) -> str | None:
        """Open a new connection to `peer_id` at one of `maddrs` (never one already open),
        which proves its identity, then close it: "" when one opened, why not when none
        could, None when this peer could not tell (its own dialer failed or was too slow,
        or this transport cannot dial back). Bounded by about `timeout_s`; never raises."""
        return None

    async def restart_as_client(self) -> bool:
        """Go on in client mode (no DHT service, nobody expected to dial in), keeping the
        identity and the registered handlers; False when this transport cannot switch."""
        return False

    # ---- relay slot (peer/relay_slot.py) ---------------------------------------------

    async def relay_addresses(self) -> list[str] | None:
        """The relayed (`/p2p-circuit`) addresses this peer announces now: [] while it
        holds no relay slot, None when this transport takes no slot or cannot tell.
        Never raises a TransportError."""
        return None

    async def renew(self) -> bool:
        """Start the network side again in the same mode, keeping the identity and the
        registered handlers (calls fail with `TransportClosed` meanwhile): what a peer
        does when its daemon stays stuck. False when this transport cannot."""
        return False


def check_response_size(response: bytes, max_response: int) -> bytes:
    """`response` as bytes, or ResponseTooLarge if it is over `max_response` bytes."""
    if len(response) > max_response:
        raise ResponseTooLarge(
            f"response of {len(response)} bytes exceeds max_response_bytes={max_response}"
        )
    return bytes(response)


class TransportBase(Transport):
    """The skeleton of every transport: lifecycle state, served handlers, `call()`'s checks.

    A transport subclasses this and adds only its own network (template methods):
    `_start()` joins it, `_stop()` leaves it (never raises), `_call()` carries one call
    within the deadline `call()` set, and `_serve_handler()` makes a newly registered
    handler reachable. `max_in_flight` / `max_per_caller`: requests one handler runs at
    once, from everyone / from one caller; past either cap a request is refused at once
    (the caller gets a `RemoteError`), never queued.
    """

    kind: ClassVar[str] = "base"
    """The transport's name in log lines (`transport_started kind=...`)."""
    serves_before_start: ClassVar[bool] = False
    """Whether handlers may be registered before `start()` (the in-memory fake's can; a
    real transport hands each one to its running network)."""

    def __init__(self, client_mode: bool, max_in_flight: int, max_per_caller: int) -> None:
        ConcurrencyLimit(max_in_flight, max_per_caller)  # validate now, not at registration
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self._client_mode = client_mode
        self._peer_id = ""
        self._identity: Identity | None = None
        self._maddrs: list[str] = []
        self._handlers: dict[str, tuple[Handler, int]] = {}
        """Served RPCs: name -> (handler, max_request_bytes)."""
        self._in_flight: dict[str, ConcurrencyLimit] = {}
        """Per served RPC, the requests it runs now."""
        self._ready = asyncio.Event()
        self._closed = False
        self.traffic = Traffic()
        """Payload bytes this peer moved, by category (`traffic.py`)."""

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            raise TransportClosed("transport not started: no identity loaded yet")
        return self._identity

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    def visible_maddrs(self) -> list[str]:
        return list(self._maddrs)

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise TransportClosed("transport was shut down; create a new one")
        if self._ready.is_set():
            return
        await self._start()
        self._ready.set()
        logger.info(
            "transport_started kind=%s peer_id=%s maddrs=%s client_mode=%s",
            self.kind, self._peer_id, ",".join(self.visible_maddrs()), self._client_mode,
        )  # fmt: skip

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        await self._stop()
        logger.info("transport_shutdown kind=%s peer_id=%s", self.kind, self._peer_id)

    async def wait_until_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise TransportStartError(f"{self.kind} transport not ready after {timeout_s}s") from None

    def _check_open(self) -> None:
        """Raise TransportClosed unless started and not shut down."""
        if self._closed or not self._ready.is_set():
            raise TransportClosed(f"transport {self._peer_id or '?'} is not running")

    @abstractmethod
    async def _start(self) -> None:
        """Join the network (`start()` has checked the state and marks it ready)."""

    @abstractmethod
    async def _stop(self) -> None:
        """Leave the network and release every resource; never raises."""

    # ---- RPC -------------------------------------------------------------------------

    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if not self.serves_before_start:
            self._check_open()
        check_size_limit("max_request_bytes", max_request_bytes)
        if name in self._handlers:
            raise ValueError(f"handler {name!r} is already registered")
        self._handlers[name] = (self._metered(name, handler), max_request_bytes)
        self._in_flight[name] = self._new_limit()
        await self._serve_handler(name)

    def _metered(self, name: str, handler: Handler) -> Handler:
        """`handler`, counting the bytes it is served and answers in `traffic`."""

        async def metered(caller: str, request: bytes) -> bytes:
            response = await handler(caller, request)
            if caller != self._peer_id:
                self.traffic.served(name, len(request), len(response))
            return response

        return metered

    async def _serve_handler(self, name: str) -> None:
        """Make the handler just registered under `name` reachable (the fake: nothing to do)."""

    def _new_limit(self) -> ConcurrencyLimit:
        """A fresh concurrency cap for one served RPC."""
        return ConcurrencyLimit(self.max_in_flight, self.max_per_caller)

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
                response = await self._call(peer_id, name, request, max_response_bytes)
        except TimeoutError:
            raise CallTimeout(f"call {name} to {peer_id} timed out after {timeout_s}s") from None
        if peer_id != self._peer_id:
            self.traffic.call(name, len(request), len(response))
        return response

    @abstractmethod
    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        """Carry one call to `peer_id` (possibly this peer); raises a TransportError.
        `call()` has checked the arguments and bounds this by its deadline."""

    async def _call_self(self, name: str, request: bytes, max_response: int) -> bytes:
        """A call to this very peer: its handler runs here, without a stream."""
        response = await self._serve_in_process(self._peer_id, name, request)
        return check_response_size(response, max_response)

    async def _serve_in_process(self, caller: str, name: str, request: bytes) -> bytes:
        """Run this peer's handler `name` for `caller` in this process, with the checks a
        stream server makes (size limit, concurrency caps); its failure is a RemoteError."""
        if name not in self._handlers:
            raise RemoteError(f"peer {self._peer_id} has no handler {name!r}")
        handler, max_request = self._handlers[name]
        if len(request) > max_request:
            raise RequestTooLarge(
                f"request of {len(request)} bytes exceeds {self._peer_id}'s limit of {max_request} bytes"
            )
        limit = self._in_flight[name]
        refusal = limit.try_acquire(caller)  # refused at the door, never queued
        if refusal is not None:
            logger.warning(
                "rpc_rejected reason=too_many_concurrent name=%s caller=%s detail=%r", name, caller, refusal
            )
            raise RemoteError(f"peer {self._peer_id} refused the call: too many concurrent requests ({refusal})")
        try:
            return await handler(caller, bytes(request))
        except Exception as e:
            logger.warning("handler_failed name=%s caller=%s error=%r", name, caller, e)
            raise RemoteError(
                f"handler {name} on {self._peer_id} failed: {type(e).__name__}: {e}"
            ) from None
        finally:
            limit.release(caller)
