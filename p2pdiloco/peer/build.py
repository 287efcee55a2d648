"""What a learner trains with, built from the run config: the model, the global state's
fragments, the data stream and held-out set, and the inner trainer.

Kept apart from the roles so that a multi-process learner (`training.ranks`) builds the
same things in the same order on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from p2pdiloco.config import RunConfig
from p2pdiloco.errors import ConfigError
from p2pdiloco.protocol.fragments import frame_problem, partition_fragments
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.data import Corpus, heldout_batches, learner_batches
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import RankGroup
from p2pdiloco.training.train import InnerTrainer, resolve_device
from p2pdiloco.wire import WireLimits


@dataclass
class Training:
    """A learner's model, data and the replica of the global state it starts from."""

    state: GlobalState
    trainer: InnerTrainer
    batches: Iterator[torch.Tensor]
    eval_set: list[torch.Tensor]
    device: str


def data_rank(peer_id: str, configured: int) -> int:
    """This learner's data shard: the configured one, else one drawn from its peer id."""
    if configured >= 0:
        return configured
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little")


def build_training(
    config: RunConfig,
    peer_id: str,
    ranks: RankGroup | None,
    limits: WireLimits,
    on_progress: Callable[[str, int, int], None],
) -> Training:
    """Build the model, the fragments' global state, the data and the trainer (ConfigError
    when a fragment would not fit the wire's limits)."""
    options = config.peer
    device = ranks.device if ranks else resolve_device(config.train.device)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    model = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    params = {n: p.detach() for n, p in model.named_parameters()}
    sizes = {n: p.numel() for n, p in params.items()}
    fragments = partition_fragments(sizes, config.sync.num_fragments)
    too_big = frame_problem(sizes, fragments, limits.max_total_elements, limits.max_frame_bytes)
    if too_big:
        raise ConfigError(too_big)
    state = GlobalState(params, fragments, config.outer)
    corpus = Corpus.from_config(config.data, lambda done, total: on_progress("data", done, total))
    rank = data_rank(peer_id, options.data_rank)
    if ranks is not None:  # this rank's part of the learner's shard (see ranks)
        batches = ranks.batches(corpus, rank, options.data_shards, config)
    else:
        batches = learner_batches(
            corpus, rank, options.data_shards, config.train.batch_size, config.model.seq_len, config.train.seed
        )
    eval_set = (
        heldout_batches(corpus, options.eval_batches, config.train.batch_size, config.model.seq_len)
        if options.eval_batches
        else []
    )
    trainer = ranks.trainer(model, config.train) if ranks else InnerTrainer(model, config.train, device)
    return Training(state, trainer, batches, eval_set, str(device))
