"""Package hygiene: an honest public API and a pure core without network imports."""

from __future__ import annotations

import ast
from pathlib import Path

import p2pdiloco

PURE_MODULES = ["config", "outer", "model", "data", "train", "simulate", "compress", "wire"]
NETWORK_IMPORTS = {"asyncio", "socket", "hivemind", "libp2p", "trio", "multiaddr"}


def test_all_names_exist() -> None:
    for name in p2pdiloco.__all__:
        assert hasattr(p2pdiloco, name), name


def test_pure_core_imports_no_networking() -> None:
    root = Path(p2pdiloco.__file__).parent
    for module in PURE_MODULES:
        path = root / f"{module}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & NETWORK_IMPORTS, f"{module} imports {imported & NETWORK_IMPORTS}"
