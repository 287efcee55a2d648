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

Two decisions that would fork the swarm if peers took them from local timing are taken
from signed data instead:

- *Supersession* (no local void): when nobody can serve a committed update, the round is
  re-run by a synchronizer whose record names the digest it supersedes (`supersedes`,
  signed). Every peer skips the superseded record alike, but only when the re-run was
  closed at least `supersede_after_s` after it (both times are the records' own signed
  `closed_at`) and no record built on it was closed before the re-run: a committed round
  that anyone built on can never be superseded, so history cannot be rewritten this way.
- *Chain start* (no rewind): once early records expired, the chain starts where it
  reaches the highest head (ties: the lowest start), also from the hash this replica
  itself reached (`anchor`), so one stray record below the real start truncates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zstandard

from p2pdiloco.identity import SIGNATURE_BYTES, Identity, SignedKind, is_peer_id, verify
from p2pdiloco.protocol.election import rendezvous_score
from p2pdiloco.protocol.membership import two_numbers

MAX_RECORD_BYTES = 1 << 16
"""A round record larger than this is not one (bytes)."""
RECORD_ZSTD_LEVEL = 3
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""The first bytes of a zstd frame (a msgpack map never starts with them)."""
MAX_LISTED_PEERS = 1024
"""Contributors or holders one record may name."""
SUPERSEDE_AFTER_S = 60.0
"""Signed time between a record and the re-run that supersedes it, seconds (a run passes
its `sync.round_deadline_s`, the same on every peer of the run)."""


def rounds_key(run: str, fragment: int, round_id: int = 0, epoch_rounds: int = 0) -> str:
    """DHT key of a fragment's round records: one key (`epoch_rounds` 0), or, in a run that
    splits its records into epochs of `epoch_rounds` rounds (`network.record_epoch_rounds`),
    the key of the epoch holding `round_id`: a read then brings an epoch's records, not the
    hour's (docs/scale.md)."""
    base = f"p2pdiloco/{run}/rounds/{fragment}"
    if epoch_rounds <= 0:
        return base
    return f"{base}/{epoch_rounds}/{round_id // epoch_rounds}"


MAX_EPOCH_ROUNDS = 4096


def epoch_of_key(run: str, fragment: int, key: str) -> tuple[int, int] | None:
    """(epoch_rounds, epoch) of an epoch key of `fragment`'s records, or None."""
    prefix = rounds_key(run, fragment) + "/"
    if not key.startswith(prefix):
        return None
    pair = two_numbers(key[len(prefix):], 9)
    if pair is None:
        return None
    epoch_rounds, epoch = pair
    return (epoch_rounds, epoch) if 1 <= epoch_rounds <= MAX_EPOCH_ROUNDS else None


ROUND_RECORD_TTL_S = 3600.0
"""How long a round record is kept (in the DHT, and by a replica that read it), seconds."""


def record_subkey(round_id: int, synchronizer: str) -> str:
    """Subkey of one synchronizer's record of a round: two racing records never overwrite."""
    return f"{round_id}/{synchronizer}"


