"""The terminal dashboard: plain data in, rich renderables out.

It reads what peers publish (heartbeats and round records) and never drives the run.
`SwarmSnapshot` is the data; `render_*` are pure functions of a snapshot; `Observer`
builds snapshots from a transport; `watch` (the live screen) and `observe_once` join the
DHT as a client-mode observer, for `p2pdiloco dashboard`, `status` and `demo`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from p2pdiloco.config import PeerConfig
from p2pdiloco.membership import Heartbeat, live_members, members_key
from p2pdiloco.rounds import RoundRecord, open_record, rounds_key

SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class SwarmSnapshot:
    """Everything the dashboard shows, at one instant."""

    run: str
    taken_at: float
    """DHT time of the snapshot, seconds."""
    members: dict[str, Heartbeat] = field(default_factory=dict)
    rounds: list[RoundRecord | None] = field(default_factory=list)
    """Latest round record per fragment (None: no round closed yet)."""
    loss_history: list[float] = field(default_factory=list)
    """Held-out loss reported by peers over time (for the sparkline)."""
    last_seen: dict[str, float] = field(default_factory=dict)
    """DHT time each peer was last seen alive (gone peers stay listed for a while)."""
    gone: dict[str, Heartbeat] = field(default_factory=dict)

    def learners(self) -> list[Heartbeat]:
        return sorted(
            (b for b in self.members.values() if b.role == "learner"), key=lambda b: b.peer_id
        )

    def to_json(self) -> dict[str, Any]:
        """Machine-readable form (`p2pdiloco status --json`)."""
        return {
            "run": self.run,
            "taken_at": self.taken_at,
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
                for r in self.rounds
            ],
            "peers": [
                dataclasses.asdict(b) | {"last_seen": self.last_seen.get(b.peer_id)}
                for b in self.learners()
            ],
            "tokens_per_s": sum(b.tokens_per_s for b in self.learners()),
            "eval_loss": self.loss_history[-1] if self.loss_history else None,
        }


def sparkline(values: list[float], width: int = 30) -> str:
    """A one-line chart of the last `width` values (lower is a shorter bar)."""
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[int((v - low) / span * (len(SPARK) - 1))] for v in values)


def human_bytes(num: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1000
    return f"{num:.1f} TB"


def short(peer_id: str) -> str:
    return f"…{peer_id[-6:]}" if len(peer_id) > 6 else peer_id


def peer_status(beat: Heartbeat) -> str:
    """training / syncing / straggling / leaving / starting, as the peer reports it."""
    return beat.status


def render_header(snapshot: SwarmSnapshot) -> RenderableType:
    """Run name, rounds and synchronizers per fragment, live peers, throughput, loss, bytes."""
    learners = snapshot.learners()
    tokens_per_s = sum(b.tokens_per_s for b in learners)
    sent = sum(b.bytes_sent for b in learners)
    received = sum(b.bytes_received for b in learners)
    rounds = []
    for fragment, record in enumerate(snapshot.rounds):
        if record is None:
            rounds.append(f"f{fragment}: round 0")
        else:
            rounds.append(
                f"f{fragment}: round {record.round + 1} (last by {short(record.synchronizer)}, {len(record.contributors)} merged)"
            )
    syncing = sorted({short(b.peer_id) for b in learners if b.synchronizing})
    loss = snapshot.loss_history[-1] if snapshot.loss_history else None
    lines = [
        Text.assemble(
            ("run ", "bold"),
            (snapshot.run, "cyan"),
            ("   live peers ", "bold"),
            str(len(learners)),
            ("   swarm ", "bold"),
            f"{tokens_per_s:,.0f} tok/s",
        ),
        Text.assemble(("rounds ", "bold"), "  ".join(rounds) or "none yet"),
        Text.assemble(("synchronizing now ", "bold"), ", ".join(syncing) or "-"),
        Text.assemble(
            ("held-out loss ", "bold"),
            f"{loss:.4f} " if loss else "- ",
            (sparkline(snapshot.loss_history), "green"),
        ),
        Text.assemble(("bytes ", "bold"), f"up {human_bytes(sent)}  down {human_bytes(received)}"),
    ]
    return Panel(Group(*lines), title="p2pdiloco", border_style="blue")


def render_peers(snapshot: SwarmSnapshot) -> RenderableType:
    """One row per peer: id, device, throughput, contributions, weight, last seen, role, status."""
    table = Table(expand=True)
    for name, justify in [
        ("peer", "left"),
        ("device", "left"),
        ("tok/s", "right"),
        ("tokens contrib.", "right"),
        ("rounds contrib.", "right"),
        ("last weight", "right"),
        ("last seen", "right"),
        ("role", "left"),
        ("status", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows = [
        (b, "synchronizer" if b.synchronizing else "learner", peer_status(b))
        for b in snapshot.learners()
    ]
    rows += [
        (b, "learner", "gone") for b in sorted(snapshot.gone.values(), key=lambda b: b.peer_id)
    ]
    for beat, role, status in rows:
        seen = snapshot.taken_at - snapshot.last_seen.get(beat.peer_id, snapshot.taken_at)
        style = {"gone": "dim", "straggling": "yellow", "syncing": "cyan"}.get(status, "")
        table.add_row(
            short(beat.peer_id),
            beat.device,
            f"{beat.tokens_per_s:,.0f}",
            f"{beat.tokens_contributed:,}",
            str(beat.rounds_contributed),
            f"{beat.last_weight:.2f}",
            f"{max(seen, 0):.0f}s ago",
            role,
            status,
            style=style,
        )
    return table


def render_dashboard(snapshot: SwarmSnapshot) -> RenderableType:
    """The whole screen."""
    return Group(render_header(snapshot), render_peers(snapshot))


class Observer:
    """Builds snapshots of a run from a started transport (client mode is enough)."""

    def __init__(
        self, transport: Any, run: str, num_fragments: int, keep_gone_s: float = 60.0
    ) -> None:
        self.transport = transport
        self.run = run
        self.num_fragments = num_fragments
        self.keep_gone_s = keep_gone_s
        self.snapshot = SwarmSnapshot(
            run=run, taken_at=transport.now(), rounds=[None] * num_fragments
        )
        self._seen_beats: dict[str, Heartbeat] = {}

    async def refresh(self) -> SwarmSnapshot:
        now = self.transport.now()
        records = await self.transport.get(members_key(self.run))
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
        for fragment in range(self.num_fragments):
            raw = await self.transport.get(rounds_key(self.run, fragment))
            decoded = [
                r for r in (open_record(self.run, v) for v, _ in raw.values()) if r is not None
            ]
            if decoded:
                snap.rounds[fragment] = max(decoded, key=lambda r: r.round)
        losses = [b.eval_loss for b in snap.members.values() if b.eval_loss > 0]
        if losses:
            loss = min(losses)
            if not snap.loss_history or snap.loss_history[-1] != loss:
                snap.loss_history.append(loss)
        return snap


async def _open_observer(peer: PeerConfig, num_fragments: int, kind: str) -> tuple[Any, Observer]:
    """A started client-mode transport joined through `peer.initial_peers`, and an
    observer of `peer.run` on it (never the peer's own address or identity)."""
    from p2pdiloco.peer import make_transport_for

    transport = make_transport_for(
        PeerConfig(
            initial_peers=peer.initial_peers,
            client_mode=True,
            startup_timeout_s=peer.startup_timeout_s,
        ),
        kind=kind,
    )
    await transport.start()
    return transport, Observer(transport, peer.run, num_fragments)


async def observe_once(peer: PeerConfig, num_fragments: int, transport_kind: str = "hivemind") -> SwarmSnapshot:
    """One snapshot of the run (`p2pdiloco status`)."""
    transport, observer = await _open_observer(peer, num_fragments, transport_kind)
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
) -> None:
    """The live screen: a fresh snapshot every `refresh_s` seconds while `keep_going()`."""
    from rich.live import Live

    transport, observer = await _open_observer(peer, num_fragments, transport_kind)
    try:
        with Live(render_dashboard(await observer.refresh()), refresh_per_second=2) as live:
            while keep_going():
                await asyncio.sleep(refresh_s)  # the screen's refresh period
                live.update(render_dashboard(await observer.refresh()))
    finally:
        await transport.shutdown()
