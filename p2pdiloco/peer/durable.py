"""The global state on disk, with the signed records that justify it: a run outlives its peers.

Every checkpoint writes, per fragment that moved, `global-<f>.pt` beside the learner's
own file (format and offline check: `peer.saved_state`). On start, before the learner
takes its bases, `restore` installs each fragment whose file verifies; a file that fails
is logged with its reason and that fragment starts from the initial state like a new
peer's: a damaged or tampered checkpoint never crashes a peer and never enters the swarm.

After a full stop the DHT may hold none of the run's records (they expire after an
hour, and a restarted bootstrap node starts empty): `republish` stores the restored
chain's records again, so the swarm's canonical chain goes on from the newest state any
restarted peer holds, and peers with an empty directory download that state (verified
by hash against the same records, `roles.download`). A record closed so long ago that
the DHT's rules would refuse it (or keep it less than half its lifetime) goes back in a
resume envelope this peer signs now (`rounds.seal_resumed`): the record inside is its
synchronizer's, checked as ever, and its chain gives the screening its history again.
It publishes nothing when the DHT already holds a record at or past the restored round
(the swarm went on without us: our older records would only add rivals to rounds it has
settled). A joiner at round 0
that sees no record while live peers say they are past it waits, bounded, for the
records (`wait_for_chain`) rather than start the run over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from p2pdiloco import wire
from p2pdiloco.peer.saved_state import SavedFragment, justifying_chain, read_fragment, save_fragment
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import (
    ROUND_RECORD_TTL_S,
    RoundRecord,
    record_subkey,
    records_of,
    rounds_key,
    seal_resumed,
)
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState

log = logging.getLogger(__name__)

REPUBLISH_CONCURRENCY = 8
"""Stores in flight at once while republishing."""


# --- the peer's side ---------------------------------------------------------------------


class GlobalCheckpoint:
    """Saves this peer's replica of the global state with its records, restores it on start
    and republishes the records it stands on."""

    def __init__(
        self,
        directory: str,
        run: str,
        config_hash: str,
        replicas: ReplicaSync,
        limits: wire.WireLimits,
        emit: Callable[[dict], None],
        certificates: tuple[bytes, ...] = (),
    ) -> None:
        self.directory = directory
        self.certificates = certificates
        """This peer's operator certificates, shown in the resume envelopes it signs."""
        self.run = run
        self.config_hash = config_hash
        self.replicas = replicas
        self.state: GlobalState = replicas.state
        self.limits = limits
        self.emit = emit
        num = self.state.num_fragments
        self.chains: list[dict[int, RoundRecord]] = [{} for _ in range(num)]
        """Per fragment, the records that justify the last state saved or restored (kept
        across saves: the DHT forgets records after an hour, a checkpoint need not)."""
        self.saved: list[tuple[int, str]] = [(0, "") for _ in range(num)]
        """Per fragment, (round, hash) of the state last saved or restored."""
        self.restored: dict[int, int] = {}
        """Fragment -> round restored from disk at start."""
        self.refused: dict[int, str] = {}
        """Fragment -> why its saved state was refused at start."""

    # --- start ------------------------------------------------------------------------

    def restore(self) -> dict[int, int]:
        """Install every fragment whose saved state verifies (before the learner takes its
        bases, after `ReplicaSync` took the initial hashes); fragment -> round restored."""
        for fragment in range(self.state.num_fragments):
            found = read_fragment(
                self.directory,
                fragment,
                self.run,
                self.config_hash,
                self.state,
                self.replicas.genesis[fragment],
                self.limits,
                self._certified_at_close,
            )
            if found is None:
                continue
            if isinstance(found, str):
                self.refused[fragment] = found
                log.warning(
                    "global checkpoint refused dir=%s fragment=%d reason=%r: this fragment starts from the "
                    "initial state",
                    self.directory,
                    fragment,
                    found,
                )
                continue
            self._install(found)
        return self.restored

    def _certified_at_close(self, record: RoundRecord) -> bool:
        """Whether the run entitled the record's synchronizer when it closed the round (a
        certificate valid then). Not whether the record could be committed *now*: a
        checkpoint is read long after its rounds closed."""
        admission = self.replicas.entitlement.admission
        return (
            admission.synchronizer_refusal(
                self.run, record.synchronizer, record.certificates, record.closed_at
            )
            is None
        )

    def _install(self, saved: SavedFragment) -> None:
        fragment, round_id = saved.state.fragment, saved.state.round
        last = saved.records[round_id - 1]
        self.state.install_download(saved.state)
        self.replicas.chains[fragment] = dict(saved.records)
        self.replicas.applied[fragment] = {last.round: last.digest}
        if saved.frame is not None:
            self.replicas.keep(saved.frame)
        self.chains[fragment] = dict(saved.records)
        self.saved[fragment] = (round_id, saved.state.hash)
        self.restored[fragment] = round_id
        log.info(
            "global checkpoint restored fragment=%d round=%d hash=%s records=%d",
            fragment,
            round_id,
            saved.state.hash[:12],
            len(saved.records),
        )

    async def resume(self) -> None:
        """After the network is up: say what the saved state gave (events), then put the
        records it stands on back in the DHT (`republish`)."""
        for fragment, reason in self.refused.items():
            self.emit({"event": "checkpoint_refused", "fragment": fragment, "reason": reason})
        if not self.restored:
            return
        state = self.state
        self.emit({"event": "resumed", "rounds": list(state.rounds), "dir": self.directory,
                   "hashes": [state.current_hash(f) for f in range(state.num_fragments)]})  # fmt: skip
        await self.republish()

    async def republish(self) -> None:
        """Store the restored chains' records in the DHT again where the swarm has nothing
        at or past them (after a full stop the DHT may have forgotten the run)."""
        for fragment, round_id in sorted(self.restored.items()):
            epochs = self.replicas.epoch_rounds
            key = rounds_key(self.run, fragment, round_id, epochs)  # the restored head's
            present = records_of(self.run, await self.replicas.transport.get(key), fragment)
            ahead = [r for r, _ in present if r >= round_id]
            if ahead:
                log.info(
                    "records not republished fragment=%d: the swarm holds round %d",
                    fragment,
                    max(ahead),
                )
                continue
            missing = [
                r
                for r in self.chains[fragment].values()
                if (r.round, r.synchronizer) not in present
            ]
            stored = await self._store_all(fragment, missing)
            log.info(
                "records republished fragment=%d stored=%d of %d", fragment, stored, len(missing)
            )
            self.emit(
                {"event": "republished", "fragment": fragment, "round": round_id, "records": stored}
            )

    async def _store_all(self, fragment: int, records: Iterable[RoundRecord]) -> int:
        transport, epochs = self.replicas.transport, self.replicas.epoch_rounds
        gate = asyncio.Semaphore(REPUBLISH_CONCURRENCY)

        async def store(record: RoundRecord) -> bool:
            async with gate:
                subkey = record_subkey(record.round, record.synchronizer)
                key = rounds_key(self.run, fragment, record.round, epochs)
                now = transport.now()
                value = record.sealed
                if record.closed_at < now - ROUND_RECORD_TTL_S / 2:  # would live under half a life
                    value = seal_resumed(transport.identity, self.run, record, now, self.certificates)
                return await transport.store(key, subkey, value, now + ROUND_RECORD_TTL_S)

        return sum(await asyncio.gather(*(store(r) for r in records)))

    # --- saving -----------------------------------------------------------------------

    async def known(self) -> list[tuple[dict[int, RoundRecord], dict[str, bytes]]]:
        """Per fragment (on the event loop, which owns them): the chain as this replica
        knows it, and the frames it holds of that chain's records, by digest."""
        out = []
        for fragment, chain in enumerate(self.replicas.chains):
            chain = dict(chain)
            frames = {}
            for record in chain.values():
                update = self.replicas.store.get(fragment, record.digest)
                if update is not None:
                    frames[record.digest] = update.frame
            out.append((chain, frames))
        return out

    def save(self, known: list[tuple[dict[int, RoundRecord], dict[str, bytes]]]) -> list[int]:
        """Save every fragment that moved since its last save and that its records justify
        (training thread; `known` from `known()` on the event loop); the fragments
        written. OSError when the disk refuses."""
        written = []
        for fragment, (chain, frames) in enumerate(known):
            with self.state.lock:  # where the replica is, without copying it
                round_id, hash_ = self.state.rounds[fragment], self.state.current_hash(fragment)
            if round_id == 0 or (round_id, hash_) == self.saved[fragment]:
                continue
            merged = {
                **self.chains[fragment],
                **{r: rec for r, rec in chain.items() if r < round_id},
            }
            justified = justifying_chain(merged, round_id, hash_)
            if not justified:
                log.debug(
                    "global state not saved fragment=%d round=%d: no record signs it",
                    fragment,
                    round_id,
                )
                continue
            exported = self.state.export_fragment(fragment)
            if (exported.round, exported.hash) != (round_id, hash_):
                continue  # it moved meanwhile: the next checkpoint saves it
            frame = frames.get(justified[-1].digest)
            save_fragment(self.directory, self.run, self.config_hash, exported, justified, frame)
            self.chains[fragment] = {record.round: record for record in justified}
            self.saved[fragment] = (round_id, hash_)
            written.append(fragment)
        return written


