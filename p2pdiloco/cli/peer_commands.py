"""`p2pdiloco join` and `p2pdiloco bootstrap`: the commands that run a node of the swarm.

`join` runs the peer daemon (`p2pdiloco.peer.daemon.PeerDaemon`): it joins a run, trains,
and synchronises when elected. `bootstrap` runs a DHT-only node that stores the run's
records and prints the multiaddrs other peers bootstrap from. Both find the run's config
through `p2pdiloco.cli.options`; torch is imported only after the config is known good.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from p2pdiloco.cli.options import (
    add_config_options,
    add_join_flags,
    add_peer_flag,
    config_from_args,
    join_config,
)
from p2pdiloco.errors import ConfigError

log = logging.getLogger("p2pdiloco")


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
    config, admission, certificates = join_config(args)
    from p2pdiloco.peer.checkpoint_dir import with_checkpoint_dir
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
    config = with_checkpoint_dir(config)  # "auto": a folder of the user's data directory, claimed
    network = config.network
    rules = RunRecordRules(
        config.peer.run, config.sync.num_fragments, admission, network.member_shards, network.record_epoch_rounds
    )
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
    # a bootstrap node has a public address (docs/operate.md): it relays for NAT'd peers
    transport = make_transport_for(peer, rules, config.network.transport, relay_service=True)

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


# --- their parsers -----------------------------------------------------------------------


def add_join_command(sub: argparse._SubParsersAction) -> None:
    """`join` on the top-level parser."""
    join = sub.add_parser("join", help="run the peer daemon: join a run and train")
    add_config_options(join)
    join.add_argument(
        "--log-json", action="store_true", help="log one JSON object per line (for machines)"
    )
    join.add_argument(
        "--skip-preflight", action="store_true", help="join even if this machine looks too small (see `doctor`)"
    )
    add_join_flags(join)
    join.set_defaults(handler=cmd_join)


def add_bootstrap_command(sub: argparse._SubParsersAction) -> None:
    """`bootstrap` on the top-level parser."""
    bootstrap = sub.add_parser("bootstrap", help="run a DHT-only node and print its multiaddrs")
    add_config_options(bootstrap)
    add_peer_flag(bootstrap, "--run", "run whose records this node stores (reads bootstrap_peers/<run>.toml)")
    add_peer_flag(bootstrap, "--manifest", "signed run manifest (default bootstrap_peers/<run>.toml)")
    add_peer_flag(bootstrap, "--host", "listen address")
    add_peer_flag(bootstrap, "--port", "listen port (0: any)", type=int)
    add_peer_flag(
        bootstrap,
        "--announce-maddrs",
        "public addresses to announce and print, e.g. /ip4/203.0.113.7/tcp/31337 (a cloud VM's public IP)",
        nargs="*",
        metavar="MULTIADDR",
    )
    add_peer_flag(
        bootstrap, "--identity", "Ed25519 key file (created if missing)", "identity_path"
    )
    add_peer_flag(
        bootstrap, "--initial-peers", "other bootstrap nodes", nargs="*", metavar="MULTIADDR"
    )
    add_peer_flag(bootstrap, "--events", "print a JSON readiness line", action="store_true")
    bootstrap.set_defaults(handler=cmd_bootstrap)
