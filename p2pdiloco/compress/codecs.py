"""Codecs for deltas and outer gradients, and error feedback for the lossy ones.

Every codec turns an fp32 tensor into an `EncodedTensor` (codec name, shape, a small
`meta` dict of plain values, and a little-endian `payload`) and back. The decoder reads
everything it needs (block size, scale dtype, k, index width) from `meta`, so a peer
decodes whatever a sender chose; `check_layout` says, before a payload is read, whether
its size is what codec, shape and meta imply (the wire calls it on untrusted headers).

Decoding untrusted tensors is bounded before anything is allocated: `decode_tensors`
checks every shape against the layout the caller expects (or, without one, the total
against `MAX_DECODE_ELEMENTS`), and a zstd payload may declare at most `MAX_ZSTD_RATIO`
times its own size and is decompressed in bounded slices to exactly that size.

    fp32 / fp16 / bf16   plain casts (fp16 saturates at +-65504 rather than overflowing)
    int8 / int4          blockwise absmax: code = round(x / scale), scale = absmax / 127 (7)
    fp4                  E3M0 (sign + 3-bit exponent): +-absmax * 2^-e, e in 0..6, or 0
    topk                 the k largest |x|, int8 values with one scale, delta-coded indices
    +zstd                an optional lossless zstd stage on top of any of them

Byte layouts and expected errors are in docs/protocol.md ("Codecs").

Decoding feeds the global state, so every decoder is bit-identical on every CPU kernel set:
exact casts and at most one elementwise multiply per value, no fused op and no
floating-point reduction (docs/arithmetic.md). Encoding runs on one learner and need not be.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from p2pdiloco.config import CODECS, CompressConfig
from p2pdiloco.shapes import check_shape, num_elements

__all__ = [
    "CODECS",
    "MAX_DECODE_ELEMENTS",
    "MAX_ZSTD_RATIO",
    "Codec",
    "EncodedTensor",
    "ErrorFeedback",
    "LazyTensors",
    "check_layout",
    "codec_for",
    "decode_tensor",
    "decode_tensors",
    "encode_tensors",
    "lazy_tensors",
    "make_codec",
    "make_codec_from_config",
]

logger = logging.getLogger(__name__)

_NATIVE_LITTLE = sys.byteorder == "little"
# Elements processed per step of the blockwise loops: big enough that Python overhead is
# negligible, small enough that the fp32 temporaries stay in cache (4 MiB).
_CHUNK_ELEMENTS = 1 << 20
_MAX_BLOCK = 1 << 20
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14
# Above this size topk first filters candidates by a threshold estimated on a strided sample.
_TOPK_DIRECT_MAX = 1 << 16
ZSTD_LEVEL = 3
MAX_DECODE_ELEMENTS = 1 << 28
"""Most elements one `decode_tensors` call materialises when the caller gives no layout."""
MAX_ZSTD_RATIO = 256
"""Largest decoded/compressed size ratio a zstd payload may declare. Real deltas compress
1-3x; zeros reach ~30,000x, which would let a few KiB cost a receiver GiBs. Encoders fall
back to the plain payload above it, so an honest peer never hits this limit."""
ZSTD_RATIO_FREE_BYTES = 4096
"""Decoded sizes up to this many bytes pass whatever their ratio (tiny tensors compress well)."""
_ZSTD_INPUT_SLICE = 1 << 16  # compressed bytes fed per step; output is checked after each
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
# little-endian buffers


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


# ---------------------------------------------------------------------------------------
# blockwise absmax codecs: int8, int4, fp4


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


def _safe_inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 where the scale is 0 (an all-zero block codes to zeros, never 0/0)."""
    return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))


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


# ---------------------------------------------------------------------------------------
# topk


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


# ---------------------------------------------------------------------------------------
# lossless zstd stage