def subkey_round(subkey: str) -> int | None:
    """The round a record subkey (`record_subkey`) names, or None if it names none."""
    text = subkey.split("/", 1)[0]
    return int(text) if text.isdigit() and len(text) <= 12 else None


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
    receipts: tuple[bytes, ...] = ()
    """The holders' signed receipts (`sign_receipt`), aligned with `holders` (there may be
    fewer): a holder's word that it keeps this round's update, not the synchronizer's word
    for it (`attested_records`)."""
    contributors: tuple[tuple[str, float, int], ...] = ()
    """(peer id, merge weight, tokens) of every merged delta, in merge order."""
    contributions: tuple[str, ...] = ()
    """Digest of each contributor's signed contribution (aligned with `contributors`):
    what an auditor fetches to recompute the merge."""
    norms: tuple[float, ...] = ()
    """Norm of each contributor's delta, capped at the reference its window was screened
    against (`screening.history_norms`: a lone delta cannot lift the next clip): the next
    rounds' history."""
    refused: tuple[str, ...] = ()
    """Digests of the window's contributions the screening refused (an audit redoes it)."""
    history_from: int = -1
    """First round of the chain whose norms and tokens the screening used (-1: none)."""
    grace_s: float = 0.0
    closed_at: float = 0.0
    """DHT time the round was committed."""
    certificates: tuple[bytes, ...] = ()
    """The synchronizer's operator certificates (a certified run admits no record without)."""
    supersedes: str = ""
    """Digest of a record of the same round and parent whose update nobody could serve:
    this record re-runs the round in its place ("" for none; see `superseded_digests`)."""
    sealed: bytes = field(default=b"", compare=False, repr=False)
    """The signed bytes this record was read from or sealed into (what is stored and sent)."""
    resumed_at: float = field(default=0.0, compare=False)
    """DHT time a peer restored this record after its lifetime (0: read as committed):
    the time its envelope signs (`seal_resumed`), by `resumed_by`."""
    resumed_by: str = field(default="", compare=False)
    """The peer that signed the resume envelope ("" when not resumed)."""
    resumed_certificates: tuple[bytes, ...] = field(default=(), compare=False, repr=False)
    """That peer's operator certificates (a certified run admits no resume without)."""

    @functools.cached_property
    def named(self) -> frozenset[str]:
        """The peers this record names: its synchronizer and its contributors (computed
        once: the chain rules ask it of every record on every pass, and at M learners
        a scan of the contributors each time made a pass cost records x M)."""
        return frozenset((self.synchronizer, *(c[0] for c in self.contributors)))

    def encode(self) -> bytes:
        """The record's bytes: its msgpack map, zstd-compressed when that is smaller (a
        record naming its window's contributors, each with a hex digest and a base58 id,
        shrinks by about a quarter; every replica reads every record, at N = 1,000 more
        than once). `decode_round_record` reads both forms."""
        plain = self.packed()
        packed = zstandard.ZstdCompressor(level=RECORD_ZSTD_LEVEL, write_content_size=True).compress(plain)
        return packed if len(packed) < len(plain) else plain

    def packed(self) -> bytes:
        """The msgpack map alone (what `encode` compresses; the decoder reads both)."""
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
                # only when set: records that supersede nothing keep their old bytes
                **({"supersedes": self.supersedes} if self.supersedes else {}),
                **({"receipts": list(self.receipts)} if self.receipts else {}),
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


def _receipts(value: Any, holders: int) -> tuple[bytes, ...]:
    """At most one signature-sized blob per holder (more: not a record)."""
    receipts = _peers(value)
    if len(receipts) > holders or any(not isinstance(r, bytes) or len(r) != SIGNATURE_BYTES for r in receipts):
        raise ValueError("not receipts of the holders")
    return tuple(receipts)


def decode_round_record(raw: bytes) -> RoundRecord | None:
    """A round record, or None when the bytes are not exactly one (untrusted: never raises).

    Types are checked, not coerced: a string where a number belongs is not a record.
    """
    try:
        if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_RECORD_BYTES:
            return None
        if raw[:4] == _ZSTD_MAGIC:
            frame = bytes(raw)
            declared = zstandard.frame_content_size(frame)
            if not 0 <= declared <= MAX_RECORD_BYTES:  # unknown (-1) or too large: not a record
                return None
            raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_RECORD_BYTES)
        data: Any = msgpack.unpackb(
            raw, raw=False, max_bin_len=1 << 16, max_str_len=1 << 16, max_array_len=1 << 16
        )
        if not isinstance(data, dict):
            return None
        holders = tuple(_str(p) for p in _peers(data.get("holders", [])))
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
            holders=holders,
            contributors=tuple(contributors),
            contributions=tuple(_str(d, 64) for d in _peers(data.get("contributions", []))),
            norms=tuple(_number(n) for n in _peers(data.get("norms", []))),
            refused=tuple(_str(d, 64) for d in _peers(data.get("refused", []))),
            history_from=_round_or_none(data.get("history_from", -1)),
            grace_s=_number(data["grace_s"]),
            closed_at=_number(data["closed_at"]),
            certificates=tuple(_blob(c) for c in _peers(data.get("certificates", []))[:4]),
            supersedes=_str(data.get("supersedes", ""), 64),
            receipts=_receipts(data.get("receipts", []), len(holders)),
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


