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
# xdist workers fill the cores, and oversubscribed OpenMP threads spin against each
# other on a loaded machine (a tiny simulation took 10x longer beside a CPU hog).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every event a peer emits (here and in the processes a test starts) must match its
# declaration in p2pdiloco/events.py: a breach raises instead of being logged once.
os.environ["P2PDILOCO_CHECK_EVENTS"] = "1"
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


LONGEST_FIRST = (
    "net/test_nat.py",
    "net/test_sim_agreement.py",
    "net/test_attacks_audits.py",
    "net/test_attacks_members.py",
    "net/test_attacks_transport.py",
    "net/test_swarm.py",
    "net/test_certified.py",
    "net/test_rounds.py",
    "net/test_durable.py",
    "net/test_attacks_replica.py",
    "net/test_attacks.py",
)
"""Test files whose tests take the longest (about 50-200 s each on an idle 2-core machine
with three workers, `--durations`; the NAT test runs where iptables is installed, as in
CI), longest first. The order only schedules, it never skips."""


def _schedule_rank(item: pytest.Item) -> tuple[int, int]:
    path = str(item.fspath).replace("\\", "/")
    for rank, name in enumerate(LONGEST_FIRST):
        if path.endswith("tests/" + name):
            return (0, rank)
    return (1, 0) if "/tests/net/" in path else (2, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first: the networked tests (the long files first), then the pure ones, so
    the workers (`--dist load`, handed a test or two at a time) end together on short
    tests instead of one worker finishing a 2-minute swarm alone (a stable sort: within a
    file the order is the file's)."""
    items.sort(key=_schedule_rank)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the config. This runs in xdist's controller too, which is where the workers'
    reports arrive and the only process whose output is shown (collection hooks run in
    the workers alone); the terminal reporter may not be registered yet. It lives here,
    not in tests/net/conftest.py: the controller never collects, so it never loads a
    conftest below this one (a rerun's cause was never printed)."""
    global _config
    _config = config


_config: pytest.Config | None = None
"""pytest's config, once configured."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print why a networked test needed its rerun (pytest shows only final failures), so a
    flake in CI can be explained from its log."""
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if report.outcome == "rerun" and terminal is not None:
        lines = report.longreprtext.splitlines()
        terminal.write_line(f"\nRERUN CAUSE {report.nodeid}:")
        for line in lines[-40:]:
            terminal.write_line(f"    {line}")