def past_round_zero(members: Mapping[str, Heartbeat], fragment: int, me: str) -> bool:
    """Whether another live peer says its replica of `fragment` is past round 0."""
    return any(
        p != me and len(b.rounds) > fragment and b.rounds[fragment] > 0 for p, b in members.items()
    )


async def wait_for_chain(
    replicas: ReplicaSync, fragment: int, poll_s: float, timeout_s: float
) -> bool:
    """For a replica at round 0: while the DHT holds no record of `fragment` but a live
    peer says it is past round 0 (a run resuming from checkpoints, its records not yet
    republished or not yet accepted), wait, re-reading the chain every `poll_s`, at most
    `timeout_s`, instead of starting the run over from the initial state. True once a
    chain is there (or nothing to wait for). A peer's claimed rounds cost a joiner at most
    `timeout_s`, once."""
    deadline = time.monotonic() + timeout_s
    me = replicas.transport.peer_id
    while replicas.state.round_of(fragment) == 0 and past_round_zero(
        replicas.members(), fragment, me
    ):
        if await replicas.read_chain(fragment):
            return True
        if time.monotonic() >= deadline:
            log.warning(
                "no round record of fragment=%d although peers are past round 0: starting anyway",
                fragment,
            )
            return False
        await asyncio.sleep(poll_s)  # a poll of the DHT, not a synchronisation
    return True
