"""The peer daemon: one process that joins a run, learns, and synchronises when elected.

Threads and ownership: the training loop runs on the calling (main) thread; the network
(transport, synchronizer, learner link, heartbeats) runs on one asyncio event loop in a
background thread. They share only the `GlobalState` (behind its lock) and hand work to
each other through futures and a queue. `stop()` (from a signal handler) sets an event;
`run()` then shuts the parts down in reverse order in `finally:`.

This module is the process around a peer: its event loop, its transport, its metrics
server. The peer itself, with its roles, is `peer.joined.JoinedPeer`, built once the
transport is up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from p2pdiloco.config import PeerConfig, RunConfig
from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.events import EventSink
from p2pdiloco.peer.addressbook import initial_peers_with_fallback, load_addresses
from p2pdiloco.peer.checkpoint_dir import concrete_dir
from p2pdiloco.peer.clock import check_clock_at_join
from p2pdiloco.peer.joined import JoinedPeer, run_on
from p2pdiloco.peer.metrics import MetricsServer, PeerMetrics, Totals
from p2pdiloco.peer.reachability import ASK_S, settle_reachability, wants_client_mode
from p2pdiloco.peer.relay_slot import watch_relay_slot
from p2pdiloco.training.ranks import follow_lead, join_ranks
from p2pdiloco.transport.base import Transport
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.record_rules import RunRecordRules

log = logging.getLogger(__name__)


class PeerDaemon:
    """Start the transport, build the `JoinedPeer`, run it until stopped, leave."""

    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        on_progress: Callable[[str, int, int], None] = lambda phase, done, total: None,
        admission: Admission | None = None,
        certificates: tuple[bytes, ...] = (),
    ) -> None:
        self.config = config
        self.admission = admission or Admission()
        """Who may synchronize and learn in this run (from its manifest; open by default)."""
        self.certificates = certificates
        """This peer's operator certificates, shown in its heartbeats and round records."""
        self.options = options = config.peer
        """This peer's own settings (the `[peer]` section)."""
        self.transport = transport
        self.on_progress = on_progress
        """Long work reports here: (phase, done, total), phases `data` and `state`."""
        self.emit = EventSink(options.events)
        self.metrics_server: MetricsServer | None = None
        """`--metrics-port`: Prometheus metrics counted from our events (p2pdiloco.peer.metrics)."""
        if options.metrics_port:
            metrics = PeerMetrics(options.run, self.totals)
            self.emit.listeners.append(metrics.on_event)
            self.metrics_server = MetricsServer(metrics.registry, options.metrics_host, options.metrics_port)
        self.stop_event = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="p2pdiloco-net", daemon=True)
        self.peer: JoinedPeer | None = None
        """The joined peer, once the transport is up (its roles need the peer id)."""
        self._relay_watch: Future[None] | None = None
        """`peer.relay_slot.watch_relay_slot`, for a client-mode peer."""

    def _on_loop(self, coro, timeout_s: float):
        return run_on(self.loop, coro, timeout_s)

    def run(self) -> int:
        """Join, train, leave. Returns an exit code (0: clean)."""
        ranks = join_ranks(self.config.train.device)  # torchrun: one learner, N processes
        if ranks is not None and not ranks.is_lead:
            return follow_lead(ranks, self.config)  # steps only; no network
        if self.metrics_server is not None:  # a port in use is the operator's error: before joining
            self.metrics_server.start()
        self._loop_thread.start()
        try:
            self._on_loop(self.transport.start(), self.options.startup_timeout_s + 30)
            self._on_loop(check_clock_at_join(self.transport, self.options.initial_peers), 10)
            # a peer nobody can dial goes on in client mode (peer.reachability): the
            # questions, then perhaps a restart of the transport
            self.config = self._on_loop(
                settle_reachability(self.config, self.transport, self.emit),
                ASK_S + self.options.startup_timeout_s + 30,
            )
            self.options = self.config.peer
            if self.options.client_mode:  # reached only through a relay: watch the slot
                self._relay_watch = asyncio.run_coroutine_threadsafe(
                    watch_relay_slot(self.transport, self.emit, self._on_relay_failure), self.loop
                )
            self.peer = JoinedPeer(
                self.config, self.transport, self.loop, self.emit, ranks,
                self.admission, self.certificates, self.on_progress,
            )  # fmt: skip
            return self.peer.run(self.stop_event)
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask the peer to leave (safe from signal handlers and other threads)."""
        self.stop_event.set()

    def _on_relay_failure(self, why: str) -> None:
        log.error("%s; the peer stops (start it again)", why)
        self.stop()

    def totals(self) -> Totals | None:
        """The running totals the metrics export (None until the peer joined)."""
        return self.peer.totals() if self.peer is not None else None

    def _shutdown(self) -> None:
        if self._loop_thread.is_alive():
            try:
                self._on_loop(self._leave(), 60)
            except Exception as exc:  # noqa: BLE001 - shutting down: report, carry on
                log.warning("leave failed error=%r", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(10)
        if self.peer is not None:
            self.peer.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.emit({"event": "stopped"})

    async def _leave(self) -> None:
        if self._relay_watch is not None:
            self._relay_watch.cancel()
        if self.peer is not None:
            await self.peer.leave()
        await self.transport.shutdown()


def make_transport_for(
    options: PeerConfig, rules: RunRecordRules | None = None, kind: str = "hivemind", relay_service: bool = False
) -> Transport:
    """The run's transport (`network.transport`, imported lazily) for a peer's `[peer]`
    settings, whose DHT node stores and believes only records that pass the run's `rules`;
    with `relay_service` (a bootstrap node) it relays for peers behind NAT at once."""
    from p2pdiloco.transport import make_transport
    from p2pdiloco.transport.bootstrap import check_announce_maddr

    for maddr in options.announce_maddrs:
        check_announce_maddr(maddr)
    initial = list(options.initial_peers)
    directory = concrete_dir(options)
    if directory and initial:
        # Remembered peers are tried too, so a restart survives dead bootstrap nodes.
        initial = initial_peers_with_fallback(initial, load_addresses(directory), "")
    try:
        return make_transport(
            kind,
            initial_peers=initial,
            host=options.host,
            port=options.port,
            client_mode=wants_client_mode(options),
            use_relay=options.use_relay,
            use_auto_relay=options.use_auto_relay,
            relay_service=relay_service,
            identity_path=options.identity_path or None,
            announce_maddrs=list(options.announce_maddrs) or None,
            startup_timeout_s=options.startup_timeout_s,
            record_rules=rules,
            # A contribute call stays open until its window closes: room for every fragment.
            max_per_caller=max(8, 2 * (rules.num_fragments if rules else 1) + 2),
        )
    except (ValueError, TypeError) as exc:
        raise NetworkSetupError(f"cannot set up the transport: {exc}") from None
