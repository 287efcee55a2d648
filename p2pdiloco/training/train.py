"""The inner loop: AdamW with warm-up + cosine, clipping, accumulation, bf16 autocast on CUDA.

A step never waits for the device: the loss stays on it (summed there, read with
`read_loss()` at log points), XLA gets one sync per step, and parameters leave for the
host through `HostStager`. A learner over several processes replaces `loss_module` by
its DDP wrapper (see `ranks`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from p2pdiloco.config import TrainConfig
from p2pdiloco.errors import DeviceError
from p2pdiloco.training.devices import HostStager, device_stats, sync_device


def resolve_device(name: str) -> torch.device:
    """The torch device for `train.device`; raises `DeviceError` if it is not available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "train.device=cuda but no CUDA GPU is visible; use train.device=cpu or auto"
            )
        return torch.device("cuda")
    if name == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise DeviceError(
                "train.device=mps but Apple MPS is not available; use train.device=cpu or auto"
            )
        return torch.device("mps")
    if name == "xla":
        try:
            import torch_xla  # imported only when asked for
        except ImportError:
            raise DeviceError(
                "train.device=xla needs torch_xla: pip install 'p2pdiloco[tpu]'"
            ) from None
        return torch_xla.device()
    raise DeviceError(f"unknown device {name!r}; choose auto, cpu, cuda, mps or xla")


def lr_at(step: int, config: TrainConfig) -> float:
    """Inner learning rate at `step` (0-based): linear warm-up, then cosine to the floor."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(config.total_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_inner_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and vectors are not decayed)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


@dataclass(frozen=True)
class StepResult:
    """What one inner step did."""

    loss: torch.Tensor
    """Mean training loss over the step's micro-batches (nats), a 0-dim tensor on the
    training device: reading it waits for the device, so the loop reads `read_loss()`
    at log points instead."""
    tokens: int
    """Tokens (predicted positions) processed."""
    lr: float
    """Learning rate used."""


class LossOf(nn.Module):
    """The model's training loss as a module's forward, so DDP can wrap it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens)


class InnerTrainer:
    """Owns one replica's model and inner optimizer and takes inner steps on it."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device) -> None:
        self.model = model.to(device)
        self.config = config
        self.device = device
        self.optimizer = make_inner_optimizer(self.model, config)
        self.step_index = 0
        self.loss_module: nn.Module = LossOf(self.model)
        """forward(batch) -> loss; a multi-process learner puts its DDP wrapper here."""
        self.host = HostStager(device)
        """Copies fragments to host memory for shipping (pinned and async on CUDA)."""
        self._loss_sum = self._zero()
        self._loss_steps = 0

    def _zero(self) -> torch.Tensor:
        # Made on the host and moved, with one dimension: XLA turns a device-side constant
        # or a moved 0-dim tensor into a constant of the next step's graph, which then
        # differs from the others (one more graph to compile); device data does not.
        return torch.zeros(1, dtype=torch.float32).to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # bf16 autocast on CUDA only: CPU autocast is slower than fp32 on most machines,
        # and on a TPU XLA already runs matmuls in bf16 by default.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP: all-reduce gradients once per step, after the last micro-batch.
        no_sync = getattr(self.loss_module, "no_sync", None)
        return no_sync() if no_sync is not None and not last else contextlib.nullcontext()

    def step(self, batches: Iterator[torch.Tensor]) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches drawn from `batches`."""
        lr = lr_at(self.step_index, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        accum = self.config.grad_accum
        step_loss, tokens = None, 0
        for index in range(accum):
            batch = next(batches).to(self.device, non_blocking=True)
            with self._grad_sync(last=index == accum - 1):
                with self._autocast():
                    loss = self.loss_module(batch)
                (loss / accum).backward()
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            tokens += batch.shape[0] * (batch.shape[1] - 1)
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean_loss = step_loss / accum
        self._loss_sum = self._loss_sum + mean_loss.float()
        self._loss_steps += 1
        self.step_index += 1
        sync_device(self.device)  # XLA: the whole step is one graph, run here
        return StepResult(loss=mean_loss, tokens=tokens, lr=lr)

    def read_loss(self) -> float | None:
        """Mean training loss (nats) of the steps since the last read; None if none ran.

        The one place the loss leaves the device: call it at log points, not every step.
        """
        if self._loss_steps == 0:
            return None
        mean = float(self._loss_sum.cpu()[0]) / self._loss_steps
        self._loss_sum, self._loss_steps = self._zero(), 0
        return mean

    def params_written(self, names: Iterable[str]) -> None:
        """Parameters `names` were written from outside a step (a received fragment, a
        reset). XLA runs the writes now, as their own small graph; a multi-process learner
        also sends them to its other ranks before the next step (see `ranks`)."""
        sync_device(self.device)

    def finish(self) -> dict | None:
        """The loop is over: release helpers (other ranks); returns facts worth an event
        (the device's final counters on an accelerator)."""
        return self.device_stats() or None

    def device_stats(self) -> dict[str, int]:
        """Counters of the training device (see `devices.device_stats`)."""
        return device_stats(self.device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean held-out loss (nats per token) of `model` over fixed batches."""
    was_training = model.training
    model.eval()
    losses = [float(model.loss(batch.to(device))) for batch in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
