"""Fragments: balanced, deterministic bin packing and a staggered schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.protocol.fragments import fragments_due, partition_fragments
from p2pdiloco.training.model import build_model


def test_model_fragments_are_balanced_and_cover_every_tensor_once() -> None:
    model = build_model("tiny")
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    fragments = partition_fragments(sizes, 4)
    names = [n for f in fragments for n in f]
    assert sorted(names) == sorted(sizes) and len(names) == len(set(names))
    loads = [sum(sizes[n] for n in f) for f in fragments]
    assert max(loads) / min(loads) < 1.3
    assert partition_fragments(sizes, 4) == fragments


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=8),
)
def test_greedy_packing_is_within_one_tensor_of_the_ideal(sizes_list, num) -> None:
    if num > len(sizes_list):
        with pytest.raises(ValueError):
            partition_fragments({f"t{i}": s for i, s in enumerate(sizes_list)}, num)
        return
    sizes = {f"t{i}": s for i, s in enumerate(sizes_list)}
    loads = [sum(sizes[n] for n in f) for f in partition_fragments(sizes, num)]
    # Greedy LPT: the heaviest bin exceeds the average by at most the largest item.
    assert max(loads) <= sum(sizes_list) / num + max(sizes_list)


def test_one_fragment_is_plain_diloco() -> None:
    assert [s for s in range(1, 101) if fragments_due(s, 25, 1)] == [25, 50, 75, 100]


def test_fragments_are_staggered_by_h_over_f() -> None:
    due = {s: fragments_due(s, 12, 4) for s in range(1, 40) if fragments_due(s, 12, 4)}
    assert due == {
        12: [0],
        15: [1],
        18: [2],
        21: [3],
        24: [0],
        27: [1],
        30: [2],
        33: [3],
        36: [0],
        39: [1],
    }
    # every fragment every H steps, one fragment at a time
    assert all(len(v) == 1 for v in due.values())


def test_a_warm_start_syncs_every_fragment_often_then_resumes_the_staggered_schedule() -> None:
    due = {s: fragments_due(s, 12, 2, warm_steps=6, warm_inner_steps=2) for s in range(1, 32)}
    assert {s: f for s, f in due.items() if f} == {
        2: [0, 1], 4: [0, 1], 6: [0, 1],  # warm: all fragments every 2 steps
        18: [0], 24: [1], 30: [0],  # then H = 12, staggered by H / F, counted from step 6
    }  # fmt: skip
    assert [s for s in range(1, 20) if fragments_due(s, 5, 1, 0, 1)] == [5, 10, 15]


def test_a_fragment_too_big_for_one_frame_names_the_fragments_needed() -> None:
    from p2pdiloco.protocol.fragments import frame_problem

    sizes = {"emb": 300, "w1": 200, "w2": 200, "b": 10}
    one = partition_fragments(sizes, 1)
    problem = frame_problem(sizes, one, max_elements=400, max_bytes=1 << 30)
    assert "sync.num_fragments=1 puts 710 elements in fragment 0" in problem
    assert "at most 400" in problem and "sync.num_fragments >= 2" in problem
    assert frame_problem(sizes, partition_fragments(sizes, 2), 400, 1 << 30) == ""
    # the byte limit counts too (fp32, 1 MiB for the header)
    assert "at most 256" in frame_problem(sizes, one, 1 << 28, (1 << 20) + 1024)
