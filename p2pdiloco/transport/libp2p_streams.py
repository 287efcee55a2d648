"""py-libp2p streams under the RPC framing (on the trio thread).

`TrioStream` is a py-libp2p stream as the framing's `ByteStream` (trio deadlines turned
into TimeoutError, resets into `StreamEnded`); `call_over_stream` is one call on a fresh
stream, py-libp2p's many failure types mapped to the transport's errors; `LockedLimit` is
a handler's concurrency cap shared by the trio thread (serving) and asyncio (calls to self).
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager, suppress
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import ProtocolNotSupportedError

from p2pdiloco.transport import framing
from p2pdiloco.transport.base import PeerUnreachable, RemoteError
from p2pdiloco.transport.ratelimit import ConcurrencyLimit, Hold


class TrioStream:
    """A py-libp2p stream as the framing's `ByteStream` (used on the trio thread)."""

    def __init__(self, stream: Any, idle_s: float) -> None:
        self.stream, self.idle_s = stream, idle_s
        self._aborted = False
        self._reading: trio.CancelScope | None = None

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        if self._aborted:
            return b""
        try:
            with (
                trio.CancelScope() as self._reading,
                trio.fail_after(self.idle_s if idle_bound else float("inf")),
            ):
                return await self.stream.read(n)
        except StreamEOF:
            return b""
        except StreamError as exc:
            raise framing.StreamEnded(f"stream reset: {type(exc).__name__}") from None
        except trio.TooSlowError:
            raise TimeoutError("no byte within the idle timeout") from None
        finally:
            self._reading = None
        return b""  # reached only when `abort` cancelled the read

    def abort(self) -> None:
        self._aborted = True
        if self._reading is not None:
            self._reading.cancel()

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


async def call_over_stream(
    host: Any, remote: ID, peer_id: str, name: str, request: bytes, max_response: int, idle_s: float
) -> bytes:
    """Call RPC `name` of the connected peer `remote` (`peer_id`) on a fresh stream; raises
    RemoteError, PeerUnreachable, the framing's size errors, or TimeoutError (idle)."""
    try:
        stream = await host.new_stream(remote, [TProtocol(framing.PROTOCOL_PREFIX + name)])
    except StreamFailure as exc:
        cause = exc.__cause__
        if isinstance(cause, ProtocolNotSupportedError) or "protocols not supported" in str(cause):
            raise RemoteError(f"peer {peer_id} has no handler {name!r}") from None
        raise PeerUnreachable(f"cannot open a stream to {peer_id}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - py-libp2p raises many kinds on a lost connection
        raise PeerUnreachable(f"cannot open a stream to {peer_id}: {type(exc).__name__}") from None
    wrapped = TrioStream(stream, idle_s)
    try:
        return await framing.make_call(wrapped, request, peer_id, max_response)
    except ConnectionError as exc:
        raise PeerUnreachable(f"peer {peer_id} closed the stream: {exc}") from None
    finally:
        await wrapped.close()


class LockedLimit(ConcurrencyLimit):
    """A `ConcurrencyLimit` shared by the trio thread (serving) and asyncio (calls to self).

    Only the trio thread's streams read bodies, so only they take over a slot (calls to
    self use `try_acquire` / `release`): a victim's `abort` runs on its own thread."""

    def __init__(self, max_in_flight: int, max_per_caller: int) -> None:
        super().__init__(max_in_flight, max_per_caller)
        self._lock = threading.RLock()  # admit and give_back call try_acquire and release

    def try_acquire(self, caller: str) -> str | None:
        with self._lock:
            return super().try_acquire(caller)

    def release(self, caller: str) -> None:
        with self._lock:
            super().release(caller)

    # admit -> _take_over calls the victim's `abort` under the lock: a TrioStream's only
    # cancels a scope (it never takes this lock), so that cannot deadlock.
    def admit(self, caller: str, due_s: float, abort: Any = None) -> Hold | str:
        with self._lock:
            return super().admit(caller, due_s, abort)

    def body_read(self, hold: Hold) -> bool:
        with self._lock:
            return super().body_read(hold)

    def give_back(self, hold: Hold) -> None:
        with self._lock:
            super().give_back(hold)
