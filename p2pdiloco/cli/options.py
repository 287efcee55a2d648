"""From command-line flags to a run config: the flags several commands share, and the
order in which they override each other.

A run's config comes from `--config` (else the embedded default run), then `--set
section.key=value`, then the shortcut flags: `--transport`, a command's own shortcuts,
and the peer flags, each of which is a shorthand for `--set peer.NAME=VALUE`. A joining
peer or an observer of a run that has a signed manifest takes the manifest's config
instead of `--config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from p2pdiloco.config import REACHABILITY, TRANSPORTS, PeerConfig, RunConfig, load_config
from p2pdiloco.errors import ConfigError

log = logging.getLogger("p2pdiloco")

# The flags that say how to find a live run (their `peer.` field names).
RUN_FINDING_FIELDS = ("run", "manifest", "initial_peers", "bootstrap_file")


# --- flags -------------------------------------------------------------------------------


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """`--config`, `--set` and `--transport`: every command that reads a run config."""
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


def add_peer_flag(
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


def add_finding_flags(parser: argparse.ArgumentParser) -> None:
    """How any peer finds a run: its name, manifest, bootstrap file or addresses."""
    add_peer_flag(
        parser, "--run", "run name: its <run>.toml, else <run>.txt, from ./bootstrap_peers or shipped (`p2pdiloco runs`)"
    )
    add_peer_flag(
        parser, "--initial-peers", "multiaddrs to bootstrap from", nargs="*", metavar="MULTIADDR"
    )
    add_peer_flag(parser, "--bootstrap-file", "bootstrap file (default bootstrap_peers/<run>.txt)")
    add_peer_flag(parser, "--manifest", "signed run manifest (default bootstrap_peers/<run>.toml)")


def add_watch_flags(watcher: argparse.ArgumentParser) -> None:
    """How an observer (dashboard, status, audit) finds a run."""
    add_finding_flags(watcher)
    add_peer_flag(
        watcher,
        "--timeout-s",
        "give up joining the DHT after this long (s)",
        "startup_timeout_s",
        type=float,
    )


def add_join_flags(join: argparse.ArgumentParser) -> None:
    """Every `[peer]` field as a `join` flag: shorthands for `--set peer.NAME=VALUE`."""
    add_finding_flags(join)
    _add_network_flags(join)
    _add_training_flags(join)
    _add_output_flags(join)
    _add_fault_flags(join.add_argument_group("fault injection (tests and benchmarks only)"))


def _add_network_flags(join: argparse.ArgumentParser) -> None:
    """How a joining peer enters the swarm: new or not, its address, its identity."""
    add_peer_flag(join, "--new-run", "start a new swarm (no bootstrap peers)", action="store_true")
    add_peer_flag(join, "--startup-timeout-s", "give up joining after this long (s)", type=float)
    add_peer_flag(join, "--host", "listen address")
    add_peer_flag(join, "--port", "listen port (0: any)", type=int)
    add_peer_flag(
        join, "--announce-maddrs", "public addresses to announce", nargs="*", metavar="MULTIADDR"
    )
    add_peer_flag(
        join, "--client-mode", "behind NAT: outgoing connections only", action="store_true"
    )
    add_peer_flag(
        join,
        "--reachability",
        "auto: ask peers to dial back, client mode if none can; public: serve; client",
        choices=REACHABILITY,
        metavar="{" + ",".join(REACHABILITY) + "}",
    )
    add_peer_flag(
        join,
        "--no-relay",
        "no libp2p circuit relays (direct connections only)",
        "use_relay",
        action="store_const",
        const=False,
    )
    add_peer_flag(
        join,
        "--no-auto-relay",
        "in client mode, take no slot on a relay (nobody can reach this peer through one)",
        "use_auto_relay",
        action="store_const",
        const=False,
    )
    add_peer_flag(join, "--identity", "Ed25519 key file (created if missing)", "identity_path")
    add_peer_flag(join, "--heartbeat-s", "seconds between heartbeats", type=float)


def _add_training_flags(join: argparse.ArgumentParser) -> None:
    """What a joining peer trains on, when it starts and when it leaves."""
    add_peer_flag(join, "--data-rank", "this peer's data shard (-1: from the peer id)", type=int)
    add_peer_flag(join, "--data-shards", "number of data shards", type=int)
    add_peer_flag(
        join,
        "--wait-peers",
        "start training once N learners (this one included) are live (0: at once)",
        type=int,
        metavar="N",
    )
    add_peer_flag(
        join,
        "--wait-peers-timeout-s",
        "start anyway after this long (s), with a warning",
        type=float,
    )
    add_peer_flag(
        join, "--max-rounds", "leave once every fragment reached this round (0: never)", type=int
    )
    add_peer_flag(join, "--max-steps", "leave after this many inner steps (0: never)", type=int)
    add_peer_flag(
        join, "--eval-batches", "held-out batches evaluated each round (0: none)", type=int
    )
    add_peer_flag(
        join,
        "--threads",
        "torch CPU threads (0: default; 1 when peers share a machine)",
        "torch_threads",
        type=int,
    )


def _add_output_flags(join: argparse.ArgumentParser) -> None:
    """What a joining peer reports (events, metrics) and where it keeps its state."""
    add_peer_flag(join, "--events", "print one JSON event per line on stdout", action="store_true")
    add_peer_flag(
        join, "--metrics-port", "serve Prometheus metrics over HTTP on this port (0: off)", type=int
    )
    add_peer_flag(join, "--metrics-host", "address the metrics endpoint listens on")
    add_peer_flag(
        join,
        "--checkpoint-dir",
        "save the global state and local state here (periodically, on leaving), restore on start",
    )
    add_peer_flag(
        join,
        "--no-checkpoint",
        "save nothing (same as --checkpoint-dir none)",
        "checkpoint_dir",
        action="store_const",
        const="none",
    )
    add_peer_flag(
        join,
        "--checkpoint-every-s",
        "seconds between periodic checkpoints",
        type=float,
    )


def _add_fault_flags(faults: argparse._ArgumentGroup) -> None:
    """Faults a peer injects into its own behaviour, for tests and benchmarks."""
    add_peer_flag(faults, "--straggle-s", "delay contributions to early rounds (s)", type=float)
    add_peer_flag(faults, "--straggle-rounds", "rounds affected by --straggle-s", type=int)
    add_peer_flag(faults, "--corrupt", "send nan or garbage contributions to early rounds")
    add_peer_flag(
        faults,
        "--corrupt-rounds",
        "rounds affected by --corrupt (and as many first contributions)",
        type=int,
    )
    add_peer_flag(
        faults,
        "--crash-at",
        "PHASE[:ROUND], SIGKILL this peer at that phase of a commit (after_quorum, "
        "during_merge, after_hold, after_record, after_first_reply); also P2PDILOCO_CRASH_AT",
    )
    add_peer_flag(
        faults,
        "--split-view-rounds",
        "see only this peer and ignore rival records for the first N rounds "
        "(forces two commits of one round)",
        type=int,
    )


# --- configs -----------------------------------------------------------------------------


def transport_override(args: argparse.Namespace) -> list[str]:
    """`--transport X` as the override `network.transport="X"` (nothing when absent)."""
    kind = getattr(args, "transport", None)
    return [f"network.transport={json.dumps(kind)}"] if kind else []


def _peer_shortcuts(args: argparse.Namespace) -> list[str]:
    """The peer flags given on the command line, as `peer.NAME=VALUE` overrides."""
    return [
        f"peer.{f.name}={json.dumps(getattr(args, f.name))}"
        for f in dataclasses.fields(PeerConfig)
        if getattr(args, f.name, None) is not None
    ]


def _manifest_overrides(args: argparse.Namespace) -> list[str]:
    """What the command line changes in a manifest's config: --set, --transport, peer flags."""
    return [*args.overrides, *transport_override(args), *_peer_shortcuts(args)]


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> RunConfig:
    """The config from --config, then --set, then shortcut flags (`extra`, then peer flags)."""
    return load_config(
        args.config, [*args.overrides, *transport_override(args), *(extra or []), *_peer_shortcuts(args)]
    )


