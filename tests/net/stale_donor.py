"""The stale donor of tests/net/adversary.py (issue 28, item 8), as a stranger's program
would run it: its own fresh identity and transport, the run's config hash read from an
honest heartbeat, the stock DHT.

1. It downloads a real state of every fragment from a victim by `get_state`, part by part,
   as a joiner does (roles/download.py). That state is valid: it hashes to a record of the
   canonical chain. It only gets old.
2. It then beats as a learner at the chain's head: the freshest honest beat's round plus
   `lead` (beats lag the chain by a period or so; a claim a little ahead stays at the head
   as the run moves, and came first in the pre-fix most-advanced-first order). Its beats
   are signed with `sent_at` / `live_s` as the membership rules require and refreshed
   every `BEAT_PERIOD_S`. It answers every `get_state` with the captured parts, byte for
   byte (the round and hash they name are the old ones).

Before the fix a downloader took any canonical state of the last hour, most advanced
claim first: this donor rolled every joiner back to the captured round. Now the state is
refused at its first part (`download.acceptable_state`: stale) and the joiner goes on to
an honest donor.

The attack lasts `duration_s`, or until the file named by $STALE_DONOR_STOP_FILE exists,
and reports the rounds it captured, the head it claimed, and the requests it served.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from floods import victims_beats  # beside this script, as adversary.py imports us

from p2pdiloco import wire
from p2pdiloco.protocol.membership import Heartbeat, members_key, seal_heartbeat
from p2pdiloco.wire import messages

DEFAULT_DURATION_S = 60.0
BEAT_PERIOD_S = 1.0
"""As often as the honest test peers beat: the claimed head follows rounds seconds apart."""
BEAT_LIVE_S = 20.0
"""The life its beats sign (the rules let the DHT keep one this long plus a slack)."""
CALL_TIMEOUT_S = 60.0
CAPTURE_TRIES = 30
"""Attempts at a whole, consistent download of a fragment (a victim may be busy, rate
limit us, or move to a new round mid-download)."""
MAX_REQUEST_BYTES = 1 << 16


def stale_donor_duration_s() -> float:
    """The attack's length: $STALE_DONOR_S (a test may lengthen it), else `DEFAULT_DURATION_S`."""
    return float(os.environ.get("STALE_DONOR_S", DEFAULT_DURATION_S))


def _stop_requested() -> bool:
    path = os.environ.get("STALE_DONOR_STOP_FILE")
    return bool(path) and Path(path).exists()




async def download_parts(
    transport: Any, run: str, victim: str, fragment: int
) -> tuple[int, str, list[bytes]] | str:
    """Every part of `victim`'s state of `fragment`, as the raw reply frames: (its round,
    its hash, the frames), or why not (busy, rate limited, a state that changed midway)."""
    limits = wire.WireLimits()
    frames: list[bytes] = []
    first: tuple[int, str, int] | None = None
    while first is None or len(frames) < first[2]:
        request = wire.encode_message(
            wire.Message(
                kind=wire.STATE_REQUEST, run=run, round=0, fragment=fragment,
                meta={"peer": transport.peer_id, "part": len(frames)},
            )
        )  # fmt: skip
        try:
            raw = await transport.call(
                victim, f"{run}.{messages.RPC_GET_STATE}", request,
                timeout_s=CALL_TIMEOUT_S, max_response_bytes=limits.max_frame_bytes,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a victim that fails: the caller tries again
            return f"call failed: {type(exc).__name__}"
        msg = wire.decode_message(raw, limits)
        if isinstance(msg, wire.Rejected) or msg.kind != messages.STATE_REPLY:
            return "no state part (busy or rate limited)"
        named = (msg.round, str(msg.meta.get("hash")), int(msg.meta.get("parts", 1)))
        if first is None:
            first = named
        elif named != first:
            return "the victim's state moved during the download"
        frames.append(raw)
    return first[0], first[1], frames


async def capture_states(
    transport: Any, run: str, victims: list[str], fragments: int
) -> dict[int, tuple[int, str, list[bytes]]]:
    """A whole state of each fragment, from the first victim that serves one past round 0."""
    captured: dict[int, tuple[int, str, list[bytes]]] = {}
    for fragment in range(fragments):
        for attempt in range(CAPTURE_TRIES):
            got = await download_parts(transport, run, victims[attempt % len(victims)], fragment)
            if not isinstance(got, str) and got[0] >= 1:
                captured[fragment] = got
                break
            await asyncio.sleep(1.0)  # patience: the victim's rate limit refills
    return captured


class StaleServer:
    """Answers `get_state` with the captured (old) parts and counts what it served."""

    def __init__(self, run: str, peer_id: str, captured: dict[int, tuple[int, str, list[bytes]]],
                 report: Callable[[dict], None]) -> None:  # fmt: skip
        self.run = run
        self.peer_id = peer_id
        self.captured = captured
        self.report = report
        self.requests = 0
        self.parts_served = 0
        self.downloads_started: list[tuple[str, int]] = []
        """(caller, fragment) of every first part served."""

    async def rpc_get_state(self, caller: str, request: bytes) -> bytes:
        self.requests += 1
        msg = wire.decode_message(request, wire.WireLimits())
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != wire.STATE_REQUEST
            or msg.fragment not in self.captured
        ):
            return messages.reply(
                self.run, 0, 0, self.peer_id, messages.Reply.REJECTED, reason="bad state_request"
            )
        round_id, _, frames = self.captured[msg.fragment]
        part = msg.meta.get("part", 0)
        if not isinstance(part, int) or not 0 <= part < len(frames):
            return messages.reply(
                self.run, 0, msg.fragment, self.peer_id, messages.Reply.REJECTED, reason="no such part"
            )
        self.parts_served += 1
        if part == 0:
            self.downloads_started.append((caller, msg.fragment))
            self.report({"stale_donor_served": caller, "fragment": msg.fragment, "round": round_id})
        return frames[part]


