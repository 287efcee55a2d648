"""Reach a peer through a relay circuit only, from a fresh libp2p daemon (run by test_nat).

    python relay_probe.py HOST_IP RELAY_MADDR TARGET_PEER_ID TIMEOUT_S

Dials `RELAY_MADDR/p2p-circuit/p2p/TARGET`, the one address that goes through the relay,
until a connection opens (the libp2p handshake proves the target's key) or the timeout
passes, and prints one JSON line: {"reached": bool, "tries": n, "errors": [...]}. Each try
starts a new daemon: libp2p backs off from an address that failed once, and the target
takes its relay slot some seconds after it starts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

TRY_S = 15.0


async def try_once(host_ip: str, relay: str, target: str) -> str:
    """"" when a connection to `target` opened through the relay, else why not."""
    from hivemind.p2p import P2P, PeerID
    from multiaddr import Multiaddr

    p2p = await P2P.create(
        initial_peers=[relay], dht_mode="client", host_maddrs=[f"/ip4/{host_ip}/tcp/0"],
        use_relay=True, auto_nat=False, nat_port_map=False, startup_timeout=TRY_S,
    )  # fmt: skip
    try:
        circuit = Multiaddr(f"{relay}/p2p-circuit/p2p/{target}")
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(target), [circuit]), TRY_S)
        return ""
    except Exception as exc:  # noqa: BLE001 - no slot yet, or no relay: reported
        return f"{type(exc).__name__}: {exc}"[:600]
    finally:
        await p2p.shutdown()


async def probe(host_ip: str, relay: str, target: str, timeout_s: float) -> dict:
    deadline, errors = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        error = await try_once(host_ip, relay, target)
        if not error:
            return {"reached": True, "tries": len(errors) + 1, "errors": errors[-2:]}
        errors.append(error)
        await asyncio.sleep(3)
    return {"reached": False, "tries": len(errors), "errors": errors[:1] + errors[-1:]}


if __name__ == "__main__":
    host_ip, relay, target, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    print(json.dumps(asyncio.run(probe(host_ip, relay, target, timeout_s))), flush=True)
