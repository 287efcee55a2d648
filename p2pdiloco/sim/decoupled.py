"""Decoupled DiLoCo on simulated time: the swarm's schedule in one process, real training.

The lockstep simulator (`simulate.run_diloco`) is plain DiLoCo: every learner takes H
steps and every delta is merged every round. The swarm is not like that: learners run at
their own speeds and never wait; a window closes at quorum K plus the grace of Eq. 3;
fragments are due on a staggered schedule; a learner takes a result over at its next
step. This module replays that schedule with an event queue on a simulated clock and
runs the swarm's own code for everything but the network:

- each learner is a real `Learner` (its ship schedule, its claims, its on-receive rule,
  folding a delta no round merged into the next one) on a `GlobalState` replica of its
  own, its deltas encoded into real CONTRIBUTION frames with the run's codec;
- each window is the synchronizer's `WindowMachine` (quorum, grace, close, expire);
- each merge is `merge.merge_round` (screening, token weights, the merge rule, the
  outer codec) through `common.CanonicalChain`, as in the lockstep simulator, applied
  with `GlobalState.apply_update` to every replica.

So a loss of computed steps in the learner shows in the simulator too (a simulator that
resent late deltas to the next round, which the learner does not do, would hide it).
Deterministic from `train.seed` and `simulate.seed`. What it leaves out, on purpose:
failover, commit and rival records (a round either closes or not), bandwidth (a fixed
`link_s` each way, `sync_s` to merge).
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import logging
import random
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.outer.screening import Candidate, dot
from p2pdiloco.outer.step import Params, tensor_norm
from p2pdiloco.protocol.window_rules import Close, Wait, WindowMachine, overlap_steps_of
from p2pdiloco.roles.learner import Learner
from p2pdiloco.sim.common import (
    SYNCHRONIZER,
    CanonicalChain,
    Committed,
    DeltaChannel,
    LossCurve,
    Progress,
    fp32_channel,
    global_state_of,
    learner_streams,
    load_params,
    peer_id,
    schedule_config,
)
from p2pdiloco.training.data import Corpus
from p2pdiloco.training.model import Decoder, build_model
from p2pdiloco.training.train import InnerTrainer, evaluate, resolve_device
from p2pdiloco.wire.messages import Outcome, Reply

log = logging.getLogger(__name__)

RUN = "simulated"
LIMITS = wire.WireLimits()


@dataclass
class SimLearner:
    """One simulated learner: the real learner loop and its speed."""

    learner: Learner
    step_time_s: float
    bytes_sent: int = 0


@dataclass
class SimWindow:
    machine: WindowMachine
    arrivals: dict[int, tuple[Candidate, Future]] = field(default_factory=dict)
    """Learner index -> (its decoded contribution, the future its reply resolves)."""


@dataclass
class DecoupledRun:
    """What a decoupled simulation produced (besides its loss curve)."""

    curve: LossCurve
    tokens: int
    bytes_per_learner: int
    rounds: list[int]
    merged: int
    """Deltas merged, over all rounds and fragments."""
    stale_merged: int
    """Of those, deltas whose base was older than the round they were merged into."""
    dropped: int
    """Deltas no round merged (late, refused, or their window expired): folded or lost."""
    sim_time_s: float
    steps: list[int] = field(default_factory=list)
    """Inner steps each learner took."""
    eval_times_s: list[float] = field(default_factory=list)
    """Simulated time of each point of the loss curve."""
    rho: list[float] = field(default_factory=list)
    """Cosine between consecutive merged updates of a fragment, one per round after its
    first (the rho of the outer-step rule in docs/operate.md)."""
    merged_steps: int = 0
    """Inner steps carried by merged deltas (fragment-steps: one per fragment a step is in)."""
    local_steps: int = 0
    """Fragment-steps still in the learners' local progress at the end."""
    lost_steps: dict[str, int] = field(default_factory=dict)
    """Fragment-steps the learners reported lost, by reason."""

    @property
    def work_efficiency(self) -> float:
        """Merged fragment-steps / computed fragment-steps."""
        computed = sum(self.steps) * max(len(self.rounds), 1)
        return self.merged_steps / computed if computed else 0.0


