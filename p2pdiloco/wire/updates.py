"""Outer updates as one representation: a signed-off wire frame, stored and served as is.

A synchronizer encodes the merged outer gradient of (round, fragment) once, into an
OUTER_UPDATE frame whose meta names the parent hash, the resulting hash and the
contributors. The frame's digest identifies it everywhere: round records name it,
holders keep it, `get_update` serves it byte for byte, and every replica decodes the
same bytes, so every replica applies the same bits.

`parse_update` never raises: any input is an `Update` or a `wire.Rejected(reason)`, and
tensor names and shapes are checked against the fragment layout before anything is
decoded; `Update.decode` refuses NaN/Inf.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from p2pdiloco import compress, wire
from p2pdiloco.wire import messages

MAX_KEPT_PER_FRAGMENT = 48
"""Update frames kept per fragment (committed and held), oldest dropped first."""
MAX_KEPT_BYTES_PER_FRAGMENT = 512 << 20
"""...and at most this many bytes of them per fragment (a `150m` update with P = 2 is
~150 MB held: frame and parsed payloads), keeping at least `MIN_KEPT_PER_FRAGMENT`. A
replica behind by more than what peers keep downloads the state instead (replica_sync)."""
MIN_KEPT_PER_FRAGMENT = 2


def update_digest(frame: bytes) -> str:
    """Hex digest of an update frame's bytes."""
    return hashlib.blake2b(frame, digest_size=16).hexdigest()


@dataclass(frozen=True)
class Update:
    """A validated update frame and what its meta says."""

    frame: bytes
    digest: str
    round: int
    fragment: int
    synchronizer: str
    parent: str
    hash: str
    contributors: tuple[tuple[str, float, int], ...]
    tensors: dict[str, compress.EncodedTensor]

    @property
    def nbytes(self) -> int:
        """Bytes this update holds: its frame and the parsed payloads."""
        return len(self.frame) + sum(t.nbytes for t in self.tensors.values())

    def decode(self) -> dict[str, torch.Tensor]:
        """The outer gradient (heavy: call off the event loop). ValueError if bad or not finite."""
        shapes = {name: tuple(encoded.shape) for name, encoded in self.tensors.items()}
        return compress.decode_tensors(self.tensors, shapes=shapes, finite=True)


def new_update(
    run: str,
    round_id: int,
    fragment: int,
    synchronizer: str,
    parent: str,
    new_hash: str,
    contributors: list[tuple[str, float, int]],
    tensors: dict[str, compress.EncodedTensor],
    grace_s: float = 0.0,
) -> Update:
    """The `Update` a synchronizer commits, built from what it holds: the one frame that
    represents (round, fragment)'s outer update, encoded once and never parsed back (it
    is what `parse_update` of that frame returns)."""
    frame = wire.encode_message(
        wire.Message(
            kind=wire.OUTER_UPDATE,
            run=run,
            round=round_id,
            fragment=fragment,
            meta={
                "peer": synchronizer,
                "parent": parent,
                "hash": new_hash,
                "contributors": [list(c) for c in contributors],
                "tokens": sum(int(t) for _, _, t in contributors),
                "grace_s": float(grace_s),
            },
            tensors=tensors,
        )
    )
    return Update(
        frame=frame,
        digest=update_digest(frame),
        round=round_id,
        fragment=fragment,
        synchronizer=synchronizer,
        parent=parent,
        hash=new_hash,
        contributors=tuple((str(p), float(w), int(t)) for p, w, t in contributors),
        tensors=dict(tensors),
    )


def parse_update(
    frame: bytes,
    limits: wire.WireLimits,
    run: str,
    shapes: list[dict[str, tuple[int, ...]]],
) -> Update | wire.Rejected:
    """Validate an update frame against the run and the fragment layout (`shapes[f]`).

    Never raises: any input is an `Update` or the reason it is refused. Sizes are
    checked against the layout here, before any tensor is decoded (`Update.decode`).
    """
    msg = wire.decode_message(frame, limits)
    if isinstance(msg, wire.Rejected):
        return msg
    if msg.kind != wire.OUTER_UPDATE or msg.run != run:
        return wire.Rejected(f"expected an outer update of run {run!r}, got {msg.kind}")
    if not 0 <= msg.fragment < len(shapes):
        return wire.Rejected(f"no fragment {msg.fragment}")
    layout = shapes[msg.fragment]
    if set(msg.tensors) != set(layout):
        return wire.Rejected(f"update tensors do not match fragment {msg.fragment}")
    for name, encoded in msg.tensors.items():
        if tuple(encoded.shape) != tuple(layout[name]):
            return wire.Rejected(f"update tensor {name} has shape {tuple(encoded.shape)[:8]}")
    meta = msg.meta
    parent, new_hash = meta.get("parent"), meta.get("hash")
    if not isinstance(parent, str) or not isinstance(new_hash, str) or not new_hash:
        return wire.Rejected("update lacks its parent or result hash")
    contributors = messages.parse_contributors(meta.get("contributors", []))
    if isinstance(contributors, wire.Rejected):
        return wire.Rejected(f"update has malformed contributors: {contributors.reason}")
    frame = bytes(frame)
    return Update(
        frame=frame,
        digest=update_digest(frame),
        round=msg.round,
        fragment=msg.fragment,
        synchronizer=meta["peer"],
        parent=parent,
        hash=new_hash,
        contributors=contributors,
        tensors=msg.tensors,
    )


class UpdateStore:
    """Update frames this peer holds (committed or not yet), by digest, bounded per fragment."""

    def __init__(
        self,
        max_per_fragment: int = MAX_KEPT_PER_FRAGMENT,
        max_bytes_per_fragment: int = MAX_KEPT_BYTES_PER_FRAGMENT,
    ) -> None:
        self.max_per_fragment = max_per_fragment
        self.max_bytes_per_fragment = max_bytes_per_fragment
        self._frames: dict[int, OrderedDict[str, Update]] = {}

    def put(self, update: Update) -> None:
        kept = self._frames.setdefault(update.fragment, OrderedDict())
        kept[update.digest] = update
        kept.move_to_end(update.digest)
        while len(kept) > self.max_per_fragment or (
            len(kept) > MIN_KEPT_PER_FRAGMENT
            and sum(u.nbytes for u in kept.values()) > self.max_bytes_per_fragment
        ):
            kept.popitem(last=False)

    def get(self, fragment: int, digest: str) -> Update | None:
        return self._frames.get(fragment, {}).get(digest)

    def of_round(self, fragment: int, round_id: int) -> list[Update]:
        return [u for u in self._frames.get(fragment, {}).values() if u.round == round_id]
