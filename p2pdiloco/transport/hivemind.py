"""The hivemind transport: hivemind's DHT for records, its p2pd daemon's raw streams for RPC.

We use only hivemind's public surface: `DHT(...)`, `DHT.store/get(return_future=True)`,
`DHT.replicate_p2p()` and `P2P.add_binary_stream_handler/call_binary_stream_handler`
(the same calls hivemind's own averager makes). RPC framing is ours,
shared with the libp2p transport (`framing.py`, docs/transport.md).

hivemind and py-libp2p cannot share a process (duplicate protobuf symbols), so import this
module only through `make_transport("hivemind")`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from contextlib import suppress
from functools import partial

import psutil
from hivemind.dht import DHT
from hivemind.dht.protocol import ValidationError
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.backoff import backoff_delays, within
from p2pdiloco.identity import Identity, load_or_create_identity
from p2pdiloco.transport import framing
from p2pdiloco.transport.base import (
    DEFAULT_MAX_BYTES,
    AddressInUse,
    CallTimeout,
    ClockReading,
    ClockSkew,
    Handler,
    PeerUnreachable,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
    Transport,
    TransportClosed,
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

logger = logging.getLogger(__name__)

PROBE_RETRY_S, PROBE_RETRY_CAP_S = 0.25, 4.0
"""Waits between TCP probes of the initial peers (`backoff_delays`: doubling, jittered), s."""
BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S = 1.0, 8.0
"""Waits between hivemind bootstrap attempts, s."""

def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (psutil: Linux, macOS, ...; empty if it is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped yet, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_FORKING_DHT = False


def _fork_dht(dht: DHT) -> None:
    """Fork hivemind's DHT process with an orphan watchdog (see `_watch_parent`)."""
    global _FORKING_DHT
    _FORKING_DHT = True
    try:
        dht.run_in_background(await_ready=False)
    finally:
        _FORKING_DHT = False


def _after_fork_in_child() -> None:
    if _FORKING_DHT:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _watch_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """In the DHT child: if our parent dies (even by SIGKILL), kill p2pd and exit.

    hivemind's DHT process does not notice its parent's death, so without this a killed
    peer leaves its DHT process and p2pd running, holding the port and the identity.
    """
    while os.getppid() == parent_pid:
        time.sleep(period_s)  # a watchdog's period, not synchronisation
    for pid in _child_pids(os.getpid()):
        with suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(1)


os.register_at_fork(after_in_child=_after_fork_in_child)

_SKEW = re.compile(r"local: ([0-9.]+), peer: ([0-9.]+)")


def _validation_error(e: ValidationError) -> TransportStartError:
    """hivemind's bootstrap refusal as one line that says what to do.

    hivemind pings its initial peers with `validate=True`: a peer whose clock is more
    than `MAX_DHT_TIME_DISCREPANCY_SECONDS` (3 s) from theirs, or that they cannot ping
    back, is refused with a `ValidationError` (before, it crossed `join` as a traceback).
    """
    text = str(e)
    times = _SKEW.search(text)
    if times:
        offset_s = float(times.group(2)) - float(times.group(1))
        side = "behind" if offset_s > 0 else "ahead of"
        return ClockSkew(
            f"your clock is {abs(offset_s):.1f} s {side} the initial peers' (hivemind allows 3 s): "
            "synchronise it (e.g. `timedatectl set-ntp true`, or your OS's time settings)",
            offset_s,
        )
    return TransportStartError(
        f"the initial peers refused this peer: {text}; if they cannot dial you back, "
        "join with --client-mode (or forward your port, see `p2pdiloco doctor`)"
    )


async def _ping_for_time(_dht: DHT, node, peer_id: str, timeout_s: float) -> tuple[float, float, float] | None:
    """In the DHT process: hivemind's own ping to `peer_id`, whose answer carries the
    peer's DHT time; (sent, their time, received), or None if it did not answer."""
    try:
        stub = node.protocol.get_stub(PeerID.from_base58(peer_id))
        request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
        sent = get_dht_time()
        response = await asyncio.wait_for(stub.rpc_ping(request, timeout=timeout_s), timeout_s)
        received = get_dht_time()
    except Exception:  # noqa: BLE001 - any failure means no reading
        return None
    if not response.dht_time:
        return None
    return sent, float(response.dht_time), received


