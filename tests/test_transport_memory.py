"""The in-memory fake keeps the transport contract: limits, deadlines, faults, expiring records."""

from __future__ import annotations

import asyncio

import pytest

import p2pdiloco.transport as transport_pkg
from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.transport import (
    CallTimeout,
    PeerUnreachable,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
    TransportClosed,
    TransportError,
    TransportStartError,
    make_transport,
)
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def two_peers(network: MemoryNetwork) -> tuple[MemoryTransport, MemoryTransport]:
    a, b = MemoryTransport(network), MemoryTransport(network)
    await a.start()
    await b.start()
    await a.wait_until_ready(1)
    return a, b


async def echo(caller: str, request: bytes) -> bytes:
    return request


def test_all_is_exported_and_importable():
    for name in transport_pkg.__all__:
        assert hasattr(transport_pkg, name), name


def test_factory_builds_memory_and_rejects_unknown_kinds():
    network = MemoryNetwork()
    assert isinstance(make_transport("memory", network=network), MemoryTransport)
    with pytest.raises(ValueError, match="transport kind"):
        make_transport("carrier-pigeon")


def test_error_tree():
    for error in (PeerUnreachable, CallTimeout, RemoteError, ResponseTooLarge, TransportClosed):
        assert issubclass(error, TransportError)
    assert issubclass(RequestTooLarge, RemoteError)
    assert issubclass(TransportStartError, NetworkSetupError)


def test_call_round_trips_bytes_and_passes_caller_id():
    async def main():
        a, b = await two_peers(MemoryNetwork())
        seen = []

        async def who(caller: str, request: bytes) -> bytes:
            seen.append(caller)
            return request[::-1]

        await a.register_handler("who", who, max_request_bytes=1 << 20)
        assert await b.call(a.peer_id, "who", b"abc", timeout_s=1) == b"cba"
        assert seen == [b.peer_id]

    run(main())


def test_request_over_limit_is_refused_and_handler_keeps_serving():
    async def main():
        a, b = await two_peers(MemoryNetwork())
        await a.register_handler("echo", echo, max_request_bytes=10)
        with pytest.raises(RequestTooLarge):
            await b.call(a.peer_id, "echo", b"x" * 11, timeout_s=1)
        assert await b.call(a.peer_id, "echo", b"x" * 10, timeout_s=1) == b"x" * 10

    run(main())


def test_response_over_callers_limit_raises():
    async def main():
        a, b = await two_peers(MemoryNetwork())
        await a.register_handler("echo", echo)
        with pytest.raises(ResponseTooLarge):
            await b.call(a.peer_id, "echo", b"x" * 100, timeout_s=1, max_response_bytes=99)

    run(main())


def test_unknown_handler_and_failing_handler_are_remote_errors():
    async def main():
        a, b = await two_peers(MemoryNetwork())

        async def broken(caller: str, request: bytes) -> bytes:
            raise ValueError("boom")

        await a.register_handler("broken", broken)
        with pytest.raises(RemoteError, match="no handler"):
            await b.call(a.peer_id, "missing", b"", timeout_s=1)
        with pytest.raises(RemoteError, match="boom"):
            await b.call(a.peer_id, "broken", b"", timeout_s=1)

    run(main())


def test_killed_peer_is_unreachable_and_suspended_peer_times_out():
    async def main():
        network = MemoryNetwork()
        a, b = await two_peers(network)
        await a.register_handler("echo", echo)
        network.suspend(a.peer_id)
        with pytest.raises(CallTimeout):
            await b.call(a.peer_id, "echo", b"hi", timeout_s=0.1)
        network.resume(a.peer_id)
        assert await b.call(a.peer_id, "echo", b"hi", timeout_s=1) == b"hi"
        network.kill(a.peer_id)
        with pytest.raises(PeerUnreachable):
            await b.call(a.peer_id, "echo", b"hi", timeout_s=1)

    run(main())


def test_slow_handler_hits_the_callers_deadline():
    async def main():
        a, b = await two_peers(MemoryNetwork())

        async def slow(caller: str, request: bytes) -> bytes:
            await asyncio.sleep(10)
            return b""

        await a.register_handler("slow", slow)
        with pytest.raises(CallTimeout):
            await b.call(a.peer_id, "slow", b"", timeout_s=0.1)

    run(main())


def test_client_mode_peers_cannot_reach_each_other_but_can_reach_servers():
    async def main():
        network = MemoryNetwork()
        server = MemoryTransport(network)
        c1, c2 = (
            MemoryTransport(network, client_mode=True),
            MemoryTransport(network, client_mode=True),
        )
        for t in (server, c1, c2):
            await t.start()
            await t.register_handler("echo", echo)
        assert c1.client_mode and c1.visible_maddrs() == []
        assert await c1.call(server.peer_id, "echo", b"1", timeout_s=1) == b"1"
        with pytest.raises(PeerUnreachable):
            await c1.call(c2.peer_id, "echo", b"1", timeout_s=1)

    run(main())


def test_shutdown_is_idempotent_and_closes_the_transport():
    async def main():
        network = MemoryNetwork()
        a, b = await two_peers(network)
        await a.register_handler("echo", echo)
        await a.shutdown()
        await a.shutdown()
        with pytest.raises(PeerUnreachable):
            await b.call(a.peer_id, "echo", b"", timeout_s=1)
        with pytest.raises(TransportClosed):
            await a.call(b.peer_id, "echo", b"", timeout_s=1)
        with pytest.raises(TransportClosed):
            await a.start()

    run(main())


def test_wait_until_ready_times_out_before_start():
    async def main():
        with pytest.raises(TransportStartError):
            await MemoryTransport(MemoryNetwork()).wait_until_ready(0.05)

    run(main())


def test_dht_subkeys_from_many_peers_merge_under_one_key():
    async def main():
        clock = FakeClock()
        network = MemoryNetwork(clock=clock)
        a, b = await two_peers(network)
        assert a.now() == clock.now
        assert await a.store("members", a.peer_id, b"a", clock.now + 10)
        assert await b.store("members", b.peer_id, b"b", clock.now + 20)
        records = await a.get("members")
        assert records == {a.peer_id: (b"a", clock.now + 10), b.peer_id: (b"b", clock.now + 20)}
        assert await b.get("nobody") == {}

    run(main())


def test_dht_records_expire_on_the_injected_clock():
    async def main():
        clock = FakeClock()
        a, _ = await two_peers(MemoryNetwork(clock=clock))
        await a.store("k", "s", b"v", clock.now + 5)
        clock.now += 4.9
        assert "s" in await a.get("k")
        clock.now += 0.2
        assert await a.get("k") == {}
        assert not await a.store("k", "s", b"late", clock.now - 1), "already expired"

    run(main())


def test_dht_keeps_the_record_that_expires_last():
    async def main():
        clock = FakeClock()
        a, _ = await two_peers(MemoryNetwork(clock=clock))
        assert await a.store("k", "s", b"new", clock.now + 10)
        assert not await a.store("k", "s", b"old", clock.now + 5)
        assert await a.store("k", "s", b"newer", clock.now + 11)
        assert (await a.get("k"))["s"] == (b"newer", clock.now + 11)

    run(main())
