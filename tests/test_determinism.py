"""Replicas stay bit-identical whatever CPU kernel set computes them, and the helpers.

The cross-CPU test runs this file as a script in subprocesses, one per
`ATEN_CPU_CAPABILITY` this machine can run (default, and avx2/avx512 where the CPU has
them): each builds the tiny model, runs five rounds of encode -> decode -> merge -> outer
step on two fragments under every merge rule, codec and momentum schedule, and prints the
hashes of the decoded deltas (and their norms), the merged gradients and the fragments.
Fused multiply-adds (`alpha=`), vectorised reductions or torch's own random init make
these lists differ between kernel sets; the test asserts they are equal.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.compress import decode_tensor, make_codec
from p2pdiloco.config import OuterConfig
from p2pdiloco.outer.fragment_state import FragmentState, hash_tensors
from p2pdiloco.outer.step import (
    SUM_BLOCK,
    OuterState,
    fixed_order_sum,
    merge,
    merge_weighted,
    outer_step,
    tensor_norm,
    token_weights,
)
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.model import build_model

ROUNDS = 5
LEARNERS = 3
RULES = ("mean", "token", "radial", "radial-median")
CODECS = ("int8", "fp4")
DELAYED = (1, 2)  # Nesterov, and delayed Nesterov every 2 merges


def _uniform(rng: np.random.PCG64, count: int, half_width: float) -> np.ndarray:
    """Uniform float64 values in [-half_width, half_width) from raw PCG64 bits: exact
    integer-to-float steps, so the same on every machine (unlike torch.randn)."""
    unit = (rng.random_raw(count) >> np.uint64(11)).astype(np.float64) / 2.0**53
    return unit * (2.0 * half_width) - half_width


def _deltas(
    rng: np.random.PCG64, shapes: dict[str, tuple[int, ...]]
) -> list[dict[str, torch.Tensor]]:
    """One delta per learner: a shared direction plus learner noise at a learner scale,
    so the radial rule neither cancels nor degenerates."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(LEARNERS)]
    for name, shape in shapes.items():
        count = math.prod(shape)
        common = _uniform(rng, count, 1e-3)
        for learner in range(LEARNERS):
            noise = _uniform(rng, count, 1e-3 * (learner + 1))
            values = (common + noise).astype(np.float32).reshape(shape)
            out[learner][name] = torch.from_numpy(values)
    return out


