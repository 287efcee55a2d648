"""Parameter fragments and their staggered schedule (Streaming DiLoCo, Decoupled DiLoCo).

Tensors are bin-packed into F fragments of similar size so that each synchronisation
moves about 1/F of the model; fragment f is synchronised every H inner steps, offset by
f * H / F steps, so a peer's upload is spread evenly over time. F = 1 is plain DiLoCo.
"""

from __future__ import annotations

from collections.abc import Mapping


def partition_fragments(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Greedy balanced bin packing: largest tensor first into the lightest fragment.

    Deterministic (ties broken by name) so every peer derives the same fragments from the
    same model. Each fragment's names keep the model's order. Raises if a fragment would
    be empty (more fragments than tensors).
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {num_fragments} fragments")
    order = {name: index for index, name in enumerate(sizes)}
    loads = [0] * num_fragments
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        lightest = min(range(num_fragments), key=lambda f: (loads[f], f))
        bins[lightest].append(name)
        loads[lightest] += sizes[name]
    return [sorted(names, key=order.__getitem__) for names in bins]


def fragment_offset(fragment: int, inner_steps: int, num_fragments: int) -> int:
    """Steps by which fragment `fragment`'s schedule is shifted: f * H / F (rounded down)."""
    return fragment * inner_steps // num_fragments


def fragments_due(
    step: int, inner_steps: int, num_fragments: int, warm_steps: int = 0, warm_inner_steps: int = 1
) -> list[int]:
    """Fragments whose synchronisation falls at inner step `step` (1-based, after the step).

    During a warm start (steps 1..`warm_steps`) every fragment is due every
    `warm_inner_steps` steps; after it, fragment f is due at steps H + offset_f,
    2H + offset_f, ... counted from the end of the warm start.
    """
    if step <= warm_steps:
        return list(range(num_fragments)) if step % warm_inner_steps == 0 else []
    due = []
    for fragment in range(num_fragments):
        shifted = step - warm_steps - fragment_offset(fragment, inner_steps, num_fragments)
        if shifted >= inner_steps and shifted % inner_steps == 0:
            due.append(fragment)
    return due


def frame_problem(
    sizes: Mapping[str, int], fragments: list[list[str]], max_elements: int, max_bytes: int
) -> str:
    """Why a fragment's delta or update cannot travel in one frame (fp32, the widest codec,
    with 1 MiB for the header), or "" when every fragment fits. State transfer is split
    into parts (`state_transfer`); contributions and updates are one frame a fragment."""
    cap = min(max_elements, (max_bytes - (1 << 20)) // 4)
    loads = [sum(sizes[n] for n in names) for names in fragments]
    worst = max(range(len(loads)), key=loads.__getitem__)
    if loads[worst] <= cap:
        return ""
    total = sum(loads)
    return (
        f"sync.num_fragments={len(fragments)} puts {loads[worst]:,} elements in fragment {worst}; "
        f"one frame carries at most {cap:,}: use sync.num_fragments >= {-(-total // cap)} "
        "(or more, the packing is not exact)"
    )
