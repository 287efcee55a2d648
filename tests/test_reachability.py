"""The dial-back RPC (`transport.dialback`) and the auto-client decision
(`peer.reachability`), on the in-memory transport: no network, no processes.

A NAT is `MemoryNetwork.behind_nat`: fresh connections to the peer fail, calls it makes
still work. The networked version, with a real router in network namespaces, is
tests/net/test_nat.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from p2pdiloco.config import PeerConfig, RunConfig
from p2pdiloco.peer.reachability import (
    Answer,
    check_reachability,
    decide,
    listen_warning,
    peers_to_ask,
    reach_finding,
    settle_reachability,
)
from p2pdiloco.transport.dialback import (
    DIAL_BACK,
    MAX_DIALS,
    DialBackService,
    decode_answer,
    decode_request,
    dialable,
    encode_answer,
    encode_request,
    libp2p_public,
    serve_dial_back,
)
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport

A = "12D3KooWCallerCallerCallerCallerCallerCallerCall"
B = "12D3KooWOtherOtherOtherOtherOtherOtherOtherOther"


def maddr(peer_id: str) -> str:
    return f"/memory/{peer_id}/p2p/{peer_id}"


class CountingTransport(MemoryTransport):
    """A memory peer that counts the fresh dials it makes (a refused address costs none)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dials: list[list[str]] = []

    async def dial_fresh(self, peer_id: str, maddrs: list[str], timeout_s: float) -> str:
        self.dials.append(list(maddrs))
        return await super().dial_fresh(peer_id, maddrs, timeout_s)


async def swarm(num_helpers: int = 1, **service_options):
    """A network, `num_helpers` peers answering dial-backs, and one peer to check."""
    network = MemoryNetwork()
    helpers = [CountingTransport(network) for _ in range(num_helpers)]
    services = []
    for helper in helpers:
        await helper.start()
        service = DialBackService(helper, **service_options)
        await helper.register_handler(DIAL_BACK, service.handle, max_request_bytes=4096)
        services.append(service)
    me = MemoryTransport(network)
    await me.start()
    return network, helpers, services, me


def ask_raw(me: MemoryTransport, helper: MemoryTransport, maddrs: list[str]):
    return me.call(helper.peer_id, DIAL_BACK, encode_request(maddrs), timeout_s=30)


# --- which addresses are dialled ----------------------------------------------------------


def test_only_the_callers_own_direct_addresses_on_its_own_ip_are_dialled() -> None:
    observed = ["/ip4/203.0.113.7/tcp/40123"]
    mine = f"/ip4/203.0.113.7/tcp/4001/p2p/{A}"
    requested = [
        mine,
        f"/ip4/198.51.100.9/tcp/80/p2p/{A}",  # a victim's host with the caller's id
        f"/ip4/203.0.113.7/tcp/4002/p2p/{B}",  # another peer's id
        f"/ip4/203.0.113.7/tcp/4003/p2p/{B}/p2p-circuit/p2p/{A}",  # a relay circuit
        f"/dns4/victim.example/tcp/443/p2p/{A}",  # a name could point anywhere
        f"/ip4/203.0.113.7/tcp/0/p2p/{A}",  # no port
        "garbage",
    ]
    assert dialable(A, requested, observed) == ([mine], "")


def test_a_peer_behind_nat_is_told_where_its_connection_comes_from() -> None:
    targets, reason = dialable(
        A, [f"/ip4/192.168.1.20/tcp/4001/p2p/{A}"], ["/ip4/203.0.113.7/tcp/5"]
    )
    assert targets == [] and "192.168.1.20" in reason and "203.0.113.7" in reason


def test_foreign_and_indirect_addresses_are_named_in_the_refusal() -> None:
    assert "peer id" in dialable(A, [f"/ip4/203.0.113.7/tcp/1/p2p/{B}"], ["/ip4/203.0.113.7"])[1]
    relayed = f"/ip4/203.0.113.7/tcp/1/p2p/{B}/p2p-circuit/p2p/{A}"
    assert "peer id" in dialable(A, [relayed], ["/ip4/203.0.113.7"])[1]
    assert "direct" in dialable(A, [f"/dns4/x.example/tcp/1/p2p/{A}"], ["/ip4/203.0.113.7"])[1]


