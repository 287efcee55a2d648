"""`p2pdiloco dashboard` and `p2pdiloco status`: watch a run without taking part in it.

Both join the run's DHT as a client-mode observer (`p2pdiloco.cli.dashboard`), with the
run's manifest when it has one, and never train: `dashboard` redraws the swarm live,
`status` prints it once.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from p2pdiloco.cli.options import add_config_options, add_watch_flags, observer_config
from p2pdiloco.config import PeerConfig


def _watched(args: argparse.Namespace) -> tuple[PeerConfig, int, str, dict[str, Any]]:
    """Whom a watcher joins through (`[peer]`, initial peers resolved), how many fragments,
    on which transport, and how it reads the run (the manifest's admission when the run
    has one: uncertified records ignored, certified synchronizers shown; K; max grace)."""
    config, admission = observer_config(args)
    view = {
        "admission": admission, "min_quorum": config.sync.min_quorum, "max_grace_s": config.sync.max_grace_s,
        "member_shards": config.network.member_shards,
        "record_epoch_rounds": config.network.record_epoch_rounds,
    }  # fmt: skip
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


# --- their parsers -----------------------------------------------------------------------


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`dashboard` and `status` on the top-level parser."""
    dashboard = sub.add_parser("dashboard", help="watch a run live (client-mode observer, no training)")
    add_config_options(dashboard)
    add_watch_flags(dashboard)
    dashboard.add_argument(
        "--refresh-s", type=float, default=1.0, help="seconds between screen refreshes"
    )
    dashboard.set_defaults(handler=cmd_dashboard)

    status = sub.add_parser("status", help="print a run's peers and rounds once")
    add_config_options(status)
    add_watch_flags(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=cmd_status)
