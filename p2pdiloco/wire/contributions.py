"""Signed contributions: what a learner sends, and what a synchronizer keeps for audits.

A learner seals its CONTRIBUTION frame (run, round, fragment, base round, tokens, steps,
the encoded delta) with its identity. The synchronizer opens it against the caller's
peer id, merges it, names its digest in the round record, and keeps the sealed bytes of
recent rounds so any peer can fetch them and recompute the merge (`audit`). A sealed
contribution is evidence: nobody but the learner could have written it, and the record
that lists its digest was signed by the synchronizer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgpack

from p2pdiloco.identity import Identity, SignedKind

MAX_AUDIT_REQUEST_BYTES = 256
KEPT_ROUNDS = 16
"""Rounds (per fragment) whose contributions a synchronizer keeps for auditors."""
KEPT_BYTES = 512 << 20
"""Bound on the bytes of kept contributions; the oldest rounds go first."""


CONTRIBUTIONS = SignedKind("contribution")
"""Contributions, signed by their learner; bounded by the run's frame size when opened."""


def seal_contribution(identity: Identity, run: str, frame: bytes) -> bytes:
    """The request a learner sends: its frame with its signature."""
    return CONTRIBUTIONS.seal(identity, run, frame)


def contribution_digest(sealed: bytes) -> str:
    """The name of a sealed contribution in round records (hex, 128 bits)."""
    return hashlib.blake2b(sealed, digest_size=16).hexdigest()


def open_contribution(run: str, peer: str, sealed: bytes, max_bytes: int) -> bytes | str:
    """The frame inside `sealed` if `peer` signed it for `run`, else the reason (a string)."""
    frame = CONTRIBUTIONS.open(peer, run, sealed, max_bytes)
    return frame if isinstance(frame, bytes) else f"contribution not signed by its sender: {frame}"


def encode_audit_request(round_id: int, fragment: int) -> bytes:
    return msgpack.packb([round_id, fragment])


def decode_audit_request(raw: bytes) -> tuple[int, int] | str:
    try:
        if len(raw) > MAX_AUDIT_REQUEST_BYTES:
            return "request too large"
        pair = msgpack.unpackb(raw, max_array_len=2)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes
        return f"undecodable request ({type(exc).__name__})"
    if not (isinstance(pair, list) and len(pair) == 2):
        return "request is not [round, fragment]"
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in pair):
        return "round and fragment must be counts"
    return pair[0], pair[1]


def encode_contribution_list(sealed: list[bytes]) -> bytes:
    return msgpack.packb(sealed, use_bin_type=True)


def decode_contribution_list(raw: bytes, max_items: int, max_bytes: int) -> list[bytes] | str:
    try:
        items = msgpack.unpackb(raw, max_array_len=max_items, max_bin_len=max_bytes)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes
        return f"undecodable contribution list ({type(exc).__name__})"
    if not isinstance(items, list) or not all(isinstance(i, bytes) for i in items):
        return "not a list of sealed contributions"
    return items


class ContributionStore:
    """The sealed contributions of recently committed rounds, bounded in rounds and bytes."""

    def __init__(self, kept_rounds: int = KEPT_ROUNDS, kept_bytes: int = KEPT_BYTES) -> None:
        self.kept_rounds = kept_rounds
        self.kept_bytes = kept_bytes
        self._rounds: OrderedDict[tuple[int, int], list[bytes]] = OrderedDict()
        self._bytes = 0

    def put(self, round_id: int, fragment: int, sealed: list[bytes]) -> None:
        key = (round_id, fragment)
        if key in self._rounds:
            self._bytes -= sum(map(len, self._rounds.pop(key)))
        self._rounds[key] = list(sealed)
        self._bytes += sum(map(len, sealed))
        per_fragment = [k for k in self._rounds if k[1] == fragment]
        for old in per_fragment[: max(0, len(per_fragment) - self.kept_rounds)]:
            self._bytes -= sum(map(len, self._rounds.pop(old)))
        while self._bytes > self.kept_bytes and len(self._rounds) > 1:
            _, dropped = self._rounds.popitem(last=False)
            self._bytes -= sum(map(len, dropped))

    def get(self, round_id: int, fragment: int) -> list[bytes] | None:
        return self._rounds.get((round_id, fragment))

