"""The `p2pdiloco` command line.

Every user error ends in one red line on stderr and exit code 2, never a traceback;
Ctrl-C ends with exit code 130 after the command's own clean-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from p2pdiloco import __version__
from p2pdiloco.config import RunConfig, load_config
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

    from p2pdiloco.bootstrap import resolve_initial_peers
    from p2pdiloco.peer import PeerDaemon, PeerOptions, make_transport_for
    from p2pdiloco.train import resolve_device

    config = config_from_args(args)
    resolve_device(config.train.device)  # fail before joining, with one line
    initial = resolve_initial_peers(args.run, args.initial_peers, args.bootstrap_file, args.new_run)
    options = PeerOptions(
        run=args.run,
        initial_peers=tuple(initial),
        host=args.host,
        port=args.port,
        client_mode=args.client_mode,
        announce_maddrs=tuple(args.announce_maddrs or ()),
        checkpoint_dir=str(args.checkpoint_dir) if args.checkpoint_dir else None,
        identity_path=str(args.identity) if args.identity else None,
        data_rank=args.data_rank,
        data_shards=args.data_shards,
        heartbeat_s=args.heartbeat_s,
        max_rounds=args.max_rounds,
        max_steps=args.max_steps,
        wait_peers=args.wait_peers,
        wait_peers_timeout_s=args.wait_peers_timeout_s,
        events=args.events,
        straggle_s=args.straggle_s,
        straggle_rounds=args.straggle_rounds,
        corrupt=args.corrupt or "",
        corrupt_rounds=args.corrupt_rounds,
        crash_at=args.crash_at or os.environ.get("P2PDILOCO_CRASH_AT", ""),
        checkpoint_every_s=args.checkpoint_every_s,
        split_view_rounds=args.split_view_rounds,
        torch_threads=args.threads,
        eval_batches=args.eval_batches,
        startup_timeout_s=args.startup_timeout_s,
    )
    from p2pdiloco.faults import parse_crash_at

    try:
        parse_crash_at(options.crash_at)
    except ValueError as exc:
        raise ConfigError(f"--crash-at: {exc}") from None
    progress = _PhaseProgress()
    daemon = PeerDaemon(config, options, make_transport_for(options), on_progress=progress.update)

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


# --- demo --------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """A local swarm: a bootstrap node and N learners on 127.0.0.1, with the dashboard."""
    from rich.console import Console

    from p2pdiloco.demo import DEMO_RUN, LocalSwarm

    extra = [f"model.preset={json.dumps(args.model)}"] if args.model else []
    sets = [*DEMO_RUN, *args.overrides, *extra]
    config = load_config(args.config, sets)  # validate here: one clear line, before any process
    if args.peers < 1 or args.rounds < 1:
        raise ConfigError("--peers and --rounds must be >= 1")
    console = Console()
    import signal

    def on_term(_signum, _frame) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the demo like Ctrl-C: every child goes too

    signal.signal(signal.SIGTERM, on_term)
    swarm = LocalSwarm(
        args.peers, sets if args.config is None else [*args.overrides, *extra], args.rounds
    )
    if args.config is not None:
        swarm.sets = [
            f"{section}.{key}={json.dumps(value)}"
            for section, values in _config_items(config)
            for key, value in values
        ]
    try:
        with console.status(f"starting a bootstrap node and {args.peers} learners on 127.0.0.1 …"):
            swarm.start()
        if args.no_dashboard:
            _follow_plain(swarm, console)
        else:
            _follow_dashboard(swarm, config.sync.num_fragments)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every peer…[/]")
        swarm.shutdown()
        return EXIT_INTERRUPTED
    finally:
        swarm.shutdown()
    summary = swarm.summary()
    _print_demo_summary(console, summary)
    if args.json:
        _write_json(args.json, summary)
    return 0 if summary["rounds_completed"] >= 1 else 1


def _config_items(config: RunConfig):
    from p2pdiloco.config import config_to_dict

    return [(section, list(values.items())) for section, values in config_to_dict(config).items()]


def _follow_plain(swarm, console) -> None:
    """Without the dashboard: one line per closed round, until every learner left."""
    import time

    printed: set[tuple[int, int]] = set()
    while swarm.running():
        for child in swarm.learners:
            for event in child.of("round_closed"):
                key = (event["fragment"], event["round"])
                if key not in printed:
                    printed.add(key)
                    console.print(
                        f"round {event['round'] + 1} fragment {event['fragment']}: {len(event['contributors'])} deltas merged by {child.name}, grace {event['grace_s']:.2f}s"
                    )
            for event in child.of("eval"):
                key = (-1, id(event))
                if key not in printed:
                    printed.add(key)
        time.sleep(0.5)  # polling the children's event lists, not synchronising


def _follow_dashboard(swarm, num_fragments: int) -> None:
    """The live dashboard, fed by an observer on the swarm's DHT, until every learner left."""
    import asyncio

    from rich.live import Live

    from p2pdiloco.dashboard import Observer, render_dashboard
    from p2pdiloco.peer import PeerOptions, make_transport_for

    async def watch() -> None:
        transport = make_transport_for(
            PeerOptions(initial_peers=tuple(swarm.bootstrap_maddrs), client_mode=True)
        )
        await transport.start()
        try:
            observer = Observer(transport, "local", num_fragments)
            with Live(render_dashboard(await observer.refresh()), refresh_per_second=2) as live:
                while swarm.running():
                    await asyncio.sleep(1.0)  # the refresh period of the screen
                    live.update(render_dashboard(await observer.refresh()))
        finally:
            await transport.shutdown()

    asyncio.run(watch())


