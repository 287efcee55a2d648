"""The dashboard's panels: pure functions from a `SwarmSnapshot` to rich renderables.

What an operator of a decoupled run watches, besides who is there: how the merge weighs
each learner and how stale their deltas are (`render_contributions`), whether windows
reach their quorum and how long they wait for stragglers (`render_windows`), where the
bytes go (`render_bytes`), what the audits concluded (`render_audits`) and how far apart
the learners' losses are (`render_loss`). Nothing here reads the network or the clock:
`dashboard.Observer` builds the snapshot, the tests render pinned ones.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from p2pdiloco.cli.snapshot import SwarmSnapshot
    from p2pdiloco.protocol.membership import Heartbeat

SPARK = "▁▂▃▄▅▆▇█"
CERTIFIED = "certified"
"""Admission label of a peer whose synchronizer certificate the run's operator signed."""
NOT_ADMITTED = "not admitted"
"""Admission label of a learner whose deltas the run's synchronizers refuse."""


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


def _table(title: str, columns: list[tuple[str, str]], caption: str = "") -> Table:
    table = Table(
        title=title,
        title_justify="left",
        caption=caption or None,
        caption_justify="left",
        expand=True,
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    return table


# --- the header and the peers --------------------------------------------------------------


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
    if snapshot.admission_modes:
        certified = sum(1 for b in learners if snapshot.admission.get(b.peer_id) == CERTIFIED)
        refused = sum(1 for b in learners if snapshot.admission.get(b.peer_id) == NOT_ADMITTED)
        lines.append(
            Text.assemble(
                ("admission ", "bold"),
                f"{snapshot.admission_modes}   certified synchronizers live {certified}",
                (f"   not admitted {refused}", "red") if refused else "",
            )
        )
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
        (b, "synchronizer" if b.synchronizing else "learner", b.status) for b in snapshot.learners()
    ]
    rows += [
        (b, "learner", "gone") for b in sorted(snapshot.gone.values(), key=lambda b: b.peer_id)
    ]
    for beat, role, status in rows:
        seen = snapshot.taken_at - snapshot.last_seen.get(beat.peer_id, snapshot.taken_at)
        admitted = snapshot.admission.get(beat.peer_id, "")
        if admitted == NOT_ADMITTED and status != "gone":
            status = NOT_ADMITTED
        style = {"gone": "dim", "straggling": "yellow", "syncing": "cyan", NOT_ADMITTED: "red"}.get(
            status, ""
        )
        table.add_row(
            short(beat.peer_id),
            beat.device,
            f"{beat.tokens_per_s:,.0f}",
            f"{beat.tokens_contributed:,}",
            str(beat.rounds_contributed),
            f"{beat.last_weight:.2f}",
            f"{max(seen, 0):.0f}s ago",
            f"{role} ✓" if admitted == CERTIFIED else role,
            status,
            style=style,
        )
    if snapshot.admission_modes:
        table.caption = "✓: certified synchronizer (the run's operator signed its certificate)"
        table.caption_justify = "left"
    return table


# --- a decoupled run's panels ----------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """One learner's part in the recent merges."""

    peer_id: str
    rounds: int
    """Recent rounds (all fragments) that merged one of its deltas."""
    last: float
    """Its weight in the latest round of any fragment (0 when that round left it out)."""
    mean: float
    """Its weight summed over the recent rounds, over the number of rounds: its share of
    all merged weight."""
    tokens: int
    """Tokens its merged deltas carried, as the records list them."""


def weight_shares(snapshot: SwarmSnapshot) -> list[Share]:
    """Every learner seen live or in a recent round, by share of the merged weight."""
    records = [r for fragment in snapshot.history for r in fragment]
    latest = max(records, key=lambda r: (r.closed_at, r.round), default=None)
    peers = {b.peer_id for b in snapshot.learners()} | {
        c[0] for r in records for c in r.contributors
    }
    shares = []
    for peer in peers:
        merged = [(w, t) for r in records for p, w, t in r.contributors if p == peer]
        last = (latest.weight_of(peer) or 0.0) if latest is not None else 0.0
        mean = sum(w for w, _ in merged) / len(records) if records else 0.0
        shares.append(Share(peer, len(merged), last, mean, sum(t for _, t in merged)))
    return sorted(shares, key=lambda s: (-s.mean, s.peer_id))


