"""Round records and the canonical-chain rule (pure functions of `p2pdiloco.protocol.rounds`).

Every peer reads the same records from the DHT and must pick the same one update per
(round, fragment); these tests state that rule: the record format, what a decoder does
with junk, which stored records count, and how rivals, broken links, void updates and
expired early rounds shape the chain.
"""

from __future__ import annotations

import math
from dataclasses import replace as dataclasses_replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.identity import Identity
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.rounds import (
    FINALITY_DEPTH,
    MAX_LISTED_PEERS,
    MAX_RECORD_BYTES,
    SUPERSEDE_AFTER_S,
    UNPROVEN,
    RoundRecord,
    canonical_chain,
    decode_round_record,
    final_point,
    open_record,
    rank,
    record_standing,
    record_subkey,
    records_of,
    seal_record,
    skipped_on_chain,
    standing_key,
    superseded_digests,
)

RUN = "rounds-test"
GENESIS = "genesis-hash"
EXPIRES = 1e12
KEYS = [Identity.generate() for _ in range(4)]
SIGNER = {key.peer_id: key for key in KEYS}
A, B, C, D = (key.peer_id for key in KEYS)


def record(
    round_id: int,
    synchronizer: str,
    *,
    parent: str,
    hash: str,  # noqa: A002 - the field's name
    fragment: int = 0,
    digest: str | None = None,
    contributors: tuple[tuple[str, float, int], ...] = (),
) -> RoundRecord:
    return RoundRecord(
        round=round_id,
        fragment=fragment,
        synchronizer=synchronizer,
        hash=hash,
        parent=parent,
        digest=digest if digest is not None else f"digest-{round_id}-{synchronizer}",
        holders=("holder-1",),
        contributors=contributors,
        grace_s=0.25,
        closed_at=1700000000.5,
    )


def stored(*records: RoundRecord) -> dict[str, tuple[bytes, float]]:
    """DHT records as `transport.get` returns them, each under its own subkey."""
    return {record_subkey(r.round, r.synchronizer): (sealed(r), EXPIRES) for r in records}


def sealed(r: RoundRecord) -> bytes:
    return seal_record(SIGNER[r.synchronizer], RUN, r)


def ordered(round_id: int, *peers: str, fragment: int = 0) -> list[str]:
    """Peers best-ranked first for (round, fragment)."""
    return synchronizer_order(RUN, round_id, fragment, peers)


# --- the record format ------------------------------------------------------------------


def test_a_record_survives_encode_then_decode_field_for_field() -> None:
    original = RoundRecord(
        round=7,
        fragment=2,
        synchronizer="peer-a",
        hash="h7",
        parent="h6",
        digest="d7",
        holders=("peer-b", "peer-c"),
        contributors=(("peer-a", 0.25, 128), ("peer-b", 0.75, 384)),
        grace_s=0.5,
        closed_at=1700000123.25,
    )
    assert decode_round_record(original.encode()) == original
    assert decode_round_record(bytearray(original.encode())) == original


def test_a_record_naming_a_window_of_contributors_travels_compressed_and_a_bomb_is_not_a_record() -> None:
    """Every replica reads every record (more than once at N = 1,000): a record naming 50
    contributors, each with a base58 id and a hex digest, is sent zstd-compressed, about a
    quarter smaller; a zstd frame that declares more than a record may hold, or nothing,
    is not a record."""
    import hashlib

    import zstandard

    ids = [Identity.generate().peer_id for _ in range(50)]
    digests = [hashlib.sha256(p.encode()).hexdigest() for p in ids]
    window = dataclasses_replace(
        record(9, ids[0], parent="p", hash="h", contributors=tuple((p, 0.02, 1000 + i) for i, p in enumerate(ids))),
        contributions=tuple(digests), norms=tuple(0.5 for _ in ids),
    )  # fmt: skip
    raw = window.encode()
    assert raw[:4] == b"\x28\xb5\x2f\xfd" and len(raw) < 0.8 * len(window.packed())
    assert decode_round_record(raw) == window
    assert decode_round_record(raw[:-3]) is None  # truncated
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(b"\x00" * (MAX_RECORD_BYTES + 1))
    assert len(bomb) < 100 and decode_round_record(bomb) is None
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(window.packed())
    assert decode_round_record(unsized) is None


