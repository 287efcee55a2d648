"""The global state every peer holds a replica of: fp32 parameters, outer momentum, rounds.

Rounds are counted per fragment: `rounds[f]` is how many outer updates fragment f has
received. Applying the update of (round r, fragment f) requires `rounds[f] == r`, so
every replica applies the same updates in the same order and stays bit-identical (the
state and the outer step live on the CPU in fp32, with arithmetic that is bit-identical on
every CPU kernel set: docs/arithmetic.md). Each fragment has a hash over its parameters,
momentum and delayed-Nesterov accumulators, published in round records so a diverged
replica notices.

The learner thread and the network thread share this object; a lock guards it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.outer.step import OuterState, Params, outer_step

UPDATE_HISTORY = 16
"""Encoded outer updates kept per fragment, to serve peers catching up."""


def hash_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex digest over names, shapes and little-endian fp32 bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to(torch.float32).contiguous().cpu()
        digest.update(name.encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        # the array's own buffer (flat, contiguous): no copy of a tensor to hash it
        digest.update(tensor.numpy().astype("<f4", copy=False).reshape(-1).data)
    return digest.hexdigest()


def _hash_of_parts(params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor], accumulated: Mapping[str, torch.Tensor]) -> str:
    """The fragment hash of these tensors (`GlobalState.fragment_hash`)."""
    tensors = {f"p/{n}": t for n, t in params.items()}
    tensors.update({f"m/{n}": t for n, t in momentum.items()})
    tensors.update({f"a/{n}": t for n, t in accumulated.items()})
    return hash_tensors(tensors)


@dataclass(frozen=True)
class FragmentState:
    """A copy of one fragment's global state, as sent to a peer that joins."""

    fragment: int
    round: int
    params: Params
    momentum: Params
    hash: str
    accumulated: Params = field(default_factory=dict)
    """Deltas summed since the last momentum update (`outer.delayed_nesterov_every > 1`)."""


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

    def _accumulated_of(self, fragment: int) -> Params:
        return {
            n: self.outer_state.accumulated[n]
            for n in self.fragments[fragment]
            if n in self.outer_state.accumulated
        }

    def fragment_hash(self, fragment: int) -> str:
        """Hash of the fragment's parameters, outer momentum and delayed-Nesterov sums.

        The sums (`a/<name>`, present only between momentum updates when
        `delayed_nesterov_every > 1`) shape the next updates, so they are part of the state.
        """
        with self.lock:
            names = self.fragments[fragment]
            params = {n: self.params[n] for n in names}
            return _hash_of_parts(params, self._momentum_of(fragment), self._accumulated_of(fragment))

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
                accumulated={n: t.clone() for n, t in self._accumulated_of(fragment).items()},
            )

    def checked_copy(self, state: FragmentState) -> FragmentState:
        """fp32 CPU copies of a downloaded fragment's params, momentum and sums, after
        checking names, shapes and finiteness of every tensor (ValueError otherwise), with
        `hash` set to what the copies hash to, not to what the donor claimed. Reads only
        the layout, so it needs no lock and leaves the replica untouched."""
        if isinstance(state.fragment, bool) or not isinstance(state.fragment, int):
            raise ValueError(f"fragment must be an int, got {state.fragment!r}")
        if not 0 <= state.fragment < self.num_fragments:
            raise ValueError(f"no fragment {state.fragment} (there are {self.num_fragments})")
        if isinstance(state.round, bool) or not isinstance(state.round, int) or state.round < 0:
            raise ValueError(f"round must be a non-negative int, got {state.round!r}")
        names = set(self.fragments[state.fragment])
        if set(state.params) != names:
            raise ValueError(f"state of fragment {state.fragment} does not match its tensors")
        copies: list[Params] = []
        for kind, tensors in (
            ("params", state.params),
            ("momentum", state.momentum),
            ("accumulated", state.accumulated),
        ):
            if not set(tensors) <= names:
                extra = sorted(set(tensors) - names)[0]
                raise ValueError(f"{kind} tensor {extra!r} is not in fragment {state.fragment}")
            checked: Params = {}
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    raise ValueError(f"{kind} tensor {name} is not a floating-point tensor")
                if tuple(tensor.shape) != tuple(self.params[name].shape):
                    raise ValueError(f"{kind} tensor {name} has shape {tuple(tensor.shape)}")
                copy = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
                # After the cast: a float64 value beyond the fp32 range would become inf.
                if not bool(torch.isfinite(copy).all()):
                    raise ValueError(f"{kind} tensor {name} is not finite")
                checked[name] = copy
            copies.append(checked)
        params, momentum, accumulated = copies
        return FragmentState(
            fragment=state.fragment,
            round=state.round,
            params=params,
            momentum=momentum,
            hash=_hash_of_parts(params, momentum, accumulated),
            accumulated=accumulated,
        )

    def import_fragment(self, state: FragmentState) -> str:
        """Replace one fragment's state with a downloaded copy; returns its hash here.

        Everything is checked before anything changes: on ValueError the replica is as it was.
        """
        return self.install_checked(self.checked_copy(state))

    def install_checked(self, checked: FragmentState) -> str:
        """Install a `checked_copy` (its tensors become the replica's); returns its hash."""
        with self.lock:
            for name in self.fragments[checked.fragment]:
                self.params[name] = checked.params[name]
                for mine, theirs in (
                    (self.outer_state.momentum, checked.momentum),
                    (self.outer_state.accumulated, checked.accumulated),
                ):
                    if name in theirs:
                        mine[name] = theirs[name]
                    else:
                        mine.pop(name, None)
                self.outer_state.tensor_steps[name] = checked.round
            self.rounds[checked.fragment] = checked.round
            self._history[checked.fragment].clear()
            self.applied_hashes[checked.fragment] = {checked.round - 1: checked.hash} if checked.round else {}
        for listener in list(self.listeners):
            listener(checked.fragment, checked.round - 1)
        return checked.hash


