"""The `p2pdiloco` command line.

Every user error ends in one red line on stderr and exit code 2, never a traceback;
Ctrl-C ends with exit code 130 after the command's own clean-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pdiloco import __version__
from p2pdiloco.config import TRANSPORTS, PeerConfig, RunConfig, load_config
from p2pdiloco.errors import ConfigError, P2PDilocoError

log = logging.getLogger("p2pdiloco")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line with exit code 2 (its default code too)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _print_error(f"{message} (see {self.prog} --help)")
        raise SystemExit(EXIT_USER_ERROR)


def _print_error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/] {escape(message)}"
    )


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="run config (TOML); defaults to the embedded default run"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field, e.g. --set sync.inner_steps=100 (repeatable)",
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="the run's peer-to-peer stack [network.transport, default \"hivemind\"]",
    )


def _transport_override(args: argparse.Namespace) -> list[str]:
    """`--transport X` as the override `network.transport="X"` (nothing when absent)."""
    kind = getattr(args, "transport", None)
    return [f"network.transport={json.dumps(kind)}"] if kind else []


def _add_peer_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    help_text: str,
    name: str | None = None,
    **kwargs: Any,
) -> None:
    """A shorthand for `--set peer.NAME=VALUE`. It has no default of its own: an absent
    flag leaves the field to the config (whose defaults are `PeerConfig`'s)."""
    if "action" not in kwargs:
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    name = name or flag.lstrip("-").replace("-", "_")
    default = json.dumps(getattr(PeerConfig(), name))
    parser.add_argument(
        flag,
        dest=name,
        default=None,
        help=f"{help_text} [peer.{name}, default {default}]",
        **kwargs,
    )


def _peer_shortcuts(args: argparse.Namespace) -> list[str]:
    """The peer flags given on the command line, as `peer.NAME=VALUE` overrides."""
    return [
        f"peer.{f.name}={json.dumps(getattr(args, f.name))}"
        for f in dataclasses.fields(PeerConfig)
        if getattr(args, f.name, None) is not None
    ]


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> RunConfig:
    """The config from --config, then --set, then shortcut flags (`extra`, then peer flags)."""
    return load_config(
        args.config, [*args.overrides, *_transport_override(args), *(extra or []), *_peer_shortcuts(args)]
    )


def _join_config(args: argparse.Namespace):
    """(config, admission, certificates) of a joining peer: from the run's signed manifest
    when it has one (verified, operator pinned), else from --config/--set (an open run)."""
    from p2pdiloco.identity import load_or_create_identity
    from p2pdiloco.trust.admission import Admission
    from p2pdiloco.trust.manifest import find_manifest, joined_config, pin_operator

    config = config_from_args(args)
    manifest = find_manifest(config.peer)
    if manifest is None:
        peer = _with_initial_peers(config.peer, config.peer.new_run)
        return dataclasses.replace(config, peer=peer), Admission(), ()
    if args.config is not None:
        raise ConfigError(
            f"--config conflicts with the manifest of run {manifest.name!r}: the run's config "
            "is the manifest's (use --set for [peer] and per-peer fields)"
        )
    config = joined_config(manifest, [*args.overrides, *_transport_override(args), *_peer_shortcuts(args)])
    pin_operator(manifest)
    peer = config.peer
    if not peer.initial_peers and not peer.new_run and manifest.bootstrap:
        peer = dataclasses.replace(peer, initial_peers=manifest.bootstrap)
    config = dataclasses.replace(config, peer=_with_initial_peers(peer, peer.new_run))
    certificates: tuple[bytes, ...] = ()
    if peer.identity_path:
        try:
            me = load_or_create_identity(peer.identity_path).peer_id
        except (OSError, ValueError) as exc:
            raise ConfigError(f"peer.identity_path: {exc}") from None
        certificates = manifest.certificates_of(me)
    log.info(
        "run manifest name=%s operator=%s synchronizers=%s learners=%s certificates=%d",
        manifest.name, manifest.operator[-8:], manifest.synchronizers, manifest.learners,
        len(certificates),
    )
    return config, manifest.admission(), certificates


def _with_initial_peers(peer: PeerConfig, new_run: bool) -> PeerConfig:
    """`peer` with its initial peers resolved: the given ones, else its bootstrap file."""
    from p2pdiloco.transport.bootstrap import resolve_initial_peers

    bootstrap_file = Path(peer.bootstrap_file) if peer.bootstrap_file else None
    initial = resolve_initial_peers(peer.run, list(peer.initial_peers), bootstrap_file, new_run)
    return dataclasses.replace(peer, initial_peers=tuple(initial))


# --- simulate ----------------------------------------------------------------------------


def _simulate_shortcuts(args: argparse.Namespace) -> list[str]:
    shortcuts = []
    if args.learners is not None:
        shortcuts.append(f"simulate.learners={args.learners}")
    if args.rounds is not None:
        shortcuts.append(f"simulate.rounds={args.rounds}")
    if args.inner_steps is not None:
        shortcuts.append(f"sync.inner_steps={args.inner_steps}")
    if args.model is not None:
        shortcuts.append(f"model.preset={json.dumps(args.model)}")
    if args.merge is not None:
        shortcuts.append(f"outer.merge={json.dumps(args.merge)}")
    if args.mode is not None:
        shortcuts.append(f"simulate.mode={json.dumps(args.mode)}")
    return shortcuts


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run DiLoCo and the synchronous baseline in one process and print held-out losses."""
    config = config_from_args(args, _simulate_shortcuts(args))  # its errors before torch's import
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from p2pdiloco.sim.simulate import simulate

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        tasks: dict[str, int] = {}

        def on_progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                label = phase if phase == "decoupled steps" else f"{phase} rounds"
                tasks[phase] = bar.add_task(label, total=total)
            bar.update(tasks[phase], completed=done)

        result = simulate(config, progress=on_progress)
    table = Table(
        title=f"simulate ({result.mode}): {result.learners} learners, H={result.inner_steps}, "
        f"{result.rounds} rounds, merge={result.merge_rule}"
    )
    table.add_column("run")
    table.add_column("held-out loss", justify="right")
    table.add_column("bytes sent / learner", justify="right")
    table.add_row(
        "DiLoCo", f"{result.diloco_eval_loss:.4f}", f"{result.diloco_bytes_per_learner:,}"
    )
    if result.sync is not None:
        table.add_row(
            "synchronous DP", f"{result.sync_eval_loss:.4f}", f"{result.sync_bytes_per_learner:,}"
        )
    Console().print(table)
    summary = {
        "mode": result.mode,
        "schedule": result.schedule,
        "learners": result.learners,
        "inner_steps": result.inner_steps,
        "rounds": result.rounds,
        "merge": result.merge_rule,
        "tokens": result.tokens,
        "diloco_eval_loss": result.diloco_eval_loss,
        "sync_eval_loss": result.sync_eval_loss,
        "loss_ratio": result.diloco_eval_loss / result.sync_eval_loss
        if result.sync_eval_loss
        else None,
        "comm_reduction": result.comm_reduction if result.sync else None,
    }
    if result.sync is not None:
        print(
            f"loss_ratio={summary['loss_ratio']:.4f} comm_reduction={summary['comm_reduction']:.1f}"
        )
    if args.json:
        _write_json(args.json, summary)
    return 0


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write --json {path}: {exc.strerror or exc}") from None


# --- join --------------------------------------------------------------------------------


class _PhaseProgress:
    """Progress bars for a peer's long work (data indexing, state download) on a terminal."""

    LABELS = {"data": "indexing data files", "state": "downloading global state (fragments)"}

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
            redirect_stdout=False,  # stdout may carry --events lines
            redirect_stderr=False,
        )
        self.tasks: dict[str, int] = {}
        self.closed = False
        self.bar.start()

    def update(self, phase: str, done: int, total: int) -> None:
        if self.closed:
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(self.LABELS.get(phase, phase), total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)
        if phase == "state" and done >= total:
            self.close()  # joined: the bars give way to the log

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.bar.stop()


