"""A peer that joined a run: its roles, built at once, and the life of the peer in them.

Built once the transport is up (the roles need its peer id): the replica of the global
state and `ReplicaSync`, the `Synchronizer`, the `LearnerLink`, the `Learner` and the
`Membership`. Threads: the learner runs on the calling thread; the roles on the daemon's
event loop; decode / merge / outer step / hash on one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from p2pdiloco import __version__, wire
from p2pdiloco.config import RunConfig, config_hash
from p2pdiloco.errors import ConfigError
from p2pdiloco.events import EventSink
from p2pdiloco.peer import census
from p2pdiloco.peer.addressbook import remember_addresses
from p2pdiloco.peer.build import build_training
from p2pdiloco.peer.checkpoint import load_learner, save_learner
from p2pdiloco.peer.checkpoint_dir import concrete_dir
from p2pdiloco.peer.durable import GlobalCheckpoint, wait_for_chain
from p2pdiloco.peer.faults import SplitView, crash_hook, faulty_contribute, hook_steps
from p2pdiloco.peer.heap import heap_free_bytes
from p2pdiloco.peer.metrics import Totals
from p2pdiloco.protocol.membership import BeatTally, Heartbeat
from p2pdiloco.roles.learner import Learner
from p2pdiloco.roles.learner_link import LearnerLink, Outcome
from p2pdiloco.roles.presence import Membership
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.synchronizer import Synchronizer
from p2pdiloco.training.ranks import RankGroup
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import Auditor

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 300.0
"""Bound on bringing one fragment to the head of its chain (a state download included)."""
JOIN_WAIT_ROUNDS, JOIN_WAIT_MAX_S = 2, 240.0
"""Round deadlines (at most seconds) a joiner waits, in all, for records when live peers
say they are past round 0 (`durable.wait_for_chain`)."""
REPUBLISH_TIMEOUT_S = 120.0
"""Bound on storing a restored chain's records in the DHT again."""


