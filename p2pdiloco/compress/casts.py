"""fp32, fp16 and bf16: codecs that are a plain cast, `itemsize` bytes per element.

fp16 saturates at +-65504 rather than overflowing to inf, which every receiver would
reject. Decoding is an exact cast back to fp32 (subnormals included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from p2pdiloco.compress.base import (
    _FP16_MAX,
    Codec,
    EncodedTensor,
    _check_meta_keys,
    _flat_fp32,
    _from_le,
    _shape_of,
    _to_le_bytes,
)


class _CastCodec(Codec):
    """fp32, fp16 and bf16: a plain cast, `itemsize` bytes per element."""

    def __init__(self, name: str, dtype: torch.dtype, wire_dtype: str) -> None:
        self.name = name
        self._dtype = dtype
        self._wire_dtype = wire_dtype  # numpy dtype of the payload
        self._itemsize = torch.finfo(dtype).bits // 8

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat = _flat_fp32(tensor)
        if self._dtype == torch.float16:
            # Saturate instead of overflowing to inf, which every receiver would reject.
            flat = flat.clamp(-_FP16_MAX, _FP16_MAX)
        return EncodedTensor(self.name, _shape_of(tensor), {}, _to_le_bytes(flat.to(self._dtype)))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        numel = self._check_encoded(encoded)
        values = _from_le(encoded.payload, self._wire_dtype, numel)
        if self._dtype == torch.bfloat16:
            values = values.view(torch.bfloat16)
        # fp16/bf16 -> fp32 is exact (subnormals included): the same bits on every CPU
        return values.to(torch.float32, copy=True).reshape(encoded.shape)

    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        _check_meta_keys(meta, set(), self.name)
        return numel * self._itemsize
