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
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco import __version__, compress, messages, wire
from p2pdiloco.checkpoint import load_learner, save_learner
from p2pdiloco.config import RunConfig, config_hash
from p2pdiloco.data import Corpus, heldout_batches, learner_batches
from p2pdiloco.errors import ConfigError, NetworkSetupError
from p2pdiloco.fragments import partition_fragments
from p2pdiloco.learner import Learner
from p2pdiloco.learner_link import LearnerLink, Outcome
from p2pdiloco.membership import Heartbeat, learners, live_members, members_key
from p2pdiloco.model import build_model
from p2pdiloco.state import FragmentState, GlobalState
from p2pdiloco.synchronizer import Synchronizer
from p2pdiloco.train import InnerTrainer, resolve_device
from p2pdiloco.transport.base import Transport, TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerOptions:
    """How this peer joins (per peer, unlike the run config every peer shares)."""

    run: str = "local"
    """Run name: the namespace of every DHT key and RPC."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs to bootstrap from (empty: this peer starts a new DHT)."""
    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 0
    """Listen port (0: any free port)."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to announce instead of the listen ones (public IP behind port forwarding)."""
    client_mode: bool = False
    """Behind NAT: only outgoing connections; never elected synchronizer."""
    identity_path: str | None = None
    """Ed25519 key file: the peer id survives restarts."""
    data_rank: int | None = None
    """This peer's data shard (None: derived from the peer id)."""
    data_shards: int = 1
    """Number of data shards the run is split into (1: every peer reads all, in its own order)."""
    heartbeat_s: float = 2.0
    """Seconds between heartbeats; a peer silent for 4 heartbeats is gone."""
    max_rounds: int | None = None
    """Leave after every fragment reached this round (None: run until stopped)."""
    max_steps: int | None = None
    """Leave after this many inner steps."""
    wait_peers: int = 0
    """Start training only once this many learners (this one included) are live, so peers
    started together begin together (0: start at once). Bounded by `wait_peers_timeout_s`."""
    wait_peers_timeout_s: float = 300.0
    """After this long the peer starts anyway (with a warning): a barrier never hangs a peer."""
    eval_batches: int = 2
    """Held-out batches evaluated after each round of fragment 0."""
    events: bool = False
    """Print one JSON line per event on stdout (tests and the demo read these)."""
    startup_timeout_s: float = 120.0
    """Bound on joining the DHT."""
    checkpoint_dir: str | None = None
    """Where the learner's local state is saved on leaving and restored on start."""
    torch_threads: int = 0
    """Threads for torch's CPU kernels (0: torch's default). Several peers on one machine
    should use 1 each, or their busy-waiting thread pools starve one another."""
    straggle_s: float = 0.0
    """Fault injection (tests, benchmarks): delay contributions to early rounds by this much."""
    straggle_rounds: int = 0
    """Rounds (from 0) whose contributions are delayed by `straggle_s`."""
    corrupt: str = ""
    """Fault injection: send `nan` deltas or `garbage` frames to early rounds."""
    corrupt_rounds: int = 0
    """Rounds (from 0) whose contributions are corrupted."""


@dataclass
class PeerStatus:
    """What the heartbeat loop publishes, refreshed from the learner each beat."""

    members: dict[str, Heartbeat] = field(default_factory=dict)
    rejected_members: dict[str, str] = field(default_factory=dict)


