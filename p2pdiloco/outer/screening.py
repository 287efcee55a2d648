"""Robust screening of learners' deltas before a merge: pure, deterministic, auditable.

Learners are untrusted (design.md, Trust). Before a synchronizer merges a (round,
fragment) window it decides, for each contribution, whether it enters the merge, by how
much its delta is scaled down, and how many of its claimed tokens count. An auditor
recomputes the same decision bit for bit, so every input is explicit and comes from what
every replica holds: the signed contributions, the canonical chain of round records
(`History`: accepted norms and tokens of earlier rounds of the fragment) and the
replica's fragment at the round's base (parameters `p/`, outer momentum `m/`). No clock,
no synchronizer-local memory. Norms go through `outer.tensor_norm` and dot products
through `outer.fixed_order_sum` with float64 products and `math.fsum`, and the sum of
unit directions of the leave-one-out check adds in peer order, so every CPU gets the same
bits and the cosines do not depend on the order of the candidates.

The rules, in the order `screen` applies them:

1. **Work claimed.** No steps or no tokens: refused. Tokens are bounded by `bound_tokens`.
2. **Norm.** Non-finite or zero norm: refused. The clip threshold is `clip_factor` times
   the median of the norms the history's records list (`min_history` of them at least;
   a record lists its merged norms capped at its own reference, `history_norms`, so a
   learner alone in each window cannot ratchet the clip up);
   without history, the lower median of this window, capped by `max_param_ratio` times
   the norm of the fragment's parameters (every replica knows it, even in round 0). A
   delta above the threshold is scaled down to it; above `refuse_factor` times the
   threshold it is refused. A lone first-round delta has only the parameter bound: noted.
   Both bounds grow with the work a delta claims against the median (`work_ratio`): the
   clip by its bounded tokens (at most `token_factor` x), the refusal by its claim (at
   most `MAX_WORK_RATIO` x), so an honest delta that folded several missed ones is
   clipped, not refused, and a false claim buys at most `token_factor` clips.
3. **Direction vs momentum.** Once the outer momentum is nonzero (round 1 on), a delta
   whose cosine with it is below `momentum_min_cosine` is refused.
4. **Direction vs the others.** With `min_loo_peers` deltas or more left, the one with
   the lowest cosine to the sum of the others' unit directions (leave-one-out) is refused
   while that cosine is below `loo_min_cosine`, one at a time, recomputing after each,
   so a flipped delta does not drag an honest one below the line with it. A sparse delta
   (`SPARSE_DENSITY`) is held to `sparse_loo_min_cosine` instead.
5. **Weights.** `outer.token_weights` over the kept deltas with their bounded tokens, so
   no peer gets more than `max_weight_share` (`outer.cap_shares`).

The thresholds come from `scripts/measure_screening.py`: the tiny model, 4 learners,
token merge, outer Nesterov 0.7/0.9, every window measured whole (F = 1) and split in
four fragments (F = 4), in three runs: A) H = 20, 14 rounds, cosine lr decay (the
script's defaults); B) the same with a 5-round warm-up and a constant lr; C) H = 40,
8 rounds, seed 1. Honest deltas, F = 1 / F = 4:

| figure                                 | A           | B           | C           |
| -------------------------------------- | ----------- | ----------- | ----------- |
| cosine with momentum, min              | .036 / .008 | .047 / .013 | .044 / .018 |
| ... p5                                 | .070 / .051 | .052 / .042 | .050 / .040 |
| ... median                             | .118 / .128 | .095 / .105 | .100 / .103 |
| leave-one-out cosine, min              | .277 / .225 | .194 / .157 | .290 / .264 |
| ... p5                                 | .415 / .361 | .203 / .195 | .336 / .306 |
| ... median                             | .526 / .515 | .309 / .312 | .418 / .410 |
| ... with one of the others flipped, min| .060 / -.033| .042 / .013 | .103 / .087 |
| norm / history median, max             | 1.17 / 1.32 | 1.88 / 2.45 | 1.05 / 1.30 |
| ... p95                                | 1.04 / 1.08 | 1.77 / 2.14 | 1.03 / 1.26 |
| norm / parameter norm, max             | .24 / .65   | .16 / .35   | .29 / .97   |

A sign-flipped delta has minus the honest cosines; a random direction of the same norm
has |cos| <= 0.008 with both. B's norm ratios above 1.4 are its warm-up rounds. Picked:

- `loo_min_cosine = 0.05`: a third of the lowest honest figure; refuses flips and random
  directions whenever 3+ deltas remain; the worst-first loop keeps the honest ones that
  a flipped neighbour pulled down to -0.033.
- `sparse_loo_min_cosine = 0.01`: sparse2 deltas (run A with `--codec sparse2`, error
  feedback) keep the top 1.6% of their entries, and learners' top sets overlap only in
  part, so honest cosines fall to min .049 / .027, p5 .061 / .035 (F = 1 / F = 4; the same
  run's fp32 figures are .277 / .166): the dense line refused 2 of 56 and 30 of 224 honest
  sparse deltas. Flipped ones stay at most -.027, random ones within ±.007; 0.01 refuses
  both and kept every honest one. The momentum line holds as it is (honest sparse min
  .024), but a flipped sparse delta alone (K = 1) passes it more often (11 of 56, 94 of
  224; dense 4 and 16).
- `momentum_min_cosine = -0.05`: honest deltas are only weakly aligned with a momentum
  that remembers ~10 rounds (min 0.008), so a positive line would refuse honest work,
  and a round in which outer steps oscillate (or a momentum an accepted attacker has
  already bent) would stall the run. At -0.05 no honest delta was refused, and in run A
  a flipped delta alone (K = 1) was refused in 51 of 52 windows after round 0 (F = 1)
  and 198 of 208 (F = 4); 0.0 would have refused all, with a margin of 0.008 only. It
  is the check for K = 1-2, where leave-one-out is blind.
- `clip_factor = 3.0`: above every honest ratio, warm-up included (2.45 at most), so
  honest deltas are not clipped; `refuse_factor = 4.0`: refused above 12x the median.
- `max_param_ratio = 4.0`: 4x the largest honest ratio (a fragment of small residual
  projections in round 0); it applies only until there is history.
- `token_factor = 2.0`: not measured (claims are equal in a synchronous simulation); room
  for learners that ran more steps than the median. It bounds the weight too: a weight is
  tokens x tokens per step, so a claim at the token bound with a large batch would
  otherwise count 4x the median (in bench_attack it took the 0.5 share cap).

What this does not stop: a delta that keeps its norm under the clip and its direction
close enough to honest ones (bounded damage by construction); a flip of one tensor of a
large fragment (the cosines are per fragment); in round 0 with fewer than
`min_loo_peers` deltas, anything up to the parameter bound; a majority of colluders in
one window (leave-one-out then refuses honest ones); and Sybils: each identity gets at
most the cap, k of them at most k times it (admission is the defence).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.config import ScreeningRules  # the [screening] section: defined with the config
from p2pdiloco.outer.step import (
    SUM_BLOCK,
    Params,
    fixed_order_sum,
    merge,
    tensor_norm,
    token_weights,
    trimmed_mean,
)

SPARSE_DENSITY = 0.25
"""A delta with at most this share of nonzero entries is sparse: its leave-one-out line is
`sparse_loo_min_cosine` (sparse2 keeps 1.6%, topk 5%; int8 and the casts keep ~100%)."""

_DOT_CHUNK = 32 * SUM_BLOCK
"""Elements multiplied at a time in `dot` (8 MiB of float64 per operand)."""


@dataclass(frozen=True)
class Candidate:
    """One signed contribution to a window."""

    peer: str
    delta: Mapping[str, torch.Tensor]
    tokens: int
    """Tokens claimed (before any bound)."""
    steps: int
    """Inner steps claimed."""
    staleness: int = 0
    """Rounds between the delta's base and the window's round."""


@dataclass(frozen=True)
class History:
    """What earlier round records of the same fragment say (the canonical chain only)."""

    norms: tuple[float, ...] = ()
    """Norms of the accepted deltas as merged (after their scale), most recent records."""
    tokens: tuple[int, ...] = ()
    """Token counts of the accepted deltas as recorded (bounded), most recent records."""


def history_of(records: Sequence[Sequence[tuple[float, int]]], rounds: int) -> History:
    """The history from a fragment's canonical round records, oldest first: each record
    as its contributors' (merged norm, tokens); the last `rounds` records count."""
    recent = records[-rounds:] if rounds > 0 else []
    return History(
        norms=tuple(float(norm) for record in recent for norm, _ in record),
        tokens=tuple(int(tokens) for record in recent for _, tokens in record),
    )


