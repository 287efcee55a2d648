"""The swarm's messages and records on top of `wire`: RPC names, reply kinds, round records.

RPCs (each request and reply is one `wire` frame, moved in bounded chunks):

    contribute   learner -> synchronizer  CONTRIBUTION        -> CONTRIBUTE_REPLY (+ update)
    get_update   peer -> peer             UPDATE_REQUEST      -> OUTER_UPDATE or CONTRIBUTE_REPLY(missing)
    get_state    joiner -> peer           STATE_REQUEST       -> STATE_REPLY (one fragment)

DHT records: heartbeats (see `membership`) and one round record per (fragment, round)
under `p2pdiloco/<run>/rounds/<fragment>`, subkey = round, naming the synchronizer, the
contributors with their weights, the grace waited and the fragment's hash afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pdiloco import wire
from p2pdiloco.wire import MessageKind, register_kind

RPC_CONTRIBUTE = "contribute"
RPC_GET_UPDATE = "get_update"
RPC_GET_STATE = "get_state"

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
        },
    )
)
register_kind(MessageKind(UPDATE_REQUEST, required={"peer": "str"}, carries_tensors=False))
register_kind(MessageKind(STATE_REPLY, required={"peer": "str", "hash": "str"}))


def rounds_key(run: str, fragment: int) -> str:
    """DHT key of a fragment's round records."""
    return f"p2pdiloco/{run}/rounds/{fragment}"


@dataclass(frozen=True)
class RoundRecord:
    """What a synchronizer publishes when it closes (round, fragment)."""

    round: int
    fragment: int
    synchronizer: str
    hash: str
    """Hash of the fragment's parameters and momentum after this round's update."""
    contributors: list[tuple[str, float, int]] = field(default_factory=list)
    """(peer id, merge weight, tokens) of every merged delta."""
    grace_s: float = 0.0
    closed_at: float = 0.0
    """DHT time the window closed."""

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "round": self.round,
                "fragment": self.fragment,
                "synchronizer": self.synchronizer,
                "hash": self.hash,
                "contributors": [list(c) for c in self.contributors],
                "grace_s": self.grace_s,
                "closed_at": self.closed_at,
            },
            use_bin_type=True,
        )


def decode_round_record(raw: bytes) -> RoundRecord | None:
    """A round record, or None when the bytes are not one."""
    try:
        data: Any = msgpack.unpackb(
            raw, raw=False, max_bin_len=1 << 16, max_str_len=1 << 16, max_array_len=1 << 16
        )
        contributors = [(str(p), float(w), int(t)) for p, w, t in data["contributors"]]
        return RoundRecord(
            round=int(data["round"]),
            fragment=int(data["fragment"]),
            synchronizer=str(data["synchronizer"]),
            hash=str(data["hash"]),
            contributors=contributors,
            grace_s=float(data["grace_s"]),
            closed_at=float(data["closed_at"]),
        )
    except Exception:  # noqa: BLE001 - untrusted bytes
        return None


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
        round=round_id,
        fragment=fragment,
        meta={"peer": peer, "status": status, **{k: v for k, v in meta.items() if v is not None}},
        tensors=tensors or {},
    )
    return wire.encode_message(message)
