"""Keep this peer's replica on the canonical chain: hold, serve, fetch, apply, repair.

One module owns everything that moves committed updates between replicas:

- `rpc_hold_update`: a synchronizer pushes its update frame here *before* committing;
  this peer validates and keeps it (not applied: only a round record commits it);
- `rpc_get_update` / `rpc_get_state`: serve kept update frames byte for byte, and a
  fragment's full state to joiners and repairing peers;
- `sync_fragment`: read the fragment's round records, pick the canonical chain
  (`rounds.canonical_chain`), apply its updates in order (fetched by digest from the
  record's holders, its synchronizer or any live peer), and repair by state download
  when this replica sits on a losing branch or is too far behind.

All heavy work (decode, outer step, hash, export, import) runs on one worker thread,
never on the event loop; every network wait has a deadline. Faults are logged and the
round is retried on the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import compress, messages, wire
from p2pdiloco.membership import Heartbeat, synchronizer_candidates
from p2pdiloco.rounds import RoundRecord, canonical_chain, records_of, rounds_key
from p2pdiloco.state import (
    FragmentState,
    GlobalState,
    PreparedUpdate,
    import_verified,
    install_update,
)
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.updates import Update, UpdateStore, parse_update

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 30.0
"""Deadline of one `get_update` call, seconds."""
STATE_TIMEOUT_S = 120.0
"""Deadline of one `get_state` call, seconds."""
MAX_FETCH_PEERS = 6
"""Peers asked for one update before this sync pass gives up on it."""
MAX_CATCH_UP_ROUNDS = 8
"""Behind by more rounds than this: download the fragment's state instead of replaying."""


