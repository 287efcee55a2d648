"""The RPC framing both real transports speak, written once against a small stream interface.

    request   b"PDQ1" | u64 length | body in chunks of <= 1 MiB
    continue  0x01, receiver to caller, only before a body over one chunk (within the limit)
    response  b"PDS1" | u8 status  | u64 length | body in chunks of <= 1 MiB

The receiver reads the 12-byte request header first and refuses a request over its limit
without reading the body; the caller reads the response header first and refuses a
response over its limit the same way. docs/transport.md explains each rule.

hivemind's p2pd streams are asyncio, py-libp2p's are trio: each transport wraps its stream
in a `ByteStream` (reads and writes bounded by the transport's idle timeout, `within` for
an overall deadline), and the protocol below runs unchanged on either.

The receiver holds a stranger to a `Pace`: the request header within `grace_s`, then the
body on schedule (on average at least `min_bytes_per_s` since the grace ended), and the
response written within the same budget. An idle timeout alone let a caller hold a
handler slot for ever by trickling one byte every 50 s. The pace
bounds one stream's life, not a crowd of free identities that open theirs again at once
to keep every slot full: a full handler is therefore shared fairly (`ConcurrencyLimit.
admit`), a newcomer taking over the slot of a body being read for the caller reading
the most, and the stream taken over stops at once (`ByteStream.abort`).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass
from typing import Protocol

from p2pdiloco.transport.base import (
    CHUNK_BYTES,
    MIN_LINK_BYTES_PER_S,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
)
from p2pdiloco.transport.ratelimit import ConcurrencyLimit, Hold

logger = logging.getLogger(__name__)

PROTOCOL_PREFIX = "/p2pdiloco/rpc/1/"
REQUEST_HEADER = struct.Struct(">4sQ")
RESPONSE_HEADER = struct.Struct(">4sBQ")
REQUEST_MAGIC = b"PDQ1"
RESPONSE_MAGIC = b"PDS1"
STATUS_OK, STATUS_ERROR, STATUS_TOO_LARGE = 0, 1, 2
MAX_ERROR_BYTES = 4096
CONTINUE = b"\x01"


@dataclass(frozen=True)
class Pace:
    """How fast a stranger must move a frame it sends us, or read one we send it.

    `grace_s` to start (the request header, a first byte of the response read), then on
    average `min_bytes_per_s` at least: a frame of n bytes is done within
    `deadline_s(n)`, and a stream that falls behind that schedule is dropped at once,
    not at the end (so a trickler holds a slot about `grace_s`, whatever it declared).
    The default rate is a quarter of the slowest link a peer is expected to have (the
    caller's own deadline assumes the full rate), so an honest upload shared by a few
    streams keeps its pace.
    """

    grace_s: float = 10.0
    min_bytes_per_s: float = MIN_LINK_BYTES_PER_S / 4

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a frame of `nbytes` may take, start to end."""
        return self.grace_s + nbytes / self.min_bytes_per_s


DEFAULT_PACE = Pace()


class StreamEnded(ConnectionError):
    """The other side closed or reset the stream before the frame was complete."""


class TakenOver(StreamEnded):
    """A fairer caller took over this request's slot while its body was being read."""


class ByteStream(Protocol):
    """One RPC stream as the framing sees it; every wait raises TimeoutError when bounded."""

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        """Up to `n` bytes, b"" at the end of the stream; `idle_bound`: TimeoutError after
        the transport's idle timeout without a byte."""

    async def write(self, data: bytes) -> None:
        """Write and flush, TimeoutError after the idle timeout."""

    def within(self, seconds: float) -> AbstractAsyncContextManager[None]:
        """A deadline for a block of reads and writes: TimeoutError when it passes."""

    async def close(self) -> None:
        """Close the stream; never raises."""

    def abort(self) -> None:
        """Make a read in progress, and every later one, end at once (b"" or StreamEnded);
        synchronous, called on the loop (thread) that serves the stream; never raises."""


async def read_exactly(stream: ByteStream, length: int, idle_bound: bool = True) -> bytes:
    """Exactly `length` bytes in reads of <= CHUNK_BYTES; StreamEnded if the stream ends first."""
    parts, remaining = [], length
    while remaining > 0:
        chunk = await stream.read(min(CHUNK_BYTES, remaining), idle_bound)
        if not chunk:
            raise StreamEnded(f"stream ended {remaining} bytes before the end of a {length}-byte frame")
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)  # one copy; growing a bytearray and bytes()-ing it costs two


