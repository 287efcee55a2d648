"""The swarm's messages and records on top of `wire`: RPC names, reply kinds, round records.

RPCs (each request and reply is one `wire` frame, moved in bounded chunks):

    contribute   learner -> synchronizer  CONTRIBUTION        -> CONTRIBUTE_REPLY (+ update)
    hold_update  synchronizer -> peer     OUTER_UPDATE        -> CONTRIBUTE_REPLY(held)
    get_update   peer -> peer             UPDATE_REQUEST      -> OUTER_UPDATE or CONTRIBUTE_REPLY(missing)
    get_state    joiner -> peer           STATE_REQUEST(part) -> STATE_REPLY (one part of a fragment)
    get_contributions  auditor -> synchronizer  [round, fragment] -> signed contributions

DHT records: heartbeats (see `membership`) and round records (see `rounds`).

`decode_reply` and `parse_contributors` turn untrusted replies into a `wire.Message` or a
`wire.Rejected(reason)`; they never raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from p2pdiloco import wire
from p2pdiloco.wire import MessageKind, register_kind

RPC_CONTRIBUTE = "contribute"
RPC_GET_UPDATE = "get_update"
RPC_GET_STATE = "get_state"
RPC_HOLD_UPDATE = "hold_update"
RPC_GET_CONTRIBUTIONS = "get_contributions"

CONTRIBUTE_REPLY = "contribute_reply"
"""synchronizer -> learner: status of a contribution, with the round's update if closed."""
UPDATE_REQUEST = "update_request"
"""peer -> peer: send the encoded update of (round, fragment) if you keep it."""
STATE_REPLY = "state_reply"
"""peer -> joiner: parameters (`p/<name>`), momentum (`m/<name>`) and sums (`a/<name>`) of
one fragment, in parts that fit the wire limits (`state_transfer`)."""

class Reply(StrEnum):
    """Every status a CONTRIBUTE_REPLY may carry (a `str`: it goes on the wire as text;
    `decode_reply` turns the text back into one of these, or refuses the frame)."""

    MERGED = "merged"
    """The delta entered this round's merge; the update is attached."""
    LATE = "late"
    """The round had closed; its update is attached, resend to the next round."""
    NO_QUORUM = "no_quorum"
    """The window expired before quorum: no outer step was taken."""
    REJECTED = "rejected"
    """The delta was refused (reason attached); the peer keeps running."""
    BEHIND = "behind"
    """The synchronizer is behind the learner's round; try the next candidate."""
    MOVED = "moved"
    """A better-placed synchronizer is live (named in moved_to): resend there."""
    MISSING = "missing"
    """(get_update) This peer does not keep that update."""
    HELD = "held"
    """(hold_update) The update is kept here, to serve once its round is committed."""


class NoAnswer(StrEnum):
    """A contribution's outcome when no synchronizer answered it: it may still be merged
    (`protocol.deltas.AMBIGUOUS`)."""

    UNREACHABLE = "unreachable"
    """No candidate synchronizer took the call (each timed out, refused, or was away)."""
    FAILED = "failed"
    """Sending it raised here."""

MAX_CONTRIBUTORS = 1 << 16
"""Most contributors one update or reply may list."""

register_kind(
    MessageKind(
        CONTRIBUTE_REPLY,
        required={"peer": "str", "status": "str"},
        optional={
            "reason": "str",
            "weight": "float",
            "hash": "str",
            "contributors": "list",
            "moved_to": "str",
            "digest": "str",
            "record": "bytes",
        },
        bounds={"weight": (0.0, math.inf)},
    )
)
register_kind(
    MessageKind(
        UPDATE_REQUEST,
        required={"peer": "str"},
        optional={"digest": "str"},
        carries_tensors=False,
    )
)
register_kind(
    MessageKind(
        STATE_REPLY,
        required={"peer": "str", "hash": "str"},
        optional={"part": "uint", "parts": "uint"},
        bounds={"part": (0, wire.MAX_COUNT), "parts": (1, wire.MAX_COUNT)},
    )
)


def reply(
    run: str,
    round_id: int,
    fragment: int,
    peer: str,
    status: Reply,
    tensors: dict | None = None,
    **meta: Any,
) -> bytes:
    """Encode a CONTRIBUTE_REPLY frame."""
    message = wire.Message(
        kind=CONTRIBUTE_REPLY,
        run=run,
        # a request that did not decode has no round or fragment: answer for 0
        round=max(round_id, 0),
        fragment=max(fragment, 0),
        meta={"peer": peer, "status": status, **{k: v for k, v in meta.items() if v is not None}},
        tensors=tensors or {},
    )
    return wire.encode_message(message)


def parse_contributors(value: Any) -> tuple[tuple[str, float, int], ...] | wire.Rejected:
    """`[[peer, weight, tokens], ...]` from a message's meta, types checked and not coerced."""
    if not isinstance(value, list | tuple) or len(value) > MAX_CONTRIBUTORS:
        return wire.Rejected(f"contributors must be a list of at most {MAX_CONTRIBUTORS}")
    out = []
    for entry in value:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            return wire.Rejected("a contributor must be [peer, weight, tokens]")
        peer, weight, tokens = entry
        if not isinstance(peer, str) or not 0 < len(peer) <= wire.MAX_NAME_CHARS:
            return wire.Rejected("a contributor's peer must be a non-empty string")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0.0 <= weight < math.inf  # NaN fails this too
        ):
            return wire.Rejected("a contributor's weight must be a finite number >= 0")
        if (
            isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or not 0 <= tokens <= wire.MAX_COUNT
        ):
            return wire.Rejected(f"a contributor's tokens must be an int in [0, {wire.MAX_COUNT}]")
        out.append((peer, float(weight), tokens))
    return tuple(out)


def decode_reply(
    raw: Any, limits: wire.WireLimits, run: str | None = None
) -> wire.Message | wire.Rejected:
    """A CONTRIBUTE_REPLY frame (of `run`, when given) with a known status; never raises."""
    msg = wire.decode_message(raw, limits)
    if isinstance(msg, wire.Rejected):
        return msg
    if msg.kind != CONTRIBUTE_REPLY:
        return wire.Rejected(f"expected a {CONTRIBUTE_REPLY}, got {msg.kind}")
    if run is not None and msg.run != run:
        return wire.Rejected(f"reply of another run {msg.run[:60]!r}")
    try:
        msg.meta["status"] = Reply(msg.meta["status"])
    except ValueError:
        return wire.Rejected(f"unknown reply status {msg.meta['status'][:40]!r}")
    moved_to = msg.meta.get("moved_to")
    if moved_to is not None and not 0 < len(moved_to) <= wire.MAX_NAME_CHARS:
        return wire.Rejected("moved_to must name a peer")
    if "contributors" in msg.meta:
        contributors = parse_contributors(msg.meta["contributors"])
        if isinstance(contributors, wire.Rejected):
            return contributors
    return msg


@dataclass(frozen=True)
class Outcome:
    """What became of one contribution."""

    status: Reply | NoAnswer
    round: int
    fragment: int
    synchronizer: str = ""
    weight: float = 0.0
    reason: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    latency_s: float = 0.0
    """From handing the delta to the network to holding the round's result, seconds."""
