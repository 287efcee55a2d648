"""What both simulators share: the learners' data and replicas, the loss curve, the delta
channel, and the canonical chain that merges every window with the swarm's own code.

`CanonicalChain` is a simulated swarm's synchronizers in one object: each window goes
through `protocol.merge.merge_round` (screening, token weights, the merge rule, the outer
codec) and is applied with `GlobalState.apply_update`, as a synchronizer commits it. So a
simulated figure, lockstep or decoupled, measures the merge the peers run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress
from p2pdiloco.config import RunConfig, replace
from p2pdiloco.outer.screening import Candidate, Verdict
from p2pdiloco.outer.step import Params
from p2pdiloco.protocol.fragments import partition_fragments
from p2pdiloco.protocol.merge import history_of, max_tokens_per_step, merge_round
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.data import Corpus, learner_batches
from p2pdiloco.training.model import Decoder

DeltaChannel = Callable[[int, Params], tuple[Params, int]]
"""What a delta goes through on its way to the merge: (learner, delta) -> (received delta,
bytes sent). The default sends fp32 as it is; the codecs plug in here."""

Progress = Callable[[str, int, int], None]
"""Progress callback: (phase, done, total)."""

SYNCHRONIZER = "simulated"
"""The synchronizer named in a simulated round record."""


@dataclass
class LossCurve:
    """Held-out loss of one run against the tokens it has processed so far (all learners)."""

    tokens: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)

    def record(self, tokens: int, loss: float) -> None:
        self.tokens.append(tokens)
        self.eval_loss.append(loss)


def fp32_channel(_learner: int, delta: Params) -> tuple[Params, int]:
    """Send a delta uncompressed: 4 bytes per parameter."""
    return delta, sum(t.numel() * 4 for t in delta.values())


def peer_id(learner: int) -> str:
    """The peer id of simulated learner `learner` (merge order is peer-id order)."""
    return f"sim-{learner}"


def global_state_of(model: Decoder) -> Params:
    """The global parameters as fp32 CPU tensors (a copy)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def load_params(model: Decoder, params: Params) -> None:
    """Overwrite a replica's parameters with `params` (the paper's on-receive rule)."""
    for name, p in model.named_parameters():
        if name in params:
            p.copy_(params[name].to(p.device, p.dtype))


def learner_streams(
    config: RunConfig, corpus: Corpus, num_learners: int
) -> list[Iterator[torch.Tensor]]:
    """One batch stream per simulated learner: its own shard, its own order."""
    train, seq_len = config.train, config.model.seq_len
    return [
        learner_batches(corpus, rank, num_learners, train.batch_size, seq_len, train.seed)
        for rank in range(num_learners)
    ]


def schedule_config(config: RunConfig) -> RunConfig:
    """`config` with the cosine schedule spanning the whole simulated run (for DiLoCo and
    the baseline alike): `simulate.rounds * sync.inner_steps` steps."""
    total = config.simulate.rounds * config.sync.inner_steps
    return replace(
        config, train={"total_steps": total, "warmup_steps": min(config.train.warmup_steps, total)}
    )


@dataclass(frozen=True)
class Committed:
    """A window the canonical chain merged and applied."""

    round_id: int
    update: Params
    """The decoded outer gradient: what every replica applies."""
    kept: dict[str, Verdict]
    """Peer id -> its verdict, for the deltas the screening let into the merge."""


class CanonicalChain:
    """The canonical replica of a simulated swarm and the round records of each fragment:
    what its synchronizers agree on, and what the held-out loss is measured on."""

    def __init__(self, config: RunConfig, params: Params) -> None:
        self.config = config
        fragments = partition_fragments(
            {name: t.numel() for name, t in params.items()}, config.sync.num_fragments
        )
        self.state = GlobalState(params, fragments, config.outer)
        self.records: list[dict[int, RoundRecord]] = [{} for _ in fragments]
        """Per fragment, round -> its record (the screening's history)."""
        self.outer_codec = compress.make_codec_from_config(config.compress, outer=True)
        self.token_cap = max_tokens_per_step(config)

    @property
    def fragments(self) -> list[list[str]]:
        """The tensor names of each fragment."""
        return self.state.fragments

    def replica(self) -> GlobalState:
        """A new replica of the canonical state as it is now (a learner's, at the start)."""
        return GlobalState(self.state.params, self.fragments, self.config.outer)

    def contributors(self, fragment: int, round_id: int) -> frozenset[str] | None:
        """Peer ids merged into (round_id, fragment); None while it is not committed."""
        record = self.records[fragment].get(round_id)
        return None if record is None else frozenset(peer for peer, _, _ in record.contributors)

    def merge(
        self, fragment: int, candidates: Sequence[Candidate], quorum: int
    ) -> Committed | None:
        """Merge the window of `fragment`'s current round as a synchronizer does and apply
        it; None (nothing applied) when fewer than `quorum` deltas pass the screening."""
        config, round_id = self.config, self.state.round_of(fragment)
        snapshot = self.state.export_fragment(fragment)
        history, _first = history_of(
            self.records[fragment], round_id, config.screening.history_rounds
        )
        result = merge_round(
            candidates, history=history, params=snapshot.params, momentum=snapshot.momentum,
            outer=config.outer, sync=config.sync, rules=config.screening,
            max_tokens_per_step=self.token_cap, outer_codec=self.outer_codec, quorum=quorum,
        )  # fmt: skip
        if not result.quorate:
            return None
        kept = {v.peer: v for v in result.screening.kept}
        new_hash = self.state.apply_update(fragment, round_id, result.decoded)
        self.records[fragment][round_id] = RoundRecord(
            round_id, fragment, SYNCHRONIZER, new_hash,
            contributors=tuple((v.peer, float(v.weight), v.tokens) for v in kept.values()),
            norms=tuple(v.history_norm for v in kept.values()),
        )  # fmt: skip
        return Committed(round_id, result.decoded, kept)
