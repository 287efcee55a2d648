"""The notice and hold floods of tests/net/adversary.py (issue 28, items 10 and 11), written
as a stranger's program would: free Ed25519 identities, the attacker's own DHT node, and
stock hivemind p2pd daemons (one per identity, tests/net/slow_bodies.py) whose RPC
streams carry the project's framing.

- `notice_flood`: for every canonical round record the run closes while it lasts, each of
  `identities` fresh identities signs a fraud notice accusing it (a valid notice: the DHT
  rules store it); a share of them also beat as learners with the run's config hash, so
  their notices count as a live learner's. Before the fix every peer verified every new
  notice, a fragment download from the notifier each.
- `hold_flood`: `identities` fresh daemons push `hold_update` frames to every victim,
  valid-looking ones (a genuine update's tensors re-labelled for rounds around the
  current one, naming the pushing identity as synchronizer) and junk, trying to evict
  the frames the victims hold and keep. At the end it asks every victim for the genuine
  frames of the last committed rounds, by the digests their records name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import time
from collections import Counter
from typing import Any

from hivemind.p2p import P2P, PeerID

from p2pdiloco import wire
from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import HEARTBEATS, Heartbeat, members_key, open_heartbeat
from p2pdiloco.protocol.rounds import RoundRecord, rank, records_of, rounds_key
from p2pdiloco.transport import framing
from p2pdiloco.transport.hivemind import _AsyncioStream
from p2pdiloco.trust.audit import FraudNotice, notice_subkey, notices_key, seal_notice
from p2pdiloco.wire import messages
from p2pdiloco.wire.updates import new_update, update_digest

NOTICE_EXPIRY_S = 3000.0
"""How long a flooded notice stays (the rules allow an hour)."""
BEAT_LIVE_S = 240.0
STORES_AT_ONCE = 25
"""DHT stores in flight at once from the attacker's one node."""
CALL_TIMEOUT_S = 20.0
RECENT_ROUNDS = 3
"""Rounds back from the head whose records are accused (a replica follows them)."""
MAX_RESPONSE_BYTES = 64 << 20
DEFAULT_DURATION_S = 60.0


def flood_duration_s() -> float:
    """A flood's length: $FLOOD_S (a test may shorten it), else `DEFAULT_DURATION_S`."""
    return float(os.environ.get("FLOOD_S", DEFAULT_DURATION_S))


async def _bounded(jobs: list, limit: int = STORES_AT_ONCE) -> list:
    """Await `jobs` (coroutines), at most `limit` at once; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(job):
        async with gate:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


async def victims_beats(transport: Any, run: str, victims: list[str]) -> dict[str, Heartbeat]:
    """The victims' signed heartbeats as the DHT holds them now."""
    records = await transport.get(members_key(run))
    beats = {}
    for victim in victims:
        if victim in records:
            beat = open_heartbeat(run, victim, records[victim][0])
            if isinstance(beat, Heartbeat):
                beats[victim] = beat
    return beats


async def store_beats(transport: Any, run: str, sybils: list[Identity], config_hash: str) -> int:
    """A valid learner heartbeat for each of `sybils` (the run's config hash, an address
    nobody answers at); how many the DHT stored."""

    async def beat(i: int, sybil: Identity) -> bool:
        sent_at = transport.now()
        heartbeat = Heartbeat(
            peer_id=sybil.peer_id, status="training", config_hash=config_hash,
            maddrs=(f"/ip4/10.254.{i // 250}.{i % 250 + 1}/tcp/4001/p2p/{sybil.peer_id}",),
            sent_at=sent_at, live_s=BEAT_LIVE_S,
        )  # fmt: skip
        sealed = sybil.seal(HEARTBEATS.domain(run), heartbeat.encode())
        return bool(
            await transport.store(
                members_key(run), sybil.peer_id, sealed, sent_at + BEAT_LIVE_S + 50
            )
        )

    return sum(await _bounded([beat(i, s) for i, s in enumerate(sybils)]))


async def recent_records(
    transport: Any, run: str, num_fragments: int, rounds: int = RECENT_ROUNDS
) -> list[RoundRecord]:
    """The best-ranked record of each of the last `rounds` rounds of every fragment, as the
    DHT holds them (what the honest replicas follow, unless a rival won meanwhile)."""
    out = []
    for fragment in range(num_fragments):
        found = records_of(run, await transport.get(rounds_key(run, fragment)), fragment)
        by_round: dict[int, list[RoundRecord]] = {}
        for record in found.values():
            by_round.setdefault(record.round, []).append(record)
        for round_id in sorted(by_round)[-rounds:]:
            out.append(min(by_round[round_id], key=lambda r: rank(run, r)))
    return out