def test_at_most_a_few_addresses_are_dialled_and_ipv6_is_compared_as_an_address() -> None:
    many = [f"/ip4/203.0.113.7/tcp/{4000 + i}/p2p/{A}" for i in range(20)]
    assert dialable(A, many, ["/ip4/203.0.113.7/tcp/9"])[0] == many[:MAX_DIALS]
    v6 = f"/ip6/2001:db8::1/tcp/4001/p2p/{A}"
    assert dialable(A, [v6], ["/ip6/2001:0db8:0:0::1/tcp/5"])[0] == [v6]


def test_bad_requests_and_answers_raise_value_errors_only() -> None:
    for raw in (b"\xc1", msgpack.packb([1, 2, 3]), encode_request(["/a"])[:-1]):
        with pytest.raises(ValueError):
            decode_request(raw)
    for raw in (b"", encode_answer(True, "x")[:-1], msgpack.packb({"reachable": "yes"})):
        with pytest.raises(ValueError):
            decode_answer(raw)
    assert decode_request(encode_request(["/a"] * 100)) == ["/a"] * 8
    assert decode_request(msgpack.packb({"maddrs": ["/ok", 7, "x" * 1000]})) == ["/ok"]


# --- the service ----------------------------------------------------------------------------


def test_a_reachable_peer_hears_yes_and_one_behind_nat_hears_no() -> None:
    async def go():
        network, (helper,), _, me = await swarm()
        yes = decode_answer(await ask_raw(me, helper, [maddr(me.peer_id)]))
        network.behind_nat.add(me.peer_id)
        no = decode_answer(await ask_raw(me, helper, [maddr(me.peer_id)]))
        return yes, no

    (yes, why_yes), (no, why_no) = asyncio.run(go())
    assert yes is True and "dialled" in why_yes
    assert no is False and "refused" in why_no


def test_foreign_addresses_are_refused_without_dialling() -> None:
    async def go():
        network, (helper,), _, me = await swarm()
        other = MemoryTransport(network)
        await other.start()
        answer = decode_answer(await ask_raw(me, helper, [maddr(other.peer_id)]))
        return answer, helper.dials

    (reachable, reason), dials = asyncio.run(go())
    assert reachable is False and "peer id" in reason
    assert dials == [], "a foreign address was dialled"


def test_a_caller_is_rate_limited_and_so_is_everyone_together() -> None:
    now = [1000.0]

    async def go():
        _, (helper,), (service,), me = await swarm(clock=lambda: now[0])
        request = encode_request([maddr(me.peer_id)])
        mine = [decode_answer(await service.handle(me.peer_id, request))[0] for _ in range(3)]
        now[0] += 31.0  # a token comes back
        later = decode_answer(await service.handle(me.peer_id, request))[0]
        # free identities: each is allowed once, the whole service only so often
        others = [decode_answer(await service.handle(f"sybil{i}", request)) for i in range(12)]
        return mine, later, others, helper.dials

    mine, later, others, dials = asyncio.run(go())
    assert mine == [True, True, None] and later is True
    assert len(dials) == 3, "a rate-limited request dialled"
    assert sum("busy" in reason for _, reason in others) >= 12 - 8


def test_a_dial_back_is_bounded_in_time() -> None:
    async def go():
        network, (helper,), _, me = await swarm(dial_s=0.3)
        network.suspend(me.peer_id)  # frozen: a fresh connection to it never completes
        started = time.monotonic()
        answer = await ask_raw(me, helper, [maddr(me.peer_id)])
        return decode_answer(answer), time.monotonic() - started

    (reachable, reason), elapsed = asyncio.run(go())
    # a dial that cannot finish says nothing about the caller: no verdict, in bounded time
    assert reachable is None and "within 0.3 s" in reason
    assert elapsed < 5


