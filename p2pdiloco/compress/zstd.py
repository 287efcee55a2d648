"""The optional lossless zstd stage on top of any codec, and its bounds against bombs.

A zstd payload may declare at most `MAX_ZSTD_RATIO` times its own size and is
decompressed in bounded slices to exactly that size, so a few KiB from the network can
never cost a receiver GiBs; the ratio is checked from the header, before decompression.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import zstandard

from p2pdiloco.compress.base import _NO_LIMIT, Codec, EncodedTensor, _checked_numel

ZSTD_LEVEL = 3
MAX_ZSTD_RATIO = 256
"""Largest decoded/compressed size ratio a zstd payload may declare. Real deltas compress
1-3x; zeros reach ~30,000x, which would let a few KiB cost a receiver GiBs. Encoders fall
back to the plain payload above it, so an honest peer never hits this limit."""
ZSTD_RATIO_FREE_BYTES = 4096
"""Decoded sizes up to this many bytes pass whatever their ratio (tiny tensors compress well)."""
_ZSTD_INPUT_SLICE = 1 << 16  # compressed bytes fed per step; output is checked after each


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
