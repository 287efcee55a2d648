"""The sparse codec `sparse2`: the k largest |x| of every chunk, indices within the chunk,
values in 2 bits (SparseLoCo's recipe, arXiv:2508.15706).

The flat tensor is cut into chunks of `chunk` elements (4096 by default, the last one may
be short). Each full chunk keeps its k largest |x| (64 by default: 1.56%); a short chunk
of L elements keeps ceil(k * L / chunk), so density is the same everywhere. Exact zeros are
never kept, so a chunk may keep fewer. An index is its offset in the chunk, in
ceil(log2(chunk)) bits (12 for 4096), and a value is a sign bit and a magnitude bit
that picks one of the chunk's two levels (lo, hi), sent as bf16.

Why two fitted levels: on the kept values of a real AdamW delta (the `tiny` model, 20
steps), the error of 2-bit values relative to the kept values was 4.1% with lo/hi fitted
per chunk (1-D k-means, three Lloyd steps), 11% for four uniform levels at absmax/4 and
3absmax/4, 8% for sign and magnitudes {0.75, 1} x absmax, and 7.4% for sign times the
mean (1 bit). On Gaussian, Laplace and Student-t(3) tensors the fitted levels were best
too (6.3%, 11%, 26%): the kept values are the tail beyond the k-th largest, which no
level grid fixed in advance fits. bf16 levels cost 4 bytes per chunk (0.001 byte per
element), keep fp32's range (tiny late-training deltas never underflow, as fp16 scales
would) and add at most 2^-9 relative to a level.

Payload (little-endian), for nc = ceil(n / chunk) chunks and nnz kept entries in all:

    nc x u16        count of each chunk (<= its quota)
    nc x 2 x bf16   lo, hi of each chunk (finite)
    nnz x b bits    offsets in the chunk, chunk by chunk, strictly increasing in each
    nnz x 2 bits    codes: bit 0 picks hi, bit 1 is the sign

Bit fields are packed least significant bit first, and the padding bits of each field's
last byte are zero, so every tensor has exactly one encoding. `meta` is {"chunk", "k",
"nnz"}: the header alone fixes the payload size, and the decoder checks every count,
offset and level before it allocates the output.

Decoding is a table lookup: a kept entry is lo, hi, -lo or -hi of its chunk, exact casts
and no arithmetic at all, so it is bit-identical on every CPU (docs/arithmetic.md).
Encoding is too, because the outer update a synchronizer publishes may be sparse2 and an
auditor re-encodes it to check the record's hash: ties at a chunk's k-th largest |x| go to
the lowest offsets (torch.topk may take any of them), the levels are fitted with exact
integer sums (`_fit_levels`) and cast float64 -> fp32 -> bf16 one step at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from p2pdiloco.compress.base import (
    _CHUNK_ELEMENTS,
    Codec,
    EncodedTensor,
    _check_meta_keys,
    _flat_fp32,
    _from_le,
    _meta_int,
    _shape_of,
    _to_le_bytes,
)

MAX_CHUNK = 1 << 16
"""Largest chunk (elements): offsets fit 16 bits."""
_MAX_COUNT = (1 << 16) - 1  # a chunk's count is a u16
_BF16_MAX = 3.3895313892515355e38  # levels are clamped here so the cast never overflows
_LLOYD_STEPS = 3  # the fitted levels barely move after the third (measured: 4.23% -> 4.08%)


def index_bits(chunk: int) -> int:
    """Bits of one offset in a chunk of `chunk` elements."""
    return max(1, (chunk - 1).bit_length())


def chunk_quotas(numel: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(full chunks, elements of the short last chunk or 0, entries it may keep)."""
    full, tail = divmod(numel, chunk)
    return full, tail, -(-k * tail // chunk)


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """`values` (< 2^width, width <= 16) as consecutive `width`-bit fields, LSB first."""
    as_bytes = values.astype("<u2").view(np.uint8).reshape(-1, 2)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack_bits(payload: bytes, offset: int, count: int, width: int) -> np.ndarray:
    """`count` fields of `width` bits at byte `offset` (int64); ValueError on nonzero padding."""
    nbytes = -(-count * width // 8)
    packed = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offset)
    used = count * width % 8
    if used and packed[-1] >> used:
        raise ValueError("sparse2 padding bits are not zero")
    # A field of <= 16 bits starting at any bit lies within 3 bytes: read them as one word.
    padded = np.zeros(nbytes + 2, dtype=np.int32)
    padded[:nbytes] = packed
    start = np.arange(count, dtype=np.int64) * width
    byte, shift = start >> 3, (start & 7).astype(np.int32)
    word = padded[byte] | padded[byte + 1] << 8 | padded[byte + 2] << 16
    return ((word >> shift) & ((1 << width) - 1)).astype(np.int64)


_FIXED_BITS = 40  # a row in fixed point: its largest |x| below 2^41, int64 sums exact


def _fit_levels(magnitude: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per row, the two levels (lo, hi) that best fit the kept magnitudes (1-D 2-means).

    A float sum rounds differently in the order the CPU's vector width sets, so each row is
    summed in fixed point: its magnitudes times the power of two that puts its largest
    below 2^41, truncated to int64 (exact products, floored alike everywhere), whose sums
    are exact in any order. Truncation drops less than 2^-40 of the row's largest value."""
    magnitude = magnitude.to(torch.float64)  # exact, and fp32's whole range stays finite
    exponent = torch.frexp(magnitude.amax(1)).exponent
    scale = torch.ldexp(torch.ones(magnitude.shape[0], dtype=torch.float64), _FIXED_BITS - exponent)
    fixed = (magnitude * scale.unsqueeze(1)).to(torch.int64)
    count = kept.sum(1)  # dropped entries hold zeros
    split = fixed.sum(1).to(torch.float64) / count.clamp(min=1) / scale
    for _ in range(_LLOYD_STEPS):
        high = (magnitude >= split.unsqueeze(1)) & kept
        low = kept & ~high
        num_high, num_low = high.sum(1), low.sum(1)
        hi = (fixed * high).sum(1).to(torch.float64) / num_high.clamp(min=1) / scale
        low_mean = (fixed * low).sum(1).to(torch.float64) / num_low.clamp(min=1) / scale
        lo = torch.where(num_low > 0, low_mean, hi)
        split = (lo + hi) / 2
    return torch.stack((lo, hi), dim=1)


def _top_offsets(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `magnitude` (rows, length >= k), the offsets of its k largest entries in
    increasing order; of entries equal to the k-th largest, the lowest offsets."""
    top = torch.topk(magnitude, k, dim=1, sorted=False)
    offsets = top.indices
    kth = top.values.min(1, keepdim=True).values  # the k largest values are one multiset
    tied = ((magnitude >= kth).sum(1) > k).nonzero().squeeze(1)
    if tied.numel():  # which of the tied entries topk took depends on its kernel
        rows, line = magnitude[tied], kth[tied]
        greater, equal = rows > line, rows == line
        room = k - greater.sum(1, keepdim=True)
        chosen = greater | (equal & (equal.cumsum(1) <= room))
        offsets[tied] = chosen.nonzero()[:, 1].view(-1, k)
    return offsets.sort(dim=1).values


class _SparseCodec(Codec):
    """Top-k per chunk with chunk offsets and 2-bit values (see the module docstring)."""

    name = "sparse2"

    def __init__(self, chunk: int = 4096, k: int = 64) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= MAX_CHUNK:
            raise ValueError(f"sparse chunk must be an int in [2, {MAX_CHUNK}], got {chunk!r}")
        high = min(chunk, _MAX_COUNT)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= high:
            raise ValueError(f"sparse k must be an int in [1, {high}], got {k!r}")
        self.chunk = chunk
        self.k = k

    def __repr__(self) -> str:
        return f"SparseCodec(chunk={self.chunk}, k={self.k})"

    def _top_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, values), each (chunks, k): every chunk's top k by |x|, offsets sorted;
        a short last chunk is padded with zeros, which are never kept."""
        n, chunk, k = flat.numel(), self.chunk, self.k
        full, tail, tail_k = chunk_quotas(n, chunk, k)
        offsets, values = [], []
        rows_per_slab = max(1, _CHUNK_ELEMENTS // chunk)  # a slab of rows stays in cache
        for row in range(0, full, rows_per_slab):
            rows = flat[row * chunk : min(full, row + rows_per_slab) * chunk].view(-1, chunk)
            top = _top_offsets(rows.abs(), k)
            offsets.append(top)
            values.append(rows.gather(1, top))
        if tail:
            rest = flat[full * chunk :]
            top = _top_offsets(rest.abs().unsqueeze(0), tail_k).squeeze(0)
            offsets.append(torch.cat((top, top.new_zeros(k - tail_k))).unsqueeze(0))
            values.append(torch.cat((rest[top], rest.new_zeros(k - tail_k))).unsqueeze(0))
        return torch.cat(offsets), torch.cat(values)

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat = _flat_fp32(tensor)
        meta = {"chunk": self.chunk, "k": self.k, "nnz": 0}
        if flat.numel() == 0:
            return EncodedTensor(self.name, _shape_of(tensor), meta, b"")
        offsets, values = self._top_rows(flat)
        if not bool(torch.isfinite(values).all()):  # NaN and Inf sort as the largest
            raise ValueError("sparse2 cannot encode non-finite values")
        magnitude = values.abs()
        kept = magnitude > 0
        # Levels as transmitted (bf16), then each value takes the nearer one (ties: lo).
        levels = _fit_levels(magnitude, kept).clamp_(max=_BF16_MAX).to(torch.float32).to(torch.bfloat16)
        lo, hi = levels.to(torch.float32).unbind(1)
        pick_hi = (hi.unsqueeze(1) - magnitude).abs() < (magnitude - lo.unsqueeze(1)).abs()
        codes = pick_hi.to(torch.uint8) | (values < 0).to(torch.uint8) << 1
        counts = kept.sum(1)
        meta["nnz"] = int(counts.sum())
        width = index_bits(self.chunk)
        payload = (
            counts.numpy().astype("<u2").tobytes()
            + _to_le_bytes(levels)
            + _pack_bits(offsets[kept].numpy(), width)
            + _pack_bits(codes[kept].numpy(), 2)
        )
        return EncodedTensor(self.name, _shape_of(tensor), meta, payload)

    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        _check_meta_keys(meta, {"chunk", "k", "nnz"}, self.name)
        chunk = _meta_int(meta, "chunk", 2, MAX_CHUNK)
        k = _meta_int(meta, "k", 1, min(chunk, _MAX_COUNT))
        full, tail, tail_k = chunk_quotas(numel, chunk, k)
        nnz = _meta_int(meta, "nnz", 0, full * k + tail_k)
        num_chunks = full + (tail > 0)
        return num_chunks * 6 + -(-nnz * index_bits(chunk) // 8) + -(-nnz // 4)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        n = self._check_encoded(encoded)  # the payload size is what shape and meta imply
        chunk, k, nnz = encoded.meta["chunk"], encoded.meta["k"], encoded.meta["nnz"]
        payload = encoded.payload
        full, tail, tail_k = chunk_quotas(n, chunk, k)
        num_chunks = full + (tail > 0)
        # counts: each within its chunk's quota, and they add up to the header's nnz
        counts = _from_le(payload, "<u2", num_chunks).to(torch.int64)
        quota = torch.full((num_chunks,), k, dtype=torch.int64)
        if tail:
            quota[-1] = tail_k
        if bool((counts > quota).any()):
            chunk_id = int(torch.nonzero(counts > quota)[0])
            raise ValueError(
                f"sparse2 chunk {chunk_id} keeps {int(counts[chunk_id])}, "
                f"more than its {int(quota[chunk_id])}"
            )
        if int(counts.sum()) != nnz:
            raise ValueError(f"sparse2 counts add up to {int(counts.sum())}, meta says {nnz}")
        levels = _from_le(payload, "<i2", 2 * num_chunks, 2 * num_chunks)
        levels = levels.view(torch.bfloat16).to(torch.float32)  # exact
        if not bool(torch.isfinite(levels).all()):
            raise ValueError("sparse2 levels are non-finite (NaN or Inf)")
        # offsets: inside their chunk and strictly increasing in it (so unique)
        start = 6 * num_chunks
        width = index_bits(chunk)
        offsets = torch.from_numpy(_unpack_bits(payload, start, nnz, width))
        codes = torch.from_numpy(_unpack_bits(payload, start + -(-nnz * width // 8), nnz, 2))
        chunk_of = torch.repeat_interleave(torch.arange(num_chunks), counts)
        length = torch.full((num_chunks,), chunk, dtype=torch.int64)
        if tail:
            length[-1] = tail
        if bool((offsets >= length[chunk_of]).any()):
            raise ValueError("sparse2 offset is outside its chunk")
        index = chunk_of * chunk + offsets
        if nnz > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError("sparse2 offsets repeat or are not increasing within a chunk")
        # values: a lookup in each chunk's (lo, hi, -lo, -hi); no arithmetic
        lo, hi = levels.view(-1, 2).unbind(1)
        table = torch.stack((lo, hi, -lo, -hi), dim=1).reshape(-1)
        out = torch.zeros(n, dtype=torch.float32)
        out[index] = table[chunk_of * 4 + codes]  # unique indices: deterministic
        return out.reshape(encoded.shape)
