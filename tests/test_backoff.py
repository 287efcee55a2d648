"""Retry waits: doubling to a cap, jittered so that peers do not retry in lockstep."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from itertools import islice

import pytest

from p2pdiloco.backoff import backoff_delays, within


def test_waits_double_to_the_cap_and_keep_at_least_half() -> None:
    delays = list(islice(backoff_delays(0.5, 4.0, random.Random(0)), 8))
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert sum(delays[:3]) < sum(delays[3:6])


def test_peers_that_failed_together_retry_apart() -> None:
    first_retries = [
        next(islice(backoff_delays(1.0, 8.0, random.Random(seed)), 3, None)) for seed in range(50)
    ]
    assert len({round(d, 3) for d in first_retries}) == 50  # not one instant for everyone
    assert max(first_retries) - min(first_retries) > 1.0


def test_a_wait_ends_by_the_deadline_and_bad_bounds_are_refused() -> None:
    assert within(5.0, deadline=10.0, now=8.0) == 2.0
    assert within(1.0, deadline=10.0, now=11.0) == 0.0
    assert within(1.0, deadline=10.0, now=0.0) == 1.0
    with pytest.raises(ValueError):
        next(backoff_delays(0.0, 1.0))
    with pytest.raises(ValueError):
        next(backoff_delays(2.0, 1.0))


def test_child_processes_are_found_and_a_zombie_is_not_alive() -> None:
    """The hivemind transport reaps its p2pd daemons by these (psutil, not a /proc scan)."""
    from p2pdiloco.transport.hivemind_daemon import child_pids, pid_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid()) and pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # killed but not waited for: a zombie
            if not pid_alive(child.pid):
                break
            import time

            time.sleep(0.01)
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid) and child_pids(2**22 + 12345) == []


def test_a_start_that_reached_no_initial_peer_is_retried_whichever_layer_says_so() -> None:
    """hivemind's DHT node and p2pd's own bootstrap dial word it differently; a peer
    restarting in client mode under load met the second, and was not retried."""
    from p2pdiloco.transport.hivemind_daemon import is_bootstrap_failure

    assert is_bootstrap_failure("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")
    assert is_bootstrap_failure(
        "Daemon failed to start: 2026/12/07 00:52:27 failed to connect to bootstrap peers"
    )
    assert not is_bootstrap_failure("Daemon failed to start: listen tcp4: address already in use")
