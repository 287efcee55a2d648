"""The libp2p transport: py-libp2p (pure Python, trio) for streams, our own record store.

One process per peer and no daemon: a py-libp2p host (TCP, noise, yamux) runs on a trio
event loop in its own thread, and this class bridges the asyncio side of p2pdiloco to it.

- **Identity**: the same Ed25519 key file as the hivemind transport, so a peer has the
  same peer id on both.
- **RPC**: each call is one libp2p stream, protocol `/p2pdiloco/rpc/1/<name>`, framed by
  `framing.py` exactly as on hivemind (size limits, "continue", deadlines).
- **Records**: py-libp2p's Kademlia stores one value per key and cannot list subkeys, but
  the swarm needs `{subkey: (value, expiration)}` dictionaries whose entries expire on
  their own. So records live in a one-hop DHT of our own (docs/transport.md): every
  server peer keeps a `RecordTable`; a record is stored on, and read from, the
  `REPLICAS` server peers closest to its key (XOR distance of hashes, Kademlia's metric)
  among those this peer knows, and read from the same; peers learn each other through the bootstrap peers and a
  periodic exchange of known peers (a peer named by another is probed before it counts). Every record is checked with the run's rules when a
  peer asks to store it and when one returns it, as hivemind's validators do.
- **Client mode**: no listening socket; the peer dials out, serves calls over the
  connections it opened, and keeps no records.

py-libp2p and hivemind cannot share a process (duplicate protobuf symbols): import this
module only through `make_transport("libp2p")`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import multiaddr
import trio
from cryptography.hazmat.primitives import serialization
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import ProtocolNotSupportedError

from p2pdiloco.backoff import backoff_delays
from p2pdiloco.identity import Identity, is_peer_id, load_or_create_identity
from p2pdiloco.transport import framing
from p2pdiloco.transport.base import (
    DEFAULT_MAX_BYTES,
    AddressInUse,
    CallTimeout,
    ClockReading,
    Handler,
    PeerUnreachable,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
    Transport,
    TransportClosed,
    TransportError,
    TransportStartError,
    admit_call,
    check_port_free,
    check_size_limit,
)
from p2pdiloco.transport.ratelimit import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_PER_CALLER,
    ConcurrencyLimit,
)
from p2pdiloco.transport.records import Records, RecordTable, merge_latest

logger = logging.getLogger(__name__)
for _name, _level in (("libp2p", logging.ERROR), ("libp2p.host.basic_host", logging.CRITICAL)):
    logging.getLogger(_name).setLevel(_level)  # py-libp2p logs every refused stream as an error

T = TypeVar("T")

RECORDS_STORE = "~records.store"
RECORDS_GET = "~records.get"
RECORDS_PEERS = "~records.peers"
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
REFRESH_S = 5.0
"""Period of the known-peers exchange."""
MAX_KNOWN = 1024
MAX_SHARED = 64
"""Known peers sent in one exchange."""
MAX_CANDIDATES = 256
MAX_PROBES = 8
"""Candidates probed at once after an exchange."""
MAX_FAILURES = 3
"""Consecutive failed exchanges before a peer is forgotten."""
BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S = 0.25, 4.0
"""Waits between bootstrap attempts (`backoff_delays`: doubling, jittered), s."""
MAX_RECORD_REQUEST = 2 << 20
MAX_RECORDS_RESPONSE = 16 << 20


@dataclass
class _Known:
    maddrs: list[str]
    failures: int = 0


def _distance(key: str, peer_id: str) -> int:
    digest = lambda text: int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")  # noqa: E731
    return digest(key) ^ digest(peer_id)


def _split_maddr(text: str) -> tuple[str, str] | None:
    """(address without /p2p, peer id) of a bootstrap multiaddr, None if malformed."""
    address, sep, peer = text.rpartition("/p2p/")
    if not sep or not is_peer_id(peer):
        return None
    try:
        multiaddr.Multiaddr(address)
    except Exception:  # noqa: BLE001 - any malformed text
        return None
    return address, peer


class _TrioStream:
    """A py-libp2p stream as the framing's `ByteStream` (used on the trio thread)."""

    def __init__(self, stream: Any, idle_s: float) -> None:
        self.stream, self.idle_s = stream, idle_s

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        try:
            with trio.fail_after(self.idle_s if idle_bound else float("inf")):
                return await self.stream.read(n)
        except StreamEOF:
            return b""
        except StreamError as exc:
            raise framing.StreamEnded(f"stream reset: {type(exc).__name__}") from None
        except trio.TooSlowError:
            raise TimeoutError("no byte within the idle timeout") from None

    async def write(self, data: bytes) -> None:
        try:
            with trio.fail_after(self.idle_s):
                await self.stream.write(bytes(data))
        except StreamError as exc:
            raise framing.StreamEnded(f"stream reset: {type(exc).__name__}") from None
        except trio.TooSlowError:
            raise TimeoutError("write stalled past the idle timeout") from None

    @asynccontextmanager
    async def within(self, seconds: float):
        try:
            with trio.fail_after(seconds):
                yield
        except trio.TooSlowError:
            raise TimeoutError(f"not done within {seconds} s") from None

    async def close(self) -> None:
        with suppress(Exception), trio.move_on_after(5):
            await self.stream.close()


