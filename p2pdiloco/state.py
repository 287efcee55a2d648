"""The global state every peer holds a replica of: fp32 parameters, outer momentum, rounds.

Rounds are counted per fragment: `rounds[f]` is how many outer updates fragment f has
received. Applying the update of (round r, fragment f) requires `rounds[f] == r`, so
every replica applies the same updates in the same order and stays bit-identical (the
state and the outer step live on the CPU in fp32). Each fragment has a hash over its
parameters and momentum, published in round records so a diverged replica notices.

The learner thread and the network thread share this object; a lock guards it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.outer import OuterState, Params, outer_step

UPDATE_HISTORY = 16
"""Encoded outer updates kept per fragment, to serve peers catching up."""


def hash_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex digest over names, shapes and little-endian fp32 bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to(torch.float32).contiguous().cpu()
        digest.update(name.encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class FragmentState:
    """A copy of one fragment's global state, as sent to a peer that joins."""

    fragment: int
    round: int
    params: Params
    momentum: Params
    hash: str


class GlobalState:
    """A replica of the run's global state, split into fragments."""

    def __init__(self, params: Params, fragments: list[list[str]], outer: OuterConfig) -> None:
        self.params = {
            name: t.detach().to(torch.float32).cpu().clone() for name, t in params.items()
        }
        self.fragments = fragments
        self.outer = outer
        self.outer_state = OuterState()
        self.rounds = [0] * len(fragments)
        self.lock = threading.RLock()
        self._history: list[OrderedDict[int, bytes]] = [OrderedDict() for _ in fragments]
        self.applied_hashes: list[dict[int, str]] = [{} for _ in fragments]
        """Hash of each fragment after each update this replica applied."""
        self.listeners: list[Callable[[int, int], None]] = []
        """Called as `listener(fragment, round)` after each applied update (any thread)."""

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def round_of(self, fragment: int) -> int:
        with self.lock:
            return self.rounds[fragment]

    def fragment_params(self, fragment: int) -> tuple[int, Params]:
        """(round, a copy of the fragment's parameters): the base a learner's delta refers to."""
        with self.lock:
            names = self.fragments[fragment]
            return self.rounds[fragment], {n: self.params[n].clone() for n in names}

    def _momentum_of(self, fragment: int) -> Params:
        return {
            n: self.outer_state.momentum[n]
            for n in self.fragments[fragment]
            if n in self.outer_state.momentum
        }

    def fragment_hash(self, fragment: int) -> str:
        """Hash of the fragment's parameters and outer momentum."""
        with self.lock:
            names = self.fragments[fragment]
            tensors = {f"p/{n}": self.params[n] for n in names}
            tensors.update({f"m/{n}": t for n, t in self._momentum_of(fragment).items()})
            return hash_tensors(tensors)

    def apply_update(
        self, fragment: int, round_id: int, outer_grad: Mapping[str, torch.Tensor]
    ) -> str:
        """Apply the outer update of (round_id, fragment); returns the fragment's new hash.

        Raises ValueError when the replica is not at `round_id` for that fragment or the
        gradient does not cover exactly the fragment's tensors: the caller catches up first.
        """
        with self.lock:
            if self.rounds[fragment] != round_id:
                raise ValueError(
                    f"fragment {fragment} is at round {self.rounds[fragment]}, update is for round {round_id}"
                )
            names = self.fragments[fragment]
            if set(outer_grad) != set(names):
                raise ValueError(
                    f"update for fragment {fragment} does not cover exactly its tensors"
                )
            for name in names:
                if tuple(outer_grad[name].shape) != tuple(self.params[name].shape):
                    raise ValueError(
                        f"update tensor {name} has shape {tuple(outer_grad[name].shape)}"
                    )
            outer_step(
                self.params,
                {n: outer_grad[n] for n in names},
                self.outer_state,
                lr=self.outer.lr,
                momentum=self.outer.momentum,
                nesterov=self.outer.nesterov,
                delayed_every=self.outer.delayed_nesterov_every,
            )
            self.rounds[fragment] += 1
            new_hash = self.fragment_hash(fragment)
            self.applied_hashes[fragment][round_id] = new_hash
        for listener in list(self.listeners):
            listener(fragment, round_id)
        return new_hash

    def remember_update(self, fragment: int, round_id: int, encoded: bytes) -> None:
        """Keep the encoded update of (round_id, fragment) to serve peers catching up."""
        with self.lock:
            history = self._history[fragment]
            history[round_id] = encoded
            while len(history) > UPDATE_HISTORY:
                history.popitem(last=False)

    def encoded_update(self, fragment: int, round_id: int) -> bytes | None:
        """The encoded update of (round_id, fragment) if this replica still keeps it."""
        with self.lock:
            return self._history[fragment].get(round_id)

    def export_fragment(self, fragment: int) -> FragmentState:
        """A consistent copy of one fragment's state (for a joining peer)."""
        with self.lock:
            names = self.fragments[fragment]
            return FragmentState(
                fragment=fragment,
                round=self.rounds[fragment],
                params={n: self.params[n].clone() for n in names},
                momentum={n: t.clone() for n, t in self._momentum_of(fragment).items()},
                hash=self.fragment_hash(fragment),
            )

    def import_fragment(self, state: FragmentState) -> str:
        """Replace one fragment's state with a downloaded copy; returns its hash here."""
        with self.lock:
            names = self.fragments[state.fragment]
            if set(state.params) != set(names) or not set(state.momentum) <= set(names):
                raise ValueError(f"state of fragment {state.fragment} does not match its tensors")
            for name in names:
                if tuple(state.params[name].shape) != tuple(self.params[name].shape):
                    raise ValueError(
                        f"state tensor {name} has shape {tuple(state.params[name].shape)}"
                    )
                self.params[name] = state.params[name].to(torch.float32).clone()
                if name in state.momentum:
                    self.outer_state.momentum[name] = state.momentum[name].to(torch.float32).clone()
                else:
                    self.outer_state.momentum.pop(name, None)
                self.outer_state.tensor_steps[name] = state.round
            self.rounds[state.fragment] = state.round
            self._history[state.fragment].clear()
            new_hash = self.fragment_hash(state.fragment)
            self.applied_hashes[state.fragment] = {state.round - 1: new_hash} if state.round else {}
        for listener in list(self.listeners):
            listener(state.fragment, state.round - 1)
        return new_hash
