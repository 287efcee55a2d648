"""A client-mode peer's relay slot: reported when taken or lost, renewed when p2pd stays stuck.

Nobody can dial a peer behind a NAT; others reach it only through a relay circuit, on a
slot its p2pd's autorelay reserves on a public peer (the bootstrap nodes, which relay at
once). go-libp2p's autorelay has two habits that a swarm whose relays are few meets: it
waits up to 3 minutes for four relay candidates before it reserves on fewer (its boot
delay), and after one failed reservation it leaves that relay alone for an hour, also
when the relay only restarted. So the peer watches the addresses its daemon announces:

- `relay_slot` when a relayed (`/p2p-circuit`) address appears or the set changes,
  with the addresses and how long the peer waited for them;
- `relay_slot_lost` when the last one goes;
- `relay_renewed` when it has had none for `patience_s`: the transport starts again
  (same identity, same handlers), which clears autorelay's back-off. The patience
  doubles after each renewal that brought no slot, up to `MAX_PATIENCE_S`, so a swarm
  without any relay costs one short restart an hour at most.

`SlotWatch` decides (pure, clock passed in); `watch_relay_slot` polls the transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pdiloco.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

PATIENCE_S = 300.0
"""How long a peer waits for a slot before renewing: autorelay's boot delay (180 s), a
search for candidates and one reservation, with room for a loaded machine."""
MAX_PATIENCE_S = 3600.0
"""The longest wait between renewals (autorelay's own back-off is an hour)."""
POLL_S = 5.0
"""How often the daemon's announced addresses are read."""


@dataclass
class SlotWatch:
    """What a peer's relay slot did, from the relayed addresses seen at each instant.

    `start(now)` first; then `observe(addresses, now)` returns the events to emit and
    whether to renew the transport now; after a renewal, call `renewed(now)`. `addresses` None means the
    daemon could not tell: nothing changes, the patience runs on.
    """

    patience_s: float = PATIENCE_S
    max_patience_s: float = MAX_PATIENCE_S
    addresses: tuple[str, ...] = ()
    """The relayed addresses last seen (empty: no slot)."""
    waiting_since: float | None = None
    """When the peer last found itself without a slot (start, loss, renewal); None while
    it holds one."""
    fruitless: int = 0
    """Renewals in a row that brought no slot."""

    def start(self, now: float) -> None:
        """The watch begins at `now`, with no slot yet."""
        self.waiting_since = now

    @property
    def current_patience_s(self) -> float:
        return min(self.patience_s * 2**self.fruitless, self.max_patience_s)

    def observe(self, addresses: list[str] | None, now: float) -> tuple[list[dict[str, Any]], bool]:
        if addresses is None:
            return [], self._out_of_patience(now)
        seen = tuple(sorted(set(addresses)))
        events: list[dict[str, Any]] = []
        if seen and seen != self.addresses:
            event: dict[str, Any] = {"event": "relay_slot", "addresses": list(seen)}
            if self.waiting_since is not None:
                event["waited_s"] = round(now - self.waiting_since, 1)
            events.append(event)
            self.waiting_since, self.fruitless = None, 0
        elif not seen and self.addresses:
            events.append({"event": "relay_slot_lost", "addresses": list(self.addresses)})
            self.waiting_since = now
        self.addresses = seen
        return events, self._out_of_patience(now)

    def _out_of_patience(self, now: float) -> bool:
        return self.waiting_since is not None and now - self.waiting_since >= self.current_patience_s

    def renewed(self, now: float) -> None:
        self.fruitless += 1
        self.waiting_since = now
        self.addresses = ()


async def watch_relay_slot(
    transport: Transport,
    emit: Callable[[dict[str, Any]], None],
    on_failure: Callable[[str], None],
    watch: SlotWatch | None = None,
    poll_s: float = POLL_S,
) -> None:
    """Watch `transport`'s relay slot until cancelled (see the module's docstring).
    Returns at once when the transport takes no slot; a renewal that fails calls
    `on_failure(why)` (the transport is down then) and ends the watch."""
    if await transport.relay_addresses() is None:
        return
    watch = watch or SlotWatch()
    loop = asyncio.get_running_loop()
    watch.start(loop.time())
    while True:
        events, renew = watch.observe(await transport.relay_addresses(), loop.time())
        for event in events:
            emit(event)
        if renew:
            waited = loop.time() - (watch.waiting_since or loop.time())
            emit({"event": "relay_renewed", "waited_s": round(waited, 1), "renewals": watch.fruitless + 1})
            log.warning(
                "relay_slot none for %.0f s: starting the transport again (p2pd's autorelay "
                "backs off from a relay for an hour after one failed reservation)",
                waited,
            )
            try:
                await transport.renew()
            except (TransportError, OSError) as exc:
                on_failure(f"the transport did not start again after a relay renewal: {exc}")
                return
            watch.renewed(loop.time())
        await asyncio.sleep(poll_s)  # polling the daemon's addresses, not synchronising
