"""The swarm's messages and records on top of `wire`: RPC names, reply kinds, round records.

RPCs (each request and reply is one `wire` frame, moved in bounded chunks):

    contribute   learner -> synchronizer  CONTRIBUTION        -> CONTRIBUTE_REPLY (+ update)
    hold_update  synchronizer -> peer     OUTER_UPDATE        -> CONTRIBUTE_REPLY(held)
    get_update   peer -> peer             UPDATE_REQUEST      -> OUTER_UPDATE or CONTRIBUTE_REPLY(missing)
    get_state    joiner -> peer           STATE_REQUEST       -> STATE_REPLY (one fragment)

DHT records: heartbeats (see `membership`) and round records (see `rounds`).
"""

from __future__ import annotations

from typing import Any

from p2pdiloco import wire
from p2pdiloco.wire import MessageKind, register_kind

RPC_CONTRIBUTE = "contribute"
RPC_GET_UPDATE = "get_update"
RPC_GET_STATE = "get_state"
RPC_HOLD_UPDATE = "hold_update"

CONTRIBUTE_REPLY = "contribute_reply"
"""synchronizer -> learner: status of a contribution, with the round's update if closed."""
UPDATE_REQUEST = "update_request"
"""peer -> peer: send the encoded update of (round, fragment) if you keep it."""
STATE_REPLY = "state_reply"
"""peer -> joiner: parameters (`p/<name>`) and momentum (`m/<name>`) of one fragment."""

# Reply statuses.
MERGED = "merged"  # the delta entered this round's merge; the update is attached
LATE = "late"  # the round had closed; its update is attached, resend to the next round
NO_QUORUM = "no_quorum"  # the window expired before quorum: no outer step was taken
REJECTED = "rejected"  # the delta was refused (reason attached); the peer keeps running
BEHIND = "behind"  # the synchronizer is behind the learner's round; try the next candidate
MOVED = "moved"  # a better-placed synchronizer is live (named in moved_to): resend there
MISSING = "missing"  # (get_update) this peer does not keep that update
HELD = "held"  # (hold_update) the update is kept here, to serve once its round is committed

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
register_kind(MessageKind(STATE_REPLY, required={"peer": "str", "hash": "str"}))


def reply(
    run: str,
    round_id: int,
    fragment: int,
    peer: str,
    status: str,
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
