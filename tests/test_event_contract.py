"""Every event kind is declared once (`p2pdiloco.events.KINDS`) and every event matches it.

Two checks: each dict literal in the package that names an `event` (what a peer emits) is
read from the source and held to its kind's declaration; and at run time the sink refuses
(in the test suite, where `P2PDILOCO_CHECK_EVENTS=1` reaches every peer process too) or
logs (a volunteer's peer, once a kind) an event that does not match. The in-process
clusters of the role tests check theirs through `tests/checked_events.py`.
"""

from __future__ import annotations

import ast
import io
import json
import logging
from pathlib import Path

import pytest

from p2pdiloco import events
from p2pdiloco.events import KINDS, EventContractError, EventSink, contract_breach

PACKAGE = Path(events.__file__).resolve().parent


def emitted_literals() -> list[tuple[str, str, set[str], bool]]:
    """(where, kind, literal keys, spreads another dict) of every `{"event": ...}` literal
    in the package; an `a if c else b` kind counts as both."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Dict):
                continue
            names = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
            if "event" not in names:
                continue
            value = node.values[names.index("event")]
            kinds = [value] if not isinstance(value, ast.IfExp) else [value.body, value.orelse]
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            keys = {n for n in names if isinstance(n, str)} - {"event"}
            spread = any(k is None for k in node.keys)
            for kind in kinds:
                assert isinstance(kind, ast.Constant), f"{where}: an event's kind is named in the source"
                found.append((where, kind.value, keys, spread))
    return found


def test_every_event_the_package_emits_is_declared_with_its_fields() -> None:
    found = emitted_literals()
    assert len(found) >= 40  # the scan sees the emitting sites (45 when written)
    for where, kind, keys, spread in found:
        declared = KINDS.get(kind)
        assert declared is not None, f"{where}: event {kind!r} is not declared in p2pdiloco/events.py"
        if not spread:
            assert set(declared.fields) <= keys, (where, kind, set(declared.fields) - keys)
        undeclared = keys - set(declared.fields) - set(declared.optional)
        assert not undeclared or declared.open, (where, kind, undeclared)
    # and nothing is declared that nothing emits
    assert {kind for _, kind, _, _ in found} == set(KINDS)


def test_a_breach_is_named() -> None:
    assert contract_breach({"event": "applied", "fragment": 0, "round": 1, "hash": "h"}) is None
    assert contract_breach({"ready": True, "peer_id": "p"}) is None  # the readiness line
    assert "undeclared event" in contract_breach({"event": "aplied"})
    assert "lacks ['hash']" in contract_breach({"event": "applied", "fragment": 0, "round": 1})
    assert "undeclared ['x']" in contract_breach({"event": "applied", "fragment": 0, "round": 1, "hash": "h", "x": 1})
    # open kinds carry figures besides their fields
    assert contract_breach({"event": "summary", "steps": 3}) is None
    assert "lacks" in contract_breach({"event": "step", "step": 1})


def test_the_sink_refuses_a_breach_under_the_tests_and_logs_it_once_for_a_volunteer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {"event": "applied", "fragment": 0}
    monkeypatch.setenv(events.CHECK_ENV, "1")
    with pytest.raises(EventContractError, match="lacks"):
        EventSink(True, io.StringIO())(bad)
    monkeypatch.setenv(events.CHECK_ENV, "0")
    stream = io.StringIO()
    sink = EventSink(True, stream)
    with caplog.at_level(logging.ERROR, logger="p2pdiloco.events"):
        sink(bad)
        sink(bad)
        sink({"event": "stopped"})
    assert [r.getMessage() for r in caplog.records].count("event contract: event 'applied' lacks ['hash', 'round']") == 1
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["applied", "applied", "stopped"]  # the peer goes on
