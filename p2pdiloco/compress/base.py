"""The codec interface (`Codec`), the tensor as it crosses the network (`EncodedTensor`),
and the byte-level helpers every codec shares.

Every codec turns an fp32 tensor into an `EncodedTensor` (codec name, shape, a small
`meta` dict of plain values, and a little-endian `payload`) and back. The decoder reads
everything it needs (block size, scale dtype, k, index width) from `meta`, so a peer
decodes whatever a sender chose; `Codec.check_layout` says, before a payload is read,
whether its size is what codec, shape and meta imply (the wire calls it on untrusted
headers). The codecs live beside this module:

    fp32 / fp16 / bf16   plain casts (`casts`)
    int8 / int4 / fp4    blockwise absmax codes (`blockwise`)
    topk                 the k largest |x| (`topk`)
    sparse2              the k largest |x| of every chunk, in 2 bits (`sparse`)
    +zstd                an optional lossless zstd stage on top of any of them (`zstd`)

Byte layouts and expected errors are in docs/protocol.md ("Codecs").

Decoding feeds the global state, so every decoder is bit-identical on every CPU kernel set:
exact casts and at most one elementwise multiply per value, no fused op and no
floating-point reduction (docs/arithmetic.md). Encoding runs on one learner and need not be.
"""

from __future__ import annotations

import math
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from p2pdiloco.shapes import check_shape, num_elements

_NATIVE_LITTLE = sys.byteorder == "little"
# Elements processed per step of the blockwise loops: big enough that Python overhead is
# negligible, small enough that the fp32 temporaries stay in cache (4 MiB).
_CHUNK_ELEMENTS = 1 << 20
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14
_NO_LIMIT = 1 << 62  # element bound for local (trusted) decodes: shapes are still type-checked


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor as it crosses the network: `payload` is little-endian bytes."""

    codec: str
    """Codec name, one of `CODECS`."""
    shape: tuple[int, ...]
    """Shape of the decoded tensor."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Codec parameters (plain msgpack-able values), e.g. {"block": 256, "scale": "fp16"}."""
    payload: bytes = b""
    """The encoded bytes."""

    @property
    def numel(self) -> int:
        """Elements of the decoded tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload."""
        return len(self.payload)


# ---------------------------------------------------------------------------------------
# little-endian buffers and untrusted meta


def _to_le_bytes(tensor: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous CPU tensor in little-endian order."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bfloat16; the bits are what we send
    array = tensor.contiguous().numpy()
    if not _NATIVE_LITTLE:
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()


def _from_le(payload: bytes, dtype: str, count: int, offset: int = 0) -> torch.Tensor:
    """A read-only tensor over `count` little-endian values of numpy `dtype` (e.g. "<f4")."""
    if count == 0:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype).newbyteorder("=")))
    array = np.frombuffer(payload, dtype=np.dtype(dtype), count=count, offset=offset)
    if not _NATIVE_LITTLE:
        array = array.astype(array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # The view is read-only and every caller only reads it; copying would cost a pass.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a flat contiguous fp32 CPU view (a copy only when it must be)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex():
        raise TypeError(f"cannot encode a {tensor.dtype} tensor")
    return tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)


def _shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def _checked_numel(shape: Any, max_elements: int, *, allow_empty: bool = True) -> int:
    """Elements of an untrusted `shape`, or ValueError (no allocation): see `shapes.check_shape`."""
    return num_elements(check_shape(shape, max_elements=max_elements, allow_empty=allow_empty))


def _meta_int(meta: Mapping[str, Any], key: str, low: int, high: int) -> int:
    """`meta[key]` as an int in [low, high], or ValueError naming the key."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"meta {key!r} must be an int in [{low}, {high}], got {value!r}")
    return value


def _check_meta_keys(meta: Mapping[str, Any], allowed: set[str], codec: str) -> None:
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a map, got {type(meta).__name__}")
    unknown = sorted(str(k) for k in meta if k not in allowed)
    if unknown:
        raise ValueError(f"unknown meta key {unknown[0]!r} for codec {codec}")


def _safe_inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 where the scale is 0 (an all-zero block codes to zeros, never 0/0)."""
    return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))


# ---------------------------------------------------------------------------------------
# the interface


class Codec(ABC):
    """Encodes an fp32 tensor into an `EncodedTensor` and decodes it back (fp32, same shape)."""

    name: str
    """Codec name as it appears on the wire (one of `CODECS`)."""

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """Encode a floating-point tensor (any shape, including 0-d and empty)."""

    @abstractmethod
    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        """Decode to an fp32 tensor of `encoded.shape`; ValueError if the payload is invalid."""

    @abstractmethod
    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        """Payload bytes implied by `numel` and `meta`; ValueError if `meta` is invalid."""

    def check_layout(self, shape: tuple[int, ...], meta: Mapping[str, Any], nbytes: int) -> None:
        """ValueError unless a payload of `nbytes` is exactly what shape and meta imply."""
        expected = self.raw_payload_bytes(_checked_numel(shape, _NO_LIMIT), meta)
        if nbytes != expected:
            raise ValueError(
                f"payload is {nbytes} bytes, codec {self.name} with shape "
                f"{list(shape)} implies {expected}"
            )

    def _check_encoded(self, encoded: EncodedTensor) -> int:
        if not isinstance(encoded, EncodedTensor):
            raise ValueError(f"expected an EncodedTensor, got {type(encoded).__name__}")
        if encoded.codec != self.name:
            raise ValueError(f"codec {self.name} cannot decode a {encoded.codec!r:.40} tensor")
        if not isinstance(encoded.payload, bytes):
            raise ValueError(f"payload must be bytes, got {type(encoded.payload).__name__}")
        numel = _checked_numel(encoded.shape, _NO_LIMIT)
        self.check_layout(tuple(encoded.shape), encoded.meta, len(encoded.payload))
        return numel

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
