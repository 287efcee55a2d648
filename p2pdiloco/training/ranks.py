"""A learner that spans several processes (torchrun): DDP inside, one voice in the swarm.

`torchrun --nproc-per-node N -m p2pdiloco join ...` starts N copies of the peer. Rank 0
is the peer: it joins the DHT, synchronises when elected and runs the learner loop.
Every other rank only takes inner steps beside it (`follow_lead`). DDP all-reduces the
gradients (gloo on the CPU, nccl on CUDA), so every rank holds the same parameters and
rank 0 takes the delta from them: the learner's delta is that of one replica trained on
N times the batch, and it claims N times its per-rank tokens in the merge weights
(synchronizers bound every claim by `screening.token_factor` times the median claim).

Rank 0 writes into its parameters from outside a step (a received global fragment, a
reset after divergence, a checkpoint). So before every step it broadcasts a header (stop?
first step? which parameters changed), then the changed parameters in one flat buffer.
The first step also carries rank 0's inner-optimizer state and step index, so a learner
restored from a checkpoint starts every rank from it. Any rank dying ends the learner
(the collective fails and the process exits; torchrun tears down the rest).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from p2pdiloco.config import RunConfig, TrainConfig
from p2pdiloco.errors import ConfigError, DeviceError
from p2pdiloco.training.data import BatchStream, Corpus, concatenate
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer, StepResult, resolve_device

log = logging.getLogger(__name__)

__all__ = ["RankGroup", "RankInfo", "RankedTrainer", "detect_ranks", "follow_lead", "join_ranks"]

RANK_TIMEOUT_S = 3600.0
"""Bound on any one collective, seconds. It must cover rank 0's longest quiet spell, when
the other ranks wait for it: joining (DHT start, waiting for peers, downloading state)."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in a multi-process learner (from torchrun's environment)."""

    rank: int
    """0 for the process that talks to the swarm."""
    world_size: int
    """Processes in this learner."""
    local_rank: int
    """Index on this machine: the CUDA device it trains on."""

    @property
    def is_lead(self) -> bool:
        return self.rank == 0