def test_the_record_of_a_full_window_fits_what_a_record_may_hold() -> None:
    """A window takes MAX_WINDOW_DELTAS deltas and a record names MAX_COMMIT_HOLDERS
    holders: the largest record a synchronizer can write (random ids and digests, which do
    not compress, the largest numbers, four certificates) still fits MAX_RECORD_BYTES,
    decodes, and opens once signed, so no window's round is unpublishable."""
    import secrets

    from p2pdiloco.config import MAX_COMMIT_HOLDERS, MAX_WINDOW_DELTAS

    ids = [Identity.generate() for _ in range(4)]
    base58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    peer = [
        "12D3KooW" + "".join(secrets.choice(base58) for _ in range(44))
        for _ in range(MAX_WINDOW_DELTAS + MAX_COMMIT_HOLDERS)
    ]
    digest = [secrets.token_hex(32) for _ in range(MAX_WINDOW_DELTAS)]
    full = RoundRecord(
        round=2**62, fragment=63, synchronizer=ids[0].peer_id, hash=secrets.token_hex(32),
        parent=secrets.token_hex(32), digest=secrets.token_hex(32),
        holders=tuple(peer[MAX_WINDOW_DELTAS:]),
        contributors=tuple((p, 1 / 3, 2**62) for p in peer[:MAX_WINDOW_DELTAS - 1]),
        contributions=tuple(digest[:-1]), norms=tuple(math.pi for _ in digest[:-1]),
        refused=(digest[-1],), history_from=2**62, grace_s=math.pi, closed_at=math.e * 1e9,
        certificates=tuple(secrets.token_bytes(1024) for _ in range(4)),
        supersedes=secrets.token_hex(32),
    )  # fmt: skip
    raw = full.encode()
    assert len(raw) <= MAX_RECORD_BYTES, f"{len(raw)} bytes"
    assert decode_round_record(raw) == full
    assert open_record("run", seal_record(ids[0], "run", full)) == full


def test_weight_of_names_the_merge_weight_of_a_contributor_or_none() -> None:
    r = record(0, "s", parent=GENESIS, hash="h", contributors=(("a", 0.4, 10), ("b", 0.6, 20)))
    assert r.weight_of("a") == 0.4
    assert r.weight_of("b") == 0.6
    assert r.weight_of("c") is None


names = st.text(min_size=0, max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False)
valid_records = st.builds(
    RoundRecord,
    round=st.integers(0, 2**63 - 1),
    fragment=st.integers(0, 2**63 - 1),
    synchronizer=names,
    hash=names,
    parent=names,
    digest=names,
    holders=st.lists(names, max_size=8).map(tuple),
    contributors=st.lists(
        st.tuples(names, finite, st.integers(0, 2**63 - 1)), max_size=8
    ).map(tuple),
    grace_s=finite,
    closed_at=finite,
)


@settings(max_examples=examples(200), deadline=None)
@given(valid_records)
def test_every_well_formed_record_round_trips(original: RoundRecord) -> None:
    assert decode_round_record(original.encode()) == original


def assert_well_formed(decoded: RoundRecord) -> None:
    """What a caller may rely on for any record the decoder returns."""
    assert isinstance(decoded, RoundRecord)
    for value in (decoded.round, decoded.fragment):
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0
    for value in (decoded.synchronizer, decoded.hash, decoded.parent, decoded.digest):
        assert isinstance(value, str)
    assert all(isinstance(p, str) for p in decoded.holders)
    assert len(decoded.holders) <= MAX_LISTED_PEERS
    assert len(decoded.contributors) <= MAX_LISTED_PEERS
    for peer, weight, tokens in decoded.contributors:
        assert isinstance(peer, str)
        assert isinstance(weight, float) and math.isfinite(weight)
        assert isinstance(tokens, int)
    assert math.isfinite(decoded.grace_s) and math.isfinite(decoded.closed_at)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=512))
def test_decoding_arbitrary_bytes_never_raises(raw: bytes) -> None:
    decoded = decode_round_record(raw)
    if decoded is not None:
        assert_well_formed(decoded)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()  # NaN and +-inf included
    | st.text(max_size=300)
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = (
    "round", "fragment", "synchronizer", "hash", "parent", "digest",
    "holders", "contributors", "grace_s", "closed_at",
)


HUGE = st.sampled_from([list(range(70000)), ["peer"] * 5000, [["p", 0.5, 1]] * 3000, "x" * 70000])


@settings(max_examples=examples(200), deadline=None)
@given(
    overrides=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values | HUGE, max_size=12),
    drop=st.sets(st.sampled_from(FIELDS), max_size=3),
)
def test_decoding_any_msgpack_map_never_raises_and_yields_only_well_formed_records(
    overrides: dict, drop: set[str]
) -> None:
    """Junk of every kind (wrong types, NaN and inf, huge lists) in any field."""
    data = {**valid_map(), **overrides}
    for name in drop:
        data.pop(name, None)
    decoded = decode_round_record(msgpack.packb(data, use_bin_type=True))
    if decoded is not None:
        assert_well_formed(decoded)


@settings(max_examples=examples(100), deadline=None)
@given(values)
def test_decoding_a_msgpack_value_that_is_not_a_map_yields_none(value: object) -> None:
    if isinstance(value, dict):
        value = [value]
    assert decode_round_record(msgpack.packb(value, use_bin_type=True)) is None


def valid_map() -> dict:
    return msgpack.unpackb(record(3, "s", parent="p", hash="h").packed(), raw=False)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round", -1),
        ("round", True),
        ("round", math.nan),
        ("round", math.inf),
        ("round", None),
        ("fragment", -2),
        ("fragment", math.inf),
        ("synchronizer", 5),
        ("synchronizer", b"bytes"),
        ("synchronizer", "x" * 257),
        ("hash", None),
        ("hash", ["h"]),
        ("parent", 1.5),
        ("digest", {"d": 1}),
        ("holders", [1, 2]),
        ("holders", {"a": 1}),
        ("contributors", [["a", math.nan, 1]]),
        ("contributors", [["a", math.inf, 1]]),
        ("contributors", [["a", 0.5]]),
        ("contributors", [[7, 0.5, 1]]),
        ("contributors", [["a", 0.5, math.inf]]),
        ("contributors", "abc"),
        ("contributors", None),
        ("grace_s", math.nan),
        ("grace_s", -math.inf),
        ("grace_s", None),
        ("closed_at", math.inf),
        ("closed_at", [1.0]),
    ],
)
def test_a_record_with_a_wrong_or_non_finite_field_is_not_a_record(field: str, value: object) -> None:
    data = valid_map()
    data[field] = value
    assert decode_round_record(msgpack.packb(data, use_bin_type=True)) is None


