"""`join`'s clock check: read the initial peers' clocks once the transport is up.

A peer whose clock is far off signs records that others refuse as expired or from the
future; hivemind's bootstrap refuses such a peer with a less helpful message. The
verdict itself is `preflight.check_clock` (pure); this module does the reading.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from p2pdiloco.peer.preflight import Finding, check_clock, raise_if_fatal

log = logging.getLogger(__name__)

CLOCK_S = 2.0
"""Deadline of one clock reading."""
CLOCK_PEERS = 4
"""Initial peers whose clocks are read."""


def peer_ids_of(maddrs: list[str] | tuple[str, ...]) -> list[str]:
    """The peer ids that multiaddrs name (`.../p2p/<id>`), each once, in order."""
    ids: list[str] = []
    for maddr in maddrs:
        peer = maddr.rpartition("/p2p/")[2] if "/p2p/" in maddr else ""
        if peer and peer not in ids:
            ids.append(peer)
    return ids


async def read_clocks(transport: Any, peer_ids: list[str], timeout_s: float = CLOCK_S) -> list[Any]:
    """The clock readings of those of `peer_ids` that answered within `timeout_s`."""
    readings = await asyncio.gather(*(transport.read_clock(p, timeout_s) for p in peer_ids))
    return [r for r in readings if r is not None]


async def check_clock_at_join(
    transport: Any, initial_peers: list[str] | tuple[str, ...]
) -> Finding:
    """`join`'s clock check, once its transport is up: raises `PreflightError` when the
    clock is too far from the initial peers' (hivemind's bootstrap refuses it before),
    logs a warning when it is a little off. Bounded by `CLOCK_S`."""
    ids = peer_ids_of(initial_peers)[:CLOCK_PEERS]
    finding = check_clock(await read_clocks(transport, ids), len(ids))
    if finding.level == "warn":
        log.warning("clock %s", finding.line())
    raise_if_fatal([finding], skippable=False)
    return finding
