"""The peer's JSON event lines: every kind declared once with its fields (`KINDS`), and
one thread-safe sink that writes them (the tests, the demo, the dashboard, the metrics,
`bench_chaos` and the simulator's agreement read them)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger(__name__)

CHECK_ENV = "P2PDILOCO_CHECK_EVENTS"
"""Set to 1 (the test suite does, for its peers too) and an event that does not match its
declaration raises `EventContractError`; otherwise it is logged once per kind."""


@dataclass(frozen=True)
class EventKind:
    """One kind of event: the fields it always carries, those it may carry, and what it says."""

    name: str
    fields: tuple[str, ...]
    about: str
    optional: tuple[str, ...] = ()
    open: bool = False
    """Carries figures besides its fields (a summary's totals, a device's statistics)."""


def _kinds(*kinds: EventKind) -> dict[str, EventKind]:
    return {kind.name: kind for kind in kinds}


_FR = ("fragment", "round")
KINDS: dict[str, EventKind] = _kinds(
    # rounds, as a replica follows them
    EventKind("applied", (*_FR, "hash"), "a replica applied a committed round"),
    EventKind("downloaded", (*_FR, "hash", "donor"), "a replica installed a verified state from a donor"),
    EventKind("joined", ("rounds", "hashes"), "the peer found the run and holds these rounds"),
    EventKind("diverged", _FR, "a record's parent is not the state here: the replica repairs"),
    EventKind("repair", ("fragment",), "the replica fetches the state again after a divergence"),
    EventKind("voided", _FR, "a held round was dropped: its record lost to a rival"),
    EventKind("records_from_peer", ("fragment", "peer", "records", "new"), "round records read from a peer"),
    EventKind("republished", (*_FR, "records"), "this peer stored the chain's records in the DHT again"),
    # audits
    EventKind("audited", (*_FR, "synchronizer", "verdict", "reason"), "a round's merge recomputed here"),
    EventKind("unverified", (*_FR, "synchronizer", "reason"), "an out-of-line update held: it could not be audited"),
    EventKind("convicted", (*_FR, "synchronizer", "reason"), "a false merge proven: its synchronizer is banned"),
    EventKind("false_notice", ("auditor", "round"), "a fraud notice that did not check out"),
    # the synchronizer
    EventKind("window_open", _FR, "this peer opened the window of a round it synchronizes"),
    EventKind("window_moved", (*_FR, "to"), "a better-placed synchronizer took the window"),
    EventKind("rejected", (*_FR, "peer", "reason"), "a contribution refused by the screening or the decoder"),
    EventKind(
        "round_closed",
        (*_FR, "hash", "contributors", "weights", "tokens", "steps", "step_ranges", "staleness", "refused",
         "holders", "clip_norm", "grace_s", "sync_s", "history_from"),
        "this peer committed a round",
    ),  # fmt: skip
    # the learner
    EventKind("step", ("step", "loss", "rounds"), "every 10 inner steps", open=True),
    EventKind("eval", ("step", "rounds", "eval_loss"), "the global model's held-out loss"),
    EventKind("shipped", ("fragment", "round", "base_round", "steps", "tokens", "first_step", "last_step"), "a delta sent"),
    EventKind("contributed", (*_FR, "status", "synchronizer", "weight", "reason"), "the answer to a delta"),
    EventKind("delta_merged", (*_FR, "steps", "tokens", "weight", "first_step", "last_step"), "a delta merged"),
    EventKind("delta_folded", (*_FR, "steps", "tokens", "reason"), "a delta not merged: its work stays local"),
    EventKind("delta_unmerged", (*_FR, "steps", "tokens"), "a rival record left a merged delta out"),
    EventKind("delta_merged_late", (*_FR, "steps", "tokens"), "a rival record lists a delta folded here"),
    EventKind("steps_lost", ("fragment", "steps", "tokens", "first_step", "last_step", "reason"), "work dropped"),
    EventKind("local_reset", ("fragment",), "the local progress of a fragment was reset"),
    EventKind("trainer_finished", (), "a multi-process learner released its other ranks", open=True),
    EventKind("waiting_for_peers", ("live", "want"), "the start barrier waits"),
    EventKind("peers_ready", ("live",), "the start barrier passed"),
    # the peer
    EventKind("checkpoint_loaded", ("step",), "the peer resumed from its checkpoint"),
    EventKind("checkpoint_none", ("step",), "the peer found no checkpoint"),
    EventKind("checkpoint_saved", ("path", "step", "global_rounds"), "a checkpoint written"),
    EventKind("checkpoint_refused", ("fragment", "reason"), "a saved fragment that did not verify"),
    EventKind("resumed", ("rounds", "hashes", "dir"), "the verified state restored from the checkpoint"),
    EventKind("memory", (*_FR, "rss_bytes", "heap_free_bytes", "census_s"), "a memory census", open=True),
    EventKind("reachability", ("mode", "client_mode", "reason"), "how peers reach this one", ("asked", "reachable")),
    EventKind("relay_slot", ("addresses",), "a relay slot taken", ("waited_s",)),
    EventKind("relay_slot_lost", ("addresses",), "the relay slot is gone"),
    EventKind("relay_renewed", ("waited_s", "renewals"), "the relay slot asked for again"),
    EventKind("crashing", (*_FR, "phase"), "a fault injected at this phase (tests, bench_chaos)"),
    EventKind("summary", (), "the peer's totals, on leaving", open=True),
    EventKind("stopped", (), "the peer stopped"),
)
"""Every event a peer emits. A line without an `event` is the readiness line."""


class EventContractError(ValueError):
    """An event that does not match its declaration in `KINDS`."""


def contract_breach(event: Mapping) -> str | None:
    """Why `event` does not match its declaration, or None when it does."""
    name = event.get("event")
    if name is None:
        return None
    kind = KINDS.get(name)
    if kind is None:
        return f"undeclared event {name!r}"
    keys = set(event) - {"event"}
    missing = set(kind.fields) - keys
    if missing:
        return f"event {name!r} lacks {sorted(missing)}"
    extra = keys - set(kind.fields) - set(kind.optional)
    if extra and not kind.open:
        return f"event {name!r} carries undeclared {sorted(extra)}"
    return None


class EventSink:
    """Writes one JSON object per line; safe from any thread; a closed reader is ignored.

    `listeners` (the metrics, `p2pdiloco.peer.metrics`) see every event, printed or not; one
    that raises is logged, never raised into the caller.
    """

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream
        self.listeners: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._strict = os.environ.get(CHECK_ENV) == "1"
        self._breached: set[str] = set()

    def __call__(self, event: dict) -> None:
        breach = contract_breach(event)
        if breach is not None:
            if self._strict:
                raise EventContractError(breach)
            if breach not in self._breached:  # once a kind: a peer keeps running
                self._breached.add(breach)
                log.error("event contract: %s", breach)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the training loop
                log.exception("event listener failed event=%s", event.get("event"))
        if not self.enabled or self._closed:
            return
        line = json.dumps({"t": round(time.time(), 3), **event}) + "\n"
        with self._lock:
            try:
                stream = self.stream or sys.stdout
                stream.write(line)
                stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._closed = True  # whoever read our events is gone; keep running
