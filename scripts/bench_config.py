"""Config validation: today's code against pydantic and msgspec, on startup time and on the
error messages of common mistakes (docs/architecture.md, "Libraries").

    python scripts/bench_config.py     # pydantic and msgspec are measured when installed

Each implementation runs in 3 fresh processes (after `import p2pdiloco.config`, which
all share); the best is printed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

CASES = {
    "wrong type": {"sync": {"inner_steps": "50"}},
    "bool for int": {"sync": {"inner_steps": True}},
    "float for int": {"sync": {"inner_steps": 50.5}},
    "typo in a key": {"sync": {"inner_step": 50}},
    "out of range": {"sync": {"min_quorum": 0}},
    "list for a tuple (TOML)": {"peer": {"initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/x"]}},
}

IMPL = {
    "ours": """
from p2pdiloco.config import config_from_dict as build
""",
    "pydantic": """
import dataclasses, pydantic
from pydantic import ConfigDict, TypeAdapter
import p2pdiloco.config as c
def wrap(cls):
    return pydantic.dataclasses.dataclass(cls, frozen=True, config=ConfigDict(extra="forbid"))
sections = {f.name: wrap(f.type if not isinstance(f.type, str) else getattr(c, f.type)) for f in dataclasses.fields(c.RunConfig)}
Run = pydantic.dataclasses.dataclass(
    dataclasses.make_dataclass("RunConfig", [(n, t, dataclasses.field(default_factory=t)) for n, t in sections.items()]),
    config=ConfigDict(extra="forbid"))
adapter = TypeAdapter(Run)
def build(raw):
    return adapter.validate_python(raw)
""",
    "msgspec": """
import msgspec
import p2pdiloco.config as c
def build(raw):
    return msgspec.convert(raw, c.RunConfig, strict=True)
""",
}

RUN = r"""
import time, json, sys
t0 = time.perf_counter()
{impl}
t1 = time.perf_counter()
build({{}})
t2 = time.perf_counter()
for _ in range(100): build({{}})
t3 = time.perf_counter()
errors = {{}}
for name, raw in json.loads(sys.argv[1]).items():
    try:
        build(raw); errors[name] = "(accepted)"
    except Exception as exc:
        errors[name] = f"{{type(exc).__name__}}: " + " | ".join(str(exc).splitlines())
print(json.dumps({{"setup_ms": (t1 - t0) * 1e3, "first_ms": (t2 - t1) * 1e3, "each_ms": (t3 - t2) * 10, "errors": errors}}))
"""

for name, impl in IMPL.items():
    if name != "ours" and importlib.util.find_spec(name) is None:
        print(f"== {name}: not installed (pip install {name})")
        continue
    runs = []
    for _ in range(3):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import p2pdiloco.config\n" + RUN.format(impl=impl),
                json.dumps(CASES),
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            print(name, out.stderr[-2000:])
            break
        runs.append(json.loads(out.stdout))
    if not runs:
        continue
    best = min(runs, key=lambda r: r["setup_ms"])
    print(
        f"== {name}: setup {best['setup_ms']:.1f} ms (import + build, after p2pdiloco.config), first config {best['first_ms']:.2f} ms, then {best['each_ms']:.3f} ms each"
    )
    for case, err in best["errors"].items():
        print(f"   {case:24} {err[:230]}")