RESUMED_RECORDS = SignedKind("resumed", MAX_RECORD_BYTES + 128 + 8 * 1024)
"""Resume envelopes: a committed record (as its synchronizer sealed it), the time a peer
restored it and that peer's certificates, signed by that peer."""


def open_record(run: str, sealed: object) -> RoundRecord | None:
    """The record in `sealed` if its synchronizer signed it for `run`, or the record a
    resume envelope carries (`open_resumed`), else None (never raises).

    Remembered for the last `OPENED_RECORDS` values (records are immutable, and every
    replica reads the same records on every sync pass, the DHT's validator on every
    answer: a key of 300 records of 5 KiB cost 33 ms to open and 58 ms to validate per
    read, which a flood of valid records turned into most of a round's CPU)."""
    if not isinstance(sealed, bytes | bytearray):
        return None
    return _open_remembered(run, bytes(sealed))


OPENED_RECORDS = 4096
"""Opened records remembered (`open_record`): ~20 MiB at most, at the largest records."""


@functools.lru_cache(maxsize=OPENED_RECORDS)
def _open_remembered(run: str, sealed: bytes) -> RoundRecord | None:
    payload = RESUMED_RECORDS.peek(sealed)  # the larger bound; a record's own is checked on opening
    if not isinstance(payload, bytes):
        return None
    record = decode_round_record(payload)
    if record is None:
        return open_resumed(run, sealed, payload)
    if not is_peer_id(record.synchronizer) or isinstance(ROUND_RECORDS.open(record.synchronizer, run, sealed), str):
        return None
    return dataclasses.replace(record, sealed=sealed)


def seal_resumed(
    identity: Identity, run: str, record: RoundRecord, resumed_at: float, certificates: tuple[bytes, ...] = ()
) -> bytes:
    """`record` (carrying its synchronizer's `sealed` bytes) in a resume envelope signed by
    `identity` at DHT time `resumed_at`: how a peer that restarted after a stop longer than
    `ROUND_RECORD_TTL_S` puts the records its checkpoint stands on back in the DHT, whose
    rules refuse a record closed longer ago than any record lives. The envelope vouches for
    nothing but the time: the record inside is checked as ever (its synchronizer's
    signature, a certificate valid at its own close), and the peer resuming it must be one
    the run entitles now."""
    if not record.sealed:
        raise ValueError("a resumed record carries its synchronizer's signed bytes")
    payload = msgpack.packb(
        {"record": record.sealed, "by": identity.peer_id, "at": float(resumed_at),
         "certificates": list(certificates)},
        use_bin_type=True,
    )  # fmt: skip
    return RESUMED_RECORDS.seal(identity, run, payload)


def open_resumed(run: str, sealed: object, payload: bytes) -> RoundRecord | None:
    """The record a resume envelope carries, with when and by whom it was resumed, or None
    (untrusted: never raises). `payload`: the envelope's payload, not yet verified."""
    try:
        data: Any = msgpack.unpackb(payload, raw=False, max_bin_len=MAX_RECORD_BYTES + 256, max_array_len=8)
        if not isinstance(data, dict) or set(data) != {"record", "by", "at", "certificates"}:
            return None
        by, at, inner = _str(data["by"]), _number(data["at"]), data["record"]
        certificates = tuple(_blob(c) for c in _peers(data["certificates"])[:4])
    except Exception:  # noqa: BLE001 - untrusted bytes
        return None
    if not is_peer_id(by) or not isinstance(inner, bytes) or isinstance(RESUMED_RECORDS.open(by, run, sealed), str):
        return None
    peeked = ROUND_RECORDS.peek(inner)
    record = decode_round_record(peeked) if isinstance(peeked, bytes) else None
    if record is None or not is_peer_id(record.synchronizer):
        return None
    if isinstance(ROUND_RECORDS.open(record.synchronizer, run, inner), str):
        return None
    return dataclasses.replace(
        record, sealed=inner, resumed_at=at, resumed_by=by, resumed_certificates=certificates
    )


