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