@dataclass(frozen=True)
class Verdict:
    """What the screening decided for one candidate."""

    peer: str
    kept: bool
    reason: str
    """Why it was refused ("" when kept)."""
    norm: float
    """L2 norm of the delta as sent (`outer.tensor_norm`)."""
    scale: float
    """Multiply the delta by this before merging (1.0: not clipped; 0.0 when refused)."""
    tokens: int
    """Tokens that count (bounded)."""
    weight: float = 0.0
    """Merge weight (0 when refused); the kept weights sum to one."""
    momentum_cosine: float | None = None
    loo_cosine: float | None = None

    history_norm: float = 0.0
    """What the round record lists for the next rounds' history: the merged norm, at most
    the reference this window was screened against (times `HISTORY_GROWTH` when two or
    more deltas were kept), so the clip cannot ratchet (`history_norms`)."""

    @property
    def merged_norm(self) -> float:
        """Norm of the delta as merged (after its scale)."""
        return self.norm * self.scale


@dataclass(frozen=True)
class Screening:
    """The decision for a whole window, in candidate order."""

    verdicts: tuple[Verdict, ...]
    clip_norm: float
    """Deltas above this norm were scaled down to it (inf: no bound known)."""
    refuse_norm: float
    """Deltas above this norm were refused."""
    reference: str
    """Where the clip threshold came from: history, window, parameters or none."""
    notes: tuple[str, ...] = field(default=())

    @property
    def kept(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.kept]

    @property
    def refused(self) -> dict[str, str]:
        return {v.peer: v.reason for v in self.verdicts if not v.kept}


