"""A Llama-style decoder in one file: RMSNorm, rotary embeddings, SwiGLU, tied embeddings.

Byte-level tokens (see `data.VOCAB_SIZE`), so no tokenizer download is ever needed.
The presets go from a ~1M-parameter `tiny` for tests to the `150m` and `1b` shapes
OpenDiLoCo trained (their vocabulary was 32k; ours is bytes, so the embedding is smaller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from p2pdiloco.training.data import VOCAB_SIZE


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the decoder."""

    dim: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads (dim must be a multiple)."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward."""
    vocab_size: int = VOCAB_SIZE
    """Token ids in [0, vocab_size)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(dim=128, num_layers=4, num_heads=4, ffn_dim=352),
    "small": ModelShape(dim=320, num_layers=8, num_heads=5, ffn_dim=864),
    # OpenDiLoCo's 150M and 1B (TinyLlama-shaped) configurations.
    "150m": ModelShape(dim=1024, num_layers=12, num_heads=16, ffn_dim=2688),
    "1b": ModelShape(dim=2048, num_layers=22, num_heads=32, ffn_dim=5632),
}


_INIT_CHUNK = 1 << 16  # 512 KiB of float64: the temporaries stay in cache


def portable_uniform_(param: torch.Tensor, std: float, rng: np.random.PCG64) -> None:
    """Fill `param` in place with uniform values of standard deviation `std`, the same bits
    on every machine.

    torch's normal_/uniform_ draw different numbers under different CPU kernel sets
    (ATEN_CPU_CAPABILITY default vs avx2), so replicas would start apart. Here the values
    come from PCG64's raw 64-bit outputs (a fixed algorithm on every platform; unlike
    `Generator.integers`, whose method numpy may change between versions), whose top 53
    bits, divided by 2^53, are exactly a float64 u in [0, 1); then `u * 2a - a` with
    a = std * sqrt(3) (uniform on [-a, a) has standard deviation a / sqrt(3)): two IEEE
    operations in float64, then one rounding to fp32.
    """
    count = param.numel()
    half_width = std * math.sqrt(3.0)
    if param.device.type == "meta":  # shapes only (size checks): skip the draws
        rng.advance(count)
        return
    flat = torch.empty(count, dtype=torch.float32)
    # A chunk at a time (the stream does not depend on it): small temporaries are reused
    # by malloc, while fresh ones as large as the tensor cost more in page faults.
    for start in range(0, count, _INIT_CHUNK):
        bits = rng.random_raw(min(_INIT_CHUNK, count - start))
        bits >>= np.uint64(11)
        values = bits.astype(np.float64)  # integers below 2^53: exact
        values /= 2.0**53  # a power of two: exact
        values *= 2.0 * half_width
        values -= half_width
        flat[start : start + values.size] = torch.from_numpy(values.astype(np.float32))
    with torch.no_grad():
        param.copy_(flat.view(param.shape))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean-centering)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2) for rotary position embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x (batch, heads, seq, head_dim) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.head_dim = shape.dim // shape.num_heads
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim, bias=False)
        self.out = nn.Linear(shape.dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    """Gated feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.up = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.down = nn.Linear(shape.ffn_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attn = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.ffn = SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """The language model: embed, blocks, norm, tied output projection."""

    def __init__(self, shape: ModelShape, seed: int = 0) -> None:
        super().__init__()
        if shape.dim % shape.num_heads or (shape.dim // shape.num_heads) % 2:
            raise ValueError(
                f"dim {shape.dim} must split into an even head size over {shape.num_heads} heads"
            )
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.dim)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        cos, sin = rotary_table(shape.dim // shape.num_heads, shape.max_seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style scales: std 0.02, residual projections scaled by 1/sqrt(2 * layers).

        Drawn uniform (same std) from one PCG64 stream in parameter order, so `seed` gives
        the same bits on every CPU (see `portable_uniform_`); gains stay at one.
        """
        rng = np.random.PCG64(seed)
        residual_std = 0.02 / math.sqrt(2 * self.shape.num_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue
            std = residual_std if name.endswith(("out.weight", "down.weight")) else 0.02
            portable_uniform_(param, std, rng)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        seq = tokens.shape[1]
        if seq > self.shape.max_seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds max_seq_len {self.shape.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        # Tied embeddings: the output projection reuses the input embedding matrix.
        return F.linear(self.norm(x), self.embed.weight)

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        stop_token: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`tokens` (batch, seq) followed by up to `max_new_tokens` new ones (nanoGPT's loop).

        Greedy at `temperature` 0, else sampled from the softmax at that temperature, from
        the `top_k` likeliest tokens when `top_k` > 0. The context is cropped to the last
        `max_seq_len` tokens (no KV cache: one full forward a token, fine for a preview).
        Stops early once every sequence has produced `stop_token`.
        """
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.shape.max_seq_len :])[:, -1, :].float()
            if temperature <= 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat((tokens, next_token), dim=1)
            if stop_token is not None:
                done |= next_token[:, 0] == stop_token
                if bool(done.all()):
                    break
        return tokens

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) over a batch of sequences (batch, seq + 1)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


def build_model(preset: str, *, seed: int = 0, max_seq_len: int = 2048) -> Decoder:
    """A freshly initialised decoder; the same `seed` gives bit-identical weights on every peer."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {tuple(PRESETS)}")
    shape = PRESETS[preset]
    shape = ModelShape(**{**shape.__dict__, "max_seq_len": max(max_seq_len, 8)})
    # The layers' default init draws from torch's global generator before reset_parameters
    # overwrites it with the portable one: keep the caller's random stream untouched.
    generator_state = torch.random.get_rng_state()
    try:
        return Decoder(shape, seed=seed)
    finally:
        torch.random.set_rng_state(generator_state)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
