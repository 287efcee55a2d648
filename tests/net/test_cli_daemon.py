"""The commands users touch, run as real processes: demo, join from a bootstrap file,
status, the dashboard in a real terminal (tmux), and the one-line errors."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from p2pdiloco.cli.argv import child_join_args, set_args

from .harness import REPO_ROOT, free_port
from .swarm_util import TINY_RUN, Events, applied, start_bootstrap, start_peer_processes

pytestmark = pytest.mark.timeout(900)


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pdiloco", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def test_demo_completes_with_falling_loss_and_identical_replicas(tmp_path) -> None:
    out = tmp_path / "demo.json"
    tiny = set_args(
        ["model.seq_len=32", "train.batch_size=2", "data.max_files=60", "sync.inner_steps=10"]
    )
    proc = run_cli(
        "demo",
        "--no-dashboard",
        "--model",
        "tiny",
        "--peers",
        "2",
        "--rounds",
        "3",
        "--json",
        str(out),
        *tiny,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["peers"] == 2 and summary["rounds_completed"] >= 3
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    assert summary["bytes_sent"] > 0 and summary["replicas_identical"]
    assert "held-out loss" in proc.stdout


@pytest.fixture()
def bootstrap_file(tmp_path):
    boot = start_bootstrap()
    path = tmp_path / "testrun.txt"
    path.write_text("# a test run\n" + "\n".join(boot.maddrs) + "\n")
    return path


def test_join_from_a_bootstrap_file_forms_a_swarm_that_status_lists(bootstrap_file) -> None:
    join = child_join_args(
        "--run", "testrun", "--bootstrap-file", str(bootstrap_file),
        sets=[*TINY_RUN, "sync.min_quorum=2"],
    )  # fmt: skip
    peers = start_peer_processes([join, join], ready_timeout_s=240)
    logs = [Events(p) for p in peers]
    for log in logs:
        log.wait(applied(0), 300)
    proc = run_cli(
        "status",
        "--json",
        "--run",
        "testrun",
        "--bootstrap-file",
        str(bootstrap_file),
        *set_args(TINY_RUN),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(proc.stdout)
    listed = {p["peer_id"] for p in status["peers"]}
    assert {p.peer_id for p in peers} <= listed
    assert status["rounds"][0]["round"] >= 0 and status["rounds"][0]["synchronizer"] in listed
    # a peer that disagrees on the run config cannot join silently
    other = run_cli(
        "join",
        "--run",
        "testrun",
        "--bootstrap-file",
        str(bootstrap_file),
        *set_args([*TINY_RUN, "sync.inner_steps=7"]),
    )
    assert other.returncode == 2 and "differs from the run's" in other.stderr.splitlines()[-1], (
        other.stderr[-2000:]
    )


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (CI installs it)")
def test_dashboard_shows_peer_rows_and_rounds_in_a_real_terminal(bootstrap_file) -> None:
    join = child_join_args(
        "--bootstrap-file", str(bootstrap_file), sets=[*TINY_RUN, "sync.min_quorum=2"]
    )
    peers = start_peer_processes([join, join], ready_timeout_s=240)
    for log in [Events(p) for p in peers]:
        log.wait(applied(0), 300)
    session = f"p2pd-{uuid.uuid4().hex[:8]}"
    command = f"cd {REPO_ROOT} && {sys.executable} -m p2pdiloco dashboard --bootstrap-file {bootstrap_file}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", command], check=True
    )
    try:
        deadline = time.monotonic() + 180
        screen = ""
        wanted = [p.peer_id[-6:] for p in peers]
        while time.monotonic() < deadline:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if all(w in screen for w in wanted) and "rounds" in screen:
                break
            time.sleep(1)  # polling the terminal's contents, with a deadline
        assert all(w in screen for w in wanted), screen
        assert "rounds" in screen and "live peers" in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


def test_bad_inputs_each_give_one_line_and_exit_code_2(tmp_path) -> None:
    assert "unknown run" in _one_error_line(run_cli("join", "--run", "no-such-run"))
    bad = tmp_path / "bad.txt"
    bad.write_text("# ok\n/ip4/127.0.0.1/tcp/1\n")
    assert f"{bad}:2" in _one_error_line(run_cli("join", "--bootstrap-file", str(bad)))
    assert "not a valid multiaddr" in _one_error_line(
        run_cli("join", "--initial-peers", "/ip4/nonsense/tcp/1/p2p/x")
    )
    assert "config file" in _one_error_line(
        run_cli("join", "--new-run", "--config", str(tmp_path / "missing.toml"))
    )
    assert "cuda" in _one_error_line(run_cli("join", "--new-run", "--set", "train.device='cuda'"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "already in use" in _one_error_line(
            run_cli("join", "--new-run", "--port", str(port), *set_args(TINY_RUN))
        )
    dead = (
        f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/12D3KooWEKA2Q78SUehS68gSmBu9ARDrqrWQd82a3w8KXMPyEbEp"
    )
    line = _one_error_line(
        run_cli("join", "--startup-timeout-s", "10", "--initial-peers", dead, *set_args(TINY_RUN))
    )
    assert "initial peers" in line


def test_checkpoint_is_saved_on_leaving_and_restored_on_start(tmp_path) -> None:
    from .harness import start_peer_process

    ckpt = tmp_path / "ckpt"
    args = [
        "-m",
        "p2pdiloco",
        "join",
        "--events",
        "--new-run",
        "--threads",
        "1",
        "--log-json",
        "--max-steps",
        "12",
        "--checkpoint-dir",
        str(ckpt),
        *set_args(TINY_RUN),
    ]
    first = Events(start_peer_process(args, ready_timeout_s=240))
    saved = first.wait(lambda e: e.get("event") == "checkpoint_saved", 300)
    assert saved["step"] == 12 and (ckpt / "learner.pt").exists()
    assert first.peer.popen.wait(60) == 0
    second = Events(start_peer_process(args, ready_timeout_s=240))
    second.wait(lambda e: e.get("event") == "checkpoint_saved", 300)
    loaded = [e for e in second.seen if e.get("event") == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == 12
