"""Fault injection for tests and benchmarks, wrapped around the production path.

Nothing here runs unless asked for (`join --crash-at`, `P2PDILOCO_CRASH_AT`,
`--straggle-s`, `--corrupt`): the daemon wraps the commit's steps (`hook_steps`) and
the plain `submit` only then; production code knows of no hook.

Crash points of a synchronizer's commit (the steps of `roles.commit`, docs/protocol.md):
`after_quorum`, `during_merge`, `after_hold` (update held, no record yet),
`after_record` (committed, nobody answered), `after_first_reply`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from p2pdiloco import compress, wire
from p2pdiloco.roles.commit import Committer

Hook = Callable[[str, int, int], Awaitable[None]]
"""`await hook(phase, round, fragment)` at each phase of a commit."""

log = logging.getLogger(__name__)

CRASH_PHASES = ("after_quorum", "during_merge", "after_hold", "after_record", "after_first_reply")
REPLY_FLUSH_S = 1.0
"""After the first reply, time given to the transport to deliver it before dying, s."""


def parse_crash_at(spec: str) -> tuple[str, int] | None:
    """`PHASE` or `PHASE:ROUND` (round >= 0, default: the first round this peer closes)."""
    if not spec:
        return None
    phase, _, round_text = spec.partition(":")
    if phase not in CRASH_PHASES:
        raise ValueError(f"crash point must be one of {', '.join(CRASH_PHASES)}, got {phase!r}")
    try:
        round_id = int(round_text) if round_text else -1
    except ValueError:
        raise ValueError(f"crash round must be an int, got {round_text!r}") from None
    return phase, round_id


def die_now() -> None:
    """SIGKILL this peer with everything it spawned (its DHT process, its p2pd daemon)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def hook_steps(committer: Committer, hook: Hook) -> None:
    """Make `committer` await `hook(phase, round, fragment)` between the steps of each
    commit: before the merge, while it runs, after the hold, after the record, after
    the first answer."""
    merge, hold, publish, answer_first = committer.merge, committer.hold, committer.publish, committer.answer_first

    async def merging(window, grace_s):
        await hook("after_quorum", window.round, window.fragment)
        running = asyncio.ensure_future(merge(window, grace_s))
        await asyncio.sleep(0)  # the merge is on the worker thread now
        await hook("during_merge", window.round, window.fragment)
        return await running

    async def holding(update):
        holders = await hold(update)
        if holders is not None:
            await hook("after_hold", update.round, update.fragment)
        return holders

    async def publishing(window, merged, record):
        failure = await publish(window, merged, record)
        if not failure:
            await hook("after_record", window.round, window.fragment)
        return failure

    async def answering(window, reply):
        await answer_first(window, reply)
        await hook("after_first_reply", window.round, window.fragment)

    committer.merge, committer.hold = merging, holding  # type: ignore[method-assign]
    committer.publish, committer.answer_first = publishing, answering  # type: ignore[method-assign]


def crash_hook(spec: str, on_event=lambda event: None) -> Hook | None:
    """A commit hook that kills this process at the named phase (None: no crash asked)."""
    parsed = parse_crash_at(spec)
    if parsed is None:
        return None
    phase, round_id = parsed

    async def hook(reached: str, round_now: int, fragment: int) -> None:
        if reached != phase or (round_id >= 0 and round_now != round_id):
            return
        log.warning("fault injection: crashing at phase=%s round=%d", phase, round_now)
        on_event({"event": "crashing", "phase": phase, "round": round_now, "fragment": fragment})
        if phase == "after_first_reply":
            await asyncio.sleep(REPLY_FLUSH_S)  # let the transport deliver the first reply
        elif phase == "during_merge":
            await asyncio.sleep(0)  # the merge is running on the worker thread now
        die_now()

    return hook


def corrupt_frame(frame: bytes, kind: str) -> bytes:
    """A frame with a NaN in its first tensor, or random garbage."""
    if kind == "garbage":
        return bytes(reversed(frame[: len(frame) // 2]))
    msg = wire.decode_message(frame, wire.WireLimits())
    assert not isinstance(msg, wire.Rejected)
    tensors = compress.decode_tensors(msg.tensors)
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    fp32 = compress.make_codec("fp32")
    encoded = {**msg.tensors, name: fp32.encode(tensors[name])}
    return wire.encode_message(
        wire.Message(
            kind=msg.kind, run=msg.run, round=msg.round, fragment=msg.fragment,
            meta=msg.meta, tensors=encoded,
        )
    )


def faulty_contribute(contribute, straggle_s: float, straggle_rounds: int, corrupt: str, corrupt_rounds: int):
    """Wrap `LearnerLink.contribute` with injected latency and corruption: contributions to
    rounds below `corrupt_rounds`, and this peer's first `corrupt_rounds` contributions."""

    sent = 0

    async def wrapped(fragment: int, target_round: int, frame: bytes):
        nonlocal sent
        sent += 1
        if straggle_s > 0 and target_round < straggle_rounds:
            await asyncio.sleep(straggle_s)  # injected latency (no netem here)
        # every contribution to the first rounds, and the first ones wherever they land
        # (a peer that starts late still sends its corrupt delta)
        if corrupt and (target_round < corrupt_rounds or sent <= corrupt_rounds):
            frame = corrupt_frame(frame, corrupt)
        return await contribute(fragment, target_round, frame)

    return wrapped


class SplitView:
    """Fault injection: for the first `rounds` rounds of fragment 0 this peer sees only
    itself when it elects, contributes and synchronizes, and ignores rival records, so
    two peers commit the same round on purpose (the canonical-chain rule must then pick
    one everywhere). Replica sync keeps the true view, so the loser can repair."""

    def __init__(self, rounds: int, own_id: Callable[[], str], round_of: Callable[[int], int]) -> None:
        self.rounds = rounds
        self.own_id = own_id
        self.round_of = round_of

    def blind(self) -> bool:
        return self.round_of(0) < self.rounds

    def view(self, members: Callable[[], dict]) -> Callable[[], dict]:
        """The membership as this peer's roles see it."""

        def seen() -> dict:
            everyone = members()
            if not self.blind():
                return everyone
            me = self.own_id()
            return {me: everyone[me]} if me in everyone else {}

        return seen

    def rivals_visible(self, round_id: int) -> bool:
        return round_id >= self.rounds
