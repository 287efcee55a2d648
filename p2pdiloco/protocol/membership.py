"""Heartbeat records: what each peer publishes about itself, and who is alive.

Each peer stores one msgpack record under the DHT key `<run>/members` (or, in a run
split into `network.member_shards` shards, under its peer's shard key), subkey = its
peer id, expiring after a few heartbeat periods. Live membership = the unexpired,
well-formed records of a compatible protocol version; everything else is ignored and
logged by the caller.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from p2pdiloco.identity import Identity, SignedKind, is_peer_id

PROTOCOL_VERSION = 4
"""Bumped on any incompatible change of the swarm's messages or records (4: heartbeats
sign their send time and lifetime; 3: heartbeats, records and contributions are signed,
see security.md; 2: the commit point)."""

CLOCK_SLACK_S = 60.0
"""How long the DHT keeps a heartbeat past the life its sender signed: a reader whose
clock runs up to this much ahead still finds it (hivemind drops records it thinks
expired), while liveness is judged by the signed send time, not by the DHT's expiry."""
MAX_CLOCK_OFFSET_S = 45.0
"""Most a peer corrects its clock by to agree with the swarm's (a tolerated skew)."""
CLOCK_DEADBAND_S = 5.0
"""Clock differences left uncorrected (a beat is read up to a period after it was sent:
correcting for that would make every peer chase the others' lag); liveness tolerates
them instead."""

ROLES = ("learner", "observer", "bootstrap")


def members_key(run: str) -> str:
    """The DHT key under which a run's heartbeats live (one shard: `network.member_shards` 1)."""
    return f"p2pdiloco/{run}/members"


MAX_MEMBER_SHARDS = 1024
"""Most shards a run's membership may be split into (a power of two)."""


def member_shard(peer_id: str, shards: int) -> int:
    """The shard a peer's heartbeat lives in (the same on every peer: a hash of its id)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % shards


def member_shard_key(run: str, shard: int, shards: int) -> str:
    """The DHT key of one membership shard; with one shard, the run's `members_key`.

    The shard count is part of the key, so a record stored under another count is not
    mistaken for this one's, and the record rules can check that each heartbeat lives in
    its peer's shard (`shard_of_key`)."""
    if shards <= 1:
        return members_key(run)
    return f"{members_key(run)}/{shards}/{shard}"


def two_numbers(suffix: str, max_digits: int) -> tuple[int, int] | None:
    """`"<a>/<b>"` (decimal, at most `max_digits` each) as (a, b), or None: the tail of a
    membership shard key or of a round records epoch key."""
    parts = suffix.split("/")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= max_digits for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def shard_of_key(run: str, key: str) -> tuple[int, int] | None:
    """(shard, shards) of a membership shard key of `run`, or None for any other key."""
    prefix = members_key(run) + "/"
    if not key.startswith(prefix):
        return None
    pair = two_numbers(key[len(prefix):], 4)
    if pair is None:
        return None
    shards, shard = pair
    if not (2 <= shards <= MAX_MEMBER_SHARDS and shards & (shards - 1) == 0 and 0 <= shard < shards):
        return None
    return shard, shards


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
    sent_at: float = 0.0
    """Swarm time (s) the peer signed this beat at: orders its beats, so an old one
    replayed never outlives a newer one (see `heartbeat_expiry_refusal`)."""
    live_s: float = 0.0
    """Seconds after `sent_at` the peer counts as live without a newer beat (4 periods).
    0: a beat that signs no time (tools, tests), judged by its DHT expiry alone; the
    record rules refuse it on the network."""
    joined_at: float = 0.0
    """Swarm time (s) of the peer's first beat this session. A sharded run elects it only
    once every peer has read its shard since (`Membership.settled`); 0: not said (a beat
    of an older peer or a tool), counted as long settled."""

    def live_until(self, expiration: float) -> float:
        """Swarm time until which this beat, stored until `expiration`, shows its peer live."""
        return self.sent_at + self.live_s if self.live_s > 0 else expiration

    def encode(self) -> bytes:
        """The beat's bytes: a map of the fields that differ from their defaults (and the
        protocol version, which a reader checks first). A reader fills in the defaults
        (`decode_heartbeat`), so a learner's beat is a fifth smaller: at N = 1,000 every
        peer reads a shard of beats per beat and a newcomer reads them all once."""
        data = {
            f.name: list(value) if isinstance(value, tuple) else value
            for f in dataclasses.fields(self)
            if (value := getattr(self, f.name)) != f.default or f.name == "protocol"
        }
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
    "sent_at": (int, float),
    "live_s": (int, float),
    "joined_at": (int, float),
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