# --- bit-exact reductions ----------------------------------------------------------------


def dot(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Σ a·b over the tensors both hold, the same bits on every CPU and in any order.

    Products of fp32 values are exact in float64; each chunk is summed by
    `fixed_order_sum` and the chunk sums by `math.fsum`, correctly rounded, so neither the
    order of the tensors nor of the arguments changes the result.
    """
    partials: list[float] = []
    for name, tensor in a.items():
        other = b.get(name)
        if other is None:
            continue  # absent momentum is zero
        partials.extend(_chunk_partials(name, tensor.detach().reshape(-1), other.detach().reshape(-1)))
    return math.fsum(partials)


def _chunk_partials(name: str, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """x·y per chunk of `_DOT_CHUNK` elements, each product in float64 (exact for two fp32
    inputs, correctly rounded otherwise) and summed by `fixed_order_sum`: the partials
    `dot` and `loo_cosines` add with `math.fsum`."""
    if x.numel() != y.numel():
        raise ValueError(f"{name}: {x.numel()} elements against {y.numel()}")
    partials = []
    for start in range(0, x.numel(), _DOT_CHUNK):
        stop = min(start + _DOT_CHUNK, x.numel())
        product = x[start:stop].to(torch.float64)
        product.mul_(y[start:stop].to(torch.float64))
        partials.append(fixed_order_sum(product))
    return partials


def norm_and_density(delta: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(`tensor_norm(delta)`, share of its entries that are nonzero), each tensor read once
    (a lazy delta decodes once for both). The count is an exact integer: the same anywhere."""
    squares: list[float] = []
    nonzero = total = 0
    for tensor in delta.values():
        squares.append(fixed_order_sum(tensor, square=True))
        nonzero += int(torch.count_nonzero(tensor))
        total += tensor.numel()
    return math.sqrt(math.fsum(squares)), nonzero / total if total else 1.0


def _finite_positive(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if math.isfinite(v) and v > 0.0]


# --- the rules, one function each ----------------------------------------------------------


def clip_threshold(
    history_norms: Sequence[float],
    current_norms: Sequence[float],
    factor: float,
    *,
    param_norm: float | None = None,
    max_param_ratio: float = math.inf,
    min_history: int = 3,
) -> tuple[float, str]:
    """(clip norm, where it came from: history, window, parameters or none).

    `factor` × the median of the history's accepted norms when it holds `min_history`,
    so one learner alone (K = 1) cannot lift it. Until then `factor` × the lower median
    of this window's norms (with two deltas the smaller one; one alone has no bound of
    its own), capped by `max_param_ratio × param_norm`, which every replica knows even in
    round 0. The parameter bound is left out once there is history: a fragment of small
    (residual, zero-initialised) tensors can have honest deltas near its own norm.
    """
    history = _finite_positive(history_norms)
    if len(history) >= min_history:
        return factor * statistics.median(history), "history"
    current = _finite_positive(current_norms)
    clip, source = math.inf, "none"
    if len(current) >= 2:
        clip, source = factor * statistics.median_low(current), "window"
    if param_norm is not None and math.isfinite(param_norm) and param_norm > 0.0:
        bound = max_param_ratio * param_norm
        if bound < clip:
            clip, source = bound, "parameters"
    return clip, source


HISTORY_GROWTH = 1.5
"""A window of two or more kept deltas may lift the clip reference by at most this factor
a round (through the norms its record lists); a window of one delta cannot lift it."""


def history_norms(merged_norms: Sequence[float], clip_norm: float, clip_factor: float) -> list[float]:
    """What a round record lists as its kept deltas' norms for the next rounds' history.

    A record's norms become the reference of the next windows (`clip_threshold`). Listed
    as merged, a delta at the clip enters at `clip_factor` times the reference, and a
    learner alone in each window (K = 1, no grace) lifts the clip about
    1.5x a round (3 to 5,877 in 20 rounds). So each listed norm is at most the reference
    this window was screened against (`clip_norm / clip_factor`): a lone delta can keep
    or lower the reference, never lift it; with two or more kept deltas at most
    `HISTORY_GROWTH` times it, which honest norms that grow (a warm-up) follow a round at
    a time, and which a pair of colluders lifts at most that much a round. With no bound
    known (`inf`), the merged norms as they are.
    """
    if not (math.isfinite(clip_norm) and clip_norm > 0.0):
        return [float(n) for n in merged_norms]
    cap = (clip_norm / clip_factor) * (HISTORY_GROWTH if len(merged_norms) >= 2 else 1.0)
    return [min(float(n), cap) for n in merged_norms]


MAX_WORK_RATIO = 64.0
"""At most this many times the reference work lifts a delta's refuse bound (its clip is
lifted at most `token_factor` times, with its bounded tokens)."""


def reference_tokens(
    history_tokens: Sequence[int], window_tokens: Sequence[int], min_history: int
) -> float | None:
    """The work a typical delta carries, in tokens: the median of the history's bounded
    claims (`min_history` of them at least), else the lower median of this window's
    claims (two or more), else None (no reference: no delta's bounds are lifted)."""
    history = [t for t in history_tokens if t > 0]
    if len(history) >= min_history:
        return float(statistics.median(history))
    window = [t for t in window_tokens if t > 0]
    if len(window) >= 2:
        return float(statistics.median_low(window))
    return None


def work_ratio(tokens: int, reference: float | None, cap: float) -> float:
    """How many typical deltas' work `tokens` is: in [1, cap] (1 without a reference).

    A learner that folded missed deltas into its next one, or ran at a larger batch,
    legitimately sends a larger norm; the ratio lifts its norm bounds by the work it
    claims. Claims are untrusted, so the clip uses the *bounded* tokens (at most
    `token_factor` times the median) and the refuse bound at most `MAX_WORK_RATIO`: a
    claim can turn a refusal into a clip, never let more than `token_factor` clips through.
    """
    if reference is None or reference <= 0.0 or tokens <= 0:
        return 1.0
    return min(max(tokens / reference, 1.0), cap)


def clip_scale(norm: float, clip_norm: float) -> float:
    """Factor that brings a delta of `norm` down to `clip_norm` (1.0 when under it)."""
    return clip_norm / norm if norm > clip_norm else 1.0


def bound_tokens(
    claims: Sequence[int],
    steps: Sequence[int],
    history_tokens: Sequence[int],
    factor: float,
    max_tokens_per_step: int,
    *,
    min_history: int = 3,
) -> list[int]:
    """Each claim capped at min(claim, steps × max_tokens_per_step, factor × median).

    The median is of the history's accepted token counts when it holds `min_history`,
    else the lower median of this window's step-bounded claims (a claim alone is bounded
    by its steps only). Integers in, integers out: the same everywhere.
    """
    if len(claims) != len(steps):
        raise ValueError("claims and steps must have one entry per candidate")
    by_steps = [
        max(0, min(c, max(s, 0) * max_tokens_per_step)) for c, s in zip(claims, steps, strict=True)
    ]
    history = [t for t in history_tokens if t > 0]
    window = [t for t in by_steps if t > 0]
    if len(history) >= min_history:
        limit = math.floor(factor * statistics.median(history))
    elif len(window) >= 2:
        limit = math.floor(factor * statistics.median_low(window))
    else:
        return by_steps
    return [min(t, limit) for t in by_steps]


def momentum_cosines(
    deltas: Sequence[Mapping[str, torch.Tensor]],
    norms: Sequence[float],
    momentum: Mapping[str, torch.Tensor],
) -> list[float] | None:
    """Cosine of each delta with the outer momentum; None when the momentum is zero."""
    momentum_norm = tensor_norm(momentum) if momentum else 0.0
    if not (math.isfinite(momentum_norm) and momentum_norm > 0.0):
        return None
    return [dot(d, momentum) / (n * momentum_norm) for d, n in zip(deltas, norms, strict=True)]


def loo_cosines(
    deltas: Sequence[Mapping[str, torch.Tensor]], norms: Sequence[float], order: Sequence[int]
) -> list[float | None]:
    """Cosine of each delta with Σ unit(Δ_j) over the others; None where they cancel out.

    One pass over the data, O(M N): with S = Σ_j u_j (u_j = Δ_j / ‖Δ_j‖),
    u_i·S_-i = u_i·S − 1 and ‖S_-i‖² = ‖S‖² − 2 u_i·S + 1, so no pairwise products are
    needed (M² of them cost half an hour of a core at M = 32 and 75M parameters). Tensor by
    tensor, each delta's tensor read twice (into S, then against it) and dropped, so a
    window of `LazyTensors` holds one decoded tensor and S at a time, whatever M. S is
    summed elementwise in float64 in `order` (give a canonical one, e.g. by peer) and the
    dot products as in `dot`, so the values do not depend on the order of `deltas` nor
    on the CPU.
    """
    count = len(deltas)
    along: list[list[float]] = [[] for _ in range(count)]
    square_partials: list[float] = []
    for name in deltas[0] if deltas else ():
        total: torch.Tensor | None = None  # from the first read: no extra decode for its size
        for j in order:
            unit = deltas[j][name].detach().reshape(-1).to(torch.float64).div_(norms[j])
            total = unit if total is None else total.add_(unit)
        assert total is not None  # `order` names every delta
        for i in range(count):
            along[i].extend(_chunk_partials(name, deltas[i][name].detach().reshape(-1), total))
        square_partials.append(fixed_order_sum(total, square=True))
    square = math.fsum(square_partials)
    cosines: list[float | None] = []
    for i in range(count):
        unit_dot = math.fsum(along[i]) / norms[i]
        rest = square - 2.0 * unit_dot + 1.0
        # the others cancel out (rounding leaves a few ulps of ‖S‖², not a direction)
        cosines.append((unit_dot - 1.0) / math.sqrt(rest) if rest > 1e-9 * count else None)
    return cosines


class Scaled(Mapping[str, torch.Tensor]):
    """A delta times `scale`, computed per tensor on access: one fp32 rounding per element,
    the same bits as scaling it whole, without a second copy of the fragment."""

    def __init__(self, delta: Mapping[str, torch.Tensor], scale: float) -> None:
        self._delta, self._scale = delta, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._delta[name].float()
        return tensor if self._scale == 1.0 else torch.mul(tensor, self._scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self._delta)

    def __len__(self) -> int:
        return len(self._delta)


def scaled(delta: Mapping[str, torch.Tensor], scale: float) -> Mapping[str, torch.Tensor]:
    """The delta times `scale`, one fp32 rounding per element (the delta itself at 1.0)."""
    return Scaled(delta, scale)


def layout_of(delta: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a delta; a `compress.LazyTensors` answers without decoding."""
    shapes = getattr(delta, "shapes", None)
    if isinstance(shapes, dict):
        return shapes
    return {name: tuple(t.shape) for name, t in delta.items()}


# --- the whole window ----------------------------------------------------------------------


def screen(
    candidates: Sequence[Candidate],
    history: History,
    rules: ScreeningRules,
    momentum: Mapping[str, torch.Tensor] | None = None,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    max_tokens_per_step: int,
    max_weight_share: float = 1.0,
    staleness_discount: float = 1.0,
) -> Screening:
    """Decide which candidates enter the merge, their scales, tokens and weights.

    `momentum` and `params` are the fragment's outer momentum and parameters at the
    window's base (the parent hash of the update); `max_weight_share` and
    `staleness_discount` are `outer.max_weight_share` and `sync.staleness_discount`.
    Pure and deterministic: the same inputs give the same bits, and a permutation of the
    candidates permutes the verdicts (the merge itself adds in candidate order, so give
    it in a canonical one, e.g. sorted by peer). Never raises on what a peer sent, given
    `params` (they fix the layout a delta must have).

    Four checks, in order, each on the candidates the ones before kept: the claims and
    the layout (`_refuse_malformed`), the norm (`_bound_norms`), the direction against
    the outer momentum (`_check_momentum`) and against the others (`_check_others`).
    """
    peers = [c.peer for c in candidates]
    if len(set(peers)) != len(peers):
        raise ValueError("one candidate per peer")
    count = len(candidates)
    reasons: list[str] = [""] * count
    notes: list[str] = []
    tokens = bound_tokens(
        [c.tokens for c in candidates],
        [c.steps for c in candidates],
        history.tokens,
        rules.token_factor,
        max_tokens_per_step,
        min_history=rules.min_history,
    )
    measured = [norm_and_density(c.delta) for c in candidates]
    norms = [norm for norm, _ in measured]
    _refuse_malformed(candidates, tokens, norms, params, reasons)
    clip, refuse, source, scales = _bound_norms(candidates, tokens, norms, history, rules, params, reasons, notes)
    momentum_cos = _check_momentum(candidates, norms, momentum, rules, reasons, notes)
    lines = [rules.sparse_loo_min_cosine if d <= SPARSE_DENSITY else rules.loo_min_cosine for _, d in measured]
    loo = _check_others(candidates, norms, lines, rules, reasons, notes)

    kept = [i for i in range(count) if not reasons[i]]
    weights = token_weights(
        [tokens[i] for i in kept],
        [candidates[i].steps for i in kept],
        max_share=max_weight_share,
        staleness=[candidates[i].staleness for i in kept],
        staleness_discount=staleness_discount,
        max_ratio=rules.token_factor,
    )
    weight_of = dict(zip(kept, weights, strict=True))
    listed = history_norms([norms[i] * scales[i] for i in kept], clip, rules.clip_factor)
    history_norm_of = dict(zip(kept, listed, strict=True))
    verdicts = tuple(
        Verdict(
            peer=peers[i],
            kept=not reasons[i],
            reason=reasons[i],
            norm=norms[i],
            scale=scales[i] if not reasons[i] else 0.0,
            tokens=tokens[i],
            weight=weight_of.get(i, 0.0),
            history_norm=history_norm_of.get(i, 0.0),
            momentum_cosine=momentum_cos.get(i),
            loo_cosine=loo.get(i),
        )
        for i in range(count)
    )
    return Screening(verdicts, clip, refuse, source, tuple(notes))


def _refuse_malformed(
    candidates: Sequence[Candidate],
    tokens: list[int],
    norms: list[float],
    params: Mapping[str, torch.Tensor] | None,
    reasons: list[str],
) -> None:
    """Refuse (in `reasons`) a delta of another layout, one claiming no work, and one whose
    norm is not finite or zero."""
    layout = {n: tuple(t.shape) for n, t in params.items()} if params else None
    for i, c in enumerate(candidates):
        if layout is not None and layout_of(c.delta) != layout:
            reasons[i] = "delta layout differs from the fragment"
        elif c.steps <= 0 or tokens[i] <= 0:
            reasons[i] = "contribution claims no work"
        elif not math.isfinite(norms[i]):
            reasons[i] = "delta norm is not finite"
        elif norms[i] == 0.0:
            reasons[i] = "delta is zero"


def _bound_norms(
    candidates: Sequence[Candidate],
    tokens: list[int],
    norms: list[float],
    history: History,
    rules: ScreeningRules,
    params: Mapping[str, torch.Tensor] | None,
    reasons: list[str],
    notes: list[str],
) -> tuple[float, float, str, list[float]]:
    """Clip to a multiple of a reference the window cannot move, refuse far above it:
    (clip, refuse bound, where the reference came from, each candidate's scale)."""
    alive = [i for i in range(len(candidates)) if not reasons[i]]
    param_norm = tensor_norm(params) if params else None
    clip, source = clip_threshold(
        history.norms,
        [norms[i] for i in alive],
        rules.clip_factor,
        param_norm=param_norm,
        max_param_ratio=rules.max_param_ratio,
        min_history=rules.min_history,
    )
    refuse = clip * rules.refuse_factor
    reference = reference_tokens(history.tokens, [candidates[i].tokens for i in alive], rules.min_history)
    scales = [0.0] * len(candidates)
    for i in alive:
        # a delta carrying more work has a larger norm: the bounds grow with it (folded
        # deltas carry every step since their learner's last merge)
        own_refuse = refuse * work_ratio(candidates[i].tokens, reference, MAX_WORK_RATIO)
        if norms[i] > own_refuse:
            reasons[i] = (
                f"delta norm {norms[i]:.4g} is above {own_refuse:.4g} (refuse bound, from {source})"
            )
        else:
            scales[i] = clip_scale(norms[i], clip * work_ratio(tokens[i], reference, rules.token_factor))
    if source in ("none", "parameters"):
        notes.append(f"no norm history: clip from {source} only")
    return clip, refuse, source, scales


def _check_momentum(
    candidates: Sequence[Candidate],
    norms: list[float],
    momentum: Mapping[str, torch.Tensor] | None,
    rules: ScreeningRules,
    reasons: list[str],
    notes: list[str],
) -> dict[int, float]:
    """Direction against the outer momentum, which every replica holds (zero in round 0):
    each alive candidate's cosine; those below the line are refused."""
    alive = [i for i in range(len(candidates)) if not reasons[i]]
    momentum_cos: dict[int, float] = {}
    cosines = momentum_cosines(
        [candidates[i].delta for i in alive], [norms[i] for i in alive], momentum or {}
    )
    if cosines is None:
        notes.append("outer momentum is zero: no momentum direction check")
        return momentum_cos
    for i, cos in zip(alive, cosines, strict=True):
        momentum_cos[i] = cos
        if not cos >= rules.momentum_min_cosine:
            reasons[i] = f"cosine {cos:.3f} with the outer momentum is below {rules.momentum_min_cosine:g}"
    return momentum_cos


def _check_others(
    candidates: Sequence[Candidate],
    norms: list[float],
    lines: list[float],
    rules: ScreeningRules,
    reasons: list[str],
    notes: list[str],
) -> dict[int, float]:
    """Direction against the others (leave-one-out): drop the worst of those below their
    line (`lines`: each candidate's, by its density) while there is one; each scored
    candidate's cosine."""
    peers = [c.peer for c in candidates]
    pool = [i for i in range(len(candidates)) if not reasons[i]]
    loo: dict[int, float] = {}
    if len(pool) < rules.min_loo_peers:
        notes.append(f"{len(pool)} deltas: no leave-one-out direction check")
        return loo
    members = list(pool)
    while len(members) >= rules.min_loo_peers:
        by_peer = sorted(range(len(members)), key=lambda k: peers[members[k]])
        values = loo_cosines([candidates[i].delta for i in members], [norms[i] for i in members], by_peer)
        scored = [(v, peers[i], i) for i, v in zip(members, values, strict=True) if v is not None]
        loo.update({i: v for v, _, i in scored})
        below = [(v, peer, i) for v, peer, i in scored if v < lines[i]]
        if not below:
            break
        worst, _, i = min(below)  # ties broken by peer id: order-free
        reasons[i] = f"cosine {worst:.3f} with the other deltas is below {lines[i]:g}"
        members.remove(i)
    return loo


def merge_screened(
    candidates: Sequence[Candidate],
    screening: Screening,
    rule: str,
    *,
    trim_fraction: float = 0.0,
    **radial_options: object,
) -> Params:
    """Merge the kept deltas, each times its scale, in candidate order: `rule` is one of
    `outer.merge`'s (with the screening's weights) or `trimmed` (`trimmed_mean`)."""
    kept = [(c, v) for c, v in zip(candidates, screening.verdicts, strict=True) if v.kept]
    if not kept:
        raise ValueError("no delta was kept")
    deltas = [scaled(c.delta, v.scale) for c, v in kept]
    if rule == "trimmed":
        return trimmed_mean(deltas, trim_fraction)
    return merge(rule, deltas, [v.weight for _, v in kept], **radial_options)
