"""Heartbeat records: what each peer publishes about itself, and who is alive.

Each peer stores one msgpack record under the DHT key `<run>/members`, subkey = its
peer id, expiring after a few heartbeat periods. Live membership = the unexpired,
well-formed records of a compatible protocol version; everything else is ignored and
logged by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
"""Bumped on any incompatible change of the swarm's messages or records."""

ROLES = ("learner", "observer", "bootstrap")


def members_key(run: str) -> str:
    """The DHT key under which a run's heartbeats live."""
    return f"p2pdiloco/{run}/members"


@dataclass(frozen=True)
class Heartbeat:
    """One peer's published status (the dashboard renders these, nothing else)."""

    peer_id: str
    role: str = "learner"
    client_mode: bool = False
    """True when the peer cannot accept connections: never elected synchronizer."""
    device: str = "cpu"
    tokens_per_s: float = 0.0
    tokens_contributed: int = 0
    rounds_contributed: int = 0
    last_weight: float = 0.0
    """Merge weight of its last accepted contribution."""
    rounds: tuple[int, ...] = ()
    """Its global round per fragment."""
    status: str = "starting"
    """starting, training, syncing, straggling, leaving."""
    synchronizing: tuple[int, ...] = ()
    """Fragments whose current window this peer is holding as synchronizer."""
    inner_step: int = 0
    loss: float = 0.0
    eval_loss: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    software: str = ""
    protocol: int = PROTOCOL_VERSION
    config_hash: str = ""
    """Hash of the run config the peer trains with; peers with another one are ignored."""
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        data = dataclasses.asdict(self)
        data["rounds"] = list(self.rounds)
        data["synchronizing"] = list(self.synchronizing)
        return msgpack.packb(data, use_bin_type=True)


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Heartbeat)}


def decode_heartbeat(raw: bytes) -> Heartbeat | str:
    """A heartbeat, or the reason it is rejected (a string)."""
    try:
        data = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_bin_len=1 << 16, max_str_len=1 << 16
        )
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any decode failure is a rejection
        return f"undecodable heartbeat: {type(exc).__name__}"
    if not isinstance(data, dict):
        return "heartbeat is not a map"
    if data.get("protocol") != PROTOCOL_VERSION:
        return f"incompatible protocol version {data.get('protocol')!r} (ours {PROTOCOL_VERSION})"
    known = {k: v for k, v in data.items() if k in _FIELD_TYPES}
    try:
        known["rounds"] = tuple(int(r) for r in known.get("rounds", ()))
        known["synchronizing"] = tuple(int(r) for r in known.get("synchronizing", ()))
        beat = Heartbeat(**known)
    except (TypeError, ValueError) as exc:
        return f"malformed heartbeat: {exc}"
    if not isinstance(beat.peer_id, str) or not beat.peer_id or beat.role not in ROLES:
        return "heartbeat lacks a peer id or has an unknown role"
    return beat


def live_members(
    records: Mapping[str, tuple[bytes, float]], now: float, config_hash: str = ""
) -> tuple[dict[str, Heartbeat], dict[str, str]]:
    """(live heartbeats by peer id, rejection reason by subkey) from DHT records.

    With `config_hash`, learners that train with another run config are rejected: a
    peer that silently disagrees on the model, H or the codecs would corrupt merges.
    """
    live: dict[str, Heartbeat] = {}
    rejected: dict[str, str] = {}
    for subkey, (raw, expiration) in records.items():
        if expiration < now:
            continue
        beat = decode_heartbeat(raw)
        if isinstance(beat, str):
            rejected[subkey] = beat
        elif beat.peer_id != subkey:
            rejected[subkey] = f"heartbeat for {beat.peer_id} stored under {subkey}"
        elif config_hash and beat.role == "learner" and beat.config_hash != config_hash:
            rejected[subkey] = (
                f"trains with another run config ({beat.config_hash[:12]} vs ours {config_hash[:12]})"
            )
        else:
            live[subkey] = beat
    return live, rejected


def synchronizer_candidates(members: Mapping[str, Heartbeat]) -> list[str]:
    """Peers that may be elected: live learners that accept connections."""
    return sorted(
        p
        for p, b in members.items()
        if b.role == "learner" and not b.client_mode and b.status != "leaving"
    )


def learners(members: Mapping[str, Heartbeat]) -> list[str]:
    """Live learners (expected contributors of a window)."""
    return sorted(p for p, b in members.items() if b.role == "learner" and b.status != "leaving")
