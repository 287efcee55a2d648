"""`p2pdiloco doctor`'s network checks on the in-memory transport, and its command line."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from p2pdiloco.cli.doctor import best_address, network_findings, tcp_problem
from p2pdiloco.cli.main import main
from p2pdiloco.config import PeerConfig
from p2pdiloco.errors import PreflightError
from p2pdiloco.peer import preflight
from p2pdiloco.peer.clock import check_clock_at_join, peer_ids_of
from p2pdiloco.transport.base import AddressInUse, TransportStartError
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport


def memory_maddr(peer_id: str) -> str:
    return f"/memory/{peer_id}/p2p/{peer_id}"


class Swarm:
    """A bootstrap peer on a memory network and a transport factory for the doctor."""

    def __init__(
        self,
        clock_offset_s: float = 0.0,
        start_fails: Exception | None = None,
        dialer_lost: bool = False,
    ) -> None:
        self.network = MemoryNetwork()
        self.bootstrap = MemoryTransport(self.network)
        self.clock_offset_s = clock_offset_s
        self.start_fails = start_fails
        self.dialer_lost = dialer_lost
        self.opened: list[tuple[list[str], bool]] = []

    def open_transport(self, initial: list[str], dialer: bool) -> MemoryTransport:
        self.opened.append((initial, dialer))
        network = MemoryNetwork() if dialer and self.dialer_lost else self.network
        transport = MemoryTransport(
            network, client_mode=dialer, clock_offset_s=0.0 if dialer else self.clock_offset_s
        )
        if self.start_fails is not None and initial and not dialer:
            failure = self.start_fails

            async def start() -> None:
                raise failure

            transport.start = start  # type: ignore[method-assign]
        return transport

    def findings(self, client_mode: bool = False) -> dict[str, preflight.Finding]:
        async def go() -> list[preflight.Finding]:
            await self.bootstrap.start()
            peer = PeerConfig(
                initial_peers=(memory_maddr(self.bootstrap.peer_id),), client_mode=client_mode
            )
            return await network_findings(peer, "memory", self.open_transport, 5.0)

        return {f.check: f for f in asyncio.run(go())}


def test_a_healthy_peer_joins_agrees_on_time_and_is_dialled() -> None:
    swarm = Swarm()
    found = swarm.findings()
    assert [
        found[c].level for c in ("transport", "bootstrap", "clock", "addresses", "reachable")
    ] == ["ok"] * 5
    initial, dialer = swarm.opened[-1]  # a second, dialling transport, at our address
    assert dialer and len(initial) == 1 and initial[0].startswith("/memory/")
    assert initial[0] != memory_maddr(swarm.bootstrap.peer_id)


def test_a_clock_behind_fails_with_the_offset_and_what_to_do() -> None:
    clock = Swarm(clock_offset_s=-12.0).findings()["clock"]
    assert clock.level == "fail" and "12.00 s" in clock.message and "behind" in clock.message
    assert "timedatectl" in clock.advice


def test_a_peer_nobody_can_dial_is_told_so() -> None:
    reachable = Swarm(dialer_lost=True).findings()["reachable"]
    assert reachable.level == "fail" and "--client-mode" in reachable.advice


def test_client_mode_needs_no_dial() -> None:
    found = Swarm().findings(client_mode=True)
    assert found["reachable"].level == "skip" and found["addresses"].level == "ok"


def test_a_run_that_does_not_answer_still_gets_the_local_network_checks() -> None:
    swarm = Swarm(start_fails=TransportStartError("none of the initial peers answered"))
    found = swarm.findings()
    assert found["bootstrap"].level == "fail" and "status --run" in found["bootstrap"].advice
    assert found["clock"].level == "skip" and found["reachable"].level == "ok"
    assert swarm.opened[1] == ([], False)  # retried alone


def test_a_port_in_use_is_one_failed_line() -> None:
    found = Swarm(
        start_fails=AddressInUse("cannot listen on 127.0.0.1:31337: address already in use")
    ).findings()
    assert list(found) == ["port"] and "running already" in found["port"].advice


def test_join_refuses_a_clock_too_far_off_and_warns_a_little_off(caplog) -> None:
    async def at_join(offset_s: float) -> preflight.Finding:
        network = MemoryNetwork()
        other, me = MemoryTransport(network), MemoryTransport(network, clock_offset_s=offset_s)
        await other.start()
        await me.start()
        return await check_clock_at_join(me, [memory_maddr(other.peer_id)])

    with pytest.raises(PreflightError, match="preflight clock: your clock is 20.00 s"):
        asyncio.run(at_join(20.0))
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.cli.doctor"):
        assert asyncio.run(at_join(1.5)).level == "warn"
    assert "NTP" in caplog.text
    assert asyncio.run(at_join(0.0)).level == "ok"


def test_helpers() -> None:
    assert peer_ids_of(
        ["/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/5.6.7.8/tcp/1/p2p/A", "/ip4/1.2.3.4/tcp/2/p2p/B", "junk"]
    ) == ["A", "B"]
    assert (
        best_address(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.0.2/tcp/1", "/ip4/8.8.8.8/tcp/1"])
        == "/ip4/8.8.8.8/tcp/1"
    )
    assert best_address([]) == ""
    assert asyncio.run(tcp_problem("/memory/x")) == ""


def test_tcp_problem_names_a_closed_port() -> None:
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert "refused" in asyncio.run(tcp_problem(f"/ip4/127.0.0.1/tcp/{port}/p2p/X"))


def test_doctor_offline_prints_json_and_exits_by_its_findings(capsys, monkeypatch) -> None:
    assert (
        main(
            [
                "doctor",
                "--offline",
                "--json",
                "--set",
                "model.preset='tiny'",
                "--set",
                "train.device='cpu'",
            ]
        )
        == 0
    )
    checks = json.loads(capsys.readouterr().out)
    assert [c["check"] for c in checks] == ["devices", "memory", "device memory", "disk"]
    monkeypatch.setattr(preflight, "ram_bytes", lambda: (1 << 20, 1 << 20))
    assert main(["doctor", "--offline", "--set", "model.preset='tiny'"]) == 1
    out = capsys.readouterr().out
    assert "fail" in out and "memory" in out and "smaller model preset" in out


def test_join_runs_the_local_checks_before_anything_else(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(preflight, "ram_bytes", lambda: (1 << 20, 1 << 20))
    monkeypatch.chdir(tmp_path)
    code = main(
        ["join", "--new-run", "--set", "model.preset='tiny'", "--set", "train.device='cpu'"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "preflight memory" in err[0] and "--skip-preflight" in err[0]
