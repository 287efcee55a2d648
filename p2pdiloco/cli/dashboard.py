"""The terminal dashboard: plain data in, rich renderables out.

It reads what peers publish (heartbeats and round records) and never drives the run.
`SwarmSnapshot` is the data; the `render_*` functions of `p2pdiloco.cli.panels` are pure
functions of a snapshot; `Observer` builds snapshots from a transport, applying the run's
admission (a record of a synchronizer the run does not entitle is ignored, a certified one
is shown as such); `watch` (the live screen) and `observe_once` join the DHT as a
client-mode observer, for `p2pdiloco dashboard`, `status` and `demo`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from p2pdiloco.cli.panels import (
    CERTIFIED,
    NOT_ADMITTED,
    human_bytes,
    loss_spread,
    render_dashboard,
    render_header,
    render_peers,
    short,
    sparkline,
    weight_shares,
)
from p2pdiloco.cli.snapshot import HISTORY_ROUNDS, SwarmSnapshot
from p2pdiloco.config import PeerConfig
from p2pdiloco.protocol.membership import Heartbeat, live_members
from p2pdiloco.protocol.rounds import RoundRecord, open_record, rank, rounds_key
from p2pdiloco.roles.presence import read_members
from p2pdiloco.trust.admission import Admission

__all__ = [
    "Observer",
    "SwarmSnapshot",
    "human_bytes",
    "observe_once",
    "render_dashboard",
    "render_header",
    "render_peers",
    "short",
    "sparkline",
    "watch",
]





def _peer_json(beat: Heartbeat) -> dict[str, Any]:
    """A heartbeat as JSON: its fields, certificates as a count (bytes are not JSON)."""
    data = dataclasses.asdict(beat)
    data["certificates"] = len(beat.certificates)
    return data


def admission_label(admission: Admission, run: str, beat: Heartbeat, now: float) -> str:
    """What the run's admission makes of a live peer (`SwarmSnapshot.admission`)."""
    if admission.learner_refusal(run, beat.peer_id, beat.certificates, now) is not None:
        return NOT_ADMITTED
    if admission.synchronizers == "certified":
        entitled = admission.synchronizer_refusal(run, beat.peer_id, beat.certificates, now) is None
        return CERTIFIED if entitled else "learner"
    return "open"


class Observer:
    """Builds snapshots of a run from a started transport (client mode is enough)."""

    def __init__(
        self,
        transport: Any,
        run: str,
        num_fragments: int,
        keep_gone_s: float = 60.0,
        admission: Admission | None = None,
        min_quorum: int = 1,
        max_grace_s: float = 0.0,
        member_shards: int = 1,
        record_epoch_rounds: int = 0,
    ) -> None:
        self.transport = transport
        self.run = run
        self.member_shards = member_shards
        self.record_epoch_rounds = record_epoch_rounds
        self.num_fragments = num_fragments
        self.keep_gone_s = keep_gone_s
        self.admission = admission or Admission()
        self.snapshot = SwarmSnapshot(
            run=run,
            taken_at=transport.now(),
            rounds=[None] * num_fragments,
            history=[[] for _ in range(num_fragments)],
            min_quorum=min_quorum,
            max_grace_s=max_grace_s,
            admission_modes=""
            if self.admission.is_open
            else f"synchronizers {self.admission.synchronizers}, learners {self.admission.learners}",
        )
        self._seen_beats: dict[str, Heartbeat] = {}
        self._records: list[dict[int, RoundRecord]] = [{} for _ in range(num_fragments)]

    def _entitled(self, record: RoundRecord) -> bool:
        """Whether the run lets `record`'s synchronizer commit it (the DHT's rule too)."""
        refusal = self.admission.synchronizer_refusal(
            self.run, record.synchronizer, record.certificates, record.closed_at
        )
        return refusal is None

    async def _read_records(self, fragment: int, beats) -> dict[str, tuple[bytes, float]]:  # noqa: ANN001
        """The fragment's records: its one key, or (epochs) the two epochs up to the head
        the live members claim (the screen shows the last rounds only)."""
        size = self.record_epoch_rounds
        if size <= 0:
            return await self.transport.get(rounds_key(self.run, fragment))
        head = max((b.rounds[fragment] for b in beats if len(b.rounds) > fragment), default=0)
        keys = {rounds_key(self.run, fragment, r, size) for r in (max(head - size, 0), head)}
        raw: dict[str, tuple[bytes, float]] = {}
        for found in await asyncio.gather(*(self.transport.get(k) for k in sorted(keys))):
            raw.update(found)
        return raw

    async def refresh(self) -> SwarmSnapshot:
        now = self.transport.now()
        records = await read_members(self.transport, self.run, self.member_shards)
        live, _rejected = live_members(self.run, records, now)
        snap = self.snapshot
        snap.taken_at = now
        snap.members = {p: b for p, b in live.items() if b.role == "learner"}
        for peer, beat in snap.members.items():
            snap.last_seen[peer] = now
            self._seen_beats[peer] = beat
        snap.gone = {
            p: b
            for p, b in self._seen_beats.items()
            if p not in snap.members and now - snap.last_seen.get(p, now) < self.keep_gone_s
        }
        snap.admission = {p: admission_label(self.admission, self.run, b, now) for p, b in snap.members.items()}
        for fragment in range(self.num_fragments):
            raw = await self._read_records(fragment, snap.members.values())
            kept = self._records[fragment]
            for value, _expiration in raw.values():
                record = open_record(self.run, value)
                if record is None or record.fragment != fragment or not self._entitled(record):
                    continue
                held = kept.get(record.round)
                if held is None or rank(self.run, record) < rank(self.run, held):
                    kept[record.round] = record
            for old in sorted(kept)[:-HISTORY_ROUNDS]:
                del kept[old]
            snap.history[fragment] = [kept[r] for r in sorted(kept)]
            if kept:
                snap.rounds[fragment] = kept[max(kept)]
        losses = [b.eval_loss for b in snap.members.values() if b.eval_loss > 0]
        if losses:
            loss = min(losses)
            if not snap.loss_history or snap.loss_history[-1] != loss:
                snap.loss_history.append(loss)
        return snap


