"""Admission control for RPC handlers: a token bucket per peer and a cap on calls in flight.

Pure bookkeeping with time passed in (`now`, or an injected `clock`): no asyncio, no
network. `RateLimiter` bounds how much a peer may ask for over time (a small `get_state`
request costs its donor ~8 bytes a parameter); `ConcurrencyLimit` bounds how many
requests a handler runs at once, in all and per caller, so a flood is refused at the
door instead of queued without end.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_PER_CALLER",
    "ConcurrencyLimit",
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


class ConcurrencyLimit:
    """Counts one handler's requests in flight, in all and per caller; refuses past either cap.

    `try_acquire(caller)` admits a request (returns None) or says why not; every admitted
    request must be matched by one `release(caller)`. Memory is bounded by
    `max_in_flight`: a caller with nothing in flight is forgotten.
    """

    def __init__(self, max_in_flight: int, max_per_caller: int) -> None:
        for name, value in (("max_in_flight", max_in_flight), ("max_per_caller", max_per_caller)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_in_flight = max_in_flight
        self.max_per_caller = max_per_caller
        self.in_flight = 0
        self._per_caller: dict[str, int] = {}

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


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