def record_time(record: RoundRecord) -> float:
    """The signed time a record was last vouched for: its close, or when a peer resumed it."""
    return max(record.closed_at, record.resumed_at)


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


def rivalry_key(
    run: str,
    record: RoundRecord,
    standing: Mapping[tuple[int, str, str], int],
    attested: frozenset[tuple[int, str, str]] = frozenset(),
) -> tuple:
    """Sort key among a round's rivals with one parent (the lowest wins): a record read as
    committed before one resumed after its lifetime (a live chain outranks a restored
    history: peers that came back from a full stop and went on are not rewound by one
    that came back later with an older branch), then standing, then a record whose update
    an independent peer signed that it holds before one only its signer vouches for
    (`attested_records`), then rank."""
    return (
        record.resumed_at > 0,
        standing.get(standing_key(record), PROVEN),
        standing_key(record) not in attested,
        rank(run, record),
    )


def rank(run: str, record: RoundRecord) -> tuple[int, str]:
    """Sort key of a record among its round's rivals: higher rendezvous score wins."""
    return (-rendezvous_score(run, record.round, record.fragment, record.synchronizer), record.synchronizer)


def superseded_digests(
    records: Iterable[RoundRecord], supersede_after_s: float = SUPERSEDE_AFTER_S
) -> frozenset[str]:
    """Digests of the records a valid re-run supersedes (pure, the same on every peer).

    A record S supersedes T when S names T's digest, both are of the same round and
    parent, S was closed at least `supersede_after_s` after T (signed times), and no
    record built on T (next round, parent T's hash) by an independent synchronizer was
    closed before S: once another peer committed on T, T was served and applied, and
    stays. Independent: not T's own synchronizer, and named by a record of T's ancestry
    when T has one in the records (a key T itself made a contributor does not count).
    Otherwise T's signer, or a free key it named, could build on an update that exists
    nowhere and make it impossible to re-run: every replica would wait on it for good.
    """
    records = list(records)
    by_digest: dict[tuple[int, str], list[RoundRecord]] = {}
    children: dict[tuple[int, str], list[RoundRecord]] = {}
    index: dict[tuple[int, str], list[RoundRecord]] = {}
    for record in records:
        by_digest.setdefault((record.round, record.digest), []).append(record)
        children.setdefault((record.round - 1, record.parent), []).append(record)
        index.setdefault((record.round, record.hash), []).append(record)
    out: set[str] = set()
    for rerun in records:
        if not rerun.supersedes or rerun.supersedes == rerun.digest:
            continue
        for target in by_digest.get((rerun.round, rerun.supersedes), ()):
            if target.parent != rerun.parent or rerun.closed_at - target.closed_at < supersede_after_s:
                continue
            ancestry = _names_of_ancestry(target, index)
            built_on = [
                c for c in children.get((target.round, target.hash), ())
                if c.closed_at < rerun.closed_at and c.synchronizer != target.synchronizer
                and (ancestry is None or c.synchronizer in ancestry)
            ]  # fmt: skip
            if not built_on:
                out.add(target.digest)
    return frozenset(out)


def _names_of_ancestry(
    record: RoundRecord, index: dict[tuple[int, str], list[RoundRecord]], lookback: int = 64
) -> set[str] | None:
    """Peers named by the records of `record`'s ancestry (`lookback` rounds back, at most
    8 records a round), or None when none of its parents is among the records."""
    frontier = index.get((record.round - 1, record.parent), [])
    if not frontier:
        return None
    names: set[str] = set()
    for _ in range(lookback):
        if not frontier:
            break
        for ancestor in frontier:
            names |= ancestor.named
        frontier = [a for r in frontier for a in index.get((r.round - 1, r.parent), [])][:8]
    return names


PROVEN_LOOKBACK = 256
"""Rounds of a record's ancestry searched for its synchronizer (records live an hour)."""
TAKEOVER_AFTER_S = 2 * SUPERSEDE_AFTER_S
"""After this long with no round (signed times), a peer the chain never named may
commit the next one: an open run must not halt once every peer it named has left."""
PROVEN, TAKEOVER, UNPROVEN = 0, 1, 2
"""A record's standing in an open run (`record_standing`): better standing wins first."""


