"""The inner loop: AdamW with warm-up + cosine, clipping, accumulation, bf16 autocast on CUDA."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from p2pdiloco.config import TrainConfig
from p2pdiloco.errors import DeviceError


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
            import torch_xla.core.xla_model as xm  # imported only when asked for
        except ImportError:
            raise DeviceError(
                "train.device=xla needs torch_xla: pip install 'p2pdiloco[tpu]'"
            ) from None
        return xm.xla_device()
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

    loss: float
    """Mean training loss over the step's micro-batches, in nats."""
    tokens: int
    """Tokens (predicted positions) processed."""
    lr: float
    """Learning rate used."""


class InnerTrainer:
    """Owns one replica's model and inner optimizer and takes inner steps on it."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device) -> None:
        self.model = model.to(device)
        self.config = config
        self.device = device
        self.optimizer = make_inner_optimizer(self.model, config)
        self.step_index = 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        # bf16 autocast on CUDA only: CPU autocast is slower than fp32 on most machines.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, batches: Iterator[torch.Tensor]) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches drawn from `batches`."""
        lr = lr_at(self.step_index, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        total_loss, tokens = 0.0, 0
        for _ in range(self.config.grad_accum):
            batch = next(batches).to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.model.loss(batch)
            (loss / self.config.grad_accum).backward()
            total_loss += float(loss.detach())
            tokens += batch.shape[0] * (batch.shape[1] - 1)
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return StepResult(loss=total_loss / self.config.grad_accum, tokens=tokens, lr=lr)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean held-out loss (nats per token) of `model` over fixed batches."""
    was_training = model.training
    model.eval()
    losses = [float(model.loss(batch.to(device))) for batch in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
