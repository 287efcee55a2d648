"""Admission control for RPC handlers: a token bucket per peer and a cap on calls in flight.

Pure bookkeeping with time passed in (`now`, or an injected `clock`): no asyncio, no
network. `RateLimiter` bounds how much a peer may ask for over time (a small `get_state`
request costs its donor ~8 bytes a parameter); `ConcurrencyLimit` bounds how many
requests a handler runs at once, in all and per caller, so a flood is refused at the
door instead of queued without end, and shares a full handler fairly: a caller with
fewer bodies being read takes over a slot of the caller with the most.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import suppress
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_PER_CALLER",
    "ConcurrencyLimit",
    "Hold",
    "RateLimiter",
]

DEFAULT_MAX_KEYS = 4096
"""Peers a `RateLimiter` remembers; the least recently seen is forgotten beyond this."""
DEFAULT_MAX_IN_FLIGHT = 64
"""Requests one RPC handler runs at once, from all callers together."""
DEFAULT_MAX_PER_CALLER = 8
"""Requests one RPC handler runs at once for a single caller."""


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per key (peer id): `burst` tokens at most, refilled at `rate_per_s`.

    `allow(key, cost)` spends `cost` tokens if the key's bucket holds them. Memory is
    bounded: beyond `max_keys` the least recently seen key is forgotten (it comes back
    with a full bucket, which is what an unknown peer gets anyway).
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        if not _finite(rate_per_s) or rate_per_s < 0:
            raise ValueError(f"rate_per_s must be a finite number >= 0, got {rate_per_s!r}")
        if not _finite(burst) or burst <= 0:
            raise ValueError(f"burst must be a finite number > 0, got {burst!r}")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        """Keys remembered now."""
        return len(self._buckets)

    def allow(self, key: Hashable, cost: float = 1.0, now: float | None = None) -> bool:
        """Spend `cost` tokens of `key`'s bucket if it holds them; False (nothing spent) if not.

        A `cost` above `burst` is never allowed. `now` defaults to `clock()`; a clock that
        goes backwards refills nothing.
        """
        if not _finite(cost) or cost < 0:
            raise ValueError(f"cost must be a finite number >= 0, got {cost!r}")
        now = self.clock() if now is None else now
        if not _finite(now):
            raise ValueError(f"now must be a finite time in seconds, got {now!r}")
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.burst, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(now - bucket.updated, 0.0)
            bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate_per_s)
            bucket.updated = max(now, bucket.updated)
        if bucket.tokens < cost:
            return False
        bucket.tokens -= cost
        return True

    def tokens(self, key: Hashable, now: float | None = None) -> float:
        """Tokens `key` could spend at `now` (`burst` for an unknown key); spends nothing."""
        now = self.clock() if now is None else now
        bucket = self._buckets.get(key)
        if bucket is None:
            return self.burst
        elapsed = max(now - bucket.updated, 0.0)
        return min(self.burst, bucket.tokens + elapsed * self.rate_per_s)


@dataclass(eq=False)
class Hold:
    """One request a stream server admitted (`ConcurrencyLimit.admit`), from its header
    to its last response byte.

    While its body is being read it may be taken over by a fairer claimant: then
    `taken_over` is set, its slot already belongs to the newcomer, and `abort` (if any)
    has been called once so its stream stops at once. `due_s` is when the body falls
    behind its pace (time.monotonic); the reader moves it on as bytes arrive, and the
    hold furthest behind (the earliest `due_s`) is the one taken over.
    """

    caller: str
    due_s: float
    abort: Callable[[], None] | None = None
    reading: bool = True
    taken_over: bool = False
    ended: bool = False
    took_over_from: str | None = None
    """The caller whose slot this hold took over on admission (for the log), else None."""


class ConcurrencyLimit:
    """Counts one handler's requests in flight, in all and per caller; refuses past either cap.

    `try_acquire(caller)` admits a request (returns None) or says why not; every admitted
    request must be matched by one `release(caller)`. Memory is bounded by
    `max_in_flight`: a caller with nothing in flight is forgotten.

    A stream server uses `admit` / `body_read` / `give_back` instead, which add fair
    sharing of a full handler: the pace drops one slow body, but free
    identities that open a slow stream again at once keep every slot full, and a
    newcomer is refused for ever. So when the handler is full, a caller reading fewer
    bodies than some other caller by two or more takes over one of that caller's slots
    still reading a body (the heaviest caller's, the one furthest behind its pace). A
    caller with no body being read is then always admitted while some caller has two
    bodies being read, and a caller's last body being read is never taken over. A request
    whose body is complete (in the handler, or answering) is never taken over.
    """

    def __init__(self, max_in_flight: int, max_per_caller: int) -> None:
        for name, value in (("max_in_flight", max_in_flight), ("max_per_caller", max_per_caller)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self.in_flight = 0
        self._per_caller: dict[str, int] = {}
        self._reading: dict[str, set[Hold]] = {}
        """Per caller, its admitted holds whose body is still being read (the ones that
        may be taken over); a caller with none is forgotten."""

    def try_acquire(self, caller: str) -> str | None:
        """Admit one request of `caller` (None), or the reason it is refused."""
        if self.in_flight >= self.max_in_flight:
            return f"{self.in_flight} requests in flight, limit {self.max_in_flight}"
        mine = self._per_caller.get(caller, 0)
        if mine >= self.max_per_caller:
            return f"caller has {mine} requests in flight, limit {self.max_per_caller}"
        self.in_flight += 1
        self._per_caller[caller] = mine + 1
        return None

    def release(self, caller: str) -> None:
        """End one admitted request of `caller`."""
        mine = self._per_caller.get(caller, 0)
        assert mine > 0 and self.in_flight > 0, f"release without acquire for {caller!r}"
        self.in_flight -= 1
        if mine == 1:
            del self._per_caller[caller]
        else:
            self._per_caller[caller] = mine - 1

    def of(self, caller: str) -> int:
        """Requests of `caller` in flight now."""
        return self._per_caller.get(caller, 0)

    def reading_of(self, caller: str) -> int:
        """Requests of `caller` whose body is being read now (those that may be taken over)."""
        return len(self._reading.get(caller, ()))

    # ---- a stream server's holds, shared fairly ----------------------------------------

    def admit(
        self, caller: str, due_s: float, abort: Callable[[], None] | None = None
    ) -> Hold | str:
        """Admit a request of `caller` whose body is about to be read, as a `Hold`, or the
        reason it is refused. When only the global cap stands in the way, the request
        takes over a fairer victim's slot (see the class), whose `abort` is called.
        `due_s`: when the body falls behind its pace if nothing arrives."""
        refusal = self.try_acquire(caller)
        took_over_from = None
        if refusal is not None:
            victim = self._victim_for(caller) if self.of(caller) < self.max_per_caller else None
            if victim is None:
                return refusal
            self._take_over(victim, caller)
            took_over_from = victim.caller
        hold = Hold(caller, due_s, abort, took_over_from=took_over_from)
        self._reading.setdefault(caller, set()).add(hold)
        return hold

    def body_read(self, hold: Hold) -> bool:
        """`hold`'s body is complete: it keeps its slot and can no longer be taken over.
        False if it was taken over already (its stream must stop)."""
        if hold.taken_over or hold.ended:
            return False
        self._stop_reading(hold)
        return True

    def give_back(self, hold: Hold) -> None:
        """End `hold`: its slot is released, unless it was taken over (the slot went to
        the newcomer then). Safe to call more than once: it releases at most once."""
        if hold.ended:
            return
        hold.ended = True
        if hold.taken_over:
            return
        self._stop_reading(hold)
        self.release(hold.caller)

    def _victim_for(self, caller: str) -> Hold | None:
        """The hold `caller` may take over: of the callers reading the most bodies (at
        least two more than `caller`), the hold furthest behind its pace; None if none."""
        others = [holds for other, holds in self._reading.items() if other != caller]
        most = max(map(len, others), default=0)
        if most < self.reading_of(caller) + 2:
            return None
        return min(
            (hold for holds in others if len(holds) == most for hold in holds),
            key=lambda h: h.due_s,
        )

    def _take_over(self, victim: Hold, caller: str) -> None:
        """Move `victim`'s slot to `caller` (the count in flight is unchanged) and stop it."""
        self._stop_reading(victim)
        victim.taken_over = True
        self.release(victim.caller)
        self.in_flight += 1
        self._per_caller[caller] = self._per_caller.get(caller, 0) + 1
        if victim.abort is not None:
            with suppress(Exception):  # a stream that fails to abort still stops at its next read
                victim.abort()

    def _stop_reading(self, hold: Hold) -> None:
        if not hold.reading:
            return
        hold.reading = False
        holds = self._reading[hold.caller]
        holds.discard(hold)
        if not holds:
            del self._reading[hold.caller]


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
