"""A virtual clock for running many peers' real asyncio code in one process.

`run_virtual(main)` runs a coroutine on an event loop whose time only moves when every
task is waiting: the selector, instead of sleeping until the next timer, jumps the clock
to it. `time.monotonic` and `time.time` (read by the roles for deadlines, holds and
signed send times) follow the same clock while it runs, so a thousand peers' heartbeats,
deadlines and windows play out in the order they would on a real network, as fast as the
CPU computes them. Work handed to a thread would run outside that clock: the simulator
gives the roles an `InlineExecutor` instead, so CPU work costs no virtual time (the link
model and the compute model charge time explicitly).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
from concurrent.futures import Executor, Future
from typing import Any

START_WALL_S = 1_800_000_000.0
"""Wall time the virtual clock starts at (a fixed date: runs are reproducible)."""


class VirtualClock:
    """Seconds since the start of a simulated run; `wall()` adds a fixed epoch."""

    def __init__(self, start_wall_s: float = START_WALL_S) -> None:
        self.elapsed_s = 0.0
        self.start_wall_s = start_wall_s

    def monotonic(self) -> float:
        return self.elapsed_s

    def wall(self) -> float:
        return self.start_wall_s + self.elapsed_s


class _JumpingSelector(selectors.BaseSelector):
    """The loop's selector: real file events (the loop's self-pipe) are polled without
    waiting; a wait for the next timer moves the virtual clock instead of sleeping."""

    def __init__(self, clock: VirtualClock) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj, events, data=None):  # noqa: ANN001, ANN201 - selector API
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):  # noqa: ANN001, ANN201
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):  # noqa: ANN001, ANN201
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None):  # noqa: ANN201
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise Deadlock("every task waits and no timer is due: the simulation cannot go on")
        self._clock.elapsed_s += max(timeout, 0.0)
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self):  # noqa: ANN201
        return self._real.get_map()


class Deadlock(RuntimeError):
    """Raised when nothing can ever run again (a bug in the simulated code or setup)."""


class InlineExecutor(Executor):
    """Runs submitted work at once on the caller's thread (no virtual time passes)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:  # noqa: ANN001
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


def run_virtual(main: Coroutine[Any, Any, Any], clock: VirtualClock | None = None) -> Any:
    """Run `main` to completion on virtual time; `time.monotonic`/`time.time` follow the
    virtual clock meanwhile and are restored after."""
    clock = clock or VirtualClock()
    real_monotonic, real_time = time.monotonic, time.time
    loop = asyncio.SelectorEventLoop(_JumpingSelector(clock))
    time.monotonic, time.time = clock.monotonic, clock.wall  # type: ignore[assignment]
    try:
        loop.time = clock.monotonic  # type: ignore[method-assign]
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:  # on the virtual clock: a clean-up that waits costs no real time
                gathered = asyncio.gather(*tasks, return_exceptions=True)
                loop.run_until_complete(asyncio.wait_for(gathered, 3600.0))
        finally:
            loop.close()
            time.monotonic, time.time = real_monotonic, real_time  # type: ignore[assignment]
