"""Fuzz: the property tests with random seeds and many more examples, until time is up.

The suite runs every hypothesis test derandomized (`tests/proptest.py`), so a landing never
fails because the search found something new that day. This script is where new things are
found: it runs the same tests over and over, each pass with fresh random seeds and
`--scale` times the suite's examples, and stops at the first failure (a finding: hypothesis
prints the falsifying example and a `@reproduce_failure` blob). Fix it, pin the example
with `@example(...)` in the test, and run again. Run it before landing.

    python scripts/fuzz.py [--minutes 10] [--scale 10] [--json PATH] [-k EXPR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def property_test_files() -> list[str]:
    """Every test file that uses hypothesis."""
    tests = sorted((REPO_ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(REPO_ROOT)) for p in tests if "from hypothesis" in p.read_text()]


def run_pass(
    files: list[str], scale: int, keyword: str | None, timeout_s: float
) -> tuple[int | None, str]:
    """One pytest pass over `files` with random seeds; (exit code or None if cut, output)."""
    env = dict(os.environ, P2PDILOCO_HYPOTHESIS_PROFILE="fuzz", P2PDILOCO_FUZZ_SCALE=str(scale))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files]
    if keyword:
        command += ["-k", keyword]
    try:
        proc = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return None, "pass cut at the time limit"
    return proc.returncode, (proc.stdout + proc.stderr)[-6000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget")
    parser.add_argument("--scale", type=int, default=10, help="examples per test x the suite's")
    parser.add_argument("--quick", action="store_true", help="one minute at scale 2")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.scale = 1.0, 2
    files = property_test_files()
    deadline = time.monotonic() + args.minutes * 60
    passes, finding = 0, None
    while time.monotonic() < deadline:
        code, output = run_pass(files, args.scale, args.keyword, deadline - time.monotonic() + 5)
        if code is None:
            break
        if code not in (0, 5):
            finding = output
            break
        passes += 1
    result = {
        "minutes": args.minutes,
        "scale": args.scale,
        "files": files,
        "passes": passes,
        "finding": finding,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if finding:
        print(finding)
        print(f"fuzz: FINDING after {passes} clean passes over {len(files)} files")
        return 1
    print(f"fuzz: {passes} clean passes over {len(files)} files at {args.scale}x examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
