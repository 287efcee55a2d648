"""Hypothesis settings shared by the property tests.

The suite (CI and the README's command) runs them derandomized: the examples are a fixed
function of each test, so a landing never fails because the search found something new
that day. `scripts/fuzz.py` runs the same tests with random seeds and `examples(n)` scaled
up (`P2PDILOCO_HYPOTHESIS_PROFILE=fuzz`, `P2PDILOCO_FUZZ_SCALE=k`), and what it finds is
pinned here with `@example` once fixed.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("P2PDILOCO_HYPOTHESIS_PROFILE", "suite")
SCALE = max(1, int(os.environ.get("P2PDILOCO_FUZZ_SCALE", "1")))

settings.register_profile("suite", derandomize=True, database=None, deadline=None)
settings.register_profile("fuzz", derandomize=False, database=None, deadline=None, print_blob=True)
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """`n` examples in the suite, `n * P2PDILOCO_FUZZ_SCALE` when fuzzing."""
    return n * SCALE
