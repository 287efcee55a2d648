"""A transport peer for networked tests: serve "echo" and "size", obey JSON commands on stdin.

    python tests/net/transport_peer.py [--initial-peer MADDR]... [--port N] [--identity PATH]
        [--client-mode] [--max-request-bytes N] [--startup-timeout S]
        [--transport hivemind|libp2p]

Prints `{"ready": true, "peer_id": ..., "maddrs": [...]}` once started (or `"ready": false`
with the error and exits 2), then answers one JSON line per command (echoing `"id"`):

    {"op": "call", "peer": ID, "name": "echo"|"size", "num_bytes": N, "seed": S,
     "timeout_s": T, "max_response_bytes": M}
    {"op": "store", "key": K, "subkey": S, "value": STR, "ttl_s": T}
    {"op": "get", "key": K}
    {"op": "shutdown"}

Handlers: "echo" returns the request; "size" returns `{"num_bytes", "sha256"}` of it as JSON.
SIGTERM or stdin EOF shut the transport down cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
import signal
import sys
import time
from typing import Any

from p2pdiloco.transport import Transport, TransportError, make_transport


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def payload(num_bytes: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes, so both sides can check them."""
    return random.Random(seed).randbytes(num_bytes)


async def echo(caller: str, request: bytes) -> bytes:
    return request


async def size(caller: str, request: bytes) -> bytes:
    digest = hashlib.sha256(request).hexdigest()
    return json.dumps({"num_bytes": len(request), "sha256": digest, "caller": caller}).encode()


async def run_command(transport: Transport, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "call":
        request = payload(command.get("num_bytes", 0), command.get("seed", 0))
        started = time.monotonic()
        try:
            response = await transport.call(
                command["peer"],
                command.get("name", "echo"),
                request,
                timeout_s=command.get("timeout_s", 60),
                max_response_bytes=command.get("max_response_bytes", 1 << 30),
            )
        except TransportError as e:
            elapsed_s = time.monotonic() - started
            return {
                "ok": False,
                "error": type(e).__name__,
                "message": str(e),
                "elapsed_s": elapsed_s,
            }
        return {
            "ok": True,
            "elapsed_s": time.monotonic() - started,
            "num_bytes": len(response),
            "echo_matches": response == request,
            "request_sha256": hashlib.sha256(request).hexdigest(),
            "response": response.decode(errors="replace") if len(response) < 4096 else None,
        }
    if op == "store":
        expiration = transport.now() + command["ttl_s"]
        stored = await transport.store(
            command["key"], command["subkey"], command["value"].encode(), expiration
        )
        return {"ok": True, "stored": stored, "expiration_time": expiration}
    if op == "get":
        records = await transport.get(command["key"], latest=command.get("latest", True))
        return {
            "ok": True,
            "now": transport.now(),
            "records": {sub: [value.decode(), exp] for sub, (value, exp) in records.items()},
        }
    return {"ok": False, "error": "UnknownCommand", "message": op}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--identity", default=None)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20)
    parser.add_argument("--startup-timeout", type=float, default=90)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")

    transport = make_transport(
        args.transport,
        initial_peers=args.initial_peer,
        port=args.port,
        identity_path=args.identity,
        client_mode=args.client_mode,
        startup_timeout_s=args.startup_timeout,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        try:
            await transport.start()
            await transport.register_handler("echo", echo, args.max_request_bytes)
            await transport.register_handler("size", size, args.max_request_bytes)
        except TransportError as e:
            emit({"ready": False, "error": type(e).__name__, "message": str(e)})
            return 2
        emit({"ready": True, "peer_id": transport.peer_id, "maddrs": transport.visible_maddrs()})

        stdin = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        tasks: set[asyncio.Task] = set()

        async def answer(command: dict[str, Any]) -> None:
            try:
                reply = await run_command(transport, command)
            except Exception as e:  # report, never die on a bad command
                reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
            emit({**reply, "id": command.get("id")})

        while not stop.is_set():
            line_task = asyncio.ensure_future(stdin.readline())
            stop_task = asyncio.ensure_future(stop.wait())
            await asyncio.wait({line_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            stop_task.cancel()
            if not line_task.done():
                line_task.cancel()
                break
            line = line_task.result()
            if not line:
                break  # parent went away
            command = json.loads(line)
            if command.get("op") == "shutdown":
                break
            task = asyncio.create_task(answer(command))  # commands run concurrently
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in tasks:
            task.cancel()
    finally:
        await transport.shutdown()
    emit({"event": "shutdown", "peer_id": transport.peer_id})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
