"""A window held encoded (`compress.LazyTensors`): the same merge bits as decoded deltas, and a
working set of decoded fp32 that does not grow with the number of contributions; with the
sparse2 codec too, whose windows screening holds to the sparse line and which merge to the
same bits in whatever order the deltas arrive."""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import CompressConfig, load_config
from p2pdiloco.outer.screening import SPARSE_DENSITY, Candidate, History, ScreeningRules
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


CODECS = ("int8", "sparse2")
SPARSE = {"sparse_chunk": 64, "sparse_k": 4}
"""sparse2 at its density (1/16 here against 1/64: the layout is small) in chunks the
tensors above fill several times."""


def encoded(delta: dict[str, torch.Tensor], codec: str = "int8") -> dict[str, compress.EncodedTensor]:
    return compress.encode_tensors(compress.make_codec(codec, **(SPARSE if codec == "sparse2" else {})), delta)


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


def merge_window(
    candidates: list[Candidate],
    history: History | None = None,
    momentum_value: float = 0.0,
    outer_codec: compress.Codec | None = None,
    **outer: object,
):
    config = load_config(overrides=[f"outer.{k}={v!r}" for k, v in outer.items()])
    params = {n: torch.ones(s) for n, s in LAYOUT.items()}
    momentum = {n: torch.full(s, momentum_value) for n, s in LAYOUT.items()}
    return merge_round(
        candidates,
        history=history or History(),
        params=params,
        momentum=momentum,
        outer=config.outer,
        sync=config.sync,
        rules=ScreeningRules(),
        max_tokens_per_step=10_000,
        outer_codec=outer_codec or compress.make_codec("fp32"),
    )


def window(count: int, lazy: type | None, codec: str = "int8", **outer: object):
    candidates = []
    for i, delta in enumerate(deltas(count)):
        enc = encoded(delta, codec)
        held = lazy(enc) if lazy else compress.decode_tensors(enc)
        candidates.append(Candidate(f"peer-{i:02d}", held, tokens=1000 + i, steps=10))
    return merge_window(candidates, **outer)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("rule", ["token", "mean", "radial", "trimmed"])
def test_a_lazy_window_merges_to_the_same_bits_as_a_decoded_one(rule: str, codec: str) -> None:
    eager = window(6, None, codec, merge=rule)
    lazy = window(6, compress.LazyTensors, codec, merge=rule)
    assert [dataclasses.astuple(v) for v in eager.screening.verdicts] == [
        dataclasses.astuple(v) for v in lazy.screening.verdicts
    ]
    assert eager.decoded is not None and lazy.decoded is not None
    for name in LAYOUT:
        assert torch.equal(eager.decoded[name], lazy.decoded[name]), name


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("rule", ["token", "radial", "trimmed"])
def test_the_decoded_working_set_is_one_tensor_per_contribution_not_one_fragment(rule: str, codec: str) -> None:
    peaks = {}
    for count in (4, 16):
        CountingLazy.live = CountingLazy.peak = 0
        result = window(count, CountingLazy, codec, merge=rule)
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


# --- sparse2 windows -----------------------------------------------------------------------


def sparse_candidates(count: int, rounds: int = 3) -> list[Candidate]:
    """`count` learners' sparse2 deltas as a synchronizer holds them, after `rounds` of
    error feedback: a shared direction under three times as much noise of their own, so
    their top sets overlap in part and the cosines between them are what the tiny model's
    real ones are (0.02-0.04 here, measured 0.027 at least: the dense line 0.05 refused them)."""
    codec = compress.make_codec("sparse2", **SPARSE)
    feedback = [compress.ErrorFeedback() for _ in range(count)]
    for r in range(rounds):
        gen = torch.Generator().manual_seed(r)
        common = {n: torch.randn(s, generator=gen) for n, s in LAYOUT.items()}
        noisy = [{n: 1e-2 * (common[n] + 3 * torch.randn(s, generator=gen)) for n, s in LAYOUT.items()} for _ in range(count)]
        sent = [compress.encode_tensors(codec, d, fb) for d, fb in zip(noisy, feedback, strict=True)]
    return [
        Candidate(f"peer-{i:02d}", compress.LazyTensors(enc), tokens=1000, steps=10) for i, enc in enumerate(sent)
    ]


def test_sparse2_deltas_are_screened_as_sparse_and_honest_ones_kept() -> None:
    candidates = sparse_candidates(6)
    decoded = compress.decode_tensors(candidates[0].delta._encoded)
    density = sum(int(t.count_nonzero()) for t in decoded.values()) / FRAGMENT_ELEMENTS
    assert 0 < density <= SPARSE_DENSITY
    result = merge_window(candidates, momentum_value=1e-3)
    assert all(v.kept and v.scale == 1.0 for v in result.screening.verdicts)
    cosines = [v.loo_cosine for v in result.screening.verdicts]
    assert all(c is not None and ScreeningRules().sparse_loo_min_cosine < c for c in cosines)
    assert min(cosines) < ScreeningRules().loo_min_cosine  # held to the dense line, refused