async def read_paced(
    stream: ByteStream, length: int, pace: Pace, started_s: float, hold: Hold | None = None
) -> bytes:
    """Exactly `length` bytes, on `pace`'s schedule counted from `started_s` (time.monotonic):
    TimeoutError as soon as the bytes received so far fall behind it; StreamEnded if the
    stream ends first. With a `hold`, its `due_s` follows the schedule (how far behind it
    the body is decides which slot a newcomer takes over), and TakenOver as soon as it is
    taken over."""
    parts, received = [], 0
    while received < length:
        # behind schedule once now > start + grace + received / rate
        due_s = started_s + pace.grace_s + received / pace.min_bytes_per_s
        if hold is not None:
            hold.due_s = due_s
            _check_held(hold)
        left_s = due_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"{received} of {length} bytes: slower than {pace.min_bytes_per_s:g} B/s")
        async with stream.within(left_s):
            chunk = await stream.read(min(CHUNK_BYTES, length - received))
        if hold is not None:
            _check_held(hold)
        if not chunk:
            raise StreamEnded(f"stream ended {length - received} bytes before the end of a {length}-byte frame")
        parts.append(chunk)
        received += len(chunk)
    return b"".join(parts)


def _check_held(hold: Hold) -> None:
    if hold.taken_over:
        raise TakenOver(f"the slot of {hold.caller} was taken over by a fairer caller")


async def write_body(stream: ByteStream, body: bytes) -> None:
    view = memoryview(body)
    for offset in range(0, len(view), CHUNK_BYTES):
        await stream.write(view[offset : offset + CHUNK_BYTES])


async def send_response(stream: ByteStream, status: int, body: bytes, pace: Pace = DEFAULT_PACE) -> None:
    """The response frame, written within `pace.deadline_s` of its size (a caller that
    reads slowly does not hold the handler's slot either)."""
    async with stream.within(pace.deadline_s(RESPONSE_HEADER.size + len(body))):
        await stream.write(RESPONSE_HEADER.pack(RESPONSE_MAGIC, status, len(body)))
        await write_body(stream, body)


async def _discard(stream: ByteStream, length: int, seconds: float) -> None:
    """Drain a small refused body (bounded) so the refusal reaches the caller."""
    with suppress(Exception):
        async with stream.within(seconds):
            while length > 0 and (chunk := await stream.read(min(CHUNK_BYTES, length))):
                length -= len(chunk)


