"""`join --metrics-port`: a real peer process serves Prometheus metrics that scraping reads."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pdiloco.cli.argv import set_args

from .harness import REPO_ROOT, free_port, start_peer_process
from .swarm_util import TINY_RUN, Events, join_args

pytestmark = pytest.mark.timeout(300)


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items: value} of every sample the endpoint serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_a_training_peer_serves_its_metrics() -> None:
    port = free_port()
    peer = Events(
        start_peer_process(
            join_args(flags=["--new-run", "--run", "metricsrun", "--metrics-port", str(port)]),
            ready_timeout_s=180,
        )
    )
    # alone with a quorum of 1, the peer closes its own rounds: a learner and a synchronizer
    peer.wait(lambda e: e.get("event") == "step" and e["step"] >= 10, 120)
    peer.wait(lambda e: e.get("event") == "round_closed", 120)
    metrics = scrape(port)

    info = metrics["p2pdiloco_peer_info"]
    ((labels, one),) = info.items()
    assert (
        one == 1
        and dict(labels)["peer_id"] == peer.peer.peer_id
        and dict(labels)["run"] == "metricsrun"
    )
    steps = metrics["p2pdiloco_inner_steps_total"][()]
    assert steps >= 10
    assert metrics["p2pdiloco_tokens_total"][()] >= steps * 2 * 32  # batch 2 x seq 32 a step
    assert metrics["p2pdiloco_tokens_per_second"][()] > 0
    assert metrics["p2pdiloco_loss"][()] > 0
    assert metrics["p2pdiloco_rounds_contributed_total"][()] >= 1
    assert metrics["p2pdiloco_rounds_closed_total"][()] >= 1
    assert metrics["p2pdiloco_grace_seconds_count"][()] >= 1
    assert metrics["p2pdiloco_updates_applied_total"][()] >= 1
    assert metrics["p2pdiloco_replica_round"][(("fragment", "0"),)] >= 1
    assert metrics["p2pdiloco_replica_hash_agrees"][(("fragment", "0"),)] == 1
    assert metrics["p2pdiloco_sent_bytes_total"][(("kind", "contribution"),)] > 0
    assert metrics["p2pdiloco_events_total"][(("event", "step"),)] >= 1
    assert 1 << 20 < metrics["p2pdiloco_peak_resident_memory_bytes"][()] < 1 << 40

    assert peer.peer.stop(60) == 0  # SIGTERM: the peer leaves cleanly and closes the endpoint
    with pytest.raises(OSError):
        scrape(port)


def test_a_metrics_port_in_use_is_one_error_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sets = set_args(TINY_RUN)
        proc = subprocess.run(
            [sys.executable, "-m", "p2pdiloco", "join", "--new-run", "--metrics-port", str(port), *sets],
            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error:") and f"127.0.0.1:{port}" in last and "--metrics-port" in last
