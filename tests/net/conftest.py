"""Fixtures for networked tests: every child peer is reaped at test end, even on failure."""

from __future__ import annotations

import atexit
from collections.abc import Iterator

import pytest

from .harness import reap_all

atexit.register(reap_all)  # if pytest itself is interrupted


@pytest.fixture(autouse=True)
def reap_peer_processes() -> Iterator[None]:
    """Kill every peer process group a test started, whatever the outcome."""
    try:
        yield
    finally:
        reap_all()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Networked tests (and only they) may be rerun once, so a rare timing flake of real
    processes on a loaded machine does not throw away a run. pytest names every rerun in
    its summary (`-ra`: lines starting with RERUN); each one is a bug to explain."""
    for item in items:
        if "tests/net/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.flaky(reruns=1))
