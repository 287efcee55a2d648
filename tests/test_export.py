"""The trained model leaves the swarm: `transformers` loads the export as LlamaForCausalLM
and computes our logits (max abs difference below 1e-4 in fp32), its tokenizer gives our
byte ids, and `p2pdiloco export` / `generate` report bad input in one line, exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2pdiloco.cli.main import main
from p2pdiloco.config import config_hash
from p2pdiloco.errors import ConfigError
from p2pdiloco.peer.checkpoint import FILE_NAME, read_model_state, save_learner
from p2pdiloco.training.data import EOS, decode_tokens, encode_text
from p2pdiloco.training.export import (
    ExportError,
    hf_state_dict,
    model_shape,
    preset_of,
    write_hf_model,
)
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ_LEN = 64
LOGITS_ATOL = 1e-4
"""fp32 on both sides: the two implementations differ only in summation order (~1e-6 seen)."""
TINY = ["--set", "model.preset='tiny'", "--set", f"model.seq_len={SEQ_LEN}"]
TEXT = "def add(a, b):\n    return a + b  # héllo, wörld — ∑ 😀\n"


@dataclasses.dataclass
class Progress:
    """The part of the learner's progress a checkpoint keeps (`save_learner` reads `step`)."""

    step: int = 7


@dataclasses.dataclass
class SavedLearner:
    """What `save_learner` reads of a learner: its trainer, progress and codec feedback."""

    trainer: InnerTrainer
    progress: Progress = dataclasses.field(default_factory=Progress)
    feedback: None = None

    def local_work(self) -> dict:
        return {}  # no local work off its base: the checkpoint's model is what is exported


