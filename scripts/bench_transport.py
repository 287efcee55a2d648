"""Benchmark: throughput of our `Transport.call()` next to the layers beneath it.

Moves one payload (100 MB; 20 MB with --quick) from this process to a server process on
loopback, over three paths measured in the same run:

- `call`   : HivemindTransport.call() to a handler (chunked, size-checked, framed),
- `stream` : hivemind's raw P2P binary stream through the same p2pd daemons,
- `tcp`    : a plain asyncio TCP socket (the ceiling of this machine).

Each figure is payload bytes / wall seconds for the whole transfer (stream open and the
8-byte acknowledgement included), best of N repetitions, in MB/s (1 MB = 10^6 bytes).

    python scripts/bench_transport.py [--quick] [--json PATH] [--mb N] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

CHUNK = 1 << 20
LENGTH = struct.Struct(">Q")
RAW_PROTOCOL = "/p2pdiloco/bench/raw/1"


async def _read_exactly_chunked(reader: asyncio.StreamReader, num_bytes: int) -> int:
    received = 0
    while received < num_bytes:
        chunk = await reader.read(min(CHUNK, num_bytes - received))
        if not chunk:
            raise ConnectionError("stream closed early")
        received += len(chunk)
    return received


async def _sink_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read one length-prefixed payload, answer its length (8 bytes)."""
    try:
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        writer.write(LENGTH.pack(await _read_exactly_chunked(reader, length)))
        await writer.drain()
    finally:
        writer.close()


async def _send_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> None:
    view = memoryview(payload)
    writer.write(LENGTH.pack(len(payload)))
    for offset in range(0, len(view), CHUNK):
        writer.write(view[offset : offset + CHUNK])
        await writer.drain()
    (echoed,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), 300))
    writer.close()
    assert echoed == len(payload), (echoed, len(payload))


async def serve(max_request_bytes: int) -> None:
    """Server process: our transport, a raw hivemind P2P and a TCP sink; one JSON line ready."""
    from hivemind.p2p import P2P

    from p2pdiloco.transport import make_transport

    transport = make_transport("hivemind", initial_peers=[])
    await transport.start()

    async def sink(caller: str, request: bytes) -> bytes:
        return LENGTH.pack(len(request))

    await transport.register_handler("sink", sink, max_request_bytes)
    raw = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60)
    await raw.add_binary_stream_handler(RAW_PROTOCOL, lambda _, r, w: _sink_stream(r, w))
    tcp = await asyncio.start_server(_sink_stream, "127.0.0.1", 0)
    ready = {
        "peer_id": transport.peer_id,
        "maddrs": transport.visible_maddrs(),
        "raw_maddrs": [str(m) for m in await raw.get_visible_maddrs()],
        "tcp_port": tcp.sockets[0].getsockname()[1],
    }
    print(json.dumps(ready), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
    finally:
        tcp.close()
        await raw.shutdown()
        await transport.shutdown()


async def measure(server: dict[str, Any], num_bytes: int, repeats: int) -> dict[str, Any]:
    from hivemind.p2p import P2P, PeerID

    from p2pdiloco.transport import make_transport

    payload = os.urandom(num_bytes)
    transport = make_transport("hivemind", initial_peers=server["maddrs"])
    await transport.start()
    raw = await P2P.create(
        initial_peers=server["raw_maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60
    )
    raw_peer = PeerID.from_base58(server["raw_maddrs"][0].rsplit("/p2p/", 1)[1])

    async def via_call() -> None:
        reply = await transport.call(server["peer_id"], "sink", payload, 300, 64)
        assert LENGTH.unpack(reply)[0] == num_bytes

    async def via_stream() -> None:
        _, reader, writer = await raw.call_binary_stream_handler(raw_peer, RAW_PROTOCOL)
        await _send_stream(reader, writer, payload)

    async def via_tcp() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server["tcp_port"])
        await _send_stream(reader, writer, payload)

    seconds: dict[str, list[float]] = {"call": [], "stream": [], "tcp": []}
    try:
        for _ in range(repeats):  # interleaved, so load drift hits every path alike
            for name, run in (("call", via_call), ("stream", via_stream), ("tcp", via_tcp)):
                started = time.perf_counter()
                await asyncio.wait_for(run(), 600)
                seconds[name].append(time.perf_counter() - started)
    finally:
        await raw.shutdown()
        await transport.shutdown()
    result: dict[str, Any] = {"payload_mb": num_bytes / 1e6, "repeats": repeats}
    for name, times in seconds.items():
        result[f"{name}_mb_s"] = round(num_bytes / 1e6 / min(times), 1)
        result[f"{name}_median_mb_s"] = round(num_bytes / 1e6 / statistics.median(times), 1)
    result["call_vs_stream"] = round(result["call_mb_s"] / result["stream_mb_s"], 3)
    result["call_vs_tcp"] = round(result["call_mb_s"] / result["tcp_mb_s"], 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="20 MB, 3 repeats (well under a minute)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--mb", type=float, default=None, help="payload size, MB")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    num_bytes = int((args.mb or (20 if args.quick else 100)) * 1e6)
    repeats = args.repeats or (3 if args.quick else 5)
    if args.serve:
        asyncio.run(serve(max_request_bytes=num_bytes + 1))
        return 0

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--mb", str(num_bytes / 1e6)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = server.stdout.readline()  # readiness line (the server's start is bounded)
        if not line:
            print("bench_transport error=server_failed_to_start", file=sys.stderr)
            return 1
        result = asyncio.run(measure(json.loads(line), num_bytes, repeats))
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
    result["cpu_count"] = os.cpu_count()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"bench_transport payload_mb={result['payload_mb']:g} call_mb_s={result['call_mb_s']} "
        f"hivemind_stream_mb_s={result['stream_mb_s']} tcp_mb_s={result['tcp_mb_s']} "
        f"call_vs_stream={result['call_vs_stream']} call_vs_tcp={result['call_vs_tcp']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
