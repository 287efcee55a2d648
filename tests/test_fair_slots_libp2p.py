"""Fair sharing of a full handler on the libp2p transport, run in a child process.

py-libp2p and hivemind cannot share a process (duplicate protobuf symbols): importing
py-libp2p here would break every hivemind test that runs after it in the same pytest
worker. The cases live in tests/libp2p_fair_slots_cases.py (not collected by name) and
run under their own interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "libp2p_fair_slots_cases.py"


@pytest.mark.timeout(300)
def test_fair_slots_on_trio_with_the_libp2p_stream_and_lock() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CASES.parents[1]), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider", str(CASES)],
        capture_output=True, text=True, timeout=280, env=env, cwd=CASES.parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
