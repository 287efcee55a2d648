"""An outside observer of a live run: `p2pdiloco audit`, and the global model of
`p2pdiloco export --run` / `generate --run`.

The observer never trains and never serves. It builds the run's model from the (verified)
config and follows the canonical chain of fragments to their head (`catch_up`: a state
download from the run's learners, checked by hash like any joiner's, then the committed
updates, each checked against its record's signed hash). That is the run's current
verified global model (`download_global_state`).

`audit_next_round` then waits for the next committed record, fetches that round's signed
contributions from its synchronizer and recomputes the merge bit for bit
(`audit.audit_round`). Only the *next* round can be checked: the parent state of an older
round is no longer held by anyone.

Every wait is bounded by `wait_s`; a run that stalls or a synchronizer that does not
serve its contributions gives `unverifiable`, never a hang and never an accusation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco import wire
from p2pdiloco.backoff import backoff_delays, within
from p2pdiloco.config import RunConfig
from p2pdiloco.protocol.fragments import partition_fragments
from p2pdiloco.protocol.membership import Heartbeat, live_members
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.roles.presence import read_members
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.model import build_model
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.audit import UNVERIFIABLE, Auditor, AuditResult

log = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the observer re-reads the DHT while it waits (a poll period, not a sync)."""
CATCH_UP_RETRY_CAP_S = 8.0
"""Longest wait between attempts to catch up (they start at POLL_S and double, jittered), s."""


def observer_state(config: RunConfig) -> GlobalState:
    """The run's genesis state, built exactly as every peer builds it."""
    model = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    params = {n: p.detach() for n, p in model.named_parameters()}
    fragments = partition_fragments({n: p.numel() for n, p in params.items()}, config.sync.num_fragments)
    return GlobalState(params, fragments, config.outer)


class RunMembers:
    """The run's live membership as last read from the DHT (donors for the state download)."""

    def __init__(self, transport: Transport, run: str, shards: int = 1) -> None:
        self.transport, self.run, self.shards = transport, run, shards
        self.view: dict[str, Heartbeat] = {}

    async def refresh(self) -> None:
        try:
            records = await read_members(self.transport, self.run, self.shards)
        except TransportError as exc:
            log.info("membership read failed: %r", exc)
            return
        # any learner may donate: what it sends is checked against the chain's signed hash
        self.view, _ = live_members(self.run, records, self.transport.now())

    def __call__(self) -> dict[str, Heartbeat]:
        return dict(self.view)


async def catch_up(replicas: ReplicaSync, members: RunMembers, fragments: list[int], deadline: float) -> bool:
    """Bring each of `fragments` to the head of its canonical chain; False when the
    monotonic `deadline` passes first (the run stalled, or no donor served its state)."""
    pending = list(fragments)
    delays = backoff_delays(POLL_S, CATCH_UP_RETRY_CAP_S)
    while True:
        await members.refresh()
        pending = [f for f in pending if not await replicas.sync_fragment(f)]
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        # no donor served it yet: retry later, jittered, before the deadline
        await asyncio.sleep(within(next(delays), deadline, time.monotonic()))


@contextlib.contextmanager
def observer_replica(
    transport: Transport, config: RunConfig, admission: Admission, thread_name: str
) -> Iterator[tuple[GlobalState, RunMembers, ReplicaSync]]:
    """A replica of the run that only follows its chain (state, members, replica sync),
    with a worker thread of its own that is shut down on exit. An update out of line with
    the last ones is recomputed by its auditor before it is applied."""
    run = config.peer.run
    state = observer_state(config)
    members = RunMembers(transport, run, config.network.member_shards)
    limits = wire.WireLimits()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name) as worker:
        replicas = ReplicaSync(
            transport, run, state, members, limits, worker,
            void_after_s=config.sync.round_deadline_s, admission=admission,
            auditor=Auditor(run, config, limits, state.fragments),
            epoch_rounds=config.network.record_epoch_rounds,
        )  # fmt: skip
        yield state, members, replicas


async def download_global_state(
    transport: Transport, config: RunConfig, admission: Admission, wait_s: float
) -> GlobalState | None:
    """The run's current verified global state, every fragment at the head of its chain
    (round 0 everywhere: the genesis, no download); None when not caught up in `wait_s`."""
    deadline = time.monotonic() + wait_s
    with observer_replica(transport, config, admission, "observer") as (state, members, replicas):
        caught_up = await catch_up(replicas, members, list(range(state.num_fragments)), deadline)
    return state if caught_up else None


async def audit_next_round(
    transport: Transport, config: RunConfig, admission: Admission, fragment: int, wait_s: float
) -> tuple[AuditResult, RoundRecord | None]:
    """Catch up with `fragment`'s chain, then audit the next round committed (bounded by `wait_s`).

    Returns the verdict and the audited record (None when no round could be audited).
    """
    if not 0 <= fragment < config.sync.num_fragments:
        return AuditResult(UNVERIFIABLE, f"the run has no fragment {fragment}"), None
    deadline = time.monotonic() + wait_s
    with observer_replica(transport, config, admission, "audit") as (state, members, replicas):
        # 1. follow the chain to its head (a download when the run is past round 0)
        if not await catch_up(replicas, members, [fragment], deadline):
            return AuditResult(UNVERIFIABLE, "could not catch up with the run's chain"), None
        target = state.round_of(fragment)
        snapshot = state.export_fragment(fragment)
        log.info("audit: at round %d of fragment %d, waiting for its record", target, fragment)
        # 2. wait for the record of the next round, built on the state we hold
        while (record := await _record_of(replicas, fragment, target)) is None:
            if time.monotonic() > deadline:
                return AuditResult(UNVERIFIABLE, f"no record of round {target} within {wait_s:g} s"), None
            await asyncio.sleep(POLL_S)
        # 3. recompute it from its signed contributions
        return await replicas.audit(record, snapshot), record


async def _record_of(replicas: ReplicaSync, fragment: int, round_id: int) -> RoundRecord | None:
    try:
        return (await replicas.read_chain(fragment)).get(round_id)
    except TransportError as exc:
        log.info("chain read failed: %r", exc)
        return None
