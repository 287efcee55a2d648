"""An operator's view of a certified run: a bootstrap node that announces the address it is
told (a cloud VM's public IP, not its private one), and `status` reading the run's manifest
(its admission, quorum and fragments) instead of the default run config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .harness import free_port, write_identity
from .swarm_util import start_bootstrap

pytestmark = pytest.mark.timeout(180)


def p2pdiloco(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pdiloco", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bootstrap_announces_its_address_and_status_applies_the_manifest(tmp_path) -> None:
    env = {**os.environ, "P2PDILOCO_HOME": str(tmp_path / "home")}
    manifest = tmp_path / "opsrun.toml"
    sets = [
        "--set",
        "sync.num_fragments=2",
        "--set",
        "sync.min_quorum=2",
        "--set",
        "model.preset='tiny'",
    ]
    made = p2pdiloco(
        "run",
        "init",
        "opsrun",
        "--operator-key",
        str(tmp_path / "op.key"),
        "--out",
        str(manifest),
        *sets,
        env=env,
    )
    assert made.returncode == 0, made.stderr

    port, key = free_port(), tmp_path / "boot.key"
    peer_id = write_identity(key)
    # what a VM behind a cloud NAT would announce: here 127.0.0.1 on the port it listens on
    announced = f"/ip4/127.0.0.1/tcp/{port}"
    boot = start_bootstrap(
        "--manifest",
        str(manifest),
        "--identity",
        str(key),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--announce-maddr",
        announced,
    )
    assert boot.maddrs == [f"{announced}/p2p/{peer_id}"], boot.maddrs

    shown = p2pdiloco(
        "status", "--json", "--manifest", str(manifest), "--initial-peers", *boot.maddrs, env=env
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    status = json.loads(shown.stdout)
    assert (
        status["run"] == "opsrun"
        and status["admission"] == "synchronizers certified, learners open"
    )
    assert (
        status["min_quorum"] == 2 and len(status["rounds"]) == 2
    )  # the manifest's K and fragments
    bad = p2pdiloco("bootstrap", "--announce-maddr", "/ip4/203.0.113.7/tcp/0", env=env)
    assert bad.returncode == 2 and "explicit port" in bad.stderr.strip().splitlines()[-1]
