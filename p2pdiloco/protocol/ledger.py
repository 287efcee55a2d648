"""Where a learner's inner steps go: the on-receive rule and the work ledger (goodput).

Decoupled DiLoCo's promise is that no computed step is lost: every step a learner takes
ends up in exactly one committed update, or stays in its local progress for the next
delta, or is reported lost with a reason (design brief, invariant 6). Two rules keep it.

**On receive** (`take_over`). The replica stands on a base `b` (the global parameters it
last took over) plus its local progress `theta - b`. When a new global `g` arrives, the
default `rebase` puts the update under *all* of that progress, `theta <- g + (theta - b)`,
whether or not a snapshot of the shipped parameters exists; then, if the delta shipped
against `b` is in a committed update, its progress leaves the local model
(`theta -= progress_shipped`), because the global now carries it. A delta no committed
round holds is *folded*: its progress simply stays local and the next delta carries it,
at the new base and full weight, instead of being resent stale or dropped. `overwrite`
(the paper's choice) and `mix` (Streaming DiLoCo's alpha) throw local progress away and
say how much.

**Honest claims** (`WorkLedger`). A claim (tokens, steps) is the work in the local
progress when the delta is taken, so it equals what the delta carries; on a merge the
carried work is subtracted from the counters (not zeroed, as before: the in-flight steps
stayed in the model and went unclaimed into the next delta).

Pure: tensors and integers in, tensors and integers out; no network, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

Params = dict[str, torch.Tensor]

@dataclass(frozen=True)
class Claim:
    """The work one delta carries: what its learner claims and what its bytes hold."""

    tokens: int
    steps: int
    first_step: int
    """The learner's step count at the first step the delta carries (1-based)."""
    last_step: int
    """... and at the last one (equal to the step count when it was taken)."""


@dataclass
class WorkLedger:
    """One learner's work in one fragment: tokens and steps in the local progress.

    `tokens` / `steps` are the work of the local progress `theta - base` not yet in any
    committed update: the next claim. Counted per fragment, because each fragment's
    delta carries every step since that fragment's work last left the model.
    """

    tokens: int = 0
    steps: int = 0
    last_step: int = 0
    """The learner's step count at the last counted step."""

    def count(self, tokens: int, step: int) -> None:
        """One inner step of `tokens` tokens, the learner's `step`-th."""
        self.tokens += tokens
        self.steps += 1
        self.last_step = step

    def claim(self) -> Claim:
        """What a delta taken now carries (the local progress, all of it)."""
        first = self.last_step - self.steps + 1
        return Claim(self.tokens, self.steps, first, self.last_step)

    def leave(self, claim: Claim) -> None:
        """The claimed work left the local progress (merged, or lost with a reason)."""
        self.tokens = max(0, self.tokens - claim.tokens)
        self.steps = max(0, self.steps - claim.steps)

    def come_back(self, claim: Claim) -> None:
        """The claimed work is local again (a rival record without it won its round)."""
        self.tokens += claim.tokens
        self.steps += claim.steps

    def clear(self) -> Claim:
        """All local work is gone (overwrite, a reset): what was lost."""
        lost = self.claim()
        self.tokens = self.steps = 0
        return lost


@torch.no_grad()
def take_over(
    params: Mapping[str, torch.Tensor],
    old_base: Mapping[str, torch.Tensor],
    new_base: Mapping[str, torch.Tensor],
    mode: str = "rebase",
    mix_alpha: float = 0.5,
    leaving: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Put the new global `new_base` under the replica's `params` (in place, by name).

    `rebase`: `theta <- new_base + ((theta - old_base) - leaving)`: all local progress
    kept but `leaving`, the progress of a delta the new global now carries. Computed in
    that order so a replica that took no step since it shipped lands exactly on
    `new_base`, bit for bit, as a lockstep learner does.
    `overwrite`: `theta <- new_base`. `mix`: `theta <- (1 - a) theta + a new_base`.
    Names are those of `new_base`; bases are host fp32, params on any device.
    """
    for name, target in new_base.items():
        param = params[name]
        target = target.to(param.device, param.dtype)
        if mode == "rebase":
            local = param.detach() - old_base[name].to(param.device, param.dtype)
            if leaving is not None:
                local = local - leaving[name].to(param.device, param.dtype)
            param.copy_(target + local)
        elif mode == "mix":
            param.mul_(1 - mix_alpha).add_(target, alpha=mix_alpha)
        else:
            param.copy_(target)


@torch.no_grad()
def move_progress(params: Mapping[str, torch.Tensor], progress: Mapping[str, torch.Tensor], sign: int) -> None:
    """Take a delta's progress out of the local model (`sign = -1`: it is in the global
    now) or put it back (`sign = +1`: the record holding it lost its round)."""
    for name, value in progress.items():
        param = params[name]
        param.add_(value.to(param.device, param.dtype), alpha=float(sign))


def progress_of(local: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> Params:
    """`local - base` in fp32 on the host: the progress a delta `base - local` carries."""
    return {n: local[n].detach().float().cpu() - base[n].float() for n in base}
