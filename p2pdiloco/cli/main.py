"""The `p2pdiloco` command line.

Every user error ends in one red line on stderr and exit code 2, never a traceback;
Ctrl-C ends with exit code 130 after the command's own clean-up.

Here: the entry point, the top-level parser, and `simulate`, `demo` and `config`. The
other commands live beside this module, each adding its own parser: `join` and
`bootstrap` in `peer_commands`, `dashboard` and `status` in `watch_commands`, `run`,
`runs`, `identity` and `audit` in `runs`, `doctor` in `doctor`, `export` and `generate`
in `model_commands`. The flags they share, and how flags become a run config, are in
`options`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from p2pdiloco import __version__
from p2pdiloco.cli import doctor, model_commands, peer_commands, runs, watch_commands
from p2pdiloco.cli.options import add_config_options, config_from_args, transport_override
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError, P2PDilocoError

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
    config = load_config(args.config, [*base, *args.overrides, *transport_override(args), *extra])
    if args.peers < 1 or args.rounds < 1:
        raise ConfigError("--peers and --rounds must be >= 1")
    from p2pdiloco.transport import require_stack

    require_stack(config.network.transport)  # its extra installed, or one line naming it
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


# --- config ------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective run config as TOML (after --config and --set)."""
    from p2pdiloco.config import render_toml

    print(render_toml(config_from_args(args)), end="")
    return 0


# --- the parser --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: one subcommand per command, in the order `--help` lists them."""
    parser = _Parser(prog="p2pdiloco", description="Peer-to-peer Decoupled DiLoCo training.")
    parser.add_argument("--version", action="version", version=f"p2pdiloco {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_simulate_command(sub)
    peer_commands.add_join_command(sub)
    peer_commands.add_bootstrap_command(sub)
    _add_demo_command(sub)
    watch_commands.add_commands(sub)
    runs.add_commands(sub)
    doctor.add_command(sub)
    model_commands.add_commands(sub)
    _add_config_command(sub)
    return parser


def _add_simulate_command(sub: argparse._SubParsersAction) -> None:
    """`simulate` on the top-level parser."""
    simulate = sub.add_parser(
        "simulate", help="DiLoCo vs synchronous data parallel, in one process"
    )
    add_config_options(simulate)
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


def _add_demo_command(sub: argparse._SubParsersAction) -> None:
    """`demo` on the top-level parser."""
    demo = sub.add_parser("demo", help="a local swarm on this machine with the live dashboard")
    add_config_options(demo)
    demo.add_argument("--peers", type=int, default=3, help="learner peers to start (default 3)")
    demo.add_argument("--rounds", type=int, default=5, help="outer rounds to train (default 5)")
    demo.add_argument("--model", help="model preset: tiny, small, 150m, 1b (default small)")
    demo.add_argument("--no-dashboard", action="store_true", help="plain progress lines instead")
    demo.add_argument("--json", type=Path, help="write the summary to this JSON file")
    demo.set_defaults(handler=cmd_demo)


def _add_config_command(sub: argparse._SubParsersAction) -> None:
    """`config` on the top-level parser."""
    config = sub.add_parser("config", help="print the effective run config as TOML")
    add_config_options(config)
    config.set_defaults(handler=cmd_config)


# --- entry point -------------------------------------------------------------------------


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