def render_contributions(snapshot: SwarmSnapshot) -> RenderableType:
    """Per learner: rounds merged, weight share (latest round, recent mean), staleness of its
    last merged delta, tokens merged."""
    recent = sum(len(f) for f in snapshot.history)
    table = _table(
        f"contributions (last {recent} rounds)",
        [
            ("peer", "left"),
            ("merged", "right"),
            ("share", "right"),
            ("avg", "right"),
            ("stale", "right"),
            ("tokens", "right"),
        ],
        caption="share: weight in the latest round; avg: over these rounds; stale: rounds "
        "between the base and the round of its last merged delta",
    )
    beats = snapshot.members
    for share in weight_shares(snapshot):
        beat = beats.get(share.peer_id)
        stale = str(beat.staleness) if beat is not None else "-"
        style = (
            "yellow"
            if beat is not None and beat.staleness >= 2
            else ("dim" if beat is None else "")
        )
        table.add_row(
            short(share.peer_id),
            str(share.rounds),
            f"{share.last:.2f}",
            f"{share.mean:.2f}",
            stale,
            f"{share.tokens:,}",
            style=style,
        )
    return table


def render_windows(snapshot: SwarmSnapshot, per_fragment: int = 3) -> RenderableType:
    """The last rounds of each fragment: who closed it, merged deltas against the quorum K,
    refused ones, the grace waited for stragglers, how long ago."""
    table = _table(
        f"windows (quorum K={snapshot.min_quorum}, grace ≤ {snapshot.max_grace_s:g} s)",
        [
            ("f", "right"),
            ("round", "right"),
            ("closed by", "left"),
            ("n/K", "right"),
            ("ref.", "right"),
            ("grace", "right"),
            ("ago", "right"),
        ],
        caption="n/K: deltas merged / quorum; ref.: refused by screening; grace: waited for stragglers",
    )
    for fragment, records in enumerate(snapshot.history):
        for record in sorted(records, key=lambda r: -r.round)[:per_fragment]:
            merged = len(record.contributors)
            sync = short(record.synchronizer)
            if snapshot.admission.get(record.synchronizer) == CERTIFIED:
                sync += "✓"
            table.add_row(
                str(fragment),
                str(record.round + 1),
                sync,
                f"{merged}/{snapshot.min_quorum}",
                str(len(record.refused)),
                f"{record.grace_s:.1f} s",
                f"{max(snapshot.taken_at - record.closed_at, 0):.0f}s",
                style="red" if record.refused else "",
            )
    if not table.rows:
        table.caption = "no round closed yet"
    return table


def render_bytes(snapshot: SwarmSnapshot) -> RenderableType:
    """Bytes by kind, per learner and in all: deltas sent, synchronizers' replies, what the
    replica fetched (round updates, state downloads, audited contributions)."""
    table = _table(
        "bytes by kind",
        [
            ("peer", "left"),
            ("sent: deltas", "right"),
            ("recv: replies", "right"),
            ("recv: replica", "right"),
            ("recv: all", "right"),
        ],
    )
    learners = snapshot.learners()
    for beat in learners:
        table.add_row(
            short(beat.peer_id),
            human_bytes(beat.bytes_sent),
            human_bytes(beat.reply_bytes),
            human_bytes(beat.replica_bytes),
            human_bytes(beat.bytes_received),
        )
    if learners:
        table.add_row(
            "all",
            *(
                human_bytes(sum(getattr(b, k) for b in learners))
                for k in ("bytes_sent", "reply_bytes", "replica_bytes", "bytes_received")
            ),
            style="bold",
        )
    return table


