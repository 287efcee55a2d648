"""`p2pdiloco export` and `p2pdiloco generate`: the model a run is training, taken out of
the swarm.

The model comes from one of two places: a learner's checkpoint (`--checkpoint DIR`, a
`join --checkpoint-dir` folder: that learner's replica), or a live run (`--run NAME` and
the other run-finding flags: its current verified global model, caught up as an observer
would). `export` writes it as safetensors that `transformers` loads; `generate`
continues a prompt with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from p2pdiloco.cli.options import (
    add_config_options,
    add_watch_flags,
    config_from_args,
    names_a_run,
    observer_config,
)
from p2pdiloco.errors import ConfigError

log = logging.getLogger("p2pdiloco")


def _download_global_model(args: argparse.Namespace) -> tuple[dict, int, dict[str, str]]:
    """The live run's current verified global parameters, caught up as an observer would."""
    import asyncio

    from p2pdiloco.errors import NetworkSetupError
    from p2pdiloco.peer.daemon import make_transport_for
    from p2pdiloco.roles.observer import download_global_state

    config, admission = observer_config(args)
    run = config.peer.run
    transport = make_transport_for(dataclasses.replace(config.peer, client_mode=True), kind=config.network.transport)

    async def download():
        await transport.start()
        try:
            return await download_global_state(transport, config, admission, args.wait_s)
        finally:
            await transport.shutdown()

    state = asyncio.run(download())
    if state is None:
        raise NetworkSetupError(
            f"could not catch up with run {run!r} within {args.wait_s:g} s: no live learner served "
            f"its state (is it up? `p2pdiloco status --run {run}`; or raise --wait-s)"
        )
    rounds = [state.round_of(f) for f in range(state.num_fragments)]
    if not any(rounds):
        log.warning("run %s is at round 0 everywhere: these are its initial weights", run)
    source = {
        "source": f"run {run}",
        "rounds": ",".join(map(str, rounds)),
        "hashes": ",".join(state.fragment_hash(f) for f in range(state.num_fragments)),
    }
    return dict(state.params), config.model.seq_len, source


def _model_params(args: argparse.Namespace) -> tuple[dict, int, dict[str, str]]:
    """(the model's tensors by name, its trained context length in tokens, where they came
    from): a checkpoint's replica with --checkpoint, else a live run's global model."""
    if args.checkpoint is None:
        if not names_a_run(args):
            raise ConfigError(
                "which model? --checkpoint DIR (a `join --checkpoint-dir` folder) or --run NAME (a live run)"
            )
        return _download_global_model(args)
    if names_a_run(args):
        raise ConfigError("--checkpoint and --run/--manifest/--initial-peers name two models: give one")
    from p2pdiloco.peer.checkpoint import read_model_state

    # A checkpoint names its run config by hash only: the shape comes from its tensors,
    # the context length from --config/--set (model.seq_len).
    config = config_from_args(args)
    params, saved_hash = read_model_state(args.checkpoint)
    return params, config.model.seq_len, {"source": f"checkpoint {args.checkpoint}", "config_hash": saved_hash}


def _hub_client():
    """A Hugging Face Hub client for `--push-to-hub`, checked before any model is fetched."""
    try:
        from huggingface_hub import HfApi, get_token
    except ImportError:
        raise ConfigError("--push-to-hub needs huggingface_hub: pip install huggingface_hub") from None
    if not get_token():
        raise ConfigError("--push-to-hub needs a Hugging Face token: `hf auth login`, or set HF_TOKEN")
    return HfApi()


def _push_to_hub(api, folder: Path, repo: str) -> str:
    """Upload `folder` to the Hugging Face Hub model repo `repo`; returns its URL."""
    from p2pdiloco.errors import NetworkSetupError

    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="p2pdiloco export")
    except Exception as exc:  # noqa: BLE001 - the hub client raises many types; one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise NetworkSetupError(f"--push-to-hub {repo}: {type(exc).__name__}: {first}") from None
    return f"https://huggingface.co/{repo}"


def cmd_export(args: argparse.Namespace) -> int:
    """Write the model as safetensors + config that `transformers` loads as LlamaForCausalLM."""
    from p2pdiloco.training.export import write_hf_model

    hub = _hub_client() if args.push_to_hub else None
    params, seq_len, source = _model_params(args)
    files = write_hf_model(args.out, params, seq_len, source)
    print(f"wrote {args.out} ({', '.join(f.name for f in files)}) from {source['source']}")
    if hub is not None:
        print(f"pushed to {_push_to_hub(hub, args.out, args.push_to_hub)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the prompt and a few tokens the model continues it with."""
    if not 1 <= args.max_new_tokens <= 4096:
        raise ConfigError(f"--max-new-tokens must be in [1, 4096], got {args.max_new_tokens}")
    if args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--temperature and --top-k must be >= 0")
    import torch

    from p2pdiloco.training.data import EOS, decode_tokens, encode_text
    from p2pdiloco.training.export import decoder_of

    params, seq_len, _ = _model_params(args)
    model = decoder_of(params, seq_len)
    # an empty prompt starts a document: EOS is what precedes one in training
    context = (encode_text(args.prompt) if args.prompt else torch.tensor([EOS]))[None, :]
    tokens = model.generate(
        context, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        stop_token=EOS, generator=torch.Generator().manual_seed(args.seed),
    )[0, context.shape[1] :]
    if EOS in tokens.tolist():
        tokens = tokens[: tokens.tolist().index(EOS)]
    print(args.prompt + decode_tokens(tokens))
    return 0


# --- their parsers -----------------------------------------------------------------------


def _add_model_source_flags(command: argparse.ArgumentParser) -> None:
    """Where the model comes from: a checkpoint folder, or a live run."""
    add_config_options(command)
    command.add_argument(
        "--checkpoint", type=Path, help="a `join --checkpoint-dir` folder: that learner's replica"
    )
    add_watch_flags(command)  # or a live run: its current verified global model
    command.add_argument(
        "--wait-s", type=float, default=300.0, help="give up catching up with a live run after this long (default 300 s)"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`export` and `generate` on the top-level parser."""
    export = sub.add_parser(
        "export", help="write the model as safetensors that transformers loads (LlamaForCausalLM)"
    )
    _add_model_source_flags(export)
    export.add_argument("--out", type=Path, required=True, help="folder to write the model to")
    export.add_argument(
        "--push-to-hub", metavar="REPO", help="then upload it to this Hugging Face model repo (needs a token)"
    )
    export.set_defaults(handler=cmd_export)

    generate = sub.add_parser(
        "generate", help="continue a prompt with the model: what the swarm is learning"
    )
    _add_model_source_flags(generate)
    generate.add_argument("prompt", help="text to continue (\"\": from the start of a document)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="bytes to generate (default 64)")
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampled"
    )
    generate.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.set_defaults(handler=cmd_generate)