def standing_key(record: RoundRecord) -> tuple[int, str, str]:
    """What tells records apart for their standing: a record signed by another peer with
    a copied digest must not share an honest record's fate."""
    return (record.round, record.synchronizer, record.digest)


def record_standing(
    records: Iterable[RoundRecord], takeover_after_s: float = TAKEOVER_AFTER_S
) -> dict[tuple[int, str, str], int]:
    """`standing_key` -> standing of each record in an open run (pure, the same on every peer).

    PROVEN: its synchronizer is named (as synchronizer or contributor) by a record of its
    own ancestry (the parent links, `PROVEN_LOOKBACK` rounds back, through records that
    are not UNPROVEN), or no ancestor is known (round 0, or where older records expired).
    TAKEOVER: not named, but its parent closed at least `takeover_after_s` before it: the
    peers the chain named have all stopped. UNPROVEN otherwise: skipped.

    A free identity (anyone may sign records in an open run) could otherwise out-rank the
    elected synchronizer's record with a key ground for the round, and every peer would
    wait for an update that does not exist (0 rounds in 90 s, measured). Elections use the
    same set (`entitlement.proven`), so an honest elected synchronizer is always PROVEN.
    """
    ordered = sorted(records, key=lambda r: r.round)
    index: dict[tuple[int, str], list[RoundRecord]] = {}
    standing: dict[tuple[int, str, str], int] = {}
    for record in ordered:
        parents = index.get((record.round - 1, record.parent), [])
        if not parents or _named_in_ancestry(record.synchronizer, parents, index):
            standing[standing_key(record)] = PROVEN
        elif record.closed_at - min(p.closed_at for p in parents) >= takeover_after_s:
            standing[standing_key(record)] = TAKEOVER
        else:
            standing[standing_key(record)] = UNPROVEN
            continue
        index.setdefault((record.round, record.hash), []).append(record)
    return standing


RECEIPTS = "held"
"""Domain of a holder's receipt (`sign_receipt`), per run."""


def _receipt_payload(round_id: int, fragment: int, digest: str) -> bytes:
    return msgpack.packb([round_id, fragment, digest], use_bin_type=True)


def sign_receipt(identity: Identity, run: str, round_id: int, fragment: int, digest: str) -> bytes:
    """`identity`'s signed word that it holds the update frame `digest` of (round,
    fragment) of `run`: what a holder answers `hold_update` with, and what the record that
    commits the round carries for it (`RoundRecord.receipts`)."""
    return identity.sign(f"{RECEIPTS}/{run}", _receipt_payload(round_id, fragment, digest))


@functools.lru_cache(maxsize=OPENED_RECORDS)
def receipt_valid(run: str, holder: str, round_id: int, fragment: int, digest: str, receipt: bytes) -> bool:
    """Whether `receipt` is `holder`'s receipt for that update (remembered: every pass of
    every replica asks it of the same records)."""
    return verify(holder, f"{RECEIPTS}/{run}", _receipt_payload(round_id, fragment, digest), receipt)


def receipted_holders(run: str, record: RoundRecord) -> frozenset[str]:
    """The holders of `record` other than its synchronizer whose receipt for its update
    is valid (the others are the synchronizer's word alone)."""
    return frozenset(
        holder
        for holder, receipt in zip(record.holders, record.receipts, strict=False)
        if holder != record.synchronizer
        and receipt_valid(run, holder, record.round, record.fragment, record.digest, receipt)
    )