@pytest.mark.parametrize("missing", ["round", "fragment", "synchronizer", "hash", "contributors", "grace_s", "closed_at"])
def test_a_record_missing_a_required_field_is_not_a_record(missing: str) -> None:
    data = valid_map()
    del data[missing]
    assert decode_round_record(msgpack.packb(data, use_bin_type=True)) is None


COERCED = "decode_round_record coerces values of the wrong type with int()/float()/iteration"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round", "3"),  # a string accepted as round 3
        ("round", 1.5),  # a float truncated to round 1
        ("fragment", True),  # a bool accepted as fragment 1
        ("holders", "abc"),  # a string becomes the holders ('a', 'b', 'c')
        ("grace_s", "0.5"),  # a string accepted as a number
        ("contributors", [["a", "0.5", "2"]]),  # string weight and tokens accepted
        ("contributors", [["a", 0.5, 2.75]]),  # fractional tokens truncated to 2
    ],
)
def test_a_record_with_a_field_of_the_wrong_type_is_not_a_record(field: str, value: object) -> None:
    data = valid_map()
    data[field] = value
    assert decode_round_record(msgpack.packb(data, use_bin_type=True)) is None


def test_oversized_records_are_refused_unread() -> None:
    huge = record(0, "s", parent=GENESIS, hash="h", contributors=tuple((f"p{i}", 0.1, 1) for i in range(6000)))
    raw = huge.packed()
    assert len(raw) > MAX_RECORD_BYTES
    assert decode_round_record(raw) is None
    assert decode_round_record(huge.encode()) is None  # compressed under the limit: its map is not
    assert decode_round_record(msgpack.packb({**valid_map(), "holders": ["h"] * 70000})) is None


def test_a_record_listing_more_peers_than_allowed_is_refused_not_truncated() -> None:
    many = tuple((f"peer-{i}", 1.0 / 1100, 1) for i in range(MAX_LISTED_PEERS + 76))
    big = record(0, "s", parent=GENESIS, hash="h", contributors=many)
    raw = big.encode()
    assert len(raw) <= MAX_RECORD_BYTES
    assert decode_round_record(raw) in (big, None)


# --- which stored records count ---------------------------------------------------------


def test_records_of_keys_well_formed_records_by_round_and_synchronizer() -> None:
    a = record(0, A, parent=GENESIS, hash="ha")
    b = record(0, B, parent=GENESIS, hash="hb")
    c = record(1, A, parent="ha", hash="hc")
    assert records_of(RUN, stored(a, b, c), 0) == {(0, A): a, (0, B): b, (1, A): c}


def test_records_of_ignores_a_record_stored_under_another_subkey() -> None:
    genuine = record(0, A, parent=GENESIS, hash="ha")
    forged = record(0, B, parent=GENESIS, hash="hb")
    raw = {
        record_subkey(0, A): (sealed(genuine), EXPIRES),
        # b's record stored under a's round-1 slot, under another peer's name, or junk keys
        record_subkey(1, B): (sealed(forged), EXPIRES),
        record_subkey(0, C): (sealed(forged), EXPIRES),
        B: (sealed(forged), EXPIRES),
        "0": (sealed(forged), EXPIRES),
    }
    assert records_of(RUN, raw, 0) == {(0, A): genuine}


def test_records_of_ignores_unsigned_and_wrongly_signed_records() -> None:
    """A record in the name of A needs A's signature, for this run."""
    honest = record(0, A, parent=GENESIS, hash="ha")
    forged_by_b = KEYS[1].seal(f"round/{RUN}", honest.encode())
    other_run = seal_record(KEYS[0], "another-run", honest)
    for raw in (honest.encode(), forged_by_b, other_run):
        assert records_of(RUN, {record_subkey(0, A): (raw, EXPIRES)}, 0) == {}
        assert open_record(RUN, raw) is None
    assert open_record(RUN, sealed(honest)) == honest


def test_records_of_drops_records_of_synchronizers_the_run_does_not_entitle() -> None:
    a, b = record(0, A, parent=GENESIS, hash="ha"), record(0, B, parent=GENESIS, hash="hb")
    kept = records_of(RUN, stored(a, b), 0, entitled=lambda r: r.synchronizer == B)
    assert kept == {(0, B): b}


