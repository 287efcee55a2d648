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


def pytest_configure(config: pytest.Config) -> None:
    """Keep the config. This runs in xdist's controller too, which is where the workers'
    reports arrive and the only process whose output is shown (collection hooks run in
    the workers alone); the terminal reporter may not be registered yet."""
    global _config
    _config = config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Networked tests (and only they) may be rerun once, so a rare timing flake of real
    processes on a loaded machine does not throw away a run. pytest names every rerun in
    its summary (`-ra`: lines starting with RERUN); each one is a bug to explain."""
    for item in items:
        if "tests/net/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.flaky(reruns=1))


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
