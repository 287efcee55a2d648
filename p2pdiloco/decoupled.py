"""Decoupled DiLoCo on simulated time: the swarm's schedule in one process, real training.

The lockstep simulator (`simulate.run_diloco`) is plain DiLoCo: every learner takes H
steps and every delta is merged every round. The swarm is not like that: learners run at
their own speeds and never wait; a window closes at quorum K plus the grace of Eq. 3;
a delta that misses its window goes to the next one, stale and discounted; fragments
are due on a staggered schedule; a learner takes a result over at its next step. This
module replays that schedule with an event queue on a simulated clock, training real
models, and calls the same pure functions the peers call: `fragments_due`,
`WindowMachine` (quorum, grace, close), `staleness_rejection`, `token_weights`,
`merge`, `outer_step` and the on-receive rules. Deterministic from `train.seed` and
`simulate.seed`.

What it leaves out, on purpose: screening (honest learners only), failover and commit
(a round either closes or not), bandwidth (a fixed `link_s` each way, `sync_s` to merge).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
import random
from dataclasses import dataclass, field

import torch

from p2pdiloco.config import RunConfig
from p2pdiloco.data import Corpus
from p2pdiloco.fragments import fragments_due, partition_fragments
from p2pdiloco.model import build_model
from p2pdiloco.outer import OuterState, Params, merge, outer_step, tensor_norm, token_weights
from p2pdiloco.screening import dot
from p2pdiloco.simulate import (
    DeltaChannel,
    LossCurve,
    Progress,
    _schedule_config,
    fp32_channel,
    global_state_of,
    learner_streams,
    load_params,
)
from p2pdiloco.train import InnerTrainer, evaluate, resolve_device
from p2pdiloco.windows import Close, Expire, Move, Wait, WindowMachine, staleness_rejection

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A learner's delta of one fragment on its way (or waiting to be resent)."""

    base_round: int
    target_round: int
    delta: Params
    tokens: int
    steps: int


@dataclass
class SimLearner:
    """One simulated learner: its replica, its speed and what it has in flight."""

    trainer: InnerTrainer
    stream: object
    step_time_s: float
    bases: list[tuple[int, Params]]
    c_tokens: list[int]
    c_steps: list[int]
    step: int = 0
    tokens: int = 0
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    shipped: dict[int, Params] = field(default_factory=dict)
    """Local parameters when the fragment was shipped (`on_receive = "rebase"`)."""


