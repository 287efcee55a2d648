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
    member_shard,
    member_shard_key,
    open_members,
    seal_heartbeat,
    settle_s,
    swarm_offset_s,
)
from p2pdiloco.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

BEAT_TIMEOUT_S = 30.0
"""Deadline of one heartbeat (a store and a read)."""
MIN_SHARD_VOTES = 5
"""Sharded membership: beats a shard must show before they re-estimate the swarm clock."""
SWEEP_READS_AT_ONCE = 16
"""Shard reads in flight at once during a newcomer's sweep of the whole membership."""
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
        shards: int = 1,
    ) -> None:
        self.transport = transport
        self.shards = max(1, shards)
        """Membership shards of the run (`network.member_shards`): with more than one, a
        beat reads one shard, in a rotation, and the view remembers what each shard showed
        when last read (docs/scale.md)."""
        self._remembered: dict[str, tuple[Heartbeat, int, float]] = {}
        """Sharded: peer -> (its last live beat, its shard, local monotonic time read)."""
        self._reads = 0
        self._unswept: set[int] | None = None
        """Sharded: the shards this session's sweep has still to read (None: not begun)."""
        self.joined_at: float | None = None
        """Swarm time of our first beat this session (signed in every beat)."""
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
        if self.joined_at is None:
            self.joined_at = sent_at
        beat = dataclasses.replace(
            self.own_heartbeat(), sent_at=sent_at, live_s=live_s, joined_at=self.joined_at
        )
        return seal_heartbeat(self.transport.identity, self.run, beat), sent_at + live_s + CLOCK_SLACK_S

    def view(self) -> dict[str, Heartbeat]:
        """This peer's current view of the live membership (itself included until it leaves)."""
        view = dict(self.live)
        if not self.leaving:
            own = self.own_heartbeat()
            if self.joined_at is not None:  # as the others read it: not settled at once
                own = dataclasses.replace(own, joined_at=self.joined_at)
            view[self.transport.peer_id] = own
        return view

    async def beat(self) -> None:
        """Publish our heartbeat (in our shard) and refresh the view (from the next shard of
        the rotation; the one key when the run is not sharded)."""
        own = member_shard(self.transport.peer_id, self.shards)
        sealed, expiration = self.sealed_beat()
        await self.transport.store(
            member_shard_key(self.run, own, self.shards), self.transport.peer_id, sealed, expiration
        )
        if self.shards > 1 and (self._unswept is None or self._unswept):
            await self.sweep()
            return
        shard = self.next_shard()
        records = await self.transport.get(member_shard_key(self.run, shard, self.shards))
        self.refresh(records, shard)

    async def sweep(self) -> None:
        """Read every shard once (a sharded run's first beat): a newcomer elects from the
        whole membership at once instead of from the few shards its rotation has reached
        (one shard per beat: a full view only after `shards` beats, over four minutes at
        128 shards, while its elections disagreed with everyone else's). It costs one read
        of the whole membership, ~0.6 kB per member, once per session.

        Resumable: each shard enters the view as it arrives, and a sweep cut off by the
        beat's deadline (`BEAT_TIMEOUT_S`) goes on at the next beat with the shards it had
        not read. Before, a cut-off sweep started over and its view got nothing: at
        N = 1,000 (~600 kB) a link under ~160 kbit/s would read the membership every beat
        and never finish. A shard whose read failed counts as read (the rotation comes
        back to it)."""
        if self._unswept is None:
            self._unswept = set(range(self.shards))
        limit = asyncio.Semaphore(SWEEP_READS_AT_ONCE)

        async def read(shard: int) -> None:
            async with limit:
                try:
                    records = await self.transport.get(member_shard_key(self.run, shard, self.shards))
                except TransportError:
                    records = None
            self._unswept.discard(shard)
            if isinstance(records, dict):
                self.refresh(records, shard)

        await asyncio.gather(*(read(shard) for shard in sorted(self._unswept)), return_exceptions=True)
        if not self._unswept:
            self.next_shard()  # the rotation starts after the sweep

    @property
    def settle_s(self) -> float:
        """How long after joining every peer has read a member's beat: one rotation through
        the shards (and two periods of slack); 0 with one members key (every beat reads
        it whole)."""
        return settle_s(self.shards, self.heartbeat_s)

    def settled(self, beat: Heartbeat) -> bool:
        """Whether every peer reading the membership has seen `beat`'s peer by now (it
        joined at least `settle_s` ago): only such a peer is elected synchronizer by a
        sharded swarm (`synchronizer_candidates`), so the peers that elect agree."""
        return beat.joined_at <= self.now() - self.settle_s

    def next_shard(self) -> int:
        """The shard this beat reads: a rotation through all of them, in an order of this
        peer's own (an odd stride from its own shard), so readers spread over the shards."""
        if self.shards == 1:
            return 0
        start = member_shard(self.transport.peer_id, self.shards)
        stride = 2 * (member_shard("stride" + self.transport.peer_id, self.shards) // 2) + 1
        self._reads += 1
        return (start + (self._reads - 1) * stride) % self.shards

    def refresh(self, records: dict[str, tuple[bytes, float]], shard: int = 0) -> None:
        """The live view from the members records read, at swarm time; the swarm offset is
        re-estimated from the send times the others signed (this peer's own beat left out:
        it would vote for our own clock twice). Sharded, the records are those of `shard`
        only: the view keeps every other shard's peers as last read (`_remember`)."""
        local = self.transport.now()
        cache = self._verdicts
        opened, unsigned = open_members(self.run, records, local - MAX_CLOCK_OFFSET_S, cache)
        self._verdicts = {k: cache[k] for k in ((s, r[0]) for s, r in records.items()) if k in cache}
        if self.shards == 1 or len(opened) >= MIN_SHARD_VOTES:
            # a shard of a few beats re-estimates nothing: one stale beat (a peer that just
            # left) would be half the vote and pull this peer's clock back by its age
            self.offset_s = swarm_offset_s(opened, local, self.transport.peer_id, self.clock_voters)
        live, refused = judge_members(opened, self.now(), self.config_hash)
        rejected = {**unsigned, **refused}
        for subkey, reason in rejected.items():
            if subkey not in self.rejected:
                log.warning("ignored member subkey=%s reason=%r", subkey[-8:], reason)
        if self.shards > 1:
            live = self._remember(live, shard)
        self.live, self.rejected = live, rejected

    def _remember(self, live: dict[str, Heartbeat], shard: int) -> dict[str, Heartbeat]:
        """Sharded view: the peers `shard` shows live now replace what it showed before;
        other shards' peers stay as last read, for two rotations at most (a shard that
        could not be read for that long is forgotten)."""
        now = time.monotonic()
        horizon = 2 * self.shards * self.heartbeat_s + 4 * self.heartbeat_s
        kept = {p: r for p, r in self._remembered.items() if r[1] != shard and now - r[2] <= horizon}
        kept.update({p: (b, shard, now) for p, b in live.items() if member_shard(p, self.shards) == shard})
        self._remembered = kept
        return {p: r[0] for p, r in kept.items()}

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


async def read_members(transport: Transport, run: str, shards: int = 1) -> dict[str, tuple[bytes, float]]:
    """Every membership record of the run: the one key, or all its shards at once (what an
    observer or the dashboard reads; a learner reads one shard per beat)."""
    keys = [member_shard_key(run, shard, shards) for shard in range(max(1, shards))]
    merged: dict[str, tuple[bytes, float]] = {}
    for records in await asyncio.gather(*(transport.get(key) for key in keys)):
        merged.update(records)
    return merged
