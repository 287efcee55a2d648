"""The outer step and the merge rules, as pure functions of tensors (no I/O, no network).

Conventions: a *delta* (pseudo-gradient) is `theta_global_base - theta_local`, so the
outer optimizer *descends* along it, as in DiLoCo (arXiv 2311.08105). Parameters are
`dict[str, Tensor]` of fp32 CPU tensors; the global state and the outer step stay on the
CPU in fp32 so every peer computes the same bits whatever its accelerator.

Everything applied to the global state is bit-identical on every CPU kernel set
(ATEN_CPU_CAPABILITY default/avx2/avx512, ARM): only separate elementwise ops, each
correctly rounded by IEEE-754 (no `alpha=`, which becomes a fused multiply-add in the
vectorised kernels and two roundings in the scalar ones), scalars computed in Python
floats, and every reduction through `fixed_order_sum` (docs/arithmetic.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

Params = dict[str, torch.Tensor]

_EPS = 1e-12


SUM_BLOCK = 1 << 15
"""Leaf block of `fixed_order_sum`: 256 KiB of float64, summed while it is in cache."""
_SUM_ROWS = 32  # leaf blocks converted at a time: an 8 MiB float64 scratch, reused
_CHUNK = 1 << 20
"""Elements per step of the elementwise loops (4 MiB of fp32). A fresh full-size temporary
costs more in page faults than the arithmetic (~25 ms per 10M fp32 measured), while
malloc reuses a small one, which also stays in cache."""


def _halve_(values: torch.Tensor) -> torch.Tensor:
    """Sum along the last dim, in place: add the second half onto the first until one is
    left (with an odd length the middle value is carried, as if padded with a zero)."""
    n = values.shape[-1]
    while n > 1:
        half = (n + 1) // 2
        # The two slices never overlap (n - half <= half), so the in-place add is safe.
        values[..., : n - half].add_(values[..., half:n])
        n = half
    return values[..., 0]


def fixed_order_sum(tensor: torch.Tensor, *, square: bool = False) -> float:
    """Sum of the elements (of their squares with `square`) in float64, in a fixed order.

    `sum()` and `linalg.vector_norm` add in an order set by the SIMD width, the kernel set
    and the thread count, so peers on different CPUs get different last bits. Here the
    order is a pairwise tree fixed by the length alone: the flat values are cut into
    blocks of `SUM_BLOCK` (the last one shorter), each block is summed by halving (add
    its second half onto its first, elementwise, until one value is left), then the
    block sums are halved the same way. Elementwise adds are rounded the same whatever
    the vector width; values and squares of fp32 (and bf16/fp16) are exact in float64.
    """
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    rows, tail = divmod(n, SUM_BLOCK)
    sums = torch.empty(rows + (1 if tail else 0), dtype=torch.float64)
    # Blocks a few at a time through one small scratch: no full-size float64 copy.
    scratch = torch.empty(min(rows, _SUM_ROWS) * SUM_BLOCK, dtype=torch.float64)
    for row in range(0, rows, _SUM_ROWS):
        count = min(_SUM_ROWS, rows - row)
        blocks = scratch[: count * SUM_BLOCK].view(count, SUM_BLOCK)
        blocks.copy_(flat[row * SUM_BLOCK : (row + count) * SUM_BLOCK].view(count, SUM_BLOCK))
        if square:
            blocks.mul_(blocks)
        sums[row : row + count] = _halve_(blocks)
    if tail:
        last = flat[rows * SUM_BLOCK :].to(torch.float64, copy=True)
        if square:
            last.mul_(last)
        sums[-1] = _halve_(last)
    return float(_halve_(sums))


def _chunks(
    target: torch.Tensor, *sources: torch.Tensor
) -> Iterator[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]]:
    """(target part, source parts, fp32 scratch part) over matching flat chunks of tensors
    with as many elements as `target`, which is updated in place through its part."""
    if not target.is_contiguous():  # no flat view to update through: one chunk
        scratch = torch.empty(target.shape, dtype=torch.float32)
        yield target, [s.reshape(target.shape) for s in sources], scratch
        return
    flat = target.view(-1)
    flats = [s.reshape(-1) for s in sources]
    scratch = torch.empty(min(flat.numel(), _CHUNK), dtype=torch.float32)
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        yield flat[start:stop], [f[start:stop] for f in flats], scratch[: stop - start]


def _add_scaled_(target: torch.Tensor, tensor: torch.Tensor, scale: float) -> None:
    """`target += scale * tensor`, the product rounded to fp32 before the add: the same
    bits on every kernel set, unlike `add_(alpha=)`, a fused multiply-add on some only."""
    for part, (source,), product in _chunks(target, tensor):
        torch.mul(source, scale, out=product)
        part.add_(product)


def _l2_norm(tensor: torch.Tensor) -> float:
    """Euclidean norm through the fixed-order sum (math.sqrt is correctly rounded)."""
    return math.sqrt(fixed_order_sum(tensor, square=True))


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
    # fsum is correctly rounded; the built-in sum of floats changed algorithm in Python 3.12
    total = math.fsum(weights)
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
        rest = math.fsum(weights[i] for i in range(n) if not capped[i])
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
    max_ratio: float = math.inf,
) -> list[float]:
    """Decoupled DiLoCo §3.2 weights: `w = c_tokens * (c_tokens / c_steps)`, normalised.

    Quantity (tokens) times quality (tokens per step, i.e. batch size); each round of
    staleness multiplies a weight by `staleness_discount`; no weight counts more than
    `max_ratio` times the median of the window's, given 3 or more (a claim twice the
    median in tokens and in tokens per step, 4x in weight, counts `max_ratio`x at most);
    then no share above `max_share`.
    """
    if len(tokens) != len(steps):
        raise ValueError("tokens and steps must have one entry per learner")
    raw = []
    for index, (c_tokens, c_steps) in enumerate(zip(tokens, steps, strict=True)):
        w = c_tokens * (c_tokens / c_steps) if c_steps > 0 and c_tokens > 0 else 0.0
        if staleness is not None:
            w *= staleness_discount ** staleness[index]
        raw.append(w)
    positive = [w for w in raw if w > 0.0]
    if len(positive) >= 3 and math.isfinite(max_ratio):
        # the median, not the lower one: thin claims must not drag honest weights down
        limit = max_ratio * statistics.median(positive)
        raw = [min(w, limit) for w in raw]
    return cap_shares(raw, max_share)


def uniform_weights(count: int) -> list[float]:
    """Equal weights summing to one."""
    return [1.0 / count] * count if count else []


# --- merge rules -------------------------------------------------------------------------


def merge_weighted(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> Params:
    """Weighted mean of deltas, per tensor (weights are assumed to sum to one).

    `acc + w * delta` as a multiply then an add (two roundings), not `add_(alpha=)`,
    whose fused multiply-add exists in some kernel sets only.
    """
    if not deltas:
        raise ValueError("cannot merge zero deltas")
    # read once per name: a lazy delta decodes on each access
    return {name: _weighted_tensor(_reader(deltas, name), weights) for name in deltas[0]}


def _reader(deltas: Sequence[Mapping[str, torch.Tensor]], name: str) -> Callable[[int], torch.Tensor]:
    """Read tensor `name` of delta i as fp32, on demand: a merge that reads one delta at a
    time holds one decoded copy of a lazy delta's tensor, not M of them."""
    return lambda i: deltas[i][name].float()


