"""The trained model out of the swarm: files that `transformers` loads as `LlamaForCausalLM`.

Our decoder (`model.Decoder`) is Llama's architecture (pre-norm RMSNorm blocks, rotary
attention without biases, SwiGLU, a final RMSNorm), so its tensors map onto
`LlamaForCausalLM`'s name by name, with three differences taken care of here:

- `attn.qkv` is one matrix: its rows are q, k, v (each head after head), split into
  `q_proj`, `k_proj`, `v_proj`.
- Rotary layout. We rotate interleaved channel pairs (2i, 2i+1) of each head, as Meta's
  original Llama code does; transformers rotates halves (i, i + head_dim/2) (`rotate_half`),
  with the same frequency for pair i. Reordering the rows of q and k inside each head turns
  one into the other (the permutation of transformers' `convert_llama_weights_to_hf.py`);
  q.k is unchanged because both sides are reordered alike.
- Tied embeddings: `tie_word_embeddings`, and no `lm_head` tensor in the file.

Tokens are bytes (ids 0..255) and EOS (256, `data.EOS`): `tokenizer.json` describes them
as a byte-level BPE without merges, so `AutoTokenizer` gives the ids `data.encode_text`
gives. Pure: tensors and files in, no network (`--push-to-hub` lives in the CLI).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from p2pdiloco.errors import ConfigError
from p2pdiloco.training.data import EOS
from p2pdiloco.training.model import PRESETS, Decoder, ModelShape, build_model

WEIGHTS_FILE = "model.safetensors"
EOS_TEXT = "<|endoftext|>"
"""How the tokenizer writes EOS (the token between documents)."""
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.")


class ExportError(ConfigError):
    """Tensors that are not a p2pdiloco decoder of a known shape, or an unwritable folder."""


# --- shape and names ------------------------------------------------------------------


def preset_of(params: Mapping[str, torch.Tensor]) -> str:
    """The model preset whose shapes `params` has (the head count is not in the shapes)."""
    embed, gate = params.get("embed.weight"), params.get("blocks.0.ffn.gate.weight")
    if embed is None or gate is None or embed.dim() != 2 or gate.dim() != 2:
        raise ExportError(
            "the tensors are not a p2pdiloco decoder (no embed.weight or blocks.0.ffn)"
        )
    layers = len({int(m.group(1)) for name in params if (m := _BLOCK_KEY.match(name))})
    found = (embed.shape[0], embed.shape[1], layers, gate.shape[0])
    for name, shape in PRESETS.items():
        if (shape.vocab_size, shape.dim, shape.num_layers, shape.ffn_dim) == found:
            return name
    raise ExportError(
        f"no model preset has vocab {found[0]}, dim {found[1]}, {found[2]} layers, ffn {found[3]} "
        f"(presets: {', '.join(PRESETS)})"
    )


def model_shape(params: Mapping[str, torch.Tensor], max_seq_len: int) -> ModelShape:
    """The decoder shape of `params`, with the context length it was trained at."""
    return replace(PRESETS[preset_of(params)], max_seq_len=max(max_seq_len, 8))


def _permute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of q or k from interleaved rotary pairs to transformers' halves, head by head."""
    rows, cols = weight.shape
    return (
        weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    )


