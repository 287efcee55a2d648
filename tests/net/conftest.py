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
