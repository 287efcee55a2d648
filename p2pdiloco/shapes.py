"""One check for every tensor shape that arrives from outside (network, files, configs).

A shape's element count alone is not a safe bound: `[0, 2**32, 2**32]` holds no element,
so a product check passes it, yet torch computes its strides from the other dimensions
and overflows on the first operation. So each dimension is bounded on its own
(`0 <= d <= MAX_DIM`), the *extent* (the product with zeros counted as 1, which is what
the strides span) is bounded too, and a zero-element shape is refused unless the caller
has a layout that says the tensor is empty. Pure: no torch, no allocation.
"""

from __future__ import annotations

from typing import Any

MAX_DIM = (1 << 31) - 1
"""Largest accepted dimension (int32 range: what any real layer has, and far from overflow)."""
MAX_NDIM = 64
"""Most dimensions a shape may have anywhere (wire frames use a tighter limit)."""


def check_shape(
    shape: Any,
    *,
    max_elements: int,
    max_ndim: int = MAX_NDIM,
    allow_empty: bool = True,
    what: str = "shape",
    limit_name: str = "max_elements",
) -> tuple[int, ...]:
    """`shape` as a tuple of ints, or ValueError naming `what` and the bad field.

    Every dimension is an int in [0, MAX_DIM]; the extent (product with zeros as 1) is at
    most `max_elements`, checked dimension by dimension so no big product is ever formed;
    with `allow_empty=False` a shape holding no element is refused.
    """
    if not isinstance(shape, tuple | list):
        raise ValueError(f"{what} must be a list of ints, got {_short(shape)}")
    if len(shape) > max_ndim:
        raise ValueError(f"{what} has {len(shape)} dimensions, max_ndim is {max_ndim}")
    extent = 1
    numel = 1
    for axis, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= MAX_DIM:
            raise ValueError(
                f"{what} has a bad dimension {_short(dim)} at axis {axis} "
                f"(each must be an int in [0, {MAX_DIM}])"
            )
        extent *= max(dim, 1)
        numel *= dim
        if extent > max_elements:
            raise ValueError(
                f"{what} {_short(list(shape))} spans more than {max_elements} elements ({limit_name})"
            )
    if numel == 0 and shape and not allow_empty:
        raise ValueError(
            f"{what} {_short(list(shape))} holds no element and no layout expects that"
        )
    return tuple(shape)


def num_elements(shape: tuple[int, ...]) -> int:
    """Elements of a shape that `check_shape` accepted."""
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."
