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
"""

from __future__ import annotations

import errno
import logging
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.identity import Identity
from p2pdiloco.transport.ratelimit import ConcurrencyLimit

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


def check_port_free(host: str, port: int) -> None:
    """Raise AddressInUse if something listens on host:port (port 0 is always free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"cannot listen on {host}:{port}: address already in use; "
                    "pick another port or pass port=0"
                ) from None
            raise TransportStartError(f"cannot listen on {host}:{port}: {e.strerror}") from None


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


def admit_call(limit: ConcurrencyLimit, name: str, callee: str, caller: str) -> None:
    """Take one of `limit`'s slots for `caller`, or log and raise RemoteError: a call over
    the caps is refused at the door, never queued (the caller must `limit.release`)."""
    refusal = limit.try_acquire(caller)
    if refusal is not None:
        logger.warning(
            "rpc_rejected reason=too_many_concurrent name=%s caller=%s detail=%r", name, caller, refusal
        )
        raise RemoteError(f"peer {callee} refused the call: too many concurrent requests ({refusal})")