def attested_records(run: str, records: Iterable[RoundRecord]) -> frozenset[tuple[int, str, str]]:
    """`standing_key`s of the records whose update is attested (pure, the same on every
    peer): a holder other than the synchronizer signed a receipt for it, and that holder
    is named (as synchronizer or contributor) by a record of the ancestry that another
    synchronizer signed (`PROVEN_LOOKBACK` rounds back).

    Why: a record names its holders on its synchronizer's word, so a key the chain named
    once could sign a record for the open round, naming an update that exists nowhere,
    and every replica would wait on it until the round was re-run (`superseded_digests`,
    a round deadline later). An attested rival outranks it, and a synchronizer holding
    receipts does not yield to it (`Committer.committed_elsewhere`). "Another synchronizer":
    the signer could name free keys as contributors in records of its own (copying an
    honest hash) and have them sign receipts; names only its own records give count for
    nothing on its records. Records with no known parent are not attested (nothing names
    anyone there). Two keys the chain named, colluding, can attest each other's records:
    docs/security.md."""
    records = list(records)
    index: dict[tuple[int, str], list[RoundRecord]] = {}
    for record in records:
        index.setdefault((record.round, record.hash), []).append(record)
    out: set[tuple[int, str, str]] = set()
    for record in records:
        receipted = receipted_holders(run, record)
        if receipted and _ancestry_has(
            index.get((record.round - 1, record.parent), []), index,
            lambda r, signer=record.synchronizer, held=receipted: r.synchronizer != signer and bool(r.named & held),
        ):  # fmt: skip
            out.add(standing_key(record))
    return frozenset(out)


def counted_records(
    records: Iterable[RoundRecord], open_run: bool, supersede_after_s: float = SUPERSEDE_AFTER_S
) -> list[RoundRecord]:
    """The records the canonical rules count at all: in an open run, not the UNPROVEN
    ones (what a synchronizer checks before committing: a stranger's record for its round
    must not make it give up, as it does not make any peer follow the stranger)."""
    records = list(records)
    if not open_run:
        return records
    standing = record_standing(records, 2 * supersede_after_s)
    return [r for r in records if standing.get(standing_key(r)) != UNPROVEN]


def skipped_on_chain(
    chain: Iterable[RoundRecord], record: RoundRecord, supersede_after_s: float = SUPERSEDE_AFTER_S
) -> bool:
    """Whether an open run's canonical rules would skip `record` (UNPROVEN) on top of
    `chain`, the records its synchronizer follows: no record of its ancestry names it,
    and its parent is too recent for a takeover. Such a record changes no other peer's
    chain, so its synchronizer must not commit it either: installing it alone, it would
    apply a round nobody else applies (`Committer.publish`)."""
    return record not in counted_records([*chain, record], True, supersede_after_s)


def _named_in_ancestry(
    peer: str, parents: list[RoundRecord], index: dict[tuple[int, str], list[RoundRecord]]
) -> bool:
    return _ancestry_has(parents, index, lambda r: peer in r.named)


def _ancestry_has(
    parents: list[RoundRecord], index: dict[tuple[int, str], list[RoundRecord]], match: Callable[[RoundRecord], bool]
) -> bool:
    """Whether a record of the ancestry from `parents` (`PROVEN_LOOKBACK` rounds back, at
    most 8 records a round) is one `match` accepts."""
    frontier = parents
    for _ in range(PROVEN_LOOKBACK):
        if not frontier:
            return False
        if any(match(r) for r in frontier):
            return True
        frontier = [a for r in frontier for a in index.get((r.round - 1, r.parent), [])][:8]
    return False


FINALITY_DEPTH = 3
"""Rounds a replica must have applied on top of a round before that round is final for
it (`final_point`): from then on no record at or below it changes what it follows.

Why 3: a branch grows only by commits, and each synchronizer reads the round's records
before it commits on top of them (`Committer`), so an honest race (two records for one
round, a failover while the first synchronizer was still merging) is settled by rank
within the round after it: the losing branch gets no child once its rival is visible.
For a replica to stand on a losing branch three rounds deep, three synchronizers in a
row must have missed a rival stored in the DHT: a partition, not a race. A late record
outranking an old round, on the other hand, is exactly what an attacker with one merged
contribution can sign at any time (docs/security.md, "Finality")."""


def final_point(applied: Mapping[int, str], depth: int = FINALITY_DEPTH) -> tuple[int, str] | None:
    """(round, hash after it) of the highest round on which this replica applied `depth`
    more rounds in a row (`applied`: round -> hash after it, what the replica applied or
    downloaded), or None while it has not (pure)."""
    if not applied:
        return None
    last = max(applied)
    round_id = last - depth
    if round_id < 0 or any(r not in applied for r in range(round_id, last + 1)):
        return None
    return (round_id, applied[round_id])