def cmd_join(args: argparse.Namespace) -> int:
    """Run the peer daemon: join a run, train, synchronise when elected."""
    import signal

    # the run, its config and its peers first: their errors come before torch's import
    config, admission, certificates = _join_config(args)
    from p2pdiloco.peer.daemon import PeerDaemon, make_transport_for
    from p2pdiloco.peer.faults import parse_crash_at
    from p2pdiloco.training.train import resolve_device
    from p2pdiloco.trust.record_rules import RunRecordRules

    resolve_device(config.train.device)  # fail before joining, with one line
    if not args.skip_preflight:  # RAM, disk, device memory for the preset (p2pdiloco.peer.preflight)
        from p2pdiloco.peer.preflight import local_findings, raise_if_fatal

        raise_if_fatal(local_findings(config))
    peer = config.peer
    crash_at = peer.crash_at or os.environ.get("P2PDILOCO_CRASH_AT", "")
    try:
        parse_crash_at(crash_at)
    except ValueError as exc:
        raise ConfigError(f"peer.crash_at (--crash-at, P2PDILOCO_CRASH_AT): {exc}") from None
    config = dataclasses.replace(config, peer=dataclasses.replace(peer, crash_at=crash_at))
    rules = RunRecordRules(config.peer.run, config.sync.num_fragments, admission)
    progress = _PhaseProgress()
    daemon = PeerDaemon(
        config,
        make_transport_for(config.peer, rules, config.network.transport),
        on_progress=progress.update,
        admission=admission,
        certificates=certificates,
    )

    def on_signal(signum, _frame) -> None:
        log.info("signal=%d: leaving the run", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return daemon.run()
    finally:
        progress.close()


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """A DHT-only node: no training; prints the multiaddrs for bootstrap_peers/<run>.txt."""
    import asyncio
    import signal

    from p2pdiloco.peer.daemon import make_transport_for
    from p2pdiloco.trust.admission import Admission
    from p2pdiloco.trust.manifest import find_manifest, joined_config
    from p2pdiloco.trust.record_rules import bootstrap_rules

    config = config_from_args(args)
    peer = config.peer
    manifest = find_manifest(peer)
    if manifest is not None:
        config = joined_config(manifest, [])
        peer = dataclasses.replace(peer, run=manifest.name)
    admission = manifest.admission() if manifest is not None else Admission()
    # A bootstrap node is a DHT node too: it stores only records the run's rules allow.
    rules = bootstrap_rules(peer.run, config.sync.num_fragments if manifest is not None else None, admission)
    transport = make_transport_for(peer, rules, config.network.transport)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await transport.start()
        try:
            maddrs = transport.visible_maddrs()
            if peer.events:
                print(
                    json.dumps({"ready": True, "peer_id": transport.peer_id, "maddrs": maddrs}),
                    flush=True,
                )
            else:
                print(
                    "# bootstrap node is up; put these lines in bootstrap_peers/<run>.txt",
                    flush=True,
                )
                for maddr in maddrs:
                    print(maddr, flush=True)
            await stop.wait()
        finally:
            await transport.shutdown()

    asyncio.run(serve())
    return 0


# --- demo --------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """A local swarm: a bootstrap node and N learners on 127.0.0.1, with the dashboard."""
    import signal

    from rich.console import Console

    from p2pdiloco.cli.demo import (
        DEMO_RUN,
        LocalSwarm,
        child_sets,
        follow_dashboard,
        follow_plain,
        print_summary,
    )

    extra = [f"model.preset={json.dumps(args.model)}"] if args.model else []
    # The embedded demo run stands in for the default run; a --config file stands alone.
    base = DEMO_RUN if args.config is None else []
    # Validated here: one clear line, before any process starts.
    config = load_config(args.config, [*base, *args.overrides, *_transport_override(args), *extra])
    if args.peers < 1 or args.rounds < 1:
        raise ConfigError("--peers and --rounds must be >= 1")
    console = Console()

    def on_term(_signum, _frame) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the demo like Ctrl-C: every child goes too

    signal.signal(signal.SIGTERM, on_term)
    swarm = LocalSwarm(args.peers, child_sets(config), args.rounds)
    try:
        with console.status(f"starting a bootstrap node and {args.peers} learners on 127.0.0.1 …"):
            swarm.start()
        if args.no_dashboard:
            follow_plain(swarm, console)
        else:
            follow_dashboard(
                swarm, config.sync.num_fragments, config.network.transport,
                min_quorum=config.sync.min_quorum, max_grace_s=config.sync.max_grace_s,
            )  # fmt: skip
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every peer…[/]")
        swarm.shutdown()
        return EXIT_INTERRUPTED
    finally:
        swarm.shutdown()
    summary = swarm.summary()
    print_summary(console, summary)
    if args.json:
        _write_json(args.json, summary)
    return 0 if summary["rounds_completed"] >= 1 else 1


# --- dashboard and status ----------------------------------------------------------------


def observer_config(args: argparse.Namespace):
    """(config, admission) of a peer that only watches or audits a run: the manifest's
    when the run has one, else --config/--set; initial peers resolved."""
    from p2pdiloco.trust.admission import Admission
    from p2pdiloco.trust.manifest import find_manifest, joined_config

    config = config_from_args(args)
    manifest = find_manifest(config.peer)
    admission = Admission()
    if manifest is not None:
        config = joined_config(manifest, [*args.overrides, *_transport_override(args), *_peer_shortcuts(args)])
        admission = manifest.admission()
        if not config.peer.initial_peers and manifest.bootstrap:
            config = dataclasses.replace(
                config, peer=dataclasses.replace(config.peer, initial_peers=manifest.bootstrap)
            )
    peer = _with_initial_peers(config.peer, new_run=False)
    return dataclasses.replace(config, peer=peer), admission


def _watched(args: argparse.Namespace) -> tuple[PeerConfig, int, str, dict[str, Any]]:
    """Whom a watcher joins through (`[peer]`, initial peers resolved), how many fragments,
    on which transport, and how it reads the run (the manifest's admission when the run
    has one: uncertified records ignored, certified synchronizers shown; K; max grace)."""
    config, admission = observer_config(args)
    view = {"admission": admission, "min_quorum": config.sync.min_quorum, "max_grace_s": config.sync.max_grace_s}
    return config.peer, config.sync.num_fragments, config.network.transport, view


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Watch a run live: joins the DHT as a client-mode observer, never trains."""
    import asyncio

    from p2pdiloco.cli.dashboard import watch

    peer, num_fragments, transport, view = _watched(args)
    try:
        asyncio.run(watch(peer, num_fragments, args.refresh_s, transport_kind=transport, **view))
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run's peers and rounds once (JSON with --json)."""
    import asyncio

    from rich.console import Console

    from p2pdiloco.cli.dashboard import observe_once, render_dashboard, snapshot_json

    peer, num_fragments, transport, view = _watched(args)
    snapshot = asyncio.run(observe_once(peer, num_fragments, transport, **view))
    if args.json:
        print(json.dumps(snapshot_json(snapshot), indent=2))
    else:
        Console().print(render_dashboard(snapshot))
    return 0


# --- export and generate -----------------------------------------------------------------


def _names_a_run(args: argparse.Namespace) -> bool:
    """Whether the command line says how to find a live run (else: none was asked for)."""
    return any(getattr(args, name, None) is not None for name in ("run", "manifest", "initial_peers", "bootstrap_file"))


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
        if not _names_a_run(args):
            raise ConfigError(
                "which model? --checkpoint DIR (a `join --checkpoint-dir` folder) or --run NAME (a live run)"
            )
        return _download_global_model(args)
    if _names_a_run(args):
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


# --- config ------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective run config as TOML (after --config and --set)."""
    from p2pdiloco.config import render_toml

    print(render_toml(config_from_args(args)), end="")
    return 0


# --- entry point -------------------------------------------------------------------------


def _add_finding_flags(parser: argparse.ArgumentParser) -> None:
    """How any peer finds a run: its name, manifest, bootstrap file or addresses."""
    _add_peer_flag(
        parser, "--run", "run name: its <run>.toml, else <run>.txt, from ./bootstrap_peers or shipped (`p2pdiloco runs`)"
    )
    _add_peer_flag(
        parser, "--initial-peers", "multiaddrs to bootstrap from", nargs="*", metavar="MULTIADDR"
    )
    _add_peer_flag(parser, "--bootstrap-file", "bootstrap file (default bootstrap_peers/<run>.txt)")
    _add_peer_flag(parser, "--manifest", "signed run manifest (default bootstrap_peers/<run>.toml)")


def _add_join_flags(join: argparse.ArgumentParser) -> None:
    """Every `[peer]` field as a `join` flag: shorthands for `--set peer.NAME=VALUE`."""
    _add_finding_flags(join)
    _add_peer_flag(join, "--new-run", "start a new swarm (no bootstrap peers)", action="store_true")
    _add_peer_flag(join, "--startup-timeout-s", "give up joining after this long (s)", type=float)
    _add_peer_flag(join, "--host", "listen address")
    _add_peer_flag(join, "--port", "listen port (0: any)", type=int)
    _add_peer_flag(
        join, "--announce-maddrs", "public addresses to announce", nargs="*", metavar="MULTIADDR"
    )
    _add_peer_flag(
        join, "--client-mode", "behind NAT: outgoing connections only", action="store_true"
    )
    _add_peer_flag(join, "--identity", "Ed25519 key file (created if missing)", "identity_path")
    _add_peer_flag(join, "--heartbeat-s", "seconds between heartbeats", type=float)
    _add_peer_flag(join, "--data-rank", "this peer's data shard (-1: from the peer id)", type=int)
    _add_peer_flag(join, "--data-shards", "number of data shards", type=int)
    _add_peer_flag(
        join,
        "--wait-peers",
        "start training once N learners (this one included) are live (0: at once)",
        type=int,
        metavar="N",
    )
    _add_peer_flag(
        join,
        "--wait-peers-timeout-s",
        "start anyway after this long (s), with a warning",
        type=float,
    )
    _add_peer_flag(
        join, "--max-rounds", "leave once every fragment reached this round (0: never)", type=int
    )
    _add_peer_flag(join, "--max-steps", "leave after this many inner steps (0: never)", type=int)
    _add_peer_flag(
        join, "--eval-batches", "held-out batches evaluated each round (0: none)", type=int
    )
    _add_peer_flag(
        join,
        "--threads",
        "torch CPU threads (0: default; 1 when peers share a machine)",
        "torch_threads",
        type=int,
    )
    _add_peer_flag(join, "--events", "print one JSON event per line on stdout", action="store_true")
    _add_peer_flag(
        join, "--metrics-port", "serve Prometheus metrics over HTTP on this port (0: off)", type=int
    )
    _add_peer_flag(join, "--metrics-host", "address the metrics endpoint listens on")
    _add_peer_flag(
        join,
        "--checkpoint-dir",
        "save local state here (periodically, on leaving), restore on start",
    )
    _add_peer_flag(
        join,
        "--checkpoint-every-s",
        "seconds between periodic checkpoints (with --checkpoint-dir)",
        type=float,
    )
    faults = join.add_argument_group("fault injection (tests and benchmarks only)")
    _add_peer_flag(faults, "--straggle-s", "delay contributions to early rounds (s)", type=float)
    _add_peer_flag(faults, "--straggle-rounds", "rounds affected by --straggle-s", type=int)
    _add_peer_flag(faults, "--corrupt", "send nan or garbage contributions to early rounds")
    _add_peer_flag(
        faults,
        "--corrupt-rounds",
        "rounds affected by --corrupt (and as many first contributions)",
        type=int,
    )
    _add_peer_flag(
        faults,
        "--crash-at",
        "PHASE[:ROUND], SIGKILL this peer at that phase of a commit (after_quorum, "
        "during_merge, after_hold, after_record, after_first_reply); also P2PDILOCO_CRASH_AT",
    )
    _add_peer_flag(
        faults,
        "--split-view-rounds",
        "see only this peer and ignore rival records for the first N rounds "
        "(forces two commits of one round)",
        type=int,
    )


def _add_watch_flags(watcher: argparse.ArgumentParser) -> None:
    """How an observer (dashboard, status, audit) finds a run."""
    _add_finding_flags(watcher)
    _add_peer_flag(
        watcher,
        "--timeout-s",
        "give up joining the DHT after this long (s)",
        "startup_timeout_s",
        type=float,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2pdiloco", description="Peer-to-peer Decoupled DiLoCo training.")
    parser.add_argument("--version", action="version", version=f"p2pdiloco {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    simulate = sub.add_parser(
        "simulate", help="DiLoCo vs synchronous data parallel, in one process"
    )
    _add_config_options(simulate)
    simulate.add_argument(
        "--learners", type=int, help="number of simulated learners (simulate.learners)"
    )
    simulate.add_argument("--rounds", type=int, help="outer rounds (simulate.rounds)")
    simulate.add_argument(
        "--inner-steps", type=int, help="H, inner steps per round (sync.inner_steps)"
    )
    simulate.add_argument("--model", help="model preset: tiny, small, 150m, 1b (model.preset)")
    simulate.add_argument("--merge", help="merge rule: mean, token, radial (outer.merge)")
    simulate.add_argument(
        "--mode", choices=("lockstep", "decoupled"), help="plain DiLoCo, or the swarm's schedule (simulate.mode)"
    )
    simulate.add_argument("--json", type=Path, help="write the figures to this JSON file")
    simulate.set_defaults(handler=cmd_simulate)

    join = sub.add_parser("join", help="run the peer daemon: join a run and train")
    _add_config_options(join)
    join.add_argument(
        "--log-json", action="store_true", help="log one JSON object per line (for machines)"
    )
    join.add_argument(
        "--skip-preflight", action="store_true", help="join even if this machine looks too small (see `doctor`)"
    )
    _add_join_flags(join)
    join.set_defaults(handler=cmd_join)

    bootstrap = sub.add_parser("bootstrap", help="run a DHT-only node and print its multiaddrs")
    _add_config_options(bootstrap)
    _add_peer_flag(bootstrap, "--run", "run whose records this node stores (reads bootstrap_peers/<run>.toml)")
    _add_peer_flag(bootstrap, "--manifest", "signed run manifest (default bootstrap_peers/<run>.toml)")
    _add_peer_flag(bootstrap, "--host", "listen address")
    _add_peer_flag(bootstrap, "--port", "listen port (0: any)", type=int)
    _add_peer_flag(
        bootstrap,
        "--announce-maddrs",
        "public addresses to announce and print, e.g. /ip4/203.0.113.7/tcp/31337 (a cloud VM's public IP)",
        nargs="*",
        metavar="MULTIADDR",
    )
    _add_peer_flag(
        bootstrap, "--identity", "Ed25519 key file (created if missing)", "identity_path"
    )
    _add_peer_flag(
        bootstrap, "--initial-peers", "other bootstrap nodes", nargs="*", metavar="MULTIADDR"
    )
    _add_peer_flag(bootstrap, "--events", "print a JSON readiness line", action="store_true")
    bootstrap.set_defaults(handler=cmd_bootstrap)

    demo = sub.add_parser("demo", help="a local swarm on this machine with the live dashboard")
    _add_config_options(demo)
    demo.add_argument("--peers", type=int, default=3, help="learner peers to start (default 3)")
    demo.add_argument("--rounds", type=int, default=5, help="outer rounds to train (default 5)")
    demo.add_argument("--model", help="model preset: tiny, small, 150m, 1b (default small)")
    demo.add_argument("--no-dashboard", action="store_true", help="plain progress lines instead")
    demo.add_argument("--json", type=Path, help="write the summary to this JSON file")
    demo.set_defaults(handler=cmd_demo)

    for name, handler, help_text in [
        ("dashboard", cmd_dashboard, "watch a run live (client-mode observer, no training)"),
        ("status", cmd_status, "print a run's peers and rounds once"),
    ]:
        watcher = sub.add_parser(name, help=help_text)
        _add_config_options(watcher)
        _add_watch_flags(watcher)
        if name == "dashboard":
            watcher.add_argument(
                "--refresh-s", type=float, default=1.0, help="seconds between screen refreshes"
            )
        else:
            watcher.add_argument("--json", action="store_true", help="machine-readable output")
        watcher.set_defaults(handler=handler)

    from p2pdiloco.cli.doctor import add_command as add_doctor
    from p2pdiloco.cli.runs import add_commands

    add_commands(sub, _add_config_options, _add_watch_flags)
    add_doctor(sub, _add_config_options, _add_watch_flags, _add_peer_flag)

    for name, handler, help_text in [
        ("export", cmd_export, "write the model as safetensors that transformers loads (LlamaForCausalLM)"),
        ("generate", cmd_generate, "continue a prompt with the model: what the swarm is learning"),
    ]:
        command = sub.add_parser(name, help=help_text)
        _add_config_options(command)
        command.add_argument(
            "--checkpoint", type=Path, help="a `join --checkpoint-dir` folder: that learner's replica"
        )
        _add_watch_flags(command)  # or a live run: its current verified global model
        command.add_argument(
            "--wait-s", type=float, default=300.0, help="give up catching up with a live run after this long (default 300 s)"
        )
        if name == "export":
            command.add_argument("--out", type=Path, required=True, help="folder to write the model to")
            command.add_argument(
                "--push-to-hub", metavar="REPO", help="then upload it to this Hugging Face model repo (needs a token)"
            )
        else:
            command.add_argument("prompt", help="text to continue (\"\": from the start of a document)")
            command.add_argument("--max-new-tokens", type=int, default=64, help="bytes to generate (default 64)")
            command.add_argument(
                "--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampled"
            )
            command.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
            command.add_argument("--seed", type=int, default=0, help="sampling seed")
        command.set_defaults(handler=handler)

    config = sub.add_parser("config", help="print the effective run config as TOML")
    _add_config_options(config)
    config.set_defaults(handler=cmd_config)
    return parser


class _JsonFormatter(logging.Formatter):
    """One JSON object per log record (`--log-json`), for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "t": record.created,
                "level": record.levelname,
                "logger": record.name,
                "message": record.getMessage(),
            }
        )


def _setup_logging(verbose: bool, log_json: bool = False) -> None:
    from rich.logging import RichHandler

    handler: logging.Handler
    if log_json:
        handler = logging.StreamHandler()
        handler.setFormatter(_JsonFormatter())
    elif sys.stderr.isatty():
        handler = RichHandler(show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USER_ERROR
    _setup_logging(args.verbose, getattr(args, "log_json", False))
    if args.command in ("demo", "dashboard", "status", "doctor") and not args.verbose:
        # The screen belongs to the dashboard: only warnings and errors go to the log.
        logging.getLogger().setLevel(logging.WARNING)
    try:
        return handler(args)
    except P2PDilocoError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _print_error("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
