"""A fragment's state on the wire, in parts that fit the wire limits (pure, no network).

A joiner downloads each fragment's parameters (`p/<name>`), outer momentum (`m/<name>`)
and delayed-Nesterov sums (`a/<name>`) from a donor. A fragment of a large model holds
more than one frame may carry (a `150m` fragment with momentum is ~300M elements against
the 2^28 of `wire.WireLimits`), so the state goes in parts: whole tensors, in a fixed
order, each part within half of every limit (room for the header and for fp32 and its
envelope). Each part names the fragment's round and hash; the joiner takes every part
from one donor, refuses a mix of two states, and checks the whole by hash at the end
(`GlobalState.import_verified`), so a donor can make a download fail but never land.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from p2pdiloco import compress, wire
from p2pdiloco.outer.fragment_state import FragmentState
from p2pdiloco.wire import messages

MAX_STATE_PARTS = 4096
"""Most parts a joiner accepts for one fragment (a bound on what a donor can claim)."""
KINDS = ("p", "m", "a")
"""Key prefixes: parameters, momentum, delayed-Nesterov sums."""


MAX_PART_ELEMENTS = 1 << 24
"""At most 16M elements (64 MiB of fp32) a part, whatever the wire limits allow: a donor
builds each part's frame in memory (payloads, then the frame: ~2x the part) while it keeps
training, and half of the default limits (512 MiB a part) cost a `150m` donor gigabytes
at once. The largest tensor of `1b` (11.5M elements) still fits one part."""


def part_budget(limits: wire.WireLimits) -> int:
    """Elements one part may hold: half of every limit, at 4 bytes an element (fp32), and
    at most `MAX_PART_ELEMENTS`."""
    half = min(limits.max_total_elements, limits.max_frame_bytes // 4) // 2
    return max(1, min(half, MAX_PART_ELEMENTS))


def state_keys(snapshot: FragmentState) -> dict[str, torch.Tensor]:
    """Every tensor of `snapshot` under its wire key, in a fixed order."""
    keyed = {f"p/{n}": t for n, t in sorted(snapshot.params.items())}
    keyed.update({f"m/{n}": t for n, t in sorted(snapshot.momentum.items())})
    keyed.update({f"a/{n}": t for n, t in sorted(snapshot.accumulated.items())})
    return keyed


def split_parts(sizes: Mapping[str, int], budget: int) -> list[list[str]]:
    """Keys grouped, in order, into parts of at most `budget` elements (a tensor larger
    than the budget goes alone: the config check keeps tensors under the limits)."""
    parts: list[list[str]] = [[]]
    held = 0
    for key, size in sizes.items():
        if parts[-1] and held + size > budget:
            parts.append([])
            held = 0
        parts[-1].append(key)
        held += size
    return parts


def part_count(snapshot: FragmentState, limits: wire.WireLimits) -> int:
    """How many parts `snapshot` is served in."""
    return len(split_parts({k: t.numel() for k, t in state_keys(snapshot).items()}, part_budget(limits)))


def encode_part(run: str, peer: str, snapshot: FragmentState, part: int, limits: wire.WireLimits) -> bytes | None:
    """Frame of part `part` of `snapshot` (fp32), or None when there is no such part."""
    keyed = state_keys(snapshot)
    parts = split_parts({k: t.numel() for k, t in keyed.items()}, part_budget(limits))
    if not 0 <= part < len(parts):
        return None
    fp32 = compress.make_codec("fp32")
    return wire.encode_message(
        wire.Message(
            kind=messages.STATE_REPLY,
            run=run,
            round=snapshot.round,
            fragment=snapshot.fragment,
            meta={"peer": peer, "hash": snapshot.hash, "part": part, "parts": len(parts)},
            tensors={k: fp32.encode(keyed[k]) for k in parts[part]},
        )
    )


@dataclass(frozen=True)
class StatePart:
    """One decoded part of a donor's reply."""

    round: int
    hash: str
    part: int
    parts: int
    tensors: dict[str, torch.Tensor]


def decode_part(
    raw: bytes, run: str, fragment: int, shapes: Mapping[str, tuple[int, ...]], limits: wire.WireLimits
) -> StatePart | str:
    """A donor's reply as a StatePart of `fragment`, or why it is not one (never raises).

    `shapes` is the fragment's layout by parameter name: every key must name a known
    tensor with its shape, checked before anything is decoded.
    """
    msg = wire.decode_message(raw, limits)
    if isinstance(msg, wire.Rejected):
        return msg.reason
    if msg.kind != messages.STATE_REPLY or msg.fragment != fragment or msg.run != run:
        return f"not a state reply for fragment {fragment}"
    if msg.round < 1:
        return "state of round 0 (the genesis needs no download)"
    part, parts = msg.meta.get("part", 0), msg.meta.get("parts", 1)
    if not (isinstance(part, int) and isinstance(parts, int) and 0 <= part < parts <= MAX_STATE_PARTS):
        return "part numbers out of range"
    layout = {}
    for key in msg.tensors:
        kind, _, name = str(key).partition("/")
        if kind not in KINDS or name not in shapes:
            return f"unknown tensor {str(key)[:60]!r}"
        layout[key] = shapes[name]
    try:
        tensors = compress.decode_tensors(msg.tensors, shapes=layout)
    except ValueError as exc:
        return str(exc)
    return StatePart(msg.round, str(msg.meta["hash"]), part, parts, tensors)


class PartsAssembler:
    """Collects the parts of one donor's state; refuses a mix of two states."""

    def __init__(self, fragment: int, names: list[str]) -> None:
        self.fragment = fragment
        self.names = names
        self.first: StatePart | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.next_part = 0

    def add(self, piece: StatePart) -> str:
        """Take the next part; the reason it is refused, else ""."""
        if piece.part != self.next_part:
            return f"part {piece.part} where {self.next_part} was asked for"
        if self.first is None:
            self.first = piece
        elif (piece.round, piece.hash, piece.parts) != (self.first.round, self.first.hash, self.first.parts):
            return "the donor's state changed during the download"
        if self.tensors.keys() & piece.tensors.keys():
            return "a tensor sent twice"
        self.tensors.update(piece.tensors)
        self.next_part += 1
        return ""

    @property
    def complete(self) -> bool:
        return self.first is not None and self.next_part == self.first.parts

    def state(self) -> FragmentState | str:
        """The whole fragment state once complete (every parameter and momentum tensor;
        the sums those that were sent; `import_verified` checks the rest), or why not."""
        if not self.complete:
            return "download incomplete"
        split: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
        for key, tensor in self.tensors.items():
            kind, _, name = key.partition("/")
            split[kind][name] = tensor
        wanted = set(self.names)
        if set(split["p"]) != wanted or set(split["m"]) != wanted:
            return "parameters or momentum missing"
        return FragmentState(
            fragment=self.fragment,
            round=self.first.round,
            params=split["p"],
            momentum=split["m"],
            hash=self.first.hash,
            accumulated=split["a"],
        )
