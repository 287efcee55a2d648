"""The libp2p transport: py-libp2p (pure Python, trio) for streams, our own record store.

One process per peer and no daemon: a py-libp2p host (TCP, noise, yamux) runs on a trio
event loop in its own thread (`trio_bridge.py`), and this class bridges the asyncio side
of p2pdiloco to it.

- **Identity**: the same Ed25519 key file as the hivemind transport, so a peer has the
  same peer id on both.
- **RPC**: each call is one libp2p stream, protocol `/p2pdiloco/rpc/1/<name>`, framed by
  `framing.py` exactly as on hivemind (size limits, "continue", deadlines);
  `libp2p_streams.py` adapts py-libp2p's streams to it.
- **Records**: a Kademlia-routed DHT of our own (`libp2p_records.py`, docs/transport.md):
  every server peer keeps a `RecordTable`, and a record is stored on, and read from, the
  server peers closest to its key in the swarm, found by an iterative lookup
  (`libp2p_routing.py`) over each peer's routing table (`libp2p_peers.py`: Kademlia
  buckets, filled from the bootstrap peers, a periodic exchange of known peers and the
  lookups; a peer named by another is probed before it counts). Records a peer stored
  are republished to the peers closest to their keys now. Every record is checked with
  the run's rules when a peer asks to store it and when one returns it, as hivemind's
  validators do.
- **Client mode**: no listening socket; the peer dials out, serves calls over the
  connections it opened, and keeps no records.

py-libp2p and hivemind cannot share a process (duplicate protobuf symbols): import this
module only through `make_transport("libp2p")`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from functools import partial
from typing import Any

import msgpack
import multiaddr
import trio
from cryptography.hazmat.primitives import serialization
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2pdiloco.transport import framing
from p2pdiloco.transport.base import (
    DEFAULT_MAX_BYTES,
    AddressInUse,
    ClockReading,
    Handler,
    PeerUnreachable,
    TransportError,
    TransportStartError,
)
from p2pdiloco.transport.libp2p_peers import RECORDS_PEERS, SwarmPeers
from p2pdiloco.transport.libp2p_records import MAX_RECORD_REQUEST, RECORDS_TIME, RecordStore
from p2pdiloco.transport.libp2p_streams import LockedLimit, TrioStream, call_over_stream
from p2pdiloco.transport.networked import NetworkedTransport
from p2pdiloco.transport.ratelimit import ConcurrencyLimit
from p2pdiloco.transport.records import within_room
from p2pdiloco.transport.trio_bridge import TrioBridge

logger = logging.getLogger(__name__)
BRIDGE_MARGIN_S = 5.0
"""A get or store answers by its own deadline (`dht_timeout_s`, on the trio thread, with
what arrived); the asyncio side waits this much longer, only as a safety net: when both
deadlines were equal, one silent replica made every get return nothing."""
for _name, _level in (("libp2p", logging.ERROR), ("libp2p.host.basic_host", logging.CRITICAL)):
    logging.getLogger(_name).setLevel(_level)  # py-libp2p logs every refused stream as an error


class Libp2pTransport(NetworkedTransport):
    """A peer on a py-libp2p swarm; options: `NetworkedTransport`'s (the hivemind
    transport's), `client_mode` meaning no listening socket at all."""

    kind = "libp2p"

    def __init__(self, initial_peers: list[str], **options: Any) -> None:
        super().__init__(initial_peers, **options)
        self._bridge = TrioBridge("libp2p")
        call_known = partial(self._call_peer, find=False)  # the routing's own calls never look up
        self._peers = SwarmPeers(self.initial_peers, call_known, self.dht_timeout_s)
        self._records = RecordStore(
            self._peers, call_known, self._client_mode, self.record_rules, self.dht_timeout_s, self.now
        )
        self._joined = trio.Event()
        """Set (on the trio thread) once the bootstrap exchange answered."""
        self._reserved: dict[str, Handler] = {**self._records.handlers(), RECORDS_PEERS: self._peers.serve_peers}
        """The transport's own RPCs (a `~` name cannot collide with a run's)."""
        self._host: Any = None

    # ---- lifecycle -------------------------------------------------------------------

    async def _join(self) -> None:
        self._peer_id = self._peers.me = self.identity.peer_id
        try:
            await self._bridge.start(self._trio_main, self.startup_timeout_s)
            await asyncio.wait_for(self._bridge.run(self._bootstrap), self.startup_timeout_s)
        except TimeoutError:
            if self._peers.bootstrap_error:
                raise TransportStartError(
                    f"none of the initial peers answered ({', '.join(self.initial_peers)}) within "
                    f"{self.startup_timeout_s:g}s: {self._peers.bootstrap_error}"
                ) from None
            raise TransportStartError(f"libp2p transport not started after {self.startup_timeout_s}s") from None

    async def _trio_main(self) -> None:
        """The trio thread: run the host, serve the record RPCs, keep the routing table
        fresh (exchanges, lookups of our own id) and republish our records."""
        seed = self.identity.key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        listen = [] if self._client_mode else [multiaddr.Multiaddr(f"/ip4/{self.host}/tcp/{self.port}")]
        host = new_host(key_pair=create_new_key_pair(seed), listen_addrs=listen or None)
        if host.get_id().to_base58() != self._peer_id:
            raise TransportStartError("py-libp2p derived another peer id from the identity key")
        try:
            async with trio.open_nursery() as nursery, host.run(listen):
                self._host = host
                for name in self._reserved:
                    self._set_handler(name)
                self._maddrs = self._peers.maddrs = self._visible(host)
                nursery.start_soon(self._peers.refresh_loop)
                nursery.start_soon(self._records.republish_loop)
                nursery.start_soon(self._self_lookups)
                await self._bridge.serve(nursery)
        except OSError as exc:
            if "in use" in str(exc).lower():
                raise AddressInUse(f"cannot listen on {self.host}:{self.port}: address already in use") from None
            raise TransportStartError(f"cannot listen on {self.host}:{self.port}: {exc}") from None
        finally:
            self._host = None
            with trio.move_on_after(self.shutdown_timeout_s) as scope:
                scope.shield = True
                with suppress(Exception):
                    await host.close()

    async def _bootstrap(self) -> None:
        await self._peers.bootstrap()
        self._joined.set()

    async def _self_lookups(self) -> None:
        """Once joined, look up our own id now and periodically (our neighbours learn us,
        we learn them), in the background: a start does not wait for it."""
        await self._joined.wait()
        await self._records.self_lookup_loop()

    def _visible(self, host: Any) -> list[str]:
        if self._client_mode:
            return []
        if self.announce_maddrs:
            return [f"{a}/p2p/{self._peer_id}" for a in self.announce_maddrs]
        return [str(a) for a in host.get_addrs()]

    async def _leave(self) -> None:
        if not await self._bridge.stop(self.shutdown_timeout_s + 5):
            logger.warning("libp2p_thread_still_running peer_id=%s", self._peer_id)

    # ---- RPC -------------------------------------------------------------------------

    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if name.startswith("~"):
            raise ValueError(f"handler {name!r} is already registered or reserved")
        await super().register_handler(name, handler, max_request_bytes)

    def _new_limit(self) -> ConcurrencyLimit:
        return LockedLimit(self.max_in_flight, self.max_per_caller)

    async def _serve_handler(self, name: str) -> None:
        await self._bridge.run(self._set_handler_async, name)

    async def _set_handler_async(self, name: str) -> None:
        self._set_handler(name)

    def _set_handler(self, name: str) -> None:
        """Serve `name` on the host (trio thread)."""
        reserved = self._reserved.get(name)
        if reserved is not None:
            self._in_flight[name] = self._new_limit()
        limit = self._in_flight[name]

        async def serve(stream: Any) -> None:
            caller = stream.muxed_conn.peer_id.to_base58()
            if reserved is not None:
                handler, max_request = reserved, MAX_RECORD_REQUEST
            else:
                user_handler, max_request = self._handlers[name]
                handler = partial(self._bridge.run_asyncio, user_handler)
            await framing.serve_call(TrioStream(stream, self.idle_timeout_s), name, caller, max_request, limit, handler)

        self._host.set_stream_handler(TProtocol(framing.PROTOCOL_PREFIX + name), serve)

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        if peer_id == self._peer_id:
            return await self._call_self(name, request, max_response)
        return await self._bridge.run(self._call_peer, peer_id, name, request, max_response)

    async def _call_peer(self, peer_id: str, name: str, request: bytes, max_response: int, find: bool = True) -> bytes:
        """One call on the trio thread; raises TransportError subclasses (or TimeoutError).
        `find`: look the peer up when no address of it is known."""
        remote = await self._connect(peer_id, find)
        return await call_over_stream(self._host, remote, peer_id, name, request, max_response, self.idle_timeout_s)

    async def _connect(self, peer_id: str, find: bool) -> ID:
        try:
            remote = ID.from_base58(peer_id)
        except Exception:  # noqa: BLE001 - any malformed id
            raise PeerUnreachable(f"invalid peer id {peer_id!r}") from None
        if self._host.get_network().connections.get(remote):
            return remote
        addrs = self._addresses_of(remote)
        if not addrs and find:
            # a peer our routing table does not hold: a lookup of its id ends at it (the
            # peer closest to its own id), which answers and so becomes dialable
            with trio.move_on_after(min(self.idle_timeout_s, 10)):
                await self._records.lookup(peer_id)
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
        maddrs = self._peers.addresses_of(remote.to_base58())
        if maddrs:
            return [multiaddr.Multiaddr(a) for a in maddrs]
        try:
            return list(self._host.get_peerstore().addrs(remote))
        except Exception:  # noqa: BLE001 - the peerstore raises for an unknown peer
            return []

    # ---- records ---------------------------------------------------------------------

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        if self._records.refusal(key, subkey, bytes(value), expiration_time):
            return False
        self.traffic.stored(key, len(value) + len(subkey))
        try:
            return await asyncio.wait_for(
                self._bridge.run(self._records.store, key, subkey, bytes(value), float(expiration_time)),
                self.dht_timeout_s + BRIDGE_MARGIN_S,
            )
        except (TimeoutError, TransportError) as exc:
            logger.warning("dht_store_failed key=%s subkey=%s error=%r", key, subkey, exc)
            return False

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        try:
            found = await asyncio.wait_for(
                self._bridge.run(self._records.get, key), self.dht_timeout_s + BRIDGE_MARGIN_S
            )
        except (TimeoutError, TransportError) as exc:
            logger.warning("dht_get_failed key=%s error=%r", key, exc)
            return {}
        now = self.now()  # checked with the rules as they arrived; drop what expired since
        records = within_room({subkey: record for subkey, record in found.items() if record[1] > now})
        self.traffic.read(key, records)
        return records

    def now(self) -> float:
        return time.time()

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        """The peer's `~records.time` (None from a peer of an older version: no handler)."""
        if self._closed or not self._ready.is_set():
            return None
        sent = self.now()
        try:
            raw = await asyncio.wait_for(self._bridge.run(self._call_peer, peer_id, RECORDS_TIME, b"", 64), timeout_s)
            remote = msgpack.unpackb(raw, raw=False)
        except (TransportError, TimeoutError, ValueError, msgpack.UnpackException):
            return None
        received = self.now()
        if isinstance(remote, bool) or not isinstance(remote, float | int):
            return None
        return ClockReading(peer_id, sent, float(remote), received)
