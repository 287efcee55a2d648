"""Codecs by name: `make_codec` builds the one a sender chose, `codec_for` finds the one
that decodes what a peer sent, and `check_layout` vets an untrusted header with it.

The names are `config.CODECS`, so config validation and this registry cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from p2pdiloco.compress.base import Codec
from p2pdiloco.compress.blockwise import _Fp4Codec, _IntCodec
from p2pdiloco.compress.casts import _CastCodec
from p2pdiloco.compress.sparse import _SparseCodec
from p2pdiloco.compress.topk import _TopkCodec
from p2pdiloco.compress.zstd import _ZstdCodec
from p2pdiloco.config import CODECS, CompressConfig


def make_codec(
    name: str,
    *,
    block_size: int = 256,
    topk_fraction: float = 0.05,
    sparse_chunk: int = 4096,
    sparse_k: int = 64,
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
    elif name == "sparse2":
        codec = _SparseCodec(sparse_chunk, sparse_k)
    else:
        raise ValueError(f"unknown codec {name!r}; choose one of {CODECS}")
    return _ZstdCodec(codec) if zstd else codec


def make_codec_from_config(cfg: CompressConfig, *, outer: bool = False) -> Codec:
    """The learner-delta codec of `cfg`, or the outer-gradient one when `outer`."""
    return make_codec(
        cfg.outer_codec if outer else cfg.codec,
        block_size=cfg.block_size,
        topk_fraction=cfg.topk_fraction,
        sparse_chunk=cfg.sparse_chunk,
        sparse_k=min(cfg.outer_sparse_k, cfg.sparse_chunk) if outer else cfg.sparse_k,
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