CHAIN_MEMO_SIZE = 64
"""Inputs `canonical_chain` remembers its answer for (most recent first)."""


def _remembered(chain_of: Callable[..., dict[int, RoundRecord]]) -> Callable[..., dict[int, RoundRecord]]:
    """`chain_of`, remembered for its last `CHAIN_MEMO_SIZE` inputs (it is a pure
    function: a replica's sync passes between two rounds read the same records, and the
    swarm simulator's peers read the same DHT). The records are keyed by their signed
    bytes (whose hash Python keeps), or by their fields where they were never sealed; a
    caller gets its own copy of the chain."""
    memo: OrderedDict[tuple, dict[int, RoundRecord]] = OrderedDict()

    @functools.wraps(chain_of)
    def remembered(run: str, records: Iterable[RoundRecord], *args: Any, **options: Any) -> dict[int, RoundRecord]:
        records = list(records)
        key = (run, frozenset(r.sealed or r for r in records), args, tuple(sorted(options.items())))
        chain = memo.get(key)
        if chain is None:
            chain = memo[key] = chain_of(run, records, *args, **options)
            if len(memo) > CHAIN_MEMO_SIZE:
                memo.popitem(last=False)
        else:
            memo.move_to_end(key)
        return dict(chain)

    return remembered


@_remembered
def canonical_chain(
    run: str,
    records: Iterable[RoundRecord],
    genesis_hash: str,
    void: frozenset[str] = frozenset(),
    *,
    anchor: tuple[int, str] | None = None,
    supersede_after_s: float = SUPERSEDE_AFTER_S,
    open_run: bool = False,
    final: tuple[int, str] | None = None,
) -> dict[int, RoundRecord]:
    """The one record per round every peer follows, from its start as far as it goes.

    Round r's record is the best-ranked among those whose parent is the chosen hash
    after round r-1. Records whose digest is in `void` (proven false, or not applicable by
    anyone) and records superseded by a valid re-run (`superseded_digests`) are skipped.

    Where the chain starts: from the genesis hash at round 0, from `anchor` (round a, the
    hash this replica recorded after applying round a, once round a's records expired:
    the chain then goes on at a + 1), or, where early records have expired, at any round whose records no record of the
    round before leads to (a *free* start, from its best-ranked record). The longest chain
    wins, counted from round 0 for a linked chain (genesis, the anchor, or a free chain
    that passes through the anchor: verified by this replica) and from its start for a
    free one; ties go to the lowest start, then to a linked chain. So one stray record
    below the real start, or above its head, truncates nothing (its chain is one round
    long), and outgrowing a replica's own chain takes more forged records than its head
    round.

    In an open run (`open_run`), a record whose synchronizer its own ancestry never named
    is skipped, and one that took over a stalled chain ranks after every named rival
    (`record_standing`).

    With `final` (round f, the hash after it: this replica's `final_point`), the chain
    goes through it whatever else was signed: below f it is the ancestry of that hash,
    and from f + 1 it goes on from that hash alone, so no record at or below f (however
    well ranked, however late) and no chain that does not pass through it (however long)
    moves the replica. Only where no record leads on from f any more (they expired: a
    stop longer than `ROUND_RECORD_TTL_S`) do the rules above choose among the records
    past f.
    """
    records = list(records)
    if final is not None:
        return _through_final(run, records, genesis_hash, void, final, anchor, supersede_after_s, open_run)
    skipped = void | superseded_digests(records, supersede_after_s)
    standing = record_standing(records, 2 * supersede_after_s) if open_run else {}
    attested = attested_records(run, records)
    by_round: dict[int, list[RoundRecord]] = {}
    for record in records:
        if record.digest not in skipped and standing.get(standing_key(record)) != UNPROVEN:
            by_round.setdefault(record.round, []).append(record)
    if not by_round:
        return {}

    def best(round_id: int, parent: str | None) -> RoundRecord | None:
        rivals = [r for r in by_round.get(round_id, ()) if parent is None or r.parent == parent]
        return min(rivals, key=lambda r: rivalry_key(run, r, standing, attested)) if rivals else None

    # the head reached from (round, parent) and whether the way passes the anchor, computed
    # once per pair from the top down: choosing among many starts costs one pass, not a
    # walk per start
    ahead: dict[tuple[int, str | None], tuple[int, bool]] = {}
    for round_id in sorted(by_round, reverse=True):
        for parent in {r.parent for r in by_round[round_id]} | {None}:
            chosen = best(round_id, parent)
            assert chosen is not None
            head, through = ahead.get((round_id + 1, chosen.hash), (round_id + 1, False))
            ahead[(round_id, parent)] = (head, through or anchor == (round_id, chosen.hash))
    leads = {(r.round, r.hash) for r in records}  # skipped ones too: what was built on a void
    # or superseded update is not a fresh start
    scored: list[tuple[int, int, bool, str | None]] = []  # (length, start, free, parent)
    if (0, genesis_hash) in ahead:
        scored.append((ahead[(0, genesis_hash)][0], 0, False, genesis_hash))
    present = {r.round for r in records}
    if anchor is not None and anchor[0] not in present and (anchor[0] + 1, anchor[1]) in ahead:
        # only where the anchor's own round has expired: where its records remain, the
        # rank decides there as for every peer (a replica on a losing branch repairs)
        scored.append((ahead[(anchor[0] + 1, anchor[1])][0], anchor[0] + 1, False, anchor[1]))
    for round_id, rivals in by_round.items():
        if round_id > 0 and not any((round_id - 1, r.parent) in leads for r in rivals):
            head, through = ahead[(round_id, None)]  # nothing leads here: an expired past
            # counted from round 0 when it passes what this replica applied, else from its start
            scored.append((head if through else head - round_id, round_id, not through, None))
    if not scored:
        return {}
    _length, start, _free, parent = min(scored, key=lambda s: (-s[0], s[1], s[2]))
    chain: dict[int, RoundRecord] = {}
    round_id = start
    while (chosen := best(round_id, parent)) is not None:
        chain[round_id] = chosen
        parent, round_id = chosen.hash, round_id + 1
    return chain