class _ZstdCodec(Codec):
    """`inner`'s payload compressed with zstd; meta gets "zstd": True, the name stays inner's.

    A payload that would compress past `MAX_ZSTD_RATIO` is sent plain (meta without
    "zstd"), which every receiver accepts; this codec decodes both forms.
    """

    def __init__(self, inner: Codec, level: int = ZSTD_LEVEL) -> None:
        self.inner = inner
        self.name = inner.name
        self.level = level

    def __repr__(self) -> str:
        return f"ZstdCodec({self.inner!r})"

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        plain = self.inner.encode(tensor)
        payload = zstandard.ZstdCompressor(level=self.level).compress(plain.payload)
        if _zstd_ratio_refusal(len(plain.payload), len(payload)) is not None:
            return plain
        return EncodedTensor(plain.codec, plain.shape, {**plain.meta, "zstd": True}, payload)

    @staticmethod
    def _is_zstd(meta: Mapping[str, Any]) -> bool:
        return isinstance(meta, Mapping) and "zstd" in meta

    def _inner_meta(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(meta, Mapping) or meta.get("zstd") is not True:
            raise ValueError("meta 'zstd' must be true for a zstd payload")
        return {key: val for key, val in meta.items() if key != "zstd"}

    def raw_payload_bytes(self, numel: int, meta: Mapping[str, Any]) -> int:
        if not self._is_zstd(meta):
            return self.inner.raw_payload_bytes(numel, meta)
        return self.inner.raw_payload_bytes(numel, self._inner_meta(meta))

    def check_layout(self, shape: tuple[int, ...], meta: Mapping[str, Any], nbytes: int) -> None:
        if not self._is_zstd(meta):
            self.inner.check_layout(shape, meta, nbytes)
            return
        raw = self.raw_payload_bytes(_checked_numel(shape, _NO_LIMIT), meta)
        # zstd never expands more than its compress bound (~raw/256 + a frame header)
        bound = raw + (raw >> 7) + 1024
        if not 0 < nbytes <= bound:
            raise ValueError(f"zstd payload is {nbytes} bytes, must be in [1, {bound}]")
        refusal = _zstd_ratio_refusal(raw, nbytes)
        if refusal is not None:
            raise ValueError(refusal)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        if isinstance(encoded, EncodedTensor) and not self._is_zstd(encoded.meta):
            return self.inner.decode(encoded)
        self._check_encoded(encoded)  # layout and ratio, before a byte is decompressed
        raw = self.raw_payload_bytes(math.prod(encoded.shape), encoded.meta)
        plain = _bounded_decompress(encoded.payload, raw)
        inner = EncodedTensor(encoded.codec, encoded.shape, self._inner_meta(encoded.meta), plain)
        return self.inner.decode(inner)


def _zstd_ratio_refusal(raw_bytes: int, zstd_bytes: int) -> str | None:
    """Why `zstd_bytes` may not decode to `raw_bytes` (a compression bomb), or None."""
    if raw_bytes <= max(MAX_ZSTD_RATIO * zstd_bytes, ZSTD_RATIO_FREE_BYTES):
        return None
    return (
        f"zstd payload of {zstd_bytes} bytes declares {raw_bytes} decoded bytes, "
        f"a ratio above MAX_ZSTD_RATIO={MAX_ZSTD_RATIO}"
    )


def _bounded_decompress(payload: bytes, raw_bytes: int) -> bytes:
    """The one zstd frame in `payload`, which must decode to exactly `raw_bytes` bytes.

    The frame's declared size is checked first; then the input is fed in slices and the
    output checked after each, so nothing past `raw_bytes` (plus one slice's worth) is
    ever held, whatever the frame's blocks say. Trailing bytes after the frame are refused.
    """
    try:
        declared = zstandard.get_frame_parameters(payload).content_size
        if declared != raw_bytes:
            raise ValueError(f"zstd frame declares {declared} bytes, expected {raw_bytes}")
        stream = zstandard.ZstdDecompressor().decompressobj()
        parts, size, fed = [], 0, 0
        while fed < len(payload) and not stream.eof:
            part = stream.decompress(payload[fed : fed + _ZSTD_INPUT_SLICE])
            fed += _ZSTD_INPUT_SLICE
            size += len(part)
            if size > raw_bytes:
                raise ValueError(f"zstd payload decompresses past {raw_bytes} bytes")
            parts.append(part)
        complete = stream.eof
        trailing = max(len(payload) - fed, 0) + len(stream.unused_data) if complete else 0
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from None
    if not complete or trailing:
        raise ValueError("zstd payload is not exactly one complete frame")
    if size != raw_bytes:
        raise ValueError(f"zstd payload decompressed to {size} bytes, expected {raw_bytes}")
    return b"".join(parts)


# ---------------------------------------------------------------------------------------
# construction and dispatch


def make_codec(
    name: str,
    *,
    block_size: int = 256,
    topk_fraction: float = 0.05,
    zstd: bool = False,
    scale_dtype: str = "auto",
) -> Codec:
    """The codec called `name` (one of `CODECS`), optionally followed by a zstd stage."""
    codec: Codec
    if name == "fp32":
        codec = _CastCodec("fp32", torch.float32, "<f4")
    elif name == "fp16":
        codec = _CastCodec("fp16", torch.float16, "<f2")
    elif name == "bf16":
        codec = _CastCodec("bf16", torch.bfloat16, "<u2")
    elif name == "int8":
        codec = _IntCodec("int8", 8, block_size, scale_dtype)
    elif name == "int4":
        codec = _IntCodec("int4", 4, block_size, scale_dtype)
    elif name == "fp4":
        codec = _Fp4Codec(block_size, scale_dtype)
    elif name == "topk":
        codec = _TopkCodec(topk_fraction)
    else:
        raise ValueError(f"unknown codec {name!r}; choose one of {CODECS}")
    return _ZstdCodec(codec) if zstd else codec


def make_codec_from_config(cfg: CompressConfig, *, outer: bool = False) -> Codec:
    """The learner-delta codec of `cfg`, or the outer-gradient one when `outer`."""
    return make_codec(
        cfg.outer_codec if outer else cfg.codec,
        block_size=cfg.block_size,
        topk_fraction=cfg.topk_fraction,
        zstd=cfg.zstd,
    )


_DECODERS: dict[str, Codec] = {name: make_codec(name) for name in CODECS}
_ZSTD_DECODERS: dict[str, Codec] = {name: _ZstdCodec(codec) for name, codec in _DECODERS.items()}


def codec_for(codec: str, meta: Mapping[str, Any]) -> Codec:
    """A codec able to decode tensors of name `codec` with `meta`; ValueError if unknown."""
    if not isinstance(codec, str) or codec not in _DECODERS:
        raise ValueError(f"unknown codec {codec!r:.40}")
    zstd = isinstance(meta, Mapping) and "zstd" in meta
    return _ZSTD_DECODERS[codec] if zstd else _DECODERS[codec]


def check_layout(
    codec: str, shape: tuple[int, ...], meta: Mapping[str, Any], nbytes: int
) -> str | None:
    """None if a payload of `nbytes` is what codec, shape and meta imply, else the reason."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        return f"nbytes must be an int, got {type(nbytes).__name__}"
    try:
        codec_for(codec, meta).check_layout(shape, meta, nbytes)
    except ValueError as exc:
        return f"{exc}"
    return None


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


# ---------------------------------------------------------------------------------------
# error feedback


class ErrorFeedback:
    """Per-tensor residuals of a lossy codec, added back into the next delta (SparseLoCo).

    What a codec drops this round is sent in a later one, so the sum of what was decoded
    tracks the sum of the true deltas up to one bounded residual.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """`delta + residual[name]` in fp32 (a copy of `delta` when there is no residual)."""
        delta = delta.detach().to(torch.float32)
        residual = self._residuals.get(name)
        if residual is None:
            return delta.clone()
        if residual.shape != delta.shape:
            raise ValueError(
                f"error feedback for {name!r} has shape {tuple(residual.shape)}, "
                f"delta has {tuple(delta.shape)}"
            )
        return delta + residual.to(delta.device)

    def update(self, name: str, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep `sent_input - decoded`: what the receiver did not get of what we encoded."""
        self._residuals[name] = (
            sent_input.detach().to(torch.float32) - decoded.detach().to(torch.float32)
        ).cpu()

    def residual(self, name: str) -> torch.Tensor | None:
        """The residual kept for `name`, if any."""
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual (e.g. after the fragment was overwritten), or all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by tensor name (copies), for checkpoints."""
        return {name: res.clone() for name, res in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all residuals with those of `state` (as `state_dict` returned)."""
        residuals = {}
        for name, res in state.items():
            if not isinstance(name, str) or not isinstance(res, torch.Tensor):
                raise ValueError(f"error feedback state must map names to tensors, got {name!r}")
            residuals[name] = res.detach().to(device="cpu", dtype=torch.float32).clone()
        self._residuals = residuals
