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
- each merge is `merging.merge_round` (screening, token weights, the merge rule, the
  outer codec), applied with `GlobalState.apply_update` to every replica.

So a loss of computed steps in the learner shows in the simulator too (issue 26: the
previous simulator resent late deltas to the next round, which the learner did not do).
Deterministic from `train.seed` and `simulate.seed`. What it leaves out, on purpose:
failover, commit and rival records (a round either closes or not), bandwidth (a fixed
`link_s` each way, `sync_s` to merge).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.outer.screening import Candidate, dot
from p2pdiloco.outer.step import Params, tensor_norm
from p2pdiloco.protocol.fragments import partition_fragments
from p2pdiloco.protocol.merge import history_of, max_tokens_per_step, merge_round
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.protocol.windows import Close, Wait, WindowMachine, overlap_steps_of
from p2pdiloco.roles.learner import Learner
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.sim.simulate import (
    DeltaChannel,
    LossCurve,
    Progress,
    _schedule_config,
    fp32_channel,
    global_state_of,
    learner_streams,
    load_params,
)
from p2pdiloco.training.data import Corpus
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer, evaluate, resolve_device
from p2pdiloco.wire.messages import LATE, MERGED, NO_QUORUM, REJECTED, Outcome

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
    config = _schedule_config(config)
    sim, sync, outer = config.simulate, config.sync, config.outer
    device = resolve_device(config.train.device)
    rng = random.Random(sim.seed)
    base = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    global_params = global_state_of(base)
    fragments = partition_fragments({n: t.numel() for n, t in global_params.items()}, sync.num_fragments)
    reference = GlobalState(global_params, fragments, outer)
    """The canonical replica: what the held-out loss is measured on."""
    eval_model = copy.deepcopy(base).to(device)
    streams = learner_streams(config, corpus, sim.learners)
    queue: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()
    clock = [0.0]
    records: dict[tuple[int, int], frozenset[str]] = {}
    chains: list[dict[int, RoundRecord]] = [{} for _ in fragments]
    outer_codec = compress.make_codec_from_config(config.compress, outer=True)
    token_cap = max_tokens_per_step(config)
    overlap = overlap_steps_of(sync.overlap_steps, sync.inner_steps, sync.on_receive)

    def schedule(at: float, kind: str, *payload) -> None:
        heapq.heappush(queue, (at, next(order), kind, payload))

    def submitter(i: int):
        def submit(fragment: int, target_round: int, frame: bytes) -> Future:
            future: Future = Future()
            learners[i].bytes_sent += len(frame)
            schedule(clock[0] + sim.link_s, "arrive", i, fragment, target_round, frame, future)
            return future

        return submit

    learners: list[SimLearner] = []
    for i, speed in enumerate(learner_speeds(config)):
        learner = Learner(
            f"sim-{i}", RUN, config, InnerTrainer(copy.deepcopy(base), config.train, device), streams[i],
            GlobalState(global_params, fragments, outer), submitter(i), [],
            contributors_of=lambda f, r: records.get((f, r)),
        )  # fmt: skip
        learners.append(SimLearner(learner, sim.step_time_s / speed))
    windows: dict[int, SimWindow] = {}
    previous: dict[int, Params] = {}
    """Per fragment, the last merged update (for rho)."""
    rho: list[float] = []
    total_steps = sim.rounds * sync.inner_steps
    budget, steps_taken = total_steps * len(learners), 0
    eval_times: list[float] = [0.0]
    for i, sim_learner in enumerate(learners):
        schedule(sim_learner.step_time_s * rng.uniform(0.0, 1.0), "step", i)
    curve, tokens_total = LossCurve(), 0
    merged = stale_merged = dropped = merged_steps = 0
    curve.record(0, evaluate(eval_model, eval_set, device))
    fresh = False
    """A merge since the last evaluation."""
    # the synchronizer's step-time estimate: the learners' mean (the peers average arrivals)
    step_time = sum(x.step_time_s for x in learners) / len(learners)

    def reply(at: float, future: Future, status: str, fragment: int, round_id: int) -> None:
        schedule(at, "reply", future, Outcome(status, round_id, fragment, "simulated"))

    def deliver(i: int, fragment: int, target_round: int, frame: bytes, future: Future, now: float) -> None:
        """A delta reaches the synchronizer of its target round: late if that closed."""
        nonlocal dropped
        message = wire.decode_message(frame, LIMITS)
        assert isinstance(message, wire.Message), message
        if target_round != reference.round_of(fragment):
            dropped += 1
            reply(now + sim.link_s, future, LATE, fragment, target_round)
            return
        window = windows.get(fragment)
        if window is None:
            machine = WindowMachine(
                round=target_round, fragment=fragment, opened_at=now,
                deadline_s=sync.round_deadline_s, min_quorum=sync.min_quorum,
                min_token_fraction=sync.min_token_fraction,
            )  # fmt: skip
            window = windows[fragment] = SimWindow(machine)
        meta = message.meta
        refused = window.machine.accept(f"sim-{i}", meta["tokens"], meta["steps"], meta["step_time_s"], now)
        if refused is not None:
            dropped += 1
            reply(now + sim.link_s, future, LATE, fragment, target_round)
            return
        delta = compress.decode_tensors(message.tensors)
        staleness = target_round - meta["base_round"]
        window.arrivals[i] = (Candidate(f"sim-{i}", delta, meta["tokens"], meta["steps"], staleness), future)
        check(fragment, now)

    def check(fragment: int, now: float) -> None:
        nonlocal merged, stale_merged, dropped, merged_steps, fresh
        window = windows.get(fragment)
        if window is None:
            return
        action = window.machine.next_action(
            now, expected={f"sim-{i}" for i in range(len(learners))}, better_placed=None,
            step_time_s=step_time, sync_time_s=sim.sync_s, overlap_steps=overlap,
            gamma=sync.grace_gamma, max_grace_s=sync.max_grace_s,
        )  # fmt: skip
        if isinstance(action, Wait):
            schedule(action.until, "check", fragment)
            return
        del windows[fragment]
        round_id = window.machine.round
        done_at = now + sim.sync_s + sim.link_s
        result = None
        if isinstance(action, Close):
            snapshot = reference.export_fragment(fragment)
            history, first = history_of(chains[fragment], round_id, config.screening.history_rounds)
            result = merge_round(
                [candidate for candidate, _ in window.arrivals.values()], history=history,
                params=snapshot.params, momentum=snapshot.momentum, outer=outer, sync=sync,
                rules=config.screening, max_tokens_per_step=token_cap, outer_codec=outer_codec,
            )  # fmt: skip
        kept = {v.peer: v for v in result.screening.kept} if result is not None else {}
        if result is None or result.decoded is None or len(kept) < sync.min_quorum:
            dropped += len(window.arrivals)
            for _candidate, future in window.arrivals.values():
                reply(now + sim.link_s, future, NO_QUORUM, fragment, round_id)
            return
        update = result.decoded
        reference.apply_update(fragment, round_id, update)
        records[(fragment, round_id)] = frozenset(kept)
        chains[fragment][round_id] = RoundRecord(
            round_id, fragment, "simulated", reference.fragment_hash(fragment),
            contributors=tuple((v.peer, float(v.weight), v.tokens) for v in kept.values()),
            norms=tuple(v.merged_norm for v in kept.values()),
        )  # fmt: skip
        for j in range(len(learners)):  # every replica applies the same update
            schedule(done_at, "result", j, fragment, round_id, update)
        for candidate, future in window.arrivals.values():
            if candidate.peer in kept:
                merged += 1
                merged_steps += candidate.steps
                stale_merged += int(candidate.staleness > 0)
                reply(done_at, future, MERGED, fragment, round_id)
            else:
                dropped += 1
                reply(done_at, future, REJECTED, fragment, round_id)
        if fragment in previous:
            rho.append(cosine(update, previous[fragment]))
        previous[fragment] = {n: t.clone() for n, t in update.items()}
        if fragment == 0 and reference.round_of(0) % sim.eval_every_rounds == 0:  # as a learner does
            load_params(eval_model, reference.params)
            curve.record(tokens_total, evaluate(eval_model, eval_set, device))
            eval_times.append(now)
            log.info(
                "decoupled t=%.1f tokens=%d rounds=%s eval_loss=%.4f",
                now, tokens_total, reference.rounds, curve.eval_loss[-1],
            )  # fmt: skip
            fresh = False
        else:
            fresh = True

    now = 0.0
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        clock[0] = now
        if kind == "check":
            check(payload[0], now)
        elif kind == "arrive":
            deliver(*payload, now)
        elif kind == "reply":
            future, outcome = payload
            future.set_result(outcome)
        elif kind == "result":
            j, fragment, round_id, update = payload
            learner = learners[j].learner
            learner.state.apply_update(fragment, round_id, update)
            # a step event is a step boundary: the loop takes results over there, so the
            # next step starts from them (as a lockstep learner's would)
            learner.collect_outcomes()
            learner.take_over_updates()
        elif kind == "step":
            i = payload[0]
            if steps_taken >= budget:
                continue
            steps_taken += 1
            learner = learners[i].learner
            before = learner.progress.tokens
            learner.run_step(sync.warm_steps)
            learner.send_staged()  # encoded within the step: the schedule stays deterministic
            tokens_total += learner.progress.tokens - before
            if steps_taken < budget:
                jitter = 1.0 + sim.jitter * rng.uniform(-1.0, 1.0)
                schedule(now + learners[i].step_time_s * jitter, "step", i)
            if progress:
                progress("decoupled steps", steps_taken, budget)
    if fresh:  # the final point is the model after the last merge
        load_params(eval_model, reference.params)
        curve.record(tokens_total, evaluate(eval_model, eval_set, device))
        eval_times.append(now)
    lost: dict[str, int] = {}
    for x in learners:
        x.learner.encoder.shutdown(wait=True)
        for reason, count in x.learner.progress.lost_steps.items():
            lost[reason] = lost.get(reason, 0) + count
    return DecoupledRun(
        curve=curve, tokens=tokens_total,
        bytes_per_learner=sum(x.bytes_sent for x in learners) // len(learners),
        rounds=list(reference.rounds), merged=merged, stale_merged=stale_merged, dropped=dropped,
        sim_time_s=now, steps=[x.learner.progress.step for x in learners], eval_times_s=eval_times,
        rho=rho, merged_steps=merged_steps,
        local_steps=sum(ledger.steps for x in learners for ledger in x.learner.ledgers),
        lost_steps=lost,
    )  # fmt: skip
