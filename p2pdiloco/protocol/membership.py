"""Heartbeat records: what each peer publishes about itself, and who is alive.

Each peer stores one msgpack record under the DHT key `<run>/members`, subkey = its
peer id, expiring after a few heartbeat periods. Live membership = the unexpired,
well-formed records of a compatible protocol version; everything else is ignored and
logged by the caller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from p2pdiloco.identity import Identity, SignedKind, is_peer_id

PROTOCOL_VERSION = 3
"""Bumped on any incompatible change of the swarm's messages or records (3: heartbeats,
records and contributions are signed, see security.md; 2: the commit point)."""

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
    maddrs: tuple[str, ...] = ()
    """Addresses others can dial it at (kept in their address books for restarts)."""
    certificates: tuple[bytes, ...] = ()
    """Operator certificates this peer presents (certified runs elect only certified peers)."""
    staleness: int = 0
    """Rounds between the base and the round of its last merged delta (the dashboard's)."""
    reply_bytes: int = 0
    """Bytes received as synchronizers' answers to its deltas."""
    replica_bytes: int = 0
    """Bytes received for its replica: round updates, state downloads, audited contributions."""
    audits_ok: int = 0
    """Rounds it recomputed from their signed contributions and found right."""
    audits_mismatch: int = 0
    """Rounds it recomputed and proved false."""
    audits_unverifiable: int = 0
    """Rounds it tried to recompute without enough to conclude."""

    def encode(self) -> bytes:
        data = dataclasses.asdict(self)
        data["rounds"] = list(self.rounds)
        data["synchronizing"] = list(self.synchronizing)
        data["certificates"] = list(self.certificates)
        data["maddrs"] = list(self.maddrs)
        return msgpack.packb(data, use_bin_type=True)


MAX_HEARTBEAT_BYTES = 1 << 14
HEARTBEATS = SignedKind("heartbeat", MAX_HEARTBEAT_BYTES)
"""Heartbeats, signed by the peer they speak for."""
MAX_MEMBERS = 4096
"""Heartbeats read per refresh; a run this large needs a hierarchy, not one key."""
_STATUSES = ("starting", "training", "syncing", "straggling", "leaving")
_SCALARS: dict[str, tuple[type, ...]] = {
    "peer_id": (str,),
    "role": (str,),
    "client_mode": (bool,),
    "device": (str,),
    "tokens_per_s": (int, float),
    "tokens_contributed": (int,),
    "rounds_contributed": (int,),
    "last_weight": (int, float),
    "status": (str,),
    "inner_step": (int,),
    "loss": (int, float),
    "eval_loss": (int, float),
    "bytes_sent": (int,),
    "bytes_received": (int,),
    "software": (str,),
    "protocol": (int,),
    "config_hash": (str,),
    "staleness": (int,),
    "reply_bytes": (int,),
    "replica_bytes": (int,),
    "audits_ok": (int,),
    "audits_mismatch": (int,),
    "audits_unverifiable": (int,),
}


class BeatTally:
    """Figures a heartbeat reports that only the peer's events carry: the staleness of its
    last merged delta and its audit verdicts. `on_event` is an `EventSink` listener."""

    MAX_SHIPPED = 256
    """Shipped deltas remembered until their round is decided (the oldest go first)."""

    def __init__(self) -> None:
        self.staleness = 0
        self.audits = {"ok": 0, "mismatch": 0, "unverifiable": 0}
        self._shipped: dict[tuple[int, int], int] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "shipped":
            if len(self._shipped) >= self.MAX_SHIPPED:
                self._shipped.pop(next(iter(self._shipped)))
            self._shipped[(event["fragment"], event["round"])] = max(event["round"] - event["base_round"], 0)
        elif kind == "delta_merged":
            staleness = self._shipped.pop((event["fragment"], event["round"]), None)
            if staleness is not None:
                self.staleness = staleness
        elif kind == "audited" and event.get("verdict") in self.audits:
            self.audits[event["verdict"]] += 1


def seal_heartbeat(identity: Identity, run: str, beat: Heartbeat) -> bytes:
    """The heartbeat as stored: signed by the peer it speaks for (who must be `identity`)."""
    return HEARTBEATS.seal(identity, run, beat.encode(), signer=beat.peer_id)


def _scalar(name: str, value: Any) -> Any:
    kinds = _SCALARS[name]
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{name} is not a {kinds[0].__name__}")
    if not isinstance(value, kinds):
        raise ValueError(f"{name} is not a {kinds[0].__name__}")
    if isinstance(value, str) and len(value) > 256:
        raise ValueError(f"{name} is too long")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} is not finite")
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 1 << 62:
        raise ValueError(f"{name} is out of range")
    return float(value) if float in kinds else value


