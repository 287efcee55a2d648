"""Auditing a committed round: recompute its merge from the signed contributions.

A round record names the parent hash, the result hash, and the digest of every signed
contribution of the window (merged or refused). Anyone holding the fragment's state at
the parent hash and the recent chain can fetch those contributions from the synchronizer
and run the very merge the synchronizer ran (`merging.merge_round`). Equal bits: the
round is what the record says. Different bits: the record and the contributions are two
signed objects that prove the synchronizer published a merge it did not compute.

This module is pure (no network): `audit_round` takes what was fetched. An audit that
cannot be completed (state not at the parent, history or contributions not available)
is `unverifiable`, never an accusation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.identity import Identity, SignedKind, is_peer_id
from p2pdiloco.outer.fragment_state import FragmentState, outer_update
from p2pdiloco.outer.screening import Candidate, ScreeningRules
from p2pdiloco.protocol.merge import history_from, history_of, max_tokens_per_step, merge_round
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.wire.contributions import CONTRIBUTIONS, contribution_digest, open_contribution

OK, MISMATCH, UNVERIFIABLE = "ok", "mismatch", "unverifiable"


@dataclass(frozen=True)
class AuditResult:
    verdict: str
    """ok, mismatch (proof of a false merge) or unverifiable."""
    reason: str = ""
    recomputed_hash: str = ""


def _candidate(
    run: str, record: RoundRecord, sealed: bytes, limits: wire.WireLimits, shapes: Mapping[str, tuple]
) -> Candidate | str:
    """The decoded contribution in `sealed`, checked against the record's round; or why not."""
    frame = CONTRIBUTIONS.peek(sealed, limits.max_frame_bytes + 256)
    if isinstance(frame, str):
        return frame
    msg = wire.decode_message(frame, limits)
    if isinstance(msg, wire.Rejected):
        return msg.reason
    peer = msg.meta.get("peer")
    if not isinstance(peer, str) or isinstance(open_contribution(run, peer, sealed, limits.max_frame_bytes + 256), str):
        return "contribution not signed by the peer it names"
    if (msg.kind, msg.run, msg.round, msg.fragment) != (wire.CONTRIBUTION, run, record.round, record.fragment):
        return "contribution is for another round"
    if {n: tuple(t.shape) for n, t in msg.tensors.items()} != dict(shapes):
        return "contribution does not match the fragment's layout"
    delta = wire.lazy_tensors(msg)
    if isinstance(delta, wire.Rejected):
        return delta.reason
    base_round = int(msg.meta["base_round"])
    return Candidate(
        peer, delta, int(msg.meta["tokens"]), int(msg.meta["steps"]), staleness=record.round - base_round
    )


def audit_round(
    run: str,
    record: RoundRecord,
    contributions: Sequence[bytes],
    snapshot: FragmentState,
    names: list[str],
    chain: Mapping[int, RoundRecord],
    config: RunConfig,
    rules: ScreeningRules,
    max_tokens_per_step: int,
    limits: wire.WireLimits,
) -> AuditResult:
    """Recompute `record`'s merge from `contributions` on `snapshot` (the parent state)."""
    if record.history_from < 0 and history_of(chain, record.round, rules.history_rounds)[1] >= 0:
        # "no history" lifts the clip to the window's or the parameters' bound: a record
        # may say so only where the chain lacks those rounds. Not a
        # proof (the synchronizer may have read a partial chain): an out-of-line update
        # that cannot be verified is held, not applied.
        return AuditResult(UNVERIFIABLE, "the record claims no history but the chain holds it")
    if snapshot.hash != record.parent or snapshot.round != record.round:
        return AuditResult(UNVERIFIABLE, "the state at hand is not the round's parent")
    history = history_from(chain, record.round, record.history_from, rules.history_rounds)
    if history is None:
        return AuditResult(UNVERIFIABLE, "the chain history the record used is not known here")
    by_digest = {contribution_digest(s): s for s in contributions}
    listed = list(record.contributions) + list(record.refused)
    if len(record.contributions) != len(record.contributors) or len(set(listed)) != len(listed):
        return AuditResult(MISMATCH, "the record's contribution list is inconsistent")
    missing = [d for d in listed if d not in by_digest]
    if missing:
        return AuditResult(UNVERIFIABLE, f"{len(missing)} listed contributions not served")
    shapes = {n: tuple(snapshot.params[n].shape) for n in names}
    candidates = []
    for digest in listed:
        candidate = _candidate(run, record, by_digest[digest], limits, shapes)
        if isinstance(candidate, str):
            return AuditResult(MISMATCH, f"a listed contribution is invalid: {candidate}")
        candidates.append(candidate)
    if len({c.peer for c in candidates}) != len(candidates):
        return AuditResult(MISMATCH, "one peer listed twice")
    result = merge_round(
        candidates,
        history=history,
        params=snapshot.params,
        momentum=snapshot.momentum,
        outer=config.outer,
        sync=config.sync,
        rules=rules,
        max_tokens_per_step=max_tokens_per_step,
        outer_codec=compress.make_codec_from_config(config.compress, outer=True),
    )
    kept = result.screening.kept
    expected = tuple((v.peer, float(v.weight), v.tokens) for v in kept)
    if expected != tuple(record.contributors):
        return AuditResult(MISMATCH, "the merged contributors or their weights differ from the record's")
    if tuple(v.history_norm for v in kept) != tuple(record.norms):
        return AuditResult(MISMATCH, "the listed norms differ from the record's")
    digest_of = {c.peer: d for c, d in zip(candidates, listed, strict=True)}
    if sorted(digest_of[p] for p in result.screening.refused) != sorted(record.refused):
        return AuditResult(MISMATCH, "the refused contributions differ from the record's")
    if not result.quorate:
        return AuditResult(
            MISMATCH, f"fewer contributions pass the screening than the quorum ({result.quorum}), yet a merge was committed"
        )
    try:
        recomputed = outer_update(snapshot, result.decoded, config.outer).hash
    except ValueError as exc:
        return AuditResult(MISMATCH, f"the merge cannot be applied: {exc}")
    if recomputed != record.hash:
        return AuditResult(MISMATCH, "the recomputed result hash differs from the record's", recomputed)
    return AuditResult(OK, "", recomputed)


