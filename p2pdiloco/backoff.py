"""Waits between retries: exponential backoff with jitter, bounded by a deadline.

A fixed wait makes every peer that lost the same bootstrap node retry at the same
instants, in lockstep, for as long as the outage lasts, and hammer it together when it
comes back. Doubling the wait up to a cap spreads the load over time, and a random part
spreads the peers apart (the "equal jitter" of Brooker, "Exponential Backoff And Jitter",
AWS Architecture Blog, 2015: at least half the backoff, so no retry comes at once).

Pure and tiny on purpose: the retry loops are deadline-bounded polls (a TCP port that
opens, a donor that appears) on two event loops (asyncio, and trio for py-libp2p), so a
generator of delays fits them all, where a retry library's decorator fits exceptions from
one call (docs/architecture.md, "Libraries").
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(
    base_s: float, cap_s: float, rng: random.Random | None = None
) -> Iterator[float]:
    """Seconds to wait before retry 1, 2, ...: `min(cap_s, base_s * 2**n)` scaled by a
    uniform factor in [0.5, 1]. `rng` makes the sequence reproducible (tests)."""
    if base_s <= 0 or cap_s < base_s:
        raise ValueError(f"backoff needs 0 < base_s <= cap_s, got {base_s}, {cap_s}")
    rng = rng or random.Random()
    attempt = 0
    while True:
        ceiling = min(cap_s, base_s * 2**attempt)
        yield ceiling * rng.uniform(0.5, 1.0)
        attempt = min(attempt + 1, 62)  # 2**62 s is past any cap


def within(delay_s: float, deadline: float, now: float) -> float:
    """`delay_s`, cut so that the wait ends by `deadline` (same clock as `now`); never < 0."""
    return max(min(delay_s, deadline - now), 0.0)
