"""One fragment's global state and the one way it advances: the outer step, as data in,
data out.

A `FragmentState` is what a fragment is at a round: fp32 parameters, outer momentum,
delayed-Nesterov sums, and the hash over all three that round records publish.
`outer_update` takes a state and a decoded outer gradient and returns the state of the
next round with its hash; every apply goes through it (a learner's replica, the
synchronizer's result before its commit, an auditor's recomputation, the simulators).
`check_fragment_state` turns a state that came from outside (a download) into private,
checked fp32 copies. Pure: no lock, no I/O; a replica (`roles.state`) adds those.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.outer.step import OuterState, Params, outer_step

Layout = Mapping[str, tuple[int, ...]]
"""A fragment's tensor names and shapes."""


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


def fragment_hash(params: Params, momentum: Params, accumulated: Params) -> str:
    """The hash of a fragment's parameters, outer momentum and delayed-Nesterov sums.

    The sums (`a/<name>`, present only between momentum updates when
    `delayed_nesterov_every > 1`) shape the next updates, so they are part of the state.
    """
    tensors = {f"p/{n}": t for n, t in params.items()}
    tensors.update({f"m/{n}": t for n, t in momentum.items()})
    tensors.update({f"a/{n}": t for n, t in accumulated.items()})
    return hash_tensors(tensors)


@dataclass(frozen=True)
class FragmentState:
    """One fragment's global state at `round` (outer updates applied so far)."""

    fragment: int
    round: int
    params: Params
    momentum: Params
    hash: str
    accumulated: Params = field(default_factory=dict)
    """Deltas summed since the last momentum update (`outer.delayed_nesterov_every > 1`)."""


def check_layout(fragment: int, tensors: Mapping[str, torch.Tensor], layout: Layout, kind: str) -> None:
    """ValueError unless `tensors` cover exactly `layout`'s names with its shapes."""
    if set(tensors) != set(layout):
        raise ValueError(f"{kind} for fragment {fragment} does not cover exactly its tensors")
    for name, shape in layout.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{kind} tensor {name} has shape {tuple(tensors[name].shape)}")


def outer_update(state: FragmentState, outer_grad: Mapping[str, torch.Tensor], outer: OuterConfig) -> FragmentState:
    """The fragment after one outer step with `outer_grad`: round + 1, and its new hash.

    Takes over `state`'s tensors and updates them in place (at 75M parameters a copy of
    parameters and momentum is 600 MB): pass a private copy (`GlobalState.export_fragment`)
    unless the state is meant to move. ValueError, before anything changes, when the
    gradient does not cover exactly the fragment's tensors with their shapes.
    """
    check_layout(state.fragment, outer_grad, {n: tuple(t.shape) for n, t in state.params.items()}, "update")
    names = list(state.params)
    optimizer = OuterState(
        momentum=dict(state.momentum),
        accumulated=dict(state.accumulated),
        tensor_steps={n: state.round for n in names},  # each tensor has one step a round
    )
    params = dict(state.params)
    outer_step(
        params,
        {n: outer_grad[n] for n in names},
        optimizer,
        lr=outer.lr,
        momentum=outer.momentum,
        nesterov=outer.nesterov,
        delayed_every=outer.delayed_nesterov_every,
    )
    return FragmentState(
        fragment=state.fragment,
        round=state.round + 1,
        params=params,
        momentum=optimizer.momentum,
        hash=fragment_hash(params, optimizer.momentum, optimizer.accumulated),
        accumulated=optimizer.accumulated,
    )


def check_fragment_state(state: FragmentState, layout: Layout, num_fragments: int) -> FragmentState:
    """fp32 CPU copies of a state that came from outside, after checking its fragment,
    round, names, shapes and the finiteness of every tensor (ValueError otherwise), with
    `hash` set to what the copies hash to, not to what the sender claimed."""
    if isinstance(state.fragment, bool) or not isinstance(state.fragment, int):
        raise ValueError(f"fragment must be an int, got {state.fragment!r}")
    if not 0 <= state.fragment < num_fragments:
        raise ValueError(f"no fragment {state.fragment} (there are {num_fragments})")
    if isinstance(state.round, bool) or not isinstance(state.round, int) or state.round < 0:
        raise ValueError(f"round must be a non-negative int, got {state.round!r}")
    if set(state.params) != set(layout):
        raise ValueError(f"state of fragment {state.fragment} does not match its tensors")
    copies: list[Params] = []
    for kind, tensors in (("params", state.params), ("momentum", state.momentum), ("accumulated", state.accumulated)):
        if not set(tensors) <= set(layout):
            extra = sorted(set(tensors) - set(layout))[0]
            raise ValueError(f"{kind} tensor {extra!r} is not in fragment {state.fragment}")
        checked: Params = {}
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"{kind} tensor {name} is not a floating-point tensor")
            if tuple(tensor.shape) != tuple(layout[name]):
                raise ValueError(f"{kind} tensor {name} has shape {tuple(tensor.shape)}")
            copy = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
            # After the cast: a float64 value beyond the fp32 range would become inf.
            if not bool(torch.isfinite(copy).all()):
                raise ValueError(f"{kind} tensor {name} is not finite")
            checked[name] = copy
        copies.append(checked)
    params, momentum, accumulated = copies
    return FragmentState(state.fragment, state.round, params, momentum, fragment_hash(params, momentum, accumulated), accumulated)
