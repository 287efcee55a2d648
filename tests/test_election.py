"""Election: every peer computes the same synchronizer; the role rotates and spreads."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.protocol.election import synchronizer_order

PEERS = [f"12D3KooPeer{i}" for i in range(6)]


def top(run: str, round_id: int, fragment: int, peers: list[str]) -> str | None:
    """The elected synchronizer: the head of the rendezvous order (None: nobody)."""
    order = synchronizer_order(run, round_id, fragment, peers)
    return order[0] if order else None


@settings(max_examples=examples(100), deadline=None)
@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=32),
    st.permutations(PEERS),
)
def test_order_does_not_depend_on_how_members_are_listed(round_id, fragment, peers) -> None:
    assert synchronizer_order("run", round_id, fragment, peers) == synchronizer_order(
        "run", round_id, fragment, PEERS
    )


def test_role_rotates_over_rounds_and_spreads_over_fragments() -> None:
    by_round = Counter(top("run", r, 0, PEERS) for r in range(600))
    assert set(by_round) == set(PEERS) and min(by_round.values()) > 60
    by_fragment = {top("run", 7, f, PEERS) for f in range(24)}
    assert len(by_fragment) >= 4


def test_a_leaving_peer_only_moves_its_own_rounds() -> None:
    before = {r: top("run", r, 0, PEERS) for r in range(300)}
    gone = PEERS[2]
    after = {
        r: top("run", r, 0, [p for p in PEERS if p != gone]) for r in range(300)
    }
    for r in before:
        if before[r] != gone:
            assert after[r] == before[r]
        else:
            # failover: the next in the old order takes over
            assert after[r] == synchronizer_order("run", r, 0, PEERS)[1]


def test_runs_are_independent_and_empty_membership_elects_nobody() -> None:
    a = [top("a", r, 0, PEERS) for r in range(50)]
    b = [top("b", r, 0, PEERS) for r in range(50)]
    assert a != b
    assert top("a", 0, 0, []) is None
