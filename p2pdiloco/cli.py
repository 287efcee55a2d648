"""The `p2pdiloco` command line.

Every user error ends in one red line on stderr and exit code 2, never a traceback;
Ctrl-C ends with exit code 130 after the command's own clean-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from p2pdiloco import __version__
from p2pdiloco.config import RunConfig, load_config
from p2pdiloco.errors import ConfigError, NetworkSetupError, P2PDilocoError

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


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> RunConfig:
    """The run config from --config and --set, with shortcut flags applied last."""
    return load_config(args.config, [*args.overrides, *(extra or [])])


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
    return shortcuts


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run DiLoCo and the synchronous baseline in one process and print held-out losses."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from p2pdiloco.simulate import simulate

    config = config_from_args(args, _simulate_shortcuts(args))
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
                tasks[phase] = bar.add_task(f"{phase} rounds", total=total)
            bar.update(tasks[phase], completed=done)

        result = simulate(config, progress=on_progress)
    table = Table(
        title=f"simulate: {result.learners} learners, H={result.inner_steps}, {result.rounds} rounds, merge={result.merge_rule}"
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


def read_bootstrap_file(path: Path) -> list[str]:
    """Multiaddrs of a `bootstrap_peers/<run>.txt` file: one a line, `#` comments."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise NetworkSetupError(
            f"unknown run: {path} does not exist (pass --initial-peers or create it)"
        ) from None
    except OSError as exc:
        raise NetworkSetupError(f"cannot read {path}: {exc.strerror or exc}") from None
    addrs = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not text.startswith("/") or "/p2p/" not in text:
            raise NetworkSetupError(
                f"{path}:{number}: {text!r} is not a multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."
            )
        addrs.append(text)
    return addrs


def cmd_join(args: argparse.Namespace) -> int:
    """Run the peer daemon: join a run, train, synchronise when elected."""
    import signal

    from p2pdiloco.peer import PeerDaemon, PeerOptions, make_transport_for

    config = config_from_args(args)
    initial = list(args.initial_peers or [])
    if not initial and args.bootstrap_file is not None:
        initial = read_bootstrap_file(args.bootstrap_file)
    options = PeerOptions(
        run=args.run,
        initial_peers=tuple(initial),
        host=args.host,
        port=args.port,
        client_mode=args.client_mode,
        identity_path=str(args.identity) if args.identity else None,
        data_rank=args.data_rank,
        data_shards=args.data_shards,
        heartbeat_s=args.heartbeat_s,
        max_rounds=args.max_rounds,
        max_steps=args.max_steps,
        events=args.events,
        straggle_s=args.straggle_s,
        straggle_rounds=args.straggle_rounds,
        corrupt=args.corrupt or "",
        corrupt_rounds=args.corrupt_rounds,
        torch_threads=args.threads,
        eval_batches=args.eval_batches,
    )
    daemon = PeerDaemon(config, options, make_transport_for(options))

    def on_signal(signum, _frame) -> None:
        log.info("signal=%d: leaving the run", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return daemon.run()


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """A DHT-only node: no training; prints the multiaddrs for bootstrap_peers/<run>.txt."""
    import asyncio
    import signal

    from p2pdiloco.peer import PeerOptions, make_transport_for

    options = PeerOptions(
        initial_peers=tuple(args.initial_peers or []),
        host=args.host,
        port=args.port,
        identity_path=str(args.identity) if args.identity else None,
    )
    transport = make_transport_for(options)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await transport.start()
        try:
            maddrs = transport.visible_maddrs()
            if args.events:
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


# --- config ------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective run config as TOML (after --config and --set)."""
    from p2pdiloco.config import render_toml

    print(render_toml(config_from_args(args)), end="")
    return 0


# --- entry point -------------------------------------------------------------------------


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
    simulate.add_argument("--json", type=Path, help="write the figures to this JSON file")
    simulate.set_defaults(handler=cmd_simulate)

    join = sub.add_parser("join", help="run the peer daemon: join a run and train")
    _add_config_options(join)
    join.add_argument("--run", default="local", help="run name (reads bootstrap_peers/<run>.txt)")
    join.add_argument(
        "--initial-peers", nargs="*", metavar="MULTIADDR", help="multiaddrs to bootstrap from"
    )
    join.add_argument(
        "--bootstrap-file", type=Path, help="bootstrap file (default bootstrap_peers/<run>.txt)"
    )
    join.add_argument("--host", default="127.0.0.1", help="listen address")
    join.add_argument("--port", type=int, default=0, help="listen port (0: any)")
    join.add_argument(
        "--client-mode", action="store_true", help="behind NAT: outgoing connections only"
    )
    join.add_argument("--identity", type=Path, help="Ed25519 key file (created if missing)")
    join.add_argument("--data-rank", type=int, help="this peer's data shard")
    join.add_argument("--data-shards", type=int, default=1, help="number of data shards")
    join.add_argument("--heartbeat-s", type=float, default=2.0, help="seconds between heartbeats")
    join.add_argument("--max-rounds", type=int, help="leave once every fragment reached this round")
    join.add_argument("--max-steps", type=int, help="leave after this many inner steps")
    join.add_argument(
        "--eval-batches", type=int, default=2, help="held-out batches evaluated each round (0: none)"
    )
    join.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: default; 1 when peers share a machine)",
    )
    join.add_argument(
        "--events", action="store_true", help="print one JSON event per line on stdout"
    )
    faults = join.add_argument_group("fault injection (tests and benchmarks)")
    faults.add_argument(
        "--straggle-s", type=float, default=0.0, help="delay contributions to early rounds (s)"
    )
    faults.add_argument(
        "--straggle-rounds", type=int, default=0, help="rounds affected by --straggle-s"
    )
    faults.add_argument(
        "--corrupt", choices=["nan", "garbage"], help="send corrupt contributions to early rounds"
    )
    faults.add_argument(
        "--corrupt-rounds", type=int, default=0, help="rounds affected by --corrupt"
    )
    join.set_defaults(handler=cmd_join)

    bootstrap = sub.add_parser("bootstrap", help="run a DHT-only node and print its multiaddrs")
    bootstrap.add_argument("--host", default="127.0.0.1", help="listen address")
    bootstrap.add_argument("--port", type=int, default=0, help="listen port (0: any)")
    bootstrap.add_argument("--identity", type=Path, help="Ed25519 key file (created if missing)")
    bootstrap.add_argument(
        "--initial-peers", nargs="*", metavar="MULTIADDR", help="other bootstrap nodes"
    )
    bootstrap.add_argument("--events", action="store_true", help="print a JSON readiness line")
    bootstrap.set_defaults(handler=cmd_bootstrap)

    config = sub.add_parser("config", help="print the effective run config as TOML")
    _add_config_options(config)
    config.set_defaults(handler=cmd_config)
    return parser


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    handler: logging.Handler
    if sys.stderr.isatty():
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
    _setup_logging(args.verbose)
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