class ReplicaSync:
    """Serves and follows the canonical chain of every fragment for one peer."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        worker: ThreadPoolExecutor,
        void_after_s: float,
        on_event: Callable[[dict], None] = lambda event: None,
        rivals_visible: Callable[[int], bool] = lambda round_id: True,
    ) -> None:
        self.transport = transport
        self.rivals_visible = rivals_visible
        """Whether records of others are followed at a round (off only under the
        split-view fault injection, which makes this peer commit a round alone)."""
        self.run = run
        self.state = state
        self.members = members
        self.limits = limits
        self.worker = worker
        self.void_after_s = void_after_s
        self.on_event = on_event
        self.store = UpdateStore()
        self.shapes = [
            {n: tuple(state.params[n].shape) for n in names} for names in state.fragments
        ]
        self.genesis = [state.fragment_hash(f) for f in range(state.num_fragments)]
        self.chains: list[dict[int, RoundRecord]] = [{} for _ in state.fragments]
        """The canonical chain of each fragment as last read from the DHT."""
        self.applied: list[dict[int, str]] = [{} for _ in state.fragments]
        """Digest of the update this replica applied for each round (chain bookkeeping)."""
        self.void: set[str] = set()
        """Digests of committed updates nobody could serve for `void_after_s`: skipped."""
        self._unfetchable_since: dict[str, float] = {}
        self._locks = [asyncio.Lock() for _ in state.fragments]
        self.bytes_received = 0
        self.on_committed: list[Callable[[int, int, RoundRecord], None]] = []
        """Called as `(fragment, round, record)` with the canonical record of each round
        this replica passed, as read from the DHT (again if it changes), so learners
        settle their deltas by what the swarm committed, not by what one peer said."""
        self._notified: list[dict[int, str]] = [{} for _ in state.fragments]

    # --- serving ------------------------------------------------------------------------

    async def start(self) -> None:
        max_update = self.limits.max_frame_bytes
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_HOLD_UPDATE}", self.rpc_hold_update, max_update
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_UPDATE}", self.rpc_get_update, 1 << 16
        )
        await self.transport.register_handler(
            f"{self.run}.{messages.RPC_GET_STATE}", self.rpc_get_state, 1 << 16
        )

    def keep(self, update: Update) -> None:
        """Keep an update frame to serve (this peer's own, or one pushed or fetched)."""
        self.store.put(update)

    async def rpc_hold_update(self, caller: str, request: bytes) -> bytes:
        """A synchronizer asks us to hold its update before it commits the round."""
        update = parse_update(request, self.limits, self.run, self.shapes)
        if isinstance(update, wire.Rejected):
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], update.reason)
            return messages.reply(
                self.run, -1, 0, self.transport.peer_id, messages.REJECTED, reason=update.reason
            )
        if update.synchronizer != caller:
            reason = "update names another synchronizer"
            log.warning("refused update to hold peer=%s reason=%r", caller[-8:], reason)
            return messages.reply(
                self.run, update.round, update.fragment, self.transport.peer_id,
                messages.REJECTED, reason=reason,
            )
        self.keep(update)
        return messages.reply(
            self.run, update.round, update.fragment, self.transport.peer_id, messages.HELD,
            digest=update.digest,
        )

    def _small_request(self, request: bytes, kind: str) -> wire.Message | bytes:
        """A valid request of `kind` for one of our fragments, or the rejection to answer."""
        msg = wire.decode_message(request, self.limits)
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != kind
            or not 0 <= msg.fragment < self.state.num_fragments
        ):
            return messages.reply(
                self.run, 0, 0, self.transport.peer_id, messages.REJECTED, reason=f"bad {kind}"
            )
        return msg

    async def rpc_get_update(self, caller: str, request: bytes) -> bytes:
        """The update frame of (round, fragment) with the requested digest, byte for byte."""
        msg = self._small_request(request, messages.UPDATE_REQUEST)
        if isinstance(msg, bytes):
            return msg
        digest = msg.meta.get("digest")
        if isinstance(digest, str) and digest:
            update = self.store.get(msg.fragment, digest)
        else:
            found = self.store.of_round(msg.fragment, msg.round)
            update = found[-1] if found else None
        if update is None:
            return messages.reply(
                self.run, msg.round, msg.fragment, self.transport.peer_id, messages.MISSING
            )
        return update.frame

    async def rpc_get_state(self, caller: str, request: bytes) -> bytes:
        """One fragment's global parameters and optimizer state, for a joining peer."""
        msg = self._small_request(request, wire.STATE_REQUEST)
        if isinstance(msg, bytes):
            return msg
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, self._encode_state, msg.fragment)

    def _encode_state(self, fragment: int) -> bytes:
        snapshot = self.state.export_fragment(fragment)
        fp32 = compress.make_codec("fp32")
        tensors = {f"p/{n}": fp32.encode(t) for n, t in snapshot.params.items()}
        tensors.update({f"m/{n}": fp32.encode(t) for n, t in snapshot.momentum.items()})
        tensors.update(
            {f"a/{n}": fp32.encode(t) for n, t in getattr(snapshot, "accumulated", {}).items()}
        )
        return wire.encode_message(
            wire.Message(
                kind=messages.STATE_REPLY,
                run=self.run,
                round=snapshot.round,
                fragment=snapshot.fragment,
                meta={"peer": self.transport.peer_id, "hash": snapshot.hash},
                tensors=tensors,
            )
        )

    # --- reading the chain --------------------------------------------------------------

    async def read_chain(self, fragment: int) -> dict[int, RoundRecord]:
        """The canonical chain of `fragment` from the DHT records (bounded by the transport)."""
        raw = await self.transport.get(rounds_key(self.run, fragment))
        records = records_of(raw, fragment).values()
        chain = canonical_chain(self.run, records, self.genesis[fragment], frozenset(self.void))
        self.chains[fragment] = chain
        return chain

    def parent_hash(self, fragment: int, round_id: int) -> str | None:
        """The fragment's hash before round `round_id` on this replica (None if unknown)."""
        if round_id == 0:
            return self.genesis[fragment]
        # applied_hashes holds the hash after each applied round: no hashing on the loop
        return self.state.applied_hashes[fragment].get(round_id - 1)

    async def install_own(self, record: RoundRecord, update: Update, prepared: PreparedUpdate) -> bool:
        """Install a result this peer committed as synchronizer (no decode, no fetch)."""
        fragment = record.fragment
        async with self._locks[fragment]:
            self.keep(update)
            self.chains[fragment][record.round] = record
            loop = asyncio.get_running_loop()
            installed = await loop.run_in_executor(self.worker, install_update, self.state, prepared)
            if installed:
                self.applied[fragment][record.round] = record.digest
            return installed

    def committed(self, fragment: int, round_id: int) -> RoundRecord | None:
        """The canonical record of (round, fragment) as last read, if any."""
        return self.chains[fragment].get(round_id)

    def _on_canonical_branch(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """True unless some round this replica applied differs from the chain's record."""
        ours = self.state.applied_hashes[fragment]
        for round_id, record in chain.items():
            if round_id in ours and ours[round_id] != record.hash:
                return False
        current = self.state.round_of(fragment)
        if current > 0 and current - 1 in chain and (current - 1) not in ours:
            return False
        return True

    # --- following the chain ------------------------------------------------------------

    async def sync_fragment(self, fragment: int, chain: dict[int, RoundRecord] | None = None) -> bool:
        """Bring `fragment` to the head of its canonical chain; True when there."""
        async with self._locks[fragment]:
            if not self.rivals_visible(self.state.round_of(fragment)):
                return False
            if chain is None:
                chain = await self.read_chain(fragment)
            if not chain:
                return True
            head = max(chain) + 1
            if not self._on_canonical_branch(fragment, chain):
                log.warning("replica on a losing branch fragment=%d: repairing", fragment)
                self.on_event({"event": "repair", "fragment": fragment})
                if not await self._download(fragment, chain):
                    return False
            current = self.state.round_of(fragment)
            if head - current > MAX_CATCH_UP_ROUNDS or (current < head and current not in chain):
                if not await self._download(fragment, chain):
                    return False
            while (current := self.state.round_of(fragment)) < head:
                if not await self._apply_record(chain[current]):
                    self._notify_settled(fragment, chain)
                    return False
            self._notify_settled(fragment, chain)
            return True

    async def apply_committed(self, record: RoundRecord, hint: Update | None = None) -> bool:
        """Apply the committed round `record` (e.g. named in a synchronizer's reply)."""
        fragment = record.fragment
        if hint is not None:
            self.keep(hint)
        async with self._locks[fragment]:
            if self.state.round_of(fragment) > record.round:
                return self.state.applied_hashes[fragment].get(record.round) == record.hash
            if self.state.round_of(fragment) == record.round and (
                record.parent == self.parent_hash(fragment, record.round)
            ):
                self.chains[fragment].setdefault(record.round, record)
                return await self._apply_record(record)
        # behind, or the record is not on our branch: follow the DHT's canonical chain
        return await self.sync_fragment(fragment)

    async def _apply_record(self, record: RoundRecord) -> bool:
        update = await self._fetch(record)
        if update is None:
            return False
        loop = asyncio.get_running_loop()
        try:
            new_hash = await loop.run_in_executor(self.worker, self._apply, update)
        except ValueError as exc:
            log.warning(
                "update refused round=%d fragment=%d reason=%r", record.round, record.fragment, str(exc)
            )
            self.void.add(record.digest)
            return False
        self.applied[record.fragment][record.round] = record.digest
        if new_hash != record.hash:
            log.error(
                "replica diverged round=%d fragment=%d ours=%s theirs=%s",
                record.round, record.fragment, new_hash[:12], record.hash[:12],
            )
            self.on_event({"event": "diverged", "fragment": record.fragment, "round": record.round})
            return False
        return True

    def _apply(self, update: Update) -> str:
        """Decode and apply one update (worker thread)."""
        if self.state.fragment_hash(update.fragment) != update.parent:
            raise ValueError("update's parent is not this replica's state")
        return self.state.apply_update(update.fragment, update.round, update.decode())

    def _notify_settled(self, fragment: int, chain: dict[int, RoundRecord]) -> None:
        """Tell learners which record the DHT's canonical chain holds for each round this
        replica passed; again if a later read finds another record (a rival won)."""
        current = self.state.round_of(fragment)
        notified = self._notified[fragment]
        for round_id in sorted(r for r in chain if current - 64 <= r < current):
            record = chain[round_id]
            if notified.get(round_id) != record.digest:
                notified[round_id] = record.digest
                for listener in list(self.on_committed):
                    listener(fragment, round_id, record)
        for old in [r for r in notified if r < current - 64]:
            del notified[old]

    async def _fetch(self, record: RoundRecord) -> Update | None:
        """The update frame a record names, from our store or a holder; verified by digest."""
        kept = self.store.get(record.fragment, record.digest)
        if kept is not None:
            return kept
        me = self.transport.peer_id
        live = [p for p in synchronizer_candidates(self.members()) if p != me]
        order = [record.synchronizer, *record.holders, *live]
        peers = list(dict.fromkeys(p for p in order if p != me))[:MAX_FETCH_PEERS]
        request = wire.encode_message(
            wire.Message(
                kind=messages.UPDATE_REQUEST,
                run=self.run,
                round=record.round,
                fragment=record.fragment,
                meta={"peer": me, "digest": record.digest},
            )
        )
        for peer in peers:
            try:
                raw = await self.transport.call(
                    peer,
                    f"{self.run}.{messages.RPC_GET_UPDATE}",
                    request,
                    timeout_s=FETCH_TIMEOUT_S,
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError:
                continue
            self.bytes_received += len(raw)
            update = parse_update(raw, self.limits, self.run, self.shapes)
            if isinstance(update, wire.Rejected) or update.digest != record.digest:
                continue
            self.keep(update)
            self._unfetchable_since.pop(record.digest, None)
            return update
        first = self._unfetchable_since.setdefault(record.digest, time.monotonic())
        log.warning(
            "cannot fetch update fragment=%d round=%d digest=%s from %d peers",
            record.fragment, record.round, record.digest[:12], len(peers),
        )
        if time.monotonic() - first >= self.void_after_s:
            # Nobody live serves it: nobody can have applied it; the round is re-run.
            log.warning("round voided fragment=%d round=%d", record.fragment, record.round)
            self.void.add(record.digest)
            self.on_event({"event": "voided", "fragment": record.fragment, "round": record.round})
        return None

    # --- state download -----------------------------------------------------------------

    async def _download(self, fragment: int, chain: dict[int, RoundRecord]) -> bool:
        """Fetch the fragment's state from donors on the canonical chain; verify by hash."""
        wanted = {record.hash: record for record in chain.values()}
        head = max(chain) + 1
        me = self.transport.peer_id
        members = self.members()
        donors = sorted(
            (
                p
                for p, beat in members.items()
                if p != me
                and beat.role == "learner"
                and not beat.client_mode
                and len(beat.rounds) > fragment
                and beat.rounds[fragment] > 0
            ),
            key=lambda p: -members[p].rounds[fragment],
        )
        if not donors:
            log.warning("no donor for fragment=%d round=%d", fragment, head)
            return False
        start = fragment % len(donors)  # spread a joiner's downloads over donors
        request = wire.encode_message(
            wire.Message(
                kind=wire.STATE_REQUEST, run=self.run, round=head, fragment=fragment,
                meta={"peer": me},
            )
        )
        loop = asyncio.get_running_loop()
        for donor in donors[start:] + donors[:start]:
            try:
                raw = await self.transport.call(
                    donor,
                    f"{self.run}.{messages.RPC_GET_STATE}",
                    request,
                    timeout_s=STATE_TIMEOUT_S,
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning("state download failed donor=%s error=%r", donor[-8:], exc)
                continue
            self.bytes_received += len(raw)
            state = await loop.run_in_executor(self.worker, self._parse_state, raw, fragment)
            if state is None:
                log.warning("malformed state from donor=%s: refused", donor[-8:])
                continue
            record = wanted.get(state.hash)
            if record is None or record.round != state.round - 1:
                log.warning(
                    "state from donor=%s round=%d is not on the canonical chain: refused",
                    donor[-8:], state.round,
                )
                continue
            try:
                local_hash = await loop.run_in_executor(self.worker, import_verified, self.state, state)
            except ValueError as exc:
                log.warning("state from donor=%s refused reason=%r", donor[-8:], str(exc))
                continue
            if local_hash != state.hash:
                log.warning("state from donor=%s does not hash to its claim: refused", donor[-8:])
                continue
            self.applied[fragment] = {state.round - 1: record.digest}
            log.info(
                "downloaded fragment=%d round=%d donor=%s hash=%s",
                fragment, state.round, donor[-8:], state.hash[:12],
            )
            self.on_event(
                {
                    "event": "downloaded",
                    "fragment": fragment,
                    "round": state.round,
                    "donor": donor,
                    "hash": state.hash,
                }
            )
            return True
        return False

    def _parse_state(self, raw: bytes, fragment: int) -> FragmentState | None:
        """A donor's reply as a FragmentState, or None when it is not a valid one."""
        msg = wire.decode_message(raw, self.limits)
        if (
            isinstance(msg, wire.Rejected)
            or msg.kind != messages.STATE_REPLY
            or msg.fragment != fragment
            or msg.run != self.run
            or msg.round < 1
        ):
            return None
        try:
            tensors = compress.decode_tensors(msg.tensors)
        except ValueError:
            return None
        parts: dict[str, dict] = {"p": {}, "m": {}, "a": {}}
        for key, tensor in tensors.items():
            prefix, _, name = key.partition("/")
            if prefix not in parts:
                return None
            parts[prefix][name] = tensor
        extra = {"accumulated": parts["a"]} if parts["a"] else {}
        try:
            return FragmentState(
                fragment=fragment,
                round=msg.round,
                params=parts["p"],
                momentum=parts["m"],
                hash=str(msg.meta["hash"]),
                **extra,
            )
        except TypeError:
            return None
