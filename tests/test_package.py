"""Package hygiene: an honest public API (the pure core is checked in test_structure)."""

from __future__ import annotations

from pathlib import Path

import p2pdiloco

ROOT = Path(p2pdiloco.__file__).parent


def test_all_names_exist() -> None:
    for name in p2pdiloco.__all__:
        assert hasattr(p2pdiloco, name), name