def trained_decoder(seed: int = 3):
    """A tiny decoder whose every tensor, the RMSNorm gains included, moved off its init
    (as training moves them), so a name mapped to the wrong place shows in the logits."""
    model = build_model("tiny", seed=seed, max_seq_len=SEQ_LEN)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_config, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A checkpoint folder as `join --checkpoint-dir` writes it, and the model inside."""
    model = trained_decoder()
    folder = tmp_path_factory.mktemp("ckpt")
    trainer = InnerTrainer(model, tiny_config.train, torch.device("cpu"))
    save_learner(folder, SavedLearner(trainer), config_hash(tiny_config))
    return folder, model


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    folder, _ = checkpoint
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", "--checkpoint", str(folder), "--out", str(out), *TINY]) == 0
    return out


def fixed_batch() -> torch.Tensor:
    """Two sequences: random ids over the whole vocabulary (EOS included), and text bytes."""
    noise = torch.randint(0, 257, (1, 48), generator=torch.Generator().manual_seed(0))
    text = encode_text(TEXT)[:48][None, :]
    return torch.cat([noise, text])


def test_transformers_loads_the_export_and_computes_our_logits(checkpoint, exported) -> None:
    _, ours = checkpoint
    theirs = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    tokens = fixed_batch()
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert got.shape == expected.shape == (2, 48, 257)
    assert (got - expected).abs().max().item() < LOGITS_ATOL


def test_greedy_generation_is_the_same_in_transformers_and_ours(checkpoint, exported) -> None:
    _, ours = checkpoint
    theirs = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    prompt = encode_text("import os\n")[None, :]
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        by_them = theirs.generate(
            prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert by_them.tolist() == ours.generate(prompt, 12).tolist()


def test_the_files_say_llama_tied_embeddings_byte_vocabulary_and_context(exported) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == 257 and config["eos_token_id"] == EOS
    assert config["tie_word_embeddings"] and config["max_position_embeddings"] == SEQ_LEN
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == EOS
    tensors = safetensors_torch.load_file(exported / "model.safetensors")
    assert "lm_head.weight" not in tensors  # tied: the embedding serves both ends
    assert len(tensors) == 2 + 9 * 4


def test_the_tokenizer_gives_our_byte_ids_and_decodes_them_back(exported) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == encode_text(TEXT).tolist()
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token_id == EOS
    assert tokenizer.decode([104, 105, EOS], skip_special_tokens=True) == "hi"


def test_the_rotary_permutation_moves_rows_only_inside_each_head() -> None:
    model = trained_decoder()
    params = dict(model.state_dict())
    shape = model_shape(params, SEQ_LEN)
    converted = hf_state_dict(params, shape)
    head_dim = shape.dim // shape.num_heads
    q = params["blocks.0.attn.qkv.weight"][: shape.dim]
    q_hf = converted["model.layers.0.self_attn.q_proj.weight"]
    for head in range(shape.num_heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        assert torch.equal(q_hf[rows][: head_dim // 2], q[rows][0::2])  # pair i, first half
        assert torch.equal(q_hf[rows][head_dim // 2 :], q[rows][1::2])  # pair i, second half
    v = params["blocks.0.attn.qkv.weight"][2 * shape.dim :]
    assert torch.equal(converted["model.layers.0.self_attn.v_proj.weight"], v)


def test_tensors_that_are_not_a_decoder_of_a_known_shape_are_refused(tmp_path) -> None:
    params = dict(trained_decoder().state_dict())
    with pytest.raises(ExportError, match="no model preset"):
        preset_of({**params, "embed.weight": torch.zeros(257, 96)})
    shape = model_shape(params, SEQ_LEN)
    with pytest.raises(ExportError, match="missing"):
        hf_state_dict({k: v for k, v in params.items() if k != "blocks.2.ffn.up.weight"}, shape)
    with pytest.raises(ExportError, match="unexpected"):
        hf_state_dict({**params, "blocks.0.attn.bias": torch.zeros(3)}, shape)
    with pytest.raises(ExportError, match="not a p2pdiloco decoder"):
        write_hf_model(tmp_path / "out", {"w": torch.zeros(2, 2)}, SEQ_LEN, {})
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_gives_its_model_tensors_and_config_hash(checkpoint, tiny_config) -> None:
    folder, model = checkpoint
    params, saved_hash = read_model_state(folder)
    assert saved_hash == config_hash(tiny_config)
    assert params.keys() == model.state_dict().keys()
    assert all(torch.equal(params[n], t) for n, t in model.state_dict().items())
    with pytest.raises(ConfigError, match="no learner.pt"):
        read_model_state(folder.parent)


def test_generate_prints_the_prompt_and_its_continuation(checkpoint, capsys) -> None:
    folder, model = checkpoint
    args = ["generate", "--checkpoint", str(folder), *TINY, "--max-new-tokens", "6"]
    assert main([*args, "import "]) == 0
    continuation = model.generate(encode_text("import ")[None, :], 6, stop_token=EOS)[
        0, 7:
    ].tolist()
    if EOS in continuation:
        continuation = continuation[: continuation.index(EOS)]
    assert capsys.readouterr().out == "import " + decode_tokens(torch.tensor(continuation)) + "\n"
    sampled = []
    for _ in range(2):
        assert main([*args, "--temperature", "1.0", "--top-k", "20", "--seed", "5", "import "]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1]  # a seed gives the same sample
    assert main([*args, ""]) == 0  # an empty prompt starts a document


def test_export_and_generate_run_as_a_user_runs_them(checkpoint, tmp_path) -> None:
    folder, _ = checkpoint
    out = tmp_path / "model"
    exported = subprocess.run(
        [sys.executable, "-m", "p2pdiloco", "export", "--checkpoint", str(folder), "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    assert f"wrote {out}" in exported.stdout and (out / "model.safetensors").is_file()
    generated = subprocess.run(
        [sys.executable, "-m", "p2pdiloco", "generate", "--checkpoint", str(folder), *TINY, "hello"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("hello")


def _not_a_checkpoint(tmp_path: Path) -> str:
    (tmp_path / FILE_NAME).write_bytes(b"not a zip file at all")
    return str(tmp_path)


def _foreign_model(tmp_path: Path) -> str:
    torch.save({"config_hash": "x", "model": {"w": torch.zeros(3, 3)}}, tmp_path / FILE_NAME)
    return str(tmp_path)


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "model")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (lambda t, c: ["export", "--out", str(t / "o")], "which model? --checkpoint DIR"),
        (lambda t, c: ["export", "--checkpoint", str(t), "--out", str(t / "o")], "no learner.pt"),
        (
            lambda t, c: ["export", "--checkpoint", c, "--run", "local", "--out", str(t / "o")],
            "two models",
        ),
        (
            lambda t, c: ["export", "--checkpoint", _not_a_checkpoint(t), "--out", str(t / "o")],
            "unreadable",
        ),
        (
            lambda t, c: ["export", "--checkpoint", _foreign_model(t), "--out", str(t / "o")],
            "not a p2pdiloco decoder",
        ),
        (
            lambda t, c: ["export", "--checkpoint", c, "--out", _a_file(t), *TINY],
            "cannot write the model",
        ),
        (lambda t, c: ["export", "--checkpoint", c], "required: --out"),
        (
            lambda t, c: ["generate", "--checkpoint", c, "--max-new-tokens", "0", "hi"],
            "--max-new-tokens",
        ),
        (
            lambda t, c: ["generate", "--checkpoint", c, "--temperature", "-1", "hi"],
            "--temperature",
        ),
        (lambda t, c: ["generate", "hi"], "which model?"),
        (lambda t, c: ["generate", "--checkpoint", c], "required: prompt"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(
    argv, message, checkpoint, tmp_path, capsys
) -> None:
    folder, _ = checkpoint
    try:
        code = main(argv(tmp_path, str(folder)))
    except SystemExit as exc:  # argparse's own errors exit through _Parser.error
        code = exc.code
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines


def test_push_to_hub_without_a_token_stops_before_fetching_anything(
    checkpoint, tmp_path, capsys, monkeypatch
) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    folder, _ = checkpoint
    out = tmp_path / "model"
    argv = ["export", "--checkpoint", str(folder), "--out", str(out), "--push-to-hub", "me/model"]
    assert main(argv) == 2
    assert "needs a Hugging Face token" in capsys.readouterr().err
    assert not out.exists()
