"""Identities, operator certificates, admission rules and the DHT record rules."""

from __future__ import annotations

import math

import msgpack
import pytest

from p2pdiloco.identity import (
    Identity,
    SealError,
    SignedKind,
    is_peer_id,
    load_identity,
    save_identity,
    unseal,
    verify,
)
from p2pdiloco.protocol.membership import HEARTBEATS, Heartbeat, members_key, seal_heartbeat
from p2pdiloco.protocol.rounds import RoundRecord, record_subkey, rounds_key, seal_record
from p2pdiloco.trust.admission import Admission, Certificate, issue_certificate, read_certificate
from p2pdiloco.trust.record_rules import HEARTBEAT_MAX_TTL_S, RunRecordRules, bootstrap_rules

RUN = "trust-test"
NOW = 1_800_000_000.0
OPERATOR = Identity.generate()
PEER = Identity.generate()
OTHER = Identity.generate()


# --- identities ------------------------------------------------------------------------


def test_a_peer_id_carries_its_public_key_and_verifies_its_signatures(tmp_path) -> None:
    assert is_peer_id(PEER.peer_id) and PEER.peer_id.startswith("12D3KooW")
    signature = PEER.sign("d", b"payload")
    assert verify(PEER.peer_id, "d", b"payload", signature)
    assert not verify(PEER.peer_id, "other-domain", b"payload", signature)
    assert not verify(OTHER.peer_id, "d", b"payload", signature)
    assert not verify("not-a-peer-id", "d", b"payload", signature)
    path = tmp_path / "id.key"
    save_identity(PEER, path)
    assert load_identity(path).peer_id == PEER.peer_id
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_key_file_that_is_not_an_ed25519_key_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(b"\x08\x00\x12\x05hello")
    with pytest.raises(ValueError, match="Ed25519"):
        load_identity(path)


@pytest.mark.parametrize("junk", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb([b"x"]), 5, None, b"x" * (2 << 20)])
def test_unseal_refuses_junk_with_a_seal_error(junk) -> None:
    with pytest.raises(SealError):
        unseal(PEER.peer_id, "d", junk)


def test_a_signed_kind_opens_only_its_own_kind_run_and_signer_and_says_why_not() -> None:
    beats, records = SignedKind("beat", 256), SignedKind("record", 256)
    sealed = beats.seal(PEER, RUN, b"payload", signer=PEER.peer_id)
    assert beats.open(PEER.peer_id, RUN, sealed) == b"payload"
    assert beats.peek(sealed) == b"payload"
    assert "bad signature" in beats.open(OTHER.peer_id, RUN, sealed)
    assert "bad signature" in beats.open(PEER.peer_id, "other-run", sealed)
    assert "bad signature" in records.open(PEER.peer_id, RUN, sealed)
    assert isinstance(beats.open(PEER.peer_id, RUN, sealed, max_bytes=16), str)
    assert isinstance(beats.peek(b"\xc1"), str)
    with pytest.raises(ValueError, match="signed by that peer"):
        beats.seal(PEER, RUN, b"payload", signer=OTHER.peer_id)


# --- certificates and admission --------------------------------------------------------


def certificate(peer: Identity, role: str = "synchronizer", expires: float = NOW + 3600, by: Identity = OPERATOR) -> bytes:
    return issue_certificate(by, Certificate(RUN, peer.peer_id, role, expires))


def test_a_certificate_round_trips_and_is_bound_to_run_operator_and_peer() -> None:
    raw = certificate(PEER)
    assert read_certificate(raw, OPERATOR.peer_id, RUN) == Certificate(RUN, PEER.peer_id, "synchronizer", NOW + 3600)
    assert isinstance(read_certificate(raw, OTHER.peer_id, RUN), str)  # another operator
    assert isinstance(read_certificate(raw, OPERATOR.peer_id, "other-run"), str)


def test_certified_admission_entitles_only_unexpired_certificates_for_the_right_peer_and_role() -> None:
    rules = Admission(synchronizers="certified", learners="certified", operator=OPERATOR.peer_id)
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, [certificate(PEER)], NOW) is None
    assert "expired" in rules.synchronizer_refusal(RUN, PEER.peer_id, [certificate(PEER, expires=NOW - 1)], NOW)
    assert rules.synchronizer_refusal(RUN, OTHER.peer_id, [certificate(PEER)], NOW) is not None
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, [certificate(PEER, by=PEER)], NOW) is not None
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, [certificate(PEER, "learner")], NOW) is not None
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, [], NOW) == "no synchronizer certificate"
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, "junk", NOW) is not None
    both = [certificate(PEER, "learner"), certificate(PEER)]
    assert rules.synchronizer_refusal(RUN, PEER.peer_id, both, NOW) is None
    assert rules.learner_refusal(RUN, PEER.peer_id, both, NOW) is None


def test_open_and_allowlist_admission() -> None:
    assert Admission().synchronizer_refusal(RUN, PEER.peer_id, [], NOW) is None
    listed = Admission(learners="allowlist", allowlist=frozenset({PEER.peer_id}))
    assert listed.learner_refusal(RUN, PEER.peer_id, [], NOW) is None
    assert listed.learner_refusal(RUN, OTHER.peer_id, [], NOW) is not None
    with pytest.raises(ValueError, match="operator"):
        Admission(synchronizers="certified")


# --- the DHT record rules --------------------------------------------------------------

RULES = RunRecordRules(RUN, num_fragments=2)
CERTIFIED = RunRecordRules(RUN, 2, Admission(synchronizers="certified", operator=OPERATOR.peer_id))