def test_records_of_ignores_records_of_another_fragment_and_junk() -> None:
    mine = record(0, A, parent=GENESIS, hash="ha", fragment=1)
    other = record(0, B, parent=GENESIS, hash="hb", fragment=2)
    raw = {
        **stored(mine, other),
        record_subkey(1, C): (b"\x00junk", EXPIRES),
        record_subkey(2, D): (msgpack.packb({"round": 2}), EXPIRES),
    }
    assert records_of(RUN, raw, 1) == {(0, A): mine}
    assert records_of(RUN, raw, 2) == {(0, B): other}
    assert records_of(RUN, raw, 0) == {}


# --- ranking ----------------------------------------------------------------------------


def test_the_better_ranked_record_is_the_one_whose_synchronizer_tops_the_rendezvous_order() -> None:
    peers = [f"peer-{i}" for i in range(6)]
    for round_id in range(4):
        best, *rest = ordered(round_id, *peers)
        top = record(round_id, best, parent="p", hash="h1")
        for other in rest:
            rival = record(round_id, other, parent="p", hash="h2")
            assert rank(RUN, top) < rank(RUN, rival)


# --- the canonical chain ----------------------------------------------------------------


def test_a_single_chain_is_followed_from_genesis_to_its_head() -> None:
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r1 = record(1, "b", parent="h0", hash="h1")
    r2 = record(2, "c", parent="h1", hash="h2")
    chain = canonical_chain(RUN, [r2, r0, r1], GENESIS)
    assert chain == {0: r0, 1: r1, 2: r2}
    assert canonical_chain(RUN, [], GENESIS) == {}


def test_of_two_rival_records_the_better_ranked_wins_and_the_chain_grows_only_from_it() -> None:
    winner_id, loser_id = ordered(0, "x", "y")
    winner = record(0, winner_id, parent=GENESIS, hash="h-win")
    loser = record(0, loser_id, parent=GENESIS, hash="h-lose")
    child_of_loser = record(1, "z", parent="h-lose", hash="h-lose-1")
    child_of_winner = record(1, "w", parent="h-win", hash="h-win-1")
    chain = canonical_chain(RUN, [loser, child_of_loser, winner], GENESIS)
    assert chain == {0: winner}  # the loser's child is not in the chain
    chain = canonical_chain(RUN, [loser, child_of_loser, winner, child_of_winner], GENESIS)
    assert chain == {0: winner, 1: child_of_winner}


def test_the_better_ranked_child_of_the_loser_does_not_outrank_the_winners_child() -> None:
    winner_id, loser_id = ordered(0, "x", "y")
    best_1, worst_1 = ordered(1, "u", "v")
    r0 = record(0, winner_id, parent=GENESIS, hash="h-win")
    rival0 = record(0, loser_id, parent=GENESIS, hash="h-lose")
    loser_child = record(1, best_1, parent="h-lose", hash="a")
    winner_child = record(1, worst_1, parent="h-win", hash="b")
    chain = canonical_chain(RUN, [loser_child, winner_child, rival0, r0], GENESIS)
    assert chain == {0: r0, 1: winner_child}


def test_a_record_whose_parent_matches_nothing_ends_the_chain_unless_its_own_reaches_further() -> None:
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r1 = record(1, "b", parent="h0", hash="h1")
    orphan = record(1, "c", parent="not-h0", hash="h1-orphan")
    assert canonical_chain(RUN, [r0, r1, orphan], GENESIS) == {0: r0, 1: r1}
    # the orphan starts a chain of its own, but one that ends no higher: the lowest start wins
    assert canonical_chain(RUN, [r0, orphan], GENESIS) == {0: r0}
    # at round 0 a record not built on genesis starts nothing
    assert canonical_chain(RUN, [record(0, "a", parent="elsewhere", hash="h0")], GENESIS) == {}


def test_after_a_gap_the_chain_goes_on_where_it_reaches_furthest() -> None:
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r2 = record(2, "c", parent="h1", hash="h2")
    r3 = record(3, "d", parent="h2", hash="h3")
    assert canonical_chain(RUN, [r0, r2, r3], GENESIS) == {2: r2, 3: r3}
    assert canonical_chain(RUN, [r0, r2], GENESIS) == {0: r0}  # a tie: the lowest start


def test_a_void_record_is_skipped_and_its_rival_wins() -> None:
    winner_id, loser_id = ordered(0, "x", "y")
    better = record(0, winner_id, parent=GENESIS, hash="h-better", digest="d-better")
    worse = record(0, loser_id, parent=GENESIS, hash="h-worse", digest="d-worse")
    child = record(1, "c", parent="h-worse", hash="h1")
    assert canonical_chain(RUN, [better, worse, child], GENESIS) == {0: better}
    assert canonical_chain(RUN, [better, worse, child], GENESIS, frozenset({"d-better"})) == {
        0: worse,
        1: child,
    }


def test_a_void_record_with_no_rival_ends_the_chain_before_its_round() -> None:
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r1 = record(1, "b", parent="h0", hash="h1", digest="d1")
    r2 = record(2, "c", parent="h1", hash="h2")
    r3 = record(3, "d", parent="h2", hash="h3")
    # what was built on a void update is no fresh start, however far it reaches
    assert canonical_chain(RUN, [r0, r1, r2, r3], GENESIS, frozenset({"d1"})) == {0: r0}


