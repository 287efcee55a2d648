"""Prometheus metrics of one peer (`join --metrics-port`): an event sink and its HTTP server.

Two inputs feed one `CollectorRegistry` per peer (never prometheus' global one, so one
process may hold several, as tests do):

- the peer's events, the dicts `PeerDaemon.emit` hands out (and `--events` prints):
  `PeerMetrics.on_event` counts them. It is pure: no networking, no clock.
- the learner's running totals (`Totals`: steps, tokens, bytes by kind), read each time
  the endpoint is scraped, so they are current, not as old as the last event.

Labels stay few-valued: fragment, status, kind, role and a coarse reason (`reason_label`);
a peer id only where this peer names itself (`p2pdiloco_peer_info`). Every metric is
listed in docs/operate.md ("Metrics"); docs/grafana_dashboard.json plots them.
"""

from __future__ import annotations

import functools
import logging
import re
import resource
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pdiloco import __version__
from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.wire.messages import NoAnswer, Reply

log = logging.getLogger(__name__)

REJECTION_REASONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("not_admitted", ("not admitted",)),
    ("signature", ("signed", "signature", "certificate")),
    ("stale", ("stale", "ahead of the current round")),
    ("direction", ("cosine",)),
    ("non_finite", ("not finite", "non-finite")),
    ("norm", ("norm",)),
    ("zero", ("is zero",)),
    ("claim", ("claims no work", "tokens", "steps must")),
    ("duplicate", ("already contributed",)),
    ("malformed", (
        "malformed", "undecodable", "unexpected", "expected", "shape", "layout", "tensor",
        "must be", "meta", "codec", "frame", "payload", "header", "no fragment",
        "another peer", "too large",
    )),
)  # fmt: skip
"""Coarse reason of a refused contribution: the first label whose words the text holds,
else `other`. The texts carry numbers (norms, rounds); the labels are this fixed set."""

STATUSES = frozenset({*Reply, *NoAnswer})
"""What became of a contribution (`messages.Outcome.status`); anything else is `other`."""

_TOKEN = re.compile(r"[^a-z0-9]+")


def reason_label(reason: str) -> str:
    """The label of a refusal's free text: one of `REJECTION_REASONS` or `other`."""
    text = reason.lower()
    for label, words in REJECTION_REASONS:
        if any(word in text for word in words):
            return label
    return "other"


def token_label(text: str) -> str:
    """A code-defined reason (`refused: <why>`, `rival_record`, `not in the record`) as a
    label: the text before the first ':', lower-case words joined by '_', at most 32 chars."""
    token = _TOKEN.sub("_", text.split(":", 1)[0].lower()).strip("_")[:32]
    return token or "none"


@dataclass(frozen=True)
class Totals:
    """A learner's running totals, read when the endpoint is scraped."""

    inner_steps: int = 0
    """Inner steps taken (a restored checkpoint's included)."""
    tokens: int = 0
    """Tokens trained on."""
    tokens_per_s: float = 0.0
    """Training speed: tokens a step over the smoothed step time (rest included), tokens/s."""
    sent_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes sent, by kind (`contribution`: the deltas shipped)."""
    received_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes received, by kind (`reply`: synchronizers' answers; `replica`: updates,
    state downloads and audited contributions)."""