def run_on(loop: asyncio.AbstractEventLoop, coro, timeout_s: float):
    """Run `coro` on the event loop `loop` (another thread's) and wait for its result,
    at most `timeout_s` (then it is cancelled and TimeoutError raised)."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise


class JoinedPeer:
    """Replica, synchronizer, learner link, learner and membership of one peer in a run."""

    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        loop: asyncio.AbstractEventLoop,
        emit: EventSink,
        ranks: RankGroup | None = None,
        admission: Admission | None = None,
        certificates: tuple[bytes, ...] = (),
        on_progress: Callable[[str, int, int], None] = lambda phase, done, total: None,
    ) -> None:
        self.config = config
        self.options = options = config.peer
        self.transport = transport
        self.loop = loop
        self.emit = emit
        self.on_progress = on_progress
        self.certificates = certificates
        """This peer's operator certificates, shown in its heartbeats and round records."""
        self.config_hash = config_hash(config)
        self.limits = wire.WireLimits()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2pdiloco-state")
        self.tally = BeatTally()
        """Staleness and audit verdicts from our events, for the heartbeat (the dashboard)."""
        emit.listeners.append(self.tally.on_event)
        training = build_training(config, transport.peer_id, ranks, self.limits, on_progress)
        self.state, self.trainer, self.device_name = training.state, training.trainer, training.device
        self.members = Membership(
            transport, options.run, options.heartbeat_s, self.config_hash, self.own_heartbeat, emit,
            shards=config.network.member_shards,
        )
        split = SplitView(options.split_view_rounds, lambda: transport.peer_id, self.state.round_of)
        role_view = split.view(self.members.view) if options.split_view_rounds else self.members.view
        self.replicas = ReplicaSync(
            transport, options.run, self.state, self.members.view, self.limits, self.worker,
            void_after_s=config.sync.round_deadline_s, on_event=emit,
            rivals_visible=split.rivals_visible, admission=admission,
            auditor=Auditor(options.run, config, self.limits, self.state.fragments),
            audit_share=config.sync.audit_share, epoch_rounds=config.network.record_epoch_rounds,
        )
        self.members.clock_voters = self.replicas.entitlement.votes_on_clock
        self.replicas.entitlement.settled = self.members.settled
        # the saved global state goes in before anyone takes a base from the replica (the
        # learner below), after ReplicaSync took the initial hashes its chains start from
        self.checkpoint_dir = concrete_dir(options)
        self.global_checkpoint = (
            GlobalCheckpoint(
                self.checkpoint_dir, options.run, self.config_hash, self.replicas, self.limits, emit,
                certificates=self.certificates,
            )  # fmt: skip
            if self.checkpoint_dir else None
        )  # fmt: skip
        if self.global_checkpoint is not None:
            self.global_checkpoint.restore()
        self.synchronizer = Synchronizer(
            transport, options.run, config, self.state, role_view, self.limits, self.replicas,
            self.worker, on_event=emit, rivals_visible=split.rivals_visible,
            certificates=certificates, screening_rules=config.screening,
        )
        hook = crash_hook(options.crash_at, emit)
        if hook is not None:
            hook_steps(self.synchronizer.committer, hook)
        self.link = LearnerLink(transport, options.run, config.sync, self.replicas, role_view, self.limits)
        self.learner = Learner(
            transport.peer_id, options.run, config, self.trainer, training.batches, self.state,
            self._submitter(), training.eval_set, on_event=emit, contributors_of=self.replicas.contributors_of,
            round_unsettled=self.replicas.round_unsettled,
        )  # fmt: skip
        self._wire_events()
        self._tasks: list[asyncio.Task] = []
        self._synced_once = False
        self._last_checkpoint = time.monotonic()
        self._born = time.monotonic()

    def _submitter(self) -> Callable[[int, int, bytes], Future[Outcome]]:
        """The learner's way to the event loop: a contribution, with injected faults if asked."""
        options = self.options
        contribute = faulty_contribute(
            self.link.contribute, options.straggle_s, options.straggle_rounds, options.corrupt, options.corrupt_rounds
        )

        def submit(fragment: int, target_round: int, frame: bytes) -> Future[Outcome]:
            return asyncio.run_coroutine_threadsafe(contribute(fragment, target_round, frame), self.loop)

        return submit

    def _wire_events(self) -> None:
        """The replica tells the learner of each settled round; applied rounds are events."""
        learner, state = self.learner, self.state
        self.replicas.on_settled.append(
            lambda f, r, record: learner.round_settled(f, r, (c[0] for c in record.contributors))
        )
        state.listeners.append(
            lambda f, r: self.emit(
                {"event": "applied", "fragment": f, "round": r, "hash": state.applied_hashes[f].get(r, "")}
            )
        )
        if os.environ.get(census.ENV_VAR, "0") not in ("", "0"):  # diagnostics: p2pdiloco.peer.census
            state.listeners.append(census.CensusOnEvent(self, self.emit).request)

    def _on_loop(self, coro, timeout_s: float):
        return run_on(self.loop, coro, timeout_s)

    # --- a peer's life ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Serve, catch up, train until stopped or done, hand over the last work. Returns 0."""
        options, learner = self.options, self.learner
        self._on_loop(self._start_network(), 120)
        self.emit({"ready": True, "peer_id": self.transport.peer_id, "maddrs": self.transport.visible_maddrs()})
        if self.checkpoint_dir:
            self._resume_global()
            # the checkpoint's local work is put back on this replica's bases; the join
            # then rebases it onto the swarm's head like any update
            restored = load_learner(self.checkpoint_dir, learner, self.config_hash)
            self.emit({"event": "checkpoint_loaded" if restored else "checkpoint_none", "step": learner.progress.step})
        self._on_loop(self.members.wait_for_learners(options.wait_peers, options.wait_peers_timeout_s),
                      options.wait_peers_timeout_s + 60)  # fmt: skip
        self._on_loop(self._join(), 600)
        state = self.state
        self.emit({"event": "joined", "rounds": list(state.rounds),
                   "hashes": [state.fragment_hash(f) for f in range(state.num_fragments)]})  # fmt: skip
        learner.run(
            stop, options.max_rounds or None, options.max_steps or None, self.rounds_reached,
            every_step=self._maybe_checkpoint,
        )
        # Asked to leave (Ctrl-C): a short wait, the user is waiting; at the end of the
        # run: longer, the last round may still close.
        if stop.is_set():  # asked to leave mid-run: offer the local work once more
            learner.collect_outcomes()
            learner.take_over_updates()
            learner.ship_remaining()
        self._finish_in_flight(10.0 if stop.is_set() else 30.0)
        learner.wrap_up()
        self._checkpoint()
        self.emit({"event": "summary", **self.summary()})
        return 0

    async def _start_network(self) -> None:
        await self.replicas.start()
        await self.synchronizer.start()
        await self.members.beat()
        disagreement = self.members.config_disagreement()
        if disagreement:
            raise ConfigError(disagreement)
        self._tasks.append(asyncio.create_task(self.members.beat_forever(self._start_replica_sync)))

    def _start_replica_sync(self) -> None:
        """After a beat: bring every fragment to the head of its chain, and check the run's
        fraud notices, each beside the beats and beside each other (one of each at a time,
        never delaying the next beat). A notice's verification may download a fragment
        from its notifier, a stranger that may answer slowly or not at all: inside the
        sync pass it held every round's apply for up to `SYNC_TIMEOUT_S`
        (`bench_attack` `notice_flood`)."""
        for name, job in (("replica-sync", self._sync_all), ("notice-check", self._check_notices)):
            if not any(t.get_name() == name and not t.done() for t in self._tasks):
                self._tasks = [t for t in self._tasks if not t.done()]
                self._tasks.append(asyncio.create_task(job(), name=name))

    async def _check_notices(self) -> None:
        try:
            await asyncio.wait_for(self.replicas.check_notices(), SYNC_TIMEOUT_S)
        except (TimeoutError, TransportError) as exc:
            log.warning("fraud notice check failed error=%r", exc)

    async def _sync_all(self) -> None:
        for fragment in range(self.state.num_fragments):
            try:
                await asyncio.wait_for(self.replicas.sync_fragment(fragment), SYNC_TIMEOUT_S)
            except (TimeoutError, TransportError) as exc:
                log.warning("replica sync failed fragment=%d error=%r", fragment, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("replica sync fault fragment=%d", fragment)
        self._synced_once = True

    async def _join(self) -> None:
        """Late joiner: bring every fragment to the head of the swarm's canonical chain."""
        waited_until = time.monotonic() + min(JOIN_WAIT_ROUNDS * self.config.sync.round_deadline_s, JOIN_WAIT_MAX_S)
        for fragment in range(self.state.num_fragments):
            try:
                # live peers past round 0 and no record yet (a run resuming from its
                # checkpoints): wait a bounded while, once, rather than start the run over
                wait_s = max(waited_until - time.monotonic(), 0.0)
                await wait_for_chain(self.replicas, fragment, self.options.heartbeat_s, wait_s)
                await asyncio.wait_for(self.replicas.sync_fragment(fragment), SYNC_TIMEOUT_S)
            except (TimeoutError, TransportError) as exc:
                log.warning("initial sync failed fragment=%d error=%r", fragment, exc)
            self.on_progress("state", fragment + 1, self.state.num_fragments)

    def _resume_global(self) -> None:
        """Say what the saved global state gave; put the records it stands on back in the
        DHT where the swarm has nothing newer (`durable.GlobalCheckpoint.resume`)."""
        assert self.global_checkpoint is not None
        try:
            self._on_loop(self.global_checkpoint.resume(), REPUBLISH_TIMEOUT_S)
        except (TimeoutError, TransportError) as exc:  # the next commits carry the run on
            log.warning("records not republished error=%r", exc)

    def _finish_in_flight(self, timeout_s: float = 30.0) -> None:
        """On leaving: give in-flight contributions a bounded chance to complete."""
        deadline = time.monotonic() + timeout_s
        for item in list(self.learner.book.in_flight.values()):
            try:
                item.future.result(max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - abandoned cleanly: the round goes on without it
                pass
        try:  # one last read of the chain settles the deltas of the last rounds
            self._on_loop(self._sync_all(), max(deadline - time.monotonic(), 5.0))
        except Exception as exc:  # noqa: BLE001
            log.warning("last sync failed error=%r", exc)
        self.learner.collect_outcomes()

    async def leave(self) -> None:
        """Stop beating and syncing, say so once more, let the synchronizer finish."""
        self.members.leaving = True
        for task in self._tasks:
            task.cancel()
        self.learner.progress.status = "leaving"
        try:
            await asyncio.wait_for(self.members.beat(), 10)
        except Exception:  # noqa: BLE001
            pass
        await self.synchronizer.shutdown()

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    # --- checkpoints ----------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        """Called by the training loop after each step: checkpoint every `checkpoint_every_s`."""
        if time.monotonic() - self._last_checkpoint >= self.options.checkpoint_every_s:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Save local state, the global state with its records and the peers seen (atomic,
        durable), if a directory is set. A full disk is logged, never fatal."""
        self._last_checkpoint = time.monotonic()
        directory = self.checkpoint_dir
        if not directory:
            return
        self.learner.shipper.wait_encoding()  # the residuals the encoder thread is updating
        try:
            path = save_learner(directory, self.learner, self.config_hash)
            if self.global_checkpoint is not None:  # the chains and frames are the loop's: read there
                self.global_checkpoint.save(self._on_loop(self.global_checkpoint.known(), 30))
        except (ConfigError, OSError, TimeoutError) as exc:
            log.warning("checkpoint failed error=%s", exc)
            return
        me = self.transport.peer_id
        seen = {peer: list(beat.maddrs) for peer, beat in self.members.live.items() if peer != me and beat.maddrs}
        remember_addresses(directory, seen, time.time(), proven=self.replicas.entitlement.proven_anywhere())
        saved = self.global_checkpoint.saved if self.global_checkpoint else []
        self.emit({"event": "checkpoint_saved", "path": str(path), "step": self.learner.progress.step,
                   "global_rounds": [round_id for round_id, _hash in saved]})  # fmt: skip

    # --- status ---------------------------------------------------------------------------

    def bytes_received(self) -> int:
        """Replies (the link counts each once) and the updates and state this replica fetched."""
        return self.link.bytes_received + self.replicas.bytes_received

    def summary(self) -> dict:
        """This peer's totals, for the demo and the benchmarks."""
        p, state, learner = self.learner.progress, self.state, self.learner
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
            "local_steps": [ledger.steps for ledger in learner.book.ledgers],
            "undecided_steps": {f: item.steps for f, item in learner.book.in_flight.items()},
            "lost_steps": dict(p.lost_steps),
            "bytes_sent": p.bytes_sent,
            "bytes_received": self.bytes_received(),
            # payload bytes by category at the transport interface, and over how long
            # (what scripts/simulate_swarm.py compares its simulated peers with)
            "traffic": self.transport.traffic.snapshot() if hasattr(self.transport, "traffic") else {},
            "traffic_s": time.monotonic() - self._born,
            "latencies_s": p.latencies_s,
            "eval_loss": p.eval_loss,
            "hashes": [state.fragment_hash(f) for f in range(state.num_fragments)],
            # Linux reports kilobytes: the process's peak resident memory so far
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # freed memory malloc still keeps now, at the summary, not at the peak (None off
            # glibc): see p2pdiloco.peer.heap
            "heap_free_bytes": heap_free_bytes(),
        }

    def totals(self) -> Totals:
        """The running totals the metrics export."""
        progress = self.learner.progress
        return Totals(
            inner_steps=progress.step,
            tokens=progress.tokens,
            tokens_per_s=progress.tokens_per_s,
            sent_bytes={"contribution": progress.bytes_sent},
            received_bytes={"reply": self.link.bytes_received, "replica": self.replicas.bytes_received},
        )

    def rounds_reached(self) -> list[int]:
        """Per fragment, the furthest round known: our replica's or the canonical chain's."""
        ours = list(self.state.rounds)
        heads = [max(chain) + 1 if chain else 0 for chain in self.replicas.chains]
        # The chain's head counts only once this peer tried to reach it (a sync pass ran),
        # so a peer that can catch up does so before `--max-rounds` lets it leave.
        return [max(r, h if self._synced_once else 0) for r, h in zip(ours, heads, strict=True)]

    def own_heartbeat(self) -> Heartbeat:
        progress, options = self.learner.progress, self.options
        return Heartbeat(
            peer_id=self.transport.peer_id,
            role="learner",
            client_mode=options.client_mode,
            device=self.device_name,
            tokens_per_s=progress.tokens_per_s,
            tokens_contributed=progress.tokens_contributed,
            rounds_contributed=progress.rounds_contributed,
            last_weight=progress.last_weight,
            rounds=tuple(self.state.rounds),
            status=progress.status,
            synchronizing=tuple(self.synchronizer.holding()),
            inner_step=progress.step,
            loss=progress.loss,
            eval_loss=progress.eval_loss,
            bytes_sent=progress.bytes_sent,
            bytes_received=self.bytes_received(),
            software=f"p2pdiloco/{__version__}",
            config_hash=self.config_hash,
            certificates=self.certificates,
            maddrs=() if options.client_mode else tuple(self.transport.visible_maddrs()[:8]),
            staleness=self.tally.staleness,
            reply_bytes=self.link.bytes_received,
            replica_bytes=self.replicas.bytes_received,
            audits_ok=self.tally.audits["ok"],
            audits_mismatch=self.tally.audits["mismatch"],
            audits_unverifiable=self.tally.audits["unverifiable"],
        )
