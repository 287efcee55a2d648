"""Fair sharing of a full handler on the libp2p transport (issue 28, item 2): the same
`framing.serve_call` on trio, with `TrioStream` and the thread-safe `LockedLimit`.

Run in a child interpreter by tests/test_fair_slots_libp2p.py: py-libp2p and hivemind
cannot share a process (duplicate protobuf symbols).
"""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from p2pdiloco.transport import framing
from p2pdiloco.transport.libp2p_streams import LockedLimit, TrioStream
from p2pdiloco.transport.ratelimit import Hold

PACE = framing.Pace(grace_s=2.0, min_bytes_per_s=1000)


class FakeLibp2pStream:
    """A py-libp2p stream's surface: the request header at once, then `bytes_per_read`
    bytes every `gap_s` (a trickler's gap may be far longer than the test)."""

    def __init__(self, body_bytes: int, bytes_per_read: int, gap_s: float) -> None:
        self.data = (
            framing.REQUEST_HEADER.pack(framing.REQUEST_MAGIC, body_bytes) + b"x" * body_bytes
        )
        self.bytes_per_read, self.gap_s = bytes_per_read, gap_s
        self.header_sent = False
        self.sent = bytearray()
        self.closed = False

    async def read(self, n: int) -> bytes:
        if self.header_sent:
            await trio.sleep(self.gap_s)
        size = min(n, self.bytes_per_read if self.header_sent else framing.REQUEST_HEADER.size)
        self.header_sent = True
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk

    async def write(self, data: bytes) -> None:
        self.sent += data

    async def close(self) -> None:
        self.closed = True


def test_aborting_a_trio_stream_ends_its_pending_read_at_once() -> None:
    async def main() -> None:
        stream = TrioStream(FakeLibp2pStream(10, 1, gap_s=3600), idle_s=3600)
        assert len(await stream.read(100)) == framing.REQUEST_HEADER.size
        results: list[bytes] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(results, stream.read(100)))
            await trio.testing.wait_all_tasks_blocked()
            stream.abort()
        assert results == [b""]
        assert await stream.read(100) == b""  # and every read after it

    trio.run(_bounded, main)


def test_a_newcomer_takes_over_a_trickled_slot_on_the_trio_side() -> None:
    async def main() -> None:
        limit = LockedLimit(max_in_flight=2, max_per_caller=2)
        served: list[str] = []

        async def handler(caller: str, request: bytes) -> bytes:
            served.append(caller)
            return b"ok"

        # one byte a second: two bodies of "slow" fill the handler within the grace
        slow = [FakeLibp2pStream(60_000, 1, gap_s=1.0) for _ in range(2)]
        honest = FakeLibp2pStream(500, 500, gap_s=0.01)
        async with trio.open_nursery() as nursery:
            for raw in slow:
                call = partial(
                    framing.serve_call,
                    TrioStream(raw, 60),
                    "contribute",
                    "slow",
                    1 << 20,
                    limit,
                    handler,
                )
                nursery.start_soon(call, PACE)
            await trio.testing.wait_all_tasks_blocked()
            assert limit.in_flight == 2 and limit.reading_of("slow") == 2
            with trio.fail_after(5):
                await framing.serve_call(
                    TrioStream(honest, 60), "contribute", "honest", 1 << 20, limit, handler, PACE
                )
            assert served == ["honest"] and limit.of("slow") == 1
            assert sum(raw.closed for raw in slow) == 1  # the one taken over ended at once
        assert limit.in_flight == 0 and limit.reading_of("slow") == 0
        header = framing.RESPONSE_HEADER.unpack(bytes(honest.sent[: framing.RESPONSE_HEADER.size]))
        assert header[1] == framing.STATUS_OK

    trio.run(_bounded, main)


def test_the_locked_limit_takes_over_under_its_own_lock() -> None:
    """admit and give_back call try_acquire and release, which lock too: no self-deadlock."""
    limit = LockedLimit(max_in_flight=2, max_per_caller=2)
    victim, other = limit.admit("A", 1.0), limit.admit("A", 2.0)
    newcomer = limit.admit("B", 3.0)
    assert isinstance(newcomer, Hold) and isinstance(victim, Hold) and victim.taken_over
    for hold in (victim, other, newcomer):
        limit.give_back(hold)
    assert limit.in_flight == 0


async def _append(results: list[bytes], read) -> None:
    results.append(await read)


async def _bounded(main) -> None:
    with trio.fail_after(30):
        await main()
