"""Global state: ordered updates, identical replicas, hashes, export and import."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.outer.fragment_state import outer_update
from p2pdiloco.roles.state import GlobalState


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4, 3, generator=g),
        "b": torch.randn(5, generator=g),
        "c": torch.randn(2, 2, generator=g),
    }


def test_replicas_applying_the_same_updates_are_bit_identical() -> None:
    one, two = (
        GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig()),
        GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig()),
    )
    for r in range(3):
        grad = {"a": torch.full((4, 3), 0.1 * r), "b": torch.ones(5)}
        assert one.apply_update(0, r, grad) == two.apply_update(0, r, grad)
    assert one.rounds == [3, 0]
    assert one.fragment_hash(0) == two.fragment_hash(0) and one.fragment_hash(
        1
    ) == two.fragment_hash(1)


def test_updates_apply_only_in_order_and_only_to_their_fragment() -> None:
    state = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    with pytest.raises(ValueError, match="at round 0"):
        state.apply_update(0, 1, {"a": torch.zeros(4, 3), "b": torch.zeros(5)})
    with pytest.raises(ValueError, match="does not cover"):
        state.apply_update(0, 0, {"a": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="shape"):
        state.apply_update(1, 0, {"c": torch.zeros(3)})
    assert state.rounds == [0, 0]


def test_export_import_reproduces_the_hash_and_notifies() -> None:
    source = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    source.apply_update(1, 0, {"c": torch.ones(2, 2)})
    copy = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    seen = []
    copy.listeners.append(lambda f, r: seen.append((f, r)))
    snapshot = source.export_fragment(1)
    assert copy.import_verified(snapshot) == snapshot.hash == source.fragment_hash(1)
    assert copy.rounds == [0, 1] and seen == [(1, 0)]
    # and the next update keeps them identical (momentum came along)
    grad = {"c": torch.full((2, 2), 0.5)}
    assert copy.apply_update(1, 1, grad) == source.apply_update(1, 1, grad)


def test_a_downloaded_state_that_does_not_hash_to_its_claim_changes_nothing() -> None:
    from dataclasses import replace

    donor = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    donor.apply_update(0, 0, {"a": torch.full((4, 3), 0.1), "b": torch.ones(5)})
    honest = donor.export_fragment(0)
    joiner = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    before = joiner.fragment_hash(0)
    forged = replace(honest, params={**honest.params, "b": honest.params["b"] + 1.0})
    assert joiner.import_verified(forged) is None
    assert joiner.fragment_hash(0) == before and joiner.rounds == [0, 0]
    assert joiner.import_verified(honest) == honest.hash == donor.fragment_hash(0)
    honest.params["a"].add_(5.0)  # what was installed is the checked copy, not the donor's
    assert joiner.fragment_hash(0) == donor.fragment_hash(0)
    # a result computed on a copy leaves the replica alone until installed
    advanced = outer_update(joiner.export_fragment(0), {"a": torch.zeros(4, 3), "b": torch.zeros(5)}, joiner.outer)
    assert joiner.rounds == [1, 0] and joiner.fragment_hash(0) == honest.hash
    assert advanced.round == 2 and joiner.current_hash(0) == honest.hash


@pytest.mark.parametrize("delayed_every", [1, 3])
def test_an_update_computed_on_a_snapshot_equals_applying_it_in_place(delayed_every: int) -> None:
    """The synchronizer and every replica compute `outer_update` on their own snapshot
    (one copy of the fragment) and install it: same result, bit for bit, as applying it
    in place; the parent is checked by the hash recorded, not hashed again."""
    outer = OuterConfig(delayed_nesterov_every=delayed_every)
    applied = GlobalState(_params(), [["a", "b"], ["c"]], outer)
    installed = GlobalState(_params(), [["a", "b"], ["c"]], outer)
    for r in range(4):
        grad = {"a": torch.full((4, 3), 0.1 * (r + 1)), "b": torch.linspace(-1, 1, 5)}
        snapshot = installed.export_fragment(0)
        advanced = outer_update(snapshot, grad, outer)
        assert advanced.params["a"] is snapshot.params["a"]  # taken over, not copied
        assert installed.rounds == [r, 0]  # untouched until installed
        assert not installed.install(advanced, parent="another parent")
        assert installed.install(advanced, parent=snapshot.hash)
        assert not installed.install(advanced)  # the replica moved on: a round applies once
        assert applied.apply_update(0, r, grad) == advanced.hash == installed.fragment_hash(0)
        assert installed.current_hash(0) == advanced.hash
    with pytest.raises(ValueError, match="at round 4"):
        installed.apply_update(0, 5, grad)


def test_an_update_that_misses_a_tensor_changes_nothing() -> None:
    state = GlobalState(_params(), [["a", "b"], ["c"]], OuterConfig())
    before = state.export_fragment(0)
    with pytest.raises(ValueError, match="does not cover exactly"):
        outer_update(state.export_fragment(0), {"a": torch.ones(4, 3)}, state.outer)
    assert state.fragment_hash(0) == before.hash and state.rounds == [0, 0]
