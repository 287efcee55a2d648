"""The learner loop: inner steps without a barrier, fragments shipped on schedule.

Runs on the peer's training thread. Sending a delta, waiting for the window and
receiving the result happen on the event loop (`learner_link`) while this loop keeps
taking inner steps. No computed step is lost silently: when a fragment's update has
been applied to the global state the loop puts it under all of its local progress
(rebase, the default), and takes a shipped delta's progress out of the model only once
the canonical record of its round lists it. A delta that no committed round holds is
folded into the next one (its steps stay local, the next claim carries them); a refused
one, or steps thrown away by `overwrite`/`mix`, are reported lost with a reason.

The bookkeeping is `protocol.deltas.DeltaBook` (pure: it decides, this loop moves the
parameters), the outgoing side `shipping.Shipper`, the on-receive rule `protocol.ledger`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress
from p2pdiloco.config import RunConfig
from p2pdiloco.protocol.deltas import (
    AMBIGUOUS,
    Decision,
    DeltaBook,
    Flip,
    InFlight,
    local_work_of,
    local_work_problem,
)
from p2pdiloco.protocol.fragments import fragments_due
from p2pdiloco.protocol.ledger import Claim, move_progress, take_over
from p2pdiloco.roles.shipping import Shipper, Submit
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.train import InnerTrainer, evaluate
from p2pdiloco.wire.messages import NoAnswer, Outcome, Reply

log = logging.getLogger(__name__)

ContributorsOf = Callable[[int, int], "Mapping[str, float] | frozenset[str] | None"]
"""Peers the canonical record of (fragment, round) lists (with their merge weights), or
None when no record is known."""


@dataclass
class LearnerProgress:
    """Everything the loop carries from one step to the next (a checkpoint restores it)."""

    step: int = 0
    tokens: int = 0
    rounds_contributed: int = 0
    tokens_contributed: int = 0
    steps_contributed: int = 0
    """Inner steps carried by this learner's deltas in committed rounds."""
    lost_steps: dict[str, int] = field(default_factory=dict)
    """Inner steps reported lost, by reason (refused, non_finite, overwrite, ...)."""
    last_weight: float = 0.0
    loss: float = 0.0
    eval_loss: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    status: str = "starting"
    train_s: float = 0.0
    """Seconds spent inside inner steps."""
    rest_s: float = 0.0
    """Seconds the loop rested to keep to `train.compute_share`."""
    loop_s: float = 0.0
    """Seconds the loop ran (inner steps plus everything else on this thread)."""
    latencies_s: list[float] = field(default_factory=list)
    """Send-to-result time of each contribution that got a result."""


def rest_after(busy_s: float, compute_share: float) -> float:
    """Seconds to rest after `busy_s` of work so that work is `compute_share` of the time."""
    if compute_share >= 1.0 or busy_s <= 0.0:
        return 0.0
    return busy_s * (1.0 - compute_share) / compute_share


