"""The operator's deployment files: the systemd units verify, docs/operate.md shows them as
they are, and the Dockerfile copies what exists and pins a torch the package accepts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = sorted((ROOT / "deploy").glob("*.service"))


def test_operate_md_shows_the_peer_unit_as_shipped() -> None:
    text = (ROOT / "docs" / "operate.md").read_text()
    blocks = re.findall(r"```ini\n(.*?)```", text, re.S)
    assert (ROOT / "deploy" / "p2pdiloco@.service").read_text() in blocks
    for unit in UNITS:
        assert f"deploy/{unit.name}" in text


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_the_units_verify(tmp_path) -> None:
    """`systemd-analyze verify` on an instance of each unit, its binary pointed at this
    environment's `p2pdiloco` (verify checks that ExecStart is executable)."""
    binary = Path(sys.executable).parent / "p2pdiloco"
    if not binary.exists():
        binary = Path(shutil.which("p2pdiloco") or "")
    names = []
    for unit in UNITS:
        text = unit.read_text().replace("/opt/p2pdiloco/bin/p2pdiloco", str(binary))
        name = unit.name.replace("@.", "@testrun.")
        (tmp_path / name).write_text(text)
        names.append(f"./{name}")
    done = subprocess.run(
        ["systemd-analyze", "verify", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if "testrun" in line or "Unknown" in line
    ]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


def test_the_dockerfile_copies_what_exists_and_pins_an_accepted_torch() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+) /src/", text, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), source
    version = re.search(r"^ARG TORCH_VERSION=(\d+)\.(\d+)\.\d+", text, re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', pyproject).groups()
    pinned = (int(version.group(1)), int(version.group(2)))
    assert tuple(map(int, low.split("."))) <= pinned < tuple(map(int, high.split(".")))
    ignored = (ROOT / ".dockerignore").read_text()
    for source in ("pyproject.toml", "README.md", "LICENSE", "p2pdiloco/"):
        assert f"!{source}" in ignored
