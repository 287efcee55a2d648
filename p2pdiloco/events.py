"""One thread-safe sink for the peer's JSON event lines (tests and the demo read them)."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO


class EventSink:
    """Writes one JSON object per line; safe from any thread; a closed reader is ignored."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, event: dict) -> None:
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
