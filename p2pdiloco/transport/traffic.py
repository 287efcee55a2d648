"""Bytes a peer moves, by what they are for, counted at the transport interface.

Every transport counts the payload bytes of its calls and records (request and response
of an RPC; value stored; dictionary read) under a category named from the DHT key or the
RPC name. The same counting runs in the swarm simulator's in-memory network, so the
simulator's per-role figures and a real peer's are the same quantity (`scripts/
simulate_swarm.py` compares them). Framing, encryption and the DHT's own routing are not
in it: they are the transport's overhead, not the protocol's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

CATEGORIES = ("membership", "records", "deltas", "updates", "state", "audits", "other")
"""Where protocol bytes go: heartbeats; round records and fraud notices; deltas to the
synchronizer (and its replies); round updates (fetched, held); state downloads; the
contributions audits fetch; anything else."""
PROTOCOL = ("membership", "records", "other")
"""Categories that are the protocol's overhead, not the training's payload (audits move
sampled contributions, i.e. deltas: payload, counted on their own)."""

_RPC_CATEGORY = {
    "contribute": "deltas",
    "get_update": "updates",
    "hold_update": "updates",
    "get_state": "state",
    "get_contributions": "audits",
    "get_records": "records",
}


def key_category(key: str) -> str:
    """Category of a DHT key (`p2pdiloco/<run>/members...`, `.../rounds/<f>`, `.../audits`)."""
    parts = key.split("/")
    kind = parts[2] if len(parts) > 2 and parts[0] == "p2pdiloco" else ""
    if kind.startswith("members"):
        return "membership"
    if kind in ("rounds", "audits"):
        return "records"
    return "other"


def rpc_category(name: str) -> str:
    """Category of an RPC name (`<run>.<rpc>`)."""
    return _RPC_CATEGORY.get(name.rsplit(".", 1)[-1], "other")


@dataclass
class Traffic:
    """Byte counters of one peer: (category, "up"/"down") -> bytes, and per DHT key."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    by_key: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def call(self, name: str, request: int, response: int) -> None:
        """An RPC this peer made: the request went up, the response came down."""
        category = rpc_category(name)
        self.bytes[(category, "up")] += request
        self.bytes[(category, "down")] += response

    def served(self, name: str, request: int, response: int) -> None:
        """An RPC this peer served: the request came down, the response went up."""
        category = rpc_category(name)
        self.bytes[(category, "down")] += request
        self.bytes[(category, "up")] += response

    def stored(self, key: str, value: int) -> None:
        self.bytes[(key_category(key), "up")] += value
        self.by_key[key] += value

    def read(self, key: str, records: dict[str, tuple[bytes, float]]) -> None:
        size = sum(len(value) + len(subkey) for subkey, (value, _) in records.items())
        self.bytes[(key_category(key), "down")] += size
        self.by_key[key] += size

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{category: {"up": bytes, "down": bytes}} (every category, zeros included)."""
        return {c: {d: int(self.bytes.get((c, d), 0)) for d in ("up", "down")} for c in CATEGORIES}
