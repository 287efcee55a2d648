"""Expiring (key, subkey) records: the table behind the in-memory DHT and the libp2p one.

The replacement rule is hivemind's: a record under (key, subkey) is replaced only by one
that expires later, and an expired record is gone. The table is bounded (subkeys per key,
keys, bytes per value) because, on a real peer, every record in it was sent by someone
else. How one key's room is shared among the peers that sign its records is
`make_room`'s (the hivemind transport applies it to hivemind's own storage too).
Validation (a run's record rules) is the caller's: the table stores bytes, and
`RefusalLog` logs what the rules refused, sparsely.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

Records = dict[str, tuple[bytes, float]]
"""`{subkey: (value, expiration_time)}` under one key."""

MAX_KEYS = 1024
MAX_SUBKEYS_PER_KEY = 4096
MAX_VALUE_BYTES = 1 << 20
MAX_KEY_BYTES = 12 << 20
"""All values under one key: what one `get` answer may carry."""
MAX_RECORDS_PER_OWNER = 256
"""Records one owner keeps under a key (`owner_of`): the 256 that expire last (a
synchronizer elected every round of 14 s rounds keeps the hour a round record lives)."""
MAX_OWNER_BYTES = 512 << 10
"""Bytes one owner keeps under a key: 512 KiB, 2 KiB for each of its 256 records (sealed
round records measured 0.8 KiB with 4 contributors, 1.8 KiB with 16, 5.5 KiB with 64: a
synchronizer of 64-learner windows keeps its last 93), so one key's flood holds a
twenty-fourth of a key, and what every replica reads on every look at the chain grows by
at most that much for each key that floods."""


def owner_of(subkey: str) -> str:
    """Who a record belongs to: a subkey `<n>/<owner>` (a round record: round/signer) is
    its owner's n-th; any other subkey (a heartbeat: the peer id) is its own owner's only."""
    return subkey.rpartition("/")[2]


def order_of(subkey: str) -> int:
    """Where a record sorts among its owner's (`<n>/<owner>`: n; other subkeys: 0)."""
    head, slash, _ = subkey.rpartition("/")
    return int(head) if slash and head.isdigit() and len(head) < 20 else 0


def make_room(
    records: Mapping[str, tuple[int, float]],
    subkey: str,
    size: int,
    expiration: float,
    max_bytes: int = MAX_KEY_BYTES,
    max_count: int = MAX_SUBKEYS_PER_KEY,
    max_per_owner: int = MAX_RECORDS_PER_OWNER,
    max_owner_bytes: int = MAX_OWNER_BYTES,
) -> list[str] | None:
    """The subkeys to drop so that a record of `size` bytes expiring at `expiration` fits
    under `subkey`, or None to refuse it. `records`: the key's live records (subkey ->
    (bytes, expiration)), the one `subkey` replaces excluded.

    The room is shared so that a flood, from one key or many, costs an honest owner
    nothing it needs: an owner over `max_per_owner` records or `max_owner_bytes` gives up
    its records that expire first (the newcomer itself when it would be the first); a full
    key takes the first-expiring record of the owner that holds the most bytes (the
    newcomer counted with its owner), among owners of two records or more, so whoever
    floods pays first. By expiry, not by round: a key that signs rounds far ahead cannot
    keep its own next commit out (it expires later than the flood stored before it), and a
    record replayed with its old expiry cannot push out a newer one. A key full of
    one-record owners refuses newcomers, as before (a heartbeat never pushes out another
    peer's)."""
    room = {s: r for s, r in records.items() if s != subkey}
    owner = owner_of(subkey)
    drop: list[str] = []

    def first_to_expire(candidates: list[str]) -> str:
        return min(candidates, key=lambda s: (expiration, 0, s) if s == subkey else (room[s][1], 1, s))

    mine = [s for s in room if owner_of(s) == owner]
    mine_bytes = sum(room[s][0] for s in mine)
    while mine and (len(mine) >= max_per_owner or mine_bytes + size > max_owner_bytes):
        victim = first_to_expire([*mine, subkey])
        if victim == subkey:
            return None
        mine.remove(victim)
        drop.append(victim)
        mine_bytes -= room.pop(victim)[0]
    if size > max_owner_bytes:
        return None
    held = sum(n for n, _ in room.values())
    while held + size > max_bytes or len(room) >= max_count:
        by_owner: dict[str, list[str]] = {owner: [subkey]}
        for s in room:
            by_owner.setdefault(owner_of(s), []).append(s)
        size_of = {**{s: n for s, (n, _) in room.items()}, subkey: size}
        many = [o for o, held_by in by_owner.items() if len(held_by) >= 2]
        if not many:
            return None
        top = max(many, key=lambda o: (sum(size_of[s] for s in by_owner[o]), len(by_owner[o]), o))
        victim = first_to_expire(by_owner[top])
        if victim == subkey:
            return None
        drop.append(victim)
        held -= room.pop(victim)[0]
    return drop


def within_room(
    records: Records,
    max_bytes: int = MAX_KEY_BYTES,
    max_count: int = MAX_SUBKEYS_PER_KEY,
    max_per_owner: int = MAX_RECORDS_PER_OWNER,
    max_owner_bytes: int = MAX_OWNER_BYTES,
) -> Records:
    """The records of one `get` answer a reader goes on with: what a table would hold.

    A DHT node answers with whatever it keeps, and a stranger's node keeps without bound,
    so a reader bounds the answer before it verifies a signature: each owner its newest
    records within its share (`make_room`'s per-owner bounds), then owners take turns,
    newest first (the smaller records first in a turn), until the key's bounds: many
    one-record owners cannot push out an honest owner's newest record unless they are more
    than the key's `max_count` subkeys."""
    by_owner: dict[str, list[tuple[int, str]]] = {}
    for subkey in records:
        by_owner.setdefault(owner_of(subkey), []).append((order_of(subkey), subkey))
    queues = []
    for owned in by_owner.values():
        owned.sort(reverse=True)
        kept, held = [], 0
        for _, subkey in owned[:max_per_owner]:
            size = len(records[subkey][0])
            if held + size > max_owner_bytes:
                break
            kept.append(subkey)
            held += size
        queues.append(kept)
    out: Records = {}
    held, turn = 0, 0
    while len(out) < max_count and any(len(q) > turn for q in queues):
        # in each turn the smaller records first: a flood of big ones cannot crowd out
        # an honest owner's few-KiB record
        for subkey in sorted((q[turn] for q in queues if len(q) > turn), key=lambda s: (len(records[s][0]), s)):
            size = len(records[subkey][0])
            if len(out) < max_count and held + size <= max_bytes:
                out[subkey] = records[subkey]
                held += size
        turn += 1
    return out


class RecordTable:
    """Records under (key, subkey) with expirations; `now` is passed in (any clock)."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        max_subkeys_per_key: int = MAX_SUBKEYS_PER_KEY,
        max_value_bytes: int = MAX_VALUE_BYTES,
        max_key_bytes: int = MAX_KEY_BYTES,
        max_per_owner: int = MAX_RECORDS_PER_OWNER,
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_value_bytes = max_value_bytes
        self.max_key_bytes = max_key_bytes
        self.max_per_owner = max_per_owner
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
        self._expire(records, now)
        held = {s: (len(v), exp) for s, (v, exp) in records.items()}
        drop = make_room(
            held, subkey, len(value), expiration_time, self.max_key_bytes, self.max_subkeys_per_key,
            self.max_per_owner,
        )  # fmt: skip
        if drop is None:
            return False
        for gone in drop:
            del records[gone]
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
