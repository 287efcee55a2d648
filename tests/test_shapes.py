"""`check_shape`: every dimension bounded on its own, the extent bounded, empties by layout only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.compress import EncodedTensor, decode_tensor, make_codec
from p2pdiloco.shapes import MAX_DIM, check_shape


def test_a_zero_beside_huge_dimensions_is_refused_by_the_huge_dimension() -> None:
    with pytest.raises(ValueError, match="bad dimension 4294967296 at axis 1"):
        check_shape([0, 2**32, 2**32], max_elements=1 << 62)


def test_the_extent_counts_zeros_as_one_so_strides_stay_small() -> None:
    with pytest.raises(ValueError, match="spans more than 1024 elements"):
        check_shape([0, 64, 64], max_elements=1024)
    assert check_shape([0, 32, 32], max_elements=1024) == (0, 32, 32)


@pytest.mark.parametrize("shape", [[-1], [True], [1.0], ["3"], "ab", None, [1] * 65])
def test_bad_shapes_name_what_is_wrong(shape: Any) -> None:
    with pytest.raises(ValueError, match="shape"):
        check_shape(shape, max_elements=1 << 20)


def test_an_empty_tensor_needs_a_layout_that_says_so() -> None:
    encoded = make_codec("fp32").encode(torch.zeros(0, 4))
    with pytest.raises(ValueError, match="holds no element"):
        decode_tensor(encoded)
    assert decode_tensor(encoded, expected_shape=(0, 4)).shape == (0, 4)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(0, MAX_DIM) | st.integers(-5, 2**70), max_size=6))
def test_any_accepted_shape_can_be_strided_by_torch(shape: list[int]) -> None:
    try:
        checked = check_shape(shape, max_elements=1 << 62)
    except ValueError:
        return
    # an accepted shape never overflows torch's stride calculation
    tensor = torch.empty_strided(checked, [0] * len(checked)) if 0 in checked else None
    if tensor is not None:
        assert bool(torch.isfinite(tensor).all())
    EncodedTensor("fp32", checked, {}, b"")  # a plain record: building it allocates nothing