async def accuse(transport: Any, run: str, sybil: Identity, record: RoundRecord) -> bool:
    """Store `sybil`'s signed fraud notice against `record`; whether the DHT took it."""
    notice = FraudNotice(
        record.fragment, record.round, record.synchronizer, record.digest, sybil.peer_id
    )
    subkey = notice_subkey(record.fragment, record.round, sybil.peer_id)
    sealed = seal_notice(sybil, run, notice)
    return bool(
        await transport.store(notices_key(run), subkey, sealed, transport.now() + NOTICE_EXPIRY_S)
    )


async def notice_flood(
    transport: Any,
    run: str,
    victims: list[str],
    duration_s: float,
    identities: int,
    live_share: float,
    every_s: float,
) -> dict[str, Any]:
    """Fraud notices from `identities` fresh identities (`live_share` of them with live
    learner heartbeats) against every recent canonical record, new records as they come,
    for `duration_s`."""
    started = time.time()
    beats = await victims_beats(transport, run, victims)
    config_hash = next((b.config_hash for b in beats.values() if b.config_hash), "")
    num_fragments = max((len(b.rounds) for b in beats.values()), default=1) or 1
    sybils = [Identity.generate() for _ in range(identities)]
    live = sybils[: round(identities * live_share)]
    beats_stored = await store_beats(transport, run, live, config_hash)
    beaten_at = time.monotonic()
    accused: set[tuple[int, int, str]] = set()
    stored = 0
    until = time.monotonic() + duration_s
    while time.monotonic() < until:
        for record in await recent_records(transport, run, num_fragments):
            key = (record.fragment, record.round, record.digest)
            if key not in accused:
                accused.add(key)
                stored += sum(await _bounded([accuse(transport, run, s, record) for s in sybils]))
        if time.monotonic() - beaten_at > BEAT_LIVE_S / 2:
            beats_stored += await store_beats(transport, run, live, config_hash)
            beaten_at = time.monotonic()
        await asyncio.sleep(min(every_s, max(until - time.monotonic(), 0)))
    return {
        "identities": identities, "live": len(live), "beats_stored": beats_stored,
        "config_hash": config_hash[:12], "records_accused": len(accused), "notices_stored": stored,
        "started_at": started, "ended_at": time.time(), "duration_s": duration_s,
    }  # fmt: skip


# --- hold flood ---------------------------------------------------------------------------


async def call_as(
    p2p: P2P, victim: str, run: str, rpc: str, body: bytes, timeout_s: float = CALL_TIMEOUT_S
) -> bytes:
    """One RPC from the identity of daemon `p2p` (the project's framing over a p2pd stream)."""
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(
            PeerID.from_base58(victim), f"{framing.PROTOCOL_PREFIX}{run}.{rpc}"
        ),
        timeout_s,
    )
    try:
        stream = _AsyncioStream(reader, writer, timeout_s)
        return await asyncio.wait_for(
            framing.make_call(stream, body, victim, MAX_RESPONSE_BYTES), timeout_s
        )
    finally:
        writer.close()


def _update_request(run: str, round_id: int, fragment: int, me: str, digest: str = "") -> bytes:
    return wire.encode_message(
        wire.Message(
            kind=messages.UPDATE_REQUEST, run=run, round=round_id, fragment=fragment,
            meta={"peer": me, "digest": digest},
        )
    )  # fmt: skip


async def genuine_tensors(
    transport: Any, run: str, victims: list[str], records: list[RoundRecord]
) -> dict[int, dict]:
    """Per fragment, the encoded tensors of a genuine committed update (any victim's)."""
    found: dict[int, dict] = {}
    for record in sorted(records, key=lambda r: -r.round):
        if record.fragment in found:
            continue
        for victim in victims:
            with contextlib.suppress(Exception):
                raw = await transport.call(
                    victim, f"{run}.{messages.RPC_GET_UPDATE}",
                    _update_request(run, record.round, record.fragment, transport.peer_id, record.digest),
                    timeout_s=CALL_TIMEOUT_S, max_response_bytes=MAX_RESPONSE_BYTES,
                )  # fmt: skip
                msg = wire.decode_message(raw, wire.WireLimits())
                if not isinstance(msg, wire.Rejected) and msg.kind == wire.OUTER_UPDATE:
                    found[record.fragment] = dict(msg.tensors)
                    break
    return found


