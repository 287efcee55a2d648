"""What the dashboard shows, at one instant: the data the panels draw (`panels`) and the
observer fills (`dashboard`), kept apart from both so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord

HISTORY_ROUNDS = 16
"""Rounds per fragment the observer keeps for the panels (one record a round)."""


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
    history: list[list[RoundRecord]] = field(default_factory=list)
    """Per fragment, the last `HISTORY_ROUNDS` rounds seen, one record a round (the
    best-ranked of rivals), oldest first."""
    min_quorum: int = 1
    """The run's `sync.min_quorum` (K): deltas a window needs before it may close."""
    max_grace_s: float = 0.0
    """The run's `sync.max_grace_s`: the longest a window waits for stragglers."""
    admission: dict[str, str] = field(default_factory=dict)
    """Per live peer, what the run's admission makes of it: `certified` (may synchronize
    in a certified run), `not admitted` (its deltas are refused), `learner` (admitted,
    may not synchronize) or `open`."""
    admission_modes: str = ""
    """The run's admission when not open everywhere, e.g. `synchronizers certified, learners open`."""

    def learners(self) -> list[Heartbeat]:
        return sorted(
            (b for b in self.members.values() if b.role == "learner"), key=lambda b: b.peer_id
        )
