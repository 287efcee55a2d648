"""The life of one (round, fragment) window as a pure state machine (`windows.WindowMachine`).

Time is passed in as `now`: wait for quorum, then the grace of Eq. 3, then close; close
at once when everyone expected has arrived; move to a better-placed synchronizer only
while there is no quorum; expire at the deadline; once closing, refuse every delta.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.protocol.window_rules import RECHECK_S, Close, Expire, Move, Wait, WindowMachine

OPENED = 100.0
DEADLINE_S = 30.0
MAX_GRACE_S = 5.0


def machine(min_quorum: int = 2, **kwargs) -> WindowMachine:
    return WindowMachine(
        round=3, fragment=1, opened_at=OPENED, deadline_s=DEADLINE_S, min_quorum=min_quorum, **kwargs
    )


def act(
    m: WindowMachine,
    now: float,
    expected: set[str] = frozenset({"a", "b", "c", "d"}),
    better_placed: str | None = None,
    step_time_s: float = 1.0,
    sync_time_s: float = 0.0,
):
    """next_action with tau = 2 overlapped steps and gamma = 0.5 (so grace = step - quorum time)."""
    return m.next_action(
        now,
        expected=set(expected),
        better_placed=better_placed,
        step_time_s=step_time_s,
        sync_time_s=sync_time_s,
        overlap_steps=2,
        gamma=0.5,
        max_grace_s=MAX_GRACE_S,
    )


def test_an_empty_window_waits_and_rechecks_the_membership_every_recheck_interval() -> None:
    m = machine()
    assert act(m, OPENED) == Wait(OPENED + RECHECK_S)
    assert act(m, OPENED + 10) == Wait(OPENED + 10 + RECHECK_S)
    assert m.quorum_at is None and not m.closing


def test_quorum_then_the_grace_window_then_close() -> None:
    m = machine(min_quorum=2)
    assert m.accept("a", 100, 10, 1.0, OPENED + 0.1) is None
    assert isinstance(act(m, OPENED + 0.1), Wait)
    assert m.quorum_at is None
    assert m.accept("b", 100, 10, 1.0, OPENED + 0.5) is None
    # quorum at +0.5 s: grace = 0.5 * (2 * 1.0 - 0.5) = 0.75 s
    assert act(m, OPENED + 0.5) == Wait(OPENED + 0.5 + 0.75)
    assert m.quorum_at == OPENED + 0.5
    assert m.grace_s == pytest.approx(0.75)
    assert not m.closing
    assert isinstance(act(m, OPENED + 1.0), Wait)
    assert m.accept("c", 100, 10, 1.0, OPENED + 1.1) is None  # a straggler inside the grace
    assert act(m, OPENED + 1.25) == Close(pytest.approx(0.75))
    assert m.closing
    assert set(m.arrivals) == {"a", "b", "c"}


def test_the_grace_window_is_bounded_by_max_grace() -> None:
    m = machine(min_quorum=1)
    m.accept("a", 100, 10, 100.0, OPENED)
    assert act(m, OPENED, step_time_s=100.0) == Wait(OPENED + RECHECK_S)
    assert m.grace_s == MAX_GRACE_S
    assert isinstance(act(m, OPENED + MAX_GRACE_S - 0.01, step_time_s=100.0), Wait)
    assert act(m, OPENED + MAX_GRACE_S, step_time_s=100.0) == Close(MAX_GRACE_S)


def test_close_at_once_when_everyone_expected_has_arrived() -> None:
    m = machine(min_quorum=2)
    m.accept("a", 100, 10, 1.0, OPENED)
    m.accept("b", 100, 10, 1.0, OPENED)
    assert act(m, OPENED, expected={"a", "b"}, step_time_s=10.0) == Close(MAX_GRACE_S)
    assert m.closing


def test_the_expected_set_counts_those_who_arrived_even_if_the_membership_forgot_them() -> None:
    m = machine(min_quorum=2)
    m.accept("a", 100, 10, 1.0, OPENED)
    m.accept("gone", 100, 10, 1.0, OPENED)
    # "gone" is no longer in the membership, "b" still is: not everyone arrived
    assert isinstance(act(m, OPENED, expected={"a", "b"}, step_time_s=10.0), Wait)
    m2 = machine(min_quorum=2)
    m2.accept("a", 100, 10, 1.0, OPENED)
    m2.accept("gone", 100, 10, 1.0, OPENED)
    assert isinstance(act(m2, OPENED, expected={"a"}, step_time_s=10.0), Close)


def test_everyone_arrived_but_no_quorum_does_not_close() -> None:
    m = machine(min_quorum=3)
    m.accept("a", 100, 10, 1.0, OPENED)
    m.accept("b", 100, 10, 1.0, OPENED)
    assert isinstance(act(m, OPENED + 1, expected={"a", "b"}), Wait)
    assert act(m, OPENED + DEADLINE_S, expected={"a", "b"}) == Expire(
        "2 of 3 learners before the deadline"
    )


def test_the_token_fraction_is_part_of_the_quorum() -> None:
    m = machine(min_quorum=1, min_token_fraction=0.5)
    m.accept("a", 100, 10, 1.0, OPENED)
    # 1 of 4 expected learners: 100 tokens of an expected 400 < 50 %
    assert isinstance(act(m, OPENED + 1), Wait)
    assert m.quorum_at is None
    m.accept("b", 100, 10, 1.0, OPENED + 2)
    act(m, OPENED + 2)
    assert m.quorum_at == OPENED + 2


def test_no_quorum_and_a_better_placed_synchronizer_moves_the_window() -> None:
    m = machine(min_quorum=2)
    m.accept("a", 100, 10, 1.0, OPENED)
    assert act(m, OPENED + 1, better_placed="top") == Move("top")
    assert m.closing
    assert m.accept("b", 100, 10, 1.0, OPENED + 1) == "window is closing"


def test_an_empty_window_moves_too() -> None:
    assert act(machine(), OPENED, better_placed="top") == Move("top")


def test_a_window_with_quorum_never_moves() -> None:
    m = machine(min_quorum=1)
    m.accept("a", 100, 10, 1.0, OPENED)
    action = act(m, OPENED, better_placed="top", step_time_s=10.0)
    assert isinstance(action, Wait)
    for now in (OPENED + 0.5, OPENED + 2, OPENED + 4.9):
        assert isinstance(act(m, now, better_placed="top", step_time_s=10.0), Wait)
    assert isinstance(act(m, OPENED + 5, better_placed="top", step_time_s=10.0), Close)


def test_the_deadline_expires_a_window_without_quorum() -> None:
    m = machine(min_quorum=2)
    m.accept("a", 100, 10, 1.0, OPENED)
    assert isinstance(act(m, OPENED + DEADLINE_S - 0.001), Wait)
    assert act(m, OPENED + DEADLINE_S) == Expire("1 of 2 learners before the deadline")
    assert m.closing
    assert m.accept("b", 100, 10, 1.0, OPENED + DEADLINE_S) == "window is closing"


def test_the_last_wait_before_the_deadline_ends_at_the_deadline() -> None:
    m = machine(min_quorum=2)
    assert act(m, OPENED + DEADLINE_S - 0.25) == Wait(OPENED + DEADLINE_S)


def test_accept_refuses_a_second_delta_from_one_peer() -> None:
    m = machine()
    assert m.accept("a", 100, 10, 1.0, OPENED) is None
    assert m.accept("a", 999, 99, 1.0, OPENED + 1) == "already contributed to this window"
    assert m.arrivals["a"].tokens == 100


def test_a_delta_arriving_during_the_merge_is_refused_not_dropped() -> None:
    m = machine(min_quorum=1)
    m.accept("a", 100, 10, 1.0, OPENED)
    assert isinstance(act(m, OPENED, expected={"a"}), Close)
    # the merge has started: a latecomer is told so, and is not counted
    assert m.accept("late", 100, 10, 1.0, OPENED + 0.1) == "window is closing"
    assert m.accept("a", 100, 10, 1.0, OPENED + 0.1) == "window is closing"
    assert set(m.arrivals) == {"a"}


def test_a_full_window_takes_no_more_and_closes_before_its_grace() -> None:
    """The `max_arrivals`-th delta closes the window to further deltas, and the next
    action closes it though learners are still expected and the grace has not passed."""
    m = machine(min_quorum=1, max_arrivals=3)
    expected = {"a", "b", "c", "d", "e"}
    assert m.accept("a", 100, 10, 100.0, OPENED) is None
    assert isinstance(act(m, OPENED, expected=expected, step_time_s=100.0), Wait)
    assert m.grace_s == MAX_GRACE_S
    assert m.accept("b", 100, 10, 100.0, OPENED + 0.1) is None and not m.closing
    assert m.accept("c", 100, 10, 100.0, OPENED + 0.2) is None and m.closing and m.full
    assert m.accept("d", 100, 10, 100.0, OPENED + 0.3) == "window is closing"
    assert act(m, OPENED + 0.3, expected=expected, step_time_s=100.0) == Close(MAX_GRACE_S)
    assert set(m.arrivals) == {"a", "b", "c"}


def test_the_default_window_size_is_what_a_record_can_name() -> None:
    from p2pdiloco.config import MAX_WINDOW_DELTAS

    assert machine().max_arrivals == MAX_WINDOW_DELTAS


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
def test_a_non_finite_or_negative_claimed_step_time_is_taken_as_zero(bad: float) -> None:
    m = machine(min_quorum=2)
    assert m.accept("a", 100, 10, bad, OPENED) is None
    assert m.arrivals["a"].step_time_s == 0.0
    m.accept("b", 100, 10, 1.0, OPENED)
    claimed = max(a.step_time_s for a in m.arrivals.values())
    action = act(m, OPENED, step_time_s=claimed)
    assert math.isfinite(m.grace_s) and 0.0 <= m.grace_s <= MAX_GRACE_S
    assert isinstance(action, Wait) and math.isfinite(action.until)
    assert act(m, OPENED + m.grace_s) == Close(m.grace_s)


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_an_infinite_observed_step_time_gives_a_bounded_grace(bad: float) -> None:
    m = machine(min_quorum=1)
    m.accept("a", 100, 10, 1.0, OPENED)
    action = act(m, OPENED, step_time_s=bad)
    assert m.grace_s == (MAX_GRACE_S if bad > 0 else 0.0)
    assert action == (Wait(OPENED + RECHECK_S) if bad > 0 else Close(0.0))


@pytest.mark.parametrize("field", ["step_time_s", "sync_time_s"])
def test_a_nan_observed_time_does_not_poison_the_grace_or_the_wait(field: str) -> None:
    m = machine(min_quorum=1)
    m.accept("a", 100, 10, 1.0, OPENED)
    action = act(m, OPENED, **{field: math.nan})
    # an unknowable slack leaves no room to wait in (Eq. 3): close at quorum, never hang
    assert m.grace_s == 0.0
    assert action == Close(0.0)


# --- invariants over any sequence of events ---------------------------------------------

events = st.lists(
    st.tuples(
        st.floats(0.0, 5.0),  # time since the last event
        st.sampled_from(["a", "b", "c", "d", None]),  # who contributes (None: nobody)
        st.sampled_from([None, None, "top"]),  # better-placed synchronizer in the view
        st.sampled_from([0.0, 0.5, 2.0, 10.0, math.inf, -math.inf]),  # observed step time
        st.integers(0, 500),  # tokens
    ),
    max_size=30,
)


@settings(max_examples=examples(300), deadline=None)
@given(min_quorum=st.integers(1, 4), token_fraction=st.sampled_from([0.0, 0.5]), script=events)
def test_any_history_waits_boundedly_and_ends_at_most_once(min_quorum, token_fraction, script) -> None:
    m = machine(min_quorum=min_quorum, min_token_fraction=token_fraction)
    now, ended, frozen = OPENED, None, {}
    expected = {"a", "b", "c", "d"}
    for gap, peer, better, step_time, tokens in script:
        now += gap
        if peer is not None:
            refusal = m.accept(peer, tokens, 1, step_time, now)
            if ended is not None:
                assert refusal == "window is closing"
                assert m.arrivals == frozen  # refused, and nothing changed
        if ended is not None:
            continue
        had_quorum = m.quorum_at is not None
        action = act(m, now, expected=expected, better_placed=better, step_time_s=step_time)
        if isinstance(action, Wait):
            assert now < action.until <= now + RECHECK_S
            assert not m.closing
            continue
        assert m.closing
        ended, frozen = action, dict(m.arrivals)
        if isinstance(action, Move):
            assert not had_quorum and m.quorum_at is None and better == "top"
        elif isinstance(action, Expire):
            assert m.quorum_at is None and now >= OPENED + DEADLINE_S
        else:
            assert isinstance(action, Close)
            assert m.quorum_at is not None and len(m.arrivals) >= min_quorum
            assert math.isfinite(action.grace_s) and 0.0 <= action.grace_s <= MAX_GRACE_S
            everyone = expected <= set(m.arrivals)
            assert everyone or now >= m.quorum_at + m.grace_s
    if m.quorum_at is not None:
        assert OPENED <= m.quorum_at <= now
