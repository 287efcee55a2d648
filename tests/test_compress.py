"""Codecs round-trip every shape within their error bounds; error feedback loses nothing."""

from __future__ import annotations

import ast
import io
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco import compress, config
from p2pdiloco.compress import (
    CODECS,
    EncodedTensor,
    ErrorFeedback,
    check_layout,
    decode_tensor,
    decode_tensors,
    encode_tensors,
    make_codec,
    make_codec_from_config,
)
from p2pdiloco.config import CompressConfig
from p2pdiloco.errors import ConfigError

SHAPES = [(), (0,), (1,), (7,), (257,), (3, 5, 7), (2, 0, 3), (64, 300)]
BLOCK_CODECS = ("int8", "int4", "fp4")


def gaussian(shape: tuple[int, ...], seed: int = 0, std: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * std


def rel_error(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return float((decoded - original).norm() / original.norm())


# The transmitted fp16 scale may differ from absmax / qmax by half an fp16 ulp.
HALF_STEP = 0.5 * (1 + 2.0**-10)


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of the element's block (what the blockwise codecs scale by)."""
    flat = x.reshape(-1)
    padded = torch.zeros(math.ceil(flat.numel() / block) * block)
    padded[: flat.numel()] = flat
    amax = padded.view(-1, block).abs().amax(1)
    return amax.repeat_interleave(block)[: flat.numel()]


# ---------------------------------------------------------------------------------------
# the interface


def _string_literals(module: ModuleType) -> set[str]:
    """Every string constant in a module's source: candidate codec names."""
    tree = ast.parse(Path(module.__file__).read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _config_accepts(field: str, name: str) -> bool:
    """Whether `CompressConfig` validation lets `field` be `name`."""
    try:
        CompressConfig(**{field: name})
    except ConfigError:
        return False
    return True


def _compress_implements(name: str) -> bool:
    """Whether `make_codec` builds a codec called `name` (and it says so)."""
    try:
        codec = make_codec(name)
    except ValueError:
        return False
    assert codec.name == name
    return True


def test_codec_names_match_the_config() -> None:
    """The names config validation accepts are exactly the codecs the compress package builds.

    `compress.CODECS` is `config.CODECS` (one tuple), so comparing them proves nothing: both
    sets are found by trying every string literal of either module, one through
    `CompressConfig`'s validation, the other through `make_codec`.
    """
    candidates = _string_literals(config) | _string_literals(compress)
    implemented = {name for name in candidates if _compress_implements(name)}
    assert {"fp32", "int8", "topk"} <= implemented
    for field in ("codec", "outer_codec"):
        accepted = {name for name in candidates if _config_accepts(field, name)}
        assert accepted == implemented, f"compress.{field}: {accepted ^ implemented}"


def test_unknown_codec_and_bad_parameters_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("int3")
    with pytest.raises(ValueError, match="block_size"):
        make_codec("int8", block_size=0)
    with pytest.raises(ValueError, match="fraction"):
        make_codec("topk", topk_fraction=0.0)


@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", CODECS)
def test_every_codec_round_trips_every_shape(name: str, shape: tuple[int, ...], zstd: bool) -> None:
    x = gaussian(shape)
    codec = make_codec(name, zstd=zstd)
    encoded = codec.encode(x)
    assert encoded.codec == name and encoded.shape == shape
    assert check_layout(encoded.codec, encoded.shape, encoded.meta, encoded.nbytes) is None
    for decoder in (codec.decode, lambda e: decode_tensor(e, expected_shape=shape)):
        decoded = decoder(encoded)
        assert decoded.dtype == torch.float32 and decoded.shape == x.shape
        assert bool(torch.isfinite(decoded).all())


def test_fp32_is_exact_and_accepts_other_dtypes_and_strides() -> None:
    x = gaussian((33, 17))
    assert torch.equal(decode_tensor(make_codec("fp32").encode(x)), x)
    strided = x.t()  # not contiguous
    assert torch.equal(decode_tensor(make_codec("fp32").encode(strided)), strided)
    half = x.to(torch.bfloat16)
    assert torch.equal(decode_tensor(make_codec("bf16").encode(half)), half.float())


def test_fp16_and_bf16_are_within_half_an_ulp() -> None:
    x = gaussian((10_000,))
    x16 = decode_tensor(make_codec("fp16").encode(x))
    bf = decode_tensor(make_codec("bf16").encode(x))
    assert bool(((x16 - x).abs() <= x.abs() * 2.0**-11 + 2.0**-25).all())
    assert bool(((bf - x).abs() <= x.abs() * 2.0**-8).all())


def test_fp16_saturates_instead_of_overflowing() -> None:
    decoded = decode_tensor(make_codec("fp16").encode(torch.tensor([1e6, -1e9, 3.0])))
    assert decoded.tolist() == [65504.0, -65504.0, 3.0]


def test_payload_is_little_endian() -> None:
    encoded = make_codec("fp32").encode(torch.tensor([1.0]))
    assert encoded.payload == b"\x00\x00\x80\x3f"


# ---------------------------------------------------------------------------------------
# blockwise codecs


def test_int8_error_is_under_one_percent_and_within_half_a_step() -> None:
    x = gaussian((1000, 257), std=1e-2)
    decoded = decode_tensor(make_codec("int8").encode(x))
    assert rel_error(decoded, x) < 0.01
    step = block_absmax(x, 256) / 127
    assert bool(((decoded - x).reshape(-1).abs() <= step * HALF_STEP + 1e-12).all())


def test_int4_and_fp4_errors_are_bounded() -> None:
    x = gaussian((1000, 256))
    int4 = decode_tensor(make_codec("int4").encode(x))
    fp4 = decode_tensor(make_codec("fp4").encode(x))
    assert rel_error(int4, x) < 0.15
    assert rel_error(fp4, x) < 0.25
    step = block_absmax(x, 256) / 7
    assert bool(((int4 - x).reshape(-1).abs() <= step * HALF_STEP).all())


def test_fp4_picks_the_nearest_e3m0_level() -> None:
    x = gaussian((40, 256), seed=3)
    decoded = decode_tensor(make_codec("fp4").encode(x)).reshape(-1)
    scale = block_absmax(x, 256).half().float()  # as transmitted: fp16 scales
    levels = torch.tensor([0.0] + [2.0**-e for e in range(6, -1, -1)])
    t = x.reshape(-1).abs() / scale
    nearest = levels[(t.unsqueeze(1) - levels).abs().argmin(1)] * scale * x.reshape(-1).sign()
    torch.testing.assert_close(decoded, nearest, rtol=0, atol=0)


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_bytes_per_param_at_block_256(name: str) -> None:
    x = gaussian((1 << 20,))
    per_param = make_codec(name).encode(x).nbytes / x.numel()
    assert per_param <= (1.02 if name == "int8" else 0.52)


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_all_zero_blocks_decode_to_zero_without_nan(name: str) -> None:
    x = torch.zeros(3 * 256 + 5)
    x[300] = 2.5  # one nonzero block among zero ones, and a short zero tail
    decoded = decode_tensor(make_codec(name).encode(x))
    assert bool(torch.isfinite(decoded).all())
    assert float(decoded[300]) == pytest.approx(2.5, rel=1e-3)
    assert int((decoded != 0).sum()) == 1


@pytest.mark.parametrize("std", [1e-9, 1e-1, 1e8])
def test_scales_fall_back_to_fp32_outside_the_fp16_normal_range(std: float) -> None:
    x = gaussian((4096,), std=std)
    encoded = make_codec("int8").encode(x)
    assert encoded.meta["scale"] == ("fp16" if std == 1e-1 else "fp32")
    assert rel_error(decode_tensor(encoded), x) < 0.01


def test_block_size_comes_from_meta_not_from_the_decoder() -> None:
    x = gaussian((1000,))
    encoded = make_codec("int4", block_size=64, scale_dtype="fp32").encode(x)
    assert encoded.meta == {"block": 64, "scale": "fp32"}
    assert encoded.nbytes == math.ceil(1000 / 64) * 4 + 500
    torch.testing.assert_close(make_codec("int4").decode(encoded), decode_tensor(encoded))


@settings(max_examples=examples(60), deadline=None)
@given(
    name=st.sampled_from(BLOCK_CODECS),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    block=st.sampled_from([2, 3, 16, 256]),
    log_std=st.integers(-12, 6),
    seed=st.integers(0, 2**16),
)
def test_blockwise_codecs_stay_within_half_a_step(
    name: str, shape: tuple[int, ...], block: int, log_std: int, seed: int
) -> None:
    x = gaussian(shape, seed=seed, std=10.0**log_std)
    encoded = make_codec(name, block_size=block).encode(x)
    assert check_layout(name, shape, encoded.meta, encoded.nbytes) is None
    decoded = decode_tensor(encoded, expected_shape=shape)
    assert decoded.shape == x.shape and bool(torch.isfinite(decoded).all())
    if x.numel() == 0:
        return
    amax = block_absmax(x, block)
    err = (decoded - x).reshape(-1).abs()
    if name == "fp4":  # the widest gap between E3M0 levels is between 0.5 and 1
        assert bool((err <= amax * 0.2501 + 1e-30).all())
    else:
        qmax = 127 if name == "int8" else 7
        assert bool((err <= amax / qmax * HALF_STEP + 1e-30).all())


# ---------------------------------------------------------------------------------------
# topk


@pytest.mark.parametrize("n", [10, 1000, 300_000])
def test_topk_keeps_exactly_the_largest_entries(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    # distinct magnitudes in [1, 2]: every kept value has a nonzero int8 code
    magnitudes = 1.0 + torch.randperm(n, generator=generator).float() / n
    signs = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    x = magnitudes * signs
    encoded = make_codec("topk", topk_fraction=0.05).encode(x)
    k = math.ceil(0.05 * n)
    assert encoded.meta["k"] == k
    decoded = decode_tensor(encoded)
    expected = set(torch.topk(x.abs(), k).indices.tolist())
    assert set(torch.nonzero(decoded).view(-1).tolist()) == expected
    kept = torch.tensor(sorted(expected))
    assert bool(((decoded[kept] - x[kept]).abs() <= 2.0 / 254 + 1e-6).all())


def test_topk_is_exact_when_the_strided_sample_misses_the_top() -> None:
    n = 1 << 18
    x = torch.zeros(n)
    x[1::4096] = torch.arange(1, n // 4096 + 1).float()  # the sample (stride 4) sees only zeros
    decoded = decode_tensor(make_codec("topk", topk_fraction=0.0001).encode(x))
    k = math.ceil(0.0001 * n)
    assert set(torch.nonzero(decoded).view(-1).tolist()) == set(torch.topk(x, k).indices.tolist())


def test_topk_index_width_follows_the_largest_gap() -> None:
    x = torch.zeros(200_000)
    x[[5, 100_000]] = 1.0
    encoded = make_codec("topk", topk_fraction=1e-5).encode(x)
    assert encoded.meta == {"k": 2, "index_bytes": 4}
    dense = make_codec("topk", topk_fraction=0.5).encode(gaussian((1000,)))
    assert dense.meta["index_bytes"] == 1


def _topk_payload(gaps: list[int], n: int) -> EncodedTensor:
    payload = (
        torch.tensor([1.0]).numpy().tobytes()
        + torch.tensor(gaps, dtype=torch.int32).numpy().tobytes()
        + bytes([1] * len(gaps))
    )
    return EncodedTensor("topk", (n,), {"k": len(gaps), "index_bytes": 4}, payload)


def test_topk_rejects_repeated_or_out_of_range_indices() -> None:
    assert decode_tensor(_topk_payload([0, 3], 10))[3] == 1.0
    with pytest.raises(ValueError, match="repeat"):
        decode_tensor(_topk_payload([2, 0], 10))
    with pytest.raises(ValueError, match="outside"):
        decode_tensor(_topk_payload([2, 8], 10))


# ---------------------------------------------------------------------------------------
# layout checks and zstd


def test_check_layout_names_what_is_wrong() -> None:
    good = make_codec("int8").encode(gaussian((300,)))
    assert check_layout("int8", (300,), good.meta, good.nbytes) is None
    assert "implies" in check_layout("int8", (300,), good.meta, good.nbytes + 1)
    assert "unknown codec" in check_layout("int9", (300,), good.meta, good.nbytes)
    assert "unknown meta key" in check_layout("int8", (300,), {**good.meta, "x": 1}, 10)
    assert "block" in check_layout("int8", (300,), {"block": "256", "scale": "fp16"}, 10)
    assert "scale" in check_layout("int8", (300,), {"block": 256, "scale": "fp8"}, 10)
    assert "index_bytes" in check_layout("topk", (10,), {"k": 1, "index_bytes": 3}, 8)
    assert "'k'" in check_layout("topk", (10,), {"k": 11, "index_bytes": 1}, 26)
    assert check_layout("fp32", (2, 3), {}, 24) is None
    assert "unknown meta key" in check_layout("fp32", (2, 3), {"block": 1}, 24)


def test_zstd_stage_is_lossless_and_shrinks_redundant_payloads() -> None:
    x = torch.zeros(10_000)
    x[torch.randperm(10_000, generator=torch.Generator().manual_seed(0))[:100]] = 1.0
    plain, packed = make_codec("int8").encode(x), make_codec("int8", zstd=True).encode(x)
    assert packed.meta == {**plain.meta, "zstd": True} and packed.nbytes < plain.nbytes / 10
    assert torch.equal(decode_tensor(packed), decode_tensor(plain))


def test_past_the_ratio_limit_the_encoder_sends_plain_and_the_decoder_refuses_zstd() -> None:
    zeros = torch.zeros(1 << 16)  # 256 KiB of fp32 zeros compress ~3000:1
    sent = make_codec("fp32", zstd=True).encode(zeros)
    assert "zstd" not in sent.meta and sent.nbytes == 4 << 16
    assert torch.equal(make_codec("fp32", zstd=True).decode(sent), zeros)
    bomb = zstandard.ZstdCompressor().compress(bytes(4 << 16))
    reason = check_layout("fp32", (1 << 16,), {"zstd": True}, len(bomb))
    assert reason is not None and "MAX_ZSTD_RATIO" in reason
    with pytest.raises(ValueError, match="MAX_ZSTD_RATIO"):
        decode_tensor(EncodedTensor("fp32", (1 << 16,), {"zstd": True}, bomb))
    small = zstandard.ZstdCompressor().compress(bytes(4096))  # tiny tensors pass any ratio
    assert decode_tensor(EncodedTensor("fp32", (1024,), {"zstd": True}, small)).abs().sum() == 0


@pytest.mark.parametrize(
    "payload",
    [
        lambda frame: frame + b"\x00",  # trailing bytes after the frame
        lambda frame: frame + frame,  # a second frame
        lambda frame: frame[:-3],  # truncated
    ],
    ids=["trailing", "two-frames", "truncated"],
)
def test_a_zstd_payload_is_exactly_one_complete_frame(payload: Any) -> None:
    x = torch.randn(2000)
    frame = make_codec("fp32", zstd=True).encode(x).payload
    with pytest.raises(ValueError, match="zstd"):
        decode_tensor(EncodedTensor("fp32", (2000,), {"zstd": True}, payload(frame)))


def test_zstd_frames_that_lie_about_their_size_are_refused() -> None:
    meta = {"zstd": True}
    huge = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # claims 1 MiB
    with pytest.raises(ValueError, match="declares"):
        decode_tensor(EncodedTensor("fp32", (4,), meta, huge))
    with pytest.raises(ValueError, match="zstd"):
        decode_tensor(EncodedTensor("fp32", (4,), meta, b"\x28\xb5\x2f\xfd garbage"))
    assert "zstd payload" in check_layout("fp32", (4,), meta, 0)


# ---------------------------------------------------------------------------------------
# helpers and config


def test_encode_and_decode_tensors_by_name() -> None:
    named = {"w": gaussian((4, 4)), "b": gaussian((4,))}
    encoded = encode_tensors(make_codec("fp32"), named)
    assert list(encoded) == ["w", "b"]
    decoded = decode_tensors(encoded)
    assert all(torch.equal(decoded[k], named[k]) for k in named)
    bad = {"w": EncodedTensor("fp32", (4,), {}, b"short")}
    with pytest.raises(ValueError, match="'w'"):
        decode_tensors(bad)


def test_make_codec_from_config() -> None:
    cfg = CompressConfig(codec="int4", outer_codec="fp4", block_size=64, zstd=True)
    inner = make_codec_from_config(cfg).encode(gaussian((100,)))
    outer = make_codec_from_config(cfg, outer=True).encode(gaussian((100,)))
    assert (inner.codec, inner.meta["block"], inner.meta["zstd"]) == ("int4", 64, True)
    assert outer.codec == "fp4"
    topk = make_codec_from_config(CompressConfig(codec="topk", topk_fraction=0.1))
    assert topk.encode(gaussian((100,))).meta["k"] == 10


# ---------------------------------------------------------------------------------------
# error feedback


def _run_feedback(codec_name: str, steps: int, feedback: ErrorFeedback | None) -> list[float]:
    """Relative error of the sum of decoded deltas vs the sum of true deltas, per step."""
    codec = make_codec(codec_name, topk_fraction=0.02)
    generator = torch.Generator().manual_seed(0)
    drift = torch.randn(2000, generator=generator) * 0.1
    true_sum, sent_sum, errors = torch.zeros(2000), torch.zeros(2000), []
    for _ in range(steps):
        delta = drift + torch.randn(2000, generator=generator)
        true_sum += delta
        sent_sum += decode_tensors(encode_tensors(codec, {"d": delta}, feedback))["d"]
        errors.append(rel_error(sent_sum, true_sum))
    return errors


@pytest.mark.parametrize("name", ["topk", "int4", "fp4"])
def test_error_feedback_makes_the_sum_of_deltas_converge(name: str) -> None:
    with_feedback = _run_feedback(name, 300, ErrorFeedback())
    without = _run_feedback(name, 300, None)
    # once the residual stops growing the error of the sum shrinks like 1 / steps
    assert with_feedback[-1] < 0.25 * with_feedback[29]
    assert with_feedback[-1] < 0.2 * without[-1]


def test_error_feedback_residual_is_exactly_what_was_not_sent() -> None:
    feedback, codec = ErrorFeedback(), make_codec("topk", topk_fraction=0.1)
    delta = gaussian((50,))
    sent = decode_tensor(encode_tensors(codec, {"d": delta}, feedback)["d"])
    torch.testing.assert_close(sent + feedback.residual("d"), delta)
    torch.testing.assert_close(feedback.compensate("d", delta), 2 * delta - sent)
    with pytest.raises(ValueError, match="shape"):
        feedback.compensate("d", gaussian((51,)))


def test_error_feedback_survives_a_restart() -> None:
    feedback = ErrorFeedback()
    feedback.update("a", gaussian((3, 3)), torch.zeros(3, 3))
    buffer = io.BytesIO()
    torch.save(feedback.state_dict(), buffer)
    buffer.seek(0)
    restored = ErrorFeedback()
    restored.load_state_dict(torch.load(buffer))
    assert torch.equal(restored.residual("a"), feedback.residual("a"))
    restored.reset("a")
    assert restored.residual("a") is None and feedback.residual("a") is not None

