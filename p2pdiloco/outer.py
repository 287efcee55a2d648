"""The outer step and the merge rules, as pure functions of tensors (no I/O, no network).

Conventions: a *delta* (pseudo-gradient) is `theta_global_base - theta_local`, so the
outer optimizer *descends* along it, as in DiLoCo (arXiv 2311.08105). Parameters are
`dict[str, Tensor]` of fp32 CPU tensors; the global state and the outer step stay on the
CPU in fp32 so every peer computes the same bits whatever its accelerator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

Params = dict[str, torch.Tensor]

_EPS = 1e-12


def pseudo_gradient(
    global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]
) -> Params:
    """Delta of a learner: global base minus its local parameters, per tensor."""
    return {
        name: global_params[name] - local_params[name].detach().float().cpu()
        for name in global_params
    }


# --- weights -----------------------------------------------------------------------------


def cap_shares(weights: Sequence[float], max_share: float) -> list[float]:
    """Normalise weights to sum to one with no entry above `max_share` (water-filling).

    Excess above the cap is redistributed over the uncapped entries in proportion to
    their weight. When the cap cannot be met (n * max_share < 1) all get an equal share.
    """
    n = len(weights)
    if n == 0:
        return []
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    total = float(sum(weights))
    if total <= 0.0 or n * max_share <= 1.0:
        return [1.0 / n] * n
    shares = [w / total for w in weights]
    capped = [False] * n
    while True:
        over = [i for i in range(n) if not capped[i] and shares[i] > max_share]
        if not over:
            return shares
        for i in over:
            capped[i] = True
        free = 1.0 - max_share * sum(capped)
        rest = sum(weights[i] for i in range(n) if not capped[i])
        shares = [
            max_share
            if capped[i]
            else (weights[i] / rest * free if rest > 0 else free / (n - sum(capped)))
            for i in range(n)
        ]


def token_weights(
    tokens: Sequence[int],
    steps: Sequence[int],
    *,
    max_share: float = 1.0,
    staleness: Sequence[int] | None = None,
    staleness_discount: float = 1.0,
) -> list[float]:
    """Decoupled DiLoCo §3.2 weights: `w = c_tokens * (c_tokens / c_steps)`, normalised.

    Quantity (tokens) times quality (tokens per step, i.e. batch size); each round of
    staleness multiplies a weight by `staleness_discount`; then no share above `max_share`.
    """
    if len(tokens) != len(steps):
        raise ValueError("tokens and steps must have one entry per learner")
    raw = []
    for index, (c_tokens, c_steps) in enumerate(zip(tokens, steps, strict=True)):
        w = c_tokens * (c_tokens / c_steps) if c_steps > 0 and c_tokens > 0 else 0.0
        if staleness is not None:
            w *= staleness_discount ** staleness[index]
        raw.append(w)
    return cap_shares(raw, max_share)


def uniform_weights(count: int) -> list[float]:
    """Equal weights summing to one."""
    return [1.0 / count] * count if count else []


# --- merge rules -------------------------------------------------------------------------


def merge_weighted(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> Params:
    """Weighted mean of deltas, per tensor (weights are assumed to sum to one)."""
    if not deltas:
        raise ValueError("cannot merge zero deltas")
    merged: Params = {}
    for name in deltas[0]:
        acc = torch.zeros_like(deltas[0][name], dtype=torch.float32)
        for delta, weight in zip(deltas, weights, strict=True):
            acc.add_(delta[name].float(), alpha=float(weight))
        merged[name] = acc
    return merged


def merge_mean(deltas: Sequence[Mapping[str, torch.Tensor]]) -> Params:
    """Plain mean of deltas (DiLoCo's original rule)."""
    return merge_weighted(deltas, uniform_weights(len(deltas)))


def _weighted_median(values: list[float], weights: Sequence[float]) -> float:
    order = sorted(range(len(values)), key=lambda i: values[i])
    half, acc = 0.5 * sum(weights), 0.0
    for i in order:
        acc += weights[i]
        if acc >= half:
            return values[i]
    return values[order[-1]]


def merge_radial(
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    norm: str = "mean",
    plain_mean_names: frozenset[str] = frozenset(),
    cancel_ratio: float = 1e-3,
) -> Params:
    """Radial-directional merge, per tensor: `(Σ w‖Δ‖) · unit(Σ w · unit(Δ))`.

    The merged norm is the weighted mean (or weighted median, for untrusted peers) of the
    learners' norms, so it does not shrink like 1/sqrt(M) when directions disagree, and
    the outer lr need not be retuned when M changes. Tensors in `plain_mean_names`
    (embeddings) and tensors whose mean direction cancels (its norm below `cancel_ratio`)
    fall back to the weighted mean.
    """
    if not deltas:
        raise ValueError("cannot merge zero deltas")
    if norm not in ("mean", "median"):
        raise ValueError(f"norm must be 'mean' or 'median', got {norm!r}")
    merged: Params = {}
    for name in deltas[0]:
        tensors = [d[name].float() for d in deltas]
        if name in plain_mean_names:
            merged[name] = merge_weighted([{name: t} for t in tensors], weights)[name]
            continue
        norms = [float(torch.linalg.vector_norm(t)) for t in tensors]
        direction = torch.zeros_like(tensors[0])
        for t, n, w in zip(tensors, norms, weights, strict=True):
            if n > _EPS:
                direction.add_(t, alpha=float(w) / n)
        direction_norm = float(torch.linalg.vector_norm(direction))
        if direction_norm < cancel_ratio * sum(weights):
            merged[name] = merge_weighted([{name: t} for t in tensors], weights)[name]
            continue
        radius = (
            _weighted_median(norms, weights)
            if norm == "median"
            else sum(w * n for w, n in zip(weights, norms, strict=True)) / max(sum(weights), _EPS)
        )
        merged[name] = direction.mul_(radius / direction_norm)
    return merged


def merge(
    rule: str,
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    **radial_options: object,
) -> Params:
    """Dispatch on `outer.merge`: mean (ignores weights), token (weighted mean) or radial."""
    if rule == "mean":
        return merge_mean(deltas)
    if rule == "token":
        return merge_weighted(deltas, weights)
    if rule == "radial":
        return merge_radial(deltas, weights, **radial_options)  # type: ignore[arg-type]
    raise ValueError(f"unknown merge rule {rule!r}")


def tensor_norm(params: Mapping[str, torch.Tensor]) -> float:
    """Global L2 norm over all tensors of a delta."""
    total = sum(float(t.float().pow(2).sum()) for t in params.values())
    return total**0.5


# --- outer optimizer ---------------------------------------------------------------------


@dataclass
class OuterState:
    """The outer optimizer's state: momentum buffers and the number of merges applied."""

    momentum: Params = field(default_factory=dict)
    num_steps: int = 0
    """Outer steps applied (one per merged fragment)."""
    tensor_steps: dict[str, int] = field(default_factory=dict)
    """Outer steps applied to each tensor (fragments advance at their own pace)."""
    accumulated: Params = field(default_factory=dict)
    """Deltas summed since the last momentum update (delayed Nesterov only)."""


def outer_step(
    params: Params,
    outer_grad: Mapping[str, torch.Tensor],
    state: OuterState,
    *,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    delayed_every: int = 1,
) -> None:
    """Apply one outer SGD step in place on `params` (and `state`), restricted to the
    tensors present in `outer_grad` (a fragment).

    With `delayed_every = N > 1` (delayed Nesterov, Async Local-SGD 2401.09135) the
    momentum buffer is updated once per N merges with their mean, and merges in between
    apply only the plain gradient step; N = 1 is ordinary (Nesterov) momentum SGD, the
    same update as `torch.optim.SGD(nesterov=True)`.
    """
    state.num_steps += 1
    for name, grad in outer_grad.items():
        grad = grad.float()
        state.tensor_steps[name] = state.tensor_steps.get(name, 0) + 1
        if delayed_every <= 1:
            buf = state.momentum.get(name)
            buf = grad.clone() if buf is None else buf.mul_(momentum).add_(grad)
            state.momentum[name] = buf
            update = grad.add(buf, alpha=momentum) if nesterov else buf
            params[name].sub_(update, alpha=lr)
            continue
        acc = state.accumulated.get(name)
        state.accumulated[name] = grad.clone() if acc is None else acc.add_(grad)
        params[name].sub_(grad, alpha=lr)
        if state.tensor_steps[name] % delayed_every == 0:
            buf = state.momentum.get(name)
            mean_grad = state.accumulated.pop(name).div_(delayed_every)
            buf = mean_grad if buf is None else buf.mul_(momentum).add_(mean_grad)
            state.momentum[name] = buf
            params[name].sub_(buf, alpha=lr * momentum)