def test_waiting_for_a_dial_slot_is_bounded() -> None:
    async def go():
        network, (helper,), (service,), me = await swarm(dial_s=1.0, queue_s=0.2, max_concurrent=1)
        network.suspend(me.peer_id)
        request = encode_request([maddr(me.peer_id)])
        other = MemoryTransport(network)
        await other.start()
        network.suspend(other.peer_id)
        answers = await asyncio.gather(
            service.handle(me.peer_id, request),
            service.handle(other.peer_id, encode_request([maddr(other.peer_id)])),
        )
        return [decode_answer(a) for a in answers]

    answers = asyncio.run(go())
    assert [a[0] for a in answers] == [None, None]
    assert "within 1 s" in answers[0][1] and "no dial slot" in answers[1][1]


def test_garbage_is_an_answer_not_a_crash() -> None:
    async def go():
        _, (helper,), (service,), me = await swarm()
        return [
            decode_answer(await service.handle(me.peer_id, raw))
            for raw in (b"\xff\xfe", b"\x91\x01")
        ]

    for reachable, reason in asyncio.run(go()):
        assert reachable is None and reason.startswith("bad request")


# --- the decision ---------------------------------------------------------------------------


def test_one_yes_is_enough_a_no_without_yes_is_unreachable_silence_is_the_default() -> None:
    yes, no, silent = (
        Answer("p1", True, "ok"),
        Answer("p2", False, "nat"),
        Answer("p3", None, "busy"),
    )
    assert decide([no, yes, silent]).reachable
    verdict = decide([no, silent])
    assert not verdict.reachable and "nat" in verdict.reason
    assert decide([silent]).reachable and not decide([silent]).checked
    assert decide([]).reachable and "no other peer" in decide([]).reason


def config(**peer) -> RunConfig:
    return RunConfig(peer=PeerConfig(**peer))


def settle(network_setup, **peer):
    """Settle a peer's mode on a memory network with one dial-back helper."""

    async def go():
        network, (helper,), _, me = await swarm()
        network_setup(network, me)
        events: list[dict] = []
        initial = (maddr(helper.peer_id),)
        settled = await settle_reachability(
            config(initial_peers=initial, **peer), me, events.append
        )
        return settled.peer, me.client_mode, events, helper.dials

    return asyncio.run(go())


def test_a_peer_behind_nat_becomes_a_client_learner_by_itself() -> None:
    peer, transport_client, events, _ = settle(lambda net, me: net.behind_nat.add(me.peer_id))
    assert peer.client_mode and transport_client
    assert events[-1]["client_mode"] and not events[-1]["reachable"]


def test_a_reachable_peer_stays_a_server() -> None:
    peer, transport_client, events, dials = settle(lambda net, me: None)
    assert not peer.client_mode and not transport_client
    assert events[-1]["reachable"] and len(dials) == 1


def test_public_and_client_are_obeyed_without_asking() -> None:
    behind = lambda net, me: net.behind_nat.add(me.peer_id)  # noqa: E731
    peer, transport_client, events, dials = settle(behind, reachability="public")
    assert not peer.client_mode and not transport_client and dials == []
    for forced in ({"reachability": "client"}, {"client_mode": True}):
        peer, _, events, dials = settle(lambda net, me: None, **forced)
        assert peer.client_mode and dials == [] and events[-1]["mode"] == "client"


def test_the_first_peer_and_silent_peers_leave_it_a_server() -> None:
    async def go():
        network = MemoryNetwork()
        me, mute = MemoryTransport(network), MemoryTransport(network)  # mute: no handler
        await me.start()
        await mute.start()
        network.behind_nat.add(me.peer_id)
        alone = await settle_reachability(config(), me)
        asked = await check_reachability(me, [mute.peer_id])
        return alone.peer, asked

    alone, asked = asyncio.run(go())
    assert not alone.client_mode
    assert asked.reachable and not asked.checked and "unverified" in asked.reason
    assert reach_finding(asked).level == "skip"


