"""sparse2 keeps the top k of every chunk in 2-bit values, and its decoder checks the whole
layout before it allocates the output."""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.compress import (
    EncodedTensor,
    ErrorFeedback,
    check_layout,
    decode_tensor,
    decode_tensors,
    encode_tensors,
    make_codec,
    make_codec_from_config,
)
from p2pdiloco.compress.sparse import _pack_bits, chunk_quotas, index_bits
from p2pdiloco.config import CompressConfig
from p2pdiloco.errors import ConfigError

BF16_ULP = 2.0**-8  # a level is the fitted value rounded to bf16: within 2^-9 relative


def gaussian(shape: tuple[int, ...], seed: int = 0, std: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * std


def kept_rel_error(decoded: torch.Tensor, x: torch.Tensor) -> float:
    kept = decoded != 0
    decoded, x = decoded.double(), x.double()  # norms of values near fp32's limit
    return float((decoded - x)[kept].norm() / x[kept].norm())


def frame(
    shape: tuple[int, ...],
    chunk: int,
    k: int,
    counts: list[int],
    levels: list[float],
    offsets: list[int],
    codes: list[int],
    nnz: int | None = None,
) -> EncodedTensor:
    """A sparse2 tensor built field by field, as an adversary would."""
    level_bits = torch.tensor(levels, dtype=torch.bfloat16).view(torch.int16).numpy()
    payload = (
        np.array(counts, dtype="<u2").tobytes()
        + level_bits.astype("<i2").tobytes()
        + _pack_bits(np.array(offsets, dtype=np.int64), index_bits(chunk))
        + _pack_bits(np.array(codes, dtype=np.int64), 2)
    )
    meta = {"chunk": chunk, "k": k, "nnz": len(offsets) if nnz is None else nnz}
    return EncodedTensor("sparse2", shape, meta, payload)


# ---------------------------------------------------------------------------------------
# the format


# chunk 8 (3-bit offsets), k 2: a full chunk keeps 2, the short last one (2 elements) 1
GOLDEN = EncodedTensor(
    "sparse2",
    (10,),
    {"chunk": 8, "k": 2, "nnz": 3},
    bytes.fromhex(
        "0200 0100"  # counts 2, 1
        "803f 0040 003f 003f"  # bf16 levels: (1, 2), (0.5, 0.5)
        "7100"  # offsets 1, 6 | 1 in 3 bits each, LSB first, zero padding
        "03"  # codes -hi (sign | hi), +lo | +lo
    ),
)
GOLDEN_VALUES = [0.0, -2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5]


def test_the_byte_layout_is_as_documented() -> None:
    x = torch.tensor(GOLDEN_VALUES)
    assert make_codec("sparse2", sparse_chunk=8, sparse_k=2).encode(x) == GOLDEN
    assert decode_tensor(GOLDEN).tolist() == GOLDEN_VALUES


def test_defaults_keep_64_of_4096_in_under_004_bytes_per_param() -> None:
    x = gaussian((1 << 20,))
    encoded = make_codec("sparse2").encode(x)
    assert encoded.meta == {"chunk": 4096, "k": 64, "nnz": 256 * 64}
    # a chunk: u16 count, two bf16 levels, 64 x 12-bit offsets, 64 x 2-bit codes
    assert encoded.nbytes == 256 * (2 + 4 + 96 + 16)
    assert encoded.nbytes / x.numel() <= 0.04  # >= 100x smaller than fp32
    assert int((decode_tensor(encoded) != 0).sum()) == 256 * 64


@pytest.mark.parametrize(("dist", "bound"), [("gaussian", 0.07), ("laplace", 0.12)])
def test_two_fitted_levels_keep_the_kept_values_within_a_few_percent(
    dist: str, bound: float
) -> None:
    torch.manual_seed(0)
    x = torch.randn(1 << 20) if dist == "gaussian" else torch.empty(1 << 20).exponential_()
    if dist == "laplace":
        x *= torch.randint(0, 2, x.shape).float() * 2 - 1
    assert kept_rel_error(decode_tensor(make_codec("sparse2").encode(x)), x) < bound


def test_short_chunks_keep_the_same_share() -> None:
    # 10,000 = 2 full chunks of 4096 and 1808 elements, which keep ceil(64 * 1808 / 4096) = 29
    assert chunk_quotas(10_000, 4096, 64) == (2, 1808, 29)
    assert make_codec("sparse2").encode(gaussian((10_000,))).meta["nnz"] == 2 * 64 + 29
    assert make_codec("sparse2").encode(gaussian((128,))).meta["nnz"] == 2
    assert make_codec("sparse2").encode(torch.tensor(3.0)).meta["nnz"] == 1


def test_zeros_are_never_kept() -> None:
    x = torch.zeros(3 * 4096 + 7)
    x[5000], x[5001], x[-1] = 1.0, -3.0, 0.25
    encoded = make_codec("sparse2").encode(x)
    assert encoded.meta["nnz"] == 3
    decoded = decode_tensor(encoded)
    assert decoded[5000] == 1.0 and decoded[5001] == -3.0 and decoded[-1] == 0.25
    assert int((decoded != 0).sum()) == 3
    empty = make_codec("sparse2").encode(torch.zeros(2, 0))
    assert empty.payload == b"" and decode_tensor(empty, expected_shape=(2, 0)).shape == (2, 0)


def test_values_near_the_fp32_limit_keep_finite_levels() -> None:
    x = gaussian((5000,), seed=2, std=3e37)  # up to ~1.5e38: sums of 64 overflow fp32
    decoded = decode_tensor(make_codec("sparse2").encode(x), finite=True)
    assert kept_rel_error(decoded, x) < 0.1


def test_non_finite_input_is_refused_when_encoding() -> None:
    for bad in (math.nan, math.inf):
        x = gaussian((5000,))
        x[17] = bad
        with pytest.raises(ValueError, match="non-finite"):
            make_codec("sparse2").encode(x)


def _rows(tensor: torch.Tensor, chunk: int) -> np.ndarray:
    """The flat tensor as (chunks, chunk), the last chunk padded with zeros."""
    flat = tensor.reshape(-1).numpy()
    return np.concatenate((flat, np.zeros(-flat.size % chunk, flat.dtype))).reshape(-1, chunk)


@settings(max_examples=examples(80), deadline=None)
@given(
    shape=st.lists(st.integers(0, 60), min_size=0, max_size=3).map(tuple),
    chunk=st.sampled_from([2, 3, 16, 100, 4096]),
    k_share=st.floats(0.0, 1.0),
    log_std=st.integers(-12, 6),
    rounded=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(shape=(9,), chunk=3, k_share=1.0, log_std=0, rounded=True, seed=0)
def test_each_chunk_keeps_its_top_entries_with_their_signs_between_its_extremes(
    shape: tuple[int, ...], chunk: int, k_share: float, log_std: int, rounded: bool, seed: int
) -> None:
    k = max(1, round(k_share * chunk))
    x = gaussian(shape, seed=seed, std=10.0**log_std)
    if rounded:  # ties and exact zeros
        x = (x / 10.0**log_std).round() * 10.0**log_std
    encoded = make_codec("sparse2", sparse_chunk=chunk, sparse_k=k).encode(x)
    assert check_layout("sparse2", shape, encoded.meta, encoded.nbytes) is None
    decoded = decode_tensor(encoded, expected_shape=shape, finite=True)
    assert decoded.shape == x.shape
    full, tail, tail_k = chunk_quotas(x.numel(), chunk, k)
    quota = np.array([k] * full + ([tail_k] if tail else []), dtype=np.int64)
    values, got = _rows(x, chunk), _rows(decoded, chunk)
    kept = got != 0
    assert kept.sum() == encoded.meta["nnz"]
    assert (kept.sum(1) == np.minimum(quota, (values != 0).sum(1))).all()
    magnitude = np.abs(values)
    low = np.where(kept, magnitude, np.inf).min(1, keepdims=True)
    high = np.where(kept, magnitude, 0.0).max(1, keepdims=True)
    assert (np.where(kept, 0.0, magnitude) <= low).all()  # the top ones, in every chunk
    assert (np.sign(got) == np.sign(values))[kept].all()
    assert (np.abs(got) >= low * (1 - BF16_ULP))[kept].all()
    assert (np.abs(got) <= high * (1 + BF16_ULP))[kept].all()


def test_error_feedback_makes_the_sum_of_sparse_deltas_converge() -> None:
    codec, feedback = make_codec("sparse2", sparse_chunk=1000, sparse_k=20), ErrorFeedback()
    generator = torch.Generator().manual_seed(0)
    drift = torch.randn(2000, generator=generator) * 0.1
    true_sum, sent_sum, errors = torch.zeros(2000), torch.zeros(2000), []
    for _ in range(300):
        delta = drift + torch.randn(2000, generator=generator)
        true_sum += delta
        sent_sum += decode_tensors(encode_tensors(codec, {"d": delta}, feedback))["d"]
        errors.append(float((sent_sum - true_sum).norm() / true_sum.norm()))
    assert errors[-1] < 0.25 * errors[29]


# ---------------------------------------------------------------------------------------
# determinism


def test_same_input_same_bytes_whatever_the_threads() -> None:
    x = gaussian((3, 50_000), seed=4)
    codec = make_codec("sparse2")
    first = codec.encode(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert codec.encode(x) == first
        torch.set_num_threads(2)
        assert codec.encode(x.clone()) == first
    finally:
        torch.set_num_threads(threads)


_DECODE_WORKER = """
import hashlib, sys
import torch
from p2pdiloco.compress import EncodedTensor, decode_tensor
payload = open(sys.argv[1], "rb").read()
encoded = EncodedTensor("sparse2", (300_000,), {"chunk": 4096, "k": 64, "nnz": int(sys.argv[2])}, payload)
print(torch.backends.cpu.get_cpu_capability(), hashlib.sha256(decode_tensor(encoded).numpy().tobytes()).hexdigest())
"""


def test_decoding_is_bit_identical_under_every_cpu_kernel_set(tmp_path: Path) -> None:
    encoded = make_codec("sparse2").encode(gaussian((300_000,), seed=9, std=1e-3))
    path = tmp_path / "payload"
    path.write_bytes(encoded.payload)
    expected = hashlib.sha256(decode_tensor(encoded).numpy().tobytes()).hexdigest()
    root = str(Path(__file__).resolve().parents[1])
    for capability in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        command = [sys.executable, "-c", _DECODE_WORKER, str(path), str(encoded.meta["nnz"])]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        kernels, digest = done.stdout.split()
        assert capability is None or kernels == "DEFAULT"
        assert digest == expected, f"decoded bits differ under {kernels}"


def test_ties_at_the_kth_value_go_to_the_lowest_offsets() -> None:
    """Which of several equal |x| torch.topk takes is up to its kernel; an outer update is
    re-encoded by auditors, so encoding has one answer: the lowest offsets."""
    chunk, k = 16, 3
    x = torch.zeros(2 * chunk + 8)
    x[:chunk] = 1.0  # a chunk of 16 equal values keeps offsets 0, 1, 2
    x[chunk : 2 * chunk] = torch.tensor([0.5, -2.0] * 8)  # the 8 -2.0 tie: offsets 1, 3, 5
    x[2 * chunk + 2 :] = -0.25  # the short chunk (8 elements) keeps 2 of its 6 equal ones
    x[2 * chunk + 7] = 0.5
    encoded = make_codec("sparse2", sparse_chunk=chunk, sparse_k=k).encode(x)
    kept = torch.nonzero(decode_tensor(encoded)).squeeze(1).tolist()
    assert kept == [0, 1, 2, chunk + 1, chunk + 3, chunk + 5, 2 * chunk + 2, 2 * chunk + 7]
    for seed in range(20):  # and it is the same set whatever the order topk saw them in
        perm = torch.randperm(chunk, generator=torch.Generator().manual_seed(seed))
        shuffled = torch.where(perm < 5, 1.0, 0.0) + torch.where(perm < 2, 1.0, 0.0)
        decoded = decode_tensor(make_codec("sparse2", sparse_chunk=chunk, sparse_k=k).encode(shuffled))
        ties = sorted(i for i in range(chunk) if 2 <= perm[i] < 5)
        assert sorted(torch.nonzero(decoded).squeeze(1).tolist()) == sorted(
            [i for i in range(chunk) if perm[i] < 2] + ties[:1]
        )


_ENCODE_WORKER = """
import hashlib, sys
import numpy as np, torch
from p2pdiloco.compress import decode_tensor, make_codec
torch.set_num_threads(int(sys.argv[3]))
x = torch.from_numpy(np.fromfile(sys.argv[1], dtype="<f4").copy())
encoded = make_codec("sparse2", sparse_k=int(sys.argv[2])).encode(x)
digest = hashlib.sha256(encoded.payload + decode_tensor(encoded).numpy().tobytes()).hexdigest()
print(torch.backends.cpu.get_cpu_capability(), digest)
"""


def union_of_deltas(learners: int = 4, numel: int = 200_000) -> torch.Tensor:
    """What a synchronizer encodes as a sparse2 outer update: the mean of K decoded sparse2
    deltas (their union, up to K x k entries a chunk)."""
    codec = make_codec("sparse2")
    decoded = [decode_tensor(codec.encode(gaussian((numel,), seed=s, std=1e-3))) for s in range(learners)]
    return sum(decoded[1:], decoded[0]) / learners


def test_the_outer_update_encodes_to_the_same_bytes_under_every_cpu_kernel_set(tmp_path: Path) -> None:
    """Every replica applies what the update's bytes decode to, and an auditor re-encodes the
    merge to check the record: encode and decode give the same bits on every kernel set
    and thread count, ties (values on a grid) included."""
    own = torch.backends.cpu.get_cpu_capability()
    capabilities = [None, "default"] + (["avx2"] if own in ("AVX2", "AVX512") else [])
    capabilities += ["avx512"] if own == "AVX512" else []
    grid = torch.randint(-3, 4, (150_000,), generator=torch.Generator().manual_seed(5)).float() * 1e-3
    root = str(Path(__file__).resolve().parents[1])
    for name, x, k in (("union", union_of_deltas(), 256), ("grid", grid, 64)):
        path = tmp_path / name
        x.numpy().astype("<f4").tofile(path)
        encoded = make_codec("sparse2", sparse_k=k).encode(x)
        expected = hashlib.sha256(encoded.payload + decode_tensor(encoded).numpy().tobytes()).hexdigest()
        for capability, threads in [(c, 1) for c in capabilities] + [(None, 2)]:
            env = {key: v for key, v in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            if capability is not None:
                env["ATEN_CPU_CAPABILITY"] = capability
            command = [sys.executable, "-c", _ENCODE_WORKER, str(path), str(k), str(threads)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            kernels, digest = done.stdout.split()
            assert digest == expected, f"{name}: encoded bits differ under {kernels}, {threads} threads"


def test_the_outer_codec_keeps_the_union_of_four_deltas() -> None:
    """`compress.outer_sparse_k` (256) holds all of K = 4 deltas' entries at k = 64 (their
    union): what the update drops is only the 2-bit value error, as a delta's."""
    union = union_of_deltas()
    outer = make_codec_from_config(CompressConfig(outer_codec="sparse2"), outer=True)
    assert outer.encode(union).meta["k"] == 256
    decoded = decode_tensor(outer.encode(union))
    assert torch.equal(decoded != 0, union != 0)
    assert kept_rel_error(decoded, union) < 0.2
    with pytest.raises(ConfigError, match="compress.outer_sparse_k must be in"):
        CompressConfig(outer_sparse_k=0)
    # above the chunk it keeps every entry (a run with small chunks need not lower it)
    small = CompressConfig(outer_codec="sparse2", sparse_chunk=128, sparse_k=2)
    assert make_codec_from_config(small, outer=True).encode(union).meta["k"] == 128


# ---------------------------------------------------------------------------------------
# adversarial frames


@pytest.fixture
def no_output(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every torch.zeros call while decoding: a refused frame must never reach the output."""
    calls: list[tuple[Any, ...]] = []
    zeros = torch.zeros

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", spy)
    return calls


# (shape, chunk 8, k 2) -> chunks of 8, 8 and 4 elements; quotas 2, 2, 1
BAD_FRAMES = {
    "offset outside the short chunk": (
        frame((20,), 8, 2, [2, 2, 1], [1, 2] * 3, [0, 7, 1, 2, 4], [0] * 5),
        "outside its chunk",
    ),
    "offset outside a full chunk": (
        frame((12,), 6, 2, [2, 1], [1, 2] * 2, [1, 6, 0], [0] * 3),
        "outside its chunk",
    ),
    "repeated offset": (
        frame((20,), 8, 2, [2, 2, 1], [1, 2] * 3, [3, 3, 1, 2, 0], [0] * 5),
        "repeat or are not increasing",
    ),
    "offsets out of order": (
        frame((20,), 8, 2, [2, 2, 1], [1, 2] * 3, [5, 3, 1, 2, 0], [0] * 5),
        "repeat or are not increasing",
    ),
    "count above k": (
        frame((20,), 8, 2, [3, 1, 1], [1, 2] * 3, [0, 1, 2, 1, 0], [0] * 5),
        "keeps 3, more than its 2",
    ),
    "count above the short chunk's quota": (
        frame((20,), 8, 2, [1, 2, 2], [1, 2] * 3, [0, 1, 2, 0, 1], [0] * 5),
        "chunk 2 keeps 2, more than its 1",
    ),
    "counts that do not add up": (
        frame((20,), 8, 2, [2, 2, 0], [1, 2] * 3, [0, 1, 2, 3, 0], [0] * 5),
        "add up to 4, meta says 5",
    ),
    "NaN level": (
        frame((20,), 8, 2, [2, 2, 1], [1, math.nan, 1, 2, 1, 2], [0, 1, 2, 3, 0], [0] * 5),
        "non-finite",
    ),
    "infinite level": (
        frame((20,), 8, 2, [2, 2, 1], [1, 2, 1, 2, math.inf, 2], [0, 1, 2, 3, 0], [0] * 5),
        "non-finite",
    ),
}


@pytest.mark.parametrize("case", BAD_FRAMES, ids=str)
def test_a_malformed_layout_is_refused_before_the_output_is_allocated(
    case: str, no_output: list[tuple[Any, ...]]
) -> None:
    bad, reason = BAD_FRAMES[case]
    with pytest.raises(ValueError, match=reason):
        decode_tensor(bad)
    assert no_output == []
    with pytest.raises(ValueError, match=reason):
        decode_tensors({"w": bad}, shapes={"w": bad.shape})


def test_nonzero_padding_bits_are_refused() -> None:
    good = frame((20,), 8, 2, [2, 2, 1], [1, 2] * 3, [0, 1, 2, 3, 0], [0] * 5)
    assert decode_tensor(good).shape == (20,)
    payload = bytearray(good.payload)
    payload[-1] |= 0x80  # the codes: 5 x 2 bits used of 16
    with pytest.raises(ValueError, match="padding"):
        decode_tensor(EncodedTensor("sparse2", (20,), good.meta, bytes(payload)))
    payload = bytearray(good.payload)
    payload[-3] |= 0x80  # the offsets: 5 x 3 bits used of 16
    with pytest.raises(ValueError, match="padding"):
        decode_tensor(EncodedTensor("sparse2", (20,), good.meta, bytes(payload)))


@pytest.mark.parametrize(
    ("meta", "nbytes", "reason"),
    [
        ({"chunk": 8, "k": 2, "nnz": 6}, 20, "'nnz' must be an int in \\[0, 5\\]"),
        ({"chunk": 8, "k": 9, "nnz": 0}, 18, "'k' must be an int in \\[1, 8\\]"),
        ({"chunk": 1, "k": 1, "nnz": 0}, 18, "'chunk' must be an int in \\[2, 65536\\]"),
        ({"chunk": 1 << 17, "k": 1, "nnz": 0}, 6, "'chunk'"),
        ({"chunk": True, "k": 1, "nnz": 0}, 18, "'chunk'"),
        ({"chunk": 8, "k": 2.0, "nnz": 0}, 18, "'k'"),
        ({"chunk": 8, "k": 2}, 18, "'nnz'"),
        ({"chunk": 8, "k": 2, "nnz": 0, "block": 8}, 18, "unknown meta key 'block'"),
        ({"chunk": 8, "k": 2, "nnz": 5}, 23, "implies 22"),  # one byte too many
        ({"chunk": 8, "k": 2, "nnz": 5}, 21, "implies 22"),  # truncated
    ],
)
def test_check_layout_refuses_a_header_that_lies(
    meta: dict[str, Any], nbytes: int, reason: str
) -> None:
    message = check_layout("sparse2", (20,), meta, nbytes)
    assert message is not None
    assert re.search(reason, message), message


def test_a_header_that_lies_about_the_shape_is_refused() -> None:
    good = make_codec("sparse2").encode(gaussian((64, 300)))
    for shape in [(64, 100), (300, 64, 2), (1 << 28,)]:
        with pytest.raises(ValueError, match="implies|'nnz'"):
            decode_tensor(EncodedTensor("sparse2", shape, good.meta, good.payload))
    # the same elements in another shape is a layout the caller's expected shape refuses
    moved = EncodedTensor("sparse2", (300, 64), good.meta, good.payload)
    with pytest.raises(ValueError, match="not the expected"):
        decode_tensors({"w": moved}, shapes={"w": (64, 300)})


def _mutate(payload: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    data = bytearray(payload)
    for position, value in edits:
        if data:
            data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    return bytes(data + tail)


@settings(max_examples=examples(200), deadline=None)
@given(
    n=st.integers(0, 300),
    chunk=st.sampled_from([2, 5, 16, 64]),
    k=st.integers(1, 5),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    cut=st.none() | st.integers(0, 10**6),
    tail=st.binary(max_size=4),
    meta_key=st.sampled_from([None, "chunk", "k", "nnz"]),
    meta_value=st.integers(-2, 70) | st.none() | st.booleans() | st.floats(),
)
@example(n=20, chunk=16, k=4, edits=[(0, 0xFF)], cut=None, tail=b"", meta_key=None, meta_value=0)
def test_any_corrupted_frame_decodes_to_its_layout_or_is_a_value_error(
    n: int,
    chunk: int,
    k: int,
    edits: list[tuple[int, int]],
    cut: int | None,
    tail: bytes,
    meta_key: str | None,
    meta_value: Any,
) -> None:
    codec = make_codec("sparse2", sparse_chunk=chunk, sparse_k=min(k, chunk))
    good = codec.encode(gaussian((n,)))
    meta = dict(good.meta) if meta_key is None else {**good.meta, meta_key: meta_value}
    bad = EncodedTensor("sparse2", (n,), meta, _mutate(good.payload, edits, cut, tail))
    try:
        tensor = decode_tensor(bad, expected_shape=(n,))
    except ValueError:
        return
    # accepted: the layout held, so the output has the shape, at most nnz nonzero entries,
    # and every value is finite
    assert tensor.shape == (n,) and tensor.dtype == torch.float32
    assert int((tensor != 0).sum()) <= meta["nnz"] and bool(torch.isfinite(tensor).all())


# ---------------------------------------------------------------------------------------
# config


def test_chunk_and_k_come_from_the_config_and_are_validated() -> None:
    cfg = CompressConfig(codec="sparse2", outer_codec="sparse2", sparse_chunk=1024, sparse_k=32)
    encoded = make_codec_from_config(cfg).encode(gaussian((4096,)))
    assert encoded.meta == {"chunk": 1024, "k": 32, "nnz": 128}
    with pytest.raises(ConfigError, match="compress.sparse_k must be in"):
        CompressConfig(sparse_chunk=16, sparse_k=17)
    with pytest.raises(ConfigError, match="compress.sparse_chunk must be in"):
        CompressConfig(sparse_chunk=1)
    with pytest.raises(ValueError, match="sparse k"):
        make_codec("sparse2", sparse_chunk=16, sparse_k=0)
