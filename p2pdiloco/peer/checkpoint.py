"""A learner's local state on disk: what a restart keeps that the swarm cannot give back.

The global state (parameters, momentum, rounds) is saved beside it with the round records
that justify it (`peer.durable`: it is what lets a run outlive all its peers); this file
keeps the rest: the local replica, the inner optimizer (AdamW moments), the
error-feedback residuals (what the codec has not yet sent) and the loop's counters.

Written durably and atomically: a uniquely named temporary file in the same directory is
written and fsynced, renamed onto the final name, then the directory is fsynced. A crash
(even SIGKILL or a power cut) leaves either the previous complete file or the new one,
never half a file; the crashed writer's temporary file is removed by the next save/load.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from p2pdiloco.errors import ConfigError

log = logging.getLogger(__name__)

FILE_NAME = "learner.pt"
TMP_SUFFIX = ".tmp"
PAYLOAD_KEYS = ("config_hash", "model", "optimizer", "step_index", "feedback", "progress")

_live_lock = threading.Lock()
_live_tmp: set[Path] = set()
"""Temporary files this process is writing right now: never taken for a crashed writer's."""


def _tmp_prefix(path: Path) -> str:
    """`.learner.` for `learner.pt`: hidden, and tied to the file it will become."""
    return f".{path.stem}."


def remove_stale_temp_files(path: str | Path) -> int:
    """Remove temporary files a crashed writer of `path` left beside it; returns how many.

    Only one process is expected to write a given checkpoint directory; files this
    process is writing at the moment are kept.
    """
    path = Path(path)
    removed = 0
    try:
        candidates = list(path.parent.glob(f"{_tmp_prefix(path)}*{TMP_SUFFIX}"))
    except OSError:
        return 0
    for stale in candidates:
        with _live_lock:
            if stale in _live_tmp:
                continue
        try:
            stale.unlink()
            removed += 1
            log.info("stale temp file removed path=%s", stale)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("stale temp file not removed path=%s error=%r", stale, exc)
    return removed


class Unreadable(str):
    """Why a saved file could not be read at all (`read_saved`): the exception's type."""


def read_saved(path: Path, mmap: bool = False) -> Any:
    """What `path` holds, read with tensors only (`weights_only`: a file from the network
    or a stranger runs no code), or `Unreadable` naming the error: truncated, corrupt or
    not a torch file is the caller's one-line refusal, never an exception. `mmap`: the
    tensors stay on disk until touched."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - every unreadable file is reported the same way
        return Unreadable(type(exc).__name__)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX: fsync the directory itself)."""
    if os.name == "nt":  # no directory handles to fsync; NTFS journals the rename
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (certain network/FUSE mounts) cannot fsync a directory.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
        log.debug("directory fsync unsupported path=%s error=%r", directory, exc)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)`: temp file, fsync, rename, fsync the directory.

    On any failure the temporary file is removed and the exception propagates; the
    previous content of `path`, if any, is left as it was.
    """
    remove_stale_temp_files(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path), suffix=TMP_SUFFIX)
    tmp = Path(tmp_name)
    with _live_lock:
        _live_tmp.add(tmp)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    finally:
        with _live_lock:
            _live_tmp.discard(tmp)
    _fsync_directory(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` durably and atomically (readers see old or new, whole).

    The directory must exist. Raises OSError on failure, leaving the old file in place.
    """
    _atomic_write(Path(path), lambda file: file.write(data))


def atomic_save(path: str | Path, payload: Any) -> None:
    """`torch.save(payload)` into `path` durably and atomically (see `atomic_write_bytes`)."""
    _atomic_write(Path(path), lambda file: torch.save(payload, file))


def save_learner(directory: str | Path, learner: Any, config_hash: str) -> Path:
    """Save `learner`'s local state under `directory`; returns the file written."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create checkpoint dir {directory}: {exc.strerror or exc}"
        ) from None
    progress = dataclasses.asdict(learner.progress)
    progress.pop("latencies_s", None)
    payload = {
        "config_hash": config_hash,
        "model": learner.trainer.model.state_dict(),
        "optimizer": learner.trainer.optimizer.state_dict(),
        "step_index": learner.trainer.step_index,
        "feedback": learner.feedback.state_dict() if learner.feedback is not None else {},
        "progress": progress,
        # the local work no committed round holds, as progress against its base, so a
        # restart rebases it onto whatever global state it finds (learner.local_work)
        "local_work": learner.local_work(),
    }
    path = directory / FILE_NAME
    _atomic_write(path, lambda file: torch.save(payload, file))
    log.info("checkpoint saved path=%s step=%d", path, learner.progress.step)
    return path