def heartbeat_expiry_refusal(beat: Heartbeat, expiration: float) -> str | None:
    """Why a DHT `expiration` is wrong for `beat`, judged from signed data alone (the same
    verdict on every peer, whatever its clock), or None.

    The DHT keeps, per peer, the record that expires last. A beat may be stored no longer
    than its signed life plus CLOCK_SLACK_S, so a newer beat (signed later, same life)
    always expires later: a captured beat replayed with a far expiration is refused here,
    and one replayed with its own expiration loses to the newer one it tries to hide."""
    if beat.live_s <= 0:
        return "heartbeat signs no send time or life"
    if not 0 < beat.sent_at < 1e12:
        return "heartbeat send time is out of range"
    if expiration > beat.sent_at + beat.live_s + CLOCK_SLACK_S:
        return "heartbeat expires after its signed life"
    return None


Opened = dict[str, tuple[Heartbeat, float]]
"""Subkey -> (its signed heartbeat, the DHT expiration it was stored with)."""


def open_members(
    run: str,
    records: Mapping[str, tuple[bytes, float]],
    now: float,
    verdicts: dict[tuple[str, bytes], Heartbeat | str] | None = None,
) -> tuple[Opened, dict[str, str]]:
    """(signed heartbeats by subkey, rejection reason by subkey) of the records the DHT
    still keeps at `now`; at most MAX_MEMBERS are opened. With `verdicts` (a cache the
    caller keeps, by subkey and bytes), a record read before is not verified again: a
    heartbeat changes every period, a flood of unchanged Sybil records costs nothing."""
    opened: Opened = {}
    rejected: dict[str, str] = {}
    for subkey, (raw, expiration) in list(records.items())[:MAX_MEMBERS]:
        if expiration < now:
            continue
        cached = verdicts.get((subkey, raw)) if verdicts is not None else None
        beat = cached if cached is not None else open_heartbeat(run, subkey, raw)
        if verdicts is not None and cached is None:
            verdicts[(subkey, raw)] = beat
        if isinstance(beat, str):
            rejected[str(subkey)[:64]] = beat
        else:
            opened[subkey] = (beat, expiration)
    return opened, rejected


def judge_members(
    opened: Opened, now: float, config_hash: str = ""
) -> tuple[dict[str, Heartbeat], dict[str, str]]:
    """(live heartbeats by peer id, rejection reason by subkey) at swarm time `now`.

    A peer is live while its beat's signed life lasts; a beat signed further ahead than
    CLOCK_SLACK_S is ignored (that record only: the others stay). With `config_hash`,
    learners that train with another run config are rejected: a peer that silently
    disagrees on the model, H or the codecs would corrupt merges."""
    live: dict[str, Heartbeat] = {}
    rejected: dict[str, str] = {}
    for subkey, (beat, expiration) in opened.items():
        if beat.live_until(expiration) + CLOCK_DEADBAND_S < now:
            continue
        if beat.sent_at > now + CLOCK_SLACK_S:
            rejected[subkey] = "heartbeat signed in the future (its clock is far ahead)"
        elif config_hash and beat.role == "learner" and beat.config_hash != config_hash:
            rejected[subkey] = (
                f"trains with another run config ({beat.config_hash[:12]} vs ours {config_hash[:12]})"
            )
        else:
            live[subkey] = beat
    return live, rejected


def live_members(
    run: str, records: Mapping[str, tuple[bytes, float]], now: float, config_hash: str = ""
) -> tuple[dict[str, Heartbeat], dict[str, str]]:
    """(live heartbeats by peer id, rejection reason by subkey) from DHT records at swarm
    time `now`: `open_members` then `judge_members`. Only heartbeats signed by the peer
    they name count."""
    opened, rejected = open_members(run, records, now)
    live, refused = judge_members(opened, now, config_hash)
    return live, {**rejected, **refused}