@dataclass
class SimWindow:
    machine: WindowMachine
    deltas: dict[int, InFlight] = field(default_factory=dict)


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
    """Of those, deltas merged into a later round than the one they were taken for."""
    dropped: int
    """Deltas rejected (too stale) or lost with an expired window."""
    sim_time_s: float
    steps: list[int] = field(default_factory=list)
    """Inner steps each learner took."""
    eval_times_s: list[float] = field(default_factory=list)
    """Simulated time of each point of the loss curve."""
    rho: list[float] = field(default_factory=list)
    """Cosine between consecutive merged updates of a fragment, one per round after its
    first (the rho of the outer-step rule in docs/operate.md)."""


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
    them than a slow one."""
    config = _schedule_config(config)
    sim, sync, outer = config.simulate, config.sync, config.outer
    device = resolve_device(config.train.device)
    rng = random.Random(sim.seed)
    base = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    global_params = global_state_of(base)
    fragments = partition_fragments({n: t.numel() for n, t in global_params.items()}, sync.num_fragments)
    embedding_names = frozenset(n for n in global_params if n.startswith("embed."))
    eval_model = copy.deepcopy(base).to(device)
    streams = learner_streams(config, corpus, sim.learners)
    learners = [
        SimLearner(
            trainer=InnerTrainer(copy.deepcopy(base), config.train, device),
            stream=streams[i],
            step_time_s=sim.step_time_s / speed,
            bases=[(0, {n: global_params[n].clone() for n in names}) for names in fragments],
            c_tokens=[0] * len(fragments),
            c_steps=[0] * len(fragments),
        )
        for i, speed in enumerate(learner_speeds(config))
    ]
    rounds = [0] * len(fragments)
    windows: dict[int, SimWindow] = {}
    outer_state = OuterState()
    previous: dict[int, Params] = {}
    """Per fragment, the last merged update (for rho)."""
    rho: list[float] = []
    total_steps = sim.rounds * sync.inner_steps
    budget, steps_taken = total_steps * len(learners), 0
    eval_times: list[float] = [0.0]
    queue: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()

    def schedule(at: float, kind: str, *payload) -> None:
        heapq.heappush(queue, (at, next(order), kind, payload))

    for i, learner in enumerate(learners):
        schedule(learner.step_time_s * rng.uniform(0.0, 1.0), "step", i)
    curve, tokens_total, bytes_sent = LossCurve(), 0, 0
    merged = stale_merged = dropped = 0
    curve.record(0, evaluate(eval_model, eval_set, device))
    fresh = False
    """A merge since the last evaluation."""
    # the synchronizer's step-time estimate: the learners' mean (the peers average arrivals)
    step_time = sum(learner.step_time_s for learner in learners) / len(learners)

    def take_over(learner: SimLearner, fragment: int) -> None:
        """The on-receive rule, on this fragment's tensors, at a step boundary."""
        local = dict(learner.trainer.model.named_parameters())
        shipped = learner.shipped.pop(fragment, None)
        with torch.no_grad():
            for name in fragments[fragment]:
                param, target = local[name], global_params[name].to(local[name].device)
                if sync.on_receive == "mix":
                    param.mul_(1 - sync.mix_alpha).add_(target, alpha=sync.mix_alpha)
                elif sync.on_receive == "rebase" and shipped is not None:
                    param.copy_(target + (param.detach() - shipped[name].to(param.device)))
                else:
                    param.copy_(target)
        learner.bases[fragment] = (rounds[fragment], {n: global_params[n].clone() for n in fragments[fragment]})
        learner.c_tokens[fragment] = learner.c_steps[fragment] = 0

    def deliver(i: int, fragment: int, now: float) -> None:
        """A delta reaches the synchronizer of its target round (or the next open one)."""
        nonlocal dropped
        item = learners[i].in_flight[fragment]
        item.target_round = max(item.target_round, rounds[fragment])  # late: the next round
        if staleness_rejection(item.base_round, item.target_round, sync.max_staleness_rounds):
            del learners[i].in_flight[fragment]
            dropped += 1
            return
        window = windows.get(fragment)
        if window is None:
            machine = WindowMachine(
                round=rounds[fragment], fragment=fragment, opened_at=now,
                deadline_s=sync.round_deadline_s, min_quorum=sync.min_quorum,
                min_token_fraction=sync.min_token_fraction,
            )  # fmt: skip
            window = windows[fragment] = SimWindow(machine)
        if window.machine.accept(str(i), item.tokens, item.steps, learners[i].step_time_s, now) is None:
            window.deltas[i] = item
        check(fragment, now)

    def check(fragment: int, now: float) -> None:
        nonlocal merged, stale_merged, dropped, fresh
        window = windows.get(fragment)
        if window is None:
            return
        action = window.machine.next_action(
            now, expected={str(i) for i in range(len(learners))}, better_placed=None,
            step_time_s=step_time, sync_time_s=sim.sync_s, overlap_steps=sync.overlap_steps,
            gamma=sync.grace_gamma, max_grace_s=sync.max_grace_s,
        )  # fmt: skip
        if isinstance(action, Wait):
            schedule(action.until, "check", fragment)
            return
        del windows[fragment]
        if isinstance(action, Expire | Move):
            for i in window.deltas:
                learners[i].in_flight.pop(fragment, None)
                dropped += 1
            return
        assert isinstance(action, Close)
        kept = sorted(window.deltas.items())
        stale = [rounds[fragment] - item.base_round for _, item in kept]
        weights = token_weights(
            [item.tokens for _, item in kept], [item.steps for _, item in kept],
            max_share=outer.max_weight_share, staleness=stale,
            staleness_discount=sync.staleness_discount,
        )  # fmt: skip
        update = merge(
            outer.merge, [item.delta for _, item in kept], weights,
            norm=outer.radial_norm, plain_mean_names=embedding_names,
        )  # fmt: skip
        if fragment in previous:
            rho.append(cosine(update, previous[fragment]))
        previous[fragment] = {n: t.clone() for n, t in update.items()}
        outer_step(
            global_params, update, outer_state, lr=outer.lr, momentum=outer.momentum,
            nesterov=outer.nesterov, delayed_every=outer.delayed_nesterov_every,
        )  # fmt: skip
        rounds[fragment] += 1
        merged += len(kept)
        stale_merged += sum(1 for s in stale if s > 0)
        for i, _ in kept:
            del learners[i].in_flight[fragment]
        if fragment == 0 and rounds[0] % sim.eval_every_rounds == 0:  # as a learner does
            load_params(eval_model, global_params)
            curve.record(tokens_total, evaluate(eval_model, eval_set, device))
            eval_times.append(now)
            log.info("decoupled t=%.1f tokens=%d rounds=%s eval_loss=%.4f", now, tokens_total, rounds, curve.eval_loss[-1])
            fresh = False
        else:
            fresh = True
        for i in range(len(learners)):
            schedule(now + sim.sync_s + sim.link_s, "result", i, fragment)

    now = 0.0
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == "check":
            check(payload[0], now)
        elif kind == "arrive":
            deliver(payload[0], payload[1], now)
        elif kind == "result":
            learners[payload[0]].received.add(payload[1])
        elif kind == "step":
            i = payload[0]
            learner = learners[i]
            if steps_taken >= budget:
                continue
            steps_taken += 1
            for fragment in sorted(learner.received):
                take_over(learner, fragment)
            learner.received.clear()
            tokens = learner.trainer.step(learner.stream).tokens
            learner.step += 1
            learner.tokens += tokens
            tokens_total += tokens
            for fragment in range(len(fragments)):
                learner.c_tokens[fragment] += tokens
                learner.c_steps[fragment] += 1
            for fragment in fragments_due(
                learner.step, sync.inner_steps, sync.num_fragments, sync.warm_steps, sync.warm_inner_steps
            ):
                if fragment in learner.in_flight or learner.c_steps[fragment] == 0:
                    continue  # the previous one is still on its way
                base_round, base_params = learner.bases[fragment]
                local = {n: p.detach().float().cpu() for n, p in learner.trainer.model.named_parameters()}
                delta, sent = channel(i, {n: base_params[n] - local[n] for n in fragments[fragment]})
                bytes_sent += sent
                if sync.on_receive == "rebase":
                    learner.shipped[fragment] = {n: local[n].clone() for n in fragments[fragment]}
                learner.in_flight[fragment] = InFlight(
                    base_round, base_round, delta, learner.c_tokens[fragment], learner.c_steps[fragment]
                )
                schedule(now + sim.link_s, "arrive", i, fragment)
            if steps_taken < budget:
                jitter = 1.0 + sim.jitter * rng.uniform(-1.0, 1.0)
                schedule(now + learner.step_time_s * jitter, "step", i)
            if progress:
                progress("decoupled steps", steps_taken, budget)
    if fresh:  # the final point is the model after the last merge
        load_params(eval_model, global_params)
        curve.record(tokens_total, evaluate(eval_model, eval_set, device))
        eval_times.append(now)
    return DecoupledRun(
        curve=curve, tokens=tokens_total, bytes_per_learner=bytes_sent // len(learners),
        rounds=list(rounds), merged=merged, stale_merged=stale_merged, dropped=dropped, sim_time_s=now,
        steps=[learner.step for learner in learners], eval_times_s=eval_times, rho=rho,
    )  # fmt: skip