async def serve_call(
    stream: ByteStream,
    name: str,
    caller: str,
    max_request: int,
    limit: ConcurrencyLimit,
    handler: Callable[[str, bytes], Awaitable[bytes]],
    pace: Pace = DEFAULT_PACE,
) -> None:
    """Answer one call on `stream` with `handler`; every fault is logged, none raised.

    The caller is held to `pace` from the first byte: a slot of `limit` is never held
    longer than `pace.deadline_s` of the declared size for the request, and of the
    response's size for the answer, plus the handler's own time. A full `limit` is shared
    fairly (`ConcurrencyLimit.admit`): this request may take over the slot of another
    caller's body being read, and while its own body is read, another caller may take
    over its slot (it then ends at once, logged as `rpc_dropped reason=TakenOver`)."""
    started_s = time.monotonic()
    try:
        header = await read_paced(stream, REQUEST_HEADER.size, pace, started_s)
        magic, length = REQUEST_HEADER.unpack(header)
        if magic != REQUEST_MAGIC:
            logger.warning("rpc_bad_frame name=%s caller=%s", name, caller)
            return
        if length > max_request:
            logger.warning(
                "rpc_rejected reason=request_too_large name=%s caller=%s bytes=%d limit=%d",
                name, caller, length, max_request,
            )  # fmt: skip
            message = f"request of {length} bytes exceeds limit of {max_request} bytes"
            await send_response(stream, STATUS_TOO_LARGE, message.encode(), pace)
            if length <= CHUNK_BYTES:  # sent unasked: drain it so the refusal lands
                await _discard(stream, length, 5)
            return
        # the body's schedule starts now: the header's grace was the caller's to use
        body_started_s = time.monotonic()
        # a stream without `abort` (a test's fake) still stops at its next read when taken over
        hold = limit.admit(caller, body_started_s + pace.grace_s, getattr(stream, "abort", None))
        if isinstance(hold, str):
            # Refused at the door, never queued: the body is not read.
            logger.warning(
                "rpc_rejected reason=too_many_concurrent name=%s caller=%s detail=%r", name, caller, hold
            )
            await send_response(stream, STATUS_ERROR, f"too many concurrent requests ({hold})".encode(), pace)
            if length <= CHUNK_BYTES:
                await _discard(stream, length, 1)
            return
        if hold.took_over_from is not None:
            logger.info("rpc_took_over name=%s caller=%s from=%s", name, caller, hold.took_over_from)
        try:
            if length > CHUNK_BYTES:
                await stream.write(CONTINUE)
            request = await read_paced(stream, length, pace, body_started_s, hold)
            if not limit.body_read(hold):
                raise TakenOver(f"slot of {caller} taken over")
            try:
                response, status = await handler(caller, request), STATUS_OK
            except Exception as exc:  # noqa: BLE001 - the handler's fault goes back to the caller
                logger.warning("handler_failed name=%s caller=%s error=%r", name, caller, exc)
                response, status = f"{type(exc).__name__}: {exc}".encode()[:MAX_ERROR_BYTES], STATUS_ERROR
            await send_response(stream, status, response, pace)
        finally:
            limit.give_back(hold)  # releases the slot unless it was taken over
    except (TimeoutError, ConnectionError) as exc:
        logger.info("rpc_dropped name=%s caller=%s reason=%s", name, caller, type(exc).__name__)
    except Exception:
        logger.exception("rpc_serve_failed name=%s caller=%s", name, caller)
    finally:
        await stream.close()


async def make_call(stream: ByteStream, request: bytes, peer_id: str, max_response: int) -> bytes:
    """Send `request` on a fresh stream and return the response body.

    Raises RemoteError / RequestTooLarge (the remote refused), ResponseTooLarge, StreamEnded
    or TimeoutError (idle); the caller maps the last two to its transport's errors.
    """
    await stream.write(REQUEST_HEADER.pack(REQUEST_MAGIC, len(request)))
    if len(request) > CHUNK_BYTES:
        # Like HTTP's "Expect: 100-continue": a large body waits for the receiver to accept
        # its size, so a refused upload costs one round trip, not the payload.
        first = await read_exactly(stream, 1)
        if first != CONTINUE:
            return await _receive_response(stream, peer_id, max_response, first)
    await write_body(stream, request)
    return await _receive_response(stream, peer_id, max_response)


async def _receive_response(stream: ByteStream, peer_id: str, max_response: int, head: bytes = b"") -> bytes:
    # No idle bound on the header: the handler may compute for a while; the call's deadline rules.
    header = head + await read_exactly(stream, RESPONSE_HEADER.size - len(head), idle_bound=False)
    magic, status, length = RESPONSE_HEADER.unpack(header)
    if magic != RESPONSE_MAGIC:
        raise RemoteError(f"peer {peer_id} answered with a malformed frame")
    if status != STATUS_OK:
        body = await read_exactly(stream, min(length, MAX_ERROR_BYTES))
        kind = RequestTooLarge if status == STATUS_TOO_LARGE else RemoteError
        raise kind(f"peer {peer_id} refused the call: {body.decode(errors='replace')}")
    if length > max_response:
        raise ResponseTooLarge(f"response of {length} bytes from {peer_id} exceeds max_response_bytes={max_response}")
    return await read_exactly(stream, length)
