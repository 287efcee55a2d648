"""The swarm simulator (issue 29): virtual time, the traffic meter, and a small swarm of
real roles that must keep the swarm's invariants (one hash per round on every replica)."""

from __future__ import annotations

import asyncio
import time

from p2pdiloco.sim.links import LOOPBACK, Population
from p2pdiloco.sim.swarm import sim_config, simulate
from p2pdiloco.sim.virtual_time import Deadlock, InlineExecutor, VirtualClock, run_virtual
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.transport.traffic import Traffic, key_category, rpc_category


def test_virtual_time_jumps_to_the_next_timer_and_restores_the_clocks() -> None:
    real = time.monotonic

    async def main() -> tuple[float, float]:
        started = time.monotonic()
        await asyncio.gather(*(asyncio.sleep(3600.0 + i) for i in range(100)))
        try:
            await asyncio.wait_for(asyncio.sleep(100.0), 5.0)
        except TimeoutError:
            pass
        done = await asyncio.get_running_loop().run_in_executor(InlineExecutor(), sum, [1, 2])
        assert done == 3
        return started, time.monotonic()

    clock = VirtualClock()
    wall_started = time.perf_counter()
    started, ended = run_virtual(main(), clock)
    assert ended - started == 3699.0 + 5.0
    assert time.perf_counter() - wall_started < 30.0  # an hour of timers, not an hour
    assert time.monotonic is real


def test_a_simulation_where_nothing_can_happen_says_so() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    try:
        run_virtual(main())
    except Deadlock:
        return
    raise AssertionError("a wait nothing can end must raise Deadlock")


def test_traffic_is_counted_by_category_on_both_ends_of_a_call() -> None:
    assert key_category("p2pdiloco/run/members") == "membership"
    assert key_category("p2pdiloco/run/rounds/0") == "records"
    assert rpc_category("run.contribute") == "deltas" and rpc_category("run.get_state") == "state"

    async def main() -> tuple[Traffic, Traffic]:
        network = MemoryNetwork()
        a, b = MemoryTransport(network), MemoryTransport(network)
        for t in (a, b):
            await t.start()

        async def echo(caller: str, request: bytes) -> bytes:
            return request * 2

        await b.register_handler("run.contribute", echo)
        await a.call(b.peer_id, "run.contribute", b"x" * 100, 5.0)
        await a.store("p2pdiloco/run/members", "s", b"y" * 50, network.clock() + 60)
        await b.get("p2pdiloco/run/members")
        return a.traffic, b.traffic

    a, b = asyncio.run(main())
    assert a.snapshot()["deltas"] == {"up": 100, "down": 200}
    assert b.snapshot()["deltas"] == {"up": 200, "down": 100}
    assert a.snapshot()["membership"]["up"] == 51 and b.snapshot()["membership"]["down"] == 51


def test_a_small_simulated_swarm_commits_rounds_with_one_hash_per_round() -> None:
    figures = simulate(
        4, 120.0, config=sim_config(inner_steps=20), population=LOOPBACK, warmup_s=10.0
    )
    assert figures.rounds >= 2
    assert figures.forks == 0
    assert (
        figures.by_category["membership"]["down"] > 0 and figures.by_category["records"]["down"] > 0
    )
    assert figures.round_latency_s < 60.0
    assert 0.0 < figures.goodput <= 1.0


def test_membership_cost_per_peer_grows_with_the_swarm_on_a_single_members_key() -> None:
    """Every peer reads every heartbeat: per-peer membership bytes grow with N (what the
    issue measured; a scalable design must make this flat)."""
    population = Population(churn=False)
    small = simulate(
        4, 40.0, config=sim_config(inner_steps=20), population=population, warmup_s=10.0
    )
    large = simulate(
        16, 40.0, config=sim_config(inner_steps=20), population=population, warmup_s=10.0
    )
    per_peer = [sum(f.by_category["membership"].values()) for f in (small, large)]
    assert per_peer[1] > 2.5 * per_peer[0], per_peer
