"""Merge rules and the outer step: the invariants DiLoCo relies on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.outer.step import (
    OuterState,
    cap_shares,
    merge,
    merge_mean,
    merge_radial,
    merge_weighted,
    outer_step,
    pseudo_gradient,
    tensor_norm,
    token_weights,
)

counts = st.integers(min_value=1, max_value=10_000)
learner_counters = st.lists(st.tuples(counts, counts), min_size=1, max_size=8)
shares = st.floats(min_value=0.05, max_value=1.0)


def _random_deltas(num: int, seed: int, shape=(3, 5)) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(shape, generator=g), "b": torch.randn(shape[-1], generator=g)}
        for _ in range(num)
    ]


@settings(max_examples=examples(200), deadline=None)
@given(learner_counters, shares)
def test_token_weights_sum_to_one_and_respect_the_cap(counters, max_share) -> None:
    tokens, steps = zip(*counters, strict=True)
    weights = token_weights(tokens, steps, max_share=max_share)
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    assert all(w >= 0 for w in weights)
    if len(weights) * max_share > 1.0:
        assert max(weights) <= max_share + 1e-9
    else:
        assert weights == pytest.approx([1 / len(weights)] * len(weights))


@settings(max_examples=examples(100), deadline=None)
@given(learner_counters, st.randoms(use_true_random=False))
def test_token_weights_are_permutation_equivariant(counters, rng) -> None:
    order = list(range(len(counters)))
    rng.shuffle(order)
    weights = token_weights([c[0] for c in counters], [c[1] for c in counters], max_share=0.6)
    shuffled = token_weights(
        [counters[i][0] for i in order], [counters[i][1] for i in order], max_share=0.6
    )
    assert shuffled == pytest.approx([weights[i] for i in order])


def test_token_weight_is_quantity_times_batch_quality() -> None:
    # Same steps, twice the tokens (twice the batch): 2 * 2 = 4 times the weight.
    assert token_weights([200, 100], [10, 10]) == pytest.approx([0.8, 0.2])
    # Absent learners (no tokens) weigh zero.
    assert token_weights([100, 0], [10, 0]) == pytest.approx([1.0, 0.0])
    # Staleness discounts.
    assert token_weights(
        [100, 100], [10, 10], staleness=[0, 1], staleness_discount=0.5
    ) == pytest.approx([2 / 3, 1 / 3])


def test_cap_redistributes_in_proportion() -> None:
    assert cap_shares([8, 1, 1], 0.5) == pytest.approx([0.5, 0.25, 0.25])
    assert cap_shares([6, 3, 1], 0.5) == pytest.approx([0.5, 0.375, 0.125])
    assert cap_shares([0, 0], 0.5) == pytest.approx([0.5, 0.5])


@settings(max_examples=examples(50), deadline=None)
@given(
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=0, max_value=1000),
    st.sampled_from(["mean", "token", "radial"]),
)
def test_merges_are_permutation_invariant(num, seed, rule) -> None:
    deltas = _random_deltas(num, seed)
    weights = token_weights(list(range(1, num + 1)), [1] * num)
    merged = merge(rule, deltas, weights)
    perm = list(reversed(range(num)))
    merged_perm = merge(rule, [deltas[i] for i in perm], [weights[i] for i in perm])
    for name in merged:
        assert torch.allclose(merged[name], merged_perm[name], atol=1e-5)


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(min_value=0, max_value=1000), st.sampled_from(["mean", "token", "radial"]))
def test_a_single_learners_merge_is_its_delta(seed, rule) -> None:
    (delta,) = _random_deltas(1, seed)
    merged = merge(rule, [delta], [1.0])
    for name in delta:
        assert torch.allclose(merged[name], delta[name], atol=1e-5)


@settings(max_examples=examples(50), deadline=None)
@given(
    st.integers(min_value=2, max_value=6),
    st.integers(min_value=0, max_value=1000),
    st.floats(min_value=0.01, max_value=100.0),
)
def test_radial_merge_is_scale_equivariant(num, seed, scale) -> None:
    deltas = _random_deltas(num, seed)
    weights = [1.0 / num] * num
    merged = merge_radial(deltas, weights)
    scaled = merge_radial([{k: v * scale for k, v in d.items()} for d in deltas], weights)
    for name in merged:
        expected = merged[name] * scale
        assert float((scaled[name] - expected).norm()) <= 1e-5 * float(expected.norm()) + 1e-9


def test_radial_norm_does_not_shrink_with_disagreeing_learners() -> None:
    # Orthogonal unit deltas: the plain mean shrinks as 1/sqrt(M); radial keeps norm 1.
    eye = torch.eye(4)
    deltas = [{"w": eye[i]} for i in range(4)]
    weights = [0.25] * 4
    assert float(merge_mean(deltas)["w"].norm()) == pytest.approx(0.5)
    assert float(merge_radial(deltas, weights)["w"].norm()) == pytest.approx(1.0)
    assert torch.allclose(merge_radial(deltas, weights)["w"], torch.full((4,), 0.5))


def test_radial_falls_back_to_mean_when_directions_cancel_and_for_embeddings() -> None:
    deltas = [{"w": torch.ones(3)}, {"w": -torch.ones(3)}]
    assert torch.allclose(merge_radial(deltas, [0.5, 0.5])["w"], torch.zeros(3))
    deltas = [
        {"embed.weight": torch.tensor([1.0, 0.0])},
        {"embed.weight": torch.tensor([0.0, 3.0])},
    ]
    merged = merge_radial(deltas, [0.5, 0.5], plain_mean_names=frozenset({"embed.weight"}))
    assert torch.allclose(merged["embed.weight"], torch.tensor([0.5, 1.5]))


def test_radial_median_norm_resists_one_huge_update() -> None:
    deltas = [
        {"w": torch.tensor([1.0, 0.0])},
        {"w": torch.tensor([1.0, 0.1])},
        {"w": torch.tensor([1000.0, 0.0])},
    ]
    weights = [1 / 3] * 3
    assert float(merge_radial(deltas, weights, norm="median")["w"].norm()) == pytest.approx(
        1.005, rel=1e-2
    )
    assert float(merge_radial(deltas, weights, norm="mean")["w"].norm()) > 300


def test_weighted_merge_matches_hand_computation() -> None:
    deltas = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    assert torch.allclose(merge_weighted(deltas, [0.75, 0.25])["w"], torch.tensor([1.5, 3.0]))


def test_pseudo_gradient_is_global_minus_local() -> None:
    g = {"w": torch.tensor([1.0, 1.0])}
    local = {"w": torch.tensor([0.5, 2.0], requires_grad=True)}
    delta = pseudo_gradient(g, local)
    assert torch.equal(delta["w"], torch.tensor([0.5, -1.0])) and not delta["w"].requires_grad
    assert tensor_norm(delta) == pytest.approx(math.sqrt(1.25))


def test_outer_step_equals_torch_nesterov_sgd() -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3)}
    reference = torch.nn.Parameter(params["w"].clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    state = OuterState()
    for _ in range(5):
        grad = torch.randn(4, 3)
        outer_step(params, {"w": grad}, state, lr=0.7, momentum=0.9)
        reference.grad = grad.clone()
        sgd.step()
    assert torch.allclose(params["w"], reference.detach(), atol=1e-6)
    assert state.num_steps == 5


def test_outer_step_with_lr_one_and_no_momentum_lands_on_the_mean_local_model() -> None:
    base = {"w": torch.tensor([1.0, 1.0])}
    locals_ = [{"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([2.0, 4.0])}]
    merged = merge_mean([pseudo_gradient(base, x) for x in locals_])
    outer_step(base, merged, OuterState(), lr=1.0, momentum=0.0)
    assert torch.allclose(base["w"], torch.tensor([1.0, 3.0]))


def test_outer_step_only_touches_the_fragment_it_is_given() -> None:
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    state = OuterState()
    outer_step(params, {"a": torch.ones(2)}, state, lr=1.0, momentum=0.9)
    assert torch.equal(params["b"], torch.zeros(2)) and "b" not in state.momentum


def test_delayed_nesterov_with_every_one_is_nesterov_and_otherwise_delays_momentum() -> None:
    grads = [torch.full((2,), float(i + 1)) for i in range(4)]
    a, b = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    sa, sb = OuterState(), OuterState()
    for g in grads:
        outer_step(a, {"w": g}, sa, lr=0.1, momentum=0.9)
        outer_step(b, {"w": g}, sb, lr=0.1, momentum=0.9, delayed_every=1)
    assert torch.equal(a["w"], b["w"])
    c, sc = {"w": torch.zeros(2)}, OuterState()
    outer_step(c, {"w": grads[0]}, sc, lr=0.1, momentum=0.9, delayed_every=2)
    assert "w" not in sc.momentum and torch.allclose(c["w"], torch.full((2,), -0.1))
    outer_step(c, {"w": grads[1]}, sc, lr=0.1, momentum=0.9, delayed_every=2)
    assert torch.allclose(sc.momentum["w"], torch.full((2,), 1.5))
    # plain steps -0.1 - 0.2, then the momentum term lr * mu * 1.5
    assert torch.allclose(c["w"], torch.full((2,), -0.3 - 0.1 * 0.9 * 1.5))


def test_no_weight_counts_more_than_max_ratio_times_the_median() -> None:
    # 2x the median tokens at the same steps is 4x the weight: bounded to 2x
    assert token_weights([200, 100, 100, 100], [10, 10, 10, 10], max_ratio=2.0) == pytest.approx(
        [0.4, 0.2, 0.2, 0.2]
    )
    # thin claims do not drag the honest weights down
    thin = token_weights([100, 100, 1, 1], [10, 10, 10, 10], max_ratio=2.0)
    assert thin == pytest.approx(token_weights([100, 100, 1, 1], [10, 10, 10, 10]))
    # two claims have no median to speak of; a lifted ratio bounds nothing
    assert token_weights([200, 100], [10, 10], max_ratio=2.0) == pytest.approx([0.8, 0.2])
    assert token_weights([200, 100, 100], [10, 10, 10], max_ratio=100.0) == pytest.approx(
        [4 / 6, 1 / 6, 1 / 6]
    )