def _status(raw: bytes) -> str:
    reply = messages.decode_reply(raw, wire.WireLimits())
    if isinstance(reply, wire.Rejected):
        return "undecodable"
    reason = re.sub(r"\d+|b['\"].*", "N", str(reply.meta.get("reason", "")))  # a tally per kind
    return f"{reply.meta.get('status')}: {reason[:40]}" if reason else str(reply.meta.get("status"))


async def served_genuine(
    transport: Any, run: str, victims: list[str], records: list[RoundRecord]
) -> dict[str, int]:
    """How many (victim, record) pairs get `get_update` answers with the record's own frame
    (by its digest), and how many victims served each record."""
    tally: Counter = Counter()
    per_record = []
    for record in records:
        served_before = tally["served"]
        for victim in victims:
            try:
                raw = await transport.call(
                    victim, f"{run}.{messages.RPC_GET_UPDATE}",
                    _update_request(run, record.round, record.fragment, transport.peer_id, record.digest),
                    timeout_s=CALL_TIMEOUT_S, max_response_bytes=MAX_RESPONSE_BYTES,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - unreachable or refused: not served
                tally["error"] += 1
                continue
            tally["served" if update_digest(raw) == record.digest else "missing"] += 1
        per_record.append(tally["served"] - served_before)
    return {**tally, "servers_per_record": per_record}


def fake_frames(
    run: str, sender: str, current: dict[int, int], tensors: dict[int, dict]
) -> list[bytes]:
    """Frames one identity pushes in one sweep: per fragment, a valid-looking update for each
    round a holder may accept (current - 1 .. current + 2) naming `sender` as its
    synchronizer, one for a far round, and junk bytes."""
    frames = []
    for fragment, encoded in tensors.items():
        now = current.get(fragment, 0)
        for round_id in (now - 1, now, now + 1, now + 2, now + 50):
            update = new_update(
                run,
                max(round_id, 0),
                fragment,
                sender,
                secrets.token_hex(16),
                secrets.token_hex(16),
                [],
                encoded,
            )
            frames.append(update.frame)
    frames.append(os.urandom(512))
    return frames


async def sweep(
    p2p: P2P, run: str, victims: list[str], frames: list[bytes], replies: Counter
) -> None:
    """Push each of `frames` to every victim from daemon `p2p`'s identity; tally the replies."""
    for frame in frames:
        for victim in victims:
            try:
                raw = await call_as(p2p, victim, run, messages.RPC_HOLD_UPDATE, frame)
            except Exception as exc:  # noqa: BLE001 - count what the victim did
                replies[f"error:{type(exc).__name__}"] += 1
                continue
            replies[_status(raw)] += 1


async def hold_flood(
    transport: Any, run: str, victims: list[str], duration_s: float, identities: int, every_s: float
) -> dict[str, Any]:
    """`identities` fresh daemons push `hold_update` frames to every victim for `duration_s`."""
    from slow_bodies import _victim_addresses, start_puppets  # noqa: PLC0415 - beside this script

    started = time.time()
    beats = await victims_beats(transport, run, victims)
    num_fragments = max((len(b.rounds) for b in beats.values()), default=1) or 1
    before = await recent_records(transport, run, num_fragments)
    tensors = await genuine_tensors(transport, run, victims, before)
    if not tensors:
        return {"error": "no genuine update to imitate"}
    bootstrap = [*transport.initial_peers, *await _victim_addresses(transport._daemon.p2p, victims)]
    puppets = await start_puppets(bootstrap, identities)
    replies: Counter = Counter()
    try:
        until = time.monotonic() + duration_s
        while time.monotonic() < until:
            beats = await victims_beats(transport, run, victims)
            current = {
                f: max((b.rounds[f] for b in beats.values() if len(b.rounds) > f), default=0)
                for f in tensors
            }
            await asyncio.gather(
                *(
                    sweep(
                        p,
                        run,
                        victims,
                        fake_frames(run, p.peer_id.to_base58(), current, tensors),
                        replies,
                    )
                    for p in puppets
                )
            )
            await asyncio.sleep(min(every_s, max(until - time.monotonic(), 0)))
        after = await recent_records(transport, run, num_fragments)
        genuine = {
            "before_flood": await served_genuine(transport, run, victims, before),
            "after_flood": await served_genuine(transport, run, victims, after),
        }
    finally:
        for puppet in puppets:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(puppet.shutdown(), 10)
    return {
        "identities": len(puppets), "pushed": sum(replies.values()), "replies": dict(replies.most_common(12)),
        "held": sum(n for r, n in replies.items() if r.startswith(messages.Reply.HELD)),
        "genuine": genuine, "started_at": started, "ended_at": time.time(), "duration_s": duration_s,
    }  # fmt: skip
