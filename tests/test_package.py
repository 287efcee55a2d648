"""Package hygiene: an honest public API and a pure core without network imports."""

from __future__ import annotations

import ast
from pathlib import Path

import p2pdiloco

PURE_MODULES = [
    "config",
    "outer",
    "model",
    "data",
    "train",
    "simulate",
    "decoupled",
    "compress",
    "shapes",
    "ledger",
    "learner",
    "wire",
    "windows",
    "election",
    "fragments",
    "membership",
    "messages",
    "errors",
    "rounds",
    "updates",
    "state",
    "checkpoint",
    "addressbook",
    "devices",
    "ratelimit",
    "identity",
    "trust",
    "screening",
    "merging",
    "contributions",
    "audit",
    "record_rules",
    "export",
    "preflight",
]
"""Modules that must stay network-free: each exists, imports no networking library and
imports only other pure p2pdiloco modules. A new pure module is added here by hand."""
NETWORK_IMPORTS = {"asyncio", "socket", "hivemind", "libp2p", "trio", "multiaddr"}
ROOT = Path(p2pdiloco.__file__).parent


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """Top-level packages `path` imports, and the p2pdiloco modules among its imports."""
    packages: set[str] = set()
    ours: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                packages.add(alias.name.split(".")[0])
                if alias.name.startswith("p2pdiloco."):
                    ours.add(alias.name.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module:
            packages.add(node.module.split(".")[0])
            if node.module == "p2pdiloco":
                # from p2pdiloco import wire (a module, not a name such as __version__)
                ours |= {a.name for a in node.names if (path.parent / f"{a.name}.py").is_file()}
            elif node.module.startswith("p2pdiloco."):
                ours.add(node.module.split(".")[1])
    return packages, ours


def test_all_names_exist() -> None:
    for name in p2pdiloco.__all__:
        assert hasattr(p2pdiloco, name), name


def test_pure_core_imports_no_networking() -> None:
    missing = [m for m in PURE_MODULES if not (ROOT / f"{m}.py").is_file()]
    assert not missing, f"pure modules missing: {missing} (renamed? update PURE_MODULES)"
    for module in PURE_MODULES:
        packages, ours = imports_of(ROOT / f"{module}.py")
        assert not packages & NETWORK_IMPORTS, f"{module} imports {packages & NETWORK_IMPORTS}"
        impure = ours - set(PURE_MODULES)
        assert not impure, f"{module} imports p2pdiloco modules that are not pure: {impure}"