def detect_ranks(environ: Mapping[str, str] = os.environ) -> RankInfo | None:
    """The torchrun layout of this process; None for a single-process learner."""
    try:
        world_size = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
        local_rank = int(environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ConfigError(
            "WORLD_SIZE, RANK and LOCAL_RANK must be integers: start the learner with torchrun"
        ) from None
    if world_size <= 1:
        return None
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK must be in [0, {world_size}), got {rank}")
    return RankInfo(rank, world_size, local_rank)


def join_ranks(device_name: str, environ: Mapping[str, str] = os.environ) -> RankGroup | None:
    """The process group of this learner if torchrun started it (None otherwise)."""
    info = detect_ranks(environ)
    return RankGroup(info, device_name) if info is not None else None


@dataclass(frozen=True)
class Header:
    """What rank 0 tells the other ranks before each step."""

    stop: bool
    first: bool
    written: tuple[bool, ...]
    """Per parameter (in `named_parameters` order): rank 0 wrote it since the last step."""


class RankGroup:
    """This learner's processes: init, data split, DDP, and rank 0's per-step broadcast."""

    def __init__(self, info: RankInfo, device_name: str, timeout_s: float = RANK_TIMEOUT_S):
        if device_name == "xla":
            raise DeviceError(
                "train.device=xla is not supported in a multi-process learner: start one "
                "learner per TPU host (see docs/join.md)"
            )
        device = resolve_device(device_name)
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(device)
        elif device.type != "cpu":
            raise DeviceError(f"a multi-process learner trains on cuda or cpu, not {device.type}")
        self.info = info
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s))
        self._first = True
        log.info(
            "rank group joined rank=%d world_size=%d backend=%s device=%s",
            info.rank,
            info.world_size,
            self.backend,
            device,
        )

    @property
    def is_lead(self) -> bool:
        return self.info.is_lead

    def share(self, value: int) -> int:
        """Rank 0's `value`, on every rank."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())

    def batches(
        self, corpus: Corpus, data_rank: int, data_shards: int, config: RunConfig
    ) -> BatchStream:
        """This rank's batch stream: the learner's data shard (rank 0's `data_rank`), split
        by document across the ranks, each part in its own order."""
        data_rank = self.share(data_rank)
        seed = config.train.seed
        docs = corpus.shard(data_rank % max(data_shards, 1), data_shards, seed)
        mine = docs[self.info.rank :: self.info.world_size] or docs
        stream_seed = (seed * 1_000_003 + data_rank) * 1_000_003 + self.info.rank
        return BatchStream(
            concatenate(mine, stream_seed),
            config.train.batch_size,
            config.model.seq_len,
            stream_seed,
        )

    def trainer(self, model: nn.Module, config: TrainConfig) -> RankedTrainer:
        """An inner trainer whose gradients DDP averages across the ranks (a collective)."""
        return RankedTrainer(model, config, self)

    # --- the per-step broadcast -----------------------------------------------------------

    def lead(self, trainer: RankedTrainer, written: Iterable[str], stop: bool) -> None:
        """Rank 0, before a step (or to stop): send the header and what it names."""
        names = set(written)
        header = Header(stop, self._first, tuple(n in names for n, _ in trainer.named))
        self._send_header(header)
        self._exchange(trainer, header)

    def follow(self, trainer: RankedTrainer) -> bool:
        """Other ranks, before a step: take rank 0's header and what it names. False: stop."""
        header = self._receive_header(len(trainer.named))
        self._exchange(trainer, header)
        return not header.stop

    def _send_header(self, header: Header) -> None:
        flags = [int(header.stop), int(header.first), *map(int, header.written)]
        dist.broadcast(torch.tensor(flags, dtype=torch.uint8, device=self.device), src=0)

    def _receive_header(self, num_params: int) -> Header:
        flags = torch.empty(2 + num_params, dtype=torch.uint8, device=self.device)
        dist.broadcast(flags, src=0)
        values = [bool(v) for v in flags.tolist()]
        return Header(values[0], values[1], tuple(values[2:]))

    @torch.no_grad()
    def _exchange(self, trainer: RankedTrainer, header: Header) -> None:
        self._first = False
        if header.first:
            state = [
                {
                    "step_index": trainer.step_index,
                    "optimizer": _to_cpu(trainer.optimizer.state_dict()),
                }
            ]
            dist.broadcast_object_list(state, src=0, device=self.device)
            if not self.is_lead:
                trainer.step_index = int(state[0]["step_index"])
                trainer.optimizer.load_state_dict(state[0]["optimizer"])
        params = [p for (_, p), w in zip(trainer.named, header.written, strict=True) if w]
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=0)
        if not self.is_lead:
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def digests(self, model: nn.Module) -> list[str]:
        """Every rank's parameter digest (rank 0's first): the ranks must agree."""
        digest = hashlib.sha256()
        for _, p in sorted(model.named_parameters()):
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        gathered: list[str | None] = [None] * self.info.world_size
        dist.all_gather_object(gathered, digest.hexdigest()[:16])
        return [str(g) for g in gathered]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(value):
    """A state dict with every tensor on the CPU (it is pickled to the other ranks)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's option not to broadcast buffers before every forward: ours (the rotary
    tables) are constants. Newer torch renamed it; the XLA venv pins an older one."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {key: False}


class RankedTrainer(InnerTrainer):
    """An `InnerTrainer` on one rank of a multi-process learner.

    Rank 0 broadcasts before each step what it wrote since the last one; every rank then
    steps under DDP. A step counts the tokens of all ranks: the learner processed them.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, group: RankGroup) -> None:
        super().__init__(model, config, group.device)
        self.group = group
        self.named = list(self.model.named_parameters())
        self.loss_module = DistributedDataParallel(
            self.loss_module,
            device_ids=[group.device.index] if group.device.type == "cuda" else None,
            **_no_buffer_sync(),
        )
        self._written: set[str] = {n for n, _ in self.named}
        self._finished = False

    def step(self, batches: Iterator[torch.Tensor]) -> StepResult:
        if self.group.is_lead:
            self.group.lead(self, self._written, stop=False)
            self._written = set()
        result = super().step(batches)
        return replace(result, tokens=result.tokens * self.group.info.world_size)

    def params_written(self, names: Iterable[str]) -> None:
        super().params_written(names)
        self._written.update(names)

    def finish(self) -> dict | None:
        """Rank 0: tell the other ranks to stop, check that every rank holds the same
        parameters, and leave the process group. Facts for an event, once."""
        if self._finished or not self.group.is_lead:
            return None
        self._finished = True
        self.group.lead(self, self._written, stop=True)  # the last fragments taken over too
        self._written = set()
        digests = self.group.digests(self.model)
        self.group.close()
        if len(set(digests)) != 1:
            log.warning("ranks diverged digests=%s", digests)
        return {
            **self.device_stats(),
            "world_size": self.group.info.world_size,
            "rank_digests": digests,
            "ranks_identical": len(set(digests)) == 1,
        }


def follow_lead(group: RankGroup, config: RunConfig) -> int:
    """The life of a rank other than 0: take inner steps beside rank 0 until it stops.

    Builds what `peer.build.build_training` builds for training, in the same order of collectives
    (data rank, then DDP), and nothing of the network. Returns an exit code.
    """
    if config.peer.torch_threads > 0:
        torch.set_num_threads(config.peer.torch_threads)
    model = build_model(
        config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len
    )
    corpus = Corpus.from_config(config.data)
    batches = group.batches(corpus, 0, config.peer.data_shards, config)
    trainer = group.trainer(model, config.train)
    steps = 0
    while group.follow(trainer):
        trainer.step(batches)
        steps += 1
    digests = group.digests(trainer.model)
    group.close()
    log.info("rank %d left after steps=%d digests=%s", group.info.rank, steps, digests)
    return 0
