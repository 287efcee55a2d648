"""A libp2p peer for tests/net/test_libp2p_routing.py: tests/net/transport_peer.py's
commands on `make_transport("libp2p")`, with the record store sized for a small swarm.

    python tests/net/libp2p_routing_peer.py --identity PATH [--initial-peer MADDR]...
        [--replicas K] [--republish-s S] [--per-replica-s S] [--dht-timeout S] [--no-gossip]

`--replicas` sets k (a handful of peers can then show routing: with k = 20 every peer of
a test swarm holds every record); `--no-gossip` makes a peer that knows only its initial
peers (no exchange of known peers, no probes of the peers they name, no lookup of its own
id): whatever else it reaches, it reaches through lookups. Besides transport_peer's
commands (whose `get` answers here with `elapsed_s` too):

    {"op": "known"}            -> {"known": [peer ids of the routing table]}
    {"op": "held", "key": K}   -> {"records": {subkey: value}} of this peer's own table

Run as a child (py-libp2p and hivemind cannot share the pytest process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transport_peer import emit, run_command  # noqa: E402

from p2pdiloco.transport import (  # noqa: E402
    TransportError,
    libp2p_peers,
    libp2p_records,
    make_transport,
)


def configure(args: argparse.Namespace) -> None:
    """Set the record store's constants (module globals, read at each use)."""
    libp2p_records.REPLICAS = args.replicas
    libp2p_records.REPUBLISH_S = args.republish_s
    libp2p_records.PER_REPLICA_SHARE = args.per_replica_s / args.dht_timeout
    if args.no_gossip:
        libp2p_peers.REFRESH_S = 1e9

        async def no_probes(self: Any, fresh: list[str]) -> None:
            for candidate in fresh:
                self.candidates.pop(candidate, None)

        async def no_self_lookups(self: Any) -> None:
            return None

        libp2p_peers.SwarmPeers._probe_all = no_probes
        libp2p_records.RecordStore.self_lookup_loop = no_self_lookups


async def command(transport: Any, message: dict[str, Any]) -> dict[str, Any]:
    op = message["op"]
    if op == "known":
        return {"ok": True, "known": sorted(transport._peers.known)}
    if op == "held":
        held = transport._records.table.get(message["key"], transport.now())
        return {"ok": True, "records": {s: v.decode() for s, (v, _) in held.items()}}
    started = time.monotonic()
    reply = await run_command(transport, message)
    return {**reply, "elapsed_s": reply.get("elapsed_s", time.monotonic() - started)}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--identity", required=True)
    parser.add_argument("--replicas", type=int, default=libp2p_records.REPLICAS)
    parser.add_argument("--republish-s", type=float, default=libp2p_records.REPUBLISH_S)
    parser.add_argument("--per-replica-s", type=float, default=5.0)
    parser.add_argument("--dht-timeout", type=float, default=30.0)
    parser.add_argument("--no-gossip", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    configure(args)

    transport = make_transport(
        "libp2p",
        initial_peers=args.initial_peer,
        identity_path=args.identity,
        startup_timeout_s=90,
        dht_timeout_s=args.dht_timeout,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        try:
            await transport.start()
        except TransportError as exc:
            emit({"ready": False, "error": type(exc).__name__, "message": str(exc)})
            return 2
        emit({"ready": True, "peer_id": transport.peer_id, "maddrs": transport.visible_maddrs()})
        stdin = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        tasks: set[asyncio.Task] = set()

        async def answer(message: dict[str, Any]) -> None:
            try:
                reply = await command(transport, message)
            except Exception as exc:  # report, never die on a bad command
                reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            emit({**reply, "id": message.get("id")})

        while not stop.is_set():
            line = await stdin.readline()
            if not line or json.loads(line).get("op") == "shutdown":
                break
            task = asyncio.create_task(answer(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await transport.shutdown()
    emit({"event": "stopped"})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
