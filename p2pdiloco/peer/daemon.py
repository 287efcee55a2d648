"""The peer daemon: one process that joins a run, learns, and synchronises when elected.

Threads and ownership: the training loop runs on the calling (main) thread; the network
(transport, synchronizer, learner link, heartbeats) runs on one asyncio event loop in a
background thread. They share only the `GlobalState` (behind its lock) and hand work to
each other through futures and a queue. `stop()` (from a signal handler) sets an event;
`run()` then shuts the parts down in reverse order in `finally:`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from p2pdiloco import __version__, wire
from p2pdiloco.config import PeerConfig, RunConfig, config_hash
from p2pdiloco.errors import ConfigError, NetworkSetupError
from p2pdiloco.events import EventSink
from p2pdiloco.peer import census
from p2pdiloco.peer.addressbook import (
    initial_peers_with_fallback,
    load_addresses,
    remember_addresses,
)
from p2pdiloco.peer.checkpoint import load_learner, save_learner
from p2pdiloco.peer.clock import check_clock_at_join
from p2pdiloco.peer.faults import SplitView, crash_hook, faulty_contribute, hook_steps
from p2pdiloco.peer.heap import heap_free_bytes
from p2pdiloco.peer.metrics import MetricsServer, PeerMetrics, Totals
from p2pdiloco.protocol.fragments import frame_problem, partition_fragments
from p2pdiloco.protocol.membership import (
    BeatTally,
    Heartbeat,
    learners,
    live_members,
    members_key,
    seal_heartbeat,
)
from p2pdiloco.roles.learner import Learner
from p2pdiloco.roles.learner_link import LearnerLink, Outcome
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.synchronizer import Synchronizer
from p2pdiloco.training.data import Corpus, heldout_batches, learner_batches
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import RankGroup, follow_lead, join_ranks
from p2pdiloco.training.train import InnerTrainer, resolve_device
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import Auditor
from p2pdiloco.trust.record_rules import RunRecordRules

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """Everything a joined peer runs, built once the transport knows our peer id."""

    state: GlobalState
    trainer: InnerTrainer
    replicas: ReplicaSync
    synchronizer: Synchronizer
    link: LearnerLink
    learner: Learner
    device_name: str


class PeerDaemon:
    """Compose transport, replica, synchronizer, link and learner; run until stopped.

    Threads: the training loop runs on the calling (main) thread; the network
    (transport, synchronizer, replica sync, heartbeats) on one asyncio loop in a
    background thread; decode / merge / outer step / hash on one worker thread, so the
    loop stays responsive and heartbeats are never late. `stop()` (from a signal handler)
    sets an event; `run()` shuts the parts down in reverse order in `finally:`.
    """

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
        self.tally = BeatTally()
        """Staleness and audit verdicts from our events, for the heartbeat (the dashboard)."""
        self.emit.listeners.append(self.tally.on_event)
        self.metrics_server: MetricsServer | None = None
        """`--metrics-port`: Prometheus metrics counted from our events (p2pdiloco.peer.metrics)."""
        if options.metrics_port:
            metrics = PeerMetrics(options.run, self.totals)
            self.emit.listeners.append(metrics.on_event)
            self.metrics_server = MetricsServer(metrics.registry, options.metrics_host, options.metrics_port)
        self.stop_event = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="p2pdiloco-net", daemon=True)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2pdiloco-state")
        self.limits = wire.WireLimits()
        self.config_hash = config_hash(config)
        self.hook = crash_hook(options.crash_at, self.emit)
        self.parts: Parts | None = None
        self.ranks: RankGroup | None = None
        """The learner's other processes when torchrun started it (rank 0 talks to the swarm)."""
        self._members: dict[str, Heartbeat] = {}
        self._rejected_members: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._leaving = False
        self._last_checkpoint = time.monotonic()

    def _on_loop(self, coro, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    # --- lifecycle ----------------------------------------------------------------------

    def run(self) -> int:
        """Join, train, leave. Returns an exit code (0: clean)."""
        self.ranks = join_ranks(self.config.train.device)  # torchrun: one learner, N processes
        if self.ranks is not None and not self.ranks.is_lead:
            return follow_lead(self.ranks, self.config)  # steps only; no network
        if self.metrics_server is not None:  # a port in use is the operator's error: before joining
            self.metrics_server.start()
        self._loop_thread.start()
        try:
            self._on_loop(self.transport.start(), self.options.startup_timeout_s + 30)
            self._on_loop(check_clock_at_join(self.transport, self.options.initial_peers), 10)
            self.parts = parts = self._build()
            self._on_loop(self._start_network(), 120)
            self.emit({"ready": True, "peer_id": self.transport.peer_id, "maddrs": self.transport.visible_maddrs()})
            if self.options.checkpoint_dir:
                # the checkpoint's local work is put back on this replica's bases; the join
                # then rebases it onto the swarm's head like any update
                restored = load_learner(self.options.checkpoint_dir, parts.learner, self.config_hash)
                event = "checkpoint_loaded" if restored else "checkpoint_none"
                self.emit({"event": event, "step": parts.learner.progress.step})
            self._on_loop(self._wait_for_peers(), self.options.wait_peers_timeout_s + 60)
            self._on_loop(self._join(), 600)
            state = parts.state
            self.emit(
                {
                    "event": "joined",
                    "rounds": list(state.rounds),
                    "hashes": [state.fragment_hash(f) for f in range(state.num_fragments)],
                }
            )
            parts.learner.run(
                self.stop_event,
                self.options.max_rounds or None,
                self.options.max_steps or None,
                self.rounds_reached,
                every_step=self._maybe_checkpoint,
            )
            # Asked to leave (Ctrl-C): a short wait, the user is waiting; at the end of
            # the run: longer, the last round may still close.
            if self.stop_event.is_set():  # asked to leave mid-run: offer the local work once more
                parts.learner.collect_outcomes()
                parts.learner.take_over_updates()
                parts.learner.ship_remaining()
            self._finish_in_flight(10.0 if self.stop_event.is_set() else 30.0)
            parts.learner.wrap_up()
            self._checkpoint()
            self.emit({"event": "summary", **self.summary()})
            return 0
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask the peer to leave (safe from signal handlers and other threads)."""
        self.stop_event.set()

    def _build(self) -> Parts:
        config, options = self.config, self.options
        device = self.ranks.device if self.ranks else resolve_device(config.train.device)
        if options.torch_threads > 0:
            torch.set_num_threads(options.torch_threads)
        model = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
        params = {n: p.detach() for n, p in model.named_parameters()}
        sizes = {n: p.numel() for n, p in params.items()}
        fragments = partition_fragments(sizes, config.sync.num_fragments)
        too_big = frame_problem(sizes, fragments, self.limits.max_total_elements, self.limits.max_frame_bytes)
        if too_big:
            raise ConfigError(too_big)
        state = GlobalState(params, fragments, config.outer)
        corpus = Corpus.from_config(config.data, lambda done, total: self.on_progress("data", done, total))
        peer_id = self.transport.peer_id
        rank = (
            options.data_rank
            if options.data_rank >= 0
            else int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little")
        )
        if self.ranks is not None:  # this rank's part of the learner's shard (see ranks)
            batches = self.ranks.batches(corpus, rank, options.data_shards, config)
        else:
            batches = learner_batches(
                corpus, rank, options.data_shards, config.train.batch_size, config.model.seq_len, config.train.seed
            )
        eval_set = (
            heldout_batches(corpus, options.eval_batches, config.train.batch_size, config.model.seq_len)
            if options.eval_batches
            else []
        )
        trainer = (
            self.ranks.trainer(model, config.train) if self.ranks else InnerTrainer(model, config.train, device)
        )
        split = SplitView(options.split_view_rounds, lambda: self.transport.peer_id, state.round_of)
        role_view = split.view(self.members) if options.split_view_rounds else self.members
        replicas = ReplicaSync(
            self.transport, options.run, state, self.members, self.limits, self.worker,
            void_after_s=config.sync.round_deadline_s, on_event=self.emit,
            rivals_visible=split.rivals_visible, admission=self.admission,
            auditor=Auditor(options.run, config, self.limits, state.fragments),
            audit_share=config.sync.audit_share,
        )
        synchronizer = Synchronizer(
            self.transport, options.run, config, state, role_view, self.limits, replicas,
            self.worker, on_event=self.emit, rivals_visible=split.rivals_visible,
            certificates=self.certificates, screening_rules=config.screening,
        )
        if self.hook is not None:
            hook_steps(synchronizer.committer, self.hook)
        link = LearnerLink(self.transport, options.run, config.sync, replicas, role_view, self.limits)
        contribute = faulty_contribute(
            link.contribute, options.straggle_s, options.straggle_rounds, options.corrupt, options.corrupt_rounds
        )

        def submit(fragment: int, target_round: int, frame: bytes) -> Future[Outcome]:
            return asyncio.run_coroutine_threadsafe(contribute(fragment, target_round, frame), self.loop)

        learner = Learner(
            peer_id, options.run, config, trainer, batches, state, submit, eval_set,
            on_event=self.emit, contributors_of=replicas.contributors_of,
        )  # fmt: skip
        replicas.on_settled.append(
            lambda f, r, record: learner.round_settled(f, r, (c[0] for c in record.contributors))
        )
        state.listeners.append(
            lambda f, r: self.emit(
                {"event": "applied", "fragment": f, "round": r, "hash": state.applied_hashes[f].get(r, "")}
            )
        )
        parts = Parts(state, trainer, replicas, synchronizer, link, learner, str(device))
        if os.environ.get(census.ENV_VAR, "0") not in ("", "0"):  # diagnostics: p2pdiloco.peer.census
            state.listeners.append(census.CensusOnEvent(parts, self.emit).request)
        return parts

    async def _start_network(self) -> None:
        parts = self._parts()
        await parts.replicas.start()
        await parts.synchronizer.start()
        await self._beat()
        others = [p for p in self._members if p != self.transport.peer_id]
        disagree = [r for r in self._rejected_members.values() if r.startswith("trains with another run config")]
        if disagree and not others:
            raise ConfigError(
                f"this peer's run config differs from the run's (every live learner {disagree[0]}): use the run's published config"
            )
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    def _parts(self) -> Parts:
        assert self.parts is not None, "the peer is not built yet"
        return self.parts

    def _finish_in_flight(self, timeout_s: float = 30.0) -> None:
        """On leaving: give in-flight contributions a bounded chance to complete."""
        learner = self._parts().learner
        deadline = time.monotonic() + timeout_s
        for item in list(learner.in_flight.values()):
            try:
                item.future.result(max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - abandoned cleanly: the round goes on without it
                pass
        try:  # one last read of the chain settles the deltas of the last rounds
            self._on_loop(self._sync_all(), max(deadline - time.monotonic(), 5.0))
        except Exception as exc:  # noqa: BLE001
            log.warning("last sync failed error=%r", exc)
        learner.collect_outcomes()

    def _shutdown(self) -> None:
        self._leaving = True
        if self._loop_thread.is_alive():
            try:
                self._on_loop(self._leave(), 60)
            except Exception as exc:  # noqa: BLE001 - shutting down: report, carry on
                log.warning("leave failed error=%r", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(10)
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.emit({"event": "stopped"})

    async def _leave(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.parts is not None:
            self.parts.learner.progress.status = "leaving"
            try:
                await asyncio.wait_for(self._beat(), 10)
            except Exception:  # noqa: BLE001
                pass
            await self.parts.synchronizer.shutdown()
        await self.transport.shutdown()

    # --- checkpoints ----------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        """Called by the training loop after each step: checkpoint every `checkpoint_every_s`."""
        if time.monotonic() - self._last_checkpoint >= self.options.checkpoint_every_s:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Save local state and the peers seen (atomic, durable), if a directory is set."""
        self._last_checkpoint = time.monotonic()
        directory = self.options.checkpoint_dir
        if not directory or self.parts is None:
            return
        learner = self.parts.learner
        learner.wait_encoding()  # the residuals the encoder thread is updating
        try:
            path = save_learner(directory, learner, self.config_hash)
        except ConfigError as exc:
            log.warning("checkpoint failed error=%s", exc)
            return
        seen = {}
        for peer, beat in self._members.items():
            if peer != self.transport.peer_id:
                seen[peer] = list(beat.maddrs)
        remember_addresses(directory, {p: a for p, a in seen.items() if a}, time.time())
        self.emit({"event": "checkpoint_saved", "path": str(path), "step": learner.progress.step})

    # --- status ---------------------------------------------------------------------------

    def summary(self) -> dict:
        """This peer's totals, for the demo and the benchmarks."""
        parts = self._parts()
        p, state = parts.learner.progress, parts.state
        return {
            "peer_id": self.transport.peer_id,
            "steps": p.step,
            "tokens": p.tokens,
            "train_s": p.train_s,
            "loop_s": p.loop_s,
            "rest_s": p.rest_s,
            "rounds": list(state.rounds),
            "rounds_contributed": p.rounds_contributed,
            "tokens_contributed": p.tokens_contributed,
            "steps_contributed": p.steps_contributed,
            "local_steps": [ledger.steps for ledger in parts.learner.ledgers],
            "undecided_steps": {f: item.steps for f, item in parts.learner.in_flight.items()},
            "lost_steps": dict(p.lost_steps),
            "bytes_sent": p.bytes_sent,
            # replies (the link counts each once; the learner's figure is the same bytes) and
            # the updates and state this replica fetched
            "bytes_received": parts.link.bytes_received + parts.replicas.bytes_received,
            "latencies_s": p.latencies_s,
            "eval_loss": p.eval_loss,
            "hashes": [state.fragment_hash(f) for f in range(state.num_fragments)],
            # Linux reports kilobytes: the process's peak resident memory so far
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # freed memory malloc still keeps now, at the summary, not at the peak (None off
            # glibc): see p2pdiloco.peer.heap
            "heap_free_bytes": heap_free_bytes(),
        }

    def totals(self) -> Totals | None:
        """The running totals the metrics export (None until the parts are built)."""
        parts = self.parts
        if parts is None:
            return None
        progress = parts.learner.progress
        return Totals(
            inner_steps=progress.step,
            tokens=progress.tokens,
            tokens_per_s=progress.tokens_per_s,
            sent_bytes={"contribution": progress.bytes_sent},
            received_bytes={
                "reply": parts.link.bytes_received,
                "replica": parts.replicas.bytes_received,
            },
        )

    def rounds_reached(self) -> list[int]:
        """Per fragment, the furthest round known: our replica's or the canonical chain's."""
        parts = self._parts()
        ours = list(parts.state.rounds)
        heads = [max(chain) + 1 if chain else 0 for chain in parts.replicas.chains]
        # The chain's head counts only once this peer tried to reach it (a sync pass ran),
        # so a peer that can catch up does so before `--max-rounds` lets it leave.
        return [max(r, h if self._synced_once else 0) for r, h in zip(ours, heads, strict=True)]

    _synced_once = False

    def members(self) -> dict[str, Heartbeat]:
        """This peer's current view of the live membership (itself included)."""
        view = dict(self._members)
        if not self._leaving:
            view[self.transport.peer_id] = self._own_heartbeat()
        return view

    def _own_heartbeat(self) -> Heartbeat:
        parts = self.parts
        progress = parts.learner.progress if parts else None
        return Heartbeat(
            peer_id=self.transport.peer_id,
            role="learner",
            client_mode=self.options.client_mode,
            device=parts.device_name if parts else "cpu",
            tokens_per_s=progress.tokens_per_s if progress else 0.0,
            tokens_contributed=progress.tokens_contributed if progress else 0,
            rounds_contributed=progress.rounds_contributed if progress else 0,
            last_weight=progress.last_weight if progress else 0.0,
            rounds=tuple(parts.state.rounds) if parts else (),
            status=progress.status if progress else "starting",
            synchronizing=tuple(parts.synchronizer.holding()) if parts else (),
            inner_step=progress.step if progress else 0,
            loss=progress.loss if progress else 0.0,
            eval_loss=progress.eval_loss if progress else 0.0,
            bytes_sent=progress.bytes_sent if progress else 0,
            bytes_received=(parts.link.bytes_received + parts.replicas.bytes_received) if progress else 0,
            software=f"p2pdiloco/{__version__}",
            config_hash=self.config_hash,
            certificates=self.certificates,
            maddrs=() if self.options.client_mode else tuple(self.transport.visible_maddrs()[:8]),
            staleness=self.tally.staleness,
            reply_bytes=parts.link.bytes_received if parts else 0,
            replica_bytes=parts.replicas.bytes_received if parts else 0,
            audits_ok=self.tally.audits["ok"],
            audits_mismatch=self.tally.audits["mismatch"],
            audits_unverifiable=self.tally.audits["unverifiable"],
        )

    # --- heartbeats and replica sync --------------------------------------------------------

    async def _beat(self) -> None:
        """Publish our heartbeat and refresh the membership view."""
        now = self.transport.now()
        ttl = 4 * self.options.heartbeat_s
        key = members_key(self.options.run)
        sealed = seal_heartbeat(self.transport.identity, self.options.run, self._own_heartbeat())
        await self.transport.store(key, self.transport.peer_id, sealed, now + ttl)
        records = await self.transport.get(key)
        live, rejected = live_members(self.options.run, records, self.transport.now(), self.config_hash)
        for subkey, reason in rejected.items():
            if subkey not in self._rejected_members:
                log.warning("ignored member subkey=%s reason=%r", subkey[-8:], reason)
        self._members, self._rejected_members = live, rejected

    async def _heartbeat_loop(self) -> None:
        """Beat, then bring every fragment to the head of its canonical chain; bounded."""
        period = self.options.heartbeat_s
        while True:
            await asyncio.sleep(period)  # a period, not a synchronisation
            try:
                await asyncio.wait_for(self._beat(), 30)
            except (TimeoutError, TransportError) as exc:
                log.warning("heartbeat failed error=%r", exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the daemon must outlive any one beat
                log.exception("heartbeat fault")
            # Replica sync runs beside the beats, never delaying the next one.
            if not any(t.get_name() == "replica-sync" and not t.done() for t in self._tasks):
                self._tasks = [t for t in self._tasks if not t.done()]
                self._tasks.append(asyncio.create_task(self._sync_all(), name="replica-sync"))

    async def _sync_all(self) -> None:
        replicas = self._parts().replicas
        try:
            await asyncio.wait_for(replicas.check_notices(), 300)
        except (TimeoutError, TransportError) as exc:
            log.warning("fraud notice check failed error=%r", exc)
        for fragment in range(self._parts().state.num_fragments):
            try:
                await asyncio.wait_for(replicas.sync_fragment(fragment), 300)
            except (TimeoutError, TransportError) as exc:
                log.warning("replica sync failed fragment=%d error=%r", fragment, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("replica sync fault fragment=%d", fragment)
        self._synced_once = True

    async def _wait_for_peers(self) -> None:
        """The optional start barrier: poll the membership until enough learners are live."""
        want = self.options.wait_peers
        if want <= 1:
            return
        deadline = time.monotonic() + self.options.wait_peers_timeout_s
        live = len(learners(self.members()))
        self.emit({"event": "waiting_for_peers", "live": live, "want": want})
        while live < want:
            if time.monotonic() >= deadline:
                log.warning("starting without the awaited peers live=%d want=%d", live, want)
                return
            await asyncio.sleep(0.25)  # a poll period: how quickly a peer notices the last one
            try:
                await asyncio.wait_for(self._beat(), 30)
            except (TimeoutError, TransportError) as exc:
                log.warning("heartbeat failed error=%r", exc)
            live = len(learners(self.members()))
        self.emit({"event": "peers_ready", "live": live})

    async def _join(self) -> None:
        """Late joiner: bring every fragment to the head of the swarm's canonical chain."""
        parts = self._parts()
        for fragment in range(parts.state.num_fragments):
            try:
                await asyncio.wait_for(parts.replicas.sync_fragment(fragment), 300)
            except (TimeoutError, TransportError) as exc:
                log.warning("initial sync failed fragment=%d error=%r", fragment, exc)
            self.on_progress("state", fragment + 1, parts.state.num_fragments)


def make_transport_for(
    options: PeerConfig, rules: RunRecordRules | None = None, kind: str = "hivemind"
) -> Transport:
    """The run's transport (`network.transport`, imported lazily) for a peer's `[peer]`
    settings, whose DHT node stores and believes only records that pass the run's `rules`."""
    from p2pdiloco.transport import make_transport
    from p2pdiloco.transport.bootstrap import check_announce_maddr

    for maddr in options.announce_maddrs:
        check_announce_maddr(maddr)
    initial = list(options.initial_peers)
    if options.checkpoint_dir and initial:
        # Remembered peers are tried too, so a restart survives dead bootstrap nodes.
        initial = initial_peers_with_fallback(initial, load_addresses(options.checkpoint_dir), "")
    try:
        return make_transport(
            kind,
            initial_peers=initial,
            host=options.host,
            port=options.port,
            client_mode=options.client_mode,
            identity_path=options.identity_path or None,
            announce_maddrs=list(options.announce_maddrs) or None,
            startup_timeout_s=options.startup_timeout_s,
            record_rules=rules,
            # A contribute call stays open until its window closes: room for every fragment.
            max_per_caller=max(8, 2 * (rules.num_fragments if rules else 1) + 2),
        )
    except (ValueError, TypeError) as exc:
        raise NetworkSetupError(f"cannot set up the transport: {exc}") from None
