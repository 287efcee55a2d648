"""The swarm simulator agrees with real processes (issue 29): its figures at N = 1,000 are
trusted only because, in the setting that matters (the embedded default, K < N), they
match a real swarm on this machine.

`simulate_swarm.agreement` runs a bootstrap node and four real `python -m p2pdiloco join`
peers on 127.0.0.1 until round 12, then simulates four peers replaying the real learners'
steps over time (their `step` events) over the real span, and compares protocol, membership and records bytes per
second per peer, rounds per minute and goodput (steps merged of those decided).

The simulator charges time to the network, not to the CPU: where other work kept the
machine's cores busy during the real run (`other_cores` above `SHARED_MACHINE_CORES`,
measured from the machine's CPU time less the swarm's own), the figures that follow the
round pace cannot agree, and the test checks what must hold still (docs/scale.md,
"Trusted only after it agrees with real processes").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate_swarm.py"

pytestmark = pytest.mark.timeout(900)


def load_script():
    spec = importlib.util.spec_from_file_location("simulate_swarm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_swarm"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_simulator_agrees_with_four_real_peers_within_the_tolerance() -> None:
    script = load_script()
    entry = script.agreement(4)
    summaries = entry["real_peers"]
    assert len(summaries) == 4 and all(max(s["rounds"]) >= script.AGREEMENT_ROUNDS for s in summaries)
    assert all(s["steps_contributed"] > 0 for s in summaries), "every real learner was merged"
    report = {k: (entry["real"][k], entry["simulated"][k]) for k in entry["real"]}
    errors, others = entry["relative_error"], entry["other_cores"]
    print(f"(real, simulated): {report}; relative errors {errors}; other work {others:.2f} cores")
    tolerance = script.AGREEMENT_TOLERANCE
    if others <= script.SHARED_MACHINE_CORES:
        assert entry["agrees"], f"relative errors {errors} over {tolerance}: (real, simulated) {report}"
        return
    # Other work kept the machine's cores busy beside the real swarm (other tests of the
    # suite, a loaded CI worker): the real merges and applies queue for the CPU, which the
    # simulator charges no time for, so the figures that follow the round pace cannot
    # agree (the suite's own load, 3 tests at a time: simulated 43 % faster). What must
    # hold still: the membership rate (set by the beat) and the goodput agree, and the
    # simulator is never the slower one, as its learners replay the real ones' steps over
    # time (with each at its mean step time, bursts of other work left it 12-14 % slower).
    assert entry["replayed_steps"], "the real learners' step events were replayed"
    assert errors["membership_bytes_per_s_per_peer"] <= tolerance, report
    assert errors["goodput"] <= tolerance, report
    real_pace, simulated_pace = report["rounds_per_min"]
    assert simulated_pace >= (1 - tolerance) * real_pace, report
