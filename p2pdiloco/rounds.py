"""Round records and the rule that picks one update per (round, fragment): pure functions.

A synchronizer *commits* round r of fragment f by storing a `RoundRecord` in the DHT
under `p2pdiloco/<run>/rounds/<f>`, subkey `<r>/<synchronizer>`. It does so only after
its update is held by other peers (the record names them), so a committed round can be
fetched by anyone while one holder lives. Each record names its parent (the fragment's
hash before the update) and its result (the hash after), so records form chains.

Races (split views, a failover while the first synchronizer is still merging) can leave
two records for one round. Every peer resolves them with the same rule,
`canonical_chain`: starting from the fragment's initial hash, round by round, the record
whose parent is the chosen hash of the round before and whose synchronizer ranks highest
in the rendezvous order of that round wins. Replicas that applied a losing update repair
to the winning chain; contributions merged only in a loser are sent again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pdiloco.election import rendezvous_score

MAX_RECORD_BYTES = 1 << 16
"""A round record larger than this is not one (bytes)."""
MAX_LISTED_PEERS = 1024
"""Contributors or holders one record may name."""


def rounds_key(run: str, fragment: int) -> str:
    """DHT key of a fragment's round records."""
    return f"p2pdiloco/{run}/rounds/{fragment}"


def record_subkey(round_id: int, synchronizer: str) -> str:
    """Subkey of one synchronizer's record of a round: two racing records never overwrite."""
    return f"{round_id}/{synchronizer}"


@dataclass(frozen=True)
class RoundRecord:
    """What a synchronizer publishes when it commits (round, fragment)."""

    round: int
    fragment: int
    synchronizer: str
    hash: str
    """Hash of the fragment's parameters and optimizer state after this round's update."""
    parent: str = ""
    """Hash of the fragment before the update (the chain link)."""
    digest: str = ""
    """Digest of the update frame's bytes: what holders serve, byte for byte."""
    holders: tuple[str, ...] = ()
    """Peers besides the synchronizer that held the update before this record was written."""
    contributors: tuple[tuple[str, float, int], ...] = ()
    """(peer id, merge weight, tokens) of every merged delta."""
    grace_s: float = 0.0
    closed_at: float = 0.0
    """DHT time the round was committed."""

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "round": self.round,
                "fragment": self.fragment,
                "synchronizer": self.synchronizer,
                "hash": self.hash,
                "parent": self.parent,
                "digest": self.digest,
                "holders": list(self.holders),
                "contributors": [list(c) for c in self.contributors],
                "grace_s": self.grace_s,
                "closed_at": self.closed_at,
            },
            use_bin_type=True,
        )

    def weight_of(self, peer: str) -> float | None:
        """The merge weight of `peer`'s delta in this round, or None if it was not merged."""
        for contributor, weight, _tokens in self.contributors:
            if contributor == peer:
                return weight
        return None


def _number(value: Any) -> float:
    """A finite int or float (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError("not a finite number")
    return float(value)


def _count(value: Any) -> int:
    """A non-negative int (not a bool, not a float, not a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("not a count")
    return value


def _str(value: Any, limit: int = 256) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError("not a short string")
    return value


def _peers(value: Any) -> list:
    """A list of at most MAX_LISTED_PEERS entries (longer: not a record, never truncated)."""
    if not isinstance(value, list | tuple) or len(value) > MAX_LISTED_PEERS:
        raise ValueError("not a peer list")
    return list(value)


def decode_round_record(raw: bytes) -> RoundRecord | None:
    """A round record, or None when the bytes are not exactly one (untrusted: never raises).

    Types are checked, not coerced: a string where a number belongs is not a record.
    """
    try:
        if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_RECORD_BYTES:
            return None
        data: Any = msgpack.unpackb(
            raw, raw=False, max_bin_len=1 << 16, max_str_len=1 << 16, max_array_len=1 << 16
        )
        if not isinstance(data, dict):
            return None
        contributors = []
        for entry in _peers(data["contributors"]):
            peer, weight, tokens = _peers(entry)
            contributors.append((_str(peer), _number(weight), _count(tokens)))
        return RoundRecord(
            round=_count(data["round"]),
            fragment=_count(data["fragment"]),
            synchronizer=_str(data["synchronizer"]),
            hash=_str(data["hash"]),
            parent=_str(data.get("parent", "")),
            digest=_str(data.get("digest", "")),
            holders=tuple(_str(p) for p in _peers(data.get("holders", []))),
            contributors=tuple(contributors),
            grace_s=_number(data["grace_s"]),
            closed_at=_number(data["closed_at"]),
        )
    except Exception:  # noqa: BLE001 - untrusted bytes
        return None


def records_of(
    raw_records: Mapping[str, tuple[bytes, float]], fragment: int
) -> dict[tuple[int, str], RoundRecord]:
    """Well-formed records of `fragment` stored under their own subkey, by (round, synchronizer)."""
    out: dict[tuple[int, str], RoundRecord] = {}
    for subkey, (raw, _expiration) in raw_records.items():
        record = decode_round_record(raw)
        if (
            record is not None
            and record.fragment == fragment
            and subkey == record_subkey(record.round, record.synchronizer)
        ):
            out[(record.round, record.synchronizer)] = record
    return out


def rank(run: str, record: RoundRecord) -> tuple[int, str]:
    """Sort key of a record among its round's rivals: higher rendezvous score wins."""
    return (-rendezvous_score(run, record.round, record.fragment, record.synchronizer), record.synchronizer)


def canonical_chain(
    run: str,
    records: Iterable[RoundRecord],
    genesis_hash: str,
    void: frozenset[str] = frozenset(),
) -> dict[int, RoundRecord]:
    """The one record per round every peer follows, from round 0 as far as the chain goes.

    Round r's record is the best-ranked among those whose parent is the chosen hash
    after round r-1 (the genesis hash for r = 0). Records whose digest is in `void` (their
    update could not be fetched from anyone) are skipped. Where early records have
    expired from the DHT, the chain starts at the lowest round present, from its
    best-ranked record.
    """
    by_round: dict[int, list[RoundRecord]] = {}
    for record in records:
        if record.digest not in void:
            by_round.setdefault(record.round, []).append(record)
    chain: dict[int, RoundRecord] = {}
    if not by_round:
        return chain
    round_id = 0 if 0 in by_round else min(by_round)
    parent = genesis_hash if round_id == 0 else None
    while round_id in by_round:
        rivals = [r for r in by_round[round_id] if parent is None or r.parent == parent]
        if not rivals:
            break
        best = min(rivals, key=lambda r: rank(run, r))
        chain[round_id] = best
        parent, round_id = best.hash, round_id + 1
    return chain


def beats(run: str, challenger: RoundRecord, holder: RoundRecord) -> bool:
    """True when `challenger` wins over `holder` for the same (round, fragment, parent)."""
    return rank(run, challenger) < rank(run, holder)


@dataclass
class ChainView:
    """One peer's reading of a fragment's records: the canonical chain and its head round."""

    chain: dict[int, RoundRecord] = field(default_factory=dict)

    @property
    def next_round(self) -> int:
        """The first round the chain has not committed yet."""
        return max(self.chain) + 1 if self.chain else 0