def hf_state_dict(params: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """`params` (our names) as `LlamaForCausalLM` tensors (its names), fp32, contiguous.

    Every tensor of ours must be used and every one transformers needs produced: a missing
    or extra name is an ExportError, never a silently random layer.
    """
    dim = shape.dim
    mapping: dict[str, str] = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    for i in range(shape.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        mapping |= {
            ours + "attn_norm.weight": theirs + "input_layernorm.weight",
            ours + "attn.out.weight": theirs + "self_attn.o_proj.weight",
            ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
            ours + "ffn.gate.weight": theirs + "mlp.gate_proj.weight",
            ours + "ffn.up.weight": theirs + "mlp.up_proj.weight",
            ours + "ffn.down.weight": theirs + "mlp.down_proj.weight",
        }
    qkv_names = {
        f"blocks.{i}.attn.qkv.weight": f"model.layers.{i}.self_attn."
        for i in range(shape.num_layers)
    }
    missing = sorted((set(mapping) | set(qkv_names)) - set(params))
    extra = sorted(set(params) - set(mapping) - set(qkv_names))
    if missing or extra:
        raise ExportError(
            f"the tensors do not match a {shape.num_layers}-layer decoder: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    out = {theirs: params[ours].detach().float() for ours, theirs in mapping.items()}
    for ours, prefix in qkv_names.items():
        qkv = params[ours].detach().float()
        if qkv.shape != (3 * dim, dim):
            raise ExportError(f"{ours} has shape {tuple(qkv.shape)}, expected {(3 * dim, dim)}")
        q, k, v = qkv.split(dim)
        out[prefix + "q_proj.weight"] = _permute_rotary(q, shape.num_heads)
        out[prefix + "k_proj.weight"] = _permute_rotary(k, shape.num_heads)
        out[prefix + "v_proj.weight"] = v
    return {name: tensor.contiguous() for name, tensor in sorted(out.items())}


# --- the files ------------------------------------------------------------------------


def hf_config(shape: ModelShape) -> dict:
    """`config.json` of `LlamaForCausalLM` for `shape` (keys for transformers 4.x and 5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_heads,
        "head_dim": shape.dim // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shape.norm_eps,
        # 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def generation_config() -> dict:
    """`generation_config.json`: stop at EOS; no BOS (our sequences start with text)."""
    return {"bos_token_id": None, "eos_token_id": EOS, "pad_token_id": EOS, "do_sample": False}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel BPE uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_files(model_max_length: int) -> dict[str, dict]:
    """`tokenizer.json` (id b for byte b, EOS 256), `tokenizer_config.json` and
    `special_tokens_map.json` for `AutoTokenizer`."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    eos = {"id": EOS, "content": EOS_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}  # fmt: skip
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [eos],
        "normalizer": None,
        # the whole text is one "word": without merges, BPE leaves one token a byte
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },  # fmt: skip
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TEXT,
        "pad_token": EOS_TEXT,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(EOS): {k: v for k, v in eos.items() if k != "id"}},
    }
    return {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": config,
        "special_tokens_map.json": {"eos_token": EOS_TEXT, "pad_token": EOS_TEXT},
    }


def _model_card(shape: ModelShape, preset: str, source: Mapping[str, str]) -> str:
    lines = [
        f"# p2pdiloco `{preset}` decoder",
        "",
        "A Llama-style byte-level language model trained by a p2pdiloco swarm",
        "(peer-to-peer Decoupled DiLoCo). Tokens are UTF-8 bytes (ids 0-255) and EOS (256).",
        "",
        f"- shape: dim {shape.dim}, {shape.num_layers} layers, {shape.num_heads} heads, "
        f"ffn {shape.ffn_dim}, trained context {shape.max_seq_len} tokens",
        *(f"- {key}: {value}" for key, value in source.items()),
        "",
        "```python",
        "from transformers import AutoTokenizer, LlamaForCausalLM",
        'model = LlamaForCausalLM.from_pretrained("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
    ]
    return "\n".join(lines)


def write_hf_model(
    out: str | Path, params: Mapping[str, torch.Tensor], max_seq_len: int, source: Mapping[str, str]
) -> list[Path]:
    """Write `params` (our names) into folder `out` as a `transformers` model; returns the
    files written. `source` (short strings: where the weights came from, rounds, hashes)
    goes into the safetensors metadata and the model card.
    """
    from safetensors.torch import save_file

    preset = preset_of(params)
    shape = model_shape(params, max_seq_len)
    tensors = hf_state_dict(params, shape)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            tensors,
            str(out / WEIGHTS_FILE),
            metadata={"format": "pt", "p2pdiloco_preset": preset, **source},
        )
        documents = {"config.json": hf_config(shape), "generation_config.json": generation_config()}
        documents |= tokenizer_files(shape.max_seq_len)
        for name, document in documents.items():
            (out / name).write_text(
                json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
        (out / "README.md").write_text(_model_card(shape, preset, source), encoding="utf-8")
    except OSError as exc:
        raise ExportError(f"cannot write the model to {out}: {exc.strerror or exc}") from None
    return [out / WEIGHTS_FILE, *(out / name for name in documents), out / "README.md"]


def decoder_of(params: Mapping[str, torch.Tensor], max_seq_len: int) -> Decoder:
    """Our decoder holding `params` (to generate from), in eval mode."""
    preset = preset_of(params)
    model = build_model(preset, max_seq_len=max_seq_len)
    try:
        model.load_state_dict(dict(params), strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportError(f"the tensors do not fit the {preset} decoder ({first})") from None
    return model.eval()


__all__ = [
    "ExportError",
    "decoder_of",
    "generation_config",
    "hf_config",
    "hf_state_dict",
    "model_shape",
    "preset_of",
    "tokenizer_files",
    "write_hf_model",
]
