"""A real peer whose clock steps away: `python tests/net/skewed_peer.py join ...` runs
`p2pdiloco` with `time.time` shifted by $P2PDILOCO_TEST_CLOCK_OFFSET_S seconds once the file
$P2PDILOCO_TEST_CLOCK_STEP_FILE exists (unset: from the start).

A peer more than 3 s off cannot join a hivemind DHT at all (its initial peers refuse it,
and `join` says so in one line); a clock that steps after the join (a laptop resumed, an
NTP step, a VM migrated) is what a running swarm meets. The shift is made in this
process before anything is imported (hivemind's DHT clock is `time.time` itself), so the
peer signs, stores and judges with the wrong clock. The machine's clock is never touched."""

from __future__ import annotations

import os
import runpy
import sys
import time

_OFFSET_S = float(os.environ.get("P2PDILOCO_TEST_CLOCK_OFFSET_S", "0"))
_STEP_FILE = os.environ.get("P2PDILOCO_TEST_CLOCK_STEP_FILE", "")
"""The clock steps once this file exists (the test creates it when the peer has joined);
unset: from the start."""
_real_time = time.time
_stepped = not _STEP_FILE
_checked_at = 0.0


def _shifted_time() -> float:
    global _stepped, _checked_at
    now = _real_time()
    if not _stepped and now - _checked_at >= 0.5:  # time.time is hot: look twice a second
        _checked_at = now
        _stepped = os.path.exists(_STEP_FILE)
    return now + (_OFFSET_S if _stepped else 0.0)


time.time = _shifted_time

if __name__ == "__main__":
    sys.argv = ["p2pdiloco", *sys.argv[1:]]
    runpy.run_module("p2pdiloco", run_name="__main__", alter_sys=True)
