"""The top-k codec: the k largest |x| as int8 values under one scale, indices delta-coded.

Everything else decodes to zero, so it is meant to be paired with error feedback
(`feedback.ErrorFeedback`), which sends what was dropped in a later round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from p2pdiloco.compress.base import (
    _CHUNK_ELEMENTS,
    Codec,
    EncodedTensor,
    _check_meta_keys,
    _flat_fp32,
    _from_le,
    _meta_int,
    _safe_inverse,
    _shape_of,
    _to_le_bytes,
)

# Above this size topk first filters candidates by a threshold estimated on a strided sample.
_TOPK_DIRECT_MAX = 1 << 16


class _TopkCodec(Codec):
    """The k = ceil(fraction * n) largest |x|; the rest is zero (pair it with error feedback).

    Payload: fp32 value scale | k index gaps (uint8/16/32, the narrowest that holds the
    largest gap; the first gap is the first index) | k int8 values (round(x / scale)).
    """

    name = "topk"

    def __init__(self, fraction: float = 0.05) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"topk fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)

    def __repr__(self) -> str:
        return f"TopkCodec(fraction={self.fraction})"

    def _top_indices(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted indices of the k largest |x|, exactly the set a full sort would pick."""
        n = flat.numel()
        if n <= _TOPK_DIRECT_MAX or k * 4 > n:
            return torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values
        # A full topk over 10^8 elements costs ~10 passes, so estimate a threshold on a
        # strided sample a little below the k-th largest and keep the candidates above it
        # (nonzero() returns them in order); fall back to the full topk when too few pass.
        stride = n // _TOPK_DIRECT_MAX
        sample = flat[::stride].abs()
        rank = min(sample.numel(), int(k / n * sample.numel() * 1.25) + 16)
        threshold = torch.topk(sample, rank, sorted=False).values.amin()
        candidates = []
        for start in range(0, n, _CHUNK_ELEMENTS):
            chunk = flat[start : start + _CHUNK_ELEMENTS]
            candidates.append(torch.nonzero(chunk.abs() >= threshold).view(-1) + start)
        index = torch.cat(candidates)
        if index.numel() < k:
            return torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values
        # Select among candidates by the k-th largest value (quickselect) instead of topk
        # + sort: a mask keeps the candidates in index order. Ties at the k-th value are
        # taken first come, first served, so exactly k are kept.
        magnitude = flat[index].abs()
        kth = torch.kthvalue(magnitude, magnitude.numel() - k + 1).values
        keep = magnitude > kth
        ties = torch.nonzero(magnitude == kth).view(-1)
        keep[ties[: k - int(keep.sum())]] = True
        return index[keep]

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat = _flat_fp32(tensor)
        n = flat.numel()
        k = min(n, math.ceil(self.fraction * n))
        index = self._top_indices(flat, k) if k else flat.new_empty(0).long()
        values = flat[index]
        scale = values.abs().amax() / 127.0 if k else torch.tensor(0.0)
        codes = (values * _safe_inverse(scale)).round_().clamp_(-127, 127).to(torch.int8)
        gaps = torch.diff(index, prepend=index.new_zeros(1)) if k else index
        widest = int(gaps.max()) if k else 0
        index_bytes = 1 if widest < 1 << 8 else 2 if widest < 1 << 16 else 4
        gap_dtype = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[index_bytes]
        payload = (
            _to_le_bytes(scale.reshape(1).to(torch.float32))
            + _to_le_bytes(gaps.to(gap_dtype))
            + _to_le_bytes(codes)
        )
        return EncodedTensor(
            self.name, _shape_of(tensor), {"k": k, "index_bytes": index_bytes}, payload
        )

    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        _check_meta_keys(meta, {"k", "index_bytes"}, self.name)
        k = _meta_int(meta, "k", 0, numel)
        width = _meta_int(meta, "index_bytes", 1, 4)
        if width == 3:
            raise ValueError("meta 'index_bytes' must be 1, 2 or 4, got 3")
        return 4 + k * (width + 1)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        n = self._check_encoded(encoded)
        k, width = encoded.meta["k"], encoded.meta["index_bytes"]
        scale = _from_le(encoded.payload, "<f4", 1)
        gaps = _from_le(encoded.payload, f"<u{width}", k, 4).to(torch.int64)
        codes = _from_le(encoded.payload, "<i1", k, 4 + k * width)
        out = torch.zeros(n, dtype=torch.float32)
        if k:
            # Indices must be strictly increasing and inside the tensor: no duplicates.
            if k > 1 and bool((gaps[1:] == 0).any()):
                raise ValueError("topk indices repeat (a gap after the first is 0)")
            index = torch.cumsum(gaps, 0)  # int64: exact in any order
            if int(index[-1]) >= n:
                raise ValueError(f"topk index {int(index[-1])} is outside a tensor of {n}")
            out[index] = codes.to(torch.float32) * scale  # exact cast, one multiply
        return out.reshape(encoded.shape)
