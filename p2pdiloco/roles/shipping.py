"""A learner's outgoing deltas: take a fragment's delta against its base, encode it beside
the training thread, and hand the frame to the network.

Three stages, so an accelerator keeps queuing inner steps meanwhile: `stage` starts the
fragment's copy to the host (with the base and claim its delta is taken against);
`start_encoding` hands landed copies to the encoder thread (delta, finiteness check,
codec with error feedback; a 150M fragment costs ~0.1 s of CPU); `send_encoded` builds
the CONTRIBUTION frame and submits it. Each shipped delta enters the learner's
`DeltaBook` as the one in flight for its fragment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig
from p2pdiloco.protocol.deltas import DeltaBook, InFlight
from p2pdiloco.protocol.ledger import Claim, Params
from p2pdiloco.training.devices import StagedCopy
from p2pdiloco.training.train import InnerTrainer
from p2pdiloco.wire.messages import Outcome

log = logging.getLogger(__name__)

Submit = Callable[[int, int, bytes], "Future[Outcome]"]
"""Hand a CONTRIBUTION frame (fragment, target round, frame) to the event loop."""


@dataclass
class Staged:
    """A fragment whose host copy is on its way: its delta is encoded and sent once it landed."""

    copy: StagedCopy
    base_round: int
    base: dict[str, torch.Tensor]
    claim: Claim


@dataclass
class Encoded:
    """What the encoder thread made of a staged fragment (tensors None: non-finite delta)."""

    staged: Staged
    tensors: dict[str, compress.EncodedTensor] | None
    progress: Params | None
    """`local - base` of the shipped parameters (kept for `on_receive = "rebase"`)."""


class Shipper:
    """Stages, encodes and sends one learner's deltas."""

    def __init__(
        self,
        peer_id: str,
        run: str,
        config: RunConfig,
        trainer: InnerTrainer,
        book: DeltaBook,
        submit: Submit,
        on_sent: Callable[[int], None],
        step_time_s: Callable[[], float],
        on_event: Callable[[dict], None],
    ) -> None:
        self.peer_id = peer_id
        self.run_name = run
        self.config = config
        self.trainer = trainer
        self.book = book
        self.submit = submit
        self.on_sent = on_sent
        """Told the bytes of each frame sent."""
        self.step_time_s = step_time_s
        """The learner's step time now, announced in each contribution (the grace window)."""
        self.on_event = on_event
        self.codec = compress.make_codec_from_config(config.compress)
        lossy = config.compress.codec not in ("fp32",)
        self.feedback = compress.ErrorFeedback() if config.compress.error_feedback and lossy else None
        self._params = dict(trainer.model.named_parameters())
        self.staged: dict[int, Staged] = {}
        """Fragments copied to the host last step, encoded once the next step was queued."""
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        """Takes deltas and encodes them beside the training thread."""
        self.encoding: dict[int, Future[Encoded]] = {}
        """Fragments with the encoder, sent by the loop once their encoding is done."""

    def busy(self, fragment: int) -> bool:
        """Whether a delta of `fragment` is staged, encoding or on its way."""
        return fragment in self.book.in_flight or fragment in self.staged or fragment in self.encoding

    def stage(self, fragment: int, base_round: int, base: dict[str, torch.Tensor]) -> None:
        """Start copying the fragment to the host, with the base and claim its delta is
        taken against (the caller checked it may ship now)."""
        copy = self.trainer.host.stage({n: self._params[n] for n in base})
        self.staged[fragment] = Staged(copy, base_round, base, self.book.ledgers[fragment].claim())

    def send_staged(self, fragments: Iterable[int] | None = None) -> list[int]:
        """Encode and send the staged fragments (all, or those in `fragments`) now; the
        fragments whose delta was not finite (not sent)."""
        self.start_encoding(fragments)
        return self.send_encoded(fragments, block=True)

    def start_encoding(self, fragments: Iterable[int] | None = None) -> None:
        """Hand the staged fragments (all, or those in `fragments`) to the encoder thread."""
        chosen = self.staged.keys() if fragments is None else self.staged.keys() & set(fragments)
        for fragment in sorted(chosen):
            staged = self.staged.pop(fragment)
            self.encoding[fragment] = self.encoder.submit(self._encode, staged)

    def send_encoded(self, fragments: Iterable[int] | None = None, block: bool = False) -> list[int]:
        """Send the fragments the encoder is done with (with `block`, wait for them); the
        fragments whose delta was not finite (not sent: the learner restarts them)."""
        chosen = self.encoding.keys() if fragments is None else self.encoding.keys() & set(fragments)
        non_finite = []
        for fragment in sorted(chosen):
            if not (block or self.encoding[fragment].done()):
                continue
            encoded = self.encoding.pop(fragment).result()
            if encoded.tensors is None:
                non_finite.append(fragment)
                continue
            staged, claim = encoded.staged, encoded.staged.claim
            self._send(fragment, InFlight(
                future=Future(), target_round=staged.base_round, base_round=staged.base_round,
                tokens=claim.tokens, steps=claim.steps, tensors=encoded.tensors,
                first_step=claim.first_step, last_step=claim.last_step, progress=encoded.progress,
            ))  # fmt: skip
        return non_finite

    def take_back(self, item: InFlight, progress: Params | None) -> None:
        """A delta nobody merged (folded or refused): the error-feedback residuals of its
        tensors go back to what they were before it was encoded, so they hold only what
        merged deltas left behind (`ErrorFeedback.take_back`). `progress` is the delta's
        `local - base`; without it (`on_receive` other than rebase, where local progress
        is overwritten anyway) the residuals are dropped."""
        if self.feedback is None:
            return
        for name, encoded in item.tensors.items():
            if progress is None or self.feedback.residual(name) is None:
                self.feedback.reset(name)
            else:
                self.feedback.take_back(name, -progress[name], compress.decode_tensor(encoded))

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
        return Encoded(staged, tensors, {n: -t for n, t in delta.items()} if rebase else None)

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
                "step_time_s": self.step_time_s(),
                "first_step": max(item.first_step, 0),
                "last_step": max(item.last_step, 0),
            },
            tensors=item.tensors,
        )
        frame = wire.encode_message(message)
        self.on_sent(len(frame))
        item.future = self.submit(fragment, item.target_round, frame)
        self.book.in_flight[fragment] = item
        self.on_event(
            {
                "event": "shipped", "fragment": fragment, "round": item.target_round,
                "base_round": item.base_round, "tokens": item.tokens, "steps": item.steps,
                "first_step": item.first_step, "last_step": item.last_step,
            }
        )  # fmt: skip
        log.info(
            "shipped fragment=%d round=%d base=%d tokens=%d bytes=%d",
            fragment, item.target_round, item.base_round, item.tokens, len(frame),
        )
