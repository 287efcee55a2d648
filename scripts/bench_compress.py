"""Benchmark: size, speed and error of every codec, next to memcpy and hivemind's codecs.

Three inputs, measured in the same run:

- `delta`  : a real pseudo-gradient, theta_before - theta_after of ~20 AdamW steps of the
             project's decoder (`p2pdiloco.training.model.build_model`) on random tokens, encoded
             tensor by tensor as a learner would; a stand-in transformer-ish torch module
             is trained instead when the project model cannot be imported;
- `large`  : one 100M-element tensor (10M with --quick) with the delta's spread;
- `update` : the outer update of K = 4 learners (--learners): each trains from the same
             initial model on its own tokens, its delta goes through `sparse2`, and the
             mean of the decoded deltas (their union, denser than each) is encoded again
             with `int8` (the default outer codec), with `sparse2` at K times the delta's k
             (the whole union; `compress.outer_sparse_k` is 256 = 4 x 64) and at its k.

Per codec: bytes_per_param (payload bytes / elements), encode_gbps and decode_gbps
(GB/s of fp32 input, 1 GB = 10^9 bytes, best of N), rel_error (L2 error / L2 input),
kept_rel_error (the same over the entries that decode nonzero: a sparse codec's value error).
`memcpy_gbps` is a plain tensor copy of the same input; hivemind's Float16Compression
and Uniform8BitQuantization are measured through their compress()/extract().

    python scripts/bench_compress.py [--quick] [--json PATH] [--threads N] [--repeats N]
                                     [--clock wall|cpu] [--learners K]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

# hivemind's 8-bit codec uses torch.quantize_per_tensor, deprecated in torch 2.13
warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from p2pdiloco.compress import CODECS, Codec, decode_tensor, make_codec  # noqa: E402

VARIANTS = [*CODECS, "int8+zstd"]
SPARSE_K = 64  # sparse2's default k per chunk of 4096 (1.56%)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (the box is shared, so best-of)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return max(best, 1e-9)


# ---------------------------------------------------------------------------------------
# inputs


class StandIn(nn.Module):
    """A small transformer-ish block stack, used only when p2pdiloco.training.model is unavailable."""

    def __init__(self, vocab: int = 257, dim: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def build_model(quick: bool) -> tuple[nn.Module, int, str]:
    """The project decoder (tiny or small preset) or the stand-in, its vocab, and a label."""
    try:
        from p2pdiloco.training.model import build_model as build_project_model

        preset = "tiny" if quick else "small"
        model = build_project_model(preset, seed=0, max_seq_len=128)
        return model, int(model.shape.vocab_size), f"p2pdiloco.training.model {preset}"
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        print(f"project model unavailable ({exc!r}); training a stand-in module")
        torch.manual_seed(0)
        return StandIn(), 257, "stand-in transformer"


def real_delta(quick: bool, steps: int = 20, seed: int = 0) -> tuple[dict[str, torch.Tensor], str]:
    """theta_before - theta_after of `steps` AdamW steps on random tokens, by tensor name.

    The initial model is the same for every `seed`; the seed draws the tokens (a learner).
    """
    model, vocab, label = build_model(quick)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (8, 65), generator=generator)
        loss = model.loss(tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    delta = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    numel = sum(t.numel() for t in delta.values())
    return delta, f"{label}, {numel / 1e6:.2f}M params, {steps} AdamW steps"


# ---------------------------------------------------------------------------------------
# measurements


def figures(
    encode: Callable[[torch.Tensor], Any],
    decode: Callable[[Any], torch.Tensor],
    nbytes: Callable[[Any], int],
    tensors: list[torch.Tensor],
    repeats: int,
) -> dict[str, float]:
    """bytes_per_param, encode/decode GB/s and rel_error of one codec over `tensors`."""
    numel = sum(t.numel() for t in tensors)
    encoded = [encode(t) for t in tensors]
    decoded = [decode(e) for e in encoded]
    err = math.sqrt(
        sum(float((d.float() - t).pow(2).sum()) for d, t in zip(decoded, tensors, strict=True))
    )
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in tensors))
    # the error on the entries a sparse codec kept (the rest is error feedback's business)
    kept = [(d.float() != 0, d.float(), t) for d, t in zip(decoded, tensors, strict=True)]
    kept_err = math.sqrt(sum(float((d - t)[m].pow(2).sum()) for m, d, t in kept))
    kept_norm = math.sqrt(sum(float(t[m].pow(2).sum()) for m, _, t in kept))
    enc_s = best_seconds(lambda: [encode(t) for t in tensors], repeats)
    dec_s = best_seconds(lambda: [decode(e) for e in encoded], repeats)
    return {
        "bytes_per_param": sum(nbytes(e) for e in encoded) / numel,
        "encode_gbps": numel * 4 / enc_s / 1e9,
        "decode_gbps": numel * 4 / dec_s / 1e9,
        "rel_error": err / norm,
        "kept_rel_error": kept_err / kept_norm if kept_norm else 0.0,
    }


def ours(variant: str) -> Codec:
    name, _, stage = variant.partition("+")
    return make_codec(name, zstd=stage == "zstd")


def extract_quantized(serialized: Any) -> torch.Tensor:
    """hivemind 1.1.12's Quantization.extract, line for line, but numpy-2 safe.

    Its `int(np.frombuffer(..., count=1))` raises TypeError on numpy >= 2.1 (1-d array to
    scalar); reading element [0] instead is the only change.
    """
    import numpy as np

    buffer = serialized.buffer
    codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=np.float32)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=np.uint8)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))
    return codebook[quantized]


def measure(tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    """Every codec, memcpy and hivemind's codecs on the same tensors."""
    out: dict[str, Any] = {"codecs": {}, "hivemind": {}}
    for variant in VARIANTS:
        codec = ours(variant)
        out["codecs"][variant] = figures(
            codec.encode, decode_tensor, lambda e: e.nbytes, tensors, repeats
        )
    numel = sum(t.numel() for t in tensors)
    out["memcpy_gbps"] = (
        numel * 4 / best_seconds(lambda: [t.clone() for t in tensors], repeats) / 1e9
    )
    try:
        from hivemind.compression import (
            CompressionInfo,
            Float16Compression,
            Uniform8BitQuantization,
        )
    except ImportError as exc:  # the benchmark still reports our codecs
        print(f"hivemind unavailable ({exc!r})")
        return out
    for label, comp, extract in [
        ("fp16", Float16Compression(), None),
        ("uniform8bit", Uniform8BitQuantization(), extract_quantized),
    ]:
        out["hivemind"][label] = figures(
            lambda t, c=comp: c.compress(t, CompressionInfo.from_tensor(t)),
            extract or (lambda s, c=comp: c.extract(s)),
            lambda s: len(s.buffer),
            tensors,
            repeats,
        )
    return out