def test_peers_to_ask_are_the_initial_ones_never_itself() -> None:
    class Fake:
        peer_id = "me"
        initial_peers = ["/ip4/1.2.3.4/tcp/1/p2p/a", "/ip4/1.2.3.4/tcp/1/p2p/me"]
        initial_peers += [f"/ip4/1.2.3.{i}/tcp/1/p2p/p{i}" for i in range(5)]

    assert peers_to_ask(Fake(), []) == ["a", "p0", "p1"]


def test_serve_dial_back_registers_the_rpc() -> None:
    async def go():
        network = MemoryNetwork()
        helper = MemoryTransport(network)
        await helper.start()
        await serve_dial_back(helper)
        me = MemoryTransport(network)
        await me.start()
        return await check_reachability(me, [helper.peer_id])

    verdict = asyncio.run(go())
    assert verdict.reachable and verdict.checked
    assert reach_finding(verdict).level == "ok"


def test_loopback_listener_with_remote_initial_peers_is_warned() -> None:
    remote = ["/ip4/203.0.113.5/tcp/31337/p2p/a"]
    warning = listen_warning("127.0.0.1", remote)
    assert warning is not None and warning.level == "warn" and "0.0.0.0" in warning.advice
    assert listen_warning("127.0.0.1", ["/ip4/127.0.0.1/tcp/1/p2p/a"]) is None
    assert listen_warning("0.0.0.0", remote) is None
    assert listen_warning("localhost", ["/dns4/boot.example/tcp/1/p2p/a"]) is not None


@pytest.mark.skipif(importlib.util.find_spec("hivemind") is None, reason="hivemind not installed")
def test_relay_options_reach_hivemind_and_a_relay_slot_only_in_client_mode_and_relaying_only_when_known_public() -> None:
    # in a child: hivemind and py-libp2p cannot share this process (docs/transport.md)
    code = (
        "import json\n"
        "from p2pdiloco.transport import make_transport\n"
        "seen = {}\n"
        "for client in (False, True):\n"
        "    for relay in (False, True):\n"
        "        for service in (False, True):\n"
        "            t = make_transport('hivemind', initial_peers=[], client_mode=client, use_relay=relay,\n"
        "                               relay_service=service)\n"
        "            o = t._dht_options(5.0)\n"
        "            seen[f'{client}/{relay}/{service}'] = [\n"
        "                o['use_relay'], o['use_auto_relay'], o['client_mode'], o.get('force_reachability')]\n"
        "print(json.dumps(seen))\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # a bootstrap node (relay_service) relays at once; a client takes its relay slot at once
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "False/False/False": [False, False, False, None],
        "False/False/True": [False, False, False, None],
        "False/True/False": [True, False, False, None],
        "False/True/True": [True, False, False, "public"],
        "True/False/False": [False, True, True, None],
        "True/False/True": [False, True, True, None],
        "True/True/False": [True, True, True, "private"],
        "True/True/True": [True, True, True, "private"],
    }


@pytest.mark.parametrize(
    ("maddr", "public"),
    [
        ("/ip4/8.8.8.8/tcp/4001/p2p/12D3KooWx", True),
        ("/dns4/boot.example.org/tcp/4001", True),
        ("/ip6/2a00:1450::1/tcp/4001", True),
        ("/ip4/192.0.0.74/tcp/4001", True),  # the NAT lab's public LAN: public to go-libp2p
        ("/ip4/192.0.0.10/tcp/4001", False),  # 192.0.0.0/26: unroutable
        ("/ip4/127.0.0.1/tcp/4001", False),
        ("/ip4/10.1.2.3/tcp/4001", False),
        ("/ip4/100.64.0.1/tcp/4001", False),  # carrier-grade NAT
        ("/ip4/198.18.0.1/tcp/4001", False),
        ("/ip6/::1/tcp/4001", False),
        ("/ip6/fd00::1/tcp/4001", False),
        ("/memory/peer", False),
        ("garbage", False),
    ],
)
def test_which_addresses_go_libp2p_counts_public(maddr: str, public: bool) -> None:
    """p2pd announces a relayed address only through a relay it counts public: the relay
    slot watch reads announced circuits only when an initial peer is one."""
    assert libp2p_public(maddr) is public
