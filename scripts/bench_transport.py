"""Benchmark: throughput of both transports' `call()` next to the layers beneath them.

Moves one payload (20 MB and 100 MB; 20 MB with --quick) from a client process to a
server process on loopback, for each transport over three paths measured in the same
processes, interleaved:

- `call`   : the transport's `call()` to a handler (chunked, size-checked, framed),
- `stream` : the raw stream of the stack beneath it: hivemind's P2P binary stream through
             p2pd daemons, or a py-libp2p stream between two hosts (TCP, noise, yamux),
- `tcp`    : a plain asyncio TCP socket (the ceiling of this machine).

hivemind and py-libp2p cannot share a process, so each transport gets its own server and
client processes. Each figure is payload bytes / wall seconds for the whole transfer
(stream open and the 8-byte acknowledgement included), best of N repetitions, in MB/s
(1 MB = 10^6 bytes). `join_s` is the time from creating a client peer to its `start()`
returning, bootstrapped from the server (a daemon's start included, for hivemind).

    python scripts/bench_transport.py [--quick] [--json PATH] [--mb N] [--repeats N]
        [--transports hivemind,libp2p]
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
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

CHUNK = 1 << 20
LENGTH = struct.Struct(">Q")
RAW_PROTOCOL = "/p2pdiloco/bench/raw/1"
TRANSPORTS = ("hivemind", "libp2p")


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


async def _send_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> None:
    view = memoryview(payload)
    writer.write(LENGTH.pack(len(payload)))
    for offset in range(0, len(view), CHUNK):
        writer.write(view[offset : offset + CHUNK])
        await writer.drain()
    (echoed,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), 300))
    writer.close()
    assert echoed == len(payload), (echoed, len(payload))


# --- raw py-libp2p streams (trio, in a thread of their own) ------------------------------


class Libp2pRawServer:
    """A bare py-libp2p host whose handler reads one length-prefixed payload and acks it."""

    def __init__(self) -> None:
        self.maddr = ""
        self._ready = threading.Event()
        self._token = None
        self._stop = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("raw py-libp2p host did not start")
        return self.maddr

    def stop(self) -> None:
        if self._token is not None:
            self._token.run_sync_soon(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        import multiaddr
        import trio
        from libp2p import new_host
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.custom_types import TProtocol

        async def handler(stream) -> None:
            head = b""
            while len(head) < LENGTH.size:
                head += await stream.read(LENGTH.size - len(head))
            (length,) = LENGTH.unpack(head)
            received = 0
            while received < length:
                received += len(await stream.read(min(CHUNK, length - received)))
            await stream.write(LENGTH.pack(received))
            await stream.close()

        async def main() -> None:
            listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
            host = new_host(key_pair=create_new_key_pair(), listen_addrs=listen)
            host.set_stream_handler(TProtocol(RAW_PROTOCOL), handler)
            async with host.run(listen):
                self.maddr = str(host.get_addrs()[0])
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()

        trio.run(main)


def libp2p_raw_send(maddr: str, payloads: list[bytes]) -> list[float]:
    """Send each payload on a fresh stream of one py-libp2p connection; seconds each (stream
    open to ack; the connection is set up beforehand, as `call()`'s is after its first use)."""
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    async def main() -> list[float]:
        host = new_host(key_pair=create_new_key_pair())
        seconds = []
        async with host.run([]):
            info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
            await host.connect(info)
            for payload in payloads:
                started = time.perf_counter()
                stream = await host.new_stream(info.peer_id, [TProtocol(RAW_PROTOCOL)])
                await stream.write(LENGTH.pack(len(payload)))
                view = memoryview(payload)
                for offset in range(0, len(view), CHUNK):
                    await stream.write(bytes(view[offset : offset + CHUNK]))
                ack = b""
                while len(ack) < LENGTH.size:
                    ack += await stream.read(LENGTH.size - len(ack))
                assert LENGTH.unpack(ack)[0] == len(payload)
                seconds.append(time.perf_counter() - started)
                await stream.close()
        return seconds

    return trio.run(main)


# --- server and client processes ---------------------------------------------------------


async def serve(kind: str, max_request_bytes: int) -> None:
    """Server process: our transport, a raw stream sink of its stack and a TCP sink."""
    from p2pdiloco.transport import make_transport

    transport = make_transport(kind, initial_peers=[])
    await transport.start()

    async def sink(caller: str, request: bytes) -> bytes:
        return LENGTH.pack(len(request))

    await transport.register_handler("sink", sink, max_request_bytes)
    raw_p2p, raw_server = None, None
    if kind == "hivemind":
        from hivemind.p2p import P2P

        raw_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60)
        await raw_p2p.add_binary_stream_handler(RAW_PROTOCOL, lambda _, r, w: _sink_stream(r, w))
        raw_maddr = str((await raw_p2p.get_visible_maddrs())[0])
    else:
        raw_server = Libp2pRawServer()
        raw_maddr = await asyncio.to_thread(raw_server.start)
    tcp = await asyncio.start_server(_sink_stream, "127.0.0.1", 0)
    ready = {
        "peer_id": transport.peer_id,
        "maddrs": transport.visible_maddrs(),
        "raw_maddr": raw_maddr,
        "tcp_port": tcp.sockets[0].getsockname()[1],
    }
    print(json.dumps(ready), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
    finally:
        tcp.close()
        if raw_p2p is not None:
            await raw_p2p.shutdown()
        if raw_server is not None:
            raw_server.stop()
        await transport.shutdown()


async def measure(kind: str, server: dict[str, Any], sizes: list[int], repeats: int) -> dict[str, Any]:
    from p2pdiloco.transport import make_transport

    started = time.perf_counter()
    transport = make_transport(kind, initial_peers=server["maddrs"])
    await transport.start()
    result: dict[str, Any] = {"transport": kind, "join_s": round(time.perf_counter() - started, 2)}
    raw_p2p = raw_peer = None
    if kind == "hivemind":
        from hivemind.p2p import P2P, PeerID

        raw_p2p = await P2P.create(
            initial_peers=[server["raw_maddr"]], host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=60
        )
        raw_peer = PeerID.from_base58(server["raw_maddr"].rsplit("/p2p/", 1)[1])
    try:
        for num_bytes in sizes:
            payload = os.urandom(num_bytes)

            async def via_call(payload: bytes = payload, num_bytes: int = num_bytes) -> None:
                reply = await transport.call(server["peer_id"], "sink", payload, 300, 64)
                assert LENGTH.unpack(reply)[0] == num_bytes

            async def via_stream(payload: bytes = payload) -> float:
                if raw_p2p is not None:
                    begun = time.perf_counter()
                    _, reader, writer = await raw_p2p.call_binary_stream_handler(raw_peer, RAW_PROTOCOL)
                    await _send_stream(reader, writer, payload)
                    return time.perf_counter() - begun
                return (await asyncio.to_thread(libp2p_raw_send, server["raw_maddr"], [payload]))[0]

            async def via_tcp(payload: bytes = payload) -> None:
                reader, writer = await asyncio.open_connection("127.0.0.1", server["tcp_port"])
                await _send_stream(reader, writer, payload)

            seconds: dict[str, list[float]] = {"call": [], "stream": [], "tcp": []}
            for _ in range(repeats):  # interleaved, so load drift hits every path alike
                begun = time.perf_counter()
                await asyncio.wait_for(via_call(), 600)
                seconds["call"].append(time.perf_counter() - begun)
                seconds["stream"].append(await asyncio.wait_for(via_stream(), 600))
                begun = time.perf_counter()
                await asyncio.wait_for(via_tcp(), 600)
                seconds["tcp"].append(time.perf_counter() - begun)
            row: dict[str, Any] = {"payload_mb": num_bytes / 1e6, "repeats": repeats}
            for name, times in seconds.items():
                row[f"{name}_mb_s"] = round(num_bytes / 1e6 / min(times), 1)
                row[f"{name}_median_mb_s"] = round(num_bytes / 1e6 / statistics.median(times), 1)
            row["call_vs_stream"] = round(row["call_mb_s"] / row["stream_mb_s"], 3)
            row["call_vs_tcp"] = round(row["call_mb_s"] / row["tcp_mb_s"], 3)
            result.setdefault("payloads", []).append(row)
    finally:
        if raw_p2p is not None:
            await raw_p2p.shutdown()
        await transport.shutdown()
    return result


def run_transport(kind: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Server and client processes of one transport; the client's figures."""
    script = [sys.executable, __file__, "--transport-kind", kind]
    server = subprocess.Popen(
        [*script, "--serve", "--mb", str(max(sizes) / 1e6)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()  # readiness line (the server's start is bounded)
        if not line:
            raise RuntimeError(f"the {kind} server failed to start")
        client = subprocess.run(
            [*script, "--measure", line.strip(), "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)],
            stdout=subprocess.PIPE, text=True, timeout=1800, check=True,
        )  # fmt: skip
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 MB, 3 repeats (about a minute)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--mb", type=float, default=None, help="one payload size, MB")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--transport-kind", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(args.mb * 1e6)] if args.mb else ([20_000_000] if args.quick else [20_000_000, 100_000_000])
    repeats = args.repeats or (3 if args.quick else 5)
    if args.serve:
        asyncio.run(serve(args.transport_kind, max_request_bytes=int(float(args.mb) * 1e6) + 1))
        return 0
    if args.measure:
        sizes = [int(s) for s in args.sizes.split(",")]
        print(json.dumps(asyncio.run(measure(args.transport_kind, json.loads(args.measure), sizes, repeats))))
        return 0

    kinds = [k for k in args.transports.split(",") if k]
    unknown = sorted(set(kinds) - set(TRANSPORTS))
    if unknown:
        parser.error(f"unknown transport {unknown[0]!r} (choose from {', '.join(TRANSPORTS)})")
    result: dict[str, Any] = {"cpu_count": os.cpu_count(), "transports": {}}
    for kind in kinds:
        try:
            result["transports"][kind] = run_transport(kind, sizes, repeats)
        except (RuntimeError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
            print(f"bench_transport error={kind}_failed: {exc}", file=sys.stderr)
            return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for kind, figures in result["transports"].items():
        for row in figures["payloads"]:
            print(
                f"bench_transport transport={kind} join_s={figures['join_s']} payload_mb={row['payload_mb']:g} "
                f"call_mb_s={row['call_mb_s']} stream_mb_s={row['stream_mb_s']} tcp_mb_s={row['tcp_mb_s']} "
                f"call_vs_stream={row['call_vs_stream']} call_vs_tcp={row['call_vs_tcp']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
