"""What the DHT of a run stores: the validator every peer applies to every record.

A run uses a fixed set of keys (its heartbeats, its fraud notices and one round-record key
per fragment).
Each record must be a dictionary entry (never a plain value that would replace the whole
dictionary), under a subkey naming the peer that signed the value, with an expiration
no further ahead than its kind ever needs. Heartbeats are signed by the peer they speak
for; round records by their synchronizer, who in a certified run also shows an operator
certificate. Anything else is refused when a peer asks us to store it and dropped when
a peer returns it to us, so a forged or malformed value never reaches the protocol.

The check is pure (`now` is passed in); the hivemind transport wraps it in hivemind's
record-validator hook and the in-memory transport applies it directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pdiloco.config import MAX_FRAGMENTS
from p2pdiloco.identity import is_peer_id
from p2pdiloco.protocol.membership import (
    CLOCK_SLACK_S,
    MAX_MEMBER_SHARDS,
    heartbeat_expiry_refusal,
    member_shard,
    member_shard_key,
    members_key,
    open_heartbeat,
    shard_of_key,
)
from p2pdiloco.protocol.rounds import (
    MAX_EPOCH_ROUNDS,
    epoch_of_key,
    open_record,
    record_subkey,
    record_time,
    rounds_key,
    subkey_round,
)
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import NOTICE_TTL_S, notices_key, open_notice

HEARTBEAT_MAX_TTL_S = 300.0
"""No heartbeat signs a longer life (a peer beats every few seconds and is gone after 4
beats); the DHT keeps it CLOCK_SLACK_S longer at most."""
RECORD_MAX_TTL_S = 3600.0 + 300.0
"""No round record lives longer (committed records are kept an hour), counted from now
and from the close time it signs."""
MAX_SUBKEY_CHARS = 128


@dataclass(frozen=True)
class RunRecordRules:
    """The record rules of one run (every peer of the run builds the same)."""

    run: str
    num_fragments: int
    admission: Admission = Admission()
    member_shards: int | None = None
    """The run's `network.member_shards`; None (a bootstrap node, which has no run
    config): any a run may choose."""
    epoch_rounds: int | None = None
    """The run's `network.record_epoch_rounds`; None: any a run may choose."""

    def keys(self) -> list[str]:
        """The run's fixed DHT keys: its one members key, its notices, one records key per
        fragment. Shard and epoch keys are many (`keys_of`)."""
        return [members_key(self.run), notices_key(self.run)] + [
            rounds_key(self.run, f) for f in range(self.num_fragments)
        ]

    def keys_of(self, subkey: object) -> list[str]:
        """The shard or epoch keys a record under `subkey` may be stored under: a heartbeat
        lives in its peer's shard (`member_shard_key`), a round record in its round's epoch
        (`rounds_key`), so the key follows from the subkey and the run's layout. A DHT
        that shows keys only by their hash (hivemind) finds the key's name among these;
        it knew only `keys()` before, and refused every sharded heartbeat and every epoch
        record a real peer stored (a sharded run worked in the simulator alone)."""
        if not isinstance(subkey, str):
            return []
        if is_peer_id(subkey):
            counts = [self.member_shards] if self.member_shards is not None else _powers_of_two(2, MAX_MEMBER_SHARDS)
            return [member_shard_key(self.run, member_shard(subkey, s), s) for s in counts if s > 1]
        round_id = subkey_round(subkey)
        if round_id is None:
            return []
        sizes = [self.epoch_rounds] if self.epoch_rounds is not None else _powers_of_two(1, MAX_EPOCH_ROUNDS)
        return [
            rounds_key(self.run, f, round_id, size)
            for size in sizes if size > 0 for f in range(self.num_fragments)
        ]  # fmt: skip

    def check(self, key: str, subkey: object, value: object, expiration: float, now: float) -> str | None:
        """Why the record must not be stored or believed, or None when it is acceptable."""
        if not isinstance(subkey, str) or not subkey or len(subkey) > MAX_SUBKEY_CHARS:
            return "not a dictionary entry under a short subkey"
        if not isinstance(expiration, float | int) or not math.isfinite(expiration):
            return "expiration is not a finite time"
        if key == members_key(self.run):
            return self._check_heartbeat(subkey, value, expiration, now)
        shard = shard_of_key(self.run, key)
        if shard is not None:
            if member_shard(subkey, shard[1]) != shard[0]:
                return "heartbeat stored in another peer's membership shard"
            return self._check_heartbeat(subkey, value, expiration, now)
        if key == notices_key(self.run):
            if expiration > now + NOTICE_TTL_S + 300:
                return "fraud notice expires too far ahead"
            notice = open_notice(self.run, subkey, value)
            return notice if isinstance(notice, str) else None
        for fragment in range(self.num_fragments):
            if key == rounds_key(self.run, fragment):
                return self._check_record(fragment, subkey, value, expiration, now)
            epoch = epoch_of_key(self.run, fragment, key)
            if epoch is not None:
                refusal = self._check_record(fragment, subkey, value, expiration, now)
                # the subkey names the record's round (`_check_record` checked it does)
                if refusal is None and int(subkey.split("/", 1)[0]) // epoch[0] != epoch[1]:
                    return "round record stored under another epoch"
                return refusal
        return "not a key of this run"

    def _check_heartbeat(self, subkey: str, value: object, expiration: float, now: float) -> str | None:
        """A heartbeat's signature, then its expiry: against its own signed send time and
        life (the same verdict on every clock: this is what defeats a replay), and against
        `now` only loosely (a bound on how long a value occupies the DHT). The loose bound
        keeps one crafted value near the limit from making a peer whose clock is a little
        behind refuse it, which would drop the whole members dictionary from an answer
        (hivemind validates a dictionary as one)."""
        if expiration > now + HEARTBEAT_MAX_TTL_S + 2 * CLOCK_SLACK_S:
            return "heartbeat expires too far ahead"
        beat = open_heartbeat(self.run, subkey, value)
        if isinstance(beat, str):
            return beat
        if beat.live_s > HEARTBEAT_MAX_TTL_S:
            return "heartbeat signs too long a life"
        return heartbeat_expiry_refusal(beat, expiration)

    def _check_record(self, fragment: int, subkey: str, value: object, expiration: float, now: float) -> str | None:
        if expiration > now + RECORD_MAX_TTL_S:
            return "round record expires too far ahead"
        record = open_record(self.run, value)
        if record is None:
            return "not a round record signed by its synchronizer"
        if record.fragment != fragment or subkey != record_subkey(record.round, record.synchronizer):
            return "round record stored under another fragment or subkey"
        if expiration > record_time(record) + RECORD_MAX_TTL_S:
            return "round record expires too long after its close"
        refusal = record_time_refusal(record_time(record), now) or self.admission.synchronizer_refusal(
            self.run, record.synchronizer, record.certificates, record.closed_at
        )
        if refusal is None and record.resumed_by:
            refusal = self.admission.synchronizer_refusal(
                self.run, record.resumed_by, record.resumed_certificates, record.resumed_at
            )
        return f"synchronizer not entitled: {refusal}" if refusal else None


