"""hivemind's DHT process and the p2pd daemon under it: started with retries, stopped, reaped.

hivemind runs its DHT in a forked process, which starts a p2pd daemon. Three things go
wrong with them on real machines, and are handled here, apart from the transport's RPC
and records:

- Peers launched at the same instant dial an initial peer before it listens, and
  hivemind fails the bootstrap: `DhtDaemon.start` waits for an initial peer to accept
  TCP, then retries the bootstrap (instead of starting alone), which keeps such peers in
  one swarm rather than several halves.
- A peer killed by SIGKILL would leave its DHT process and p2pd running, holding the port
  and the identity: the DHT process is forked with a watchdog that follows its parent,
  and every p2pd pid is remembered so that shutdown (or atexit) can kill it.
- hivemind's refusals at start (clock skew, port in use, silent initial peers) arrive as
  assorted exceptions: each becomes one `TransportStartError` line that says what to do.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import psutil
from hivemind.dht import DHT
from hivemind.dht.protocol import ValidationError
from hivemind.p2p import P2P, P2PDaemonError

from p2pdiloco.backoff import backoff_delays, within
from p2pdiloco.transport.base import AddressInUse, ClockSkew, TransportStartError

logger = logging.getLogger(__name__)

PROBE_RETRY_S, PROBE_RETRY_CAP_S = 0.25, 4.0
"""Waits between TCP probes of the initial peers (`backoff_delays`: doubling, jittered), s."""
BOOTSTRAP_RETRY_S, BOOTSTRAP_RETRY_CAP_S = 1.0, 8.0
"""Waits between hivemind bootstrap attempts, s."""


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (psutil: Linux, macOS, ...; empty if it is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def pid_alive(pid: int) -> bool:
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
    for pid in child_pids(os.getpid()):
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


BOOTSTRAP_FAILURES = ("bootstrap failed", "failed to connect to bootstrap peers")
"""How a start that reached no initial peer reads: hivemind's DHT node ("DHTNode bootstrap
failed: none of the initial_peers responded to a ping") and p2pd's own dial of its
bootstrap peers ("failed to connect to bootstrap peers", seen when a peer restarts in
client mode a moment after its first daemon left, under load): both are retried."""


def is_bootstrap_failure(text: str) -> bool:
    """Whether a start's error says it reached no initial peer (worth a retry)."""
    return any(phrase in text for phrase in BOOTSTRAP_FAILURES)


class DhtDaemon:
    """One transport's hivemind DHT process and the p2pd daemon under it.

    After `start()`: `dht`, `p2p` (this process's handle on the daemon), `peer_id` and
    `maddrs`. `shutdown()` stops both and kills whatever is left; `reap()` kills the p2pd
    daemons at once (the transport also registers it with atexit).
    """

    def __init__(
        self,
        host: str,
        port: int,
        initial_peers: list[str],
        startup_timeout_s: float,
        shutdown_timeout_s: float,
    ) -> None:
        self.host, self.port = host, port
        self.initial_peers = initial_peers
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.dht: DHT | None = None
        self.p2p: P2P | None = None
        self.peer_id = ""
        self.maddrs: list[str] = []
        self._p2pd_pids: list[int] = []
        self._bootstrap_failed = False

    async def start(self, options: Callable[[float], dict[str, Any]], peer_id: str) -> None:
        """Start hivemind's DHT as peer `peer_id`, with `options(timeout_s)` as `DHT(...)`
        keywords; retry a failed bootstrap until `startup_timeout_s` is spent."""
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
                timeout_s = max(1.0, deadline - loop.time())
                await self._start_once(options(timeout_s), peer_id, timeout_s)
                return
            except TransportStartError as e:
                if not self._bootstrap_failed or loop.time() + 3 > deadline:
                    raise
                logger.info("bootstrap_retry attempt=%d error=%s", attempt, e)
                await self.stop()
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

    async def _start_once(self, options: dict[str, Any], peer_id: str, timeout_s: float) -> None:
        self._bootstrap_failed = False
        self.dht = DHT(initial_peers=self.initial_peers, start=False, **options)
        try:
            _fork_dht(self.dht)
            # Waiting for the child blocks: keep it off the loop.
            await asyncio.wait_for(
                asyncio.to_thread(self.dht.wait_until_ready, timeout_s), timeout_s + 10
            )
            self._p2pd_pids += child_pids(self.dht.pid) if self.dht.pid else []
            self.p2p = await asyncio.wait_for(self.dht.replicate_p2p(), timeout_s)
            self.peer_id = self.p2p.peer_id.to_base58()
            if self.peer_id != peer_id:
                raise ValueError("p2pd runs under another identity than the key file's")
            maddrs = await asyncio.wait_for(self.p2p.get_visible_maddrs(), timeout_s)
            self.maddrs = [str(m) for m in maddrs]
        except TimeoutError:
            raise TransportStartError(
                f"hivemind did not start within {self.startup_timeout_s}s "
                "(slow machine? raise startup_timeout_s)"
            ) from None
        except ValidationError as e:
            if self.dht.pid is not None:
                self._p2pd_pids += child_pids(self.dht.pid)
            raise _validation_error(e) from None
        except (P2PDaemonError, RuntimeError, ValueError, OSError) as e:
            self._bootstrap_failed = is_bootstrap_failure(str(e))
            if self.dht.pid is not None:
                self._p2pd_pids += child_pids(self.dht.pid)
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

    async def stop(self) -> None:
        """Stop the P2P replica and the DHT process (SIGKILL it if it does not exit)."""
        p2p, dht, self.p2p, self.dht = self.p2p, self.dht, None, None
        if p2p is not None:
            with suppress(Exception):
                await asyncio.wait_for(p2p.shutdown(), self.shutdown_timeout_s)
        if dht is not None and dht.pid is not None:
            self._p2pd_pids += [p for p in child_pids(dht.pid) if p not in self._p2pd_pids]
            with suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(dht.shutdown), self.shutdown_timeout_s)
            if dht.is_alive():
                with suppress(OSError):
                    os.kill(dht.pid, signal.SIGKILL)
                await asyncio.to_thread(dht.join, self.shutdown_timeout_s)

    async def shutdown(self) -> None:
        """`stop()`, then wait (bounded) for p2pd to follow its DHT process; kill it if not."""
        await self.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        while any(pid_alive(p) for p in self._p2pd_pids) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # polling a deadline: p2pd exits after its DHT process
        self.reap()

    def reap(self) -> None:
        """SIGKILL our p2pd daemon(s) if still running (shutdown fallback and atexit)."""
        for pid in self._p2pd_pids:
            if pid_alive(pid):
                logger.warning("p2pd_killed pid=%d peer_id=%s", pid, self.peer_id)
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