def test_sparse2_attacks_are_refused_clipped_and_bounded_as_dense_ones() -> None:
    """Direction checks, the clip history and the token bound on sparse2 deltas."""
    honest = sparse_candidates(4)

    def as_sent(delta: dict[str, torch.Tensor]) -> compress.LazyTensors:
        return compress.LazyTensors(compress.encode_tensors(compress.make_codec("sparse2", **SPARSE), delta))

    first = compress.decode_tensors(honest[0].delta._encoded)
    flipped = dataclasses.replace(honest[0], delta=as_sent({n: -t for n, t in first.items()}))
    result = merge_window([flipped, *honest[1:]])
    assert result.screening.refused.keys() == {"peer-00"}
    assert "other deltas" in result.screening.refused["peer-00"]
    # a flip alone, against the outer momentum (the last merge, its own delta in it)
    momentum = merge_window(honest).decoded
    assert momentum is not None
    config = load_config()
    alone = merge_round(
        [flipped], history=History(), params={n: torch.ones(s) for n, s in LAYOUT.items()}, momentum=momentum,
        outer=config.outer, sync=config.sync, rules=ScreeningRules(), max_tokens_per_step=10_000,
        outer_codec=compress.make_codec("fp32"),
    )  # fmt: skip
    assert "outer momentum" in alone.screening.refused["peer-00"]
    # x100 alone with a history of honest norms: refused; x2: clipped to 3x the median
    norms = tuple(v.norm for v in merge_window(honest).screening.verdicts)
    history = History(norms=norms * 3, tokens=(1000,) * 12)
    big = dataclasses.replace(honest[0], delta=as_sent({n: 100 * t for n, t in first.items()}))
    assert "refuse bound" in merge_window([big], history).screening.refused["peer-00"]
    larger = dataclasses.replace(honest[0], delta=as_sent({n: 4 * t for n, t in first.items()}))
    (verdict,) = merge_window([larger], history).screening.verdicts
    assert verdict.kept and verdict.scale < 1.0
    # a claim of 50x the tokens counts the token bound (2x the history's median) at most
    greedy = dataclasses.replace(honest[0], tokens=50_000, steps=10)
    tokens = {v.peer: v.tokens for v in merge_window([greedy, *honest[1:]], history).screening.verdicts}
    assert tokens["peer-00"] == 2000 and tokens["peer-01"] == 1000


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("rule", ["token", "radial", "trimmed"])
def test_the_merge_is_bit_identical_in_whatever_order_the_deltas_arrive(rule: str, codec: str) -> None:
    held = [
        Candidate(f"peer-{i:02d}", compress.LazyTensors(encoded(delta, codec)), tokens=1000 + 7 * i, steps=10)
        for i, delta in enumerate(deltas(4, seed=4))
    ]
    results = [merge_window(list(order), merge=rule) for order in itertools.permutations(held)]
    first = results[0]
    assert first.decoded is not None and len(first.screening.kept) == 4
    for other in results[1:]:
        assert other.screening.verdicts == first.screening.verdicts
        assert other.decoded is not None
        assert all(torch.equal(other.decoded[n], first.decoded[n]) for n in LAYOUT)


@pytest.mark.parametrize("rule", ["token", "radial"])
def test_a_sparse2_outer_update_is_the_same_tensor_on_every_replica(rule: str) -> None:
    """The union of K sparse2 deltas, encoded again with the outer k (`outer_sparse_k`,
    K x k: all of it): an auditor's re-merge gives the same bytes, and the bytes as they
    arrive decode to the tensor the synchronizer applied, on every replica."""
    from p2pdiloco.outer.fragment_state import hash_tensors

    config = CompressConfig(outer_codec="sparse2", sparse_chunk=SPARSE["sparse_chunk"], outer_sparse_k=16)
    outer_codec = compress.make_codec_from_config(config, outer=True)
    held = [
        Candidate(f"peer-{i:02d}", compress.LazyTensors(encoded(delta, "sparse2")), tokens=1000, steps=10)
        for i, delta in enumerate(deltas(4, seed=2))
    ]
    synchronizer = merge_window(held, outer_codec=outer_codec, merge=rule)
    auditor = merge_window(list(reversed(held)), outer_codec=compress.make_codec_from_config(config, outer=True), merge=rule)
    assert synchronizer.encoded is not None and auditor.encoded is not None and synchronizer.decoded is not None
    assert synchronizer.encoded == auditor.encoded
    union = {n: sum((c.delta[n] != 0).int() for c in held) > 0 for n in LAYOUT}
    for name, tensor in synchronizer.encoded.items():
        assert tensor.codec == "sparse2" and tensor.meta["k"] == 16
        # the union is kept whole (4 deltas x 4 entries a chunk fit the outer k of 16)
        assert torch.equal(synchronizer.decoded[name] != 0, union[name]), name
        arrived = compress.EncodedTensor(tensor.codec, tuple(tensor.shape), dict(tensor.meta), bytes(tensor.payload))
        assert torch.equal(compress.decode_tensor(arrived), synchronizer.decoded[name])
    assert hash_tensors(synchronizer.decoded) == hash_tensors(compress.decode_tensors(auditor.encoded))
