"""The hivemind transport: hivemind's DHT for records, its p2pd daemon's raw streams for RPC.

We use only hivemind's public surface: `DHT(...)`, `DHT.store/get(return_future=True)`,
`DHT.replicate_p2p()` and `P2P.add_binary_stream_handler/call_binary_stream_handler`
(the same calls hivemind's own averager makes). RPC framing is ours,
shared with the libp2p transport (`framing.py`, docs/transport.md). This module is the
RPC and the records' store/get; `hivemind_daemon.py` starts (with retries), stops and
reaps the DHT process and its p2pd daemon; `hivemind_dht.py` holds what runs inside the
DHT process (the run's record validator, the clock ping).

hivemind and py-libp2p cannot share a process (duplicate protobuf symbols), so import this
module only through `make_transport("hivemind")`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
from contextlib import suppress
from functools import partial
from typing import Any

from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils import get_dht_time

from p2pdiloco.transport import framing
from p2pdiloco.transport.base import ClockReading, PeerUnreachable, RemoteError
from p2pdiloco.transport.dialback import libp2p_public
from p2pdiloco.transport.hivemind_daemon import DhtDaemon
from p2pdiloco.transport.hivemind_dht import (
    RunRecordValidator,
    dial_from_dht,
    ping_for_time,
    share_room,
)
from p2pdiloco.transport.networked import NetworkedTransport
from p2pdiloco.transport.records import within_room

logger = logging.getLogger(__name__)


class HivemindTransport(NetworkedTransport):
    """A peer on a hivemind DHT swarm; RPC over p2pd raw streams.

    Options: `NetworkedTransport`'s. `max_in_flight` / `max_per_caller` count a request
    from its header to its last response byte; past either cap it is refused at once with
    an error status (the caller gets a `RemoteError`).
    """

    kind = "hivemind"
    listens_in_client_mode = True

    def __init__(self, initial_peers: list[str], **options: Any) -> None:
        super().__init__(initial_peers, **options)
        self._daemon = DhtDaemon(
            self.host, self.port, self.initial_peers, self.startup_timeout_s, self.shutdown_timeout_s
        )
        atexit.register(self._daemon.reap)

    # ---- lifecycle -------------------------------------------------------------------

    async def _join(self) -> None:
        await self._daemon.start(self._dht_options, self.identity.peer_id)
        self._peer_id, self._maddrs = self._daemon.peer_id, self._daemon.maddrs
        dht = self._daemon.dht
        if dht is not None:
            await asyncio.wait_for(_await(dht.run_coroutine(share_room, return_future=True)), self.startup_timeout_s)

    def _dht_options(self, timeout_s: float) -> dict[str, Any]:
        """hivemind's `DHT(...)` keywords for one start attempt bounded by `timeout_s`."""
        options: dict[str, Any] = dict(
            host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"],
            client_mode=self._client_mode,
            startup_timeout=timeout_s,
            # hivemind's check spawns a second daemon and only parses RSA keys; ours are Ed25519.
            check_if_identity_free=False,
            identity_path=self.identity_path,
            use_relay=self.use_relay,
            # a relay slot only helps a peer nobody can dial directly
            use_auto_relay=self.use_auto_relay and self._client_mode,
        )
        if self.use_relay and self.relay_service and not self._client_mode:
            # known public (a bootstrap node): serve relay circuits now, not once AutoNAT,
            # which never counts a private address, has decided
            options["force_reachability"] = "public"
        elif self.use_relay and options["use_auto_relay"]:
            # our dial-back already found nobody can dial us: take a relay slot at once,
            # trying the initial peers first (p2pd feeds its trusted relays to autorelay
            # on every search, beside the DHT's closest peers, which a client's first
            # lookups often miss)
            options["force_reachability"] = "private"
            relays = [m for m in self.initial_peers if "/p2p/" in m and "/p2p-circuit" not in m]
            if relays:
                options["trusted_relays"] = relays
        if self.record_rules is not None:
            options["record_validators"] = [RunRecordValidator(self.record_rules)]
        if self.announce_maddrs:
            options["announce_maddrs"] = self.announce_maddrs
        return options

    async def _leave(self) -> None:
        await self._daemon.shutdown()
        with suppress(Exception):
            atexit.unregister(self._daemon.reap)

    async def restart_as_client(self) -> bool:
        """A DHT node cannot change mode, so the DHT process and p2pd start again in
        client mode (same identity, handlers served again): others stop routing DHT
        requests to a node they cannot dial."""
        if not self._client_mode:
            self._client_mode = True
            await self.renew()
        return True

    async def renew(self) -> bool:
        """The DHT process and p2pd start again in the current mode (same identity,
        handlers served again); a failed start shuts the transport down and raises."""
        self._check_open()
        self._ready.clear()
        try:
            await self._daemon.shutdown()
            await self._join()
            for name in self._handlers:
                await self._serve_handler(name)
        except BaseException:
            await self.shutdown()
            raise
        self._ready.set()
        logger.info(
            "transport_restarted kind=%s peer_id=%s client_mode=%s",
            self.kind, self._peer_id, self._client_mode,
        )  # fmt: skip
        return True

    async def relay_addresses(self) -> list[str] | None:
        """The `/p2p-circuit` addresses p2pd announces for us now (autorelay adds one per
        relay slot it holds, on a relay it counts public), read from the daemon; None when
        this peer takes no slot, its initial peers are all on private addresses (a LAN
        run, a test on 127.0.0.1: no circuit would be announced) or the daemon did not
        answer within `dht_timeout_s`."""
        p2p = self._daemon.p2p
        if not (self._client_mode and self.use_relay and self.use_auto_relay) or p2p is None:
            return None
        if not any(libp2p_public(m) for m in self.initial_peers):
            return None  # a relay p2pd counts private is never announced: cannot tell
        try:
            maddrs = await asyncio.wait_for(p2p.get_visible_maddrs(latest=True), self.dht_timeout_s)
        except ValueError:  # hivemind's "no multiaddrs": none announced yet
            return []
        except Exception:  # noqa: BLE001 - a stuck or closing control socket: cannot tell
            return None
        return [str(m) for m in maddrs if "/p2p-circuit" in str(m)]

    # ---- RPC -------------------------------------------------------------------------

    async def _serve_handler(self, name: str) -> None:
        p2p = self._daemon.p2p
        assert p2p is not None

        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(name, info.peer_id.to_base58(), reader, writer)

        await asyncio.wait_for(p2p.add_binary_stream_handler(framing.PROTOCOL_PREFIX + name, serve), 30)

    async def _serve(
        self, name: str, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        handler, max_request = self._handlers[name]
        stream = _AsyncioStream(reader, writer, self.idle_timeout_s)
        await framing.serve_call(stream, name, caller, max_request, self._in_flight[name], handler)

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        if peer_id == self._peer_id:
            return await self._call_self(name, request, max_response)
        p2p = self._daemon.p2p
        assert p2p is not None
        try:
            remote = PeerID.from_base58(peer_id)
        except Exception:
            raise PeerUnreachable(f"invalid peer id {peer_id!r}") from None
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(remote, framing.PROTOCOL_PREFIX + name)
        except (P2PDaemonError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            text = str(e)
            if "protocol" in text.lower() and "not supported" in text.lower():
                raise RemoteError(f"peer {peer_id} has no handler {name!r}") from None
            raise PeerUnreachable(f"cannot open stream to {peer_id}: {text}") from None
        try:
            return await framing.make_call(
                _AsyncioStream(reader, writer, self.idle_timeout_s), request, peer_id, max_response
            )
        except ConnectionError as e:
            raise PeerUnreachable(f"peer {peer_id} closed the stream: {type(e).__name__}") from None
        finally:
            writer.close()

    # ---- DHT -------------------------------------------------------------------------

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        dht = self._daemon.dht
        assert dht is not None
        self.traffic.stored(key, len(value) + len(subkey))
        future = dht.store(
            key, bytes(value), expiration_time, subkey=subkey, return_future=True
        )
        try:
            return bool(await asyncio.wait_for(_await(future), self.dht_timeout_s))
        except TimeoutError:
            future.cancel()
            logger.warning("dht_store_timeout key=%s subkey=%s", key, subkey)
        except Exception as e:
            logger.warning("dht_store_failed key=%s subkey=%s error=%r", key, subkey, e)
        return False

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        dht = self._daemon.dht
        assert dht is not None
        future = dht.get(key, latest=latest, return_future=True)
        try:
            found = await asyncio.wait_for(_await(future), self.dht_timeout_s)
        except TimeoutError:
            future.cancel()
            logger.warning("dht_get_timeout key=%s", key)
            return {}
        except Exception as e:
            logger.warning("dht_get_failed key=%s error=%r", key, e)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}  # absent, or a plain (subkey-less) record some other program wrote
        now = get_dht_time()
        records = within_room({
            str(subkey): (item.value, float(item.expiration_time))
            for subkey, item in found.value.items()
            if isinstance(item.value, bytes) and item.expiration_time > now
        })  # fmt: skip
        self.traffic.read(key, records)
        return records

    def now(self) -> float:
        return get_dht_time()

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        """hivemind's DHT ping (every hivemind node answers it with its DHT time), sent
        from inside the DHT process through its public `run_coroutine`."""
        dht = self._daemon.dht
        if dht is None or self._closed:
            return None
        future = dht.run_coroutine(
            partial(ping_for_time, peer_id=peer_id, timeout_s=timeout_s), return_future=True
        )
        try:
            times = await asyncio.wait_for(_await(future), timeout_s + 1)
        except Exception:  # noqa: BLE001 - a timeout or a dead DHT process: no reading
            future.cancel()
            return None
        return None if times is None else ClockReading(peer_id, *times)

    # ---- reachability --------------------------------------------------------------

    async def observed_addrs(self, peer_id: str) -> list[str]:
        """p2pd's open connections to `peer_id`: their remote addresses."""
        p2p = self._daemon.p2p
        if p2p is None or self._closed:
            return []
        try:
            peers = await asyncio.wait_for(p2p.list_peers(), 5)
        except Exception:  # noqa: BLE001 - a dead or slow daemon: nothing observed
            return []
        return [str(a) for info in peers if info.peer_id.to_base58() == peer_id for a in info.addrs]

    async def dial_fresh(self, peer_id: str, maddrs: list[str], timeout_s: float) -> str | None:
        """A throwaway p2pd, started inside the DHT process (so the DHT process's
        watchdog reaps it if this peer dies), dials `maddrs`; its handshake checks the id."""
        dht = self._daemon.dht
        if dht is None or self._closed:
            return None
        future = dht.run_coroutine(
            partial(dial_from_dht, maddrs=list(maddrs), timeout_s=timeout_s), return_future=True
        )
        try:
            return await asyncio.wait_for(_await(future), timeout_s + 5)  # type: ignore[return-value]
        except Exception:  # noqa: BLE001 - a timeout or a dead DHT process: no verdict
            future.cancel()
            return None


class _AsyncioStream:
    """A p2pd stream (asyncio reader and writer) as the framing's `ByteStream`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, idle_s: float) -> None:
        self.reader, self.writer, self.idle_s = reader, writer, idle_s

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        if not idle_bound:
            return await self.reader.read(n)
        return await asyncio.wait_for(self.reader.read(n), self.idle_s)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), self.idle_s)

    def within(self, seconds: float):
        return asyncio.timeout(seconds)

    async def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        # closing the socket to p2pd ends a pending read (EOF) on the next loop turn
        self.writer.close()


async def _await(future: object) -> object:
    return await future  # type: ignore[misc]
