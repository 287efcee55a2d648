"""Admission control: token buckets refill at their rate; handlers refuse past their caps."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.transport import CallTimeout, RemoteError
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.transport.ratelimit import ConcurrencyLimit, RateLimiter


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------
# RateLimiter


def test_a_bucket_allows_its_burst_then_refills_at_its_rate() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rate_per_s=0.5, burst=3, clock=clock)
    assert [limiter.allow("p") for _ in range(4)] == [True, True, True, False]
    clock.now += 1.9  # 0.95 tokens: not yet one
    assert not limiter.allow("p")
    clock.now += 0.1
    assert limiter.allow("p") and not limiter.allow("p")
    clock.now += 3600  # refills to the burst, never past it
    assert [limiter.allow("p") for _ in range(4)] == [True, True, True, False]


def test_keys_have_separate_buckets_and_cost_is_spent_only_when_allowed() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=10, clock=FakeClock())
    assert limiter.allow("a", cost=7) and not limiter.allow("a", cost=7)
    assert limiter.tokens("a") == 3  # the refused request spent nothing
    assert limiter.allow("b", cost=10)
    assert not limiter.allow("c", cost=11)  # more than a full bucket: never


def test_now_can_be_passed_in_and_a_clock_going_backwards_refills_nothing() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=1, clock=lambda: pytest.fail("clock read"))
    assert limiter.allow("p", now=50.0)
    assert not limiter.allow("p", now=10.0)  # earlier than the last call
    assert not limiter.allow("p", now=50.5)
    assert limiter.allow("p", now=51.0)


def test_memory_is_bounded_by_forgetting_the_least_recently_seen_key() -> None:
    limiter = RateLimiter(rate_per_s=0, burst=1, clock=FakeClock(), max_keys=3)
    for key in ("a", "b", "c"):
        assert limiter.allow(key)
    assert not limiter.allow("a")  # "a" is now the most recently seen
    assert limiter.allow("d")  # forgets "b", the least recently seen
    assert len(limiter) == 3
    assert not limiter.allow("a") and not limiter.allow("c")
    assert limiter.allow("b")  # forgotten, so back with a full bucket


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate_per_s": -1, "burst": 1}, "rate_per_s"),
        ({"rate_per_s": float("nan"), "burst": 1}, "rate_per_s"),
        ({"rate_per_s": 1, "burst": 0}, "burst"),
        ({"rate_per_s": 1, "burst": float("inf")}, "burst"),
        ({"rate_per_s": 1, "burst": 1, "max_keys": 0}, "max_keys"),
    ],
)
def test_bad_parameters_are_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RateLimiter(**kwargs)


def test_bad_cost_or_time_is_a_value_error() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=1, clock=FakeClock())
    for cost in (-1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="cost"):
            limiter.allow("p", cost=cost)
    with pytest.raises(ValueError, match="now"):
        limiter.allow("p", now=float("nan"))


@settings(max_examples=examples(200), deadline=None)
@given(
    rate=st.floats(0, 100),
    burst=st.floats(0.1, 100),
    calls=st.lists(st.tuples(st.floats(0, 10), st.floats(0, 20)), max_size=40),
)
def test_what_is_allowed_never_exceeds_burst_plus_rate_times_time(
    rate: float, burst: float, calls: list[tuple[float, float]]
) -> None:
    clock = FakeClock(0.0)
    limiter = RateLimiter(rate_per_s=rate, burst=burst, clock=clock)
    spent = 0.0
    for step, cost in calls:
        clock.now += step
        if limiter.allow("p", cost=cost):
            spent += cost
        assert 0.0 <= limiter.tokens("p") <= burst
    assert spent <= burst + rate * clock.now + 1e-6 * (1 + spent)


# ---------------------------------------------------------------------------------------
# ConcurrencyLimit


def test_a_concurrency_limit_caps_each_caller_and_everyone() -> None:
    limit = ConcurrencyLimit(max_in_flight=3, max_per_caller=2)
    assert limit.try_acquire("a") is None and limit.try_acquire("a") is None
    assert "caller has 2 requests in flight" in limit.try_acquire("a")
    assert limit.try_acquire("b") is None
    assert "3 requests in flight, limit 3" in limit.try_acquire("c")
    limit.release("a")
    assert limit.of("a") == 1 and limit.in_flight == 2
    assert limit.try_acquire("c") is None
    for caller in ("a", "b", "c"):
        limit.release(caller)
    assert limit.in_flight == 0 and limit._per_caller == {}  # nothing kept for idle callers


def test_concurrency_limits_must_be_positive_ints() -> None:
    with pytest.raises(ValueError, match="max_per_caller"):
        ConcurrencyLimit(4, 0)
    with pytest.raises(ValueError, match="max_in_flight"):
        MemoryTransport(MemoryNetwork(), max_in_flight=0)


# ---------------------------------------------------------------------------------------
# the cap on a transport's handlers


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_handler_refuses_calls_past_its_caps_at_once_and_logs_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        network = MemoryNetwork()
        server = MemoryTransport(network, max_in_flight=4, max_per_caller=2)
        a, b, c = (MemoryTransport(network) for _ in range(3))
        for peer in (server, a, b, c):
            await peer.start()
        release = asyncio.Event()
        entered = []

        async def slow(caller: str, request: bytes) -> bytes:
            entered.append(caller)
            await release.wait()
            return request

        await server.register_handler("slow", slow)
        held = [
            asyncio.ensure_future(peer.call(server.peer_id, "slow", b"x", timeout_s=10))
            for peer in (a, a, b)
        ]
        while len(entered) < 3:
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RemoteError, match="too many concurrent requests.*caller has 2"):
            await a.call(server.peer_id, "slow", b"x", timeout_s=10)
        held.append(asyncio.ensure_future(c.call(server.peer_id, "slow", b"x", timeout_s=10)))
        while len(entered) < 4:
            await asyncio.sleep(0)
        with pytest.raises(RemoteError, match="too many concurrent requests.*limit 4"):
            await b.call(server.peer_id, "slow", b"x", timeout_s=10)
        assert loop.time() - started < 1.0  # refused at once, not queued
        assert len(entered) == 4
        release.set()
        assert await asyncio.gather(*held) == [b"x"] * 4
        # every slot came back: a full set of calls is admitted again
        again = [peer.call(server.peer_id, "slow", b"y", timeout_s=10) for peer in (a, a, b, c)]
        assert await asyncio.gather(*again) == [b"y"] * 4

    with caplog.at_level(logging.WARNING, logger="p2pdiloco.transport.memory"):
        run(main())
    refusals = [r for r in caplog.records if "rpc_rejected reason=too_many_concurrent" in r.message]
    assert len(refusals) == 2


def test_a_call_that_times_out_gives_its_slot_back() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        server = MemoryTransport(network, max_in_flight=1, max_per_caller=1)
        caller = MemoryTransport(network)
        await server.start()
        await caller.start()

        async def handler(peer: str, request: bytes) -> bytes:
            if request == b"hang":
                await asyncio.Event().wait()
            return request

        await server.register_handler("h", handler)
        with pytest.raises(CallTimeout):
            await caller.call(server.peer_id, "h", b"hang", timeout_s=0.05)
        assert await caller.call(server.peer_id, "h", b"ok", timeout_s=1) == b"ok"

    run(main())


class _Writer:
    """The half of a stream `HivemindTransport._serve` writes to."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, chunk: bytes) -> None:
        self.data += bytes(chunk)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_hivemind_server_refuses_past_its_caps_without_running_the_handler() -> None:
    """The stream server alone, on in-memory streams: no daemon is started."""
    hivemind_transport = pytest.importorskip("p2pdiloco.transport.hivemind")
    from p2pdiloco.transport import framing  # the framing both transports speak

    async def main() -> list[tuple[int, bytes]]:
        transport = hivemind_transport.HivemindTransport([], max_in_flight=2, max_per_caller=1)
        gate = asyncio.Event()
        ran = []

        async def slow(caller: str, request: bytes) -> bytes:
            ran.append(request)
            await gate.wait()
            return request

        # what register_handler records, without the daemon it also registers with
        transport._handlers["slow"] = (slow, 1 << 20)
        transport._in_flight["slow"] = ConcurrencyLimit(2, 1)

        def request(body: bytes) -> asyncio.StreamReader:
            reader = asyncio.StreamReader()
            header = framing.REQUEST_HEADER.pack(framing.REQUEST_MAGIC, len(body))
            reader.feed_data(header + body)
            reader.feed_eof()
            return reader

        writers = [_Writer() for _ in range(4)]
        held = [
            asyncio.ensure_future(transport._serve("slow", caller, request(body), writer))
            for caller, body, writer in (("A", b"1", writers[0]), ("B", b"2", writers[1]))
        ]
        while len(ran) < 2:
            await asyncio.sleep(0)
        await transport._serve("slow", "A", request(b"3"), writers[2])  # A has one in flight
        await transport._serve("slow", "C", request(b"4"), writers[3])  # two in flight in all
        assert ran == [b"1", b"2"] and writers[2].closed and writers[3].closed
        gate.set()
        await asyncio.gather(*held)
        assert transport._in_flight["slow"].in_flight == 0
        size = framing.RESPONSE_HEADER.size
        answers = []
        for writer in writers:
            _, status, _ = framing.RESPONSE_HEADER.unpack(bytes(writer.data[:size]))
            answers.append((status, bytes(writer.data[size:])))
        return answers

    answers = run(main())
    assert answers[:2] == [(0, b"1"), (0, b"2")]
    for status, body in answers[2:]:
        assert status == 1 and body.startswith(b"too many concurrent requests")
