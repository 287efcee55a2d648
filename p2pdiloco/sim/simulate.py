"""In-process DiLoCo simulator and its synchronous data-parallel baseline.

M learners run round-robin in one process: each round every learner starts from the
global parameters, takes H inner steps on its own shard, and sends its delta; each
fragment's deltas are merged as the swarm merges a window (`common.CanonicalChain`:
screening, token weights, the merge rule, the outer codec) and one outer Nesterov step is
applied. The baseline averages gradients of the same M micro-batches every step (the same
tokens, the same compute), which is what synchronous data parallel on M workers does.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from p2pdiloco.config import RunConfig, replace
from p2pdiloco.outer.screening import Candidate
from p2pdiloco.outer.step import Params, pseudo_gradient
from p2pdiloco.sim.common import (
    CanonicalChain,
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
from p2pdiloco.sim.decoupled import run_decoupled
from p2pdiloco.training.data import Corpus, heldout_batches
from p2pdiloco.training.model import build_model, count_parameters
from p2pdiloco.training.train import InnerTrainer, evaluate, resolve_device

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """Figures of a simulated DiLoCo run and, optionally, the synchronous baseline."""

    learners: int
    inner_steps: int
    rounds: int
    merge_rule: str
    num_parameters: int
    tokens: int
    diloco: LossCurve
    sync: LossCurve | None
    diloco_bytes_per_learner: int
    sync_bytes_per_learner: int
    mode: str = "lockstep"
    schedule: dict | None = None
    """Decoupled mode: rounds reached per fragment, deltas merged, merged stale, dropped,
    simulated seconds (`decoupled.DecoupledRun`)."""

    @property
    def diloco_eval_loss(self) -> float:
        return self.diloco.eval_loss[-1]

    @property
    def sync_eval_loss(self) -> float | None:
        return self.sync.eval_loss[-1] if self.sync else None

    @property
    def comm_reduction(self) -> float:
        """Bytes a learner sends in the synchronous run / bytes it sends in the DiLoCo run."""
        return self.sync_bytes_per_learner / max(self.diloco_bytes_per_learner, 1)


def codec_channel(config: RunConfig, codec_name: str) -> DeltaChannel:
    """Send each delta through a codec, with per-learner error feedback when the run asks.

    The receiver merges what it decoded, exactly as a synchronizer would; the bytes counted
    are the encoded payloads.
    """
    from p2pdiloco.compress import ErrorFeedback, decode_tensors, encode_tensors, make_codec

    c = config.compress
    codec = make_codec(
        codec_name,
        block_size=c.block_size,
        topk_fraction=c.topk_fraction,
        sparse_chunk=c.sparse_chunk,
        sparse_k=c.sparse_k,
        zstd=c.zstd,
    )
    use_feedback = c.error_feedback and codec_name != "fp32"
    feedback: dict[int, ErrorFeedback] = {}

    def channel(learner: int, delta: Params) -> tuple[Params, int]:
        fb = feedback.setdefault(learner, ErrorFeedback()) if use_feedback else None
        encoded = encode_tensors(codec, delta, fb)
        return decode_tensors(encoded), sum(e.nbytes for e in encoded.values())

    return channel


def round_lengths(config: RunConfig) -> list[int]:
    """Inner steps of each lockstep round: the warm start's short rounds, then H steps each,
    as `fragments_due` schedules them, within `simulate.rounds * H` steps in all."""
    sync = config.sync
    total = config.simulate.rounds * sync.inner_steps
    warm = min(sync.warm_steps, total) // sync.warm_inner_steps
    return [sync.warm_inner_steps] * warm + [sync.inner_steps] * (
        (total - warm * sync.warm_inner_steps) // sync.inner_steps
    )


def run_diloco(
    config: RunConfig,
    corpus: Corpus,
    eval_set: list[torch.Tensor],
    *,
    channel: DeltaChannel = fp32_channel,
    progress: Progress | None = None,
) -> tuple[LossCurve, int, int]:
    """Simulated DiLoCo. Returns (loss curve, tokens processed, bytes sent per learner)."""
    config = schedule_config(config)
    device = resolve_device(config.train.device)
    num_learners = config.simulate.learners
    base = build_model(
        config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len
    )
    chain = CanonicalChain(config, global_state_of(base))
    eval_model = copy.deepcopy(base).to(device)
    trainers = [
        InnerTrainer(copy.deepcopy(base), config.train, device) for _ in range(num_learners)
    ]
    streams = learner_streams(config, corpus, num_learners)
    # every delta reaches every window: a quorum above M would never close one
    quorum = min(config.sync.min_quorum, num_learners)
    curve, tokens_total, bytes_sent = LossCurve(), 0, 0
    curve.record(0, evaluate(eval_model, eval_set, device))
    lengths = round_lengths(config)
    for round_index, steps in enumerate(lengths):
        candidates = []
        for rank, trainer in enumerate(trainers):
            candidate, sent = _inner_round(
                rank, trainer, streams[rank], chain.state.params, steps, channel
            )
            candidates.append(candidate)
            tokens_total += candidate.tokens
            bytes_sent += sent
        _merge_every_fragment(chain, candidates, quorum)
        done = round_index + 1
        if done % config.simulate.eval_every_rounds == 0 or done == len(lengths):
            load_params(eval_model, chain.state.params)
            curve.record(tokens_total, evaluate(eval_model, eval_set, device))
            log.info(
                "diloco round=%d tokens=%d eval_loss=%.4f", done, tokens_total, curve.eval_loss[-1]
            )
        if progress:
            progress("diloco", done, len(lengths))
    return curve, tokens_total, bytes_sent // num_learners


def _inner_round(
    rank: int,
    trainer: InnerTrainer,
    batches: Iterator[torch.Tensor],
    global_params: Params,
    steps: int,
    channel: DeltaChannel,
) -> tuple[Candidate, int]:
    """One learner's round: `steps` inner steps from the global parameters, then its delta
    through the channel. Returns (its contribution as received, bytes it sent)."""
    # a result arrived: overwrite the replica with the global parameters
    load_params(trainer.model, global_params)
    tokens = 0
    for _ in range(steps):
        tokens += trainer.step(batches).tokens
    delta, sent = channel(
        rank, pseudo_gradient(global_params, dict(trainer.model.named_parameters()))
    )
    return Candidate(peer_id(rank), delta, tokens, steps), sent


def _merge_every_fragment(chain: CanonicalChain, candidates: list[Candidate], quorum: int) -> None:
    """Lockstep: every fragment's window holds every learner's part of it, and merges."""
    for fragment, names in enumerate(chain.fragments):
        window = [
            Candidate(c.peer, {n: c.delta[n] for n in names}, c.tokens, c.steps) for c in candidates
        ]
        if chain.merge(fragment, window, quorum) is None:
            log.warning(
                "diloco no quorum round=%d fragment=%d: the screening kept fewer than %d deltas",
                chain.state.round_of(fragment), fragment, quorum,
            )  # fmt: skip


def run_sync_baseline(
    config: RunConfig,
    corpus: Corpus,
    eval_set: list[torch.Tensor],
    *,
    progress: Progress | None = None,
) -> tuple[LossCurve, int, int]:
    """Synchronous data parallel on the same micro-batches. Returns (curve, tokens, bytes/learner)."""
    config = schedule_config(config)
    device = resolve_device(config.train.device)
    num_learners, steps_per_round = config.simulate.learners, config.sync.inner_steps
    model = build_model(
        config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len
    )
    # Averaging M workers' gradients == accumulating their M micro-batches in one replica.
    train = {"grad_accum": config.train.grad_accum * num_learners}
    if config.simulate.baseline_lr:
        train["lr"] = config.simulate.baseline_lr
    trainer = InnerTrainer(model, replace(config, train=train).train, device)
    streams = learner_streams(config, corpus, num_learners)

    def round_robin():
        while True:
            for stream in streams:
                for _ in range(config.train.grad_accum):
                    yield next(stream)

    batches = round_robin()
    curve, tokens_total = LossCurve(), 0
    curve.record(0, evaluate(trainer.model, eval_set, device))
    total_steps = config.simulate.rounds * steps_per_round
    for step in range(1, total_steps + 1):
        tokens_total += trainer.step(batches).tokens
        if step % (steps_per_round * config.simulate.eval_every_rounds) == 0 or step == total_steps:
            curve.record(tokens_total, evaluate(trainer.model, eval_set, device))
            log.info(
                "sync step=%d tokens=%d eval_loss=%.4f", step, tokens_total, curve.eval_loss[-1]
            )
        if progress and step % steps_per_round == 0:
            progress("sync", step // steps_per_round, config.simulate.rounds)
    # Every step each worker sends its full fp32 gradient.
    bytes_per_learner = total_steps * count_parameters(model) * 4
    return curve, tokens_total, bytes_per_learner


def _eval_set(config: RunConfig, corpus: Corpus) -> list[torch.Tensor]:
    """The held-out batches every run of a simulation is evaluated on."""
    return heldout_batches(
        corpus, config.simulate.eval_batches, config.train.batch_size, config.model.seq_len
    )


def baseline_alone(config: RunConfig, corpus: Corpus | None = None) -> tuple[LossCurve, int, int]:
    """The synchronous baseline by itself, on `simulate`'s held-out batches: (curve, tokens,
    bytes a learner). For a process of its own beside the DiLoCo run (the same figures)."""
    corpus = corpus or Corpus.from_config(config.data)
    return run_sync_baseline(config, corpus, _eval_set(config, corpus))


def simulate(
    config: RunConfig,
    *,
    corpus: Corpus | None = None,
    channel: DeltaChannel = fp32_channel,
    progress: Progress | None = None,
) -> SimulationResult:
    """Run the DiLoCo simulation and (if `simulate.baseline`) the synchronous baseline."""
    corpus = corpus or Corpus.from_config(config.data)
    eval_set = _eval_set(config, corpus)
    schedule = None
    if config.simulate.mode == "decoupled":
        run = run_decoupled(config, corpus, eval_set, channel=channel, progress=progress)
        diloco, tokens, diloco_bytes = run.curve, run.tokens, run.bytes_per_learner
        schedule = {
            "rounds": run.rounds, "merged": run.merged, "stale_merged": run.stale_merged,
            "dropped": run.dropped, "sim_time_s": run.sim_time_s,
            "rho_mean": sum(run.rho) / len(run.rho) if run.rho else None,
            "eval_times_s": run.eval_times_s, "steps": run.steps,
            "merged_steps": run.merged_steps, "local_steps": run.local_steps,
            "lost_steps": run.lost_steps, "work_efficiency": run.work_efficiency,
        }  # fmt: skip
    else:
        diloco, tokens, diloco_bytes = run_diloco(
            config, corpus, eval_set, channel=channel, progress=progress
        )
    num_parameters = count_parameters(
        build_model(config.model.preset, max_seq_len=config.model.seq_len)
    )
    # Synchronous DP sends every step's fp32 gradient; known without running it.
    sync, sync_bytes = None, config.simulate.rounds * config.sync.inner_steps * num_parameters * 4
    if config.simulate.baseline:
        sync, _, sync_bytes = run_sync_baseline(config, corpus, eval_set, progress=progress)
    return SimulationResult(
        learners=config.simulate.learners,
        inner_steps=config.sync.inner_steps,
        rounds=config.simulate.rounds,
        merge_rule=config.outer.merge,
        num_parameters=num_parameters,
        tokens=tokens,
        diloco=diloco,
        sync=sync,
        diloco_bytes_per_learner=diloco_bytes,
        sync_bytes_per_learner=sync_bytes,
        mode=config.simulate.mode,
        schedule=schedule,
    )
