"""The learner loop: inner steps without a barrier, fragments shipped on schedule.

Runs on the peer's training thread. Sending a delta, waiting for the window and
receiving the result happen on the event loop (`learner_link`) while this loop keeps
taking inner steps; when a fragment's update has been applied to the global state the
loop takes it over (rebase by default, keeping the steps since shipping; or overwrite, the
paper's choice, or mix) and resets that fragment's counters. A delta that came too late
is resent to the next round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.devices import StagedCopy
from p2pdiloco.fragments import fragments_due
from p2pdiloco.learner_link import Outcome
from p2pdiloco.messages import LATE, MERGED
from p2pdiloco.state import GlobalState
from p2pdiloco.train import InnerTrainer, evaluate

log = logging.getLogger(__name__)

Submit = Callable[[int, int, bytes], "Future[Outcome]"]
"""Hand a CONTRIBUTION frame (fragment, target round, frame) to the event loop."""


BOOKED_PER_FRAGMENT = 16
"""Bookings a learner keeps a fragment, to un-book one if a rival record takes its round."""


@dataclass
class InFlight:
    """A delta on its way: kept so a late one can be resent to the next round."""

    future: Future
    target_round: int
    base_round: int
    tokens: int
    steps: int
    tensors: dict[str, compress.EncodedTensor]
    resent: bool = False
    weight: float = 0.0
    """Merge weight the synchronizer reported (booked once the record settles it)."""


@dataclass
class Staged:
    """A fragment whose host copy is on its way: its delta is encoded and sent once it landed."""

    copy: StagedCopy
    base_round: int
    base: dict[str, torch.Tensor]
    tokens: int
    steps: int


@dataclass
class Encoded:
    """What the encoder thread made of a staged fragment (tensors None: non-finite delta)."""

    staged: Staged
    tensors: dict[str, compress.EncodedTensor] | None
    local: dict[str, torch.Tensor] | None
    """The shipped local parameters (kept for `on_receive = "rebase"`)."""


@dataclass
class LearnerProgress:
    """Everything the loop carries from one step to the next (a checkpoint restores it)."""

    step: int = 0
    tokens: int = 0
    c_tokens: list[int] = field(default_factory=list)
    """Tokens per fragment since that fragment was last received."""
    c_steps: list[int] = field(default_factory=list)
    """Inner steps per fragment since that fragment was last received."""
    rounds_contributed: int = 0
    tokens_contributed: int = 0
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
    ) -> None:
        self.peer_id = peer_id
        self.run_name = run
        self.config = config
        self.trainer = trainer
        self.batches = batches
        self.state = state
        self.submit = submit
        self.eval_set = eval_set
        self.on_event = on_event
        self.codec = compress.make_codec_from_config(config.compress)
        lossy = config.compress.codec not in ("fp32",)
        self.feedback = (
            compress.ErrorFeedback() if config.compress.error_feedback and lossy else None
        )
        num_fragments = state.num_fragments
        self.progress = LearnerProgress(c_tokens=[0] * num_fragments, c_steps=[0] * num_fragments)
        self.in_flight: dict[int, InFlight] = {}
        self.staged: dict[int, Staged] = {}
        """Fragments copied to the host last step, encoded once the next step was queued."""
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        """Takes deltas and encodes them beside the training thread: on an accelerator the
        loop keeps queuing steps meanwhile (a 150M fragment costs ~0.1 s of CPU)."""
        self.encoding: dict[int, Future[Encoded]] = {}
        """Fragments with the encoder, sent by the loop once their encoding is done."""
        self.received: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._shipped_local: dict[int, dict[str, torch.Tensor]] = {}
        self._params = dict(trainer.model.named_parameters())
        self.bases: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        """Per fragment, the global (round, parameters) the replica last took over: the
        base its delta is taken against (the global state may have moved on since)."""
        self.awaiting: dict[tuple[int, int], InFlight] = {}
        """Deltas a synchronizer reported merged, until the canonical record settles them."""
        self.committed: queue.SimpleQueue[tuple[int, int, frozenset[str]]] = queue.SimpleQueue()
        """(fragment, round, contributors) of each committed round the replica reached."""
        self.pending: dict[int, InFlight] = {}
        """Per fragment, a late delta waiting for its round to be committed here."""
        self.booked: dict[tuple[int, int], InFlight] = {}
        """The last deltas booked as merged, kept in case a rival record wins their round."""
        state.listeners.append(lambda fragment, round_id: self.received.put((fragment, round_id)))
        self.load_global_into_model(range(num_fragments))

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
            # every step
            started = time.monotonic()
            result = self.trainer.step(self.batches)
            step_s = time.monotonic() - started
            # the step's wall time includes the rest that follows it: that is how fast this
            # learner moves, which the synchronizer's grace window (Eq. 3) has to know
            self._count(result.tokens, step_s / share)
            self.progress.train_s += step_s

            # ship: send what the encoder finished, hand it what was staged last step (its
            # host copy ran beside this step's work on an accelerator), then stage the
            # fragments that are due now
            self.send_encoded(block=False)
            self.start_encoding()
            for fragment in fragments_due(
                self.progress.step, sync.inner_steps, sync.num_fragments, warm_steps, sync.warm_inner_steps
            ):
                self.stage(fragment)

            # results that arrived
            self.collect_outcomes()
            self.take_over_updates()
            self.retry_pending()

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

    def _count(self, tokens: int, step_time_s: float) -> None:
        p = self.progress
        p.step += 1
        p.tokens += tokens
        for fragment in range(len(p.c_tokens)):
            p.c_tokens[fragment] += tokens
            p.c_steps[fragment] += 1
        p.step_time_s = step_time_s if p.step == 1 else 0.9 * p.step_time_s + 0.1 * step_time_s
        p.tokens_per_s = tokens / max(p.step_time_s, 1e-9)

    # --- ship a fragment ----------------------------------------------------------------

    def ship(self, fragment: int) -> None:
        """Encode this fragment's delta against its global base and hand it to the network."""
        self.stage(fragment)
        self.send_staged([fragment])

    def stage(self, fragment: int) -> None:
        """Start copying this fragment to the host, with the base and counters its delta is
        taken against; `send_staged` encodes and sends it once the copy landed."""
        busy = fragment in self.in_flight or fragment in self.staged or fragment in self.encoding
        if busy or self.progress.c_steps[fragment] == 0:
            return  # the previous one is still on its way; the next schedule takes both
        base_round, base = self.bases[fragment]
        waiting = self.pending.get(fragment)
        if waiting is not None and waiting.base_round == base_round:
            # the new delta is taken against the same base: it carries the waiting one's
            # progress too, so sending both would count that progress twice
            del self.pending[fragment]
        copy = self.trainer.host.stage({n: self._params[n] for n in base})
        tokens, steps = self.progress.c_tokens[fragment], self.progress.c_steps[fragment]
        self.staged[fragment] = Staged(copy, base_round, base, tokens, steps)

    def send_staged(self, fragments: Iterable[int] | None = None) -> None:
        """Encode and send the staged fragments (all, or those in `fragments`) now."""
        self.start_encoding(fragments)
        self.send_encoded(fragments, block=True)

    def start_encoding(self, fragments: Iterable[int] | None = None) -> None:
        """Hand the staged fragments (all, or those in `fragments`) to the encoder thread."""
        chosen = self.staged.keys() if fragments is None else self.staged.keys() & set(fragments)
        for fragment in sorted(chosen):
            staged = self.staged.pop(fragment)
            self.encoding[fragment] = self.encoder.submit(self._encode, staged)

    def send_encoded(self, fragments: Iterable[int] | None = None, block: bool = False) -> None:
        """Send the fragments the encoder is done with (with `block`, wait for them)."""
        chosen = self.encoding.keys() if fragments is None else self.encoding.keys() & set(fragments)
        for fragment in sorted(chosen):
            if not (block or self.encoding[fragment].done()):
                continue
            encoded = self.encoding.pop(fragment).result()
            staged = encoded.staged
            if encoded.tensors is None:
                # A diverged replica must not poison the swarm: drop it and restart from global.
                log.warning(
                    "non-finite local delta fragment=%d: not sent; fragment reset to global",
                    fragment,
                )
                self.on_event({"event": "local_reset", "fragment": fragment})
                self.load_global_into_model([fragment])
                self.progress.c_tokens[fragment] = self.progress.c_steps[fragment] = 0
                continue
            if encoded.local is not None:
                self._shipped_local[fragment] = encoded.local
            item = InFlight(
                future=Future(),
                target_round=staged.base_round,
                base_round=staged.base_round,
                tokens=staged.tokens,
                steps=staged.steps,
                tensors=encoded.tensors,
            )
            self._send(fragment, item)

    def wait_encoding(self) -> None:
        """Wait until the encoder is idle (the error-feedback residuals are then settled)."""
        for future in list(self.encoding.values()):
            future.exception()

    def _encode(self, staged: Staged) -> Encoded:
        """Encoder thread: wait for the host copy, take the delta, check it, encode it."""
        local = staged.copy.wait()
        delta = {n: staged.base[n] - local[n] for n in staged.base}
        if not all(bool(torch.isfinite(t).all()) for t in delta.values()):
            return Encoded(staged, None, None)
        tensors = compress.encode_tensors(self.codec, delta, self.feedback)
        rebase = self.config.sync.on_receive == "rebase"
        return Encoded(staged, tensors, {n: t.clone() for n, t in local.items()} if rebase else None)

    def _send(self, fragment: int, item: InFlight) -> None:
        message = wire.Message(
            kind=wire.CONTRIBUTION,
            run=self.run_name,
            round=item.target_round,
            fragment=fragment,
            meta={
                "peer": self.peer_id,
                "base_round": item.base_round,
                "tokens": item.tokens,
                "steps": item.steps,
                "step_time_s": self.progress.step_time_s,
            },
            tensors=item.tensors,
        )
        frame = wire.encode_message(message)
        self.progress.bytes_sent += len(frame)
        item.future = self.submit(fragment, item.target_round, frame)
        self.in_flight[fragment] = item
        self.progress.status = "syncing"
        self.on_event(
            {
                "event": "shipped",
                "fragment": fragment,
                "round": item.target_round,
                "base_round": item.base_round,
                "tokens": item.tokens,
                "steps": item.steps,
            }
        )
        log.info(
            "shipped fragment=%d round=%d base=%d tokens=%d bytes=%d",
            fragment,
            item.target_round,
            item.base_round,
            item.tokens,
            len(frame),
        )

    # --- results that arrived -----------------------------------------------------------

    def collect_outcomes(self) -> None:
        """Book finished contributions; resend a late one once to the next round."""
        for fragment, item in list(self.in_flight.items()):
            if not item.future.done():
                continue
            del self.in_flight[fragment]
            try:
                outcome: Outcome = item.future.result()
            except Exception as exc:  # noqa: BLE001 - a network fault is a missed window
                log.warning("contribution failed fragment=%d error=%r", fragment, exc)
                continue
            self.progress.bytes_received += outcome.bytes_received
            if outcome.status in (MERGED, LATE):
                self.progress.latencies_s.append(outcome.latency_s)
            self.on_event(
                {
                    "event": "contributed",
                    "fragment": fragment,
                    "round": outcome.round,
                    "status": outcome.status,
                    "weight": outcome.weight,
                    "synchronizer": outcome.synchronizer,
                    "reason": outcome.reason,
                }
            )
            if outcome.status == MERGED:
                item.weight = outcome.weight
                self.awaiting[(fragment, item.target_round)] = item
                self.progress.status = "training"
            elif outcome.status == LATE:
                self.resend(fragment, item)
            else:
                self.progress.status = "training"
        self.settle()

    def resend(self, fragment: int, item: InFlight) -> None:
        """A delta that no committed round holds goes to the next round, once, if not too
        stale. If that round is not committed here yet (the window was still closing), the
        delta waits for it (`retry_pending`); if it can go nowhere, it is reported dropped."""
        next_round = self.state.round_of(fragment)
        stale = next_round - item.base_round > self.config.sync.max_staleness_rounds
        if item.resent or stale or not item.tensors:
            self._drop(fragment, item)
        elif next_round <= item.target_round or fragment in self.in_flight:
            self.pending[fragment] = item
        else:
            self.progress.status = "straggling"
            self.on_event({"event": "resent", "fragment": fragment, "round": item.target_round, "to": next_round})
            item.target_round, item.resent = next_round, True
            self._send(fragment, item)

    def _drop(self, fragment: int, item: InFlight) -> None:
        self.progress.status = "training"
        self.on_event({"event": "delta_dropped", "fragment": fragment, "round": item.target_round})

    def retry_pending(self) -> None:
        """Resend deltas that waited for their round to be committed here."""
        for fragment, item in list(self.pending.items()):
            if fragment in self.in_flight:
                continue
            if self.state.round_of(fragment) > item.target_round or (
                self.state.round_of(fragment) - item.base_round
                > self.config.sync.max_staleness_rounds
            ):
                del self.pending[fragment]
                self.resend(fragment, item)

    def settle(self) -> None:
        """Book merged deltas by the canonical record of their round (as the DHT holds it);
        resend those only a losing rival update merged, and un-book one whose round a
        rival took over after it was booked."""
        while True:
            try:
                fragment, round_id, contributors = self.committed.get_nowait()
            except queue.Empty:
                break
            key = (fragment, round_id)
            listed = self.peer_id in contributors
            item = self.awaiting.pop(key, None)
            if item is not None and listed:
                self._book(key, item, +1)
            elif item is not None:
                log.warning(
                    "delta not in the committed round fragment=%d round=%d: resending",
                    fragment, round_id,
                )
                self.resend(fragment, item)
            elif key in self.booked and not listed:
                log.warning("a rival update took round=%d fragment=%d: resending", round_id, fragment)
                self.resend(fragment, self._book(key, self.booked[key], -1))
        self._prune_booked()

    def _book(self, key: tuple[int, int], item: InFlight, sign: int) -> InFlight:
        """Count (+1) or un-count (-1) a merged delta; a counted one is kept in `booked`."""
        self.progress.rounds_contributed += sign
        self.progress.tokens_contributed += sign * item.tokens
        if sign > 0:
            self.progress.last_weight = item.weight
            self.booked[key] = item  # bounded by `settle`, which prunes after booking
        else:
            self.booked.pop(key, None)
        return item

    def _prune_booked(self) -> None:
        """Bound what booked deltas hold. A delta whose base is more than
        `max_staleness_rounds` behind its fragment can no longer be resent, so a rival
        taking its round only un-books it: its encoded tensors go (at `150m` one is 76 MB,
        and 16 were kept). At most `BOOKED_PER_FRAGMENT` bookings a fragment stay."""
        limit = self.config.sync.max_staleness_rounds
        kept: dict[int, int] = {}
        for key in sorted(self.booked, key=lambda k: -k[1]):  # newest rounds first
            fragment, item = key[0], self.booked[key]
            kept[fragment] = kept.get(fragment, 0) + 1
            if kept[fragment] > BOOKED_PER_FRAGMENT:
                del self.booked[key]
            elif item.tensors and self.state.round_of(fragment) - item.base_round > limit:
                item.tensors = {}

    def take_over_updates(self) -> None:
        """Take over fragments whose global update was applied; reset their counters."""
        updated = set()
        while True:
            try:
                fragment, _round = self.received.get_nowait()
            except queue.Empty:
                break
            updated.add(fragment)
        if not updated:
            return
        self.load_global_into_model(sorted(updated))
        for fragment in updated:
            self.progress.c_tokens[fragment] = 0
            self.progress.c_steps[fragment] = 0
        if 0 in updated and self.eval_set:
            self.progress.eval_loss = self.evaluate_global()
            self.on_event(
                {
                    "event": "eval",
                    "rounds": list(self.state.rounds),
                    "eval_loss": self.progress.eval_loss,
                    "step": self.progress.step,
                }
            )

    @torch.no_grad()
    def load_global_into_model(self, fragments) -> None:
        """On receive: rebase the progress since shipping (default), overwrite, or mix."""
        mode, alpha = self.config.sync.on_receive, self.config.sync.mix_alpha
        fragments = list(fragments)
        self.send_staged(fragments)  # a staged delta is taken before its fragment changes
        written = []
        for fragment in fragments:
            base_round, global_params = self.state.fragment_params(fragment)
            self.bases[fragment] = (base_round, global_params)
            shipped = self._shipped_local.pop(fragment, None)
            for name, value in global_params.items():
                param = self._params[name]
                target = value.to(param.device, param.dtype)
                if mode == "mix":
                    param.mul_(1 - alpha).add_(target, alpha=alpha)
                elif mode == "rebase" and shipped is not None:
                    progress_since_ship = param.detach() - shipped[name].to(
                        param.device, param.dtype
                    )
                    param.copy_(target + progress_since_ship)
                else:
                    param.copy_(target)
                written.append(name)
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
