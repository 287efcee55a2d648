"""The membership role: publish this peer's heartbeat, read the others', and keep the live
view every other role elects and pushes by; and the optional start barrier.

A heartbeat is a signed record in the run's members key, refreshed every
`peer.heartbeat_s` and expiring after four periods; records of another run config or
with a bad signature are ignored (logged once). Runs on the event loop; every network
wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from p2pdiloco.protocol.membership import (
    CLOCK_SLACK_S,
    MAX_CLOCK_OFFSET_S,
    Heartbeat,
    judge_members,
    learners,
    members_key,
    open_members,
    seal_heartbeat,
    swarm_offset_s,
)
from p2pdiloco.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

BEAT_TIMEOUT_S = 30.0
"""Deadline of one heartbeat (a store and a read)."""
BARRIER_POLL_S = 0.25
"""How often the start barrier re-reads the membership."""


class Membership:
    """This peer's heartbeats and its view of the live members."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        heartbeat_s: float,
        config_hash: str,
        own_heartbeat: Callable[[], Heartbeat],
        on_event: Callable[[dict], None],
    ) -> None:
        self.transport = transport
        self.run = run
        self.heartbeat_s = heartbeat_s
        self.config_hash = config_hash
        self.own_heartbeat = own_heartbeat
        self.on_event = on_event
        self.clock_voters: Callable[[Heartbeat], bool] | None = None
        """Whose signed send times set the swarm clock (`Entitlement.votes_on_clock`);
        None: every live member's."""
        self.live: dict[str, Heartbeat] = {}
        self.rejected: dict[str, str] = {}
        """Member subkey -> why its heartbeat is ignored."""
        self.leaving = False
        self.offset_s = 0.0
        """What this peer adds to its clock to agree with the swarm (`swarm_offset_s`):
        a peer whose clock is off by tens of seconds still sees others live and signs
        beats that others see live."""
        self._verdicts: dict[tuple[str, bytes], Heartbeat | str] = {}
        """Signature verdicts of the members records read (`open_members`)."""

    def now(self) -> float:
        """Swarm time: this peer's DHT clock corrected by the swarm's signed send times."""
        return self.transport.now() + self.offset_s

    def sealed_beat(self) -> tuple[bytes, float]:
        """Our heartbeat signed at swarm time, with the DHT expiration it may have."""
        sent_at = self.now()
        live_s = 4 * self.heartbeat_s
        beat = dataclasses.replace(self.own_heartbeat(), sent_at=sent_at, live_s=live_s)
        return seal_heartbeat(self.transport.identity, self.run, beat), sent_at + live_s + CLOCK_SLACK_S

    def view(self) -> dict[str, Heartbeat]:
        """This peer's current view of the live membership (itself included until it leaves)."""
        view = dict(self.live)
        if not self.leaving:
            view[self.transport.peer_id] = self.own_heartbeat()
        return view

    async def beat(self) -> None:
        """Publish our heartbeat and refresh the view."""
        key = members_key(self.run)
        sealed, expiration = self.sealed_beat()
        await self.transport.store(key, self.transport.peer_id, sealed, expiration)
        records = await self.transport.get(key)
        self.refresh(records)

    def refresh(self, records: dict[str, tuple[bytes, float]]) -> None:
        """The live view from the members records read, at swarm time; the swarm offset is
        re-estimated from the send times the others signed (this peer's own beat left out:
        it would vote for our own clock twice)."""
        local = self.transport.now()
        cache = self._verdicts
        opened, unsigned = open_members(self.run, records, local - MAX_CLOCK_OFFSET_S, cache)
        self._verdicts = {k: cache[k] for k in ((s, r[0]) for s, r in records.items()) if k in cache}
        self.offset_s = swarm_offset_s(opened, local, self.transport.peer_id, self.clock_voters)
        live, refused = judge_members(opened, self.now(), self.config_hash)
        rejected = {**unsigned, **refused}
        for subkey, reason in rejected.items():
            if subkey not in self.rejected:
                log.warning("ignored member subkey=%s reason=%r", subkey[-8:], reason)
        self.live, self.rejected = live, rejected

    async def beat_bounded(self) -> None:
        """`beat`, bounded; a failed beat is logged (the next one tries again)."""
        try:
            await asyncio.wait_for(self.beat(), BEAT_TIMEOUT_S)
        except (TimeoutError, TransportError) as exc:
            log.warning("heartbeat failed error=%r", exc)

    def config_disagreement(self) -> str | None:
        """Why this peer cannot train with the run: every live learner announces another
        run config and none announces ours (None: no such sign)."""
        others = [p for p in self.live if p != self.transport.peer_id]
        disagree = [r for r in self.rejected.values() if r.startswith("trains with another run config")]
        if disagree and not others:
            return f"this peer's run config differs from the run's (every live learner {disagree[0]}): use the run's published config"
        return None

    async def beat_forever(self, after_beat: Callable[[], None]) -> None:
        """Beat every period, calling `after_beat()` after each (the daemon starts replica
        sync there, beside the beats); until cancelled. Never raises otherwise."""
        while True:
            await asyncio.sleep(self.heartbeat_s)  # a period, not a synchronisation
            try:
                await self.beat_bounded()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the daemon must outlive any one beat
                log.exception("heartbeat fault")
            after_beat()

    async def wait_for_learners(self, want: int, timeout_s: float) -> None:
        """The optional start barrier: poll the membership until `want` learners are live
        (itself included), or `timeout_s` passed (then start anyway, with a warning)."""
        if want <= 1:
            return
        deadline = time.monotonic() + timeout_s
        live = len(learners(self.view()))
        self.on_event({"event": "waiting_for_peers", "live": live, "want": want})
        while live < want:
            if time.monotonic() >= deadline:
                log.warning("starting without the awaited peers live=%d want=%d", live, want)
                return
            await asyncio.sleep(BARRIER_POLL_S)  # how quickly a peer notices the last one
            await self.beat_bounded()
            live = len(learners(self.view()))
        self.on_event({"event": "peers_ready", "live": live})
