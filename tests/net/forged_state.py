"""A forged chain with a served state (issue 42, item 2), as an attacker would run it: a
key the chain named once (an honest learner's, turned attacker) and a stranger's own
transport, the stock DHT.

1. It downloads a real state of fragment 0 from a victim by `get_state` (the stale
   donor's capture: a state that hashes to a record of the canonical chain).
2. Then, for each new head of fragment 0's chain, the named key signs records for the
   next `SPAN` rounds on top of it: updates that exist nowhere, the last record naming the
   captured state's hash, so the chain's head is a state the attacker holds. A replica
   that follows that branch cannot fetch one update of it and is more than
   `MAX_CATCH_UP_ROUNDS` behind: it looks for a donor of the head's state.
3. The stranger beats as a learner at that head and answers every `get_state` with the
   captured parts, relabelled for the head round (the hash is the parameters', not the
   label's, so they still hash to the forged head).

Before the fix every replica installed it, the honest synchronizer included: the run
went back to the captured round, or to any weights the attacker chose. Now a state is
taken only from a donor that vouches for the records it skips (`download.unvouched`): a
span signed by one key, served by a donor no applied round named, is refused, and the
round's synchronizer re-runs the round the forged record took.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from floods import victims_beats  # beside this script, as adversary.py imports us
from stale_donor import MAX_REQUEST_BYTES, StaleServer, beat_at_head, capture_states

from p2pdiloco.identity import Identity
from p2pdiloco.protocol.rounds import (
    RoundRecord,
    open_record,
    record_subkey,
    rounds_key,
    seal_record,
)
from p2pdiloco.wire import messages

SPAN = 10
"""Forged rounds on top of each head: past `MAX_CATCH_UP_ROUNDS` (8), so a replica on the
branch downloads a state instead of replaying updates."""
RECORD_LIFE_S = 1800.0
BEAT_PERIOD_S = 1.0


async def sign_branch(
    transport: Any, run: str, signer: Identity, head: RoundRecord, last_hash: str, forged: set[str]
) -> int:
    """Records for rounds head+1 .. head+SPAN of fragment 0, signed by `signer`, chained
    from `head`'s hash, the last naming `last_hash`; how many the DHT stored. Their
    digests go into `forged`."""
    parent, stored = head.hash, 0
    for round_id in range(head.round + 1, head.round + SPAN + 1):
        record = RoundRecord(
            round=round_id, fragment=0, synchronizer=signer.peer_id,
            hash=last_hash if round_id == head.round + SPAN else os.urandom(16).hex(), parent=parent,
            digest=os.urandom(16).hex(), contributors=((signer.peer_id, 1.0, 64),), holders=(signer.peer_id,),
            closed_at=transport.now(),
        )  # fmt: skip
        forged.add(record.digest)
        stored += await transport.store(
            rounds_key(run, 0), record_subkey(round_id, signer.peer_id), seal_record(signer, run, record),
            transport.now() + RECORD_LIFE_S,
        )  # fmt: skip
        parent = record.hash
    return stored


async def honest_head(transport: Any, run: str, victims: list[str], forged: set[str]) -> RoundRecord | None:
    """The highest-round record of fragment 0 signed by a victim, not one of ours (the
    named key may be a victim's too: a learner turned attacker)."""
    records = [open_record(run, value) for value, _ in (await transport.get(rounds_key(run, 0))).values()]
    honest = [r for r in records if r is not None and r.synchronizer in victims and r.digest not in forged]
    return max(honest, key=lambda r: r.round, default=None)


async def forged_state_attack(
    transport: Any,
    run: str,
    victims: list[str],
    signer: Identity,
    duration_s: float,
    relabel: Callable[[bytes, int], bytes],
    report: Callable[[dict], None],
) -> dict:
    """Capture fragment 0's state, then for `duration_s` sign a `SPAN`-round branch on
    every new honest head whose last record names the captured hash, and serve that state
    (frames relabelled by `relabel(frame, round)`) as a learner at the branch's head."""
    captured = await capture_states(transport, run, victims, 1)
    if not captured:
        return {"error": "no victim served a whole state"}
    captured_round, served_hash, frames = captured[0]
    served: dict[int, tuple[int, str, list[bytes]]] = {0: (captured_round, served_hash, frames)}
    report({"forged_state_captured": True, "round": captured_round, "hash": served_hash})
    server = StaleServer(run, transport.peer_id, served, report)
    await transport.register_handler(f"{run}.{messages.RPC_GET_STATE}", server.rpc_get_state, MAX_REQUEST_BYTES)
    beats = await victims_beats(transport, run, victims)
    fragments = max((len(b.rounds) for b in beats.values()), default=1)
    claimed: dict[int, int] = {}
    branches, signed, based_on, forged = [], 0, -1, set()
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        head = await honest_head(transport, run, victims, forged)
        if head is not None and head.round > based_on:
            based_on = head.round
            signed += await sign_branch(transport, run, signer, head, served_hash, forged)
            top = head.round + SPAN + 1  # the state after the last forged round
            served[0] = (top, served_hash, [relabel(frame, top) for frame in frames])
            claimed[0] = max(claimed.get(0, 0), top)
            branches.append(head.round)
        await beat_at_head(transport, run, victims, fragments, 0, claimed)
        await asyncio.sleep(BEAT_PERIOD_S)  # a heartbeat period, not a synchronisation
    return {
        "captured_round": captured_round, "served_hash": served_hash, "branches": len(branches),
        "records_signed": signed, "requests": server.requests, "parts_served": server.parts_served,
        "downloads_started": len(server.downloads_started), "callers": sorted({c for c, _ in server.downloads_started}),
        "key": signer.peer_id,
    }  # fmt: skip
