"""Named tensors to and from the network: `encode_tensors` (with optional error feedback)
and the bounded decoders `decode_tensor`, `decode_tensors` and `lazy_tensors`.

Decoding untrusted tensors is bounded before anything is allocated: `decode_tensors`
checks every shape against the layout the caller expects (or, without one, the total
against `MAX_DECODE_ELEMENTS`); the zstd stage bounds its own payloads (`zstd`). Any
input, of any type, gives tensors or a ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import torch

from p2pdiloco.compress.base import _NO_LIMIT, Codec, EncodedTensor, _checked_numel
from p2pdiloco.compress.feedback import ErrorFeedback
from p2pdiloco.compress.registry import codec_for

logger = logging.getLogger(__name__)

MAX_DECODE_ELEMENTS = 1 << 28
"""Most elements one `decode_tensors` call materialises when the caller gives no layout."""


def decode_tensor(
    encoded: EncodedTensor,
    *,
    expected_shape: tuple[int, ...] | None = None,
    max_elements: int = _NO_LIMIT,
    finite: bool = False,
) -> torch.Tensor:
    """Decode any valid `EncodedTensor` (fp32, its shape); ValueError if it is not valid.

    Before anything is allocated the shape must equal `expected_shape` (when given) and
    span at most `max_elements` (`shapes.check_shape`); a shape that holds no element is
    accepted only when `expected_shape` says so. With `finite`, a NaN or Inf in the result
    is a ValueError. Any input, of any type, gives a tensor or a ValueError.
    """
    if not isinstance(encoded, EncodedTensor):
        raise ValueError(f"expected an EncodedTensor, got {type(encoded).__name__}")
    numel = _checked_numel(encoded.shape, max_elements, allow_empty=expected_shape is not None)
    if expected_shape is not None and tuple(encoded.shape) != tuple(expected_shape):
        raise ValueError(
            f"shape {list(encoded.shape)[:8]} is not the expected {list(expected_shape)}"
        )
    try:
        tensor = codec_for(encoded.codec, encoded.meta).decode(encoded)
    except ValueError:
        raise
    except Exception as exc:  # a codec bug must still be a rejection, not a crash
        logger.warning("tensor decode failed unexpectedly error=%r", exc)
        raise ValueError(f"malformed tensor: {type(exc).__name__}: {exc}") from None
    if finite and numel and not bool(torch.isfinite(tensor).all()):
        raise ValueError("non-finite values (NaN or Inf)")
    return tensor


def encode_tensors(
    codec: Codec, named: Mapping[str, torch.Tensor], feedback: ErrorFeedback | None = None
) -> dict[str, EncodedTensor]:
    """Encode every tensor; with `feedback`, add each residual first and keep the new one."""
    encoded = {}
    for name, tensor in named.items():
        if feedback is None:
            encoded[name] = codec.encode(tensor)
            continue
        compensated = feedback.compensate(name, tensor)
        encoded[name] = codec.encode(compensated)
        feedback.update(name, compensated, codec.decode(encoded[name]))
    return encoded


def _check_sizes(
    encoded: Mapping[str, EncodedTensor],
    shapes: Mapping[str, tuple[int, ...]] | None,
    max_total_elements: int,
) -> None:
    """Names, types and sizes of untrusted tensors, before anything is allocated."""
    if not isinstance(encoded, Mapping):
        raise ValueError(f"tensors must be a map of names, got {type(encoded).__name__}")
    if shapes is not None:
        missing = sorted(map(str, set(shapes) - set(encoded)))
        extra = sorted(map(str, set(encoded) - set(shapes)))
        if missing or extra:
            raise ValueError(
                f"tensor names do not match the layout: missing {missing[:4]}, "
                f"unexpected {[name[:60] for name in extra[:4]]}"
            )
    total = 0
    for name, tensor in encoded.items():
        if not isinstance(tensor, EncodedTensor):
            raise ValueError(f"tensor {name!r:.60}: not an EncodedTensor")
        try:
            if shapes is not None:
                expected = tuple(shapes[name])
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"shape {list(tensor.shape)[:8]} is not the expected {list(expected)}"
                    )
            total += _checked_numel(tensor.shape, _NO_LIMIT if shapes else max_total_elements)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tensor {name!r:.60}: {exc}") from None
        if shapes is None and total > max_total_elements:
            raise ValueError(f"tensors hold more than {max_total_elements} elements")


def decode_tensors(
    encoded: Mapping[str, EncodedTensor],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_total_elements: int = MAX_DECODE_ELEMENTS,
    finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Decode untrusted tensors by name; ValueError naming the first one that is not valid.

    Every size is checked before the first tensor is decoded: with `shapes`, the names
    must be exactly its keys and each shape its value; without, the element count over
    all tensors is at most `max_total_elements`. With `finite` (the default: these are
    deltas, updates and state from the network), NaN or Inf anywhere is a ValueError.
    Any input, of any type, gives tensors or a ValueError.
    """
    _check_sizes(encoded, shapes, max_total_elements)
    return dict(_decode_each(encoded, finite))


def _decode_each(
    encoded: Mapping[str, EncodedTensor], finite: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, decoded tensor), one at a time; ValueError naming the first invalid one."""
    for name, tensor in encoded.items():
        try:
            # the sizes were checked against the layout (or bounded) before: the shape is known
            yield name, decode_tensor(tensor, expected_shape=tuple(tensor.shape), finite=finite)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r:.60}: {exc}") from None


class LazyTensors(Mapping[str, torch.Tensor]):
    """Validated encoded tensors that decode on each access, one tensor at a time.

    A synchronizer holds every contribution of a window until it merges: as fp32 that is
    M copies of the fragment, as received (int8: a quarter of that) it is what the audit
    store keeps anyway. The merge reads tensor by tensor, so with these its fp32 working
    set is M copies of the largest tensor, not of the fragment. Decoding is deterministic:
    every access gives the same bits. Build with `lazy_tensors`, which validates first.
    """

    def __init__(self, encoded: Mapping[str, EncodedTensor]) -> None:
        self._encoded = dict(encoded)

    def __getitem__(self, name: str) -> torch.Tensor:
        encoded = self._encoded[name]  # validated by `lazy_tensors`
        return decode_tensor(encoded, expected_shape=tuple(encoded.shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self._encoded)

    def __len__(self) -> int:
        return len(self._encoded)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape, without decoding anything."""
        return {name: tuple(e.shape) for name, e in self._encoded.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held (the encoded payloads)."""
        return sum(e.nbytes for e in self._encoded.values())


def lazy_tensors(
    encoded: Mapping[str, EncodedTensor],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_total_elements: int = MAX_DECODE_ELEMENTS,
) -> LazyTensors:
    """`decode_tensors`' checks (sizes first, then every tensor decoded once and found
    finite, one at a time) without keeping the decoded tensors: ValueError if any fails."""
    _check_sizes(encoded, shapes, max_total_elements)
    for _ in _decode_each(encoded, finite=True):
        pass  # each tensor is dropped as soon as it is checked
    return LazyTensors(encoded)
