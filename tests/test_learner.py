"""The learner loop's bookkeeping: the base a delta is taken against, and settling deltas
by the committed record of their round."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.data import learner_batches
from p2pdiloco.fragments import partition_fragments
from p2pdiloco.learner import Learner, rest_after
from p2pdiloco.learner_link import Outcome
from p2pdiloco.model import build_model
from p2pdiloco.state import GlobalState
from p2pdiloco.train import InnerTrainer


def make_learner(tiny_config, tiny_corpus, num_fragments: int = 1):
    """A learner whose `submit` records frames and hands back futures the test resolves."""
    model = build_model("tiny", seed=0, max_seq_len=tiny_config.model.seq_len)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = GlobalState(params, partition_fragments({n: p.numel() for n, p in params.items()}, num_fragments), tiny_config.outer)
    trainer = InnerTrainer(model, tiny_config.train, torch.device("cpu"))
    batches = learner_batches(tiny_corpus, 0, 1, 2, 32, seed=0)
    sent: list[tuple[int, int, bytes, Future]] = []

    def submit(fragment: int, target_round: int, frame: bytes) -> Future:
        future: Future = Future()
        sent.append((fragment, target_round, frame, future))
        return future

    learner = Learner("me", "run", tiny_config, trainer, batches, state, submit, [])
    return learner, state, sent


def test_a_delta_is_taken_against_the_base_the_learner_trained_from(tiny_config, tiny_corpus) -> None:
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    base_before = {n: t.clone() for n, t in state.fragment_params(0)[1].items()}
    learner.trainer.step(learner.batches)
    learner.progress.c_steps[0] = learner.progress.c_tokens[0] = 1
    # the global state moves on (an update applied) before the loop takes it over
    grad = {n: torch.full_like(t, 0.01) for n, t in base_before.items()}
    state.apply_update(0, 0, grad)
    learner.ship(0)
    (_, target, frame, _) = sent[0]
    msg = wire.decode_message(frame, wire.WireLimits())
    assert msg.meta["base_round"] == 0 and target == 0
    delta = compress.decode_tensors(msg.tensors)
    local = {n: p.detach() for n, p in learner.trainer.model.named_parameters()}
    for name, tensor in delta.items():
        expected = base_before[name] - local[name]
        assert torch.allclose(tensor, expected, atol=0.05), name


def test_merged_delta_is_booked_only_when_the_committed_record_lists_it(tiny_config, tiny_corpus) -> None:
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.progress.c_steps[0] = learner.progress.c_tokens[0] = 5
    learner.ship(0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "sync", 0.5))
    learner.collect_outcomes()
    assert learner.progress.rounds_contributed == 0, "a reply alone books nothing"
    learner.committed.put((0, 0, frozenset({"me", "other"})))
    learner.settle()
    assert learner.progress.rounds_contributed == 1 and learner.progress.tokens_contributed == 5
    # a rival record wins round 0 later: the delta is un-booked and sent again
    state.apply_update(0, 0, {n: torch.zeros_like(t) for n, t in state.fragment_params(0)[1].items()})
    learner.committed.put((0, 0, frozenset({"other"})))
    learner.settle()
    assert learner.progress.rounds_contributed == 0 and learner.progress.tokens_contributed == 0
    assert [t for (_, t, _, _) in sent] == [0, 1], "resent once, to the next round"


def test_booked_deltas_drop_their_tensors_once_too_stale_to_resend(tiny_config, tiny_corpus) -> None:
    """A booked delta is kept so a rival record taking its round can send it again; once
    its base is more than `max_staleness_rounds` behind, it could only be dropped, so only
    its counters stay. Bookings are bounded per fragment (they were bounded over all
    fragments by (fragment, round) order, which evicted fragment 0's newest first)."""
    from p2pdiloco.learner import BOOKED_PER_FRAGMENT, InFlight

    learner, state, _ = make_learner(tiny_config, tiny_corpus, num_fragments=2)
    zeros = {n: torch.zeros_like(t) for n, t in state.fragment_params(0)[1].items()}
    tensors = {"w": compress.make_codec("int8").encode(torch.ones(4))}
    limit = tiny_config.sync.max_staleness_rounds
    for round_id in range(BOOKED_PER_FRAGMENT + 4):
        item = InFlight(Future(), round_id, round_id, tokens=1, steps=1, tensors=dict(tensors))
        learner._book((0, round_id), item, +1)
        learner._book((1, round_id), InFlight(Future(), round_id, round_id, 1, 1, dict(tensors)), +1)
        state.apply_update(0, round_id, zeros)
    learner.settle()  # the loop settles every iteration, and prunes then
    current = state.round_of(0)
    rounds_0 = sorted(r for f, r in learner.booked if f == 0)
    assert len(rounds_0) == BOOKED_PER_FRAGMENT and rounds_0[-1] == current - 1
    assert len([k for k in learner.booked if k[0] == 1]) == BOOKED_PER_FRAGMENT
    for (fragment, round_id), item in learner.booked.items():
        if fragment == 0:
            assert bool(item.tensors) == (current - round_id <= limit), round_id
    # a rival taking a round whose delta is too stale un-books it and sends nothing
    assert learner.progress.rounds_contributed == 2 * (BOOKED_PER_FRAGMENT + 4)
    learner.committed.put((0, rounds_0[0], frozenset({"other"})))
    learner.settle()
    assert learner.progress.rounds_contributed == 2 * (BOOKED_PER_FRAGMENT + 4) - 1


def test_a_delta_merged_only_in_a_losing_update_is_resent(tiny_config, tiny_corpus) -> None:
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.progress.c_steps[0] = learner.progress.c_tokens[0] = 5
    learner.ship(0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "loser", 1.0))
    learner.collect_outcomes()
    state.apply_update(0, 0, {n: torch.zeros_like(t) for n, t in state.fragment_params(0)[1].items()})
    learner.committed.put((0, 0, frozenset({"winner"})))
    learner.settle()
    assert learner.progress.rounds_contributed == 0
    assert [t for (_, t, _, _) in sent] == [0, 1]


