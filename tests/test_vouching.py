"""Which downloaded states a replica may install (`roles.download.span_of`, `unvouched`):
the pure rule behind "no state without proof" (docs/security.md)."""

from __future__ import annotations

from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.download import span_of, unvouched


def record(round_id: int, synchronizer: str, contributors: tuple[str, ...] = (), tag: str = "h") -> RoundRecord:
    return RoundRecord(
        round=round_id, fragment=0, synchronizer=synchronizer, hash=f"{tag}{round_id}", parent=f"{tag}{round_id - 1}",
        digest=f"d{tag}{round_id}", contributors=tuple((c, 1.0, 1) for c in contributors), closed_at=0.0,
    )  # fmt: skip


def chain_of(*records: RoundRecord) -> dict[int, RoundRecord]:
    return {r.round: r for r in records}


def test_the_span_starts_at_the_first_round_this_replica_did_not_apply() -> None:
    chain = chain_of(*(record(r, "s") for r in range(6)))
    applied = {r: f"h{r}" for r in range(3)}
    assert [r.round for r in span_of(chain, applied)] == [3, 4, 5]
    assert span_of(chain, {r: f"h{r}" for r in range(6)}) == []


def test_a_joiner_with_nothing_skips_the_whole_chain() -> None:
    chain = chain_of(*(record(r, "s") for r in range(4, 9)))  # older records expired
    assert [r.round for r in span_of(chain, {})] == [4, 5, 6, 7, 8]


def test_a_replica_on_a_losing_branch_skips_from_where_it_left_the_chain() -> None:
    chain = chain_of(*(record(r, "s") for r in range(5)))
    applied = {0: "h0", 1: "h1", 2: "other2", 3: "other3"}
    assert [r.round for r in span_of(chain, applied)] == [2, 3, 4]


def test_after_a_download_the_rounds_below_it_are_not_skipped_again() -> None:
    chain = chain_of(*(record(r, "s") for r in range(10)))
    applied = {6: "h6"}  # a download at round 7 forgot the hashes before it
    assert [r.round for r in span_of(chain, applied)] == [7, 8, 9]


def test_a_span_signed_by_two_known_keys_is_taken_from_any_donor() -> None:
    span = [record(4, "a"), record(5, "b")]
    assert unvouched(span, "a", {"a", "b"}) == ""
    assert unvouched(span, "stranger", {"a", "b", "c"}) == ""


def test_one_keys_span_is_taken_only_from_a_known_donor_that_signed_none_of_it() -> None:
    span = [record(r, "attacker", ("sybil",)) for r in range(4, 14)]
    assert "signed every record" in unvouched(span, "attacker", {"attacker", "learner"})
    assert "named the donor" in unvouched(span, "sybil", {"attacker", "learner"})  # named by the span only
    assert unvouched(span, "learner", {"attacker", "learner"}) == ""


def test_an_empty_span_needs_a_known_donor() -> None:
    assert unvouched([], "learner", {"learner"}) == ""
    assert unvouched([], "stranger", {"learner"}) != ""


def test_a_second_signer_the_span_itself_named_does_not_count() -> None:
    """A key named once signs, then a free key it named as a contributor signs the next
    round: two signers, one of them known. Only a donor the replica knows may serve it."""
    span = [record(4, "attacker", ("sybil",)), record(5, "sybil", ("sybil",))]
    known = {"attacker", "learner"}
    assert unvouched(span, "sybil", known) != ""
    assert unvouched(span, "attacker", known) != ""
    assert unvouched(span, "learner", known) == ""
    assert unvouched(span, "stranger", set()) == ""  # knowing nobody (a joiner): the chain's state


def test_a_joiner_that_knows_nobody_takes_the_state_the_chain_names_from_any_donor() -> None:
    """A replica with nothing applied has no history to tie a state to (docs/security.md:
    what a joiner with nothing trusts); one key's span is taken even from its signer."""
    span = [record(r, "s") for r in range(3)]
    assert unvouched(span, "s", set()) == ""