class Learner:
    """One peer's training loop over its replica and the shared global state."""

    def __init__(
        self,
        peer_id: str,
        run: str,
        config: RunConfig,
        trainer: InnerTrainer,
        batches: Iterator[torch.Tensor],
        state: GlobalState,
        submit: Submit,
        eval_set: list[torch.Tensor],
        on_event: Callable[[dict], None] = lambda event: None,
        contributors_of: ContributorsOf = lambda fragment, round_id: None,
        round_unsettled: Callable[[int, int], bool] = lambda fragment, round_id: False,
    ) -> None:
        self.peer_id = peer_id
        self.config = config
        self.trainer = trainer
        self.batches = batches
        self.state = state
        self.eval_set = eval_set
        self.on_event = on_event
        self.contributors_of = contributors_of
        self.round_unsettled = round_unsettled
        """Whether the record of (fragment, round) settles nothing on the replica, which is
        still at that round (`ReplicaSync.round_unsettled`: its update held unverified, or
        unfetchable past `void_after_s`)."""
        self.progress = LearnerProgress()
        self.book = DeltaBook(state.num_fragments)
        """Every shipped delta and its fate; the work ledger of each fragment."""
        self.shipper = Shipper(
            peer_id, run, config, trainer, self.book, submit, self._sent, lambda: self.progress.step_time_s, on_event
        )
        self._params = dict(trainer.model.named_parameters())
        self.bases: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        """Per fragment, the global (round, parameters) the replica last took over: the
        base its delta is taken against (the global state may have moved on since)."""
        self.base_hashes: dict[int, str] = {}
        """Per fragment, the hash of that base: the replica moved when its hash differs (an
        update applied, or a repair that replaced the fragment at the same round)."""
        self.settled: queue.SimpleQueue[tuple[int, int, frozenset[str]]] = queue.SimpleQueue()
        """(fragment, round, contributors) of each round the replica passed, by its
        canonical record as read from the DHT; again when a rival record wins a round
        later. The one channel from the replica (`round_settled`)."""
        for fragment in range(state.num_fragments):
            self.bases[fragment] = state.fragment_params(fragment)
            self.base_hashes[fragment] = state.current_hash(fragment)
        self.restart_from_base(reason="")

    @property
    def feedback(self):
        """The error-feedback residuals of the lossy codec (None without): a checkpoint keeps them."""
        return self.shipper.feedback

    # --- the loop -----------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event,
        max_rounds: int | None = None,
        max_steps: int | None = None,
        rounds_reached: Callable[[], list[int]] | None = None,
        every_step: Callable[[], None] = lambda: None,
    ) -> None:
        """Train until `stop` is set, every fragment reached `max_rounds` (by our replica or,
        through `rounds_reached`, by the swarm's records), or `max_steps` inner steps."""
        rounds_reached = rounds_reached or (lambda: list(self.state.rounds))
        sync = self.config.sync
        # the warm start is for the run's first rounds: a learner that joins later skips it
        warm_steps = sync.warm_steps if max(self.state.rounds, default=0) == 0 else 0
        share = self.config.train.compute_share
        self.progress.status = "training"
        if self.eval_set:
            self.progress.eval_loss = self.evaluate_global()
            self.on_event(
                {
                    "event": "eval",
                    "rounds": list(self.state.rounds),
                    "eval_loss": self.progress.eval_loss,
                    "step": 0,
                }
            )
        loop_started = time.monotonic()
        while not stop.is_set():
            started = time.monotonic()
            self.run_step(warm_steps)

            # once in a while
            if self.progress.step % 10 == 0:
                loss = self.trainer.read_loss()  # the only place the loss leaves the device
                self.progress.loss = self.progress.loss if loss is None else loss
                self.on_event(
                    {
                        "event": "step",
                        "step": self.progress.step,
                        "loss": self.progress.loss,
                        "rounds": list(self.state.rounds),
                        **self.trainer.device_stats(),
                    }
                )

            every_step()  # the daemon's periodic work on this thread (checkpoints)
            rest = rest_after(time.monotonic() - started, share)
            if rest > 0.0:
                stop.wait(rest)
                self.progress.rest_s += rest

            # stop
            if max_rounds is not None and min(rounds_reached()) >= max_rounds:
                break
            if max_steps is not None and self.progress.step >= max_steps:
                break
        self.send_staged()
        finished = self.trainer.finish()  # a multi-process learner releases its other ranks
        if finished:
            self.on_event({"event": "trainer_finished", **finished})
        self.progress.loop_s = time.monotonic() - loop_started
        self.progress.status = "leaving"

    def run_step(self, warm_steps: int = 0) -> None:
        """One turn of the loop: an inner step, what is due shipped, results taken over."""
        sync, share = self.config.sync, self.config.train.compute_share
        started = time.monotonic()
        result = self.trainer.step(self.batches)
        step_s = time.monotonic() - started
        # the step's wall time includes the rest that follows it: that is how fast this
        # learner moves, which the synchronizer's grace window (Eq. 3) has to know
        self._count(result.tokens, step_s / share)
        self.progress.train_s += step_s
        # ship: send what the encoder finished, hand it what was staged last step (its
        # host copy ran beside this step's work on an accelerator), then stage the
        # fragments that are due now (and those whose ship waited for a decision)
        self._restart_non_finite(self.shipper.send_encoded(block=False))
        self.shipper.start_encoding()
        scheduled = fragments_due(
            self.progress.step, sync.inner_steps, sync.num_fragments, warm_steps, sync.warm_inner_steps
        )
        for fragment in sorted(set(scheduled) | self.book.due):
            self.stage(fragment)
        # results that arrived
        self.collect_outcomes()
        self.take_over_updates()

    def ship_remaining(self) -> None:
        """On leaving: ship the local work of every fragment not already on its way (the
        last round may still merge it; what it does not stays reported as local)."""
        for fragment in range(self.state.num_fragments):
            self.stage(fragment)
        self.send_staged()

    def wrap_up(self) -> None:
        """After the loop and the last answers: decide what the last answers decide."""
        self.collect_outcomes()
        self.take_over_updates()

    def _count(self, tokens: int, step_time_s: float) -> None:
        p = self.progress
        p.step += 1
        p.tokens += tokens
        self.book.count(tokens, p.step)
        p.step_time_s = step_time_s if p.step == 1 else 0.9 * p.step_time_s + 0.1 * step_time_s
        p.tokens_per_s = tokens / max(p.step_time_s, 1e-9)

    # --- ship a fragment ----------------------------------------------------------------

    def stage(self, fragment: int) -> None:
        """Start taking this fragment's delta against its base (`Shipper.stage`).

        One delta per base: while the previous one is undecided the fragment is marked due
        and shipped once it is decided (its steps wait, they are not lost). Nor is a delta
        taken against a base the replica has already passed: the take-over comes first."""
        book = self.book
        base_round, base = self.bases[fragment]
        if self.shipper.busy(fragment) or self.state.round_of(fragment) != base_round or book.closed_lately(
            fragment, base_round, time.monotonic(), self.config.sync.round_deadline_s
        ):
            # (closed lately: the swarm closed this base's round and the replica has not
            # followed, no holder answers yet: another delta to it would be late too, so
            # none is sent until the take-over moves the base, or a round deadline at most)
            book.due.add(fragment)
            return
        book.due.discard(fragment)
        if book.ledgers[fragment].steps > 0:
            self.shipper.stage(fragment, base_round, base)

    def send_staged(self, fragments: Iterable[int] | None = None) -> None:
        """Encode and send the staged fragments (all, or those in `fragments`) now."""
        self._restart_non_finite(self.shipper.send_staged(fragments))

    def _restart_non_finite(self, fragments: list[int]) -> None:
        """A diverged replica must not poison the swarm: its delta is dropped and the
        fragment restarts from the global state."""
        for fragment in fragments:
            log.warning("non-finite local delta fragment=%d: not sent; fragment reset to global", fragment)
            self.on_event({"event": "local_reset", "fragment": fragment})
            self.restart_from_base([fragment], reason="non_finite")

    def _sent(self, frame_bytes: int) -> None:
        """A contribution of `frame_bytes` went to the network."""
        self.progress.bytes_sent += frame_bytes
        self.progress.status = "syncing"

    # --- results that arrived -----------------------------------------------------------

    def collect_outcomes(self) -> None:
        """Read the synchronizers' answers; decide the deltas an answer decides."""
        for fragment, item in list(self.book.in_flight.items()):
            if item.reply or not item.future.done():
                continue
            try:
                outcome: Outcome = item.future.result()
            except Exception as exc:  # noqa: BLE001 - a network fault is a missed window
                log.warning("contribution failed fragment=%d error=%r", fragment, exc)
                outcome = Outcome(NoAnswer.FAILED, item.target_round, fragment, reason=repr(exc)[:200])
            item.reply, item.replied_at, item.weight = outcome.status, time.monotonic(), outcome.weight
            self.progress.bytes_received += outcome.bytes_received
            if outcome.latency_s > 0.0:
                self.progress.latencies_s.append(outcome.latency_s)
            self.on_event(
                {"event": "contributed", "fragment": fragment, "round": outcome.round, "status": outcome.status,
                 "weight": outcome.weight, "synchronizer": outcome.synchronizer, "reason": outcome.reason}
            )  # fmt: skip
            self.progress.status = "training"
            if outcome.status == Reply.REJECTED:
                # the swarm refused this work: folding it would send it again, and bigger
                self._decide(fragment, Decision.LOST, f"refused: {outcome.reason}"[:120])
            elif outcome.status != Reply.MERGED and outcome.status not in AMBIGUOUS:
                if outcome.status == Reply.LATE:
                    self.book.closed_round[fragment] = (item.target_round, time.monotonic())
                self._decide(fragment, Decision.FOLDED, outcome.status)
        # a synchronizer gone silent: folded once its round's deadline passed without a
        # record listing it (a record that lists it later moves it out again)
        for fragment in self.book.undecided_past(time.monotonic(), self.config.sync.round_deadline_s):
            self._decide(fragment, Decision.FOLDED, self.book.in_flight[fragment].reply)
        self._fold_unsettled_merges()
        self.settle()

    def _fold_unsettled_merges(self) -> None:
        """A delta answered `merged` by a record that settles nothing here (a synchronizer
        that commits and withholds its update: nobody serves it for `void_after_s`) goes
        back to the local work, to be resent to the round's re-run; were the update to
        arrive after all, the record settles it merged (`settle`)."""
        for fragment, item in list(self.book.in_flight.items()):
            if item.reply == Reply.MERGED and self.round_unsettled(fragment, item.target_round):
                log.warning("merged by a record nobody serves round=%d fragment=%d", item.target_round, fragment)
                self._decide(fragment, Decision.FOLDED, "record unfetchable")

    def _decide(self, fragment: int, kind: Decision, why: str = "", moved: bool = False) -> None:
        """Decide the delta on its way for `fragment` (`DeltaBook.decide`) and move what
        its fate moves: progress out of the model, counters, events."""
        progress = self.book.in_flight[fragment].progress  # decide drops it
        fate = self.book.decide(fragment, kind, moved)
        item = fate.item
        if fate.move_out is not None:
            move_progress(self._params, fate.move_out, -1)
            self.trainer.params_written(list(fate.move_out))
        if kind != Decision.MERGED:
            # what error feedback kept back of a delta nobody merged would count twice
            self.shipper.take_back(item, progress)
        if kind == Decision.LOST:
            self._report_lost(fragment, item.claim, why)
        elif kind == Decision.MERGED:
            self._count_merged(fragment, item, +1)
        else:
            self.on_event(
                {"event": "delta_folded", "fragment": fragment, "round": item.target_round,
                 "tokens": item.tokens, "steps": item.steps, "reason": why}
            )  # fmt: skip
        self.book.prune(list(self.state.rounds), self.config.sync.max_staleness_rounds)

    def _report_lost(self, fragment: int, claim: Claim, reason: str) -> None:
        """Steps that no update will carry: counted by reason and said (invariant 6)."""
        if claim.steps <= 0:
            return
        key = reason.split(":")[0]
        lost = self.progress.lost_steps
        lost[key] = lost.get(key, 0) + claim.steps
        log.warning("steps lost fragment=%d steps=%d reason=%s", fragment, claim.steps, reason)
        self.on_event(
            {"event": "steps_lost", "fragment": fragment, "steps": claim.steps, "tokens": claim.tokens,
             "first_step": claim.first_step, "last_step": claim.last_step, "reason": reason}
        )  # fmt: skip

    def round_settled(self, fragment: int, round_id: int, contributors: Iterable[str]) -> None:
        """The replica passed (fragment, round) and its canonical record lists
        `contributors` (any thread)."""
        self.settled.put((fragment, round_id, frozenset(contributors)))

    def settle(self) -> None:
        """Follow the canonical records of rounds already decided here: if a rival record
        wins a round, a delta booked merged in it comes back into the local progress, and
        a folded delta that the winner lists leaves it."""
        while True:
            try:
                fragment, round_id, contributors = self.settled.get_nowait()
            except queue.Empty:
                break
            flip = self.book.settle(fragment, round_id, contributors, self.peer_id)
            if flip is not None:
                self._apply_flip(fragment, round_id, flip)
        self.book.prune(list(self.state.rounds), self.config.sync.max_staleness_rounds)

    def _apply_flip(self, fragment: int, round_id: int, flip: Flip) -> None:
        """Move a decided delta's progress back into the model (+1) or out of it (-1)."""
        item, sign = flip.item, flip.sign
        if sign > 0:
            log.warning("a rival update took round=%d fragment=%d", round_id, fragment)
            self._count_merged(fragment, item, -1)
        else:
            log.warning("the record of round=%d fragment=%d lists a folded delta", round_id, fragment)
        if item.tensors:
            delta = compress.decode_tensors(item.tensors, finite=False)
            move_progress(self._params, {n: -t for n, t in delta.items()}, sign)
            self.trainer.params_written(list(delta))
            self.on_event(
                {"event": "delta_unmerged" if sign > 0 else "delta_merged_late", "fragment": fragment,
                 "round": item.target_round, "steps": item.steps, "tokens": item.tokens}
            )  # fmt: skip
        elif sign > 0:  # too stale to keep: its work is gone with the rival's round
            self._report_lost(fragment, item.claim, "rival_record")
        if sign < 0:
            self._count_merged(fragment, item, +1)

    def _count_merged(self, fragment: int, item: InFlight, sign: int) -> None:
        """Count (+1) or un-count (-1) a merged delta in the progress."""
        self.progress.rounds_contributed += sign
        self.progress.tokens_contributed += sign * item.tokens
        self.progress.steps_contributed += sign * item.steps
        if sign > 0:
            self.progress.last_weight = item.weight
            self.on_event(
                {"event": "delta_merged", "fragment": fragment, "round": item.target_round, "tokens": item.tokens,
                 "steps": item.steps, "first_step": item.first_step, "last_step": item.last_step,
                 "weight": item.weight}
            )  # fmt: skip

    def take_over_updates(self) -> None:
        """Take over fragments whose global state moved (an update applied, or a repair):
        the update goes under the local progress, and the delta shipped against the old
        base is decided by the canonical record of its round."""
        updated = {f for f, known in self.base_hashes.items() if self.state.current_hash(f) != known}
        if not updated:
            return
        self.load_global_into_model(sorted(updated))
        if 0 in updated and self.eval_set:
            self.progress.eval_loss = self.evaluate_global()
            self.on_event(
                {"event": "eval", "rounds": list(self.state.rounds), "eval_loss": self.progress.eval_loss,
                 "step": self.progress.step}
            )  # fmt: skip

    @torch.no_grad()
    def load_global_into_model(self, fragments: Iterable[int]) -> None:
        """On receive: rebase all local progress onto the new global (default), or
        overwrite / mix (the local progress is then reported lost); then decide the
        shipped delta whose round the replica has passed."""
        mode, alpha = self.config.sync.on_receive, self.config.sync.mix_alpha
        fragments = list(fragments)
        self.send_staged(fragments)  # a staged delta is taken before its fragment changes
        written = []
        for fragment in fragments:
            _old_round, old_base = self.bases[fragment]
            with self.state.lock:
                new_round, new_base = self.state.fragment_params(fragment)
                self.base_hashes[fragment] = self.state.current_hash(fragment)
            item = self.book.in_flight.get(fragment)
            merged = None
            if item is not None and item.target_round < new_round:
                listed = self.contributors_of(fragment, item.target_round)
                merged = item.reply == Reply.MERGED if listed is None else self.peer_id in listed
                if merged and isinstance(listed, Mapping):  # decided before the reply came
                    item.weight = float(listed[self.peer_id])
            leaving = item.progress if merged and item is not None else None
            take_over(self._params, old_base, new_base, mode, alpha, leaving)
            self.bases[fragment] = (new_round, new_base)
            written.extend(new_base)
            if merged is not None and item is not None:
                self._decide(fragment, Decision.MERGED if merged else Decision.FOLDED, item.reply or "not in the record", moved=True)
            if mode != "rebase":
                self._report_lost(fragment, self.book.ledgers[fragment].clear(), mode)
        self.trainer.params_written(written)

    @torch.no_grad()
    def local_work(self) -> dict:
        """What a checkpoint keeps so a restart loses only the steps since (`local_work_of`)."""
        return local_work_of(self._params, self.bases, self.book)

    @torch.no_grad()
    def restore_local_work(self, work: object) -> str | None:
        """Put checkpointed local work (`local_work`) back on the current bases; None when
        done, else why not (nothing is changed then: the local parameters are the base)."""
        self.restart_from_base(reason="")
        if self.config.sync.on_receive != "rebase":
            return "local work is kept only with sync.on_receive = rebase"
        problem = local_work_problem(work, self.bases)
        if problem:
            return problem
        assert isinstance(work, dict)
        written = []
        for fragment, saved in work.items():
            move_progress(self._params, saved["progress"], +1)
            written.extend(saved["progress"])
            ledger = self.book.ledgers[fragment]
            ledger.tokens, ledger.steps, ledger.last_step = saved["tokens"], saved["steps"], saved["last_step"]
        self.trainer.params_written(written)
        return None

    @torch.no_grad()
    def restart_from_base(self, fragments: Iterable[int] | None = None, reason: str = "restart") -> None:
        """Set the fragments' local parameters to their base (no local progress): at start,
        after a checkpoint restore (its local progress stood on a base this process does
        not know), or after a non-finite delta. Their local work is reported lost."""
        fragments = range(self.state.num_fragments) if fragments is None else list(fragments)
        written = []
        for fragment in fragments:
            for name, value in self.bases[fragment][1].items():
                self._params[name].copy_(value.to(self._params[name].device, self._params[name].dtype))
                written.append(name)
            lost = self.book.ledgers[fragment].clear()
            if reason:
                self._report_lost(fragment, lost, reason)
        self.trainer.params_written(written)

    def evaluate_global(self) -> float:
        """Held-out loss of the global parameters (on a copy, the replica is untouched)."""
        model = self.trainer.model
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        with self.state.lock, torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.state.params[name].to(p.device, p.dtype))
        loss = evaluate(model, self.eval_set, self.trainer.device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])
        self.trainer.params_written([])  # restored as they were: only XLA runs the copies now
        return loss