def _print_demo_summary(console, summary: dict) -> None:
    from rich.table import Table

    from p2pdiloco.dashboard import human_bytes, short

    table = Table(title=f"demo: {summary['peers']} peers, {summary['rounds_completed']} rounds")
    for name in (
        "peer",
        "steps",
        "tokens",
        "rounds contributed",
        "tokens contributed",
        "bytes sent",
    ):
        table.add_column(name, justify="left" if name == "peer" else "right")
    for peer in summary["per_peer"]:
        table.add_row(
            short(peer["peer_id"]),
            str(peer["steps"]),
            f"{peer['tokens']:,}",
            str(peer["rounds_contributed"]),
            f"{peer['tokens_contributed']:,}",
            human_bytes(peer["bytes_sent"]),
        )
    console.print(table)
    start, end = summary["eval_loss_start"], summary["eval_loss_end"]
    if start is not None and end is not None:
        console.print(
            f"held-out loss {start:.4f} -> {end:.4f}   bytes sent {human_bytes(summary['bytes_sent'])}   replicas identical: {summary['replicas_identical']}"
        )


# --- dashboard and status ----------------------------------------------------------------


def _initial_peers(args: argparse.Namespace) -> list[str]:
    from p2pdiloco.bootstrap import resolve_initial_peers

    return resolve_initial_peers(args.run, args.initial_peers, args.bootstrap_file, new_run=False)


