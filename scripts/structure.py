"""The package's shape in numbers: long modules, classes and functions, import circles,
imports that run against the layers, and code that nothing but tests uses.

    python scripts/structure.py            # the report
    python scripts/structure.py --json     # the same, as JSON (for before/after notes)
    python scripts/structure.py --check    # exit 1 on a circle or an import against the layers

Read from the source with `ast`: nothing of the package is imported or run. The layers
are the folders of `p2pdiloco/`, lowest first (`LAYERS`); a module may import from its
own folder and from folders below it, never from one above. The dead-code figure is a
name count, the same heuristic as vulture: a function, class or method whose name
appears nowhere in the package or `scripts/` except where it is defined. A name that
only tests use counts as dead; so would a name called through `getattr` (none is, today).
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2pdiloco"

# Lowest first. A module imports only from its own layer or lower ones. The top-level
# modules of the package (config, errors, events, ...) form the ground floor.
LAYERS = ("", "compress", "outer", "wire", "training", "transport", "protocol", "trust", "roles", "sim", "peer", "cli")

LONG_MODULE, LONG_CLASS, LONG_FUNCTION = 400, 300, 80


@dataclass
class Module:
    name: str
    path: pathlib.Path
    lines: int
    tree: ast.Module
    imports: set[str] = field(default_factory=set)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules() -> dict[str, Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = module_name(path)
        modules[name] = Module(name, path, text.count("\n"), ast.parse(text))
    for module in modules.values():
        module.imports = internal_imports(module, modules)
    return modules


def internal_imports(module: Module, modules: dict[str, Module]) -> set[str]:
    """The package's modules that `module` imports, at any depth of its code."""
    found = set()
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the module `pkg.sub`; `from pkg import name`, `pkg`
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module.name and name != "p2pdiloco":
                found.add(name)
    return found


def layer_of(name: str) -> str:
    """The folder of `p2pdiloco/` that a module lies in ("" for the top-level modules)."""
    parts = name.split(".")
    if len(parts) == 2 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return parts[1] if len(parts) > 2 else ""


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in sorted(modules[name].imports):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def against_layers(modules: dict[str, Module]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    wrong = []
    for module in modules.values():
        if module.name == "p2pdiloco.__main__":
            continue  # `python -m p2pdiloco`: the entry point stands above every layer
        mine = layer_of(module.name)
        if mine not in rank:
            wrong.append(f"{module.name}: folder {mine!r} is not in LAYERS")
            continue
        for other in sorted(module.imports):
            theirs = layer_of(other)
            if theirs in rank and rank[theirs] > rank[mine]:
                wrong.append(f"{module.name} -> {other}")
    return wrong


def long_definitions(modules: dict[str, Module]) -> tuple[list, list]:
    classes, functions = [], []
    for module in modules.values():
        for node in ast.walk(module.tree):
            length = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and length > LONG_CLASS:
                classes.append((f"{module.name}.{node.name}", length))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > LONG_FUNCTION:
                functions.append((f"{module.name}.{node.name}", length))
    return sorted(classes, key=lambda c: -c[1]), sorted(functions, key=lambda f: -f[1])


HOOKS = {"forward", "collect", "validate", "main"}  # called by torch, prometheus, hivemind, scripts


def references(paths: list[pathlib.Path]) -> dict[str, list[tuple[pathlib.Path, int]]]:
    """Every place a name is used: read, taken as an attribute, or imported (`__all__` does not count)."""
    found: dict[str, list] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, []).append((path, node.lineno))
    return found


def dead_code(modules: dict[str, Module]) -> list[tuple[str, int]]:
    """Definitions that nothing outside tests uses, to a fixed point: a use inside dead
    code, or inside the definition itself, does not count."""
    used = references([m.path for m in modules.values()] + sorted((ROOT / "scripts").glob("*.py")))
    defs = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("__") or node.name in HOOKS:
                    continue
                if any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in node.decorator_list):
                    continue
                defs.append((module, node))
    dead: set[int] = set()
    changed = True
    while changed:
        changed = False
        spans = [(m.path, n.lineno, n.end_lineno) for i, (m, n) in enumerate(defs) if i in dead]
        for i, (module, node) in enumerate(defs):
            if i in dead:
                continue
            live = [
                (path, line) for path, line in used.get(node.name, [])
                if not (path == module.path and node.lineno <= line <= node.end_lineno)
                and not any(path == p and a <= line <= b for p, a, b in spans)
            ]
            if not live:
                dead.add(i)
                changed = True
    return sorted((f"{defs[i][0].name}.{defs[i][1].name}", defs[i][1].end_lineno - defs[i][1].lineno + 1) for i in dead)


def report() -> dict:
    modules = read_modules()
    classes, functions = long_definitions(modules)
    dead = dead_code(modules)
    return {
        "modules": len(modules),
        "lines": sum(m.lines for m in modules.values()),
        f"modules over {LONG_MODULE} lines": sorted(
            ((m.name, m.lines) for m in modules.values() if m.lines > LONG_MODULE), key=lambda m: -m[1]),
        f"classes over {LONG_CLASS} lines": classes,
        f"functions over {LONG_FUNCTION} lines": functions,
        "import circles": circles(modules),
        "imports against the layers": against_layers(modules),
        "unused outside tests": dead,
        "lines unused outside tests": sum(lines for _, lines in dead),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 on a circle or an import against the layers")
    args = parser.parse_args()
    result = report()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            if isinstance(value, list):
                print(f"{key}: {len(value)}")
                for item in value:
                    print("   ", " ".join(map(str, item)) if isinstance(item, (list, tuple)) else item)
            else:
                print(f"{key}: {value}")
    if args.check and (result["import circles"] or result["imports against the layers"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
