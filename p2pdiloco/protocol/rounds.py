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

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pdiloco.identity import Identity, SignedKind, is_peer_id
from p2pdiloco.protocol.election import rendezvous_score

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
    """(peer id, merge weight, tokens) of every merged delta, in merge order."""
    contributions: tuple[str, ...] = ()
    """Digest of each contributor's signed contribution (aligned with `contributors`):
    what an auditor fetches to recompute the merge."""
    norms: tuple[float, ...] = ()
    """Norm of each contributor's delta as merged (after clipping): the next rounds' history."""
    refused: tuple[str, ...] = ()
    """Digests of the window's contributions the screening refused (an audit redoes it)."""
    history_from: int = -1
    """First round of the chain whose norms and tokens the screening used (-1: none)."""
    grace_s: float = 0.0
    closed_at: float = 0.0
    """DHT time the round was committed."""
    certificates: tuple[bytes, ...] = ()
    """The synchronizer's operator certificates (a certified run admits no record without)."""
    sealed: bytes = field(default=b"", compare=False, repr=False)
    """The signed bytes this record was read from or sealed into (what is stored and sent)."""

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
                "contributions": list(self.contributions),
                "norms": list(self.norms),
                "refused": list(self.refused),
                "history_from": self.history_from,
                "grace_s": self.grace_s,
                "closed_at": self.closed_at,
                "certificates": list(self.certificates),
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


def _round_or_none(value: Any) -> int:
    """A round number, or -1 for none."""
    if value == -1 and isinstance(value, int) and not isinstance(value, bool):
        return -1
    return _count(value)


def _str(value: Any, limit: int = 256) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError("not a short string")
    return value


def _blob(value: Any, limit: int = 1024) -> bytes:
    if not isinstance(value, bytes) or len(value) > limit:
        raise ValueError("not a short byte string")
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
            contributions=tuple(_str(d, 64) for d in _peers(data.get("contributions", []))),
            norms=tuple(_number(n) for n in _peers(data.get("norms", []))),
            refused=tuple(_str(d, 64) for d in _peers(data.get("refused", []))),
            history_from=_round_or_none(data.get("history_from", -1)),
            grace_s=_number(data["grace_s"]),
            closed_at=_number(data["closed_at"]),
            certificates=tuple(_blob(c) for c in _peers(data.get("certificates", []))[:4]),
        )
    except Exception:  # noqa: BLE001 - untrusted bytes
        return None


ROUND_RECORDS = SignedKind("round", MAX_RECORD_BYTES + 128)
"""Round records, signed by their synchronizer (128 bytes: the seal's envelope)."""


def seal_record(identity: Identity, run: str, record: RoundRecord) -> bytes:
    """The record as stored and sent: signed by its synchronizer (who must be `identity`)."""
    return ROUND_RECORDS.seal(identity, run, record.encode(), signer=record.synchronizer)


def signed_record(identity: Identity, run: str, record: RoundRecord) -> RoundRecord:
    """`record` carrying its own signed bytes (`record.sealed`)."""
    return dataclasses.replace(record, sealed=seal_record(identity, run, record))


def open_record(run: str, sealed: object) -> RoundRecord | None:
    """The record in `sealed` if its synchronizer signed it for `run`, else None (never raises)."""
    payload = ROUND_RECORDS.peek(sealed)
    record = decode_round_record(payload) if isinstance(payload, bytes) else None
    if record is None or not is_peer_id(record.synchronizer):
        return None
    if isinstance(ROUND_RECORDS.open(record.synchronizer, run, sealed), str):
        return None
    return dataclasses.replace(record, sealed=bytes(sealed))


def records_of(
    run: str,
    raw_records: Mapping[str, tuple[bytes, float]],
    fragment: int,
    entitled: Callable[[RoundRecord], bool] | None = None,
) -> dict[tuple[int, str], RoundRecord]:
    """Signed, well-formed records of `fragment` under their own subkey, by (round, synchronizer).

    With `entitled`, records of synchronizers the run does not entitle are dropped too.
    """
    out: dict[tuple[int, str], RoundRecord] = {}
    for subkey, (raw, _expiration) in raw_records.items():
        record = open_record(run, raw)
        if (
            record is not None
            and (entitled is None or entitled(record))
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


