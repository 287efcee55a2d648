"""A learner's local state on disk: what a restart keeps that the swarm cannot give back.

The global state (parameters, momentum, rounds) is downloaded from live peers on join;
a checkpoint keeps the rest: the local replica, the inner optimizer (AdamW moments),
the error-feedback residuals (what the codec has not yet sent) and the loop's counters.
Written atomically (temporary file, then rename), so a crash never leaves half a file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.errors import ConfigError

log = logging.getLogger(__name__)

FILE_NAME = "learner.pt"


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
    }
    path = directory / FILE_NAME
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    log.info("checkpoint saved path=%s step=%d", path, learner.progress.step)
    return path


def load_learner(directory: str | Path, learner: Any, config_hash: str) -> bool:
    """Restore `learner`'s local state if a checkpoint of the same run config exists."""
    path = Path(directory) / FILE_NAME
    if not path.exists():
        return False
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is reported, never fatal
        log.warning("checkpoint unreadable path=%s error=%r: starting fresh", path, exc)
        return False
    if payload.get("config_hash") != config_hash:
        log.warning("checkpoint of another run config path=%s: starting fresh", path)
        return False
    learner.trainer.model.load_state_dict(payload["model"])
    learner.trainer.optimizer.load_state_dict(payload["optimizer"])
    learner.trainer.step_index = int(payload["step_index"])
    if learner.feedback is not None:
        learner.feedback.load_state_dict(payload["feedback"])
    for key, value in payload["progress"].items():
        if hasattr(learner.progress, key) and key not in ("status", "loop_s", "train_s"):
            setattr(learner.progress, key, value)
    log.info("checkpoint loaded path=%s step=%d", path, learner.progress.step)
    return True
