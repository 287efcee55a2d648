"""The global state's files: one per fragment, and the offline check that lets one in.

`global-<f>.pt` holds a fragment's `FragmentState` (parameters, outer momentum,
delayed-Nesterov sums) at round R, the sealed round records of the canonical chain up to
round R-1 (each signed by its synchronizer, linked parent to hash) and the update frame
of round R-1. `read_fragment` gives it back only when everything checks without the
network: every record opens with its synchronizer's signature for this run, the records
form one chain (from this run's initial state when it starts at round 0), and the saved
tensors (checked like any download: layout, fp32, finite) hash to what the last record
signs. The file's own claims (a hash, a round) are never taken on trust.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco import wire
from p2pdiloco.outer.fragment_state import FragmentState
from p2pdiloco.peer.checkpoint import Unreadable, atomic_save, read_saved, remove_stale_temp_files
from p2pdiloco.protocol.rounds import RoundRecord, open_record
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.wire.updates import Update, parse_update

FORMAT = 1
"""Version of the file layout below (a file of another version is not read)."""
MAX_SAVED_RECORDS = 256
"""Records of a fragment's chain a checkpoint keeps (the latest; a run younger than this
keeps its whole chain from round 0)."""


def file_name(fragment: int) -> str:
    return f"global-{fragment}.pt"


@dataclass(frozen=True)
class SavedFragment:
    """A fragment's state as read back from disk and verified."""

    state: FragmentState
    """Checked fp32 copies; `hash` is what they hash to."""
    records: dict[int, RoundRecord]
    """The chain that justifies it, by round, ending at `state.round - 1`."""
    frame: Update | None
    """The update of the last round (None when it was not kept or does not check)."""


# --- the chain a state stands on (pure) --------------------------------------------------


def justifying_chain(
    records: Mapping[int, RoundRecord],
    round_id: int,
    state_hash: str,
    limit: int = MAX_SAVED_RECORDS,
) -> list[RoundRecord]:
    """The records that lead to a fragment's state at `round_id` with hash `state_hash`,
    oldest first: the record of round `round_id - 1` that signs that hash, and before it
    each record whose hash is the next one's parent, back as far as `records` go (at most
    `limit`). Empty when no record signs the state."""
    last = records.get(round_id - 1)
    if round_id <= 0 or last is None or last.hash != state_hash:
        return []
    chain = [last]
    while len(chain) < limit:
        before = records.get(chain[-1].round - 1)
        if before is None or before.hash != chain[-1].parent:
            break
        chain.append(before)
    return chain[::-1]


def chain_problem(
    chain: list[RoundRecord],
    fragment: int,
    round_id: int,
    state_hash: str,
    genesis_hash: str,
    entitled: Callable[[RoundRecord], bool] = lambda record: True,
) -> str | None:
    """Why `chain` (oldest first) does not justify the fragment's state at `round_id` with
    hash `state_hash`, or None when it does."""
    if not chain:
        return "no round records"
    for before, after in zip(chain, chain[1:], strict=False):
        if after.round != before.round + 1:
            return f"records skip from round {before.round} to {after.round}"
        if after.parent != before.hash:
            return f"record of round {after.round} does not follow round {before.round}"
    for record in chain:
        if record.fragment != fragment:
            return f"record of round {record.round} is of fragment {record.fragment}"
        if not entitled(record):
            return f"record of round {record.round} is by a synchronizer this run does not entitle"
    if chain[0].round == 0 and chain[0].parent != genesis_hash:
        return "chain does not start at this run's initial state"
    if chain[-1].round != round_id - 1:
        return f"records end at round {chain[-1].round}, the state is at round {round_id}"
    if chain[-1].hash != state_hash:
        return "state does not hash to what its round record signs"
    return None


# --- the files ---------------------------------------------------------------------------


def save_fragment(
    directory: str | Path,
    run: str,
    config_hash: str,
    state: FragmentState,
    chain: list[RoundRecord],
    frame: bytes | None,
) -> Path:
    """Write one fragment's state, its justifying chain (sealed records) and the last
    round's update frame, atomically. OSError when the disk refuses."""
    path = Path(directory) / file_name(state.fragment)
    payload = {
        "format": FORMAT,
        "run": run,
        "config_hash": config_hash,
        "fragment": state.fragment,
        "round": state.round,
        "params": state.params,
        "momentum": state.momentum,
        "accumulated": state.accumulated,
        "records": [record.sealed for record in chain],
        "frame": frame,
        "saved_at": time.time(),
    }
    atomic_save(path, payload)
    return path


def _tensors(value: object) -> dict[str, torch.Tensor]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        raise ValueError("tensors are not a dict of named tensors")
    return value


def read_fragment(
    directory: str | Path,
    fragment: int,
    run: str,
    config_hash: str,
    replica: GlobalState,
    genesis_hash: str,
    limits: wire.WireLimits,
    entitled: Callable[[RoundRecord], bool] = lambda record: True,
) -> SavedFragment | str | None:
    """The verified saved state of `fragment` (None: no file; a string: why it is refused).
    Never raises for what a file holds; the replica is not changed."""
    path = Path(directory) / file_name(fragment)
    remove_stale_temp_files(path)
    if not path.exists():
        return None
    payload = read_saved(path)
    if isinstance(payload, Unreadable):
        return f"unreadable ({payload})"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return "not a global-state checkpoint of this version"
    if payload.get("run") != run or payload.get("config_hash") != config_hash:
        return "of another run or run config"
    round_id = payload.get("round")
    if (
        payload.get("fragment") != fragment
        or isinstance(round_id, bool)
        or not isinstance(round_id, int)
        or round_id < 1
    ):
        return "fragment or round malformed"
    raw_records = payload.get("records")
    if not isinstance(raw_records, list) or len(raw_records) > MAX_SAVED_RECORDS:
        return "records malformed"
    chain = []
    for raw in raw_records:
        record = open_record(run, raw)
        if record is None:
            return "a round record is not signed by its synchronizer for this run"
        chain.append(record)
    try:
        saved = FragmentState(
            fragment,
            round_id,
            _tensors(payload.get("params")),
            _tensors(payload.get("momentum")),
            "",
            _tensors(payload.get("accumulated")),
        )
        checked = replica.checked_copy(saved)  # fp32 copies, finite, the layout's; hash taken
    except ValueError as exc:
        return f"state malformed: {exc}"
    problem = chain_problem(chain, fragment, round_id, checked.hash, genesis_hash, entitled)
    if problem:
        return problem
    frame, update = payload.get("frame"), None
    if isinstance(frame, bytes):
        parsed = parse_update(frame, limits, run, replica.layouts)
        if isinstance(parsed, Update) and parsed.digest == chain[-1].digest:
            update = parsed
    return SavedFragment(checked, {record.round: record for record in chain}, update)
