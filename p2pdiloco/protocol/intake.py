"""What a synchronizer takes from a learner: the checks on one contribution, pure.

A contribution (its signature already checked) is a decoded CONTRIBUTION message from
`caller`. `check_contribution` decides, from the message and this replica's rounds and
layout alone, whether it may enter a window: `Accepted` with the claims it carries, or
`Refused` with the status the learner is answered (`rejected`: never resend it;
`behind`: the synchronizer is behind, try again; `late`: the round is closed). What
needs the network or the clock (election, rival records, the window's own rules) is the
synchronizer's, after this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from p2pdiloco import wire
from p2pdiloco.protocol.window_rules import staleness_rejection
from p2pdiloco.wire import messages

MAX_UNREACHABLE = 64
"""Peers a contribution may report unreachable (failover); more are dropped."""


@dataclass(frozen=True)
class Accepted:
    """A contribution that may enter the window of (round, fragment), with its claims."""

    round: int
    fragment: int
    base_round: int
    tokens: int
    steps: int
    step_time_s: float
    first_step: int
    last_step: int
    unreachable: frozenset[str]
    """Better-placed synchronizers the learner could not reach (failover): not moved to."""


@dataclass(frozen=True)
class Refused:
    """Why a contribution does not enter a window, and what the learner is answered."""

    status: str
    reason: str
    round: int = -1
    fragment: int = -1


def unreachable_peers(meta: dict) -> frozenset[str]:
    """The `unreachable` list of a contribution's meta, as a set of peer ids (junk dropped)."""
    listed = meta.get("unreachable") or []
    return frozenset(p for p in listed[:MAX_UNREACHABLE] if isinstance(p, str))


def layout_problem(fragment: int, msg: wire.Message, layout: dict[str, tuple[int, ...]]) -> str | None:
    """Why the message's tensors are not exactly the fragment's, or None."""
    if set(msg.tensors) != set(layout):
        return f"delta tensors do not match fragment {fragment}"
    for name, expected in layout.items():
        if tuple(msg.tensors[name].shape) != tuple(expected):
            return f"tensor {name} has shape {tuple(msg.tensors[name].shape)}, expected {tuple(expected)}"
    return None


def check_contribution(
    msg: wire.Message | wire.Rejected,
    caller: str,
    run: str,
    rounds: Sequence[int],
    layouts: Sequence[dict[str, tuple[int, ...]]],
    max_staleness_rounds: int,
) -> Accepted | Refused:
    """Whether `caller`'s decoded contribution may enter the window of its round, given
    this replica's round of each fragment (`rounds`) and their layouts."""
    if isinstance(msg, wire.Rejected):
        return Refused(messages.Reply.REJECTED, msg.reason)
    target, fragment = msg.round, msg.fragment
    if msg.kind != wire.CONTRIBUTION or msg.run != run:
        return Refused(messages.Reply.REJECTED, f"unexpected {msg.kind} for run {msg.run!r}", target, fragment)
    if msg.meta.get("peer") != caller:
        # Auditors check the signature against the named peer: a frame naming someone
        # else would make an honest merge look forged.
        return Refused(messages.Reply.REJECTED, "contribution names another peer", target, fragment)
    if not 0 <= fragment < len(rounds):
        return Refused(messages.Reply.REJECTED, f"no fragment {fragment}", target, fragment)
    current = rounds[fragment]
    if target > current:
        return Refused(messages.Reply.BEHIND, f"synchronizer at round {current}", target, fragment)
    if target < current:
        return Refused(messages.Reply.LATE, "round already closed", target, fragment)
    step_time_s = msg.meta.get("step_time_s", 0.0)
    if not isinstance(step_time_s, int | float) or not math.isfinite(step_time_s) or step_time_s < 0:
        return Refused(messages.Reply.REJECTED, "step_time_s must be a finite number >= 0", target, fragment)
    base_round = int(msg.meta["base_round"])
    reason = staleness_rejection(base_round, current, max_staleness_rounds) or layout_problem(
        fragment, msg, layouts[fragment]
    )
    if reason:
        return Refused(messages.Reply.REJECTED, reason, target, fragment)
    return Accepted(
        round=target,
        fragment=fragment,
        base_round=base_round,
        tokens=int(msg.meta["tokens"]),
        steps=int(msg.meta["steps"]),
        step_time_s=float(step_time_s),
        first_step=int(msg.meta.get("first_step", 0)),
        last_step=int(msg.meta.get("last_step", 0)),
        unreachable=unreachable_peers(msg.meta),
    )
