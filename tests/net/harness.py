"""Start real peers as separate OS processes on 127.0.0.1 and talk to them over pipes.

Protocol with a child: it prints one JSON object per stdout line. The first line with a
`"ready"` key is its readiness report (`{"ready": true, "peer_id": ..., "maddrs": [...]}`,
or `{"ready": false, "error": ..., "message": ...}` before exiting); every later line is an
event. The parent may send JSON lines on the child's stdin; a child answering a message
with an `"id"` echoes that id in its reply. Non-JSON stdout lines are kept in `.noise`.

Each child runs in its own session/process group, so `kill()` and the reaping fixture
also reach what it spawned (hivemind's DHT process and its p2pd daemon).
Readiness is a signal, never a sleep: every wait here has a deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TRANSPORT_PEER = Path(__file__).resolve().parent / "transport_peer.py"

_EOF = object()


class PeerFailedToStart(RuntimeError):
    """The child exited or reported `"ready": false` before it was ready."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


def process_group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def process_name(pid: int) -> str:
    """The kernel's short name of `pid` ("" if gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class PeerProcess:
    """A running child peer: its readiness report, its events, and signals to send it."""

    def __init__(self, popen: subprocess.Popen, name: str, stderr_path: str) -> None:
        self.popen = popen
        self.name = name
        self.stderr_path = stderr_path
        self.report: dict[str, Any] = {}
        self.noise: list[str] = []
        self._events: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    # ---- identity --------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def peer_id(self) -> str:
        return self.report["peer_id"]

    @property
    def maddrs(self) -> list[str]:
        return list(self.report["maddrs"])

    def group_pids(self) -> list[int]:
        """Every live process in this peer's process group (itself, DHT, p2pd...)."""
        return process_group_pids(self.pid)

    def p2pd_pids(self) -> list[int]:
        """Live p2pd daemons this peer spawned."""
        return [pid for pid in self.group_pids() if process_name(pid) == "p2pd"]

    def alive(self) -> bool:
        return self.popen.poll() is None

    # ---- events ----------------------------------------------------------------------

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                self.noise.append(line.rstrip("\n"))
                continue
            if isinstance(event, dict):
                self._events.put(event)
            else:
                self.noise.append(line.rstrip("\n"))
        self._events.put(_EOF)

    def next_event(
        self, timeout_s: float, match: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        """The next stdout event (satisfying `match`); TimeoutError after `timeout_s`.

        Events that do not match are dropped. Raises EOFError when the child's stdout closed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no matching event within {timeout_s}s")
            try:
                event = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            if event is _EOF:
                self._events.put(_EOF)  # stay at EOF for later readers
                raise EOFError(f"{self.name} closed stdout; stderr tail:\n{self.stderr_tail()}")
            if match is None or match(event):
                return event

    def send(self, message: dict[str, Any]) -> None:
        """Write one JSON line to the child's stdin."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(message) + "\n")
        self.popen.stdin.flush()

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message` with a fresh `"id"` and wait up to `timeout_s` for the reply."""
        request_id = next(self._ids)
        self.send({**message, "id": request_id})
        return self.next_event(timeout_s, lambda event: event.get("id") == request_id)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the readiness report; raises PeerFailedToStart if it is negative."""
        try:
            report = self.next_event(timeout_s, lambda event: "ready" in event)
        except (TimeoutError, EOFError) as e:
            raise PeerFailedToStart(f"{self.name} not ready: {e}\n{self.stderr_tail()}") from None
        self.report = report
        if not report["ready"]:
            raise PeerFailedToStart(f"{self.name} failed to start: {report}", report)
        return report

    def stderr_tail(self, num_bytes: int = 4000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - num_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # ---- signals ---------------------------------------------------------------------

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self, group: bool = True) -> None:
        """SIGKILL the whole process group (a machine dying), and reap the child.

        `group=False` kills only the peer's own process (the OOM killer's choice), leaving
        whatever it spawned to notice on its own.
        """
        if group:
            self._signal_group(signal.SIGKILL)
        elif self.alive():
            self.popen.kill()
        self.popen.wait(timeout=30)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM the peer (it shuts down cleanly); SIGKILL the group after `timeout_s`."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def suspend(self) -> None:
        """SIGSTOP the whole group: the peer (and its daemon) freeze, sockets stay open."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole group."""
        self._signal_group(signal.SIGCONT)

    def reap(self) -> None:
        """Kill whatever is left of the group, even orphans, and close pipes."""
        self._signal_group(signal.SIGCONT)
        self._signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            os.unlink(self.stderr_path)
        except OSError:
            pass


def launch_peer_process(args: Sequence[str], name: str | None = None) -> PeerProcess:
    """Launch `python <args...>` (a script path or `-m module`) without waiting for it."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    fd, stderr_path = tempfile.mkstemp(prefix="peer-", suffix=".stderr")
    with os.fdopen(fd, "wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,  # own process group: kill() reaches the daemons too
        )
    peer = PeerProcess(popen, name or f"peer-{popen.pid}", stderr_path)
    _LIVE.append(peer)
    return peer


def start_peer_process(
    args: Sequence[str], ready_timeout_s: float = 120, name: str | None = None
) -> PeerProcess:
    """Launch a peer and wait for its readiness line (PeerFailedToStart otherwise)."""
    peer = launch_peer_process(args, name)
    peer.wait_ready(ready_timeout_s)
    return peer


def start_peer_processes(
    many_args: Sequence[Sequence[str]], ready_timeout_s: float = 120
) -> list[PeerProcess]:
    """Launch several peers at the same instant, then wait until every one is ready."""
    peers = [launch_peer_process(args) for args in many_args]
    deadline = time.monotonic() + ready_timeout_s
    for peer in peers:
        peer.wait_ready(max(1.0, deadline - time.monotonic()))
    return peers


_LIVE: list[PeerProcess] = []


def reap_all() -> None:
    """Kill every peer launched so far (and its process group)."""
    while _LIVE:
        _LIVE.pop().reap()


_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _base58(data: bytes) -> str:
    number, text = int.from_bytes(data, "big"), ""
    while number:
        number, digit = divmod(number, 58)
        text = _B58[digit] + text
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + text


def write_identity(path: str | Path) -> str:
    """Write a libp2p Ed25519 identity file (no hivemind import here); returns its peer id.

    Lets a test know a peer's full multiaddr before the peer starts.
    """
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption())
    public = key.public_key().public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)
    # protobuf PrivateKey{Type=Ed25519(1), Data=seed||public}; PublicKey{Type=1, Data=public}
    Path(path).write_bytes(b"\x08\x01\x12\x40" + seed + public)
    public_proto = b"\x08\x01\x12\x20" + public
    return _base58(b"\x00" + bytes([len(public_proto)]) + public_proto)  # identity multihash


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (a race the caller accepts)."""
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
