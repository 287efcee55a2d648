"""A fragment's state from other peers, for a joiner, a replica too far behind, or one on
a losing branch: downloaded in parts, verified by hash against the canonical chain.

hivemind's state download trusts the highest claimed round and one donor; here a state
counts only when its checked copies hash to a record of the canonical chain (a donor can
make a download fail, never land), and a joiner's fragments are spread over donors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.outer.fragment import FragmentState
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.base import Transport, TransportError, transfer_timeout_s
from p2pdiloco.wire import messages
from p2pdiloco.wire.state_transfer import MAX_PART_ELEMENTS, PartsAssembler, decode_part

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 120.0
"""Deadline of one `get_state` call, seconds, plus a whole part (fp32) at that link."""


class StateDownload:
    """Downloads fragments' states into one replica."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        state: GlobalState,
        members: Callable[[], dict[str, Heartbeat]],
        limits: wire.WireLimits,
        worker: ThreadPoolExecutor,
        on_event: Callable[[dict], None],
    ) -> None:
        self.transport = transport
        self.run = run
        self.state = state
        self.members = members
        self.limits = limits
        self.worker = worker
        self.on_event = on_event
        self.bytes_received = 0

    def donors(self, fragment: int) -> list[str]:
        """Live learners that accept connections and hold the fragment past round 0, most
        advanced first."""
        me, members = self.transport.peer_id, self.members()
        return sorted(
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

    async def download(self, fragment: int, chain: dict[int, RoundRecord]) -> RoundRecord | None:
        """Install the fragment's state from a donor on the canonical chain `chain`,
        verified by hash; the record of the round the state stands after, or None."""
        wanted = {record.hash: record for record in chain.values()}
        head = max(chain) + 1
        donors = self.donors(fragment)
        if not donors:
            log.warning("no donor for fragment=%d round=%d", fragment, head)
            return None
        start = fragment % len(donors)  # spread a joiner's downloads over donors
        loop = asyncio.get_running_loop()
        for donor in donors[start:] + donors[:start]:
            state = await self.fetch(donor, fragment, head)
            if state is None:
                continue
            record = wanted.get(state.hash)
            if record is None or record.round != state.round - 1:
                log.warning(
                    "state from donor=%s round=%d is not on the canonical chain: refused", donor[-8:], state.round
                )
                continue
            local_hash = await loop.run_in_executor(self.worker, self.state.import_verified, state)
            if local_hash != state.hash:
                log.warning("state from donor=%s does not hash to its claim: refused", donor[-8:])
                continue
            log.info(
                "downloaded fragment=%d round=%d donor=%s hash=%s", fragment, state.round, donor[-8:], state.hash[:12]
            )
            self.on_event(
                {"event": "downloaded", "fragment": fragment, "round": state.round, "donor": donor, "hash": state.hash}
            )
            return record
        return None

    async def fetch(self, donor: str, fragment: int, head: int) -> FragmentState | None:
        """Every part of `fragment`'s state from `donor`, or None (logged) when it fails."""
        me = self.transport.peer_id
        assembler = PartsAssembler(fragment, self.state.fragments[fragment])
        elements = self.state.sizes[fragment]
        loop = asyncio.get_running_loop()
        while not assembler.complete:
            request = wire.encode_message(
                wire.Message(
                    kind=wire.STATE_REQUEST, run=self.run, round=head, fragment=fragment,
                    meta={"peer": me, "part": assembler.next_part},
                )
            )
            try:
                raw = await self.transport.call(
                    donor,
                    f"{self.run}.{messages.RPC_GET_STATE}",
                    request,
                    timeout_s=transfer_timeout_s(STATE_TIMEOUT_S, 4 * min(MAX_PART_ELEMENTS, 2 * elements)),
                    max_response_bytes=self.limits.max_frame_bytes,
                )
            except TransportError as exc:
                log.warning("state download failed donor=%s error=%r", donor[-8:], exc)
                return None
            self.bytes_received += len(raw)
            piece = await loop.run_in_executor(
                self.worker, decode_part, raw, self.run, fragment, self.state.layouts[fragment], self.limits
            )
            reason = piece if isinstance(piece, str) else assembler.add(piece)
            if reason:
                log.warning("state from donor=%s refused reason=%r", donor[-8:], reason[:200])
                return None
        state = assembler.state()
        if isinstance(state, str):
            log.warning("state from donor=%s refused reason=%r", donor[-8:], state)
            return None
        return state