def test_when_early_rounds_expired_the_chain_starts_at_the_lowest_round_from_its_best_record() -> None:
    best, second = ordered(5, "x", "y")
    r5 = record(5, best, parent="h4", hash="h5")
    rival5 = record(5, second, parent="h4-other", hash="h5-other")
    r6 = record(6, "z", parent="h5", hash="h6")
    rival6 = record(6, "w", parent="h5-other", hash="h6-other")
    chain = canonical_chain(RUN, [rival6, r6, rival5, r5], GENESIS)
    assert chain == {5: r5, 6: r6}


def test_records_of_another_round_than_the_chain_needs_are_ignored() -> None:
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r1 = record(1, "c", parent="h0", hash="h1")
    stray = record(9, "b", parent="h0", hash="h9")
    assert canonical_chain(RUN, [r0, r1, stray], GENESIS) == {0: r0, 1: r1}


# --- the chain start: no rewind by one stray record (issue 28, item 5) --------------------


def honest_chain(first: int, last: int) -> list[RoundRecord]:
    """Records first..last of one linked chain whose records below `first` expired."""
    return [record(r, "s", parent=f"h{r - 1}", hash=f"h{r}") for r in range(first, last + 1)]


def test_a_record_below_the_real_start_does_not_truncate_the_chain() -> None:
    chain = honest_chain(10, 20)
    below = record(9, "attacker", parent="garbage", hash="h9-fake")
    assert max(canonical_chain(RUN, [*chain, below], GENESIS)) == 20
    assert min(canonical_chain(RUN, [*chain, below], GENESIS)) == 10
    # nor one above the head: a one-record chain never outgrows the real one
    above = record(21, "attacker", parent="garbage", hash="h21-fake")
    assert canonical_chain(RUN, [*chain, above], GENESIS) == {r.round: r for r in chain}
    # nor does a record at round 0 built on genesis once the real round 0 expired
    zero = record(0, "attacker", parent=GENESIS, hash="h0-fake")
    assert canonical_chain(RUN, [*chain, zero], GENESIS) == {r.round: r for r in chain}


def test_a_replica_anchored_on_what_it_applied_is_not_led_off_by_a_longer_forged_chain() -> None:
    honest = honest_chain(13, 20)  # round 12 and below expired
    forged = [record(r, "f", parent=f"x{r - 1}", hash=f"x{r}") for r in range(30, 46)]
    assert min(canonical_chain(RUN, [*honest, *forged], GENESIS)) == 30  # a joiner: the longer
    # a replica that applied round 12 counts its chain from round 0: the forger needs more
    # records than the head round
    assert canonical_chain(RUN, [*honest, *forged], GENESIS, anchor=(12, "h12")) == {r.round: r for r in honest}
    # and one whose last round is still in the DHT, through it
    assert canonical_chain(RUN, [*honest, *forged], GENESIS, anchor=(15, "h15")) == {r.round: r for r in honest}
    assert canonical_chain(RUN, honest, GENESIS, anchor=(3, "nowhere")) == {r.round: r for r in honest}


def test_an_anchor_on_a_losing_branch_does_not_keep_a_replica_there() -> None:
    winner_id, loser_id = ordered(5, A, B)
    base = honest_chain(3, 4)
    won = record(5, winner_id, parent="h4", hash="h5")
    lost = record(5, loser_id, parent="h4", hash="l5")
    on_won = [record(6, C, parent="h5", hash="h6")]
    on_lost = [record(r, C, parent=f"l{r - 1}", hash=f"l{r}") for r in range(6, 9)]
    everyone = canonical_chain(RUN, [*base, won, lost, *on_won, *on_lost], GENESIS)
    assert everyone[5] == won
    assert canonical_chain(RUN, [*base, won, lost, *on_won, *on_lost], GENESIS, anchor=(5, "l5")) == everyone


# --- supersession: a re-run instead of a local void (issue 28, item 4) --------------------


def timed(round_id: int, synchronizer: str, closed_at: float, **fields) -> RoundRecord:
    import dataclasses

    return dataclasses.replace(record(round_id, synchronizer, **fields), closed_at=closed_at)


def test_a_rerun_supersedes_a_record_nobody_built_on_once_old_enough_by_signed_times() -> None:
    winner_id, loser_id = ordered(3, A, B)
    lost = timed(3, winner_id, 1000.0, parent="h2", hash="h3-lost", digest="d-lost")
    rerun = timed(3, loser_id, 1000.0 + 60, parent="h2", hash="h3", digest="d-rerun")
    rerun = dataclasses_replace(rerun, supersedes="d-lost")
    base = [timed(2, C, 990.0, parent="h1", hash="h2", contributors=((D, 1.0, 1),))]  # D merged before
    # without supersession the better-ranked original wins
    assert canonical_chain(RUN, [*base, lost, dataclasses_replace(rerun, supersedes="")], GENESIS)[3] == lost
    assert canonical_chain(RUN, [*base, lost, rerun], GENESIS, supersede_after_s=60)[3] == rerun
    # too early by the records' own times: not superseded
    early = dataclasses_replace(rerun, closed_at=1000.0 + 59)
    assert canonical_chain(RUN, [*base, lost, early], GENESIS, supersede_after_s=60)[3] == lost
    # a record of the next round built on the original before the re-run closed: it stays
    child = timed(4, D, 1000.0 + 30, parent="h3-lost", hash="h4")
    assert canonical_chain(RUN, [*base, lost, rerun, child], GENESIS, supersede_after_s=60) == {
        2: base[0], 3: lost, 4: child
    }
    # a child closed after the re-run does not save it: it goes with its parent
    late_child = timed(4, D, 1000.0 + 90, parent="h3-lost", hash="h4")
    chain = canonical_chain(RUN, [*base, lost, rerun, late_child], GENESIS, supersede_after_s=60)
    assert chain == {2: base[0], 3: rerun}