def worker() -> None:
    """Print the initial hash, then every fragment hash after every round of every variant."""
    # One thread: several workers (and other tests) share the CPU, and OpenMP threads that
    # spin while oversubscribed make this 10-50x slower. Results do not depend on threads
    # (test_fixed_order_sum_does_not_depend_on_layout_threads_or_dtype).
    torch.set_num_threads(1)
    print("capability", torch.backends.cpu.get_cpu_capability())
    params = {n: p.detach().clone() for n, p in build_model("tiny", seed=1234).named_parameters()}
    print("init", hash_tensors(params))
    names = sorted(params)
    fragments = [names[0::2], names[1::2]]
    variants = {
        (rule, codec, every): GlobalState(
            params,
            fragments,
            OuterConfig(
                merge="radial" if rule.startswith("radial") else rule,
                radial_norm="median" if rule == "radial-median" else "mean",
                delayed_nesterov_every=every,
            ),
        )
        for rule in RULES
        for codec in CODECS
        for every in DELAYED
    }
    codecs = {name: make_codec(name, block_size=64) for name in CODECS}
    outer_codec = make_codec("int8")
    other_codecs = {
        "fp32": make_codec("fp32"),
        "fp16": make_codec("fp16"),
        "bf16": make_codec("bf16"),
        "int4": make_codec("int4", block_size=64),
        "topk": make_codec("topk", topk_fraction=0.1),
        "int8+zstd": make_codec("int8", zstd=True),
    }
    rng = np.random.PCG64(99)
    weights = token_weights([1000, 3000, 2000], [10, 20, 10], max_share=0.5)
    for round_id in range(ROUNDS):
        for fragment, fragment_names in enumerate(fragments):
            deltas = _deltas(rng, {n: tuple(params[n].shape) for n in fragment_names})
            for codec_name, codec in other_codecs.items():  # decoded only, not merged
                decoded_one = {n: decode_tensor(codec.encode(t)) for n, t in deltas[0].items()}
                print("decoded", round_id, fragment, codec_name, hash_tensors(decoded_one))
            for codec_name, codec in codecs.items():
                decoded = [
                    {n: decode_tensor(codec.encode(t)) for n, t in delta.items()}
                    for delta in deltas
                ]
                print("decoded", round_id, fragment, codec_name, hash_tensors(decoded[0]), end=" ")
                # the norms the synchronizer screens deltas with, to the last bit
                print(*(tensor_norm(delta).hex() for delta in decoded))
                embeddings = frozenset(n for n in fragment_names if n.startswith("embed."))
                for (rule, codec_of, every), state in variants.items():
                    if codec_of != codec_name:
                        continue
                    merged = merge(
                        state.outer.merge,
                        decoded,
                        weights,
                        norm=state.outer.radial_norm,
                        plain_mean_names=embeddings,
                    )
                    # the merge itself too: the outer codec below would hide a last-bit change
                    print("merged", round_id, fragment, rule, codec_name, every, end=" ")
                    print(hash_tensors(merged))
                    # as the synchronizer does: replicas apply the decoded outer gradient
                    update = {n: decode_tensor(outer_codec.encode(t)) for n, t in merged.items()}
                    new_hash = state.apply_update(fragment, round_id, update)
                    print("hash", round_id, fragment, rule, codec_name, every, new_hash)


def _capabilities() -> list[str | None]:
    """The kernel sets to compare: default, this CPU's own (None: unset), avx2/avx512."""
    own = torch.backends.cpu.get_cpu_capability()
    wanted: list[str | None] = [None, "default"]
    if own in ("AVX2", "AVX512"):
        wanted.append("avx2")
    if own == "AVX512":
        wanted.append("avx512")
    return wanted