class Libp2pTransport(Transport):
    """A peer on a py-libp2p swarm; the constructor takes the hivemind transport's options.

    `initial_peers`: multiaddrs (with `/p2p/<id>`) to bootstrap from (empty: a new swarm).
    `host`/`port`: listen address (port 0: any free port). `client_mode`: no listening
    socket. `identity_path`: persistent Ed25519 key file. `announce_maddrs`: addresses to
    advertise instead of the listen ones. `startup_timeout_s`: bound on start and
    bootstrap. `dht_timeout_s`: bound on one store/get. `idle_timeout_s`: a stream that
    moves no byte this long is dropped. `record_rules`: the run's record validator.
    `max_in_flight` / `max_per_caller`: as for hivemind.
    """

    def __init__(
        self,
        initial_peers: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        client_mode: bool = False,
        identity_path: str | None = None,
        announce_maddrs: list[str] | None = None,
        startup_timeout_s: float = 60,
        dht_timeout_s: float = 30,
        idle_timeout_s: float = 60,
        shutdown_timeout_s: float = 10,
        record_rules=None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_per_caller: int = DEFAULT_MAX_PER_CALLER,
    ) -> None:
        ConcurrencyLimit(max_in_flight, max_per_caller)  # validate now, not at registration
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self.initial_peers = list(initial_peers)
        self.host = host
        self.port = port
        self._client_mode = client_mode
        self.identity_path = identity_path
        self.announce_maddrs = list(announce_maddrs) if announce_maddrs else None
        self.startup_timeout_s = startup_timeout_s
        self.dht_timeout_s = dht_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.record_rules = record_rules
        self._identity: Identity | None = None
        self._scratch_dir: str | None = None
        self._peer_id = ""
        self._maddrs: list[str] = []
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self._in_flight: dict[str, ConcurrencyLimit] = {}
        self._limits_lock = threading.Lock()
        self._records = RecordTable()
        self._known: dict[str, _Known] = {}
        """Server peers that answered us (or called us) under their own, authenticated id."""
        self._candidates: dict[str, list[str]] = {}
        """Peers another peer told us of: known only once they answer a probe themselves."""
        self._refused: dict[str, int] = {}
        self._bootstrap_error = ""
        self._ready = asyncio.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._host: Any = None

    # ---- lifecycle -------------------------------------------------------------------

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

    async def start(self) -> None:
        if self._closed:
            raise TransportClosed("transport was shut down; create a new one")
        if self._ready.is_set():
            return
        if not self._client_mode:
            check_port_free(self.host, self.port)
        if self.identity_path is None:
            self._scratch_dir = tempfile.mkdtemp(prefix="p2pdiloco-id-")
            self.identity_path = os.path.join(self._scratch_dir, "identity.key")
        try:
            self._identity = load_or_create_identity(self.identity_path)
        except (OSError, ValueError) as e:
            raise TransportStartError(f"cannot use identity {self.identity_path}: {e}") from None
        self._peer_id = self._identity.peer_id
        self._loop = asyncio.get_running_loop()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run_trio, args=(started,), name="libp2p", daemon=True)
        self._thread.start()
        try:
            await asyncio.wait_for(asyncio.wrap_future(started), self.startup_timeout_s)
            await asyncio.wait_for(self._in_trio(self._bootstrap), self.startup_timeout_s)
        except TimeoutError:
            await self.shutdown()
            if self._bootstrap_error:
                raise TransportStartError(
                    f"none of the initial peers answered ({', '.join(self.initial_peers)}) within "
                    f"{self.startup_timeout_s:g}s: {self._bootstrap_error}"
                ) from None
            raise TransportStartError(f"libp2p transport not started after {self.startup_timeout_s}s") from None
        except BaseException:
            await self.shutdown()
            raise
        self._ready.set()
        logger.info(
            "transport_started kind=libp2p peer_id=%s maddrs=%s client_mode=%s",
            self._peer_id, ",".join(self._maddrs), self._client_mode,
        )  # fmt: skip

    def _run_trio(self, started: concurrent.futures.Future[None]) -> None:
        try:
            trio.run(self._trio_main, started)
        except BaseException as exc:  # noqa: BLE001 - reported through `started`
            if not started.done():
                started.set_exception(exc)
            else:
                logger.warning("libp2p_thread_failed error=%r", exc)

    async def _trio_main(self, started: concurrent.futures.Future[None]) -> None:
        assert self._identity is not None
        seed = self._identity.key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        listen = [] if self._client_mode else [multiaddr.Multiaddr(f"/ip4/{self.host}/tcp/{self.port}")]
        host = new_host(key_pair=create_new_key_pair(seed), listen_addrs=listen or None)
        if host.get_id().to_base58() != self._peer_id:
            raise TransportStartError("py-libp2p derived another peer id from the identity key")
        self._stop = trio.Event()
        try:
            async with trio.open_nursery() as nursery, host.run(listen):
                self._host, self._nursery = host, nursery
                self._token = trio.lowlevel.current_trio_token()
                for name in (RECORDS_STORE, RECORDS_GET, RECORDS_PEERS, RECORDS_TIME):
                    self._set_handler(name)
                self._maddrs = self._visible(host)
                started.set_result(None)
                nursery.start_soon(self._refresh_loop)
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except OSError as exc:
            if "in use" in str(exc).lower():
                raise AddressInUse(f"cannot listen on {self.host}:{self.port}: address already in use") from None
            raise TransportStartError(f"cannot listen on {self.host}:{self.port}: {exc}") from None
        finally:
            self._host = self._nursery = None
            with trio.move_on_after(self.shutdown_timeout_s) as scope:
                scope.shield = True
                with suppress(Exception):
                    await host.close()

    def _visible(self, host: Any) -> list[str]:
        if self._client_mode:
            return []
        if self.announce_maddrs:
            return [f"{a}/p2p/{self._peer_id}" for a in self.announce_maddrs]
        return [str(a) for a in host.get_addrs()]

    async def wait_until_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise TransportStartError(f"transport not ready after {timeout_s}s") from None

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        token, stop, thread = self._token, self._stop, self._thread
        if token is not None and stop is not None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(stop.set)
        if thread is not None:
            await asyncio.to_thread(thread.join, self.shutdown_timeout_s + 5)
            if thread.is_alive():
                logger.warning("libp2p_thread_still_running peer_id=%s", self._peer_id)
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
        logger.info("transport_shutdown kind=libp2p peer_id=%s", self._peer_id)

    def _check_open(self) -> None:
        if self._closed or self._token is None or not self._ready.is_set():
            raise TransportClosed(f"transport {self._peer_id or '?'} is not running")

    # ---- the two event loops ------------------------------------------------------------

    async def _in_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the trio thread and await its result from asyncio; cancelling
        the awaiting task cancels the trio task."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        async def runner() -> None:
            result: Any = None
            error: BaseException | None = TransportClosed("the libp2p transport is shutting down")
            try:
                with scope:
                    try:
                        result, error = await fn(*args), None
                    except Exception as exc:  # noqa: BLE001 - handed to the asyncio side
                        error = exc
            finally:  # also when the whole nursery is cancelled: the awaiting side must wake
                with suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, result, error)

        def launch() -> None:
            if self._nursery is None:
                loop.call_soon_threadsafe(settle, None, TransportClosed("the libp2p transport is not running"))
            else:
                self._nursery.start_soon(runner)

        token = self._token
        if token is None:
            raise TransportClosed("the libp2p transport is not running")
        try:
            token.run_sync_soon(launch)
        except trio.RunFinishedError:
            raise TransportClosed("the libp2p transport is not running") from None
        try:
            return await done
        except asyncio.CancelledError:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
            raise

    async def _in_asyncio(self, handler: Handler, caller: str, request: bytes) -> bytes:
        """Run an asyncio handler from the trio thread and await its response."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(handler(caller, request), self._loop)
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(finished.set)

        future.add_done_callback(wake)
        try:
            await finished.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

    # ---- RPC -------------------------------------------------------------------------

    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self._check_open()
        check_size_limit("max_request_bytes", max_request_bytes)
        if name in self._handlers or name.startswith("~"):
            raise ValueError(f"handler {name!r} is already registered or reserved")
        self._handlers[name] = (handler, max_request_bytes)
        self._in_flight[name] = ConcurrencyLimit(self.max_in_flight, self.max_per_caller)
        await self._in_trio(self._set_handler_async, name)

    async def _set_handler_async(self, name: str) -> None:
        self._set_handler(name)

    def _set_handler(self, name: str) -> None:
        """Serve `name` on the host (trio thread)."""
        if name.startswith("~"):
            self._in_flight[name] = ConcurrencyLimit(self.max_in_flight, self.max_per_caller)
        limit = _LockedLimit(self._in_flight[name], self._limits_lock)

        async def serve(stream: Any) -> None:
            caller = stream.muxed_conn.peer_id.to_base58()
            if name.startswith("~"):
                handler, max_request = self._record_handler(name), MAX_RECORD_REQUEST
            else:
                user_handler, max_request = self._handlers[name]
                handler = lambda c, r: self._in_asyncio(user_handler, c, r)  # noqa: E731
            await framing.serve_call(_TrioStream(stream, self.idle_timeout_s), name, caller, max_request, limit, handler)

        self._host.set_stream_handler(TProtocol(framing.PROTOCOL_PREFIX + name), serve)

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
                if peer_id == self._peer_id:
                    return await self._call_self(name, request, max_response_bytes)
                return await self._in_trio(self._call, peer_id, name, request, max_response_bytes)
        except TimeoutError:
            raise CallTimeout(f"call {name} to {peer_id} timed out after {timeout_s}s") from None

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        """One call on the trio thread; raises TransportError subclasses (or TimeoutError)."""
        remote = await self._connect(peer_id)
        try:
            stream = await self._host.new_stream(remote, [TProtocol(framing.PROTOCOL_PREFIX + name)])
        except StreamFailure as exc:
            cause = exc.__cause__
            if isinstance(cause, ProtocolNotSupportedError) or "protocols not supported" in str(cause):
                raise RemoteError(f"peer {peer_id} has no handler {name!r}") from None
            raise PeerUnreachable(f"cannot open a stream to {peer_id}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - py-libp2p raises many kinds on a lost connection
            raise PeerUnreachable(f"cannot open a stream to {peer_id}: {type(exc).__name__}") from None
        wrapped = _TrioStream(stream, self.idle_timeout_s)
        try:
            return await framing.make_call(wrapped, request, peer_id, max_response)
        except ConnectionError as exc:
            raise PeerUnreachable(f"peer {peer_id} closed the stream: {exc}") from None
        finally:
            await wrapped.close()

    async def _connect(self, peer_id: str) -> ID:
        try:
            remote = ID.from_base58(peer_id)
        except Exception:  # noqa: BLE001 - any malformed id
            raise PeerUnreachable(f"invalid peer id {peer_id!r}") from None
        if self._host.get_network().connections.get(remote):
            return remote
        addrs = self._addresses_of(remote)
        if not addrs:
            await self._ask_around()  # a peer that joined since the last exchange
            addrs = self._addresses_of(remote)
        if not addrs:
            raise PeerUnreachable(f"no known address for peer {peer_id}")
        try:
            with trio.fail_after(min(self.idle_timeout_s, 30)):
                await self._host.connect(PeerInfo(remote, addrs))
        except trio.TooSlowError:
            raise PeerUnreachable(f"cannot connect to {peer_id}: dial timed out") from None
        except Exception as exc:  # noqa: BLE001 - refused, reset, noise failure, ...
            raise PeerUnreachable(f"cannot connect to {peer_id}: {type(exc).__name__}: {exc}") from None
        return remote

    def _addresses_of(self, remote: ID) -> list[multiaddr.Multiaddr]:
        peer = remote.to_base58()
        known = self._known.get(peer)
        maddrs = known.maddrs if known is not None else self._candidates.get(peer)
        if maddrs:
            return [multiaddr.Multiaddr(a) for a in maddrs]
        try:
            return list(self._host.get_peerstore().addrs(remote))
        except Exception:  # noqa: BLE001 - the peerstore raises for an unknown peer
            return []

    async def _ask_around(self) -> None:
        """One exchange with up to 3 known peers at once, bounded by the idle timeout."""
        with trio.move_on_after(min(self.idle_timeout_s, 10)):
            async with trio.open_nursery() as nursery:
                for peer in random.sample(list(self._known), min(3, len(self._known))):
                    nursery.start_soon(self._try_exchange, peer)

    async def _call_self(self, name: str, request: bytes, max_response: int) -> bytes:
        if name not in self._handlers:
            raise RemoteError(f"peer {self._peer_id} has no handler {name!r}")
        handler, max_request = self._handlers[name]
        if len(request) > max_request:
            raise RequestTooLarge(f"request of {len(request)} bytes exceeds {max_request} bytes")
        limit = _LockedLimit(self._in_flight[name], self._limits_lock)
        admit_call(limit, name, self._peer_id, self._peer_id)  # type: ignore[arg-type]
        try:
            response = await handler(self._peer_id, bytes(request))
        except Exception as e:
            raise RemoteError(f"handler {name} failed: {type(e).__name__}: {e}") from None
        finally:
            limit.release(self._peer_id)
        if len(response) > max_response:
            raise ResponseTooLarge(f"response of {len(response)} bytes exceeds {max_response}")
        return response

    # ---- records: a one-hop DHT over the RPCs above ---------------------------------------

    def _record_handler(self, name: str) -> Callable[[str, bytes], Awaitable[bytes]]:
        return {
            RECORDS_STORE: self._serve_store, RECORDS_GET: self._serve_get,
            RECORDS_PEERS: self._serve_peers, RECORDS_TIME: self._serve_time,
        }[name]  # fmt: skip

    async def _serve_time(self, caller: str, request: bytes) -> bytes:
        return msgpack.packb(self.now())

    async def _serve_store(self, caller: str, request: bytes) -> bytes:
        if self._client_mode:
            return b"\x00"
        key, subkey, value, expiration = msgpack.unpackb(request, raw=False)
        if not (isinstance(key, str) and isinstance(subkey, str) and isinstance(value, bytes)):
            raise ValueError("a record is [key: str, subkey: str, value: bytes, expiration: float]")
        if not isinstance(expiration, float | int) or self._refusal(key, subkey, value, expiration):
            return b"\x00"
        return b"\x01" if self._records.store(key, subkey, value, float(expiration), self.now()) else b"\x00"

    async def _serve_get(self, caller: str, request: bytes) -> bytes:
        key = msgpack.unpackb(request, raw=False)
        if not isinstance(key, str):
            raise ValueError("a record query is a key (str)")
        return msgpack.packb({s: [v, e] for s, (v, e) in self._records.get(key, self.now()).items()})

    async def _serve_peers(self, caller: str, request: bytes) -> bytes:
        """Learn the caller (if it announces addresses) and share up to MAX_SHARED known peers."""
        announced = msgpack.unpackb(request, raw=False)
        if isinstance(announced, list) and announced:
            self._learn(caller, announced)
        shared = [[p, k.maddrs] for p, k in self._known.items() if p != caller]
        random.shuffle(shared)
        return msgpack.packb(shared[:MAX_SHARED])

    def _learn(self, peer_id: str, maddrs: object) -> None:
        """Remember a server peer that called us under its own id, at the addresses it
        announced (well-formed ones that name it, bounded)."""
        good = self._addresses(peer_id, maddrs)
        if good and (peer_id in self._known or len(self._known) < MAX_KNOWN):
            self._known[peer_id] = _Known(good)
            self._candidates.pop(peer_id, None)

    def _addresses(self, peer_id: object, maddrs: object) -> list[str]:
        """The well-formed `/p2p/<peer_id>` multiaddrs of `maddrs`, without that suffix."""
        if peer_id == self._peer_id or not is_peer_id(peer_id) or not isinstance(maddrs, list):
            return []
        return [
            a.rpartition("/p2p/")[0]
            for a in maddrs[:8]
            if isinstance(a, str) and len(a) < 256 and _split_maddr(a) == (a.rpartition("/p2p/")[0], peer_id)
        ]

    def _refusal(self, key: str, subkey: str, value: bytes, expiration: float) -> str | None:
        """Why the run's rules refuse a record (logged, counted), or None."""
        if self.record_rules is None:
            return None
        reason = self.record_rules.check(key, subkey, value, expiration, self.now())
        if reason is not None:
            count = self._refused[reason] = self._refused.get(reason, 0) + 1
            if count <= 3 or count % 100 == 0:
                logger.warning("dht_record_refused reason=%r count=%d", reason, count)
            if len(self._refused) > 256:
                self._refused.clear()
        return reason

    async def _bootstrap(self) -> None:
        """Learn the swarm from the initial peers: retried until one answers (trio thread)."""
        seeds = [s for s in map(_split_maddr, self.initial_peers) if s is not None]
        if self.initial_peers and not seeds:
            raise TransportStartError(f"no usable initial peer in {', '.join(self.initial_peers)}")
        for address, peer in seeds:
            if peer != self._peer_id:
                self._known.setdefault(peer, _Known([address]))
        last_error = ""
        delays = backoff_delays(BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S)
        while seeds:
            for _, peer in seeds:
                try:
                    fresh = await self._exchange(peer)
                    async with trio.open_nursery() as nursery:
                        for candidate in fresh[:MAX_PROBES]:
                            nursery.start_soon(self._probe, candidate)
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
            self._bootstrap_error = last_error
            logger.info("bootstrap_retry error=%s", last_error)
            # back-off between attempts, jittered (peers do not retry in lockstep); start()'s
            # deadline bounds them
            await trio.sleep(next(delays))

    async def _exchange(self, peer: str) -> list[str]:
        """Swap known peers with `peer` (which becomes known: it answered under its id);
        returns the new candidates it named. Raises TransportError, TimeoutError,
        trio.TooSlowError or a decoding error."""
        with trio.fail_after(self.dht_timeout_s):
            raw = await self._call(peer, RECORDS_PEERS, msgpack.packb(self._maddrs), MAX_RECORDS_RESPONSE)
        if peer in self._candidates and len(self._known) < MAX_KNOWN:
            self._known[peer] = _Known(self._candidates.pop(peer))
        shared = msgpack.unpackb(raw, raw=False)
        fresh = []
        for item in shared[:MAX_SHARED] if isinstance(shared, list) else []:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
                continue
            other, maddrs = item
            if other in self._known or other in self._candidates or len(self._candidates) >= MAX_CANDIDATES:
                continue
            good = self._addresses(other, [f"{a}/p2p/{other}" for a in maddrs if isinstance(a, str)])
            if good:
                self._candidates[other] = good
                fresh.append(other)
        return fresh

    async def _try_exchange(self, peer: str) -> bool:
        """`_exchange`, then probe up to MAX_PROBES of the candidates it named; False if
        `peer` did not answer (a candidate that does not answer is dropped)."""
        try:
            fresh = await self._exchange(peer)
        except (TransportError, TimeoutError, trio.TooSlowError, ValueError, TypeError, msgpack.UnpackException):
            self._candidates.pop(peer, None)
            return False
        async with trio.open_nursery() as nursery:
            for candidate in fresh[:MAX_PROBES]:
                nursery.start_soon(self._probe, candidate)
        return True

    async def _probe(self, candidate: str) -> None:
        try:
            await self._exchange(candidate)
        except (TransportError, TimeoutError, trio.TooSlowError, ValueError, TypeError, msgpack.UnpackException):
            self._candidates.pop(candidate, None)

    async def _refresh_loop(self) -> None:
        """Every REFRESH_S, swap known peers with a few; forget those that keep failing."""
        while True:
            await trio.sleep(REFRESH_S)  # a period, not synchronisation
            if not self._known:
                for address, peer in filter(None, map(_split_maddr, self.initial_peers)):
                    if peer != self._peer_id:
                        self._known[peer] = _Known([address])
            for peer in random.sample(list(self._known), min(3, len(self._known))):
                answered = await self._try_exchange(peer)
                entry = self._known.get(peer)
                if entry is not None:
                    entry.failures = 0 if answered else entry.failures + 1
                    if entry.failures >= MAX_FAILURES:
                        del self._known[peer]

    def _closest(self, key: str) -> list[str]:
        candidates = list(self._known) + ([] if self._client_mode else [self._peer_id])
        return sorted(candidates, key=lambda p: _distance(key, p))[:REPLICAS]

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        if self._refusal(key, subkey, bytes(value), expiration_time):
            return False
        try:
            return await asyncio.wait_for(self._in_trio(self._store, key, subkey, bytes(value), float(expiration_time)), self.dht_timeout_s)
        except (TimeoutError, TransportError) as exc:
            logger.warning("dht_store_failed key=%s subkey=%s error=%r", key, subkey, exc)
            return False

    async def _store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        request = msgpack.packb([key, subkey, value, expiration])
        accepted = []

        async def one(peer: str) -> None:
            if peer == self._peer_id:
                accepted.append(self._records.store(key, subkey, value, expiration, self.now()))
                return
            with suppress(TransportError, TimeoutError, trio.TooSlowError):
                with trio.fail_after(self.dht_timeout_s):
                    accepted.append(await self._call(peer, RECORDS_STORE, request, 16) == b"\x01")

        async with trio.open_nursery() as nursery:
            for peer in self._closest(key):
                nursery.start_soon(one, peer)
        return any(accepted)

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        try:
            found = await asyncio.wait_for(self._in_trio(self._get, key), self.dht_timeout_s)
        except (TimeoutError, TransportError) as exc:
            logger.warning("dht_get_failed key=%s error=%r", key, exc)
            return {}
        now = self.now()
        return {s: r for s, r in found.items() if r[1] > now and not self._refusal(key, s, r[0], r[1])}

    async def _get(self, key: str) -> Records:
        request = msgpack.packb(key)
        found: Records = {}

        async def one(peer: str) -> None:
            if peer == self._peer_id:
                merge_latest(found, self._records.get(key, self.now()))
                return
            with suppress(TransportError, TimeoutError, trio.TooSlowError, ValueError, msgpack.UnpackException):
                with trio.fail_after(self.dht_timeout_s):
                    raw = await self._call(peer, RECORDS_GET, request, MAX_RECORDS_RESPONSE)
                answer = msgpack.unpackb(raw, raw=False)
                if isinstance(answer, dict):
                    merge_latest(found, {
                        s: (r[0], float(r[1])) for s, r in answer.items()
                        if isinstance(s, str) and isinstance(r, list) and len(r) == 2
                        and isinstance(r[0], bytes) and isinstance(r[1], float | int)
                    })  # fmt: skip

        closest = self._closest(key)
        remote = [p for p in closest if p != self._peer_id][:READ_FANOUT]
        async with trio.open_nursery() as nursery:
            for peer in ([self._peer_id] if self._peer_id in closest else []) + remote:
                nursery.start_soon(one, peer)
        return found

    def now(self) -> float:
        return time.time()

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        """The peer's `~records.time` (None from a peer of an older version: no handler)."""
        if self._closed or not self._ready.is_set():
            return None
        sent = self.now()
        try:
            raw = await asyncio.wait_for(self._in_trio(self._call, peer_id, RECORDS_TIME, b"", 64), timeout_s)
            remote = msgpack.unpackb(raw, raw=False)
        except (TransportError, TimeoutError, ValueError, msgpack.UnpackException):
            return None
        received = self.now()
        if isinstance(remote, bool) or not isinstance(remote, float | int):
            return None
        return ClockReading(peer_id, sent, float(remote), received)


class _LockedLimit:
    """A `ConcurrencyLimit` shared by the trio thread (serving) and asyncio (calls to self)."""

    def __init__(self, limit: ConcurrencyLimit, lock: threading.Lock) -> None:
        self.limit, self.lock = limit, lock

    def try_acquire(self, caller: str) -> str | None:
        with self.lock:
            return self.limit.try_acquire(caller)

    def release(self, caller: str) -> None:
        with self.lock:
            self.limit.release(caller)