def beat(identity: Identity = PEER, **fields) -> bytes:
    fields = {"sent_at": NOW, "live_s": 8.0, **fields}
    return seal_heartbeat(identity, RUN, Heartbeat(peer_id=identity.peer_id, **fields))


def round_record(identity: Identity = PEER, fragment: int = 0, certificates=()) -> RoundRecord:
    return RoundRecord(
        round=3, fragment=fragment, synchronizer=identity.peer_id, hash="h", parent="p",
        closed_at=NOW, certificates=tuple(certificates),
    )


def test_the_rules_accept_what_honest_peers_write() -> None:
    assert RULES.check(members_key(RUN), PEER.peer_id, beat(), NOW + 8, NOW) is None
    record = round_record()
    assert RULES.check(rounds_key(RUN, 0), record_subkey(3, PEER.peer_id), seal_record(PEER, RUN, record), NOW + 3600, NOW) is None


FORGED = [
        ("p2pdiloco/trust-test/junk", "x", b"v", NOW + 1, "not a key of this run"),
        (members_key(RUN), None, beat(), NOW + 1, "dictionary entry"),  # a plain value
        (members_key(RUN), PEER.peer_id, beat(), NOW + HEARTBEAT_MAX_TTL_S + 10, "after its signed life"),
        (members_key(RUN), PEER.peer_id, beat(), NOW + 3 * HEARTBEAT_MAX_TTL_S, "too far ahead"),
        (members_key(RUN), PEER.peer_id, beat(), math.inf, "finite"),
        (members_key(RUN), PEER.peer_id, beat(OTHER), NOW + 1, "bad signature"),
        (members_key(RUN), PEER.peer_id, beat(status="leaving", client_mode=True)[:-3], NOW + 1, ""),
        (members_key(RUN), "fake-1", beat(), NOW + 1, "not a peer id"),
        (members_key(RUN), PEER.peer_id, 12345, NOW + 1, ""),
        (rounds_key(RUN, 0), record_subkey(3, PEER.peer_id), round_record().encode(), NOW + 1, "signed"),
        (rounds_key(RUN, 1), record_subkey(3, PEER.peer_id), seal_record(PEER, RUN, round_record()), NOW + 1, "another fragment"),
        (rounds_key(RUN, 0), record_subkey(4, PEER.peer_id), seal_record(PEER, RUN, round_record()), NOW + 1, "subkey"),
        (rounds_key(RUN, 0), record_subkey(3, PEER.peer_id), seal_record(PEER, RUN, round_record()), NOW + 1e6, "too far ahead"),
        (rounds_key(RUN, 5), record_subkey(3, PEER.peer_id), seal_record(PEER, RUN, round_record(fragment=5)), NOW + 1, "not a key"),
]
"""(key, subkey, value, expiration, the refusal's words): the identities are random, so
the test ids are the case numbers (the same in every pytest-xdist worker)."""


@pytest.mark.parametrize(
    "key, subkey, value, expiration, reason", FORGED, ids=[f"case{i}" for i in range(len(FORGED))]
)
def test_the_rules_refuse_forged_malformed_and_over_long_lived_values(key, subkey, value, expiration, reason) -> None:
    refusal = RULES.check(key, subkey, value, expiration, NOW)
    assert refusal is not None and reason in refusal


def test_a_bootstrap_node_of_an_open_run_stores_the_records_of_any_fragment_a_run_may_have() -> None:
    """Learners choose the fragment count of an open run; its bootstrap node does not know
    it, and refusing fragment 1's records made the learners' stores fail (stop 23)."""
    record = seal_record(PEER, RUN, round_record(fragment=5))
    subkey = record_subkey(3, PEER.peer_id)
    open_bootstrap = bootstrap_rules(RUN, None, Admission())
    assert open_bootstrap.check(rounds_key(RUN, 5), subkey, record, NOW + 1, NOW) is None
    assert open_bootstrap.check(rounds_key(RUN, 64), subkey, record, NOW + 1, NOW) == "not a key of this run"
    with_manifest = bootstrap_rules(RUN, 2, Admission())
    assert with_manifest.check(rounds_key(RUN, 5), subkey, record, NOW + 1, NOW) == "not a key of this run"


def test_a_certified_run_stores_round_records_only_from_certified_synchronizers() -> None:
    subkey, key = record_subkey(3, PEER.peer_id), rounds_key(RUN, 0)
    bare = seal_record(PEER, RUN, round_record())
    assert "not entitled" in CERTIFIED.check(key, subkey, bare, NOW + 1, NOW)
    shown = seal_record(PEER, RUN, round_record(certificates=[certificate(PEER)]))
    assert CERTIFIED.check(key, subkey, shown, NOW + 1, NOW) is None
    borrowed = seal_record(PEER, RUN, round_record(certificates=[certificate(OTHER)]))
    assert CERTIFIED.check(key, subkey, borrowed, NOW + 1, NOW) is not None


def test_the_forged_values_of_the_attack_never_get_past_the_rules() -> None:
    """The attack seen: leaving/client-mode beats for honest peers, a plain members value."""
    forged = OTHER.seal(
        HEARTBEATS.domain(RUN),
        Heartbeat(peer_id=PEER.peer_id, status="leaving", client_mode=True).encode(),
    )
    assert RULES.check(members_key(RUN), PEER.peer_id, forged, NOW + 10, NOW) is not None
    assert RULES.check(members_key(RUN), None, b"plain", NOW + 10, NOW) is not None
