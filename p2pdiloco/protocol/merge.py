"""One round's merge as a pure function: what a synchronizer computes and an auditor redoes.

Inputs are only what every replica can hold: the signed contributions of the window
(decoded), the fragment's state at the round's parent hash (parameters and outer
momentum), the accepted norms and token counts of the recent rounds of the canonical
chain (`history_of`), and the run config. Candidates are taken in peer-id order, so the
arrival order at the synchronizer does not change a bit of the result. Screening
(`screening.screen`), weights, the merge, the outer codec and the outer step all run
through the same code on both sides, and the arithmetic is bit-identical across CPUs
(docs/arithmetic.md): a mismatch between a record's hash and an audit's is proof.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from p2pdiloco import compress
from p2pdiloco.config import OuterConfig, RunConfig, SyncConfig
from p2pdiloco.outer.screening import (
    Candidate,
    History,
    Screening,
    ScreeningRules,
    merge_screened,
    screen,
)
from p2pdiloco.protocol.rounds import RoundRecord

MAX_SEQUENCES_PER_STEP = 1024
"""A learner may claim at most this many sequences per inner step (bigger batches than the
run's are allowed; the token history bounds claims far more tightly)."""


def max_tokens_per_step(config: RunConfig) -> int:
    """The per-step cap on claimed tokens: from run-wide fields only, so that every
    synchronizer and auditor of a run computes the same bound."""
    return config.model.seq_len * MAX_SEQUENCES_PER_STEP


def history_of(chain: Mapping[int, RoundRecord], round_id: int, depth: int) -> tuple[History, int]:
    """(history, first round used) for a window of `round_id`: the accepted norms and tokens
    of the `depth` rounds before it; (empty, -1) when the chain lacks one of those rounds
    (a joiner whose records expired), and the record says so, so both sides agree."""
    first = max(0, round_id - depth)
    rounds = range(first, round_id)
    if not rounds or any(r not in chain for r in rounds):
        return History(), -1
    norms: list[float] = []
    tokens: list[int] = []
    for r in rounds:
        record = chain[r]
        norms.extend(record.norms)
        tokens.extend(t for _, _, t in record.contributors)
    return History(tuple(norms), tuple(tokens)), first


def history_from(
    chain: Mapping[int, RoundRecord], round_id: int, first: int, depth: int
) -> History | None:
    """The history a record says it used (`first`: its `history_from`), None if unknown here."""
    if first < 0:
        return History()
    if first != max(0, round_id - depth):
        return None
    history, used = history_of(chain, round_id, depth)
    return history if used == first else None


@dataclass(frozen=True)
class RoundMerge:
    """The outcome of a window's merge (before the outer step)."""

    candidates: tuple[Candidate, ...]
    """In merge order (by peer id)."""
    screening: Screening
    encoded: dict[str, compress.EncodedTensor] | None
    """The outer gradient as shipped (None when no delta was kept)."""
    decoded: dict[str, torch.Tensor] | None
    """What every replica applies: the decoded outer gradient."""
    quorum: int
    """The fewest deltas the screening must keep for the merge to be committed."""

    @property
    def quorate(self) -> bool:
        """Whether the merge may be committed: at least `quorum` deltas passed the
        screening. The one place that rule lives: the committer, the synchronizer's
        answer to its learners, the audit and the simulator all ask this."""
        return self.decoded is not None and len(self.screening.kept) >= self.quorum


def merge_round(
    candidates: Sequence[Candidate],
    *,
    history: History,
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    outer: OuterConfig,
    sync: SyncConfig,
    rules: ScreeningRules,
    max_tokens_per_step: int,
    outer_codec: compress.Codec,
    quorum: int | None = None,
) -> RoundMerge:
    """Screen, weigh, merge and encode one window. Pure and deterministic. `quorum`: the
    run's `sync.min_quorum` unless given (the simulator's lockstep baseline lowers it to
    the learners it has)."""
    quorum = sync.min_quorum if quorum is None else quorum
    ordered = tuple(sorted(candidates, key=lambda c: c.peer))
    screening = screen(
        ordered,
        history,
        rules,
        momentum,
        params=params,
        max_tokens_per_step=max_tokens_per_step,
        max_weight_share=outer.max_weight_share,
        staleness_discount=sync.staleness_discount,
    )
    if not screening.kept:
        return RoundMerge(ordered, screening, None, None, quorum)
    embeddings = frozenset(n for n in params if n.startswith("embed."))
    if outer.merge == "trimmed":
        merged = merge_screened(ordered, screening, "trimmed", trim_fraction=outer.trim_fraction)
    else:
        merged = merge_screened(
            ordered, screening, outer.merge, norm=outer.radial_norm, plain_mean_names=embeddings
        )
    encoded = {name: outer_codec.encode(t) for name, t in merged.items()}
    decoded = {
        name: compress.decode_tensor(e, expected_shape=tuple(merged[name].shape))
        for name, e in encoded.items()
    }
    return RoundMerge(ordered, screening, encoded, decoded, quorum)
