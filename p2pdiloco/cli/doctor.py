"""`p2pdiloco doctor [--run NAME]`: will this machine work as a peer of the run?

One line a check, each with what to do (`preflight.Finding`): the devices torch sees,
RAM, accelerator memory and disk against the preset's memory model (`preflight`), then
the network: the transport's start time (and whether it joined the run's DHT), the clock
against the run's peers (`Transport.read_clock`: hivemind's own DHT ping carries the
peer's DHT time), the addresses it announces, and whether it can be dialled: a second,
client-mode transport on this machine dials the first at its best announced address
and calls it, and the run's peers are asked to dial it back (`peer.reachability`, what
`join` asks; a warning too when it listens on loopback while they are elsewhere). Every
network step has a deadline; `--offline` skips them.

`join` runs the local checks before it trains (`preflight.raise_if_fatal`) and compares
clocks with its initial peers once its transport is up (`check_clock_at_join`, 2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from p2pdiloco.cli.options import (
    add_config_options,
    add_peer_flag,
    add_watch_flags,
    config_from_args,
    names_a_run,
    observer_config,
)
from p2pdiloco.peer.clock import CLOCK_PEERS, CLOCK_S, peer_ids_of, read_clocks
from p2pdiloco.peer.preflight import (
    Finding,
    address_scope,
    check_addresses,
    check_clock,
    check_reachable,
    check_transport,
    exit_code,
    local_findings,
    render_findings,
    to_json,
)
from p2pdiloco.peer.reachability import (
    check_reachability,
    listen_warning,
    peers_to_ask,
    reach_finding,
)

log = logging.getLogger(__name__)

ECHO = "p2pdiloco.cli.doctor.echo"
"""The RPC the self-dial calls: it answers the request's bytes."""
MAX_START_S = 60.0
"""The doctor's transport waits at most this long to join the run (or `--timeout-s`)."""
DIAL_S = 15.0
"""Deadline of the self-dial: the second transport's start and its call."""
OpenTransport = Callable[[list[str], bool], Any]
"""`(initial_peers, dialer)` -> an unstarted transport: the peer's own (its host, port,
client mode and announced addresses) when `dialer` is False, else a client-mode one on
any port that dials out only."""


def best_address(maddrs: list[str]) -> str:
    """The address others would dial first: a public one, else a LAN one, else loopback."""
    rank = {"public": 0, "unknown": 1, "private": 2, "loopback": 3}
    return min(maddrs, key=lambda m: rank[address_scope(m)], default="")


async def tcp_problem(maddr: str, timeout_s: float = CLOCK_S) -> str:
    """Why a TCP connection to `maddr`'s host and port fails ("" when it opens, or when
    the address is not /ip4|ip6|dns/.../tcp/PORT)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        return ""
    try:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts[2], int(parts[4])), timeout_s
        )
    except TimeoutError:
        return f"TCP connection timed out after {timeout_s:g} s"
    except ConnectionRefusedError:
        return "TCP connection refused: nothing listens there"
    except (OSError, ValueError) as exc:
        return f"TCP: {getattr(exc, 'strerror', None) or exc}"
    writer.close()
    return ""


async def self_dial(transport: Any, open_transport: OpenTransport, client_mode: bool) -> Finding:
    """Dial `transport` from a second, client-mode transport at its best address and call it."""
    target = best_address(transport.visible_maddrs())
    if client_mode or not target:
        return check_reachable(target, "", client_mode)
    from p2pdiloco.transport.base import TransportError

    nonce = os.urandom(16)

    async def echo(_caller: str, request: bytes) -> bytes:
        return request

    await transport.register_handler(ECHO, echo, max_request_bytes=64)
    problem = await tcp_problem(target)
    if problem:  # nothing accepts TCP there: no transport would get further
        return check_reachable(target, problem, client_mode)
    dialer = open_transport([target], True)
    try:
        async with asyncio.timeout(DIAL_S):
            await dialer.start()
            answer = await dialer.call(transport.peer_id, ECHO, nonce, timeout_s=DIAL_S)
        problem = "" if answer == nonce else "another peer answered"
    except TimeoutError:
        problem = f"no answer within {DIAL_S:g} s"
    except TransportError as exc:
        problem = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    finally:
        await dialer.shutdown()
    return check_reachable(target, problem, client_mode)


async def network_findings(
    peer: Any, kind: str, open_transport: OpenTransport, timeout_s: float
) -> list[Finding]:
    """The network's checks for a peer with `[peer]` settings `peer` (initial peers resolved)."""
    from p2pdiloco.transport.base import AddressInUse, ClockSkew, TransportStartError

    initial = list(peer.initial_peers)
    findings: list[Finding] = []
    joined, clock_done = bool(initial), False
    transport, started = open_transport(initial, False), time.monotonic()
    try:
        await asyncio.wait_for(transport.start(), timeout_s + 15)
    except AddressInUse as exc:
        await transport.shutdown()
        return [
            Finding(
                "port",
                "fail",
                str(exc),
                "is your peer running already? stop it, or check another --port",
            )
        ]
    except ClockSkew as exc:
        findings.append(
            Finding("clock", "fail", str(exc).split(":")[0], str(exc).partition(": ")[2])
        )
        joined, clock_done = False, True
    except (TransportStartError, TimeoutError) as exc:
        findings.append(
            Finding(
                "bootstrap",
                "fail",
                f"could not join the run: {str(exc) or 'start timed out'}",
                "is the run up (`p2pdiloco status --run NAME`)? are outgoing TCP connections allowed?",
            )
        )
        joined = False
    else:
        findings.append(check_transport(kind, time.monotonic() - started))
    if initial and not joined:  # the rest of the checks on a transport of our own
        await transport.shutdown()
        transport, started = open_transport([], False), time.monotonic()
        try:
            await asyncio.wait_for(transport.start(), timeout_s + 15)
        except (TransportStartError, TimeoutError) as exc:
            await transport.shutdown()
            return [*findings, check_transport(kind, None, str(exc) or "start timed out")]
        findings.append(check_transport(kind, time.monotonic() - started))
    try:
        if joined:
            count = len(peer_ids_of(initial))
            findings.append(
                Finding(
                    "bootstrap", "ok", f"joined the run's DHT through its {count} initial peer(s)"
                )
            )
        if not clock_done:
            ids = peer_ids_of(initial)[:CLOCK_PEERS] if joined else []
            findings.append(check_clock(await read_clocks(transport, ids), len(ids)))
        findings.append(check_addresses(transport.visible_maddrs(), peer.client_mode))
        findings.append(await self_dial(transport, open_transport, peer.client_mode))
        listen = listen_warning(peer.host, initial)
        findings += [listen] if listen is not None else []
        if joined and not peer.client_mode:  # what `join` asks: can the run's peers dial us?
            asked = peers_to_ask(transport, initial)
            findings.append(reach_finding(await check_reachability(transport, asked)))
    finally:
        await transport.shutdown()
    return findings


