"""Expiring (key, subkey) records: the table behind the in-memory DHT and the libp2p one.

The replacement rule is hivemind's: a record under (key, subkey) is replaced only by one
that expires later, and an expired record is gone. The table is bounded (subkeys per key,
keys, bytes per value) because, on a real peer, every record in it was sent by someone
else. Validation (a run's record rules) is the caller's: the table stores bytes, and
`RefusalLog` logs what the rules refused, sparsely.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

Records = dict[str, tuple[bytes, float]]
"""`{subkey: (value, expiration_time)}` under one key."""

MAX_KEYS = 1024
MAX_SUBKEYS_PER_KEY = 4096
MAX_VALUE_BYTES = 1 << 20
MAX_KEY_BYTES = 12 << 20
"""All values under one key: what one `get` answer may carry."""


class RecordTable:
    """Records under (key, subkey) with expirations; `now` is passed in (any clock)."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        max_subkeys_per_key: int = MAX_SUBKEYS_PER_KEY,
        max_value_bytes: int = MAX_VALUE_BYTES,
        max_key_bytes: int = MAX_KEY_BYTES,
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_value_bytes = max_value_bytes
        self.max_key_bytes = max_key_bytes
        self._records: dict[str, Records] = {}

    def store(self, key: str, subkey: str, value: bytes, expiration_time: float, now: float) -> bool:
        """Keep the record unless it is expired, too large, older than the one it would
        replace, or the table is full; True when kept."""
        if expiration_time <= now or len(value) > self.max_value_bytes:
            return False
        records = self._records.get(key)
        if records is None:
            if len(self._records) >= self.max_keys and not self._sweep(now):
                return False
            records = self._records[key] = {}
        old = records.get(subkey)
        if old is not None and old[1] >= expiration_time:
            return False
        if old is None and len(records) >= self.max_subkeys_per_key:
            self._expire(records, now)
            if len(records) >= self.max_subkeys_per_key:
                return False
        held = sum(len(v) for s, (v, _) in records.items() if s != subkey)
        if held + len(value) > self.max_key_bytes:
            self._expire(records, now)
            held = sum(len(v) for s, (v, _) in records.items() if s != subkey)
            if held + len(value) > self.max_key_bytes:
                return False
        records[subkey] = (bytes(value), float(expiration_time))
        return True

    def get(self, key: str, now: float) -> Records:
        """Live records under `key` (a copy)."""
        records = self._records.get(key)
        if records is None:
            return {}
        self._expire(records, now)
        return dict(records)

    @staticmethod
    def _expire(records: Records, now: float) -> None:
        for subkey in [s for s, (_, exp) in records.items() if exp <= now]:
            del records[subkey]

    def _sweep(self, now: float) -> bool:
        """Drop expired records and empty keys; True if there is room for a new key."""
        for key in list(self._records):
            self._expire(self._records[key], now)
            if not self._records[key]:
                del self._records[key]
        return len(self._records) < self.max_keys


def merge_latest(into: Records, records: Records) -> None:
    """Merge answers from several peers: per subkey, the record that expires last wins."""
    for subkey, (value, expiration) in records.items():
        old = into.get(subkey)
        if old is None or old[1] < expiration:
            into[subkey] = (value, expiration)


class RefusalLog:
    """Counts refused records by reason and logs the first three of each, then every
    100th: the network may send floods of bad records, the log must not become one."""

    MAX_REASONS = 256
    """Reasons remembered; past this, the counts start over (memory stays bounded)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def note(self, reason: str) -> None:
        """Count one refusal for `reason`, logging it when due."""
        count = self._counts[reason] = self._counts.get(reason, 0) + 1
        if count <= 3 or count % 100 == 0:
            logger.warning("dht_record_refused reason=%r count=%d", reason, count)
        if len(self._counts) > self.MAX_REASONS:
            self._counts.clear()
