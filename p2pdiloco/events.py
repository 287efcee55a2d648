"""One thread-safe sink for the peer's JSON event lines (tests and the demo read them)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger(__name__)


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

    def __call__(self, event: dict) -> None:
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