async def _observe_once(args: argparse.Namespace, num_fragments: int):
    from p2pdiloco.dashboard import Observer
    from p2pdiloco.peer import PeerOptions, make_transport_for

    transport = make_transport_for(
        PeerOptions(
            initial_peers=tuple(_initial_peers(args)),
            client_mode=True,
            startup_timeout_s=args.timeout_s,
        )
    )
    await transport.start()
    return transport, Observer(transport, args.run, num_fragments)


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Watch a run live: joins the DHT as a client-mode observer, never trains."""
    import asyncio

    from rich.live import Live

    from p2pdiloco.dashboard import render_dashboard

    config = config_from_args(args)

    async def watch() -> None:
        transport, observer = await _observe_once(args, config.sync.num_fragments)
        try:
            with Live(
                render_dashboard(await observer.refresh()), refresh_per_second=2, screen=False
            ) as live:
                while True:
                    await asyncio.sleep(args.refresh_s)  # the screen's refresh period
                    live.update(render_dashboard(await observer.refresh()))
        finally:
            await transport.shutdown()

    try:
        asyncio.run(watch())
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run's peers and rounds once (JSON with --json)."""
    import asyncio

    from rich.console import Console

    from p2pdiloco.dashboard import render_dashboard

    config = config_from_args(args)

    async def once():
        transport, observer = await _observe_once(args, config.sync.num_fragments)
        try:
            snapshot = await observer.refresh()
            return snapshot
        finally:
            await transport.shutdown()

    snapshot = asyncio.run(once())
    if args.json:
        print(json.dumps(snapshot.to_json(), indent=2))
    else:
        Console().print(render_dashboard(snapshot))
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
    join.add_argument(
        "--new-run", action="store_true", help="start a new swarm (no bootstrap peers)"
    )
    join.add_argument(
        "--startup-timeout-s", type=float, default=120.0, help="give up joining after this long"
    )
    join.add_argument("--host", default="127.0.0.1", help="listen address")
    join.add_argument("--port", type=int, default=0, help="listen port (0: any)")
    join.add_argument(
        "--client-mode", action="store_true", help="behind NAT: outgoing connections only"
    )
    join.add_argument(
        "--log-json", action="store_true", help="log one JSON object per line (for machines)"
    )
    join.add_argument(
        "--checkpoint-dir", type=Path, help="save local state here on leaving, restore on start"
    )
    join.add_argument(
        "--announce-maddrs", nargs="*", metavar="MULTIADDR", help="public addresses to announce"
    )
    join.add_argument("--identity", type=Path, help="Ed25519 key file (created if missing)")
    join.add_argument("--data-rank", type=int, help="this peer's data shard")
    join.add_argument("--data-shards", type=int, default=1, help="number of data shards")
    join.add_argument("--heartbeat-s", type=float, default=2.0, help="seconds between heartbeats")
    join.add_argument("--max-rounds", type=int, help="leave once every fragment reached this round")
    join.add_argument("--max-steps", type=int, help="leave after this many inner steps")
    join.add_argument(
        "--wait-peers",
        type=int,
        default=0,
        metavar="N",
        help="start training once N learners (this one included) are live (0: at once)",
    )
    join.add_argument(
        "--wait-peers-timeout-s",
        type=float,
        default=300.0,
        help="start anyway after this long (with a warning)",
    )
    join.add_argument(
        "--eval-batches",
        type=int,
        default=2,
        help="held-out batches evaluated each round (0: none)",
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
        "--corrupt-rounds", type=int, default=0, help="rounds affected by --corrupt (and as many first contributions)"
    )
    join.add_argument(
        "--crash-at",
        help="fault injection: PHASE[:ROUND], SIGKILL this peer at that phase of a commit "
        "(after_quorum, during_merge, after_hold, after_record, after_first_reply); "
        "also P2PDILOCO_CRASH_AT",
    )
    join.add_argument(
        "--split-view-rounds", type=int, default=0,
        help="fault injection: see only this peer and ignore rival records for the first "
        "N rounds (forces two commits of one round)",
    )
    join.add_argument(
        "--checkpoint-every-s", type=float, default=60.0,
        help="seconds between periodic checkpoints (with --checkpoint-dir)",
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
        watcher.add_argument(
            "--run", default="local", help="run name (reads bootstrap_peers/<run>.txt)"
        )
        watcher.add_argument(
            "--initial-peers", nargs="*", metavar="MULTIADDR", help="multiaddrs to bootstrap from"
        )
        watcher.add_argument(
            "--bootstrap-file", type=Path, help="bootstrap file (default bootstrap_peers/<run>.txt)"
        )
        watcher.add_argument(
            "--timeout-s", type=float, default=60.0, help="give up joining the DHT after this long"
        )
        if name == "dashboard":
            watcher.add_argument(
                "--refresh-s", type=float, default=1.0, help="seconds between screen refreshes"
            )
        else:
            watcher.add_argument("--json", action="store_true", help="machine-readable output")
        watcher.set_defaults(handler=handler)

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
    if args.command in ("demo", "dashboard", "status") and not args.verbose:
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