def test_children_by_the_records_own_signer_or_a_key_it_named_do_not_keep_it_from_a_rerun() -> None:
    """An original whose update exists nowhere, built on by its own signer and by a free
    key it named (records it signs at once, so they close before any re-run): the re-run
    still supersedes it. A child by a peer the ancestry named (one that applied it) keeps it."""
    winner_id, loser_id = ordered(3, A, B)
    base = [timed(2, C, 990.0, parent="h1", hash="h2", contributors=((D, 1.0, 1),))]
    lost = timed(3, winner_id, 1000.0, parent="h2", hash="h3-lost", digest="d-lost",
                 contributors=(("free-key-it-named", 1.0, 1),))
    rerun = dataclasses_replace(timed(3, loser_id, 1060.0, parent="h2", hash="h3", digest="d-r"), supersedes="d-lost")
    own_child = timed(4, winner_id, 1001.0, parent="h3-lost", hash="h4")
    named_child = timed(4, "free-key-it-named", 1002.0, parent="h3-lost", hash="h4e")
    assert superseded_digests([*base, lost, rerun, own_child, named_child], 60) == {"d-lost"}
    independent = timed(4, D, 1003.0, parent="h3-lost", hash="h4d")
    assert superseded_digests([*base, lost, rerun, independent], 60) == frozenset()


def test_a_rerun_naming_a_record_of_another_parent_or_round_supersedes_nothing() -> None:
    lost = timed(3, A, 1000.0, parent="h2", hash="h3-lost", digest="d-lost")
    other_parent = dataclasses_replace(timed(3, B, 2000.0, parent="elsewhere", hash="y"), supersedes="d-lost")
    other_round = dataclasses_replace(timed(4, B, 2000.0, parent="h3-lost", hash="z"), supersedes="d-lost")
    assert superseded_digests([lost, other_parent, other_round], 60) == frozenset()
    own = dataclasses_replace(timed(3, B, 2000.0, parent="h2", hash="w", digest="d-w"), supersedes="d-w")
    assert superseded_digests([own], 60) == frozenset()


def test_supersedes_is_signed_and_survives_the_wire() -> None:
    original = dataclasses_replace(record(3, A, parent="p", hash="h"), supersedes="d-old")
    opened = open_record(RUN, sealed(original))
    assert opened is not None and opened.supersedes == "d-old"
    plain = record(3, A, parent="p", hash="h")
    assert b"supersedes" not in plain.encode()  # records that supersede nothing keep their bytes


# --- the rule does not depend on the order records are read in -------------------------

HASHES = [GENESIS, "h1", "h2", "h3", "h4", "h5"]
SYNCHRONIZERS = [A, B, C, D]


@st.composite
def record_sets(draw) -> list[RoundRecord]:
    keys = draw(
        st.sets(st.tuples(st.integers(0, 4), st.sampled_from(SYNCHRONIZERS)), max_size=14)
    )
    out = []
    for round_id, synchronizer in sorted(keys):
        out.append(
            record(
                round_id,
                synchronizer,
                parent=draw(st.sampled_from(HASHES)),
                hash=draw(st.sampled_from(HASHES[1:])),
                digest=f"d-{round_id}-{synchronizer}",
            )
        )
    return out


@settings(max_examples=examples(300), deadline=None)
@given(records=record_sets(), data=st.data())
def test_the_chain_is_independent_of_input_order_and_well_linked(records: list[RoundRecord], data) -> None:
    void = frozenset(data.draw(st.sets(st.sampled_from([r.digest for r in records] or ["none"]))))
    chain = canonical_chain(RUN, records, GENESIS, void)
    shuffled = data.draw(st.permutations(records))
    assert canonical_chain(RUN, shuffled, GENESIS, void) == chain
    assert canonical_chain(RUN, reversed(records), GENESIS, void) == chain
    # the same chain when read from the DHT through records_of
    assert canonical_chain(RUN, records_of(RUN, stored(*shuffled), 0).values(), GENESIS, void) == chain
    if not chain:
        return
    rounds = sorted(chain)
    assert rounds == list(range(rounds[0], rounds[0] + len(rounds)))
    live = [r for r in records if r.digest not in void]
    # the start: never a shorter chain than the walk from genesis
    parent, walked = GENESIS, 0
    while rivals := [r for r in live if r.round == walked and r.parent == parent]:
        parent, walked = min(rivals, key=lambda r: rank(RUN, r)).hash, walked + 1
    assert len(chain) >= walked
    for round_id in rounds:
        chosen = chain[round_id]
        assert chosen.round == round_id and chosen.digest not in void
        if round_id == 0:
            parent = GENESIS
        elif round_id - 1 in chain:
            parent = chain[round_id - 1].hash
        else:
            parent = None  # the first round present after expired ones
        if parent is not None:
            assert chosen.parent == parent
        rivals = [r for r in live if r.round == round_id and (parent is None or r.parent == parent)]
        assert chosen == min(rivals, key=lambda r: rank(RUN, r))
    after = rounds[-1] + 1
    assert not [r for r in live if r.round == after and r.parent == chain[rounds[-1]].hash]


