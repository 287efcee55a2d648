"""Bulk transfers sharing links fairly, as concurrent TCP flows do (fluid model).

A FIFO link makes a 3 MB hold push wait for every fetch queued ahead of it, and keeps
moving the bytes of a call whose caller already gave up; both turn a busy synchronizer
into a congestion collapse that a real one (its flows sharing the uplink, a timed-out
stream closed) does not suffer. Here every flow in progress gets, on each of its two
links, an equal share of that link's rate, and moves at the smaller of its two shares
(a simplification of max-min fairness: a share a flow cannot use is not handed to the
others). The shares are recomputed whenever a flow starts, ends or is cancelled; a
cancelled flow (its caller's deadline passed) stops taking bandwidth at once.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

DONE_BYTES = 1e-3
"""Bytes left at which a flow counts as complete (float rounding)."""


@dataclass(eq=False)
class Flow:
    src: str
    dst: str
    remaining: float
    done: asyncio.Future = field(repr=False)
    rate: float = 0.0


class FairShareLinks:
    """The bulk flows of a simulated network, on `rates(peer) -> (up, down)` bytes/s."""

    def __init__(
        self, now: Callable[[], float], rates: Callable[[str], tuple[float, float]]
    ) -> None:
        self.now = now
        self.rates = rates
        self.flows: list[Flow] = []
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, src: str, dst: str, size: float) -> None:
        """Move `size` bytes from `src` to `dst`, sharing both links with the other flows."""
        loop = asyncio.get_running_loop()
        self._advance()
        flow = Flow(src, dst, size, loop.create_future())
        self.flows.append(flow)
        self._reschedule(loop)
        try:
            await flow.done
        except asyncio.CancelledError:
            if flow in self.flows:  # the caller gave up: its bytes stop here
                self._advance()
                self.flows.remove(flow)
                self._reschedule(loop)
            raise

    def _advance(self) -> None:
        now = self.now()
        elapsed = now - self._last
        self._last = now
        if elapsed > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * elapsed

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Finish the flows that are done, share the links anew, and wake at the next end."""
        for flow in [f for f in self.flows if f.remaining <= DONE_BYTES]:
            self.flows.remove(flow)
            if not flow.done.done():
                flow.done.set_result(None)
        ups = Counter(f.src for f in self.flows)
        downs = Counter(f.dst for f in self.flows)
        next_end = math.inf
        for flow in self.flows:
            up = self.rates(flow.src)[0] / ups[flow.src]
            down = self.rates(flow.dst)[1] / downs[flow.dst]
            flow.rate = min(up, down)
            if flow.rate > 0:
                next_end = min(next_end, flow.remaining / flow.rate)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if next_end < math.inf:
            self._timer = loop.call_later(max(next_end, 0.0), self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance()
        self._reschedule(loop)