def names_a_run(args: argparse.Namespace) -> bool:
    """Whether the command line says how to find a live run (else: none was asked for)."""
    return any(getattr(args, name, None) is not None for name in RUN_FINDING_FIELDS)


def with_initial_peers(peer: PeerConfig, new_run: bool) -> PeerConfig:
    """`peer` with its initial peers resolved: the given ones, else its bootstrap file."""
    from p2pdiloco.transport.bootstrap import resolve_initial_peers

    bootstrap_file = Path(peer.bootstrap_file) if peer.bootstrap_file else None
    initial = resolve_initial_peers(peer.run, list(peer.initial_peers), bootstrap_file, new_run)
    return dataclasses.replace(peer, initial_peers=tuple(initial))


def join_config(args: argparse.Namespace):
    """(config, admission, certificates) of a joining peer: from the run's signed manifest
    when it has one (verified, operator pinned), else from --config/--set (an open run)."""
    from p2pdiloco.identity import load_or_create_identity
    from p2pdiloco.trust.admission import Admission
    from p2pdiloco.trust.manifest import find_manifest, joined_config, pin_operator

    config = config_from_args(args)
    manifest = find_manifest(config.peer)
    if manifest is None:
        peer = with_initial_peers(config.peer, config.peer.new_run)
        return dataclasses.replace(config, peer=peer), Admission(), ()
    if args.config is not None:
        raise ConfigError(
            f"--config conflicts with the manifest of run {manifest.name!r}: the run's config "
            "is the manifest's (use --set for [peer] and per-peer fields)"
        )
    config = joined_config(manifest, _manifest_overrides(args))
    pin_operator(manifest)
    peer = config.peer
    if not peer.initial_peers and not peer.new_run and manifest.bootstrap:
        peer = dataclasses.replace(peer, initial_peers=manifest.bootstrap)
    config = dataclasses.replace(config, peer=with_initial_peers(peer, peer.new_run))
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


def observer_config(args: argparse.Namespace):
    """(config, admission) of a peer that only watches or audits a run: the manifest's
    when the run has one, else --config/--set; initial peers resolved."""
    from p2pdiloco.trust.admission import Admission
    from p2pdiloco.trust.manifest import find_manifest, joined_config

    config = config_from_args(args)
    manifest = find_manifest(config.peer)
    admission = Admission()
    if manifest is not None:
        config = joined_config(manifest, _manifest_overrides(args))
        admission = manifest.admission()
        if not config.peer.initial_peers and manifest.bootstrap:
            config = dataclasses.replace(
                config, peer=dataclasses.replace(config.peer, initial_peers=manifest.bootstrap)
            )
    peer = with_initial_peers(config.peer, new_run=False)
    return dataclasses.replace(config, peer=peer), admission