def _weighted_tensor(read: Callable[[int], torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i · tensor_i, reading each tensor once."""
    acc: torch.Tensor | None = None
    for i, weight in enumerate(weights):
        tensor = read(i)
        if acc is None:
            acc = torch.zeros_like(tensor)
        _add_scaled_(acc, tensor, float(weight))
    assert acc is not None  # callers refuse zero deltas
    return acc


def merge_mean(deltas: Sequence[Mapping[str, torch.Tensor]]) -> Params:
    """Plain mean of deltas (DiLoCo's original rule)."""
    return merge_weighted(deltas, uniform_weights(len(deltas)))


def _weighted_median(values: list[float], weights: Sequence[float]) -> float:
    """The value at which the running weight (in value order) reaches half the total."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    half, acc = 0.5 * math.fsum(weights), 0.0
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
    # One tensor name at a time, one delta's tensor at a time: lazy deltas decode on each
    # access (two or three times here), so the working set does not grow with M.
    return {
        name: _radial_tensor(
            _reader(deltas, name),
            weights,
            norm=norm,
            plain_mean=name in plain_mean_names,
            cancel_ratio=cancel_ratio,
        )
        for name in deltas[0]
    }


def _radial_tensor(
    read: Callable[[int], torch.Tensor],
    weights: Sequence[float],
    *,
    norm: str,
    plain_mean: bool,
    cancel_ratio: float,
) -> torch.Tensor:
    """`merge_radial` for the M versions of one tensor, `read(i)` giving version i."""
    if plain_mean:
        return _weighted_tensor(read, weights)
    norms = [_l2_norm(read(i)) for i in range(len(weights))]
    direction: torch.Tensor | None = None
    for i, (n, w) in enumerate(zip(norms, weights, strict=True)):
        tensor = read(i) if direction is None or n > _EPS else None
        if direction is None:
            direction = torch.zeros_like(tensor)
        if n > _EPS:
            # the coefficient in Python (float64), then one multiply and one add
            _add_scaled_(direction, tensor, float(w) / n)
    assert direction is not None  # merge_radial refuses zero deltas
    direction_norm = _l2_norm(direction)
    total_weight = math.fsum(weights)
    if direction_norm < cancel_ratio * total_weight:
        return _weighted_tensor(read, weights)
    radius = (
        _weighted_median(norms, weights)
        if norm == "median"
        else math.fsum(w * n for w, n in zip(weights, norms, strict=True)) / max(total_weight, _EPS)
    )
    return direction.mul_(radius / direction_norm)


_TRIM_CHUNK = 32 * SUM_BLOCK
"""Elements sorted at once by `trimmed_mean` (K x 20 MiB of scratch for K deltas)."""


def trimmed_mean(deltas: Sequence[Mapping[str, torch.Tensor]], trim_fraction: float) -> Params:
    """Coordinate-wise trimmed mean: per element, drop the floor(trim_fraction × K)
    largest and smallest values of the K deltas and average the rest.

    Deterministic and free of the input order: values are sorted per element, the kept
    ones added in sorted order in float64, divided once, rounded to fp32. Cost: a sort of
    K values per element, O(N K log K) for N elements, in chunks of 2^20 elements (about
    K × 20 MiB of scratch). Measured on one core: 0.74 s for K = 8 deltas of 4M elements,
    against 0.02 s for the weighted mean and 0.41 s for `screen` itself.
    Ignores weights (they are claims); scale clipped deltas before calling.
    """
    if not deltas:
        raise ValueError("cannot merge zero deltas")
    count = len(deltas)
    trim = math.floor(trim_fraction * count)
    if trim_fraction < 0.0 or 2 * trim >= count:
        raise ValueError(f"trim_fraction {trim_fraction} leaves nothing of {count} deltas")
    # one name at a time, its tensors a temporary list (lazy deltas decode on access)
    return {name: _trimmed_tensor([d[name].detach().float() for d in deltas], trim) for name in deltas[0]}


def _trimmed_tensor(tensors: list[torch.Tensor], trim: int) -> torch.Tensor:
    """`trimmed_mean` over the K versions of one tensor."""
    count, shape = len(tensors), tensors[0].shape
    flats = [t.reshape(-1) for t in tensors]
    out = torch.empty(flats[0].numel(), dtype=torch.float32)
    for start in range(0, out.numel(), _TRIM_CHUNK):
        stop = min(start + _TRIM_CHUNK, out.numel())
        values = torch.stack([f[start:stop] for f in flats]).sort(dim=0).values
        acc = values[trim].to(torch.float64)
        for row in range(trim + 1, count - trim):
            acc.add_(values[row].to(torch.float64))
        out[start:stop] = acc.div_(count - 2 * trim).to(torch.float32)
    return out.reshape(shape)


def merge(
    rule: str,
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    **radial_options: object,
) -> Params:
    """Dispatch on `outer.merge`: mean (ignores weights), token (weighted mean), radial or
    trimmed (coordinate-wise trimmed mean, `trim_fraction`; ignores weights)."""
    if rule == "mean":
        return merge_mean(deltas)
    if rule == "token":
        return merge_weighted(deltas, weights)
    if rule == "radial":
        options = {k: v for k, v in radial_options.items() if k != "trim_fraction"}
        return merge_radial(deltas, weights, **options)  # type: ignore[arg-type]
    if rule == "trimmed":
        return trimmed_mean(deltas, float(radial_options.get("trim_fraction", 0.2)))  # type: ignore[arg-type]
    raise ValueError(f"unknown merge rule {rule!r}")


def tensor_norm(params: Mapping[str, torch.Tensor]) -> float:
    """Global L2 norm over all tensors of a delta (fixed-order sums, the same on every CPU)."""
    # fsum and sqrt are correctly rounded; `** 0.5` goes through libm's pow, which need not be
    return math.sqrt(math.fsum(fixed_order_sum(t, square=True) for t in params.values()))


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
    update of `torch.optim.SGD(nesterov=True)` up to rounding.

    Every product is rounded before it is added (a multiply, then an add or subtract):
    `alpha=` would be a fused multiply-add on AVX2/AVX-512 and not on other kernel sets,
    and replicas on different CPUs would drift apart in the last bit.
    """
    state.num_steps += 1
    for name, grad in outer_grad.items():
        grad = grad.float()  # may be the caller's tensor: never modified in place
        param = params[name]
        state.tensor_steps[name] = state.tensor_steps.get(name, 0) + 1
        if delayed_every <= 1:
            buf = state.momentum.get(name)
            if buf is None:
                buf = grad.clone()
            else:
                buf.mul_(momentum).add_(grad)  # buf = mu * buf + g
            state.momentum[name] = buf
            for part, (g, b), update in _chunks(param, grad, buf):
                if nesterov:  # lr * (g + mu * buf), rounded at each step
                    torch.mul(b, momentum, out=update).add_(g).mul_(lr)
                else:
                    torch.mul(b, lr, out=update)
                part.sub_(update)
            continue
        acc = state.accumulated.get(name)
        if acc is None:
            state.accumulated[name] = grad.clone()
        else:
            acc.add_(grad)
        _add_scaled_(param, grad, -lr)  # -(lr * g) rounds as lr * g does, sign aside
        if state.tensor_steps[name] % delayed_every == 0:
            buf = state.momentum.get(name)
            mean_grad = state.accumulated.pop(name).div_(delayed_every)
            if buf is None:
                buf = mean_grad
            else:
                buf.mul_(momentum).add_(mean_grad)
            state.momentum[name] = buf
            _add_scaled_(param, buf, -(lr * momentum))
