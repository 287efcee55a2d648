"""A full RPC handler is shared fairly: free identities cannot keep a newcomer out
(issue 28, item 2).

The pace drops one slow body within its grace, but nine free identities that open a
slow stream again as soon as one is dropped keep all 64 slots of a handler full: the
freed slot is always theirs again, and an honest caller was refused every time. Now a
caller reading fewer bodies than another caller by two or more takes over that caller's
slot (the body furthest behind its pace), and the stream taken over stops at once.

- the rules, on `ConcurrencyLimit` alone (who may take over whom; counts exact);
- the attack, on fake streams through `framing.serve_call`: 9 callers x 8 trickling
  streams, re-opened at once; an honest call is admitted at once and served;
- the hivemind stream's `abort` ends a pending read on a real socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextlib import suppress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.transport import framing
from p2pdiloco.transport.ratelimit import ConcurrencyLimit, Hold

# ---------------------------------------------------------------------------------------
# the rules


def admit(
    limit: ConcurrencyLimit, caller: str, due_s: float, aborted: list[str] | None = None
) -> Hold:
    hold = limit.admit(
        caller, due_s, None if aborted is None else (lambda: aborted.append(f"{caller}@{due_s}"))
    )
    assert isinstance(hold, Hold), hold
    return hold


def test_a_newcomer_takes_over_the_heaviest_callers_slowest_body_when_the_handler_is_full() -> None:
    limit = ConcurrencyLimit(max_in_flight=4, max_per_caller=4)
    aborted: list[str] = []
    a_fast, a_slow, a_mid = (admit(limit, "A", due, aborted) for due in (30.0, 10.0, 20.0))
    b = admit(limit, "B", 5.0, aborted)  # B is the slowest, but reads one body only
    assert limit.in_flight == 4

    newcomer = admit(limit, "C", 40.0, aborted)
    assert newcomer.took_over_from == "A" and a_slow.taken_over and aborted == ["A@10.0"]
    assert limit.in_flight == 4 and limit.of("A") == 2 and limit.of("C") == 1
    assert not (a_fast.taken_over or a_mid.taken_over or b.taken_over)

    # the slot went to C: A's stream, ending, gives nothing back (once or twice)
    limit.give_back(a_slow)
    limit.give_back(a_slow)
    assert limit.in_flight == 4 and limit.of("A") == 2
    for hold in (a_fast, a_mid, b, newcomer):
        limit.give_back(hold)
    assert limit.in_flight == 0 and limit._per_caller == {} and limit._reading == {}


def test_a_callers_last_body_is_never_taken_over_and_equals_do_not_swap() -> None:
    limit = ConcurrencyLimit(max_in_flight=4, max_per_caller=4)
    for caller in "ABCD":
        admit(limit, caller, 1.0)
    assert "4 requests in flight" in limit.admit("E", 2.0)  # everyone reads one body

    limit = ConcurrencyLimit(max_in_flight=4, max_per_caller=4)
    for caller, due in (("A", 1.0), ("A", 2.0), ("B", 3.0), ("C", 4.0)):
        admit(limit, caller, due)
    # B reads one body, A two: taking one would only swap who holds two
    assert isinstance(limit.admit("B", 5.0), str)
    assert isinstance(admit(limit, "D", 5.0), Hold)  # D reads none: it takes one of A's
    assert limit.of("A") == 1 and limit.of("D") == 1


def test_a_body_read_to_the_end_is_never_taken_over() -> None:
    limit = ConcurrencyLimit(max_in_flight=2, max_per_caller=2)
    first, second = admit(limit, "A", 1.0), admit(limit, "A", 2.0)
    assert limit.body_read(first) and limit.body_read(second)  # both in the handler now
    assert "2 requests in flight" in limit.admit("B", 3.0)
    limit.give_back(first)
    limit.give_back(second)
    assert limit.in_flight == 0


def test_the_per_caller_cap_still_refuses_and_calls_without_a_body_count_as_before() -> None:
    limit = ConcurrencyLimit(max_in_flight=3, max_per_caller=1)
    admit(limit, "A", 1.0)
    assert "caller has 1 requests in flight" in limit.admit("A", 2.0)
    # a call to self (no stream, no body read) holds a slot that is never taken over
    assert limit.try_acquire("self") is None and limit.try_acquire("other") is None
    assert isinstance(limit.admit("B", 3.0), str)


def test_a_taken_over_hold_reports_it_when_its_body_is_complete() -> None:
    limit = ConcurrencyLimit(max_in_flight=2, max_per_caller=2)
    victim, _ = admit(limit, "A", 1.0), admit(limit, "A", 2.0)
    admit(limit, "B", 3.0)
    assert victim.taken_over and not limit.body_read(victim)


@settings(max_examples=examples(200))
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["admit", "body_read", "give_back"]),
            st.integers(0, 5),
            st.floats(0, 100),
        ),
        max_size=80,
    )
)
def test_counts_stay_exact_whatever_the_order(steps: list[tuple[str, int, float]]) -> None:
    """Slots in flight are always the holds not yet given back nor taken over, within
    both caps; a newcomer reading no body is refused only if nobody reads two."""
    limit = ConcurrencyLimit(max_in_flight=6, max_per_caller=3)
    holds: list[Hold] = []
    for action, who, due in steps:
        caller = "ABCDEF"[who]
        if action == "admit":
            reading_before = {c: limit.reading_of(c) for c in "ABCDEF"}
            result = limit.admit(caller, due)
            if isinstance(result, Hold):
                holds.append(result)
            elif limit.of(caller) < limit.max_per_caller and reading_before[caller] == 0:
                assert max(reading_before.values()) <= 1
        else:
            mine = [h for h in holds if h.caller == caller]
            if mine:
                getattr(limit, action)(mine[len(mine) // 2])
        live = [h for h in holds if not h.ended and not h.taken_over]
        assert limit.in_flight == len(live) <= limit.max_in_flight
        for c in "ABCDEF":
            assert limit.of(c) == sum(h.caller == c for h in live) <= limit.max_per_caller
            assert limit.reading_of(c) == sum(h.caller == c and h.reading for h in live)
    for hold in holds:
        limit.give_back(hold)
    assert limit.in_flight == 0 and limit._per_caller == {} and limit._reading == {}


# ---------------------------------------------------------------------------------------
# the attack, through the framing, on fake streams


class CallerStream:
    """A caller's stream: the request header at once, then the body `bytes_per_read`
    bytes every `gap_s`. `abort` ends a pending read as a closed socket does (b"")."""

    def __init__(self, body_bytes: int, bytes_per_read: int, gap_s: float) -> None:
        self.data = (
            framing.REQUEST_HEADER.pack(framing.REQUEST_MAGIC, body_bytes) + b"x" * body_bytes
        )
        self.bytes_per_read, self.gap_s = bytes_per_read, gap_s
        self.header_sent = False
        self.aborted = asyncio.Event()
        self.aborts = 0
        self.sent = bytearray()
        self.closed = False

    async def read(self, n: int, idle_bound: bool = True) -> bytes:
        if self.header_sent:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.aborted.wait(), self.gap_s)
        if self.aborted.is_set():
            return b""
        size = min(n, self.bytes_per_read if self.header_sent else framing.REQUEST_HEADER.size)
        self.header_sent = True
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk

    async def write(self, data: bytes) -> None:
        self.sent += data

    def within(self, seconds: float):
        return asyncio.timeout(seconds)

    async def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()

    def status(self) -> int | None:
        if len(self.sent) < framing.RESPONSE_HEADER.size:
            return None
        return framing.RESPONSE_HEADER.unpack(bytes(self.sent[: framing.RESPONSE_HEADER.size]))[1]


class CountingLimit(ConcurrencyLimit):
    """Counts slots released, and checks the global cap at every admission."""

    def __init__(self, max_in_flight: int, max_per_caller: int) -> None:
        super().__init__(max_in_flight, max_per_caller)
        self.admitted = self.released = self.taken_over = 0

    def admit(self, caller, due_s, abort=None):
        hold = super().admit(caller, due_s, abort)
        assert self.in_flight <= self.max_in_flight
        if isinstance(hold, Hold):
            self.admitted += 1
            self.taken_over += hold.took_over_from is not None
        return hold

    def release(self, caller: str) -> None:
        self.released += 1
        super().release(caller)


PACE = framing.Pace(grace_s=0.5, min_bytes_per_s=1000)
ATTACKERS, STREAMS_EACH = 9, 8


def test_an_honest_caller_gets_in_while_nine_identities_keep_every_slot_full(caplog) -> None:
    caplog.set_level(logging.INFO, logger=framing.__name__)

    async def main() -> None:
        limit = CountingLimit(max_in_flight=64, max_per_caller=STREAMS_EACH)
        served: list[tuple[str, int]] = []
        stop = asyncio.Event()
        attacker_streams: list[CallerStream] = []

        async def handler(caller: str, request: bytes) -> bytes:
            served.append((caller, len(request)))
            return b"ok"

        async def keep_trickling(caller: str) -> None:
            while not stop.is_set():  # one byte every 50 ms (20 B/s), opened again at once
                stream = CallerStream(60_000, bytes_per_read=1, gap_s=0.05)
                attacker_streams.append(stream)
                await framing.serve_call(
                    stream, "contribute", caller, 1 << 20, limit, handler, PACE
                )

        attack = [
            asyncio.ensure_future(keep_trickling(f"attacker{i}"))
            for i in range(ATTACKERS)
            for _ in range(STREAMS_EACH)
        ]
        deadline = time.monotonic() + 20
        while limit.in_flight < limit.max_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert limit.in_flight == limit.max_in_flight  # the attack fills the handler

        for attempt in range(3):  # honest calls, one after another, while it is full
            # 2000 bytes at 500 bytes every 10 ms: 50 kB/s, fifty times the pace
            honest = CallerStream(2000, bytes_per_read=500, gap_s=0.01)
            full_before = limit.in_flight == limit.max_in_flight
            started = time.monotonic()
            await asyncio.wait_for(
                framing.serve_call(honest, "contribute", "honest", 1 << 20, limit, handler, PACE),
                10,
            )
            assert honest.status() == framing.STATUS_OK, (attempt, bytes(honest.sent))
            assert ("honest", 2000) in served and time.monotonic() - started < 5
            assert full_before or attempt > 0
            served.clear()

        stop.set()
        await asyncio.wait_for(asyncio.gather(*attack), 30)
        assert limit.in_flight == 0 and limit._per_caller == {} and limit._reading == {}
        assert served == []  # no trickled body was ever complete
        assert limit.taken_over >= 1
        # every hold admitted was released once: at its own end, or when taken over
        # (its slot then passed to the newcomer), never both
        assert limit.admitted == limit.released
        taken = [s for s in attacker_streams if s.aborts]
        assert len(taken) == limit.taken_over and all(s.aborts == 1 and s.closed for s in taken)

    asyncio.run(asyncio.wait_for(main(), 120))
    assert not [r for r in caplog.records if "rpc_serve_failed" in r.getMessage()]
    assert any(
        "rpc_took_over" in r.getMessage() and "caller=honest" in r.getMessage()
        for r in caplog.records
    )
    assert any("reason=TakenOver" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------
# the hivemind stream's abort


def test_aborting_a_hivemind_stream_ends_its_pending_read_at_once() -> None:
    hivemind_transport = pytest.importorskip("p2pdiloco.transport.hivemind")

    async def main() -> None:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        stream = hivemind_transport._AsyncioStream(reader, writer, idle_s=60)
        pending = asyncio.ensure_future(stream.read(100))
        await asyncio.sleep(0)  # the read is waiting for a byte
        assert not pending.done()
        stream.abort()
        assert await asyncio.wait_for(pending, 5) == b""
        assert theirs.recv(10) == b""  # the other side sees the stream closed
        theirs.close()

    asyncio.run(asyncio.wait_for(main(), 30))