async def _open_observer(peer: PeerConfig, num_fragments: int, kind: str, **view: Any) -> tuple[Any, Observer]:
    """A started client-mode transport joined through `peer.initial_peers`, and an
    observer of `peer.run` on it (never the peer's own address or identity); `view`:
    the observer's admission, min_quorum and max_grace_s."""
    from p2pdiloco.peer.daemon import make_transport_for

    transport = make_transport_for(
        PeerConfig(
            initial_peers=peer.initial_peers,
            client_mode=True,
            startup_timeout_s=peer.startup_timeout_s,
        ),
        kind=kind,
    )
    await transport.start()
    return transport, Observer(transport, peer.run, num_fragments, **view)


async def observe_once(
    peer: PeerConfig, num_fragments: int, transport_kind: str = "hivemind", **view: Any
) -> SwarmSnapshot:
    """One snapshot of the run (`p2pdiloco status`); `view` as for `Observer`."""
    transport, observer = await _open_observer(peer, num_fragments, transport_kind, **view)
    try:
        return await observer.refresh()
    finally:
        await transport.shutdown()


async def watch(
    peer: PeerConfig,
    num_fragments: int,
    refresh_s: float = 1.0,
    keep_going: Callable[[], bool] = lambda: True,
    transport_kind: str = "hivemind",
    **view: Any,
) -> None:
    """The live screen: a fresh snapshot every `refresh_s` seconds while `keep_going()`;
    `view` as for `Observer` (admission, min_quorum, max_grace_s)."""
    from rich.live import Live

    transport, observer = await _open_observer(peer, num_fragments, transport_kind, **view)
    try:
        with Live(render_dashboard(await observer.refresh()), refresh_per_second=2) as live:
            while keep_going():
                await asyncio.sleep(refresh_s)  # the screen's refresh period
                live.update(render_dashboard(await observer.refresh()))
    finally:
        await transport.shutdown()


def snapshot_json(snapshot: SwarmSnapshot) -> dict[str, Any]:
    """Machine-readable form (`p2pdiloco status --json`)."""
    return {
        "run": snapshot.run,
        "taken_at": snapshot.taken_at,
        "rounds": [
            None
            if r is None
            else {
                "round": r.round,
                "fragment": r.fragment,
                "synchronizer": r.synchronizer,
                "hash": r.hash,
                "contributors": [c[0] for c in r.contributors],
                "grace_s": r.grace_s,
            }
            for r in snapshot.rounds
        ],
        "peers": [
            _peer_json(b) | {"last_seen": snapshot.last_seen.get(b.peer_id), "admission": snapshot.admission.get(b.peer_id, "open")}
            for b in snapshot.learners()
        ],
        "tokens_per_s": sum(b.tokens_per_s for b in snapshot.learners()),
        "eval_loss": snapshot.loss_history[-1] if snapshot.loss_history else None,
        "admission": snapshot.admission_modes or "open",
        "min_quorum": snapshot.min_quorum,
        "windows": [
            [
                {
                    "round": r.round,
                    "synchronizer": r.synchronizer,
                    "contributors": [{"peer_id": p, "weight": w, "tokens": t} for p, w, t in r.contributors],
                    "refused": len(r.refused),
                    "grace_s": r.grace_s,
                    "closed_at": r.closed_at,
                }
                for r in fragment
            ]
            for fragment in snapshot.history
        ],
        "weight_shares": [dataclasses.asdict(s) for s in weight_shares(snapshot)],
        "loss_spread": {
            name: None if spread is None else dataclasses.asdict(spread) | {"width": spread.width}
            for name, spread in (("train", loss_spread(snapshot.learners(), "loss")), ("eval", loss_spread(snapshot.learners(), "eval_loss")))
        },
    }