def _run_worker(capability: str | None) -> list[str]:
    """The worker's output lines under `ATEN_CPU_CAPABILITY=capability` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    root = str(Path(__file__).resolve().parents[1])  # the worker imports the package from here
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_hashes_are_identical_across_cpu_kernel_sets() -> None:
    runs = {capability: _run_worker(capability) for capability in _capabilities()}
    # The variable took effect: `default` really ran the non-vectorised kernels.
    assert runs["default"][0] == "capability DEFAULT"
    reference = runs[None]
    expected = 2 + ROUNDS * 2 * (6 + len(CODECS) * (1 + 2 * len(RULES) * len(DELAYED)))
    assert len(reference) == expected
    for capability, lines in runs.items():
        assert lines[1] == reference[1], f"initial model differs under {capability}"
        for mine, theirs in zip(lines[2:], reference[2:], strict=True):
            assert mine == theirs, f"{capability} vs unset: {mine} != {theirs}"


# --- fixed_order_sum ---------------------------------------------------------------------


def _halving(values: list[float]) -> float:
    """Halves added elementwise until one value is left, the middle one carried when odd."""
    while len(values) > 1:
        half = (len(values) + 1) // 2
        values = [
            values[i] + values[i + half] if i + half < len(values) else values[i]
            for i in range(half)
        ]
    return values[0] if values else 0.0


def _tree_sum(values: list[float]) -> float:
    """The reference tree in pure Python: blocks of SUM_BLOCK halved, then their sums."""
    blocks = [values[i : i + SUM_BLOCK] for i in range(0, len(values), SUM_BLOCK)]
    return _halving([_halving(block) for block in blocks])


@pytest.mark.parametrize(
    "count", [0, 1, 2, 3, 7, 64, 4097, SUM_BLOCK, SUM_BLOCK + 1, 3 * SUM_BLOCK + 5]
)
def test_fixed_order_sum_is_the_pairwise_tree_and_close_to_fsum(count: int) -> None:
    values = _uniform(np.random.PCG64(count), count, 1.0).astype(np.float32)
    tensor = torch.from_numpy(values)
    as_float = [float(v) for v in values]
    assert fixed_order_sum(tensor) == _tree_sum(as_float)
    assert fixed_order_sum(tensor) == pytest.approx(math.fsum(as_float), rel=1e-12, abs=1e-12)
    squares = [v * v for v in as_float]  # exact: fp32 squares fit in float64
    assert fixed_order_sum(tensor, square=True) == _tree_sum(squares)
    assert fixed_order_sum(tensor, square=True) == pytest.approx(math.fsum(squares), rel=1e-12)


def test_fixed_order_sum_does_not_depend_on_layout_threads_or_dtype() -> None:
    # more than one scratch of blocks, and big enough for torch to use several threads
    values = _uniform(np.random.PCG64(5), 3 * 33_335 * 11, 1.0).astype(np.float32)
    flat = torch.from_numpy(values)
    expected = fixed_order_sum(flat)
    assert expected == _tree_sum([float(v) for v in values])
    # the same values seen through another shape, a transposed copy, float64 and 1 thread
    assert fixed_order_sum(flat.view(33, 33_335)) == expected
    transposed = flat.view(33, 33_335).t().contiguous().t()  # non-contiguous, same order
    assert not transposed.is_contiguous() and fixed_order_sum(transposed) == expected
    assert fixed_order_sum(flat.double()) == expected
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert fixed_order_sum(flat) == expected
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(flat, torch.from_numpy(values))  # the input is left alone


# --- elementwise arithmetic ------------------------------------------------------------


def test_outer_step_and_weighted_merge_equal_numpy_op_by_op() -> None:
    """fp32 numpy with one rounding per operation is the specification, bit for bit, also
    across the chunks the update loops take (the tensor is larger than one chunk)."""
    rng = np.random.PCG64(11)
    shape = (1031, 1031)
    lr, mu = 0.7, 0.9
    f32 = np.float32
    grads = [_uniform(rng, math.prod(shape), 1e-2).astype(f32).reshape(shape) for _ in range(5)]
    start = _uniform(rng, math.prod(shape), 1.0).astype(f32).reshape(shape)
    for every in (1, 2):
        params = {"w": torch.from_numpy(start.copy())}
        state = OuterState()
        ref, buf, acc = start.copy(), None, None
        for step, g in enumerate(grads, start=1):
            outer_step(
                params, {"w": torch.from_numpy(g)}, state, lr=lr, momentum=mu, delayed_every=every
            )
            if every == 1:
                buf = g.copy() if buf is None else buf * f32(mu) + g
                ref = ref - (g + buf * f32(mu)) * f32(lr)
                continue
            acc = g.copy() if acc is None else acc + g
            ref = ref - g * f32(lr)
            if step % every == 0:
                mean = acc / f32(every)
                buf, acc = (mean if buf is None else buf * f32(mu) + mean), None
                ref = ref - buf * f32(lr * mu)
        assert np.array_equal(params["w"].numpy(), ref), f"delayed_every={every}"
    weights = token_weights([5, 7, 9], [1, 1, 1])
    merged = merge_weighted([{"w": torch.from_numpy(g)} for g in grads[:3]], weights)
    expected = np.zeros(shape, dtype=f32)
    for g, w in zip(grads[:3], weights, strict=True):
        expected = expected + g * f32(w)
    assert np.array_equal(merged["w"].numpy(), expected)


# --- import validation -------------------------------------------------------------------


def _state(rounds: int = 3) -> GlobalState:
    """Fragment 0 = (a, c) after `rounds` delayed-Nesterov updates (every 2), fragment 1 = b."""
    g = torch.Generator().manual_seed(0)
    params = {
        "a": torch.randn(4, 3, generator=g),
        "b": torch.randn(5, generator=g),
        "c": torch.randn(2, 2, generator=g),
    }
    state = GlobalState(params, [["a", "c"], ["b"]], OuterConfig(delayed_nesterov_every=2))
    for r in range(rounds):  # momentum after round 2, an accumulated sum after round 3
        state.apply_update(
            0, r, {"a": torch.full((4, 3), 0.1 * (r + 1)), "c": torch.full((2, 2), -0.2)}
        )
    return state


def test_accumulated_sums_are_hashed_exported_and_imported() -> None:
    source = _state()
    assert "a" in source.outer_state.accumulated and "a" in source.outer_state.momentum
    snapshot = source.export_fragment(0)
    assert set(snapshot.accumulated) == {"a", "c"}
    without_sums = {f"p/{n}": source.params[n] for n in ("a", "c")}
    without_sums.update({f"m/{n}": source.outer_state.momentum[n] for n in ("a", "c")})
    assert snapshot.hash != hash_tensors(without_sums)  # the sums are part of the hash
    copy = _state(rounds=0)
    assert copy.import_verified(snapshot) == snapshot.hash
    grad = {"a": torch.full((4, 3), 0.5), "c": torch.full((2, 2), 0.25)}
    # the next update applies the delayed momentum: identical only if the sums came along
    assert copy.apply_update(0, 3, grad) == source.apply_update(0, 3, grad)


def _bad_snapshots() -> dict[str, FragmentState]:
    good = _state().export_fragment(0)
    nan = good.params["c"].clone()
    nan[0, 0] = float("nan")
    huge = good.params["c"].double()
    huge[1, 1] = 1e300  # finite in float64, inf in fp32
    inf_sum = good.accumulated["c"].clone()
    inf_sum[0, 1] = float("inf")

    def change(**fields: object) -> FragmentState:
        return FragmentState(**{**good.__dict__, **fields})

    def params(c: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**good.params, "c": c}  # "a" is fine and comes first

    return {
        "nan param": change(params=params(nan)),
        "param beyond fp32": change(params=params(huge)),
        "bad param shape": change(params=params(torch.zeros(4))),
        "integer param": change(params=params(torch.zeros(2, 2, dtype=torch.int64))),
        "missing param": change(params={"a": good.params["a"]}),
        "nan momentum": change(momentum={**good.momentum, "c": nan}),
        "bad momentum shape": change(momentum={**good.momentum, "c": torch.zeros(2, 3)}),
        "foreign momentum": change(momentum={**good.momentum, "b": torch.zeros(5)}),
        "inf accumulated": change(accumulated={**good.accumulated, "c": inf_sum}),
        "bad accumulated shape": change(accumulated={**good.accumulated, "c": torch.zeros(9)}),
        "foreign accumulated": change(accumulated={"zzz": torch.zeros(1)}),
        "no such fragment": change(fragment=7),
        "negative round": change(round=-1),
    }


@pytest.mark.parametrize("case", list(_bad_snapshots()))
def test_a_bad_import_leaves_the_state_unchanged(case: str) -> None:
    target = _state(rounds=1)  # fragment 0 differs from the snapshot's (3 rounds)
    target.apply_update(1, 0, {"b": torch.ones(5)})
    params = {n: t.clone() for n, t in target.params.items()}
    momentum = {n: t.clone() for n, t in target.outer_state.momentum.items()}
    accumulated = {n: t.clone() for n, t in target.outer_state.accumulated.items()}
    hashes = [target.fragment_hash(0), target.fragment_hash(1)]
    rounds, steps = list(target.rounds), dict(target.outer_state.tensor_steps)
    with pytest.raises(ValueError):
        target.install_download(target.checked_copy(_bad_snapshots()[case]))
    assert [target.fragment_hash(0), target.fragment_hash(1)] == hashes
    assert target.rounds == rounds and target.outer_state.tensor_steps == steps
    for mine, before in (
        (target.params, params),
        (target.outer_state.momentum, momentum),
        (target.outer_state.accumulated, accumulated),
    ):
        assert mine.keys() == before.keys()
        assert all(torch.equal(mine[n], before[n]) for n in before)


if __name__ == "__main__":
    worker()