def resident_memory_bytes() -> int | None:
    """This process's resident memory now, bytes (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def peak_resident_memory_bytes() -> int:
    """This process's peak resident memory so far, bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class _TotalsCollector(Collector):
    """Yields the totals and the memory figures at each scrape; a failing read yields none."""

    def __init__(self, totals: Callable[[], Totals | None]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        try:
            totals = self.totals()
        except Exception as exc:  # noqa: BLE001 - a scrape never breaks the peer
            log.debug("metrics totals unreadable error=%r", exc)
            totals = None
        if totals is not None:
            yield CounterMetricFamily(
                "p2pdiloco_inner_steps", "Inner steps this learner took.", totals.inner_steps
            )
            yield CounterMetricFamily(
                "p2pdiloco_tokens", "Tokens this learner trained on.", totals.tokens
            )
            yield GaugeMetricFamily(
                "p2pdiloco_tokens_per_second",
                "This learner's training speed, tokens/s.",
                totals.tokens_per_s,
            )
            for name, what, by_kind in (
                ("p2pdiloco_sent_bytes", "Bytes sent, by kind.", totals.sent_bytes),
                ("p2pdiloco_received_bytes", "Bytes received, by kind.", totals.received_bytes),
            ):
                family = CounterMetricFamily(name, what, labels=["kind"])
                for kind, value in sorted(by_kind.items()):
                    family.add_metric([kind], value)
                yield family
        rss = resident_memory_bytes()
        if rss is not None:
            yield GaugeMetricFamily(
                "p2pdiloco_resident_memory_bytes", "Resident memory now, bytes.", rss
            )
        yield GaugeMetricFamily(
            "p2pdiloco_peak_resident_memory_bytes",
            "Peak resident memory so far, bytes.",
            peak_resident_memory_bytes(),
        )


class PeerMetrics:
    """One peer's metrics: `on_event` for each event it emits; `registry` to serve.

    Safe from any thread (prometheus' metrics lock themselves; the one dict here is
    guarded); a malformed event is skipped, never raised into the caller.
    """

    def __init__(
        self,
        run: str = "",
        totals: Callable[[], Totals | None] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.run = run
        if totals is not None:
            r.register(_TotalsCollector(totals))
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        self.peer = Info("p2pdiloco_peer", "This peer: its id, run and version.", registry=r)
        self.peer.info({"peer_id": "", "run": run, "version": __version__})
        self.events = counter("p2pdiloco_events", "Events emitted, by name.", ["event"])
        self._learner_metrics(counter, gauge, r)
        self._synchronizer_metrics(counter, gauge, r)
        self._replica_metrics(counter, gauge, r)
        self._shipped_staleness: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def _learner_metrics(self, counter: Callable, gauge: Callable, r: CollectorRegistry) -> None:
        """This learner: losses, its deltas and their fates, its weight and staleness."""
        self.loss = gauge("p2pdiloco_loss", "Training loss of the last logged inner step.")
        self.eval_loss = gauge("p2pdiloco_eval_loss", "Held-out loss of the global model.")
        self.rounds_contributed = counter(
            "p2pdiloco_rounds_contributed", "Deltas shipped (one a round and fragment)."
        )
        self.contributions = counter(
            "p2pdiloco_contributions", "Answers to this learner's deltas, by status.", ["status"]
        )
        self.rounds_merged = counter(
            "p2pdiloco_rounds_merged", "This learner's deltas a committed round merged."
        )
        self.merged_steps = counter("p2pdiloco_merged_steps", "Steps carried by merged deltas.")
        self.merged_tokens = counter("p2pdiloco_merged_tokens", "Tokens carried by merged deltas.")
        self.unmerged_steps = counter(
            "p2pdiloco_unmerged_steps", "Steps of merged deltas a rival round record took back."
        )
        self.folded_steps = counter(
            "p2pdiloco_folded_steps", "Steps folded into the next delta, by reason.", ["reason"]
        )
        self.lost_steps = counter(
            "p2pdiloco_lost_steps", "Steps no update will carry, by reason.", ["reason"]
        )
        self.weight_share = gauge(
            "p2pdiloco_weight_share", "Merge weight (share of 1) of our last merged delta."
        )
        self.staleness = Histogram(
            "p2pdiloco_merged_staleness_rounds",
            "Rounds between a merged delta's base and its round: this learner's own "
            "(role=learner), or every delta this peer merged as synchronizer.",
            ["role"],
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )

    def _synchronizer_metrics(self, counter: Callable, gauge: Callable, r: CollectorRegistry) -> None:
        """As synchronizer: rounds closed, grace, contributors, refusals."""
        self.rounds_closed = counter("p2pdiloco_rounds_closed", "Rounds committed as synchronizer.")
        self.grace = Histogram(
            "p2pdiloco_grace_seconds",
            "Grace waited for stragglers in rounds this peer closed, s.",
            buckets=(0, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.contributors = Histogram(
            "p2pdiloco_round_contributors",
            "Deltas merged in rounds this peer closed.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.rejected = counter(
            "p2pdiloco_rejected_contributions", "Contributions refused, by reason.", ["reason"]
        )

    def _replica_metrics(self, counter: Callable, gauge: Callable, r: CollectorRegistry) -> None:
        """The replica: rounds, hash agreement, repairs, downloads, audits."""
        self.replica_round = gauge(
            "p2pdiloco_replica_round", "Rounds applied to this replica's fragment.", ["fragment"]
        )
        self.hash_agrees = gauge(
            "p2pdiloco_replica_hash_agrees",
            "1 while the fragment's last applied state matched its round record's hash; "
            "0 after a divergence or while repairing a losing branch.",
            ["fragment"],
        )
        self.updates_applied = counter("p2pdiloco_updates_applied", "Round updates applied.")
        self.diverged = counter("p2pdiloco_replica_diverged", "Updates that missed their hash.")
        self.repairs = counter("p2pdiloco_replica_repairs", "Repairs of a losing branch.")
        self.downloads = counter("p2pdiloco_state_downloads", "Fragment states downloaded.")
        self.audits = counter("p2pdiloco_audits", "Rounds recomputed, by verdict.", ["verdict"])
        self.convictions = counter("p2pdiloco_convictions", "False merges this peer proved.")
        self.voided = counter(
            "p2pdiloco_rounds_voided", "Committed rounds a signed re-run replaced (nobody could serve or verify them)."
        )

    def on_event(self, event: dict[str, Any]) -> None:
        """Count one event (any thread); a malformed one is skipped and logged at debug."""
        try:
            self._count(event)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.debug("metrics skipped event=%r error=%r", str(event)[:200], exc)

    def _count(self, e: dict[str, Any]) -> None:
        if e.get("ready") and e.get("peer_id"):
            self.peer.info({"peer_id": str(e["peer_id"]), "run": self.run, "version": __version__})
        kind = e.get("event")
        if not isinstance(kind, str):
            return
        self.events.labels(kind if re.fullmatch(r"[a-z_]{1,40}", kind) else "other").inc()
        if isinstance(e.get("rounds"), list):  # joined, step, eval: every fragment's round
            for fragment, round_now in enumerate(e["rounds"]):
                self.replica_round.labels(str(fragment)).set(round_now)
        if kind == "step":
            self.loss.set(float(e["loss"]))
        elif kind == "eval":
            self.eval_loss.set(float(e["eval_loss"]))
        elif kind == "shipped":
            self.rounds_contributed.inc()
            with self._lock:
                if len(self._shipped_staleness) >= 256:  # never answered: forget the oldest
                    self._shipped_staleness.pop(next(iter(self._shipped_staleness)))
                self._shipped_staleness[(e["fragment"], e["round"])] = e["round"] - e["base_round"]
        elif kind == "contributed":
            status = e["status"] if e["status"] in STATUSES else "other"
            self.contributions.labels(status).inc()
            if status == Reply.MERGED:
                self._weigh(float(e["weight"]))
        elif kind == "delta_merged":
            self.rounds_merged.inc()
            self.merged_steps.inc(max(int(e["steps"]), 0))
            self.merged_tokens.inc(max(int(e["tokens"]), 0))
            self._weigh(float(e["weight"]))
            with self._lock:
                staleness = self._shipped_staleness.pop((e["fragment"], e["round"]), None)
            if staleness is not None:
                self.staleness.labels("learner").observe(staleness)
        elif kind == "delta_unmerged":
            self.unmerged_steps.inc(max(int(e["steps"]), 0))
        elif kind == "delta_folded":
            self.folded_steps.labels(token_label(str(e["reason"]))).inc(max(int(e["steps"]), 0))
        elif kind == "steps_lost":
            self.lost_steps.labels(token_label(str(e["reason"]))).inc(max(int(e["steps"]), 0))
        elif kind == "round_closed":
            self.rounds_closed.inc()
            self.grace.observe(float(e["grace_s"]))
            self.contributors.observe(len(e["contributors"]))
            for staleness in e.get("staleness", []):
                self.staleness.labels("synchronizer").observe(staleness)
        elif kind == "rejected":
            self.rejected.labels(reason_label(str(e["reason"]))).inc()
        else:
            self._count_replica(kind, e)

    def _weigh(self, weight: float) -> None:
        # A delta that the update's take-over decided before its synchronizer's answer
        # came is reported merged with weight 0 (its weight was in the answer): unknown.
        if weight > 0.0:
            self.weight_share.set(weight)

    def _count_replica(self, kind: str, e: dict[str, Any]) -> None:
        if kind == "applied":  # installed only once it hashed to the record's hash
            fragment = str(e["fragment"])
            self.updates_applied.inc()
            self.replica_round.labels(fragment).set(e["round"] + 1)
            self.hash_agrees.labels(fragment).set(1)
        elif kind == "downloaded":  # verified by hash against the canonical chain
            self.downloads.inc()
            self.replica_round.labels(str(e["fragment"])).set(e["round"])
            self.hash_agrees.labels(str(e["fragment"])).set(1)
        elif kind in ("diverged", "repair"):
            (self.diverged if kind == "diverged" else self.repairs).inc()
            self.hash_agrees.labels(str(e["fragment"])).set(0)
        elif kind == "audited":
            self.audits.labels(token_label(str(e["verdict"]))).inc()
        elif kind == "convicted":
            self.convictions.inc()
        elif kind == "voided":
            self.voided.inc()


class MetricsServer:
    """Serves one registry over HTTP in Prometheus' text format (any path, `/metrics` too)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        """The port asked for; once started, the bound one (0 asks for any free port)."""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen (a daemon thread answers); returns the bound port. NetworkSetupError
        when the address cannot be bound (a port in use, an unknown host)."""
        try:
            self._server, self._thread = start_http_server(self.port, self.host, self.registry)
        except OSError as exc:
            raise NetworkSetupError(
                f"cannot serve metrics on {self.host}:{self.port} (peer.metrics_host, peer.metrics_port): "
                f"{exc.strerror or exc}; choose another --metrics-port, or 0 for no metrics"
            ) from None
        self.port = self._server.server_port
        log.info("metrics served url=http://%s:%d/metrics", self.host, self.port)
        return self.port

    def shutdown(self) -> None:
        """Stop answering and close the socket (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = self._thread = None
