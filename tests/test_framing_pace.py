"""The RPC framing holds a stranger to a pace: a slot is never held by a peer that trickles.

A fake `ByteStream` plays the caller: it sends a request header and then its body at a
chosen rate. The server side (`framing.serve_call`) must drop a body that falls behind
`Pace` (issue 28, item 2: a per-read idle timeout let one byte every 50 s hold a slot for
ever) and must still take an honest body that keeps the pace.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from p2pdiloco.transport import framing
from p2pdiloco.transport.ratelimit import ConcurrencyLimit


class TrickleStream:
    """A caller sending `header + body`, `bytes_per_read` bytes every `gap_s` seconds; the
    idle timeout (like a real transport's) is `idle_s`, longer than every gap."""

    def __init__(
        self, body: bytes, bytes_per_read: int, gap_s: float, idle_s: float = 60.0, header_at_once: bool = False
    ) -> None:
        self.data = framing.REQUEST_HEADER.pack(framing.REQUEST_MAGIC, len(body)) + body
        self.bytes_per_read, self.gap_s, self.idle_s = bytes_per_read, gap_s, idle_s
        self.header_left = framing.REQUEST_HEADER.size if header_at_once else 0
        """Header bytes still to send at once (a trickler of the body only)."""
        self.sent = bytearray()
        self.closed = False

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        if self.header_left:
            size = min(n, self.header_left)
            self.header_left -= size
        else:
            await asyncio.sleep(self.gap_s)  # the trickler's next byte (within the idle timeout)
            size = min(n, self.bytes_per_read)
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk

    async def write(self, data: bytes) -> None:
        self.sent += data

    @asynccontextmanager
    async def within(self, seconds: float):
        async with asyncio.timeout(seconds):
            yield

    async def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.data = b""  # the next read ends the stream


def serve(stream: TrickleStream, limit: ConcurrencyLimit, pace: framing.Pace, calls: list[bytes]):
    async def handler(caller: str, request: bytes) -> bytes:
        calls.append(request)
        return b"ok"

    return framing.serve_call(stream, "contribute", "trickler", 1 << 20, limit, handler, pace)


def test_a_body_trickled_slower_than_the_pace_is_dropped_and_its_slot_given_back() -> None:
    pace = framing.Pace(grace_s=0.3, min_bytes_per_s=1000)

    async def main() -> None:
        limit = ConcurrencyLimit(max_in_flight=2, max_per_caller=1)
        held: list[int] = []  # slots the trickler held, seen when it took one (a loaded
        # machine may run the whole drop between two polls of the test)
        acquire = limit.try_acquire

        def noted_acquire(caller: str) -> str | None:
            refusal = acquire(caller)
            held.append(limit.of(caller))
            return refusal

        limit.try_acquire = noted_acquire  # type: ignore[method-assign]
        # the header at once, then one byte every 20 ms: 50 B/s, far below 1000 B/s, yet
        # never idle for the transport. (Trickled, the 12-byte header took 0.24 s of the
        # 0.3 s grace: a loaded machine's late sleeps dropped it before it took a slot.)
        stream = TrickleStream(b"x" * 2000, bytes_per_read=1, gap_s=0.02, header_at_once=True)
        calls: list[bytes] = []
        task = asyncio.ensure_future(serve(stream, limit, pace, calls))
        while not held and not task.done():
            await asyncio.sleep(0.01)
        assert held == [1]  # it got a slot once its header came
        # the whole body at the pace would take 0.3 + 2 s; a trickler is dropped near 0.3 s
        await asyncio.wait_for(task, 1.5)
        assert limit.in_flight == 0 and limit.of("trickler") == 0
        assert calls == [] and stream.closed

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_header_trickled_past_the_grace_is_dropped_before_taking_a_slot() -> None:
    pace = framing.Pace(grace_s=0.2, min_bytes_per_s=1000)

    async def main() -> None:
        limit = ConcurrencyLimit(max_in_flight=2, max_per_caller=1)
        stream = TrickleStream(b"x" * 10, bytes_per_read=1, gap_s=0.1)  # 12 header bytes: 1.2 s
        calls: list[bytes] = []
        await asyncio.wait_for(serve(stream, limit, pace, calls), 1.0)
        assert limit.in_flight == 0 and calls == [] and stream.closed

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_honest_body_that_keeps_the_pace_is_served() -> None:
    pace = framing.Pace(grace_s=0.3, min_bytes_per_s=1000)

    async def main() -> None:
        limit = ConcurrencyLimit(max_in_flight=2, max_per_caller=1)
        # 100 bytes every 10 ms: ~10 kB/s, ten times the pace
        stream = TrickleStream(b"y" * 3000, bytes_per_read=100, gap_s=0.01)
        calls: list[bytes] = []
        await asyncio.wait_for(serve(stream, limit, pace, calls), 10)
        assert calls == [b"y" * 3000]
        header = framing.RESPONSE_HEADER.unpack(bytes(stream.sent[: framing.RESPONSE_HEADER.size]))
        assert header == (framing.RESPONSE_MAGIC, framing.STATUS_OK, 2)
        assert limit.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_default_pace_gives_an_honest_upload_more_time_than_its_caller_does() -> None:
    """The caller's own deadline (`transfer_timeout_s`) assumes the full link rate; the
    server allows a quarter of it, so it never cuts off what its caller still waits for."""
    from p2pdiloco.transport.base import transfer_timeout_s

    for nbytes in (0, 1 << 20, 64 << 20):
        assert framing.DEFAULT_PACE.deadline_s(nbytes) >= transfer_timeout_s(0, nbytes)
