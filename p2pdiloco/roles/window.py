"""One open (round, fragment) at its synchronizer: the pure machine that decides when it
closes (`protocol.window_rules.WindowMachine`), the decoded deltas it collected with their
signed claims, and the learners waiting for the answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from p2pdiloco.outer.screening import Candidate
from p2pdiloco.protocol.window_rules import WindowMachine


@dataclass
class Window:
    """An open (round, fragment): the pure machine plus the decoded deltas and waiters."""

    machine: WindowMachine
    candidates: dict[str, Candidate] = field(default_factory=dict)
    """peer -> its decoded delta with its signed claims (tokens, steps, staleness)."""
    waiters: dict[str, asyncio.Future] = field(default_factory=dict)
    arrival: asyncio.Event = field(default_factory=asyncio.Event)
    unreachable: set[str] = field(default_factory=set)
    """Better-placed synchronizers its learners could not reach (failover): not moved to."""
    sealed: dict[str, bytes] = field(default_factory=dict)
    """peer -> its signed contribution, as received (kept for auditors once committed)."""
    step_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    """peer -> (first, last) of the learner's own steps its delta says it carries (for
    the round_closed event only: goodput is attributed to when the work was done)."""
    closing: asyncio.Task | None = None
    """The task merging and committing it once the machine closed it (a leaving peer
    lets it finish)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the window's task is over (committed, moved, expired or failed): what a
    delta refused by a closing window waits for before it is answered."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.machine.round, self.machine.fragment)

    @property
    def round(self) -> int:
        return self.machine.round

    @property
    def fragment(self) -> int:
        return self.machine.fragment

    def answer(self, peer: str, reply: bytes) -> bool:
        """Answer one waiting learner (True if it was still waiting)."""
        waiter = self.waiters.get(peer)
        if waiter is None or waiter.done():
            return False
        waiter.set_result(reply)
        return True

    def answer_all(self, reply: bytes) -> None:
        """Answer every learner still waiting (the same bytes for all)."""
        for peer in self.waiters:
            self.answer(peer, reply)