def record_time_refusal(closed_at: float, now: float) -> str | None:
    """Why a round record's signed close time (or resume time: `rounds.record_time`)
    cannot be true when judged at `now`, or None.

    A certificate is checked at the close time the record signs (a committed record stays
    valid to follow for the hour it lives, after its certificate ran out). What keeps a
    leaked or expired key from backdating a new record to a time its certificate was
    valid: the close may not lie in the future, nor further back than any record lives
    (so the certificate must still have been valid RECORD_MAX_TTL_S before now), a record
    is kept no longer after its signed close than any record lives, and a record may not
    close before the canonical record it follows (`Entitlement.entitled`)."""
    if closed_at > now + CLOCK_SLACK_S:
        return "record closes in the future"
    if closed_at < now - RECORD_MAX_TTL_S:
        return "record closed longer ago than any record lives"
    return None


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << b for b in range(high.bit_length()) if low <= 1 << b <= high]


def bootstrap_rules(run: str, num_fragments: int | None, admission: Admission) -> RunRecordRules:
    """The rules of a bootstrap node: a DHT node that stores what the run's rules allow.

    With a manifest it knows the run's fragment count. Without one (an open run) the
    learners choose it, and a bootstrap node that refused the records of their higher
    fragments would make their stores fail at random (hivemind answers a store with its
    last replica's answer): it takes every fragment a run may have."""
    return RunRecordRules(run, num_fragments if num_fragments is not None else MAX_FRAGMENTS, admission)