@dataclass(frozen=True)
class PreparedUpdate:
    """The result of an outer update computed on a copy: installed only once committed."""

    fragment: int
    round: int
    parent_hash: str
    hash: str
    scratch: GlobalState
    """A one-fragment state holding the new parameters and optimizer buffers."""


def _scratch_of(snapshot: FragmentState, names: list[str], outer: OuterConfig) -> GlobalState:
    """A one-fragment state that takes over a snapshot's tensors, without copying them.

    A snapshot from `export_fragment` is already a private copy; the clone in the
    constructor and the checked copies of `import_fragment` would be two more (at 75M
    parameters a copy of parameters and momentum is 600 MB). The snapshot is consumed: an
    update applied to the scratch changes its tensors in place.
    """
    scratch = GlobalState({}, [list(names)], outer)
    scratch.params = {n: snapshot.params[n] for n in names}
    scratch.outer_state.momentum = dict(snapshot.momentum)
    scratch.outer_state.accumulated = dict(snapshot.accumulated)
    scratch.outer_state.tensor_steps = {n: snapshot.round for n in names}
    scratch.rounds = [snapshot.round]
    return scratch


def prepare_update(
    state: GlobalState,
    fragment: int,
    round_id: int,
    outer_grad: Mapping[str, torch.Tensor],
    snapshot: FragmentState | None = None,
) -> PreparedUpdate:
    """Compute (round_id, fragment)'s update on a copy, leaving `state` untouched.

    The synchronizer needs the resulting hash for its round record *before* it commits,
    and must not change its replica until the commit point. `snapshot`, the caller's own
    `export_fragment` of this fragment, saves a copy and is consumed (its tensors become
    the result's). Raises ValueError as `apply_update` does.
    """
    if snapshot is None:
        snapshot = state.export_fragment(fragment)
    if snapshot.fragment != fragment or snapshot.round != round_id:
        raise ValueError(f"fragment {fragment} is at round {snapshot.round}, update is for round {round_id}")
    scratch = _scratch_of(snapshot, state.fragments[fragment], state.outer)
    new_hash = scratch.apply_update(0, round_id, outer_grad)
    return PreparedUpdate(fragment, round_id, snapshot.hash, new_hash, scratch)


def hash_after(
    snapshot: FragmentState, names: list[str], outer: OuterConfig, outer_grad: Mapping[str, torch.Tensor]
) -> str:
    """The hash a fragment at `snapshot` has after applying `outer_grad`.

    What an auditor compares with a round record; ValueError as `apply_update`. The
    snapshot is consumed (see `_scratch_of`).
    """
    return _scratch_of(snapshot, names, outer).apply_update(0, snapshot.round, outer_grad)


def install_update(state: GlobalState, prepared: PreparedUpdate) -> bool:
    """Swap a prepared result into `state` if it is still at the prepared parent; True if so."""
    with state.lock:
        fragment = prepared.fragment
        if state.rounds[fragment] != prepared.round or state.fragment_hash(fragment) != prepared.parent_hash:
            return False
        source = prepared.scratch.outer_state
        target = state.outer_state
        for name in state.fragments[fragment]:
            state.params[name] = prepared.scratch.params[name]
            for own, theirs in ((target.momentum, source.momentum), (target.accumulated, source.accumulated)):
                if name in theirs:
                    own[name] = theirs[name]
                else:
                    own.pop(name, None)
            target.tensor_steps[name] = source.tensor_steps.get(name, 0)
        target.num_steps += 1
        state.rounds[fragment] += 1
        state.applied_hashes[fragment][prepared.round] = prepared.hash
    for listener in list(state.listeners):
        listener(fragment, prepared.round)
    return True


def import_verified(state: GlobalState, fragment_state: FragmentState) -> str | None:
    """Import a downloaded fragment only if its contents hash to what it claims.

    The hash is taken of the checked copies before they are installed, so a donor that
    names a canonical hash but sends other tensors never changes this replica, and the
    copies checked are the copies installed (one copy of the fragment). Returns the
    hash, or None.
    """
    try:
        checked = state.checked_copy(fragment_state)
    except ValueError:
        return None
    if checked.hash != fragment_state.hash:
        return None
    return state.install_checked(checked)
