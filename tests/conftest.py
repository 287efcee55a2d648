"""Shared fixtures: small configs and a tiny corpus so the pure tests stay fast."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import proptest  # noqa: F401  (loads the hypothesis profile before any test module)
import pytest
import torch

from p2pdiloco.config import RunConfig, load_config
from p2pdiloco.training.data import Corpus

# One thread a test process, and (through the environment) a process a test starts: the
# two xdist workers fill two cores, and oversubscribed OpenMP threads spin against each
# other on a loaded machine (a tiny simulation took 10x longer beside a CPU hog).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Checkpoints are on by default, in the user's data directory: a test's peers (and the
# processes they start) write to a temporary one instead, never to the real home.
os.environ["P2PDILOCO_DATA_HOME"] = tempfile.mkdtemp(prefix="p2pdiloco-data-")
atexit.register(shutil.rmtree, os.environ["P2PDILOCO_DATA_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_config() -> RunConfig:
    """A tiny model on a slice of the standard library: seconds, not minutes."""
    return load_config(
        None,
        [
            "model.preset='tiny'",
            "model.seq_len=64",
            "data.max_files=120",
            "train.batch_size=4",
            "train.device='cpu'",
            "train.warmup_steps=5",
            "sync.inner_steps=10",
            "simulate.rounds=3",
            "simulate.learners=2",
            "simulate.eval_batches=2",
        ],
    )


@pytest.fixture(scope="session")
def tiny_corpus(tiny_config: RunConfig) -> Corpus:
    return Corpus.from_config(tiny_config.data)
