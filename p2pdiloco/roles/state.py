"""The global state every peer holds a replica of: fp32 parameters, outer momentum, rounds.

Rounds are counted per fragment: `rounds[f]` is how many outer updates fragment f has
received. Applying the update of (round r, fragment f) requires `rounds[f] == r`, so
every replica applies the same updates in the same order and stays bit-identical (the
state and the outer step live on the CPU in fp32, with arithmetic that is bit-identical on
every CPU kernel set: docs/arithmetic.md). Each fragment has a hash over its parameters,
momentum and delayed-Nesterov accumulators, published in round records so a diverged
replica notices.

The step itself is `outer.fragment_state.outer_update` (pure); a replica adds what only a
replica has: a lock (the learner thread and the network thread share it), the hash after
every round it applied (so a parent is never hashed again), and listeners.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.outer.fragment_state import (
    FragmentState,
    Layout,
    check_fragment_state,
    fragment_hash,
    outer_update,
)
from p2pdiloco.outer.step import OuterState, Params


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
        self.applied_hashes: list[dict[int, str]] = [{} for _ in fragments]
        """Hash of each fragment after each round this replica applied (or downloaded)."""
        self.layouts: list[Layout] = [
            {n: tuple(self.params[n].shape) for n in names} for names in fragments
        ]
        """Per fragment, its tensor names and shapes (fixed for the run)."""
        self.sizes = [sum(math.prod(shape) for shape in layout.values()) for layout in self.layouts]
        """Per fragment, its number of parameters (sizes a transfer's deadline)."""
        self._genesis: list[str | None] = [None] * len(fragments)
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

    def _own(self, fragment: int, hash_: str = "") -> FragmentState:
        """The fragment as a `FragmentState` over this replica's own tensors (no copy)."""
        names = self.fragments[fragment]
        optimizer = self.outer_state
        return FragmentState(
            fragment=fragment,
            round=self.rounds[fragment],
            params={n: self.params[n] for n in names},
            momentum={n: optimizer.momentum[n] for n in names if n in optimizer.momentum},
            hash=hash_,
            accumulated={n: optimizer.accumulated[n] for n in names if n in optimizer.accumulated},
        )

    def fragment_hash(self, fragment: int) -> str:
        """The fragment's hash computed from its tensors now (see `current_hash`)."""
        with self.lock:
            own = self._own(fragment)
            return fragment_hash(own.params, own.momentum, own.accumulated)

    def current_hash(self, fragment: int) -> str:
        """The fragment's hash at its current round, as recorded when the round was applied:
        hashed only once per replica (at round 0), never again for a parent."""
        with self.lock:
            round_id = self.rounds[fragment]
            if round_id > 0:
                return self.applied_hashes[fragment][round_id - 1]
            if self._genesis[fragment] is None:
                self._genesis[fragment] = self.fragment_hash(fragment)
            return self._genesis[fragment]

    def export_fragment(self, fragment: int) -> FragmentState:
        """A consistent private copy of one fragment's state (for a joiner, or to compute an
        update on without touching the replica)."""
        with self.lock:
            own = self._own(fragment, self.current_hash(fragment))
            return FragmentState(
                fragment=fragment,
                round=own.round,
                params={n: t.clone() for n, t in own.params.items()},
                momentum={n: t.clone() for n, t in own.momentum.items()},
                hash=own.hash,
                accumulated={n: t.clone() for n, t in own.accumulated.items()},
            )

    def apply_update(self, fragment: int, round_id: int, outer_grad: Mapping[str, torch.Tensor]) -> str:
        """Apply the outer update of (round_id, fragment) in place; returns the new hash.

        For a gradient this replica trusts (the simulators, tests). ValueError, before
        anything changes, when the replica is not at `round_id` for that fragment or the
        gradient does not cover exactly the fragment's tensors.
        """
        with self.lock:
            if self.rounds[fragment] != round_id:
                raise ValueError(
                    f"fragment {fragment} is at round {self.rounds[fragment]}, update is for round {round_id}"
                )
            advanced = outer_update(self._own(fragment), outer_grad, self.outer)
            self.install(advanced)
            return advanced.hash

    def install(self, advanced: FragmentState, parent: str | None = None) -> bool:
        """Make `advanced` (an `outer_update` of this replica's round) the fragment's state,
        if the replica is still at its parent round (and hash `parent`, when given); True
        if installed. Its tensors become the replica's."""
        with self.lock:
            fragment = advanced.fragment
            if self.rounds[fragment] != advanced.round - 1:
                return False
            if parent is not None and self.current_hash(fragment) != parent:
                return False
            self._take(advanced)
            self.outer_state.num_steps += 1
            self.applied_hashes[fragment][advanced.round - 1] = advanced.hash
        self._tell(fragment, advanced.round - 1)
        return True

    def checked_copy(self, state: FragmentState) -> FragmentState:
        """`check_fragment_state` against this replica's layout (no lock: reads the layout)."""
        if isinstance(state.fragment, int) and 0 <= state.fragment < self.num_fragments:
            layout = self.layouts[state.fragment]
        else:
            layout = {}
        return check_fragment_state(state, layout, self.num_fragments)

    def install_download(self, checked: FragmentState) -> str:
        """Replace one fragment's state with a `checked_copy` of a download (its tensors
        become the replica's); the hashes of earlier rounds are forgotten. Returns its hash."""
        with self.lock:
            self._take(checked)
            self.applied_hashes[checked.fragment] = {checked.round - 1: checked.hash} if checked.round else {}
            if not checked.round:
                self._genesis[checked.fragment] = checked.hash
        self._tell(checked.fragment, checked.round - 1)
        return checked.hash

    def verified_copy(self, state: FragmentState) -> FragmentState | None:
        """A `checked_copy` of a downloaded fragment if its contents hash to what it
        claims, else None (no lock: installs nothing; the download installs it later with
        `install_download`, so no network wait ever sits between check and install).

        The hash is taken of the checked copies, so a donor that names a canonical hash
        but sends other tensors never changes this replica, and the copies checked are
        the copies installed."""
        try:
            checked = self.checked_copy(state)
        except ValueError:
            return None
        return checked if checked.hash == state.hash else None

    def import_verified(self, state: FragmentState) -> str | None:
        """Import a downloaded fragment only if its contents hash to what it claims
        (`verified_copy`, then `install_download`); the hash, or None."""
        checked = self.verified_copy(state)
        return None if checked is None else self.install_download(checked)

    def _take(self, state: FragmentState) -> None:
        """The fragment's tensors and round become `state`'s (under the lock)."""
        optimizer = self.outer_state
        for name in self.fragments[state.fragment]:
            self.params[name] = state.params[name]
            for own, theirs in ((optimizer.momentum, state.momentum), (optimizer.accumulated, state.accumulated)):
                if name in theirs:
                    own[name] = theirs[name]
                else:
                    own.pop(name, None)
            optimizer.tensor_steps[name] = state.round
        self.rounds[state.fragment] = state.round

    def _tell(self, fragment: int, round_id: int) -> None:
        for listener in list(self.listeners):
            listener(fragment, round_id)
