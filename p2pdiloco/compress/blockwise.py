"""Blockwise absmax codecs: int8, int4 and fp4, one scale per block of elements.

    int8 / int4   code = round(x / scale), scale = absmax / qmax (qmax 127 or 7)
    fp4           E3M0 (sign + 3-bit exponent): +-absmax * 2^-e, e in 0..6, or 0

They share one payload (scales, then codes) and one chunked encode/decode loop; each
codec says only how a scale follows from the absmax and how codes are made and read.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from p2pdiloco.compress.base import (
    _CHUNK_ELEMENTS,
    _FP16_MAX,
    _FP16_MIN_NORMAL,
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

_MAX_BLOCK = 1 << 20


class _BlockCodec(Codec):
    """Absmax scale per block of `block_size` elements; payload = scales, then codes.

    Scales are stored as fp16 when every nonzero one is a normal fp16 (`scale_dtype="auto"`),
    else fp32, so tiny late-training deltas never lose their scale to fp16 underflow.
    Codes are computed against the scale *as transmitted*, so rounding the scale to fp16
    adds no error beyond a slightly different step size.
    """

    bits: int
    """Bits per code (8 or 4)."""

    def __init__(self, block_size: int = 256, scale_dtype: str = "auto") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(f"block_size must be an int, got {block_size!r}")
        if not 1 <= block_size <= _MAX_BLOCK:
            raise ValueError(f"block_size must be in [1, {_MAX_BLOCK}], got {block_size}")
        if scale_dtype not in ("auto", "fp16", "fp32"):
            raise ValueError(f"scale_dtype must be auto, fp16 or fp32, got {scale_dtype!r}")
        self.block_size = block_size
        self.scale_dtype = scale_dtype

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, scale_dtype={self.scale_dtype!r})"
        )

    # what each codec defines
    @abstractmethod
    def _scale_from_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        """The per-block scale to transmit, from the per-block absmax."""

    @abstractmethod
    def _quantize(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """int8 codes for `rows` (blocks, block) under per-block `scale` (blocks,)."""

    @abstractmethod
    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        """Write codes (blocks, block) times per-block scale into `out` (blocks, block)."""

    def _pack(self, codes: torch.Tensor) -> bytes:
        return _to_le_bytes(codes)

    def _unpack(self, payload: bytes, numel: int, offset: int) -> torch.Tensor:
        return _from_le(payload, "<i1", numel, offset)

    def _codes_bytes(self, numel: int) -> int:
        return numel * self.bits // 8 if self.bits == 8 else (numel + 1) // 2

    # shared machinery
    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        _check_meta_keys(meta, {"block", "scale"}, self.name)
        block = _meta_int(meta, "block", 1, _MAX_BLOCK)
        if meta.get("scale") not in ("fp16", "fp32"):
            raise ValueError(f"meta 'scale' must be 'fp16' or 'fp32', got {meta.get('scale')!r}")
        scale_bytes = 2 if meta["scale"] == "fp16" else 4
        return -(-numel // block) * scale_bytes + self._codes_bytes(numel)

    def _block_absmax(self, flat: torch.Tensor) -> torch.Tensor:
        """Absmax of every block, the last one possibly short, without a full-size temporary."""
        n, block = flat.numel(), self.block_size
        full = n - n % block
        parts = []
        if full:
            rows = flat[:full].view(-1, block)
            # amax and amin separately: aminmax(dim=) is several times slower on CPU
            parts.append(torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()))
        if full < n:
            parts.append(flat[full:].abs().amax().reshape(1))
        return torch.cat(parts) if parts else flat.new_empty(0)

    def _transmitted_scale(self, absmax: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The fp32 value of the scales as the receiver will see them, and their dtype."""
        scale = self._scale_from_absmax(absmax)
        kind = self.scale_dtype
        if kind == "auto":
            nonzero = scale[scale != 0]
            fits = nonzero.numel() == 0 or bool(
                (nonzero.amin() >= _FP16_MIN_NORMAL) & (nonzero.amax() <= _FP16_MAX)
            )
            kind = "fp16" if fits else "fp32"
        if kind == "fp16":
            scale = scale.clamp(max=_FP16_MAX).to(torch.float16).to(torch.float32)
        return scale, kind

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat = _flat_fp32(tensor)
        n, block = flat.numel(), self.block_size
        scale, kind = self._transmitted_scale(self._block_absmax(flat))
        codes = torch.zeros(n + (n & 1), dtype=torch.int8)  # even length: two nibbles a byte
        full = n - n % block
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // block)
        for row in range(0, full // block, rows_per_chunk):
            rows = flat[row * block : min(full, (row + rows_per_chunk) * block)].view(-1, block)
            chunk = self._quantize(rows, scale[row : row + rows.shape[0]])
            codes[row * block : row * block + chunk.numel()] = chunk.view(-1)
        if full < n:  # the short last block, zero-padded (zeros change no absmax)
            tail = torch.zeros(1, block)
            tail[0, : n - full] = flat[full:]
            codes[full:n] = self._quantize(tail, scale[-1:]).view(-1)[: n - full]
        scale_bytes = _to_le_bytes(scale.to(torch.float16) if kind == "fp16" else scale)
        meta = {"block": block, "scale": kind}
        return EncodedTensor(
            self.name,
            _shape_of(tensor),
            meta,
            scale_bytes + self._pack(codes[:n] if self.bits == 8 else codes),
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        n = self._check_encoded(encoded)
        block = encoded.meta["block"]
        num_blocks = -(-n // block)
        fp16 = encoded.meta["scale"] == "fp16"
        scale = _from_le(encoded.payload, "<f2" if fp16 else "<f4", num_blocks).to(torch.float32)
        codes = self._unpack(encoded.payload, n, num_blocks * (2 if fp16 else 4))
        out = torch.empty(n, dtype=torch.float32)
        full = n - n % block
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // block)
        for row in range(0, full // block, rows_per_chunk):
            lo = row * block
            hi = min(full, (row + rows_per_chunk) * block)
            self._dequantize(
                codes[lo:hi].view(-1, block),
                scale[row : row + (hi - lo) // block],
                out[lo:hi].view(-1, block),
            )
        if full < n:
            self._dequantize(codes[full:n].view(1, -1), scale[-1:], out[full:n].view(1, -1))
        return out.reshape(encoded.shape)


class _IntCodec(_BlockCodec):
    """Symmetric integer codes in [-qmax, qmax], qmax = 2^(bits-1) - 1, round to nearest."""

    def __init__(
        self, name: str, bits: int, block_size: int = 256, scale_dtype: str = "auto"
    ) -> None:
        super().__init__(block_size, scale_dtype)
        self.name = name
        self.bits = bits
        self._qmax = float(2 ** (bits - 1) - 1)

    def _scale_from_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        return absmax / self._qmax

    def _quantize(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = rows * _safe_inverse(scale).unsqueeze(1)
        # clamp: the transmitted (fp16-rounded) scale may be a hair below absmax / qmax
        return scaled.round_().clamp_(-self._qmax, self._qmax).to(torch.int8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        # code -> fp32 is exact, then one correctly rounded multiply: bit-identical everywhere
        torch.mul(codes, scale.unsqueeze(1), out=out)

    def _pack(self, codes: torch.Tensor) -> bytes:
        if self.bits == 8:
            return _to_le_bytes(codes)
        pairs = codes.view(-1, 2)  # element 2i in the low nibble, 2i+1 in the high one
        return _to_le_bytes((pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4))

    def _unpack(self, payload: bytes, numel: int, offset: int) -> torch.Tensor:
        if self.bits == 8:
            return _from_le(payload, "<i1", numel, offset)
        packed = _from_le(payload, "<i1", (numel + 1) // 2, offset)
        # arithmetic shifts sign-extend the two's-complement nibbles
        low, high = (packed << 4) >> 4, packed >> 4
        return torch.stack((low, high), dim=1).view(-1)[:numel]


# fp4 E3M0: nibble = sign << 3 | m; m = 0 is zero, m = 1..7 is absmax * 2^(m - 7).
_FP4_LEVELS = torch.tensor([0.0] + [2.0 ** (m - 7) for m in range(1, 8)])
_FP4_TABLE = torch.cat((_FP4_LEVELS, -_FP4_LEVELS))
# Nearest level in linear space (least squared error). With t = |x| / absmax <= 1, the
# midpoint between 2^j and 2^(j+1) is 1.5 * 2^j, and the one between 0 and 2^-6 is 2^-7:
# every decision boundary is fixed by t's exponent E and first mantissa bit M1, so the code
# is integer arithmetic on q = 2E + M1 (no log, no search): m = clamp(E + M1 - 120, 1, 7)
# for E >= 120 (t >= 2^-7), else 0.


class _Fp4Codec(_BlockCodec):
    """E3M0 (sign + 3-bit exponent) codes, absmax per block, as Streaming DiLoCo sends."""

    name = "fp4"
    bits = 4

    def _scale_from_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        return absmax.clone()

    def _quantize(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # t < 2 always (the scale is absmax up to fp16 rounding), so E <= 127 and q fits a byte
        bits = (rows * _safe_inverse(scale).unsqueeze(1)).view(torch.int32)
        low = (bits >> 22).to(torch.int16)  # ..., sign, E7..E0, M1 (byte-wide ops from here)
        q = low.to(torch.uint8)  # E6..E0, M1 = 2E + M1
        sign = (low >> 6).to(torch.uint8).bitwise_and_(8)  # the sign bit, moved to bit 3
        nonzero = (q >> 4).add_(1).bitwise_right_shift_(4)  # 1 iff q >= 240, i.e. E >= 120
        level = (q + 1).bitwise_right_shift_(1).sub_(120).clamp_(1, 7)  # E + M1 - 120
        # uint8 ops throughout: comparisons and int32 masks cost 3-10x more on CPU
        return level.mul_(nonzero).bitwise_or_(sign).view(torch.int8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        # a table lookup (0 or +-2^-k), then one correctly rounded multiply by the scale
        torch.mul(_FP4_TABLE[codes.long()], scale.unsqueeze(1), out=out)

    def _pack(self, codes: torch.Tensor) -> bytes:
        pairs = codes.view(-1, 2)
        return _to_le_bytes(pairs[:, 0] | (pairs[:, 1] << 4))

    def _unpack(self, payload: bytes, numel: int, offset: int) -> torch.Tensor:
        packed = _from_le(payload, "<u1", (numel + 1) // 2, offset)
        return torch.stack((packed & 0x0F, packed >> 4), dim=1).view(-1)[:numel]
