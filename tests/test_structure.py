"""The package's folders are its architecture: check the layers hold (scripts/structure.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
structure = importlib.util.module_from_spec(spec)
sys.modules["structure"] = structure
spec.loader.exec_module(structure)

NETWORKING = {"asyncio", "socket", "hivemind", "libp2p", "trio"}
PURE_FOLDERS = ("", "compress", "outer", "wire", "training", "protocol", "trust")
"""The math, the formats and the rules: none of their modules imports a networking
library, directly or through another module of the package."""


def libraries_of(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    return imported


def networking_of(modules: dict) -> dict[str, set[str]]:
    """Per module, the networking libraries it reaches (its own imports and its modules')."""
    reached: dict[str, set[str]] = {}

    def visit(name: str, seen: frozenset) -> set[str]:
        if name not in reached:
            found = libraries_of(modules[name].path) & NETWORKING
            for other in modules[name].imports - seen:
                found |= visit(other, seen | {name})
            reached[name] = found
        return reached[name]

    for name in modules:
        visit(name, frozenset())
    return reached


@pytest.fixture(scope="module")
def modules() -> dict:
    return structure.read_modules()


def test_no_module_imports_one_that_imports_it_back(modules: dict) -> None:
    assert structure.circles(modules) == []


def test_no_module_imports_from_a_folder_above_its_own(modules: dict) -> None:
    assert structure.against_layers(modules) == []


def test_every_folder_of_the_package_is_a_named_layer() -> None:
    folders = {p.name for p in structure.PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(structure.LAYERS) - {""}


@pytest.mark.parametrize("folder", PURE_FOLDERS)
def test_the_math_the_formats_and_the_rules_do_no_networking(folder: str, modules: dict) -> None:
    reached = networking_of(modules)
    paths = sorted((structure.PACKAGE / folder).glob("*.py"))
    assert paths, folder
    for path in paths:
        name = structure.module_name(path)
        if name != "p2pdiloco.__main__":  # the command line, above every layer
            assert not reached[name], (name, reached[name])


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: a made-up package with both faults is caught."""
    fake = {
        "p2pdiloco.wire.a": structure.Module("p2pdiloco.wire.a", tmp_path / "a.py", 1, ast.parse("")),
        "p2pdiloco.wire.b": structure.Module("p2pdiloco.wire.b", tmp_path / "b.py", 1, ast.parse("")),
        "p2pdiloco.cli.c": structure.Module("p2pdiloco.cli.c", tmp_path / "c.py", 1, ast.parse("")),
    }
    fake["p2pdiloco.wire.a"].imports = {"p2pdiloco.wire.b", "p2pdiloco.cli.c"}
    fake["p2pdiloco.wire.b"].imports = {"p2pdiloco.wire.a"}
    assert structure.circles(fake) == [["p2pdiloco.wire.a", "p2pdiloco.wire.b"]]
    assert structure.against_layers(fake) == ["p2pdiloco.wire.a -> p2pdiloco.cli.c"]


def defined_twice(source: str) -> list[str]:
    """Functions a module or class body defines twice: the later one silently replaces the
    earlier (ruff's F811 does not see a method repeated verbatim)."""
    twice = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef):
            names = [
                b.name
                for b in node.body
                if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)
                and not any(isinstance(d, ast.Attribute) for d in b.decorator_list)  # setters
            ]
            twice += sorted({n for n in names if names.count(n) > 1})
    return twice


def test_no_module_or_class_defines_a_function_twice() -> None:
    found = {
        str(path.relative_to(ROOT)): defined_twice(path.read_text())
        for path in (ROOT / "p2pdiloco").rglob("*.py")
    }
    assert {path: names for path, names in found.items() if names} == {}
    assert defined_twice("class A:\n def f(self): pass\n def f(self): pass\n") == ["f"]


def test_the_package_says_what_and_why_not_which_issue() -> None:
    """A docstring or comment says what the code does and why, once; the history of how it
    came to be (issue numbers, which session found what) lives in docs/ and git."""
    cited = re.compile(r"\b(issue|stop) \d+\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "p2pdiloco").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if cited.search(line)
    ]
    assert not found, found


def test_no_module_name_repeats_across_folders() -> None:
    """Near-twin names across floors (`windows` / `window`, `audit` / `audits`) made a
    reader open the wrong file: a module's name is its own, whatever the folder. `base`
    (a folder's abstract interface) is the one name each folder may have."""
    folders_of: dict[str, set[str]] = {}
    for path in (ROOT / "p2pdiloco").rglob("*.py"):
        if path.stem not in ("__init__", "__main__", "base"):
            folders_of.setdefault(path.stem, set()).add(path.parent.name)
    twins = [
        (stem, sorted(folders))
        for stem, folders in folders_of.items()
        if len(folders) > 1 or folders_of.get(stem + "s", folders) - folders
    ]
    assert not twins, twins
