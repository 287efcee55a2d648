"""Metrics: events in, Prometheus samples out; the endpoint serves the text format."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pdiloco.cli.main import build_parser
from p2pdiloco.cli.options import config_from_args
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError, NetworkSetupError
from p2pdiloco.events import EventSink
from p2pdiloco.peer.metrics import (
    MetricsServer,
    PeerMetrics,
    Totals,
    reason_label,
    resident_memory_bytes,
    token_label,
)

ME = "12D3KooWMe"


def a_peers_events() -> list[dict]:
    """What a learner that also closed one round as synchronizer emits, in order."""
    return [
        {"ready": True, "peer_id": ME, "maddrs": []},
        {"event": "joined", "rounds": [0, 0], "hashes": ["a", "b"]},
        {"event": "step", "step": 10, "loss": 4.5, "rounds": [0, 0]},
        {"event": "shipped", "fragment": 0, "round": 0, "base_round": 0, "tokens": 640, "steps": 10},
        {"event": "shipped", "fragment": 1, "round": 2, "base_round": 1, "tokens": 640, "steps": 10},
        {"event": "rejected", "peer": "X", "round": 0, "fragment": 0,
         "reason": "delta norm 12.5 is above 3.1 (refuse bound, from history)"},
        {"event": "rejected", "peer": "Y", "round": 0, "fragment": 0,
         "reason": "base round 0 is 5 rounds stale (max 4)"},
        {"event": "round_closed", "round": 0, "fragment": 0, "contributors": [ME, "Z"],
         "weights": [0.25, 0.75], "tokens": [640, 1920], "steps": [10, 30], "staleness": [0, 2],
         "refused": ["X", "Y"], "holders": ["Z"], "grace_s": 1.5, "hash": "h", "clip_norm": 1.0},
        {"event": "applied", "fragment": 0, "round": 0, "hash": "h"},
        {"event": "contributed", "fragment": 0, "round": 0, "status": "merged", "weight": 0.25,
         "synchronizer": ME, "reason": ""},
        {"event": "delta_merged", "fragment": 0, "round": 0, "tokens": 640, "steps": 10,
         "first_step": 1, "last_step": 10, "weight": 0.25},
        {"event": "contributed", "fragment": 1, "round": 2, "status": "rejected", "weight": 0.0,
         "synchronizer": "Z", "reason": "cosine -0.5 with the outer momentum is below -0.05"},
        {"event": "steps_lost", "fragment": 1, "steps": 10, "tokens": 640, "first_step": 1,
         "last_step": 10, "reason": "refused: cosine -0.5 with the outer momentum is below -0.05"},
        {"event": "contributed", "fragment": 0, "round": 1, "status": "no_quorum", "weight": 0.0,
         "synchronizer": "Z", "reason": "too few acceptable deltas"},
        {"event": "delta_folded", "fragment": 0, "round": 1, "tokens": 320, "steps": 5, "reason": "no_quorum"},
        {"event": "repair", "fragment": 1},
        {"event": "eval", "rounds": [1, 3], "eval_loss": 3.25, "step": 20},
    ]  # fmt: skip


def test_events_become_counters_and_gauges() -> None:
    metrics = PeerMetrics(run="testrun")
    for event in a_peers_events():
        metrics.on_event(event)
    value = metrics.registry.get_sample_value

    assert value("p2pdiloco_peer_info", {"peer_id": ME, "run": "testrun", "version": "0.1.0"}) == 1
    assert value("p2pdiloco_loss") == 4.5
    assert value("p2pdiloco_eval_loss") == 3.25
    # this learner
    assert value("p2pdiloco_rounds_contributed_total") == 2
    assert value("p2pdiloco_rounds_merged_total") == 1
    assert value("p2pdiloco_merged_steps_total") == 10
    assert value("p2pdiloco_merged_tokens_total") == 640
    assert value("p2pdiloco_weight_share") == 0.25
    assert value("p2pdiloco_contributions_total", {"status": "merged"}) == 1
    assert value("p2pdiloco_contributions_total", {"status": "rejected"}) == 1
    assert value("p2pdiloco_contributions_total", {"status": "no_quorum"}) == 1
    assert value("p2pdiloco_lost_steps_total", {"reason": "refused"}) == 10
    assert value("p2pdiloco_folded_steps_total", {"reason": "no_quorum"}) == 5
    own = {"role": "learner"}
    assert value("p2pdiloco_merged_staleness_rounds_count", own) == 1
    assert value("p2pdiloco_merged_staleness_rounds_sum", own) == 0
    # as synchronizer
    assert value("p2pdiloco_rounds_closed_total") == 1
    assert value("p2pdiloco_grace_seconds_sum") == 1.5
    assert value("p2pdiloco_grace_seconds_bucket", {"le": "1.0"}) == 0
    assert value("p2pdiloco_grace_seconds_bucket", {"le": "2.0"}) == 1
    assert value("p2pdiloco_round_contributors_sum") == 2
    theirs = {"role": "synchronizer"}
    assert value("p2pdiloco_merged_staleness_rounds_count", theirs) == 2
    assert value("p2pdiloco_merged_staleness_rounds_sum", theirs) == 2
    assert value("p2pdiloco_rejected_contributions_total", {"reason": "norm"}) == 1
    assert value("p2pdiloco_rejected_contributions_total", {"reason": "stale"}) == 1
    # the replica: rounds from the last report of each fragment, the hash agreement
    assert value("p2pdiloco_replica_round", {"fragment": "0"}) == 1
    assert value("p2pdiloco_replica_round", {"fragment": "1"}) == 3
    assert value("p2pdiloco_updates_applied_total") == 1
    assert value("p2pdiloco_replica_hash_agrees", {"fragment": "0"}) == 1
    assert value("p2pdiloco_replica_hash_agrees", {"fragment": "1"}) == 0
    assert value("p2pdiloco_replica_repairs_total") == 1
    assert value("p2pdiloco_events_total", {"event": "contributed"}) == 3


def test_a_merge_decided_before_its_answer_keeps_the_last_known_weight() -> None:
    metrics = PeerMetrics()
    metrics.on_event(
        {"event": "contributed", "fragment": 0, "round": 0, "status": "merged", "weight": 0.5}
    )
    metrics.on_event(
        {
            "event": "delta_merged",
            "fragment": 0,
            "round": 0,
            "tokens": 64,
            "steps": 1,
            "weight": 0.5,
        }
    )
    # the take-over decided round 1 before the synchronizer's answer: no weight known
    metrics.on_event(
        {
            "event": "delta_merged",
            "fragment": 0,
            "round": 1,
            "tokens": 64,
            "steps": 1,
            "weight": 0.0,
        }
    )
    assert metrics.registry.get_sample_value("p2pdiloco_weight_share") == 0.5
    assert metrics.registry.get_sample_value("p2pdiloco_rounds_merged_total") == 2


def test_a_verified_download_restores_hash_agreement() -> None:
    metrics = PeerMetrics()
    metrics.on_event({"event": "diverged", "fragment": 2, "round": 7})
    assert (
        metrics.registry.get_sample_value("p2pdiloco_replica_hash_agrees", {"fragment": "2"}) == 0
    )
    assert metrics.registry.get_sample_value("p2pdiloco_replica_diverged_total") == 1
    metrics.on_event({"event": "downloaded", "fragment": 2, "round": 9, "donor": "D", "hash": "h"})
    assert (
        metrics.registry.get_sample_value("p2pdiloco_replica_hash_agrees", {"fragment": "2"}) == 1
    )
    assert metrics.registry.get_sample_value("p2pdiloco_replica_round", {"fragment": "2"}) == 9


def test_malformed_events_are_skipped_not_raised() -> None:
    metrics = PeerMetrics()
    for event in [
        {"event": "step"},
        {"event": "round_closed", "grace_s": "soon"},
        {"event": "delta_merged", "steps": None},
        {"event": 3},
        {"event": "Weird Name!"},
        {},
    ]:
        metrics.on_event(event)
    assert metrics.registry.get_sample_value("p2pdiloco_events_total", {"event": "other"}) == 1
    assert (
        metrics.registry.get_sample_value("p2pdiloco_rounds_closed_total") == 1
    )  # counted before the bad grace


def test_two_peers_in_one_process_keep_separate_registries() -> None:
    first, second = PeerMetrics(), PeerMetrics()
    first.on_event({"event": "shipped", "fragment": 0, "round": 0, "base_round": 0})
    assert first.registry.get_sample_value("p2pdiloco_rounds_contributed_total") == 1
    assert second.registry.get_sample_value("p2pdiloco_rounds_contributed_total") == 0


def test_totals_are_read_at_each_scrape() -> None:
    totals = Totals(inner_steps=0)
    metrics = PeerMetrics(totals=lambda: totals)
    value = metrics.registry.get_sample_value
    assert value("p2pdiloco_inner_steps_total") == 0
    totals = Totals(
        inner_steps=42, tokens=2688, tokens_per_s=512.5,
        sent_bytes={"contribution": 1000}, received_bytes={"reply": 30, "replica": 7000},
    )  # fmt: skip
    assert value("p2pdiloco_inner_steps_total") == 42
    assert value("p2pdiloco_tokens_total") == 2688
    assert value("p2pdiloco_tokens_per_second") == 512.5
    assert value("p2pdiloco_sent_bytes_total", {"kind": "contribution"}) == 1000
    assert value("p2pdiloco_received_bytes_total", {"kind": "replica"}) == 7000
    assert value("p2pdiloco_peak_resident_memory_bytes") > 1 << 20


def test_unreadable_totals_leave_the_other_metrics_served() -> None:
    def broken() -> Totals:
        raise RuntimeError("parts are being rebuilt")

    metrics = PeerMetrics(totals=broken)
    assert metrics.registry.get_sample_value("p2pdiloco_inner_steps_total") is None
    assert metrics.registry.get_sample_value("p2pdiloco_peak_resident_memory_bytes") > 0
    assert metrics.registry.get_sample_value("p2pdiloco_rounds_closed_total") == 0


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("delta norm 1.2e+03 is above 40.1 (refuse bound, from history)", "norm"),
        ("delta norm is not finite", "non_finite"),
        ("delta is zero", "zero"),
        ("cosine -0.210 with the other deltas is below 0.05", "direction"),
        ("base round 3 is 9 rounds stale (max 4)", "stale"),
        ("base round 9 is ahead of the current round 3", "stale"),
        ("learner not admitted: no certificate", "not_admitted"),
        ("contribution not signed by its sender: bad signature", "signature"),
        ("contribution claims no work", "claim"),
        ("already contributed to this window", "duplicate"),
        ("tensor w has shape (3,), expected (4,)", "malformed"),
        ("step_time_s must be a finite number >= 0", "malformed"),
        ("something new", "other"),
    ],
)
def test_refusal_reasons_fall_into_a_fixed_set(reason: str, label: str) -> None:
    assert reason_label(reason) == label


def test_code_defined_reasons_become_tokens() -> None:
    assert token_label("refused: cosine -0.5 is below -0.05") == "refused"
    assert token_label("not in the record") == "not_in_the_record"
    assert token_label("rival_record") == "rival_record"
    assert token_label("") == "none"
    assert len(token_label("x" * 500)) == 32


def test_event_sink_feeds_listeners_even_when_not_printing() -> None:
    seen: list[dict] = []

    def broken(event: dict) -> None:
        raise RuntimeError("a buggy observer")

    sink = EventSink(enabled=False)
    sink.listeners += [broken, seen.append]
    step = {"event": "step", "step": 10, "loss": 2.5, "rounds": [1]}
    sink(step)  # the broken listener does not stop the next one
    assert seen == [step]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def test_server_serves_the_text_format_on_an_ephemeral_port() -> None:
    metrics = PeerMetrics(run="testrun", totals=lambda: Totals(inner_steps=7))
    metrics.on_event(
        {"event": "round_closed", "contributors": ["A"], "grace_s": 0.0, "staleness": [0]}
    )
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    port = server.start()
    try:
        assert port > 0 and server.port == port
        families = {f.name: f for f in text_string_to_metric_families(scrape(port))}
        assert families["p2pdiloco_rounds_closed"].samples[0].value == 1
        assert families["p2pdiloco_inner_steps"].samples[0].value == 7
        assert families["p2pdiloco_grace_seconds"].type == "histogram"
    finally:
        server.shutdown()
    server.shutdown()  # idempotent
    with pytest.raises(OSError):
        scrape(port)


def test_a_port_in_use_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(NetworkSetupError) as info:
            MetricsServer(PeerMetrics().registry, "127.0.0.1", port).start()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "--metrics-port" in message and "\n" not in message


def test_metrics_flags_are_shorthands_for_set_peer() -> None:
    args = build_parser().parse_args(
        ["join", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"]
    )
    peer = config_from_args(args).peer
    assert (peer.metrics_port, peer.metrics_host) == (9100, "0.0.0.0")
    assert load_config(None).peer.metrics_port == 0  # off by default
    with pytest.raises(ConfigError, match=r"peer.metrics_port must be in \[0, 65535\]"):
        load_config(None, ["peer.metrics_port=70000"])
    with pytest.raises(ConfigError, match="peer.metrics_host must not be empty"):
        load_config(None, ["peer.metrics_host=''"])


DOCS = Path(__file__).resolve().parents[1] / "docs"


def served_names() -> set[str]:
    """The names of every metric a peer serves, as a scrape shows them (counters with
    `_total`, the info with `_info`; a histogram by its base name)."""
    metrics = PeerMetrics(totals=lambda: Totals(sent_bytes={"contribution": 1}))
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in metrics.registry.collect()}


def test_every_metric_is_documented_and_every_documented_one_served() -> None:
    section = (DOCS / "operate.md").read_text().split("### Metrics (Prometheus)", 1)[1]
    section = section.split("\n#", 1)[0]  # up to the next heading
    table = [line for line in section.splitlines() if line.startswith("| `p2pdiloco_")]
    documented = {name for line in table for name in re.findall(r"`(p2pdiloco_[a-z_]+)`", line)}
    served = served_names()
    if resident_memory_bytes() is None:  # without psutil (libp2p's multiaddr brings it)
        served.add("p2pdiloco_resident_memory_bytes")
    assert documented == served


def test_the_grafana_dashboard_plots_served_metrics() -> None:
    dashboard = json.loads((DOCS / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"p2pdiloco_[a-z_]+", e)
    }
    assert used and used <= served_names(), used - served_names()
    assert len(used) >= 20  # it shows most of them