class RunRecordValidator(RecordValidatorBase):
    """hivemind's record-validator hook around a run's pure record rules.

    hivemind shows a validator the key's DHT id, the msgpack-encoded subkey and value;
    we map the id back to the run's key names and hand the decoded parts to the rules.
    Runs inside the DHT process on every store request and every value a peer returns.
    """

    def __init__(self, rules) -> None:
        self.rules = rules
        self._keys = {DHTID.generate(source=key).to_bytes(): key for key in rules.keys()}
        self._refused: dict[str, int] = {}

    def validate(self, record: DHTRecord) -> bool:
        try:
            key = self._keys.get(record.key)
            if key is None:
                reason = "not a key of this run"
            else:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
                reason = self.rules.check(key, subkey, value, record.expiration_time, get_dht_time())
        except Exception as exc:  # noqa: BLE001 - any bytes from the network: a refusal
            reason = f"undecodable record ({type(exc).__name__})"
        if reason is None:
            return True
        count = self._refused[reason] = self._refused.get(reason, 0) + 1
        if count <= 3 or count % 100 == 0:
            logger.warning("dht_record_refused reason=%r count=%d", reason, count)
        if len(self._refused) > 256:
            self._refused.clear()
        return False


class HivemindTransport(Transport):
    """A peer on a hivemind DHT swarm; RPC over p2pd raw streams.

    `initial_peers`: multiaddrs to bootstrap from (empty: start a new swarm).
    `host`/`port`: listen address (port 0: any free port). `client_mode`: do not accept
    incoming connections (behind NAT). `identity_path`: persistent Ed25519 key file, created
    if missing, so the peer id survives restarts. `announce_maddrs`: addresses to advertise.
    `startup_timeout_s`: bound on daemon start + bootstrap, s. `dht_timeout_s`: bound on one
    store/get, s. `idle_timeout_s`: a stream that moves no byte for this long is dropped, s.
    `max_in_flight` / `max_per_caller`: requests one handler runs at once (from the request
    header to the last response byte), from everyone / from one caller; past either cap a
    request is refused at once with an error status (the caller gets a `RemoteError`).
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
        self._in_flight: dict[str, ConcurrencyLimit] = {}
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
        self._dht: DHT | None = None
        self._p2p: P2P | None = None
        self._peer_id = ""
        self._maddrs: list[str] = []
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self._p2pd_pids: list[int] = []
        self._ready = asyncio.Event()
        self._closed = False
        self._bootstrap_failed = False
        atexit.register(self._reap_p2pd)

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
        check_port_free(self.host, self.port)
        if self.identity_path is None:
            # An ephemeral peer still signs its records: its key lives in a private scratch dir.
            self._scratch_dir = tempfile.mkdtemp(prefix="p2pdiloco-id-")
            self.identity_path = os.path.join(self._scratch_dir, "identity.key")
        created = not os.path.isfile(self.identity_path)
        try:
            self._identity = load_or_create_identity(self.identity_path)
        except (OSError, ValueError) as e:
            raise TransportStartError(f"cannot use identity {self.identity_path}: {e}") from None
        if created and self._scratch_dir is None:
            logger.info("identity_created path=%s", self.identity_path)
        try:
            await self._start_dht()
        except BaseException:
            await self.shutdown()
            raise
        self._ready.set()
        logger.info(
            "transport_started kind=hivemind peer_id=%s maddrs=%s client_mode=%s",
            self._peer_id,
            ",".join(self._maddrs),
            self._client_mode,
        )

    async def _start_dht(self) -> None:
        """Start hivemind's DHT; retry a failed bootstrap until `startup_timeout_s` is spent.

        Peers launched at the same instant may dial an initial peer before it listens;
        hivemind then fails the bootstrap. Retrying (instead of starting alone) is what
        keeps such peers in one swarm rather than several halves.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        if not await self._wait_for_initial_peers(deadline):
            # Said here: hivemind, left the ~1 s that remains, would often report its own
            # slow start instead of the dead peers.
            raise TransportStartError(
                f"none of the initial peers answered ({', '.join(self.initial_peers)}) within "
                f"{self.startup_timeout_s}s; are they up, and on this run's network.transport "
                "(hivemind)?"
            )
        delays = backoff_delays(BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S)
        for attempt in itertools.count(1):
            try:
                await self._start_dht_once(max(1.0, deadline - loop.time()))
                return
            except TransportStartError as e:
                if not self._bootstrap_failed or loop.time() + 3 > deadline:
                    raise
                logger.info("bootstrap_retry attempt=%d error=%s", attempt, e)
                await self._stop_dht()
                # back-off between attempts (with jitter: peers do not retry in lockstep)
                await asyncio.sleep(within(next(delays), deadline - 3, loop.time()))

    async def _wait_for_initial_peers(self, deadline: float) -> bool:
        """Once one initial peer accepts TCP, True; False if none did by the deadline.
        True at once if no initial peer has a TCP address to try (hivemind reports)."""
        endpoints = []
        for maddr in self.initial_peers:
            parts = maddr.split("/")
            if len(parts) > 4 and parts[1] in ("ip4", "ip6", "dns", "dns4") and parts[3] == "tcp":
                endpoints.append((parts[2], int(parts[4])))
        loop = asyncio.get_running_loop()
        delays = backoff_delays(PROBE_RETRY_S, PROBE_RETRY_CAP_S)
        while endpoints and loop.time() < deadline:
            for host, port in endpoints:
                with suppress(OSError, TimeoutError):
                    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
                    writer.close()
                    return True
            await asyncio.sleep(within(next(delays), deadline, loop.time()))  # polling with a deadline
        return not endpoints

    async def _start_dht_once(self, timeout_s: float) -> None:
        self._bootstrap_failed = False
        options: dict = dict(
            host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"],
            client_mode=self._client_mode,
            startup_timeout=timeout_s,
            # hivemind's check spawns a second daemon and only parses RSA keys; ours are Ed25519.
            check_if_identity_free=False,
        )
        options["identity_path"] = self.identity_path
        if self.record_rules is not None:
            options["record_validators"] = [RunRecordValidator(self.record_rules)]
        if self.announce_maddrs:
            options["announce_maddrs"] = self.announce_maddrs
        self._dht = DHT(initial_peers=self.initial_peers, start=False, **options)
        deadline_s = timeout_s + 10
        try:
            _fork_dht(self._dht)
            # Waiting for the child blocks: keep it off the loop.
            await asyncio.wait_for(
                asyncio.to_thread(self._dht.wait_until_ready, timeout_s), deadline_s
            )
            self._p2pd_pids += _child_pids(self._dht.pid) if self._dht.pid else []
            self._p2p = await asyncio.wait_for(self._dht.replicate_p2p(), timeout_s)
            self._peer_id = self._p2p.peer_id.to_base58()
            if self._peer_id != self.identity.peer_id:
                raise ValueError("p2pd runs under another identity than the key file's")
            maddrs = await asyncio.wait_for(self._p2p.get_visible_maddrs(), timeout_s)
            self._maddrs = [str(m) for m in maddrs]
        except TimeoutError:
            raise TransportStartError(
                f"hivemind did not start within {self.startup_timeout_s}s "
                "(slow machine? raise startup_timeout_s)"
            ) from None
        except ValidationError as e:
            if self._dht.pid is not None:
                self._p2pd_pids += _child_pids(self._dht.pid)
            raise _validation_error(e) from None
        except (P2PDaemonError, RuntimeError, ValueError, OSError) as e:
            self._bootstrap_failed = "bootstrap failed" in str(e)
            if self._dht.pid is not None:
                self._p2pd_pids += _child_pids(self._dht.pid)
            raise self._start_error(e) from None

    def _start_error(self, e: Exception) -> TransportStartError:
        text = str(e)
        if "address already in use" in text.lower():
            return AddressInUse(f"cannot listen on {self.host}:{self.port}: address already in use")
        if "bootstrap" in text.lower() or "initial_peers" in text:
            return TransportStartError(
                f"none of the initial peers answered ({', '.join(self.initial_peers)}): {text}; "
                "are they up, and on this run's network.transport (hivemind)?"
            )
        return TransportStartError(f"hivemind failed to start: {type(e).__name__}: {text}")

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
        await self._stop_dht()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        while any(_pid_alive(p) for p in self._p2pd_pids) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # polling a deadline: p2pd exits after its DHT process
        self._reap_p2pd()
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
        with suppress(Exception):
            atexit.unregister(self._reap_p2pd)
        logger.info("transport_shutdown kind=hivemind peer_id=%s", self._peer_id)

    async def _stop_dht(self) -> None:
        """Stop the P2P replica and the DHT process (SIGKILL it if it does not exit)."""
        p2p, dht, self._p2p, self._dht = self._p2p, self._dht, None, None
        if p2p is not None:
            with suppress(Exception):
                await asyncio.wait_for(p2p.shutdown(), self.shutdown_timeout_s)
        if dht is not None and dht.pid is not None:
            self._p2pd_pids += [p for p in _child_pids(dht.pid) if p not in self._p2pd_pids]
            with suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(dht.shutdown), self.shutdown_timeout_s)
            if dht.is_alive():
                with suppress(OSError):
                    os.kill(dht.pid, signal.SIGKILL)
                await asyncio.to_thread(dht.join, self.shutdown_timeout_s)

    def _reap_p2pd(self) -> None:
        """SIGKILL our p2pd daemon(s) if still running (shutdown fallback and atexit)."""
        for pid in self._p2pd_pids:
            if _pid_alive(pid):
                logger.warning("p2pd_killed pid=%d peer_id=%s", pid, self._peer_id)
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def _check_open(self) -> P2P:
        if self._closed or self._p2p is None or not self._ready.is_set():
            raise TransportClosed(f"transport {self._peer_id or '?'} is not running")
        return self._p2p

    # ---- RPC -------------------------------------------------------------------------

    async def register_handler(
        self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        p2p = self._check_open()
        check_size_limit("max_request_bytes", max_request_bytes)
        if name in self._handlers:
            raise ValueError(f"handler {name!r} is already registered")
        self._handlers[name] = (handler, max_request_bytes)
        self._in_flight[name] = ConcurrencyLimit(self.max_in_flight, self.max_per_caller)

        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(name, info.peer_id.to_base58(), reader, writer)

        await asyncio.wait_for(p2p.add_binary_stream_handler(framing.PROTOCOL_PREFIX + name, serve), 30)

    async def _serve(
        self, name: str, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        handler, max_request = self._handlers[name]
        stream = _AsyncioStream(reader, writer, self.idle_timeout_s)
        await framing.serve_call(stream, name, caller, max_request, self._in_flight[name], handler)

    async def call(
        self,
        peer_id: str,
        name: str,
        request: bytes,
        timeout_s: float,
        max_response_bytes: int = DEFAULT_MAX_BYTES,
    ) -> bytes:
        p2p = self._check_open()
        check_size_limit("max_response_bytes", max_response_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                if peer_id == self._peer_id:
                    return await self._call_self(name, request, max_response_bytes)
                return await self._call(p2p, peer_id, name, request, max_response_bytes)
        except TimeoutError:
            raise CallTimeout(f"call {name} to {peer_id} timed out after {timeout_s}s") from None

    async def _call(
        self, p2p: P2P, peer_id: str, name: str, request: bytes, max_response: int
    ) -> bytes:
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

    async def _call_self(self, name: str, request: bytes, max_response: int) -> bytes:
        if name not in self._handlers:
            raise RemoteError(f"peer {self._peer_id} has no handler {name!r}")
        handler, max_request = self._handlers[name]
        if len(request) > max_request:
            raise RequestTooLarge(f"request of {len(request)} bytes exceeds {max_request} bytes")
        limit = self._in_flight[name]
        admit_call(limit, name, self._peer_id, self._peer_id)
        try:
            response = await handler(self._peer_id, bytes(request))
        except Exception as e:
            raise RemoteError(f"handler {name} failed: {type(e).__name__}: {e}") from None
        finally:
            limit.release(self._peer_id)
        if len(response) > max_response:
            raise ResponseTooLarge(f"response of {len(response)} bytes exceeds {max_response}")
        return response

    # ---- DHT -------------------------------------------------------------------------

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        assert self._dht is not None
        future = self._dht.store(
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
        assert self._dht is not None
        future = self._dht.get(key, latest=latest, return_future=True)
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
        return {
            str(subkey): (item.value, float(item.expiration_time))
            for subkey, item in found.value.items()
            if isinstance(item.value, bytes) and item.expiration_time > now
        }

    def now(self) -> float:
        return get_dht_time()

    async def read_clock(self, peer_id: str, timeout_s: float) -> ClockReading | None:
        """hivemind's DHT ping (every hivemind node answers it with its DHT time), sent
        from inside the DHT process through its public `run_coroutine`."""
        if self._dht is None or self._closed:
            return None
        future = self._dht.run_coroutine(
            partial(_ping_for_time, peer_id=peer_id, timeout_s=timeout_s), return_future=True
        )
        try:
            times = await asyncio.wait_for(_await(future), timeout_s + 1)
        except Exception:  # noqa: BLE001 - a timeout or a dead DHT process: no reading
            future.cancel()
            return None
        return None if times is None else ClockReading(peer_id, *times)


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


async def _await(future: object) -> object:
    return await future  # type: ignore[misc]