def test_the_loop_encodes_beside_the_training_thread_and_sends_when_done(tiny_config, tiny_corpus) -> None:
    """The loop hands a staged fragment to the encoder thread and goes on; the fragment is
    busy (not staged again) until the encoded delta was sent."""
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.trainer.step(learner.batches)
    learner.progress.c_steps[0] = learner.progress.c_tokens[0] = 1
    release, threads = threading.Event(), []
    encode = learner._encode

    def held_encode(staged):
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return encode(staged)

    learner._encode = held_encode
    learner.stage(0)
    learner.start_encoding()
    learner.send_encoded(block=False)
    assert sent == [] and 0 in learner.encoding, "the loop does not wait for the encoder"
    learner.stage(0)
    assert 0 not in learner.staged, "a fragment with the encoder is not staged again"
    release.set()
    learner.send_encoded(block=True)
    assert threads and threads[0].startswith("encoder") and len(sent) == 1
    assert 0 not in learner.encoding and 0 in learner.in_flight


def test_rest_keeps_work_to_the_compute_share() -> None:
    assert rest_after(0.3, 1.0) == 0.0
    assert rest_after(0.0, 0.5) == 0.0
    assert rest_after(0.3, 0.5) == pytest.approx(0.3)
    assert rest_after(0.1, 0.25) == pytest.approx(0.3)  # busy 0.1 of every 0.4 s


@pytest.mark.parametrize("share", [1.0, 0.25])
def test_the_loop_rests_to_its_compute_share_and_reports_its_wall_speed(
    tiny_config, tiny_corpus, share
) -> None:
    """A volunteer's "use a quarter of this machine": the loop rests three times as long as
    it works, and the step time it reports (which the synchronizer's grace window uses) is
    the wall time a step takes, rest included."""
    config = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, compute_share=share))
    learner, _, _ = make_learner(config, tiny_corpus)
    learner.run(threading.Event(), max_steps=6)
    p = learner.progress
    assert p.step == 6
    if share == 1.0:
        assert p.rest_s == 0.0
    else:
        assert p.rest_s >= 3 * p.train_s, "the rest covers at least 3x the inner steps' time"
        assert p.loop_s >= p.rest_s
        # the reported step time is the compute time / share: 4x a step's compute
        assert p.step_time_s >= 2 * p.train_s / p.step
