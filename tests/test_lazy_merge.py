"""A window held encoded (`compress.LazyTensors`): the same merge bits as decoded deltas, and a
working set of decoded fp32 that does not grow with the number of contributions."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import load_config
from p2pdiloco.outer.screening import Candidate, History, ScreeningRules
from p2pdiloco.protocol.merge import merge_round

LAYOUT = {"embed.weight": (32, 16), "block.0.b": (48,)} | {f"block.{i}.w": (32, 16) for i in range(7)}
FRAGMENT_ELEMENTS = sum(torch.Size(s).numel() for s in LAYOUT.values())
LARGEST = max(torch.Size(s).numel() for s in LAYOUT.values())


def deltas(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    common = {n: torch.randn(s, generator=gen) for n, s in LAYOUT.items()}
    return [
        {n: 1e-2 * (common[n] + 0.5 * torch.randn(s, generator=gen)) for n, s in LAYOUT.items()}
        for _ in range(count)
    ]


def encoded(delta: dict[str, torch.Tensor]) -> dict[str, compress.EncodedTensor]:
    return compress.encode_tensors(compress.make_codec("int8"), delta)


class CountingLazy(compress.LazyTensors):
    """Counts the decoded elements alive at once across every instance (CPython frees a
    tensor when its last reference goes, so the finalizer runs at that moment)."""

    live = 0
    peak = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = super().__getitem__(name)
        CountingLazy.live += tensor.numel()
        CountingLazy.peak = max(CountingLazy.peak, CountingLazy.live)
        weakref.finalize(tensor, CountingLazy._freed, tensor.numel())
        return tensor

    @staticmethod
    def _freed(numel: int) -> None:
        CountingLazy.live -= numel


def window(count: int, lazy: type | None, **outer: object):
    config = load_config(overrides=[f"outer.{k}={v!r}" for k, v in outer.items()])
    candidates = []
    for i, delta in enumerate(deltas(count)):
        enc = encoded(delta)
        held = lazy(enc) if lazy else compress.decode_tensors(enc)
        candidates.append(Candidate(f"peer-{i:02d}", held, tokens=1000 + i, steps=10))
    params = {n: torch.ones(s) for n, s in LAYOUT.items()}
    momentum = {n: torch.zeros(s) for n, s in LAYOUT.items()}
    return merge_round(
        candidates,
        history=History(),
        params=params,
        momentum=momentum,
        outer=config.outer,
        sync=config.sync,
        rules=ScreeningRules(),
        max_tokens_per_step=10_000,
        outer_codec=compress.make_codec("fp32"),
    )


@pytest.mark.parametrize("rule", ["token", "mean", "radial", "trimmed"])
def test_a_lazy_window_merges_to_the_same_bits_as_a_decoded_one(rule: str) -> None:
    eager = window(6, None, merge=rule)
    lazy = window(6, compress.LazyTensors, merge=rule)
    assert [dataclasses.astuple(v) for v in eager.screening.verdicts] == [
        dataclasses.astuple(v) for v in lazy.screening.verdicts
    ]
    assert eager.decoded is not None and lazy.decoded is not None
    for name in LAYOUT:
        assert torch.equal(eager.decoded[name], lazy.decoded[name]), name


@pytest.mark.parametrize("rule", ["token", "radial", "trimmed"])
def test_the_decoded_working_set_is_one_tensor_per_contribution_not_one_fragment(rule: str) -> None:
    peaks = {}
    for count in (4, 16):
        CountingLazy.live = CountingLazy.peak = 0
        result = window(count, CountingLazy, merge=rule)
        assert len(result.screening.kept) == count
        assert CountingLazy.live == 0  # nothing decoded outlives the merge
        peaks[count] = CountingLazy.peak
    # Held decoded, 16 contributions would be 16 fragments; read tensor by tensor they are
    # at most 16 copies of the largest tensor, 2 fragments here.
    assert peaks[16] <= 16 * LARGEST
    assert peaks[16] <= 2 * FRAGMENT_ELEMENTS
    assert peaks[16] <= 4 * peaks[4]


def test_lazy_tensors_refuse_what_decode_tensors_refuses() -> None:
    good = encoded(deltas(1)[0])
    assert set(wire.lazy_tensors(wire.Message(wire.CONTRIBUTION, "r", 0, 0, {}, good), LAYOUT)) == set(LAYOUT)
    bad = dict(good)
    bad["block.0.b"] = compress.make_codec("fp32").encode(torch.tensor([float("nan")] * 48))
    rejected = wire.lazy_tensors(wire.Message(wire.CONTRIBUTION, "r", 0, 0, {}, bad), LAYOUT)
    assert isinstance(rejected, wire.Rejected) and "non-finite" in rejected.reason
    missing = {n: t for n, t in good.items() if n != "block.1.w"}
    rejected = wire.lazy_tensors(wire.Message(wire.CONTRIBUTION, "r", 0, 0, {}, missing), LAYOUT)
    assert isinstance(rejected, wire.Rejected) and "do not match the layout" in rejected.reason
    assert isinstance(wire.lazy_tensors("not a message"), wire.Rejected)  # type: ignore[arg-type]
