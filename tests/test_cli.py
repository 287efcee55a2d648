"""The command line as a user runs it: a real process, one-line errors, exit code 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from p2pdiloco.cli.main import build_parser
from p2pdiloco.cli.options import config_from_args
from p2pdiloco.config import PeerConfig, load_config


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True, timeout=timeout
    )


def test_simulate_writes_json(tmp_path) -> None:
    out = tmp_path / "sim.json"
    proc = run_cli(
        "simulate",
        "--model",
        "tiny",
        "--learners",
        "2",
        "--rounds",
        "2",
        "--inner-steps",
        "5",
        "--set",
        "data.max_files=60",
        "--set",
        "model.seq_len=32",
        "--set",
        "train.batch_size=2",
        "--set",
        "simulate.eval_batches=1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["learners"] == 2 and figures["rounds"] == 2
    assert figures["comm_reduction"] == pytest.approx(5.0)
    assert proc.stdout.strip().splitlines()[-1].startswith("loss_ratio=")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--set", "sync.min_quorum=0"], "sync.min_quorum must be >= 1"),
        (["simulate", "--set", "bogus.x=1"], "unknown config section [bogus]"),
        (["simulate", "--config", "/nonexistent/run.toml"], "does not exist"),
        (
            ["simulate", "--set", "data.source='/nonexistent/corpus'"],
            "data source /nonexistent/corpus does not exist",
        ),
        (["simulate", "--set", "train.device='cuda'"], "cuda"),
        (["simulate", "--learners", "zero"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
        (["join", "--port", "70000"], "peer.port must be in [0, 65535], got 70000"),
        (["join", "--new-run", "--crash-at", "sometime"], "peer.crash_at"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(args, message) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr


def test_config_prints_effective_toml() -> None:
    proc = run_cli("config", "--set", "sync.inner_steps=33")
    assert proc.returncode == 0
    assert "inner_steps = 33" in proc.stdout


def test_config_prints_the_peer_section_set_with_set() -> None:
    proc = run_cli("config", "--set", "peer.port=4000")
    assert proc.returncode == 0, proc.stderr
    peer_section = proc.stdout.split("[peer]\n", 1)[1]
    assert "port = 4000" in peer_section.split("\n\n", 1)[0]


def _config_of(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_every_peer_field_has_a_join_flag_without_a_default_of_its_own() -> None:
    args = build_parser().parse_args(["join"])
    fields = set(dataclasses.asdict(PeerConfig()))
    assert fields <= set(vars(args)), fields - set(vars(args))
    assert all(getattr(args, name) is None for name in fields)
    assert _config_of("join") == load_config(None)


def test_join_flags_are_shorthands_for_set_peer() -> None:
    maddr = "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWEKA2Q78SUehS68gSmBu9ARDrqrWQd82a3w8KXMPyEbEp"
    by_flags = _config_of(
        "join",
        "--port", "4000",
        "--identity", "/keys/me.key",
        "--threads", "1",
        "--client-mode",
        "--max-rounds", "3",
        "--initial-peers", maddr,
    )  # fmt: skip
    by_sets = _config_of(
        "join",
        "--set", "peer.port=4000",
        "--set", "peer.identity_path='/keys/me.key'",
        "--set", "peer.torch_threads=1",
        "--set", "peer.client_mode=true",
        "--set", "peer.max_rounds=3",
        "--set", f'peer.initial_peers=["{maddr}"]',
    )  # fmt: skip
    assert by_flags == by_sets
    assert by_flags.peer == PeerConfig(
        port=4000,
        identity_path="/keys/me.key",
        torch_threads=1,
        client_mode=True,
        max_rounds=3,
        initial_peers=(maddr,),
    )


def test_a_flag_wins_over_set_and_set_over_the_file(tmp_path) -> None:
    path = tmp_path / "peer.toml"
    path.write_text("[peer]\nport = 1000\nheartbeat_s = 5.0\neval_batches = 7\n")
    config = _config_of(
        "join", "--config", str(path), "--set", "peer.port=2000", "--set", "peer.heartbeat_s=3",
        "--port", "3000",
    )  # fmt: skip
    assert (config.peer.port, config.peer.heartbeat_s, config.peer.eval_batches) == (3000, 3.0, 7)


def test_watchers_and_bootstrap_read_the_same_peer_fields() -> None:
    status = _config_of("status", "--run", "myrun", "--timeout-s", "5")
    assert (status.peer.run, status.peer.startup_timeout_s) == ("myrun", 5.0)
    boot = _config_of("bootstrap", "--port", "31337", "--events")
    assert (boot.peer.port, boot.peer.events) == (31337, True)