class PeerDaemon:
    """Compose transport, state, synchronizer, link and learner; run until stopped."""

    def __init__(
        self,
        config: RunConfig,
        options: PeerOptions,
        transport: Transport,
        on_progress: Callable[[str, int, int], None] = lambda phase, done, total: None,
    ) -> None:
        self.config = config
        self.options = options
        self.transport = transport
        self.stop_event = threading.Event()
        self.on_progress = on_progress
        """Long work reports here: (phase, done, total), phases `data` and `state`."""
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="p2pdiloco-net", daemon=True
        )
        self.status = PeerStatus()
        self.limits = wire.WireLimits()
        self._tasks: list[asyncio.Task] = []
        self._leaving = False
        self._stdout_closed = False
        self.config_hash = config_hash(config)
        self.swarm_rounds: list[int] = []
        """Per fragment, the round the swarm has reached according to the round records."""

    # --- events -------------------------------------------------------------------------

    def emit(self, event: dict) -> None:
        """One JSON line per event on stdout (when enabled) and a log line."""
        if self.options.events and not self._stdout_closed:
            try:
                sys.stdout.write(json.dumps({"t": round(time.time(), 3), **event}) + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._stdout_closed = True  # whoever read our events is gone; keep running

    # --- lifecycle ----------------------------------------------------------------------

    def _on_loop(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def run(self) -> int:
        """Join, train, leave. Returns an exit code (0: clean)."""
        self._loop_thread.start()
        try:
            self._on_loop(self.transport.start(), self.options.startup_timeout_s + 30)
            self._build()
            self._on_loop(self._start_network(), 120)
            self.emit(
                {
                    "ready": True,
                    "peer_id": self.transport.peer_id,
                    "maddrs": self.transport.visible_maddrs(),
                }
            )
            if self.options.checkpoint_dir:
                restored = load_learner(self.options.checkpoint_dir, self.learner, self.config_hash)
                self.emit(
                    {
                        "event": "checkpoint_loaded" if restored else "checkpoint_none",
                        "step": self.learner.progress.step,
                    }
                )
            self._on_loop(self._wait_for_peers(), self.options.wait_peers_timeout_s + 60)
            self._on_loop(self._join(), 600)
            self.emit(
                {
                    "event": "joined",
                    "rounds": list(self.state.rounds),
                    "hashes": [
                        self.state.fragment_hash(f) for f in range(self.state.num_fragments)
                    ],
                }
            )
            self.learner.run(
                self.stop_event,
                self.options.max_rounds,
                self.options.max_steps,
                self.rounds_reached,
            )
            self._finish_in_flight()
            if self.options.checkpoint_dir:
                path = save_learner(self.options.checkpoint_dir, self.learner, self.config_hash)
                self.emit(
                    {
                        "event": "checkpoint_saved",
                        "path": str(path),
                        "step": self.learner.progress.step,
                    }
                )
            self.emit({"event": "summary", **self.summary()})
            return 0
        finally:
            self._shutdown()

    def summary(self) -> dict:
        """This peer's totals, for the demo and the benchmarks."""
        p = self.learner.progress
        return {
            "peer_id": self.transport.peer_id,
            "steps": p.step,
            "tokens": p.tokens,
            "train_s": p.train_s,
            "loop_s": p.loop_s,
            "rounds": list(self.state.rounds),
            "rounds_contributed": p.rounds_contributed,
            "tokens_contributed": p.tokens_contributed,
            "bytes_sent": p.bytes_sent,
            "bytes_received": p.bytes_received + self.link.bytes_received,
            "latencies_s": p.latencies_s,
            "eval_loss": p.eval_loss,
            "hashes": [self.state.fragment_hash(f) for f in range(self.state.num_fragments)],
        }

    def rounds_reached(self) -> list[int]:
        """Per fragment, the furthest round known: our replica's or the swarm's records'."""
        ours = list(self.state.rounds)
        return [
            max(r, self.swarm_rounds[f] if f < len(self.swarm_rounds) else 0)
            for f, r in enumerate(ours)
        ]

    def stop(self) -> None:
        """Ask the peer to leave (safe from signal handlers and other threads)."""
        self.stop_event.set()

    def _build(self) -> None:
        config, options = self.config, self.options
        device = resolve_device(config.train.device)
        if options.torch_threads > 0:
            torch.set_num_threads(options.torch_threads)
        model = build_model(
            config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len
        )
        params = {n: p.detach() for n, p in model.named_parameters()}
        fragments = partition_fragments(
            {n: p.numel() for n, p in params.items()}, config.sync.num_fragments
        )
        self.state = GlobalState(params, fragments, config.outer)
        corpus = Corpus.from_config(
            config.data, lambda done, total: self.on_progress("data", done, total)
        )
        peer_id = self.transport.peer_id
        rank = (
            options.data_rank
            if options.data_rank is not None
            else int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little")
        )
        batches = learner_batches(
            corpus,
            rank,
            options.data_shards,
            config.train.batch_size,
            config.model.seq_len,
            config.train.seed,
        )
        eval_set = (
            heldout_batches(
                corpus, options.eval_batches, config.train.batch_size, config.model.seq_len
            )
            if options.eval_batches
            else []
        )
        self.trainer = InnerTrainer(model, config.train, device)
        self.synchronizer = Synchronizer(
            self.transport,
            options.run,
            config,
            self.state,
            self.members,
            self.limits,
            on_event=self.emit,
        )
        self.link = LearnerLink(
            self.transport, options.run, config, self.state, self.members, self.limits
        )
        self.learner = Learner(
            peer_id,
            options.run,
            config,
            self.trainer,
            batches,
            self.state,
            self.submit,
            eval_set,
            on_event=self.emit,
        )
        self.state.listeners.append(
            lambda f, r: self.emit(
                {
                    "event": "applied",
                    "fragment": f,
                    "round": r,
                    "hash": self.state.applied_hashes[f].get(r, ""),
                }
            )
        )
        self.device_name = str(device)

    async def _start_network(self) -> None:
        await self.synchronizer.start()
        await self._beat()
        others = [p for p in self.status.members if p != self.transport.peer_id]
        disagree = [
            r
            for r in self.status.rejected_members.values()
            if r.startswith("trains with another run config")
        ]
        if disagree and not others:
            raise ConfigError(
                f"this peer's run config differs from the run's (every live learner {disagree[0]}): use the run's published config"
            )
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    def _finish_in_flight(self, timeout_s: float = 30.0) -> None:
        """On leaving: give in-flight contributions a bounded chance to complete."""
        deadline = time.monotonic() + timeout_s
        for item in list(self.learner.in_flight.values()):
            try:
                item.future.result(max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - abandoned cleanly: the round goes on without it
                pass
        self.learner.collect_outcomes()

    def _shutdown(self) -> None:
        self._leaving = True
        if self._loop_thread.is_alive():
            try:
                self._on_loop(self._leave(), 60)
            except Exception as exc:  # noqa: BLE001 - shutting down: report, carry on
                log.warning("leave failed error=%r", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(10)
        self.emit({"event": "stopped"})

    async def _leave(self) -> None:
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "learner"):
            self.learner.progress.status = "leaving"
            try:
                await asyncio.wait_for(self._beat(), 10)
            except Exception:  # noqa: BLE001
                pass
        if hasattr(self, "synchronizer"):
            await self.synchronizer.shutdown()
        await self.transport.shutdown()

    # --- learner <-> network ------------------------------------------------------------

    def submit(self, fragment: int, target_round: int, frame: bytes) -> Future[Outcome]:
        """Called from the training thread: contribute in the background."""
        return asyncio.run_coroutine_threadsafe(
            self._contribute(fragment, target_round, frame), self.loop
        )

    async def _contribute(self, fragment: int, target_round: int, frame: bytes) -> Outcome:
        options = self.options
        if options.straggle_s > 0 and target_round < options.straggle_rounds:
            await asyncio.sleep(options.straggle_s)  # injected latency (no netem here)
        if options.corrupt and target_round < options.corrupt_rounds:
            frame = corrupt_frame(frame, options.corrupt)
        return await self.link.contribute(fragment, target_round, frame)

    def members(self) -> dict[str, Heartbeat]:
        """This peer's current view of the live membership (itself included)."""
        view = dict(self.status.members)
        if not self._leaving:
            view[self.transport.peer_id] = self._own_heartbeat()
        return view

    def _own_heartbeat(self) -> Heartbeat:
        progress = self.learner.progress if hasattr(self, "learner") else None
        return Heartbeat(
            peer_id=self.transport.peer_id,
            role="learner",
            client_mode=self.options.client_mode,
            device=getattr(self, "device_name", "cpu"),
            tokens_per_s=progress.tokens_per_s if progress else 0.0,
            tokens_contributed=progress.tokens_contributed if progress else 0,
            rounds_contributed=progress.rounds_contributed if progress else 0,
            last_weight=progress.last_weight if progress else 0.0,
            rounds=tuple(self.state.rounds) if hasattr(self, "state") else (),
            status=progress.status if progress else "starting",
            synchronizing=tuple(self.synchronizer.holding())
            if hasattr(self, "synchronizer")
            else (),
            inner_step=progress.step if progress else 0,
            loss=progress.loss if progress else 0.0,
            eval_loss=progress.eval_loss if progress else 0.0,
            bytes_sent=progress.bytes_sent if progress else 0,
            bytes_received=(progress.bytes_received + self.link.bytes_received) if progress else 0,
            software=f"p2pdiloco/{__version__}",
            config_hash=self.config_hash,
        )

    async def _beat(self) -> None:
        """Publish our heartbeat and refresh the membership view."""
        now = self.transport.now()
        ttl = 4 * self.options.heartbeat_s
        await self.transport.store(
            members_key(self.options.run),
            self.transport.peer_id,
            self._own_heartbeat().encode(),
            now + ttl,
        )
        records = await self.transport.get(members_key(self.options.run))
        live, rejected = live_members(records, self.transport.now(), self.config_hash)
        for subkey, reason in rejected.items():
            if subkey not in self.status.rejected_members:
                log.warning("ignored member subkey=%s reason=%r", subkey[-8:], reason)
        self.status.members, self.status.rejected_members = live, rejected

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_s)  # a period, not a synchronisation
            try:
                await asyncio.wait_for(self._beat(), 30)
                await asyncio.wait_for(self._watch_rounds(), 120)
            except (TimeoutError, TransportError) as exc:
                log.warning("heartbeat failed error=%r", exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the daemon must outlive any one beat
                log.exception("heartbeat loop fault")

    # --- rounds, catch-up and state download --------------------------------------------

    async def latest_round_records(self, fragment: int) -> dict[int, messages.RoundRecord]:
        records = await self.transport.get(messages.rounds_key(self.options.run, fragment))
        out = {}
        for subkey, (raw, _exp) in records.items():
            record = messages.decode_round_record(raw)
            if record is not None and record.fragment == fragment and str(record.round) == subkey:
                out[record.round] = record
        return out

    async def _watch_rounds(self) -> None:
        """Catch up when the swarm is ahead; re-download a fragment whose hash diverged.

        Only after trying does this peer note how far the swarm got (`swarm_rounds`), so a
        peer that can catch up does so before `--max-rounds` lets it leave.
        """
        if len(self.swarm_rounds) < self.state.num_fragments:
            self.swarm_rounds = [0] * self.state.num_fragments
        for fragment in range(self.state.num_fragments):
            records = await self.latest_round_records(fragment)
            if not records:
                continue
            ours = self.state.applied_hashes[fragment]
            diverged = fragment in self.link.diverged or any(
                r in ours and ours[r] != rec.hash for r, rec in records.items()
            )
            latest = max(records)
            if diverged:
                log.warning("fragment diverged fragment=%d: downloading its state", fragment)
                if await self._download_fragment(fragment, records):
                    self.link.diverged.discard(fragment)
            elif self.state.round_of(fragment) <= latest:
                if not await self.link.catch_up_to(fragment, latest + 1):
                    await self._download_fragment(fragment, records)
            self.swarm_rounds[fragment] = max(self.swarm_rounds[fragment], latest + 1)

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
        """Late joiner: download every fragment that the swarm has moved past round 0."""
        for fragment in range(self.state.num_fragments):
            records = await self.latest_round_records(fragment)
            if records:
                await self._download_fragment(fragment, records)
            self.on_progress("state", fragment + 1, self.state.num_fragments)

    async def _download_fragment(
        self, fragment: int, records: dict[int, messages.RoundRecord]
    ) -> bool:
        """Fetch one fragment's state from a donor past the latest round; verify its hash.

        Donors are the live peers whose heartbeat says they are past that round; the
        choice rotates with the fragment so a joiner spreads its download over peers.
        The state must match the round record of the round it claims (by hash).
        """
        want_round = max(records) + 1
        donors = sorted(
            p
            for p, b in self.status.members.items()
            if p != self.transport.peer_id
            and b.role == "learner"
            and not b.client_mode
            and len(b.rounds) > fragment
            and b.rounds[fragment] >= want_round
        )
        if not donors:
            log.warning("no donor for fragment=%d round=%d", fragment, want_round)
            return False
        start = fragment % len(donors)
        request = wire.encode_message(
            wire.Message(
                kind=wire.STATE_REQUEST,
                run=self.options.run,
                round=want_round,
                fragment=fragment,
                meta={"peer": self.transport.peer_id},
            )
        )
        for donor in donors[start:] + donors[:start]:
            try:
                raw = await self.transport.call(
                    donor,
                    f"{self.options.run}.{messages.RPC_GET_STATE}",
                    request,
                    timeout_s=120.0,
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning("state download failed donor=%s error=%r", donor[-8:], exc)
                continue
            self.link.bytes_received += len(raw)
            state = self._parse_state(raw, fragment)
            if state is None:
                continue
            record = records.get(state.round - 1)
            if record is None:
                records.update(await self.latest_round_records(fragment))
                record = records.get(state.round - 1)
            if record is None or state.hash != record.hash:
                log.warning(
                    "state from donor=%s round=%d does not match its round record: refused",
                    donor[-8:],
                    state.round,
                )
                continue
            loop = asyncio.get_running_loop()
            local_hash = await loop.run_in_executor(None, self.state.import_fragment, state)
            if local_hash != state.hash:
                log.warning("imported state hash mismatch fragment=%d", fragment)
                continue
            log.info(
                "downloaded fragment=%d round=%d donor=%s hash=%s",
                fragment,
                state.round,
                donor[-8:],
                state.hash[:12],
            )
            self.emit(
                {
                    "event": "downloaded",
                    "fragment": fragment,
                    "round": state.round,
                    "donor": donor,
                    "hash": state.hash,
                }
            )
            return True
        return False

    def _parse_state(self, raw: bytes, fragment: int) -> FragmentState | None:
        msg = wire.decode_message(raw, self.limits)
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != messages.STATE_REPLY
            or msg.fragment != fragment
        ):
            return None
        try:
            tensors = compress.decode_tensors(msg.tensors)
        except ValueError:
            return None
        params = {k[2:]: t for k, t in tensors.items() if k.startswith("p/")}
        momentum = {k[2:]: t for k, t in tensors.items() if k.startswith("m/")}
        return FragmentState(
            fragment=fragment,
            round=msg.round,
            params=params,
            momentum=momentum,
            hash=str(msg.meta["hash"]),
        )


def corrupt_frame(frame: bytes, kind: str) -> bytes:
    """Fault injection: a frame with a NaN in its first tensor, or random garbage."""
    if kind == "garbage":
        return bytes(reversed(frame[: len(frame) // 2]))
    msg = wire.decode_message(frame, wire.WireLimits())
    assert not isinstance(msg, wire.Rejected)
    tensors = compress.decode_tensors(msg.tensors)
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    fp32 = compress.make_codec("fp32")
    encoded = {**msg.tensors, name: fp32.encode(tensors[name])}
    return wire.encode_message(
        wire.Message(
            kind=msg.kind,
            run=msg.run,
            round=msg.round,
            fragment=msg.fragment,
            meta=msg.meta,
            tensors=encoded,
        )
    )


def make_transport_for(options: PeerOptions) -> Transport:
    """The hivemind transport for these options (imported lazily)."""
    from p2pdiloco.transport import make_transport

    try:
        return make_transport(
            "hivemind",
            initial_peers=list(options.initial_peers),
            host=options.host,
            port=options.port,
            client_mode=options.client_mode,
            identity_path=options.identity_path,
            announce_maddrs=list(options.announce_maddrs) or None,
            startup_timeout_s=options.startup_timeout_s,
        )
    except (ValueError, TypeError) as exc:
        raise NetworkSetupError(f"cannot set up the transport: {exc}") from None