def outer_update(
    deltas: list[dict[str, torch.Tensor]], repeats: int
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The K learners' deltas through sparse2, merged (mean of the decoded), and the merged
    update encoded again: its density, and sparse2's figures on it at K*k and at k."""
    codec = make_codec("sparse2")
    decoded = [{n: decode_tensor(codec.encode(t)) for n, t in delta.items()} for delta in deltas]
    merged = [sum(d[n] for d in decoded) / len(decoded) for n in deltas[0]]
    numel = sum(t.numel() for t in merged)
    learners = len(deltas)
    out: dict[str, Any] = {
        "learners": learners,
        "delta_nonzero_per_param": sum(int((t != 0).sum()) for t in decoded[0].values()) / numel,
        "union_nonzero_per_param": sum(int((t != 0).sum()) for t in merged) / numel,
        "codecs": {},
    }
    update_codecs = {"int8": make_codec("int8")}
    for k in (learners * SPARSE_K, SPARSE_K):
        update_codecs[f"sparse2 k={k}"] = make_codec("sparse2", sparse_k=k)
    for name, update_codec in update_codecs.items():
        out["codecs"][name] = figures(
            update_codec.encode, decode_tensor, lambda e: e.nbytes, merged, repeats
        )
    return out, merged


def check_sparse_targets(
    delta: dict[str, Any], large: dict[str, Any], update: dict[str, Any] | None
) -> dict[str, bool]:
    """Issue 43's targets for sparse2: bytes of the delta and of the K = 4 outer update
    (at K times the delta's k: the whole union), and one core's encode speed (large tensor)."""
    targets = {
        "sparse2_delta_bytes_le_0.04": delta["codecs"]["sparse2"]["bytes_per_param"] <= 0.04,
        "sparse2_encode_ge_0.3_gbps": large["codecs"]["sparse2"]["encode_gbps"] >= 0.3,
    }
    if update is not None:
        whole = update["codecs"][f"sparse2 k={update['learners'] * SPARSE_K}"]
        targets["sparse2_update_bytes_le_0.16"] = whole["bytes_per_param"] <= 0.16
    return targets


def check_targets(result: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets, on one measured input."""
    codecs, memcpy = result["codecs"], result["memcpy_gbps"]
    int8 = codecs["int8"]
    targets = {
        "int8_bytes_le_1.02": int8["bytes_per_param"] <= 1.02,
        "int4_bytes_le_0.52": codecs["int4"]["bytes_per_param"] <= 0.52,
        "fp4_bytes_le_0.52": codecs["fp4"]["bytes_per_param"] <= 0.52,
        # the optional zstd stage is single-threaded entropy coding; it is reported, not held.
        # sparse2 selects (a top-k per chunk, ~4x a copy's work) and is held to issue 43's
        # own 0.3 GB/s instead (`check_sparse_targets`).
        "encode_ge_20pct_memcpy": all(
            codecs[c]["encode_gbps"] >= 0.2 * memcpy for c in CODECS if c != "sparse2"
        ),
    }
    hm = result["hivemind"].get("uniform8bit")
    if hm is not None:
        targets["int8_error_le_hivemind8"] = int8["rel_error"] <= hm["rel_error"]
        ours_s = 1 / int8["encode_gbps"] + 1 / int8["decode_gbps"]
        theirs_s = 1 / hm["encode_gbps"] + 1 / hm["decode_gbps"]
        targets["int8_roundtrip_not_slower_than_hivemind8"] = ours_s <= theirs_s
    return targets


def print_table(title: str, result: dict[str, Any]) -> None:
    print(f"\n{title}  (memcpy {result['memcpy_gbps']:.2f} GB/s)")
    print(
        f"{'codec':<20}{'B/param':>9}{'enc GB/s':>10}{'dec GB/s':>10}{'rel err':>10}"
        f"{'kept err':>10}"
    )
    rows = list(result["codecs"].items())
    rows += [(f"hivemind {k}", v) for k, v in result["hivemind"].items()]
    for name, f in rows:
        print(
            f"{name:<20}{f['bytes_per_param']:>9.4f}{f['encode_gbps']:>10.2f}"
            f"{f['decode_gbps']:>10.2f}{f['rel_error']:>10.4%}{f['kept_rel_error']:>10.4%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10M elements, ~1 min")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--repeats", type=int, default=0, help="timed repetitions (0: auto)")
    parser.add_argument(
        "--learners", type=int, default=4, help="K deltas merged into the outer update (0: skip)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall seconds, or this process's CPU seconds (with --threads 1: what one idle "
        "core would take, robust to other load on a shared box)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or 3
    large_numel = 10_000_000 if args.quick else 100_000_000

    delta, delta_label = real_delta(args.quick)
    delta_result = measure(list(delta.values()), repeats)
    delta_result["input"] = delta_label
    print_table(f"delta: {delta_label}", delta_result)

    update_result = None
    if args.learners:
        deltas = [delta] + [real_delta(args.quick, seed=s)[0] for s in range(1, args.learners)]
        update_result, merged = outer_update(deltas, repeats)
        update_result["input"] = f"mean of {args.learners} sparse2 deltas ({delta_label})"
        update_result["memcpy_gbps"] = (
            sum(t.numel() for t in merged)
            * 4
            / best_seconds(lambda: [t.clone() for t in merged], repeats)
            / 1e9
        )
        update_result["hivemind"] = {}
        print(
            f"\nupdate: nonzero per param {update_result['delta_nonzero_per_param']:.4f} in "
            f"a delta, {update_result['union_nonzero_per_param']:.4f} in the mean of "
            f"{args.learners}"
        )
        print_table(f"update: {update_result['input']}", update_result)

    spread = float(torch.cat([t.reshape(-1) for t in delta.values()]).std())
    generator = torch.Generator().manual_seed(1)
    large = torch.randn(large_numel, generator=generator) * spread
    large_result = measure([large], repeats)
    large_result["input"] = f"{large_numel / 1e6:.0f}M-element Gaussian, std {spread:.2e}"
    print_table(f"large: {large_result['input']}", large_result)

    targets = check_targets(large_result)
    targets.update(check_sparse_targets(delta_result, large_result, update_result))
    report = {
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "clock": args.clock,
        "delta": delta_result,
        "large": large_result,
        "update": update_result,
        # the top-level keys, on the large tensor
        "codecs": large_result["codecs"],
        "memcpy_gbps": large_result["memcpy_gbps"],
        "hivemind": large_result["hivemind"],
        "targets": targets,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    c, h = large_result["codecs"], large_result["hivemind"]
    hm8 = h.get("uniform8bit", {}).get("rel_error", float("nan"))
    met = sum(targets.values())
    print(
        f"\nbench_compress: int8 {c['int8']['bytes_per_param']:.3f} B/param err "
        f"{c['int8']['rel_error']:.2%} (hivemind 8bit {hm8:.2%}), int4 "
        f"{c['int4']['bytes_per_param']:.3f} err {c['int4']['rel_error']:.1%}, fp4 "
        f"{c['fp4']['bytes_per_param']:.3f} err {c['fp4']['rel_error']:.1%}, int8 enc "
        f"{c['int8']['encode_gbps']:.2f} GB/s vs memcpy {large_result['memcpy_gbps']:.2f}; "
        f"sparse2 delta {delta_result['codecs']['sparse2']['bytes_per_param']:.4f} B/param "
        f"err {delta_result['codecs']['sparse2']['rel_error']:.1%}, enc "
        f"{c['sparse2']['encode_gbps']:.2f} dec {c['sparse2']['decode_gbps']:.2f} GB/s"
        + (
            ""
            if update_result is None
            else ", update "
            + ", ".join(
                f"{name} {f['bytes_per_param']:.4f} err {f['rel_error']:.1%}"
                for name, f in update_result["codecs"].items()
            )
        )
        + f"; targets met {met}/{len(targets)}"
        + ("" if met == len(targets) else f" (missed: {[k for k, v in targets.items() if not v]})")
    )


if __name__ == "__main__":
    main()
