"""Child processes that report on stdout: start, read, wait, stop and reap them.

One launcher for `p2pdiloco demo`, the networked tests (tests/net/harness.py) and
scripts/bench_swarm.py. A child prints one JSON object per stdout line: the first line
with a `"ready"` key is its readiness report, `{"event": "stopped"}` says it has left
(only its interpreter's teardown remains), every other object is an event. Non-JSON
lines are kept in `Child.noise`.

Each child runs in its own session, so `kill()` and `reap()` reach its whole process
group: hivemind's DHT process and its p2pd daemon too. Every wait has a deadline; none
is a sleep.

Stopping a child that already left: at teardown Python resets its signal handlers to
the default, so a SIGTERM landing then kills a peer that finished cleanly (exit -15).
`stop()` therefore reads whatever the pipe holds, under the same lock as the reader
thread, right before it signals: if the child printed "stopped" by then, it is not
signalled at all and only its exit is awaited. A child still running when signalled
handles the signal and leaves with its own exit code, so a -15 means a real fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import psutil

__all__ = ["STOPPED", "Child", "ChildFailedToStart", "live_children", "reap_all", "wait_all_ready"]

STOPPED = "stopped"
"""The event a child prints once it has left: a stop signal after it is not needed."""

Event = dict[str, Any]


class ChildFailedToStart(RuntimeError):
    """The child exited, timed out or reported `"ready": false` before it was ready."""

    def __init__(self, message: str, report: Event | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


class Child:
    """A child process, the events it printed and the signals to send its group."""

    def __init__(self, popen: subprocess.Popen, name: str, stderr_path: str | None) -> None:
        self.popen = popen
        self.name = name
        self.stderr_path = stderr_path
        self.report: Event = {}
        """The readiness report, once `wait_ready` returned it."""
        self.events: list[Event] = []
        """Every JSON object printed so far, the readiness report included, in order."""
        self.noise: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0  # `wait_event` consumes events up to here
        self._partial = b""
        self._eof = False
        self._left = False
        self._signalled = False
        self._reaped = False
        assert popen.stdout is not None
        self._fd = popen.stdout.fileno()
        os.set_blocking(self._fd, False)  # the reader and `stop()` both drain it, never block
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-out", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        name: str | None = None,
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
    ) -> Self:
        """Start `argv` in a new session with stdout piped and stderr in a temporary file.

        `env` entries are added to this process's environment; `stdin` opens a pipe for
        `write_line` (else the child reads /dev/null). Registered for `reap_all()`.
        """
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        fd, stderr_path = tempfile.mkstemp(prefix=f"p2pdiloco-{name or 'child'}-", suffix=".log")
        with os.fdopen(fd, "wb") as stderr:
            popen = subprocess.Popen(
                [str(arg) for arg in argv],
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=cwd,
                env=full_env,
                start_new_session=True,  # its own group: kill() reaches its daemons too
            )
        child = cls(popen, name or f"child-{popen.pid}", stderr_path)
        with _LIVE_LOCK:
            _LIVE.append(child)
        return child

    # ---- state -----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        """True until the child process exited."""
        return self.popen.poll() is None

    @property
    def left(self) -> bool:
        """Whether the child printed `{"event": "stopped"}` (it left, teardown remains)."""
        with self._cond:
            return self._left

    def of(self, kind: str) -> list[Event]:
        """Every event of this kind printed so far (consumes nothing)."""
        with self._cond:
            return [e for e in self.events if e.get("event") == kind]

    def first(self, kind: str) -> Event | None:
        """The first event of this kind printed so far, if any."""
        found = self.of(kind)
        return found[0] if found else None

    def stderr_tail(self, num_bytes: int = 4000) -> str:
        """The end of the child's stderr ("" when there is none)."""
        if self.stderr_path is None:
            return ""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - num_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # ---- stdout ----------------------------------------------------------------------

    def _read_loop(self) -> None:
        """The reader thread: wait for output without the lock, read it with the lock."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            poller.poll()
            with self._cond:
                self._drain()
                if self._eof:
                    return

    def _drain(self) -> None:
        """Take in everything the pipe holds now; never blocks (call with the lock held)."""
        while not self._eof:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            if not chunk:
                self._eof = True
                lines.append(self._partial)
            for line in lines:
                self._take(line.decode(errors="replace").rstrip("\r"))
            self._cond.notify_all()

    def _take(self, line: str) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = None
        if isinstance(event, dict):
            self.events.append(event)
            if event.get("event") == STOPPED:
                self._left = True
        elif line:
            self.noise.append(line)

    def wait_event(self, match: Callable[[Event], bool] | None, timeout_s: float) -> Event:
        """The next unconsumed event satisfying `match` (any, if None); skipped ones are consumed.

        TimeoutError after `timeout_s`; EOFError once stdout closed with no match left.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                while self._cursor < len(self.events):
                    event = self.events[self._cursor]
                    self._cursor += 1
                    if match is None or match(event):
                        return event
                if self._eof:
                    raise EOFError(f"{self.name} closed stdout; stderr tail:\n{self.stderr_tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: no matching event within {timeout_s}s")
                self._cond.wait(remaining)

    def wait_ready(self, timeout_s: float) -> Event:
        """The readiness report; ChildFailedToStart if none comes in time or it is negative."""
        try:
            report = self.wait_event(lambda event: "ready" in event, timeout_s)
        except TimeoutError:
            raise ChildFailedToStart(
                f"{self.name} not ready within {timeout_s:.0f}s\n{self.stderr_tail()}"
            ) from None
        except EOFError:
            raise ChildFailedToStart(
                f"{self.name} exited before it was ready\n{self.stderr_tail()}"
            ) from None
        self.report = report
        if not report["ready"]:
            raise ChildFailedToStart(f"{self.name} failed to start: {report}", report)
        return report

    # ---- stdin -----------------------------------------------------------------------

    def write_line(self, line: str) -> None:
        """Write one line to the child's stdin (spawned with `stdin=True`)."""
        assert self.popen.stdin is not None, f"{self.name} has no stdin pipe"
        self.popen.stdin.write(line.rstrip("\n").encode() + b"\n")
        self.popen.stdin.flush()

    # ---- signals and exit ------------------------------------------------------------

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the child's whole process group (if any of it is left)."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def request_stop(self, signum: int = signal.SIGTERM) -> bool:
        """Ask the child to leave, once, unless it already left; True if it was signalled.

        The pipe is read under the reader's lock first, so a "stopped" line the child
        printed before this call is always seen: such a child is never signalled.
        """
        with self._cond:
            self._drain()
            if self._left or self._signalled or not self.alive():
                return False
            self._signalled = True
            try:
                self.popen.send_signal(signum)
            except ProcessLookupError:
                return False
            return True

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code (-N: killed by signal N), or None if still running after `timeout_s`.

        Once the child exited, every line it printed is read before this returns.
        """
        try:
            code = self.popen.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return None
        with self._cond:
            self._drain()
        return code

    def stop(self, timeout_s: float = 30.0, signum: int = signal.SIGTERM) -> int:
        """Stop the child and return its exit code; SIGKILL its group after `timeout_s`.

        A child that already printed "stopped" is not signalled, only awaited: a signal
        during its teardown would kill it after a clean leave.
        """
        self.request_stop(signum)
        code = self.wait_exit(timeout_s)
        if code is None:
            code = self.kill()
        return code if code is not None else self.popen.returncode

    def kill(self, timeout_s: float = 30.0) -> int | None:
        """SIGKILL the whole process group (a machine dying); the exit code once reaped."""
        self.signal_group(signal.SIGKILL)
        return self.wait_exit(timeout_s)

    def reap(self) -> None:
        """Kill whatever is left of the group (frozen members too), close pipes, clean up.

        Once only: a second call must not signal a process group whose id was reused.
        """
        if self._reaped:
            return
        self._reaped = True
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        self.wait_exit(30.0)
        self._reader.join(5.0)  # a survivor outside the group may still hold the pipe
        streams = [self.popen.stdin]
        if not self._reader.is_alive():
            streams.append(self.popen.stdout)  # the reader no longer polls its fd
        for stream in streams:
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self.stderr_path is not None:
            try:
                os.unlink(self.stderr_path)
            except OSError:
                pass
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)


def wait_all_ready(children: Sequence[Child], timeout_s: float) -> list[Event]:
    """Wait until every child is ready, all within one deadline; their reports."""
    deadline = time.monotonic() + timeout_s
    return [child.wait_ready(max(deadline - time.monotonic(), 1.0)) for child in children]


_LIVE: list[Child] = []
_LIVE_LOCK = threading.Lock()


def live_children() -> list[Child]:
    """Children spawned and not reaped yet."""
    with _LIVE_LOCK:
        return list(_LIVE)


def reap_all() -> None:
    """Reap every child spawned and not reaped yet (fixtures and atexit)."""
    for child in reversed(live_children()):
        child.reap()


def machine_busy_s() -> float:
    """CPU seconds this machine's cores have spent busy since boot (all processes)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by process `pid` and its live descendants (0 for those gone)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                cpu = process.cpu_times()
                total += cpu.user + cpu.system
    except psutil.Error:
        pass
    return total