def _payload_problem(payload: Any, learner: Any) -> str | None:
    """Why `payload` cannot be applied to `learner` (checked before anything is changed)."""
    if not isinstance(payload, dict):
        return f"payload is a {type(payload).__name__}, not a dict"
    missing = [key for key in PAYLOAD_KEYS if key not in payload]
    if missing:
        return f"missing keys {missing}"
    for key in ("model", "optimizer", "feedback", "progress"):
        if not isinstance(payload[key], dict):
            return f"{key} is a {type(payload[key]).__name__}, not a dict"
    if not isinstance(payload["step_index"], int) or isinstance(payload["step_index"], bool):
        return "step_index is not an int"
    expected = learner.trainer.model.state_dict()
    saved = payload["model"]
    if set(saved) != set(expected):
        return f"model keys differ ({len(saved)} saved, {len(expected)} expected)"
    for name, tensor in expected.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            return f"model tensor {name} has another shape or type"
    optimizer = learner.trainer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = payload["optimizer"].get("param_groups")
        if not isinstance(groups, list) or not isinstance(payload["optimizer"].get("state"), dict):
            return "optimizer state lacks state or param_groups"
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        try:
            saved_sizes = [len(g["params"]) for g in groups]
        except (TypeError, KeyError):
            return "optimizer param_groups malformed"
        if saved_sizes != sizes:
            return f"optimizer groups differ (saved {saved_sizes}, expected {sizes})"
    return None


def load_learner(directory: str | Path, learner: Any, config_hash: str) -> bool:
    """Restore `learner`'s local state if a checkpoint of the same run config exists.

    A missing, truncated, corrupt or foreign checkpoint is logged and reported as False
    (start fresh) before anything in `learner` is changed; it never raises for those.
    """
    path = Path(directory) / FILE_NAME
    remove_stale_temp_files(path)
    if not path.exists():
        return False
    payload = read_saved(path)
    if isinstance(payload, Unreadable):
        log.warning("checkpoint unreadable path=%s error=%s: starting fresh", path, payload)
        return False
    if isinstance(payload, dict) and payload.get("config_hash") != config_hash:
        log.warning("checkpoint of another run config path=%s: starting fresh", path)
        return False
    problem = _payload_problem(payload, learner)
    if problem is not None:
        log.warning("checkpoint malformed path=%s problem=%r: starting fresh", path, problem)
        return False
    try:
        learner.trainer.model.load_state_dict(payload["model"])
        learner.trainer.optimizer.load_state_dict(payload["optimizer"])
    except Exception as exc:  # noqa: BLE001 - reported; the model may already be changed
        raise ConfigError(
            f"checkpoint {path} matches this run config but cannot be applied ({exc}); "
            "move it away to start fresh"
        ) from None
    learner.trainer.step_index = int(payload["step_index"])
    if learner.feedback is not None:
        learner.feedback.load_state_dict(payload["feedback"])
    for key, value in payload["progress"].items():
        if hasattr(learner.progress, key) and key not in ("status", "loop_s", "train_s", "rest_s"):
            setattr(learner.progress, key, value)
    problem = learner.restore_local_work(payload.get("local_work"))
    if problem:  # an older checkpoint, or one of another layout: its local work is gone
        log.warning("checkpoint local work not restored path=%s problem=%r", path, problem)
    log.info("checkpoint loaded path=%s step=%d", path, learner.progress.step)
    return True


def read_model_state(directory: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """(the model's tensors by name, the run config hash) of the checkpoint in `directory`,
    for `p2pdiloco export` and `generate`: this learner's replica as last saved.

    Raises ConfigError (one line: which file, what is wrong) for a missing, unreadable or
    malformed checkpoint. The file is memory-mapped: the optimizer moments beside the
    model are never read into memory.
    """
    path = Path(directory) / FILE_NAME
    if not path.is_file():
        raise ConfigError(f"--checkpoint {directory}: no {FILE_NAME} in it (a `join --checkpoint-dir` folder)")
    payload = read_saved(path, mmap=True)
    if isinstance(payload, Unreadable):
        raise ConfigError(f"checkpoint {path} is unreadable ({payload}): not a p2pdiloco checkpoint")
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise ConfigError(f"checkpoint {path} holds no model tensors: not a p2pdiloco checkpoint")
    return model, str(payload.get("config_hash", ""))