def cosine(a: Params, b: Params) -> float:
    """Cosine between two updates over the tensors of both (0 when one is zero)."""
    norms = tensor_norm(a) * tensor_norm(b)
    return dot(a, b) / norms if norms > 0 else 0.0


def learner_speeds(config: RunConfig) -> list[float]:
    """Relative speed of each learner (`simulate.speeds`, cycled; 1.0 = base step time)."""
    speeds = [float(s) for s in config.simulate.speeds.split(",") if s.strip()] or [1.0]
    return [speeds[i % len(speeds)] for i in range(config.simulate.learners)]


def run_decoupled(
    config: RunConfig,
    corpus: Corpus,
    eval_set: list[torch.Tensor],
    *,
    channel: DeltaChannel = fp32_channel,
    progress: Progress | None = None,
) -> DecoupledRun:
    """Simulate the swarm's schedule until the learners took `M * rounds * H` inner steps
    between them: the baseline's tokens. Nobody waits, so a fast learner takes more of
    them than a slow one. Deltas go through the run's codec (`compress.codec`) as the
    learners encode them; `channel` is the lockstep simulator's and is not used here."""
    del channel
    return DecoupledSwarm(config, corpus, eval_set, progress).run()


class DecoupledSwarm:
    """The simulated swarm: its learners, the open windows, the canonical chain and the
    event queue on the simulated clock. `run` takes events in time order; each kind of
    event has a method (`on_step`, `on_arrive`, `on_check`, `on_result`, `on_reply`)."""

    def __init__(
        self,
        config: RunConfig,
        corpus: Corpus,
        eval_set: list[torch.Tensor],
        progress: Progress | None,
    ) -> None:
        config = schedule_config(config)
        sim, sync = config.simulate, config.sync
        self.config, self.eval_set, self.progress = config, eval_set, progress
        self.device = resolve_device(config.train.device)
        self.rng = random.Random(sim.seed)
        base = build_model(
            config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len
        )
        self.chain = CanonicalChain(config, global_state_of(base))
        """The canonical replica: what the held-out loss is measured on."""
        self.eval_model = copy.deepcopy(base).to(self.device)
        self.queue: list[tuple[float, int, str, tuple]] = []
        self.order = itertools.count()
        self.now = 0.0
        """The simulated clock: the time of the event being handled (s)."""
        self.learners = self._start_learners(base, learner_streams(config, corpus, sim.learners))
        self.windows: dict[int, SimWindow] = {}
        """Fragment -> its open window (of the canonical chain's round)."""
        self.previous: dict[int, Params] = {}
        """Per fragment, the last merged update (for rho)."""
        self.budget = sim.rounds * sync.inner_steps * len(self.learners)
        self.steps_taken = 0
        # the synchronizer's step-time estimate: the learners' mean (the peers average arrivals)
        self.step_time_s = sum(x.step_time_s for x in self.learners) / len(self.learners)
        self.overlap = overlap_steps_of(sync.overlap_steps, sync.inner_steps, sync.on_receive)
        self.out = DecoupledRun(
            curve=LossCurve(), tokens=0, bytes_per_learner=0, rounds=[],
            merged=0, stale_merged=0, dropped=0, sim_time_s=0.0,
        )  # fmt: skip
        self.fresh = False
        """A merge since the last evaluation."""

    def _start_learners(
        self, base: Decoder, streams: list[Iterator[torch.Tensor]]
    ) -> list[SimLearner]:
        """One real `Learner` per stream, on a replica of its own, at its own speed."""
        config = self.config
        learners = []
        for i, speed in enumerate(learner_speeds(config)):
            learner = Learner(
                peer_id(i), RUN, config, InnerTrainer(copy.deepcopy(base), config.train, self.device),
                streams[i], self.chain.replica(), functools.partial(self.submit, i), [],
                contributors_of=self.chain.contributors,
            )  # fmt: skip
            learners.append(SimLearner(learner, config.simulate.step_time_s / speed))
        return learners

    def schedule(self, at: float, kind: str, *payload: object) -> None:
        heapq.heappush(self.queue, (at, next(self.order), kind, payload))

    def run(self) -> DecoupledRun:
        """Replay the schedule until the step budget is spent and every event is handled."""
        for i, sim_learner in enumerate(self.learners):
            self.schedule(sim_learner.step_time_s * self.rng.uniform(0.0, 1.0), "step", i)
        self.record_loss()
        handlers = {
            "step": self.on_step, "arrive": self.on_arrive, "check": self.on_check,
            "result": self.on_result, "reply": self.on_reply,
        }  # fmt: skip
        while self.queue:
            self.now, _, kind, payload = heapq.heappop(self.queue)
            handlers[kind](*payload)
        if self.fresh:  # the final point is the model after the last merge
            self.record_loss()
        return self.summary()

    # --- every step: a learner takes one inner step, maybe ships ----------------------

    def on_step(self, i: int) -> None:
        if self.steps_taken >= self.budget:
            return
        self.steps_taken += 1
        sim_learner = self.learners[i]
        learner = sim_learner.learner
        before = learner.progress.tokens
        learner.run_step(self.config.sync.warm_steps)
        learner.send_staged()  # encoded within the step: the schedule stays deterministic
        self.out.tokens += learner.progress.tokens - before
        if self.steps_taken < self.budget:
            jitter = 1.0 + self.config.simulate.jitter * self.rng.uniform(-1.0, 1.0)
            self.schedule(self.now + sim_learner.step_time_s * jitter, "step", i)
        if self.progress:
            self.progress("decoupled steps", self.steps_taken, self.budget)

    def submit(self, i: int, fragment: int, target_round: int, frame: bytes) -> Future:
        """Learner `i` sends a CONTRIBUTION frame: it arrives one link later."""
        future: Future = Future()
        self.learners[i].bytes_sent += len(frame)
        arrive_at = self.now + self.config.simulate.link_s
        self.schedule(arrive_at, "arrive", i, fragment, target_round, frame, future)
        return future

    # --- a delta arrives: into its window, or late ------------------------------------

    def on_arrive(
        self, i: int, fragment: int, target_round: int, frame: bytes, future: Future
    ) -> None:
        """A delta reaches the synchronizer of its target round: late if that closed."""
        sync, now = self.config.sync, self.now
        message = wire.decode_message(frame, LIMITS)
        assert isinstance(message, wire.Message), message
        if target_round != self.chain.state.round_of(fragment):
            self.out.dropped += 1
            self.reply(now + self.config.simulate.link_s, future, Reply.LATE, fragment, target_round)
            return
        window = self.windows.get(fragment)
        if window is None:
            machine = WindowMachine(
                round=target_round, fragment=fragment, opened_at=now,
                deadline_s=sync.round_deadline_s, min_quorum=sync.min_quorum,
                min_token_fraction=sync.min_token_fraction,
            )  # fmt: skip
            window = self.windows[fragment] = SimWindow(machine)
        meta = message.meta
        refused = window.machine.accept(
            peer_id(i), meta["tokens"], meta["steps"], meta["step_time_s"], now
        )
        if refused is not None:
            self.out.dropped += 1
            self.reply(now + self.config.simulate.link_s, future, Reply.LATE, fragment, target_round)
            return
        delta = compress.decode_tensors(message.tensors)
        staleness = target_round - meta["base_round"]
        window.arrivals[i] = (
            Candidate(peer_id(i), delta, meta["tokens"], meta["steps"], staleness),
            future,
        )
        self.on_check(fragment)

    # --- a window's deadline: wait on, merge, or give up --------------------------------

    def on_check(self, fragment: int) -> None:
        window = self.windows.get(fragment)
        if window is None:
            return
        sim, sync = self.config.simulate, self.config.sync
        action = window.machine.next_action(
            self.now, expected={peer_id(i) for i in range(len(self.learners))}, better_placed=None,
            step_time_s=self.step_time_s, sync_time_s=sim.sync_s, overlap_steps=self.overlap,
            gamma=sync.grace_gamma, max_grace_s=sync.max_grace_s,
        )  # fmt: skip
        if isinstance(action, Wait):
            self.schedule(action.until, "check", fragment)
            return
        del self.windows[fragment]
        committed = None
        if isinstance(action, Close):
            candidates = [candidate for candidate, _ in window.arrivals.values()]
            committed = self.chain.merge(fragment, candidates, sync.min_quorum)
        if committed is None:
            self.out.dropped += len(window.arrivals)
            for _candidate, future in window.arrivals.values():
                self.reply(self.now + sim.link_s, future, Reply.NO_QUORUM, fragment, window.machine.round)
            return
        self.commit(fragment, window, committed)

    def commit(self, fragment: int, window: SimWindow, committed: Committed) -> None:
        """A window merged: its result to every replica, its replies to its learners."""
        sim, round_id, update = self.config.simulate, committed.round_id, committed.update
        done_at = self.now + sim.sync_s + sim.link_s
        for j in range(len(self.learners)):  # every replica applies the same update
            self.schedule(done_at, "result", j, fragment, round_id, update)
        for candidate, future in window.arrivals.values():
            if candidate.peer in committed.kept:
                self.out.merged += 1
                self.out.merged_steps += candidate.steps
                self.out.stale_merged += int(candidate.staleness > 0)
                self.reply(done_at, future, Reply.MERGED, fragment, round_id)
            else:
                self.out.dropped += 1
                self.reply(done_at, future, Reply.REJECTED, fragment, round_id)
        if fragment in self.previous:
            self.out.rho.append(cosine(update, self.previous[fragment]))
        self.previous[fragment] = {n: t.clone() for n, t in update.items()}
        # as a learner does: a point of the curve every `eval_every_rounds` of fragment 0
        if fragment == 0 and self.chain.state.round_of(0) % sim.eval_every_rounds == 0:
            self.record_loss()
            log.info(
                "decoupled t=%.1f tokens=%d rounds=%s eval_loss=%.4f",
                self.now, self.out.tokens, self.chain.state.rounds, self.out.curve.eval_loss[-1],
            )  # fmt: skip
        else:
            self.fresh = True

    # --- a result arrives: a learner's replica applies it -------------------------------

    def on_result(self, j: int, fragment: int, round_id: int, update: Params) -> None:
        learner = self.learners[j].learner
        learner.state.apply_update(fragment, round_id, update)
        # a step event is a step boundary: the loop takes results over there, so the
        # next step starts from them (as a lockstep learner's would)
        learner.collect_outcomes()
        learner.take_over_updates()

    def reply(self, at: float, future: Future, status: str, fragment: int, round_id: int) -> None:
        self.schedule(at, "reply", future, Outcome(status, round_id, fragment, SYNCHRONIZER))

    def on_reply(self, future: Future, outcome: Outcome) -> None:
        future.set_result(outcome)

    # --- measure and sum up -------------------------------------------------------------

    def record_loss(self) -> None:
        """A point of the loss curve: the canonical replica's held-out loss, now."""
        load_params(self.eval_model, self.chain.state.params)
        self.out.curve.record(
            self.out.tokens, evaluate(self.eval_model, self.eval_set, self.device)
        )
        self.out.eval_times_s.append(self.now)
        self.fresh = False

    def summary(self) -> DecoupledRun:
        """The run's figures, once every learner's encoder has finished."""
        out, learners = self.out, self.learners
        for x in learners:
            x.learner.shipper.encoder.shutdown(wait=True)
            for reason, count in x.learner.progress.lost_steps.items():
                out.lost_steps[reason] = out.lost_steps.get(reason, 0) + count
        out.bytes_per_learner = sum(x.bytes_sent for x in learners) // len(learners)
        out.rounds = list(self.chain.state.rounds)
        out.sim_time_s = self.now
        out.steps = [x.learner.progress.step for x in learners]
        out.local_steps = sum(ledger.steps for x in learners for ledger in x.learner.book.ledgers)
        return out