def swarm_offset_s(
    opened: Opened, now: float, me: str, votes: Callable[[Heartbeat], bool] | None = None
) -> float:
    """What to add to this peer's clock (reading `now`) to agree with the swarm: the
    median of the others' signed send times less `now`, this peer counted as one vote of
    0 (so one skewed peer moves nobody else), clamped to MAX_CLOCK_OFFSET_S, and 0 within
    CLOCK_DEADBAND_S. Only beats within that offset of live vote. A beat is read up to a
    period after it was sent, so the estimate runs a little behind; the dead band and
    CLOCK_SLACK_S cover that. With `votes`, only the beats it accepts vote: a free
    identity's beat, published once and left to age, would otherwise pull the median (and
    every honest peer's clock) back by its age."""
    window = MAX_CLOCK_OFFSET_S + CLOCK_SLACK_S
    offsets = [0.0] + [
        b.sent_at - now
        for p, (b, expiration) in opened.items()
        if p != me and b.live_s > 0 and b.live_until(expiration) >= now - window and b.sent_at <= now + window
        and (votes is None or votes(b))
    ]
    offsets.sort()
    middle = len(offsets) // 2
    median = offsets[middle] if len(offsets) % 2 else (offsets[middle - 1] + offsets[middle]) / 2
    if abs(median) <= CLOCK_DEADBAND_S:
        return 0.0
    return max(-MAX_CLOCK_OFFSET_S, min(MAX_CLOCK_OFFSET_S, median))


def settle_s(shards: int, heartbeat_s: float) -> float:
    """Seconds after a peer joins by which every member has read its beat: one rotation
    through the membership shards (one per beat) and two periods of slack; 0 with one
    members key, which every beat reads whole (`Membership.settled`)."""
    return 0.0 if shards <= 1 else (shards + 2) * heartbeat_s


def synchronizer_candidates(
    members: Mapping[str, Heartbeat],
    entitled: Callable[[Heartbeat], bool] | None = None,
    proven: Collection[str] | None = None,
    settled: Callable[[Heartbeat], bool] | None = None,
) -> list[str]:
    """Peers that may be elected: live learners that accept connections and are entitled
    (in a certified run: hold an operator certificate as synchronizer).

    With `proven` (an open run that has committed rounds): only those of them in
    `proven` (peers the canonical chain shows reachable), unless none of those is live,
    then all of them (the run must not halt when its proven peers have left). A free
    identity with a heartbeat is then never elected: it would only make learners fail
    over through an address nobody can reach.

    With `settled` (a sharded membership, `Membership.settled`): only those whose beat
    every peer has read by now. A peer that joined within the last rotation is in some
    views and not in others: elected by some, it made rival records for its round
    (seen at N = 1,000). While none is settled (a swarm's first rotation, or one whose
    settled peers all left), only the oldest: the one peer every view holds, since each
    later joiner's first beat read every shard after it joined. It is also the first to
    settle, so the views that cross the settle line first still agree with the others."""
    eligible = sorted(
        p
        for p, b in members.items()
        if b.role == "learner"
        and not b.client_mode
        and b.status != "leaving"
        and (entitled is None or entitled(b))
    )
    if proven:
        eligible = [p for p in eligible if p in proven] or eligible
    if settled is not None and eligible:
        eligible = [p for p in eligible if settled(members[p])] or [
            min(eligible, key=lambda p: (members[p].joined_at, p))
        ]
    return eligible


def past_round(members: Mapping[str, Heartbeat], peers: list[str], fragment: int, round_id: int) -> list[str]:
    """Those of `peers` whose beat says they applied `round_id` of `fragment` (their
    round of it is later): likely to hold its record and its update frame."""
    return [
        p for p in peers
        if len(members[p].rounds) > fragment and members[p].rounds[fragment] > round_id
    ]  # fmt: skip


def learners(members: Mapping[str, Heartbeat]) -> list[str]:
    """Live learners (expected contributors of a window)."""
    return sorted(p for p, b in members.items() if b.role == "learner" and b.status != "leaving")
