"""The decoder: presets, determinism, causality, tied embeddings and that it learns."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.training.data import VOCAB_SIZE
from p2pdiloco.training.model import (
    PRESETS,
    Decoder,
    apply_rotary,
    build_model,
    count_parameters,
    rotary_table,
)


def test_preset_sizes() -> None:
    assert 0.5e6 < count_parameters(build_model("tiny")) < 1.5e6
    assert 10e6 <= count_parameters(build_model("small")) <= 20e6
    with torch.device("meta"):
        assert 120e6 < count_parameters(Decoder(PRESETS["150m"])) < 180e6
        assert 0.9e9 < count_parameters(Decoder(PRESETS["1b"])) < 1.3e9


def test_same_seed_gives_identical_weights_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = build_model("tiny", seed=4)
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_embeddings_are_tied() -> None:
    model = build_model("tiny")
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and not any("lm_head" in n for n in names)


def test_logits_shape_and_causality() -> None:
    model = build_model("tiny").eval()
    tokens = torch.randint(0, VOCAB_SIZE, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, VOCAB_SIZE)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB_SIZE
    # Positions before the change must not see it.
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-5)
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:], atol=1e-5)


def test_rotary_preserves_norm_and_is_relative() -> None:
    cos, sin = rotary_table(8, 32, 10000.0)
    x = torch.randn(1, 1, 32, 8)
    rotated = apply_rotary(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    q, k = torch.randn(8), torch.randn(8)
    qs, ks = q.expand(1, 1, 32, 8), k.expand(1, 1, 32, 8)
    rq, rk = apply_rotary(qs, cos, sin)[0, 0], apply_rotary(ks, cos, sin)[0, 0]
    # The score depends only on the distance between positions.
    assert torch.allclose(rq[5] @ rk[3], rq[12] @ rk[10], atol=1e-4)


def test_initial_loss_is_near_uniform_and_overfits_one_batch() -> None:
    model = build_model("tiny", seed=0)
    batch = torch.randint(0, 256, (4, 33))
    initial = float(model.loss(batch).detach())
    assert abs(initial - torch.log(torch.tensor(float(VOCAB_SIZE)))) < 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(model.loss(batch).detach()) < initial * 0.5


def test_rejects_bad_preset_and_too_long_sequences() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        build_model("huge")
    model = build_model("tiny", max_seq_len=16)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