def _opener(peer: Any, kind: str, timeout_s: float) -> OpenTransport:
    """Transports for `network_findings` from `[peer]` settings (an ephemeral identity:
    the doctor never uses, or collides with, the peer's own)."""
    from p2pdiloco.errors import NetworkSetupError
    from p2pdiloco.transport import make_transport
    from p2pdiloco.transport.bootstrap import check_announce_maddr

    for maddr in peer.announce_maddrs:
        check_announce_maddr(maddr)

    def open_transport(initial: list[str], dialer: bool) -> Any:
        try:
            return make_transport(
                kind,
                initial_peers=initial,
                host="127.0.0.1" if dialer else peer.host,
                port=0 if dialer else peer.port,
                client_mode=dialer or peer.client_mode,
                announce_maddrs=None if dialer else (list(peer.announce_maddrs) or None),
                startup_timeout_s=DIAL_S if dialer else timeout_s,
            )
        except (ValueError, TypeError) as exc:
            raise NetworkSetupError(f"cannot set up the transport: {exc}") from None

    return open_transport


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this machine for the run; exit 0 when nothing failed, 1 otherwise."""
    from rich.console import Console

    config = observer_config(args)[0] if names_a_run(args) else config_from_args(args)
    peer, kind = config.peer, config.network.transport
    findings = local_findings(config)
    if not args.offline:
        timeout_s = min(peer.startup_timeout_s, MAX_START_S)
        findings += asyncio.run(
            network_findings(peer, kind, _opener(peer, kind, timeout_s), timeout_s)
        )
    if args.json:
        print(json.dumps(to_json(findings), indent=2))
    else:
        console = Console(highlight=False, soft_wrap=True)
        console.print(
            f"[bold]p2pdiloco doctor[/]: run {peer.run}, model {config.model.preset}, transport {kind}, "
            f"{'client mode' if peer.client_mode else f'{peer.host}:{peer.port}'}"
        )
        for line in render_findings(findings):
            console.print(line)
    return exit_code(findings)


def add_command(sub: argparse._SubParsersAction) -> None:
    """`p2pdiloco doctor` on the top-level parser."""
    doctor = sub.add_parser(
        "doctor", help="check this machine for a run: devices, RAM, disk, clock, reachability"
    )
    add_config_options(doctor)
    add_watch_flags(doctor)
    add_peer_flag(doctor, "--host", "listen address to check")
    add_peer_flag(doctor, "--port", "listen port to check (0: any)", type=int)
    add_peer_flag(
        doctor, "--announce-maddrs", "public addresses to check", nargs="*", metavar="MULTIADDR"
    )
    add_peer_flag(
        doctor, "--client-mode", "check as a peer behind NAT (dials out only)", action="store_true"
    )
    add_peer_flag(doctor, "--checkpoint-dir", "check the free space here", "checkpoint_dir")
    doctor.add_argument("--offline", action="store_true", help="the local checks only (no network)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=cmd_doctor)