def _through_final(
    run: str,
    records: list[RoundRecord],
    genesis_hash: str,
    void: frozenset[str],
    final: tuple[int, str],
    anchor: tuple[int, str] | None,
    supersede_after_s: float,
    open_run: bool,
) -> dict[int, RoundRecord]:
    """`canonical_chain` of a replica whose round `final[0]` is final (see there): the
    usual rules over the final hash's ancestry (one record a round, the one this replica
    applied) and the records that descend from it, so every chain they can pick passes
    through it. The ancestry stays in so an open run's standing still sees who the chain
    named."""
    final_round, final_hash = final
    by_round: dict[int, list[RoundRecord]] = {}
    for record in records:
        if record.digest not in void:
            by_round.setdefault(record.round, []).append(record)
    kept: list[RoundRecord] = []
    wanted = final_hash
    for round_id in range(final_round, -1, -1):  # the ancestry, from the final hash down
        mine = [r for r in by_round.get(round_id, ()) if r.hash == wanted]
        if not mine:
            break
        kept.append(min(mine, key=lambda r: rank(run, r)))
        wanted = kept[-1].parent
    reached, onward = {final_hash}, []
    for round_id in range(final_round + 1, max(by_round, default=final_round) + 1):  # descendants
        children = [r for r in by_round.get(round_id, ()) if r.parent in reached]
        if not children:
            break
        onward += children
        reached = {r.hash for r in children}
    if not onward:
        # nothing leads on from the final hash: its records expired (a stop longer than
        # ROUND_RECORD_TTL_S); the usual rules choose among the records past it
        past = [r for r in records if r.round > final_round]
        chain = canonical_chain(
            run, past, genesis_hash, void, anchor=anchor, supersede_after_s=supersede_after_s, open_run=open_run
        )
        return {**{r.round: r for r in kept}, **chain}
    start = kept[-1] if kept else None
    chain = canonical_chain(
        run, [*kept, *onward], genesis_hash, void,
        anchor=None if start is not None else final,  # the ancestry links the chain itself
        supersede_after_s=supersede_after_s, open_run=open_run,
    )  # fmt: skip
    return chain