def _ints(name: str, value: Any, limit: int = 1024) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"{name} is not a short list")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in value):
        raise ValueError(f"{name} holds something other than round numbers")
    return tuple(value)


def decode_heartbeat(raw: bytes) -> Heartbeat | str:
    """A heartbeat, or the reason it is rejected (a string). Types are checked, never coerced."""
    try:
        data = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_bin_len=1 << 12, max_str_len=1 << 12,
            max_array_len=1 << 12, max_map_len=64,
        )
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any decode failure is a rejection
        return f"undecodable heartbeat: {type(exc).__name__}"
    if not isinstance(data, dict):
        return "heartbeat is not a map"
    if data.get("protocol") != PROTOCOL_VERSION:
        return f"incompatible protocol version {str(data.get('protocol'))[:16]!r} (ours {PROTOCOL_VERSION})"
    try:
        known: dict[str, Any] = {k: _scalar(k, v) for k, v in data.items() if k in _SCALARS}
        known["rounds"] = _ints("rounds", data.get("rounds", []))
        known["synchronizing"] = _ints("synchronizing", data.get("synchronizing", []))
        certificates = data.get("certificates", [])
        if not isinstance(certificates, list) or len(certificates) > 4:
            raise ValueError("certificates is not a short list")
        if not all(isinstance(c, bytes) and len(c) <= 1024 for c in certificates):
            raise ValueError("a certificate is not a short byte string")
        known["certificates"] = tuple(certificates)
        maddrs = data.get("maddrs", [])
        if not isinstance(maddrs, list) or len(maddrs) > 8:
            raise ValueError("maddrs is not a short list")
        if not all(isinstance(m, str) and len(m) <= 256 for m in maddrs):
            raise ValueError("an address is not a short string")
        known["maddrs"] = tuple(maddrs)
        beat = Heartbeat(**known)
    except (TypeError, ValueError) as exc:
        return f"malformed heartbeat: {exc}"
    if not beat.peer_id or beat.role not in ROLES or beat.status not in _STATUSES:
        return "heartbeat lacks a peer id or has an unknown role or status"
    return beat


def open_heartbeat(run: str, subkey: str, sealed: object) -> Heartbeat | str:
    """The heartbeat in `sealed` if the peer `subkey` signed it for `run`, else the reason."""
    if not is_peer_id(subkey):
        return "subkey is not a peer id"
    payload = HEARTBEATS.open(subkey, run, sealed)
    if isinstance(payload, str):
        return payload
    beat = decode_heartbeat(payload)
    if isinstance(beat, Heartbeat) and beat.peer_id != subkey:
        return f"heartbeat for {beat.peer_id[-8:]} stored under {subkey[-8:]}"
    return beat


def live_members(
    run: str, records: Mapping[str, tuple[bytes, float]], now: float, config_hash: str = ""
) -> tuple[dict[str, Heartbeat], dict[str, str]]:
    """(live heartbeats by peer id, rejection reason by subkey) from DHT records.

    Only heartbeats signed by the peer they name count. With `config_hash`, learners
    that train with another run config are rejected: a peer that silently disagrees on
    the model, H or the codecs would corrupt merges.
    """
    live: dict[str, Heartbeat] = {}
    rejected: dict[str, str] = {}
    for subkey, (raw, expiration) in list(records.items())[:MAX_MEMBERS]:
        if expiration < now:
            continue
        beat = open_heartbeat(run, subkey, raw)
        if isinstance(beat, str):
            rejected[str(subkey)[:64]] = beat
        elif config_hash and beat.role == "learner" and beat.config_hash != config_hash:
            rejected[subkey] = (
                f"trains with another run config ({beat.config_hash[:12]} vs ours {config_hash[:12]})"
            )
        else:
            live[subkey] = beat
    return live, rejected


def synchronizer_candidates(
    members: Mapping[str, Heartbeat], entitled: Callable[[Heartbeat], bool] | None = None
) -> list[str]:
    """Peers that may be elected: live learners that accept connections and are entitled
    (in a certified run: hold an operator certificate as synchronizer)."""
    return sorted(
        p
        for p, b in members.items()
        if b.role == "learner"
        and not b.client_mode
        and b.status != "leaving"
        and (entitled is None or entitled(b))
    )


def learners(members: Mapping[str, Heartbeat]) -> list[str]:
    """Live learners (expected contributors of a window)."""
    return sorted(p for p, b in members.items() if b.role == "learner" and b.status != "leaving")