# --- issue 28: in an open run, a record counts only if its ancestry named its synchronizer


def _open_chain(rounds: int, closed_at: float = 1000.0) -> list[RoundRecord]:
    """Rounds 0..rounds-1 synchronized by A and B in turn, each with both as contributors."""
    out, parent = [], GENESIS
    for r in range(rounds):
        sync = (A, B)[r % 2]
        out.append(
            dataclasses_replace(
                record(r, sync, parent=parent, hash=f"h{r}", contributors=((A, 1.0, 10), (B, 1.0, 10))),
                closed_at=closed_at + 5 * r,
            )
        )
        parent = f"h{r}"
    return out


def _outranking(round_id: int, rivals: list[str]) -> Identity:
    """A fresh key that out-ranks every peer in `rivals` for (round, fragment 0): ground,
    as an attacker with patience would."""
    while True:
        key = Identity.generate()
        if synchronizer_order(RUN, round_id, 0, [key.peer_id, *rivals])[0] == key.peer_id:
            return key


def test_a_strangers_outranking_record_for_the_next_round_is_skipped_in_an_open_run() -> None:
    honest = _open_chain(6)
    stranger = _outranking(6, [A, B])
    SIGNER[stranger.peer_id] = stranger
    forged = dataclasses_replace(
        record(6, stranger.peer_id, parent="h5", hash="forged-6", contributors=((stranger.peer_id, 1.0, 10),)),
        closed_at=honest[-1].closed_at + 5,
    )
    rival = dataclasses_replace(
        record(6, A, parent="h5", hash="h6", contributors=((A, 1.0, 10),)), closed_at=honest[-1].closed_at + 5
    )
    records = [*honest, forged, rival]
    # the old rule (and a certified run, where certificates decide): the best rank wins
    assert canonical_chain(RUN, records, GENESIS)[6].synchronizer == stranger.peer_id
    chain = canonical_chain(RUN, records, GENESIS, open_run=True)
    assert chain[6] == rival and max(chain) == 6
    assert record_standing(records)[standing_key(forged)] == UNPROVEN


def test_a_copied_digest_does_not_share_an_honest_records_fate() -> None:
    honest = _open_chain(3)
    stranger = Identity.generate()
    copy = dataclasses_replace(honest[2], synchronizer=stranger.peer_id, hash="other")
    chain = canonical_chain(RUN, [*honest, copy], GENESIS, open_run=True)
    assert chain[2] == honest[2]


def test_a_contributor_the_chain_named_may_synchronize_and_a_stalled_run_may_be_taken_over() -> None:
    honest = _open_chain(4)
    c_named = dataclasses_replace(
        honest[3], contributors=((A, 1.0, 10), (C, 1.0, 10)), digest="d3c"
    )
    honest[3] = c_named
    by_c = dataclasses_replace(record(4, C, parent="h3", hash="h4"), closed_at=honest[3].closed_at + 5)
    assert canonical_chain(RUN, [*honest, by_c], GENESIS, open_run=True)[4] == by_c
    # D was never named: too soon after round 3, skipped; once the chain stalled, taken over
    soon = dataclasses_replace(record(4, D, parent="h3", hash="h4d"), closed_at=honest[3].closed_at + 5)
    late = dataclasses_replace(soon, closed_at=honest[3].closed_at + 2 * SUPERSEDE_AFTER_S + 1)
    assert 4 not in canonical_chain(RUN, [*honest, soon], GENESIS, open_run=True)
    assert canonical_chain(RUN, [*honest, late], GENESIS, open_run=True)[4] == late
    # ... but a named rival of the same round wins over a takeover whatever their ranks
    assert canonical_chain(RUN, [*honest, late, by_c], GENESIS, open_run=True)[4] == by_c


def test_the_remembered_chain_is_a_copy_and_follows_new_records() -> None:
    """`canonical_chain` remembers its answer for inputs it saw (a sync pass between two
    rounds reads the same records); the caller's copy is its own, and one more record is a
    new input, never the remembered answer."""
    r0 = record(0, "a", parent=GENESIS, hash="h0")
    r1 = record(1, "b", parent="h0", hash="h1", contributors=(("c", 1.0, 64), ("d", 1.0, 64)))
    first = canonical_chain(RUN, [r0], GENESIS)
    first.clear()
    assert canonical_chain(RUN, [r0], GENESIS) == {0: r0}
    assert canonical_chain(RUN, [r0, r1], GENESIS) == {0: r0, 1: r1}
    assert r1.named == frozenset({"b", "c", "d"})