async def beat_at_head(
    transport: Any, run: str, victims: list[str], fragments: int, lead: int, claimed: dict[int, int]
) -> bool:
    """One learner heartbeat claiming, per fragment, the freshest victim's round plus
    `lead` (never less than claimed before); `claimed` is updated. Whether it was stored."""
    beats = await victims_beats(transport, run, victims)
    config_hash = next((b.config_hash for b in beats.values() if b.config_hash), "")
    for fragment in range(fragments):
        seen = [b.rounds[fragment] for b in beats.values() if len(b.rounds) > fragment]
        claimed[fragment] = max([claimed.get(fragment, 0), *(r + lead for r in seen)])
    sent_at = transport.now()
    beat = Heartbeat(
        peer_id=transport.peer_id, status="training", config_hash=config_hash,
        rounds=tuple(claimed[f] for f in range(fragments)), maddrs=tuple(transport.visible_maddrs()),
        sent_at=sent_at, live_s=BEAT_LIVE_S,
    )  # fmt: skip
    sealed = seal_heartbeat(transport.identity, run, beat)
    return bool(
        await transport.store(members_key(run), transport.peer_id, sealed, sent_at + BEAT_LIVE_S)
    )


async def stale_donor_attack(
    transport: Any,
    run: str,
    victims: list[str],
    duration_s: float,
    lead: int,
    report: Callable[[dict], None],
) -> dict:
    """Capture a state of every fragment, then pose as a donor at the head serving it, for
    `duration_s` (or until $STALE_DONOR_STOP_FILE exists). `report` gets a progress line
    when the state is captured and at each download that starts here."""
    beats = await victims_beats(transport, run, victims)
    fragments = max((len(b.rounds) for b in beats.values()), default=1)
    captured = await capture_states(transport, run, victims, fragments)
    if not captured:
        return {"captured": {}, "error": "no victim served a whole state"}
    rounds = {f: r for f, (r, _, _) in captured.items()}
    report(
        {
            "stale_donor_captured": True,
            "rounds": rounds,
            "hashes": {f: h for f, (_, h, _) in captured.items()},
        }
    )
    server = StaleServer(run, transport.peer_id, captured, report)
    await transport.register_handler(
        f"{run}.{messages.RPC_GET_STATE}", server.rpc_get_state, MAX_REQUEST_BYTES
    )
    claimed: dict[int, int] = {}
    beats_stored = 0
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline and not _stop_requested():
        beats_stored += await beat_at_head(transport, run, victims, fragments, lead, claimed)
        await asyncio.sleep(BEAT_PERIOD_S)  # a heartbeat period, not a synchronisation
    return {
        "captured": rounds,
        "claimed": claimed,
        "beats_stored": beats_stored,
        "requests": server.requests,
        "parts_served": server.parts_served,
        "downloads_started": len(server.downloads_started),
        "callers": sorted({c for c, _ in server.downloads_started}),
    }