# --- fraud notices ----------------------------------------------------------------------

NOTICE_TTL_S = 3600.0
MAX_NOTICE_BYTES = 1024


def notices_key(run: str) -> str:
    """DHT key of a run's fraud notices (one per auditor and round)."""
    return f"p2pdiloco/{run}/audits"


def notice_subkey(fragment: int, round_id: int, auditor: str) -> str:
    return f"{fragment}/{round_id}/{auditor}"


NOTICES = SignedKind("audit", MAX_NOTICE_BYTES)
"""Fraud notices, signed by their auditor."""


@dataclass(frozen=True)
class FraudNotice:
    """An auditor's claim that a record's merge does not match its contributions.

    A claim, not a proof: a reader re-runs the audit itself before acting on it.
    """

    fragment: int
    round: int
    synchronizer: str
    digest: str
    """The update digest of the accused record."""
    auditor: str


def seal_notice(identity: Identity, run: str, notice: FraudNotice) -> bytes:
    payload = msgpack.packb([notice.fragment, notice.round, notice.synchronizer, notice.digest])
    return NOTICES.seal(identity, run, payload)


def open_notice(run: str, subkey: object, sealed: object) -> FraudNotice | str:
    """The notice stored under `subkey` if its auditor signed it, else the reason."""
    if not isinstance(subkey, str) or subkey.count("/") != 2:
        return "not a notice subkey"
    fragment_text, round_text, auditor = subkey.split("/")
    if not is_peer_id(auditor):
        return "notice subkey names no peer"
    payload = NOTICES.open(auditor, run, sealed)
    if isinstance(payload, str):
        return payload
    try:
        fields = msgpack.unpackb(payload, max_array_len=4, max_str_len=256)
    except Exception as exc:  # noqa: BLE001 - signed but malformed
        return f"undecodable notice ({type(exc).__name__})"
    if not (isinstance(fields, list) and len(fields) == 4):
        return "notice is not [fragment, round, synchronizer, digest]"
    fragment, round_id, synchronizer, digest = fields
    if not (
        isinstance(fragment, int) and isinstance(round_id, int) and isinstance(synchronizer, str)
        and isinstance(digest, str) and f"{fragment}/{round_id}" == f"{fragment_text}/{round_text}"
        and fragment >= 0 and round_id >= 0
    ):
        return "notice fields do not match its subkey"
    return FraudNotice(fragment, round_id, synchronizer, digest, auditor)


class Auditor:
    """What a peer needs to audit rounds of its run (config, screening, limits, layout)."""

    def __init__(
        self, run: str, config: RunConfig, limits: wire.WireLimits, fragments: list[list[str]]
    ) -> None:
        self.run = run
        self.config = config
        self.rules = config.screening
        self.max_tokens_per_step = max_tokens_per_step(config)
        self.limits = limits
        self.fragments = fragments

    def check(
        self,
        record: RoundRecord,
        contributions: Sequence[bytes],
        snapshot: FragmentState,
        chain: Mapping[int, RoundRecord],
    ) -> AuditResult:
        return audit_round(
            self.run, record, contributions, snapshot, self.fragments[record.fragment], chain,
            self.config, self.rules, self.max_tokens_per_step, self.limits,
        )