def test_a_synchronizer_the_chain_never_named_would_commit_a_record_every_other_peer_skips() -> None:
    """In an open run, a failover window at a peer no record of the chain names (C: not a
    synchronizer, contributor or holder of rounds 0-5) makes an UNPROVEN record: every
    other peer skips it, so its synchronizer, installing it alone, applied a round nobody
    else did (the simulator's forks at M = 100, quorum 10: the better-placed synchronizer
    committed the round later, and the lone replica repaired). `Committer.publish` now
    refuses it. A named peer's record, a takeover after a long stall and a first round
    stay committable."""
    chain = _open_chain(6)
    closed = chain[-1].closed_at + 5
    stranger = dataclasses_replace(record(6, C, parent="h5", hash="c6", contributors=((C, 1.0, 10),)), closed_at=closed)
    named = dataclasses_replace(record(6, A, parent="h5", hash="a6", contributors=((C, 1.0, 10),)), closed_at=closed)
    takeover = dataclasses_replace(stranger, closed_at=chain[-1].closed_at + 2 * SUPERSEDE_AFTER_S + 1)
    first = record(0, C, parent=GENESIS, hash="c0")
    assert skipped_on_chain(chain, stranger)
    assert not skipped_on_chain(chain, named)
    assert not skipped_on_chain(chain, takeover)
    assert not skipped_on_chain([], first)
    # what the other peers' canonical rules do with it: skip it, as the check predicts
    assert 6 not in canonical_chain(RUN, [*chain, stranger], GENESIS, open_run=True)


# --- finality: no record at or below a final round moves a replica ---------------------


def test_a_round_is_final_once_the_replica_applied_finality_depth_rounds_on_it() -> None:
    applied = {r: f"h{r}" for r in range(10)}
    assert final_point(applied) == (9 - FINALITY_DEPTH, f"h{9 - FINALITY_DEPTH}")
    assert final_point({r: f"h{r}" for r in range(FINALITY_DEPTH)}) is None  # not deep enough yet
    assert final_point({}) is None
    # a download forgets the rounds before it: nothing is final on its own again
    assert final_point({7: "h7"}) is None
    assert final_point({5: "h5", 6: "h6", 8: "h8", 9: "h9"}, depth=3) is None  # a gap


def _late_rival_of(honest: list[RoundRecord], round_id: int, attacker: Identity) -> RoundRecord:
    """What an attacker the chain named once signs: a record for an old round, with the
    right parent, a current close time and a key ground to out-rank the committed one."""
    return dataclasses_replace(
        record(round_id, attacker.peer_id, parent=f"h{round_id - 1}", hash=f"forged-{round_id}"),
        closed_at=honest[-1].closed_at + 5,
    )


def test_a_late_outranking_rival_of_a_final_round_changes_nothing_a_replica_follows() -> None:
    honest = _open_chain(9)
    attacker = _outranking(2, [honest[2].synchronizer])
    SIGNER[attacker.peer_id] = attacker
    honest[1] = dataclasses_replace(honest[1], contributors=((A, 1.0, 10), (attacker.peer_id, 1.0, 10)))
    rival = _late_rival_of(honest, 2, attacker)
    records = [*honest, rival]
    # the rule by rank alone: every replica would drop rounds 3-8 and follow the rival
    assert canonical_chain(RUN, records, GENESIS, open_run=True) == {0: honest[0], 1: honest[1], 2: rival}
    # a replica that applied rounds 0-8 holds round 8 - FINALITY_DEPTH final: its chain is
    # the one it built, whatever the rival's rank or close time
    final = final_point({r.round: r.hash for r in honest})
    assert final is not None and final[0] >= 2
    kept = canonical_chain(RUN, records, GENESIS, open_run=True, final=final)
    assert kept == {r.round: r for r in honest}
    # a rival of a round above the final one is still settled by rank, as by every peer
    late = _late_rival_of(honest, 8, attacker)
    follows = canonical_chain(RUN, [*honest, late], GENESIS, open_run=True, final=final)
    assert follows[8] == min(late, honest[8], key=lambda r: rank(RUN, r))


def test_a_longer_chain_that_does_not_pass_through_the_final_round_is_not_followed() -> None:
    honest = honest_chain(13, 20)  # rounds below 13 expired
    # an "expired past": self-signed records from above the head, more of them than its round
    forged = [record(r, "f", parent=f"x{r - 1}", hash=f"x{r}") for r in range(21, 60)]
    assert min(canonical_chain(RUN, [*honest, *forged], GENESIS, anchor=(20, "h20"))) == 21  # it outgrew
    final = (20 - FINALITY_DEPTH, f"h{20 - FINALITY_DEPTH}")
    assert canonical_chain(RUN, [*honest, *forged], GENESIS, anchor=(20, "h20"), final=final) == {
        r.round: r for r in honest
    }


def test_past_a_final_round_whose_records_expired_the_usual_rules_choose_above_it() -> None:
    """A stop longer than the records' lifetime: nothing leads on from the final hash any
    more; the rules choose among the records past it, and none at or below it counts."""
    later = honest_chain(30, 34)
    below = record(10, "attacker", parent="h9", hash="forged-10")
    chain = canonical_chain(RUN, [*later, below], GENESIS, final=(12, "h12"))
    assert chain == {r.round: r for r in later}
