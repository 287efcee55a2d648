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
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2pdiloco.cli.launcher import Child, ChildFailedToStart, reap_all, wait_all_ready

__all__ = [
    "REPO_ROOT",
    "TRANSPORT_PEER",
    "PeerFailedToStart",
    "PeerProcess",
    "free_port",
    "launch_peer_process",
    "pid_alive",
    "process_group_pids",
    "process_name",
    "reap_all",
    "start_peer_process",
    "start_peer_processes",
    "write_identity",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
TRANSPORT_PEER = Path(__file__).resolve().parent / "transport_peer.py"

PeerFailedToStart = ChildFailedToStart
"""The child exited or reported `"ready": false` before it was ready (`.report`)."""


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


class PeerProcess(Child):
    """A running child peer: its readiness report, its events, and signals to send it.

    Starting, reading, waiting, stopping and reaping are `p2pdiloco.cli.launcher.Child`'s;
    this adds the peer's identity, its stdin requests and its process-group probes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ids = itertools.count(1)

    # ---- identity --------------------------------------------------------------------

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

    # ---- events ----------------------------------------------------------------------

    def next_event(
        self, timeout_s: float, match: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        """The next stdout event (satisfying `match`); TimeoutError after `timeout_s`.

        Events that do not match are dropped. Raises EOFError when the child's stdout closed.
        """
        return self.wait_event(match, timeout_s)

    def send(self, message: dict[str, Any]) -> None:
        """Write one JSON line to the child's stdin."""
        self.write_line(json.dumps(message))

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message` with a fresh `"id"` and wait up to `timeout_s` for the reply."""
        request_id = next(self._ids)
        self.send({**message, "id": request_id})
        return self.next_event(timeout_s, lambda event: event.get("id") == request_id)

    # ---- signals ---------------------------------------------------------------------

    def kill(self, group: bool = True) -> int | None:  # type: ignore[override]
        """SIGKILL the whole process group (a machine dying), and reap the child.

        `group=False` kills only the peer's own process (the OOM killer's choice), leaving
        whatever it spawned to notice on its own.
        """
        if group:
            return super().kill()
        if self.alive():
            self.popen.kill()
        return self.wait_exit(30)

    def suspend(self) -> None:
        """SIGSTOP the whole group: the peer (and its daemon) freeze, sockets stay open."""
        self.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole group."""
        self.signal_group(signal.SIGCONT)


def launch_peer_process(
    args: Sequence[str], name: str | None = None, env: dict[str, str] | None = None
) -> PeerProcess:
    """Launch `python <args...>` (a script path or `-m module`) without waiting for it;
    `env` entries are added to its environment."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    peer = PeerProcess.spawn(
        [sys.executable, *map(str, args)],
        name,
        cwd=REPO_ROOT,
        env={**(env or {}), "PYTHONPATH": pythonpath},
        stdin=True,
    )
    if name is None:
        peer.name = f"peer-{peer.pid}"
    return peer


def start_peer_process(
    args: Sequence[str], ready_timeout_s: float = 120, name: str | None = None
) -> PeerProcess:
    """Launch a peer and wait for its readiness line (PeerFailedToStart otherwise)."""
    peer = launch_peer_process(args, name)
    peer.wait_ready(ready_timeout_s)
    return peer


def start_peer_processes(
    many_args: Sequence[Sequence[str]],
    ready_timeout_s: float = 120,
    envs: Sequence[dict[str, str] | None] | None = None,
) -> list[PeerProcess]:
    """Launch several peers at the same instant, then wait until every one is ready."""
    envs = envs or [None] * len(many_args)
    peers = [launch_peer_process(args, env=env) for args, env in zip(many_args, envs, strict=True)]
    wait_all_ready(peers, ready_timeout_s)
    return peers


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
