"""Each transport's stack is an extra (`pip install 'p2pdiloco[hivemind]'` or `[libp2p]`):
the package and its command line work with either one (or neither) installed, and asking
for a transport whose stack is missing is one line that names the extra to install.

A missing package is simulated in this process by a `None` entry in `sys.modules` (what
the import system reads as "not importable"), and in a child interpreter for the import
of the whole package, which must not touch either stack.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from p2pdiloco.cli.main import main
from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.transport import STACKS, TransportUnavailable, make_transport, require_stack

ROOT = Path(__file__).resolve().parents[1]
STACK_MODULES = ("hivemind", "libp2p", "trio_bridge")
"""p2pdiloco.transport modules (by prefix) that belong to one stack: imported only by
`make_transport`."""


def block(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Make the stack of transport `kind` look uninstalled, and the transport's module
    not imported yet."""
    for package in STACKS[kind]:
        monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, f"p2pdiloco.transport.{kind}", raising=False)


@pytest.mark.parametrize("kind", ["hivemind", "libp2p"])
def test_a_transport_whose_stack_is_missing_is_one_line_naming_its_extra(monkeypatch, kind) -> None:
    block(monkeypatch, kind)
    with pytest.raises(TransportUnavailable) as raised:
        make_transport(kind, initial_peers=[])
    message = str(raised.value)
    assert "\n" not in message
    assert message.endswith(f"pip install 'p2pdiloco[{kind}]'"), message
    assert f"the {kind} transport needs {STACKS[kind][0]}" in message
    assert isinstance(raised.value, NetworkSetupError)  # the command line prints it, exit 2
    with pytest.raises(TransportUnavailable):
        require_stack(kind)


def test_a_package_missing_under_the_stack_names_the_extra_too(monkeypatch) -> None:
    """py-libp2p installed without one of its own dependencies: the import fails deeper."""
    real = importlib.import_module

    def import_module(name: str, *args):
        if name == "p2pdiloco.transport.libp2p":
            raise ModuleNotFoundError("No module named 'fastecdsa'", name="fastecdsa")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(
        TransportUnavailable, match=r"needs fastecdsa.*pip install 'p2pdiloco\[libp2p\]'"
    ):
        make_transport("libp2p", initial_peers=[])


def test_a_missing_module_of_our_own_is_not_disguised_as_a_missing_extra(monkeypatch) -> None:
    real = importlib.import_module

    def import_module(name: str, *args):
        if name == "p2pdiloco.transport.libp2p":
            raise ModuleNotFoundError("No module named 'p2pdiloco.gone'", name="p2pdiloco.gone")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError) as raised:
        make_transport("libp2p", initial_peers=[])
    assert not isinstance(raised.value, TransportUnavailable)


def test_an_unknown_kind_is_still_a_value_error() -> None:
    with pytest.raises(ValueError, match="transport kind must be one of"):
        make_transport("carrier-pigeon", initial_peers=[])


@pytest.mark.timeout(120)
def test_the_command_line_prints_the_missing_stack_as_one_line(monkeypatch, capsys) -> None:
    block(monkeypatch, "libp2p")
    assert main(["bootstrap", "--transport", "libp2p", "--port", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].endswith("pip install 'p2pdiloco[libp2p]'"), lines
    assert [line for line in lines if "Traceback" in line] == []


@pytest.mark.timeout(300)
def test_the_package_and_its_command_line_import_without_either_stack(tmp_path) -> None:
    """In a child interpreter where neither stack can be imported: every module but the
    stacks' own imports, and commands that need no network run."""
    script = f"""
import importlib, pkgutil, sys
for package in {sorted({p for ps in STACKS.values() for p in ps})!r}:
    sys.modules[package] = None
import p2pdiloco
failed = []
for info in pkgutil.walk_packages(p2pdiloco.__path__, "p2pdiloco."):
    short = info.name.rpartition(".")[2]
    if short == "__main__" or (info.name.startswith("p2pdiloco.transport.") and short.startswith({STACK_MODULES!r})):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        failed.append(f"{{info.name}}: {{exc}}")
assert not failed, failed
from p2pdiloco.cli.main import main
assert main(["config"]) == 0
assert main(["runs"]) == 0
print("IMPORTED", len(sys.modules))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "P2PDILOCO_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0 and "IMPORTED" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-3000:]
    )


def test_each_transport_is_an_extra_and_the_test_extra_pulls_both() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {
        requirement.split(">")[0].split("=")[0].split("<")[0]
        for requirement in project["dependencies"]
    }
    extras = project["optional-dependencies"]
    assert not base & {"hivemind", "libp2p", "trio"}
    assert any(r.startswith("hivemind") for r in extras["hivemind"])
    assert any(r.startswith("libp2p") for r in extras["libp2p"])
    assert "p2pdiloco[hivemind,libp2p]" in extras["test"]
    # the README's first command (the demo, on the default transport) installs its stack
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[hivemind]' && p2pdiloco demo" in readme
    assert "pip install -e '.[test]' && python -m pytest" in readme