def render_audits(snapshot: SwarmSnapshot) -> RenderableType:
    """What each learner's audits concluded: rounds recomputed and found right, proven
    false, or left unverifiable."""
    table = _table(
        "audits", [("peer", "left"), ("ok", "right"), ("false", "right"), ("unverifiable", "right")]
    )
    learners = snapshot.learners()
    for beat in learners:
        table.add_row(
            short(beat.peer_id),
            str(beat.audits_ok),
            str(beat.audits_mismatch),
            str(beat.audits_unverifiable),
            style="bold red" if beat.audits_mismatch else "",
        )
    totals = [
        sum(getattr(b, k) for b in learners)
        for k in ("audits_ok", "audits_mismatch", "audits_unverifiable")
    ]
    if learners:
        table.add_row("all", *map(str, totals), style="bold red" if totals[1] else "bold")
    if not any(totals):
        table.caption = (
            "no audits yet (each peer audits a round with probability sync.audit_share / n)"
        )
    elif totals[1]:
        table.caption = (
            "a false merge was proven: its synchronizer is banned (logs: `false merge proven`)"
        )
    return table


@dataclass(frozen=True)
class Spread:
    """How far apart the learners' losses are."""

    low: float
    low_peer: str
    median: float
    high: float
    high_peer: str

    @property
    def width(self) -> float:
        return self.high - self.low


def loss_spread(beats: list[Heartbeat], field: str) -> Spread | None:
    """The spread of `field` (`loss` or `eval_loss`) over the learners that report one."""
    values = sorted((getattr(b, field), b.peer_id) for b in beats if getattr(b, field) > 0)
    if not values:
        return None
    return Spread(
        values[0][0],
        values[0][1],
        statistics.median(v for v, _ in values),
        values[-1][0],
        values[-1][1],
    )


def render_loss(snapshot: SwarmSnapshot) -> RenderableType:
    """The loss spread across learners: each learner's training and held-out loss against
    the median, and the lowest, median and highest."""
    learners = snapshot.learners()
    train = loss_spread(learners, "loss")
    table = _table(
        "loss across learners",
        [("peer", "left"), ("train", "right"), ("vs median", "right"), ("held-out", "right")],
    )
    for beat in sorted(learners, key=lambda b: (b.loss <= 0, b.loss)):
        if train is not None and beat.loss > 0:
            off = (beat.loss - train.median) / train.median
            versus = Text(f"{off:+.1%}", style="yellow" if abs(off) > 0.1 else "")
        else:
            versus = Text("-")
        table.add_row(
            short(beat.peer_id),
            f"{beat.loss:.4f}" if beat.loss > 0 else "-",
            versus,
            f"{beat.eval_loss:.4f}" if beat.eval_loss > 0 else "-",
        )
    lines = []
    for name, spread in (("train", train), ("held-out", loss_spread(learners, "eval_loss"))):
        if spread is not None:
            lines.append(
                f"{name}: {spread.low:.4f} ({short(spread.low_peer)}) .. median {spread.median:.4f} .. "
                f"{spread.high:.4f} ({short(spread.high_peer)}), spread {spread.width:.4f}"
            )
    table.caption = "\n".join(lines) or "no learner has reported a loss yet"
    return table


TWO_COLUMNS_WIDTH = 120
"""From this terminal width on, the run's panels go two a row; below, one under another."""


class _Panels:
    """The run's panels laid out for the width they get (a pipe gets 80 columns)."""

    def __init__(self, panels: list[RenderableType]) -> None:
        self.panels = panels

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if options.max_width < TWO_COLUMNS_WIDTH:
            yield from self.panels
            return
        grid = Table.grid(expand=True, padding=(0, 1))
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        for left, right in zip(self.panels[::2], [*self.panels[1::2], ""], strict=True):
            grid.add_row(left, right)
        yield grid


def render_dashboard(snapshot: SwarmSnapshot) -> RenderableType:
    """The whole screen: the header, the peers, then the run's panels (two a row on a
    terminal at least `TWO_COLUMNS_WIDTH` wide)."""
    panels = [
        render_contributions(snapshot),
        render_windows(snapshot),
        render_bytes(snapshot),
        render_audits(snapshot),
        render_loss(snapshot),
    ]
    return Group(render_header(snapshot), render_peers(snapshot), _Panels(panels))
