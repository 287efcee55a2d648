"""Error feedback for the lossy codecs: what a codec drops this round is sent in a later one.

Pure tensor bookkeeping, kept apart from the codecs: a learner owns one `ErrorFeedback`
and checkpoints it; `tensors.encode_tensors` uses it around any codec.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class ErrorFeedback:
    """Per-tensor residuals of a lossy codec, added back into the next delta (SparseLoCo).

    What a codec drops this round is sent in a later one, so the sum of what was decoded
    tracks the sum of the true deltas up to one bounded residual.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """`delta + residual[name]` in fp32 (a copy of `delta` when there is no residual)."""
        delta = delta.detach().to(torch.float32)
        residual = self._residuals.get(name)
        if residual is None:
            return delta.clone()
        if residual.shape != delta.shape:
            raise ValueError(
                f"error feedback for {name!r} has shape {tuple(residual.shape)}, "
                f"delta has {tuple(delta.shape)}"
            )
        return delta + residual.to(delta.device)

    def update(self, name: str, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep `sent_input - decoded`: what the receiver did not get of what we encoded."""
        self._residuals[name] = (
            sent_input.detach().to(torch.float32) - decoded.detach().to(torch.float32)
        ).cpu()

    def take_back(self, name: str, delta: torch.Tensor, decoded: torch.Tensor) -> None:
        """Undo `update` for a delta nobody merged (folded back or refused): `delta` is the
        delta before `compensate`, `decoded` what its bytes decode to. The residual goes
        back to what it was before (`residual - (delta - decoded)`), so the work it held
        from merged deltas stays while the unmerged delta's own part leaves with it: a
        folded delta's work is all in the model again and its next delta carries it, once."""
        residual = self._residuals.get(name)
        if residual is None:
            raise ValueError(f"no error feedback for {name!r} to take back")
        self._residuals[name] = residual - (
            delta.detach().to(torch.float32).cpu() - decoded.detach().to(torch.float32).cpu()
        )

    def residual(self, name: str) -> torch.Tensor | None:
        """The residual kept for `name`, if any."""
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual (e.g. after the fragment was overwritten), or all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by tensor name (copies), for checkpoints."""
        return {name: res.clone() for name, res in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all residuals with those of `state` (as `state_dict` returned)."""
        residuals = {}
        for name, res in state.items():
            if not isinstance(name, str) or not isinstance(res, torch.Tensor):
                raise ValueError(f"error feedback state must map names to tensors, got {name!r}")
            residuals[name] = res.detach().to(device="cpu", dtype=torch.float32).clone()
        self._residuals = residuals
