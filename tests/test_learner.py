"""The learner loop's bookkeeping: the base a delta is taken against, and settling deltas
by the committed record of their round."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.protocol.fragments import partition_fragments
from p2pdiloco.roles.learner import Learner, rest_after
from p2pdiloco.roles.learner_link import Outcome
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.data import learner_batches
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer


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


def local_params(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.trainer.model.named_parameters()}


def ship(learner, fragment: int) -> None:
    """Stage the fragment's delta and send it now (what the loop does over two steps)."""
    learner.stage(fragment)
    learner.send_staged([fragment])


def train(learner, steps: int = 1) -> None:
    """Inner steps, counted as the loop counts them."""
    for _ in range(steps):
        result = learner.trainer.step(learner.batches)
        learner._count(result.tokens, 0.1)


def apply(state: GlobalState, value: float = 0.01) -> None:
    """A committed update of the next round of fragment 0."""
    grad = {n: torch.full_like(t, value) for n, t in state.fragment_params(0)[1].items()}
    state.apply_update(0, state.round_of(0), grad)


def sent_delta(sent, index: int = -1) -> tuple[wire.Message, dict[str, torch.Tensor]]:
    msg = wire.decode_message(sent[index][2], wire.WireLimits())
    return msg, compress.decode_tensors(msg.tensors)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> bool:
    return all(torch.allclose(a[n], b[n], atol=atol) for n in b)


def with_codec(config, codec: str):
    return dataclasses.replace(config, compress=dataclasses.replace(config.compress, codec=codec))


def test_a_delta_is_never_taken_against_a_base_the_replica_has_passed(tiny_config, tiny_corpus) -> None:
    """The global state moves on before the loop took it over: the ship waits for the
    take-over, and the delta then carries all the local progress against the new base."""
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    base_before = {n: t.clone() for n, t in state.fragment_params(0)[1].items()}
    train(learner)
    local_before = local_params(learner)
    apply(state)
    ship(learner, 0)
    assert sent == [] and learner.book.due == {0}
    learner.take_over_updates()
    ship(learner, 0)
    msg, delta = sent_delta(sent)
    assert msg.meta["base_round"] == 1 and sent[0][1] == 1
    assert msg.meta["steps"] == 1
    expected = {n: base_before[n] - local_before[n] for n in delta}
    assert close(delta, expected, atol=0.05)


def test_merged_delta_is_booked_and_leaves_the_model_only_when_the_record_lists_it(
    tiny_config, tiny_corpus
) -> None:
    listed: dict[tuple[int, int], frozenset[str]] = {}
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.contributors_of = lambda f, r: listed.get((f, r))
    train(learner, 3)
    shipped_local = local_params(learner)
    ship(learner, 0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "sync", 0.5))
    learner.collect_outcomes()
    assert learner.progress.rounds_contributed == 0, "a reply alone books nothing"
    train(learner, 2)
    before = local_params(learner)
    listed[(0, 0)] = frozenset({"me", "other"})
    apply(state)
    learner.take_over_updates()
    p = learner.progress
    assert p.rounds_contributed == 1 and p.steps_contributed == 3
    assert learner.book.ledgers[0].steps == 2, "the two steps since the ship stay local, claimed"
    new_base = state.fragment_params(0)[1]
    # theta <- g + (theta - shipped): the steps since the ship, on the new global
    assert close(local_params(learner), {n: new_base[n] + before[n] - shipped_local[n] for n in new_base})


def test_a_second_update_before_the_next_ship_keeps_every_local_step(tiny_config, tiny_corpus) -> None:
    """Issue 26 A: the old fallback overwrote the replica when a second update came
    before the next ship, throwing every step since the last ship away."""
    listed = {(0, 0): frozenset({"me"}), (0, 1): frozenset({"other"})}
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.contributors_of = lambda f, r: listed.get((f, r))
    train(learner, 2)
    shipped_local = local_params(learner)
    ship(learner, 0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "sync", 1.0))
    train(learner, 1)
    learner.collect_outcomes()
    after_ship = local_params(learner)
    apply(state)
    learner.take_over_updates()
    first = state.fragment_params(0)[1]
    assert close(local_params(learner), {n: first[n] + after_ship[n] - shipped_local[n] for n in first})
    train(learner, 1)
    before = local_params(learner)
    apply(state, 0.02)  # another learner's round: nothing of ours shipped against it
    learner.take_over_updates()
    second = state.fragment_params(0)[1]
    assert close(local_params(learner), {n: second[n] + before[n] - first[n] for n in second})
    assert learner.book.ledgers[0].steps == 2 and learner.progress.lost_steps == {}


@pytest.mark.parametrize("status", ["late", "no_quorum", "behind"])
def test_a_delta_no_round_merged_is_folded_into_the_next_one(tiny_config, tiny_corpus, status) -> None:
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    events: list[dict] = []
    learner.on_event = events.append
    base_before = {n: t.clone() for n, t in state.fragment_params(0)[1].items()}
    train(learner, 2)
    ship(learner, 0)
    sent[0][3].set_result(Outcome(status, 0, 0, "sync"))
    learner.collect_outcomes()
    assert 0 not in learner.book.in_flight and (0, 0) in learner.book.folded
    assert [e["reason"] for e in events if e["event"] == "delta_folded"] == [status]
    train(learner, 1)
    local_before = local_params(learner)
    if status == "late":
        apply(state)  # the round closed without us
        learner.take_over_updates()
    ship(learner, 0)
    msg, delta = sent_delta(sent)
    assert msg.meta["steps"] == 3 and learner.book.ledgers[0].steps == 3, "one claim carries all three"
    assert close(delta, {n: base_before[n] - local_before[n] for n in delta}, atol=0.05)
    assert learner.progress.lost_steps == {}


def test_a_refused_delta_is_reported_lost_and_leaves_the_model(tiny_config, tiny_corpus) -> None:
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    events: list[dict] = []
    learner.on_event = events.append
    train(learner, 2)
    shipped_local = local_params(learner)
    ship(learner, 0)
    train(learner, 1)
    before = local_params(learner)
    sent[0][3].set_result(Outcome("rejected", 0, 0, "sync", reason="norm above the refusal"))
    learner.collect_outcomes()
    base = state.fragment_params(0)[1]
    assert close(local_params(learner), {n: base[n] + before[n] - shipped_local[n] for n in base})
    assert learner.progress.lost_steps == {"refused": 2} and learner.book.ledgers[0].steps == 1
    lost = [e for e in events if e["event"] == "steps_lost"]
    assert lost and lost[0]["steps"] == 2 and lost[0]["reason"].startswith("refused")


def first_round_merged(learner, state, sent) -> None:
    """Two steps, shipped to round 0, merged there, the update applied and taken over."""
    train(learner, 2)
    ship(learner, 0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "sync", 1.0))
    learner.collect_outcomes()
    apply(state)
    learner.take_over_updates()


@pytest.mark.parametrize("outcome", [Outcome("late", 1, 0, "sync"), Outcome("rejected", 1, 0, "sync", reason="x")])
def test_error_feedback_keeps_back_only_what_merged_deltas_left(tiny_config, tiny_corpus, outcome) -> None:
    """sparse2 sends 1.6% of a delta; error feedback keeps the rest for the next one. The
    residual of a delta nobody merged (folded: its work stays in the model and the next
    delta carries it; refused: its work is reported lost) leaves again, and what merged
    deltas left behind stays: reset, it lost their work; kept, it counted twice."""
    learner, state, sent = make_learner(with_codec(tiny_config, "sparse2"), tiny_corpus)
    learner.contributors_of = lambda f, r: {(0, 0): frozenset({"me"})}.get((f, r))
    first_round_merged(learner, state, sent)
    assert learner.progress.rounds_contributed == 1
    left = learner.feedback.state_dict()  # what the merged delta's bytes did not carry
    assert sum(bool(t.any()) for t in left.values()) > 0
    train(learner, 2)
    ship(learner, 0)
    assert any(not torch.equal(learner.feedback.residual(n), left[n]) for n in left)
    sent[1][3].set_result(outcome)
    learner.collect_outcomes()
    assert 0 not in learner.book.in_flight
    for name, residual in left.items():
        torch.testing.assert_close(learner.feedback.residual(name), residual, atol=1e-6, rtol=0)


def test_a_rival_record_moves_a_decided_delta_back_or_out(tiny_config, tiny_corpus) -> None:
    """Merged in a record that then lost its round: the progress comes back, claimed.
    Folded, and the record that wins lists it after all: it leaves the model, booked."""
    config = dataclasses.replace(tiny_config, compress=dataclasses.replace(tiny_config.compress, codec="fp32"))
    listed = {(0, 0): frozenset({"me"})}
    learner, state, sent = make_learner(config, tiny_corpus)
    learner.contributors_of = lambda f, r: listed.get((f, r))
    first_round_merged(learner, state, sent)
    settled = local_params(learner)
    _, delta = sent_delta(sent)
    learner.round_settled(0, 0, {"rival"})
    learner.settle()
    assert learner.progress.rounds_contributed == 0 and learner.book.ledgers[0].steps == 2
    assert close(local_params(learner), {n: settled[n] - delta[n] for n in delta})
    assert (0, 0) not in learner.book.booked
    # and the other way round: a folded delta whose round a record listing it wins
    train(learner, 1)
    ship(learner, 0)
    sent[-1][3].set_result(Outcome("late", 1, 0, "sync"))
    learner.collect_outcomes()
    assert (0, 1) in learner.book.folded
    folded_local = local_params(learner)
    _, delta = sent_delta(sent)
    learner.round_settled(0, 1, {"me"})
    learner.settle()
    assert learner.progress.rounds_contributed == 1 and learner.book.ledgers[0].steps == 0
    assert close(local_params(learner), {n: folded_local[n] + delta[n] for n in delta})


def test_overwrite_reports_the_local_steps_it_throws_away(tiny_config, tiny_corpus) -> None:
    config = dataclasses.replace(tiny_config, sync=dataclasses.replace(tiny_config.sync, on_receive="overwrite"))
    learner, state, _ = make_learner(config, tiny_corpus)
    train(learner, 3)
    apply(state)
    learner.take_over_updates()
    assert learner.progress.lost_steps == {"overwrite": 3} and learner.book.ledgers[0].steps == 0
    assert close(local_params(learner), state.fragment_params(0)[1])


def test_decided_deltas_drop_their_tensors_once_too_stale_to_matter(tiny_config, tiny_corpus) -> None:
    """Decided deltas are kept so a rival record can move them back or out; once their
    base is more than `max_staleness_rounds` behind only their claims stay. At most
    `KEPT_PER_FRAGMENT` a fragment are kept."""
    from p2pdiloco.protocol.deltas import KEPT_PER_FRAGMENT, InFlight

    learner, state, _ = make_learner(tiny_config, tiny_corpus, num_fragments=2)
    zeros = {n: torch.zeros_like(t) for n, t in state.fragment_params(0)[1].items()}
    tensors = {"w": compress.make_codec("int8").encode(torch.ones(4))}
    limit = tiny_config.sync.max_staleness_rounds
    for round_id in range(KEPT_PER_FRAGMENT + 4):
        for fragment in (0, 1):  # booked merged, as a decision does
            item = learner.book.booked[(fragment, round_id)] = InFlight(Future(), round_id, round_id, 1, 1, dict(tensors))
            learner._count_merged(fragment, item, +1)
        state.apply_update(0, round_id, zeros)
    learner.settle()  # the loop settles every iteration, and prunes then
    current = state.round_of(0)
    rounds_0 = sorted(r for f, r in learner.book.booked if f == 0)
    assert len(rounds_0) == KEPT_PER_FRAGMENT and rounds_0[-1] == current - 1
    assert len([k for k in learner.book.booked if k[0] == 1]) == KEPT_PER_FRAGMENT
    for (fragment, round_id), item in learner.book.booked.items():
        if fragment == 0:
            assert bool(item.tensors) == (current - round_id <= limit), round_id
    # a rival taking a round whose delta is too stale un-books it: its steps are reported lost
    total = 2 * (KEPT_PER_FRAGMENT + 4)
    assert learner.progress.rounds_contributed == total
    learner.round_settled(0, rounds_0[0], {"other"})
    learner.settle()
    assert learner.progress.rounds_contributed == total - 1
    assert learner.progress.lost_steps == {"rival_record": 1}


def test_the_loop_encodes_beside_the_training_thread_and_sends_when_done(tiny_config, tiny_corpus) -> None:
    """The loop hands a staged fragment to the encoder thread and goes on; the fragment is
    busy (not staged again) until the encoded delta was sent."""
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    train(learner)
    release, threads = threading.Event(), []
    encode = learner.shipper._encode

    def held_encode(staged):
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return encode(staged)

    learner.shipper._encode = held_encode
    learner.stage(0)
    learner.shipper.start_encoding()
    learner.shipper.send_encoded(block=False)
    assert sent == [] and 0 in learner.shipper.encoding, "the loop does not wait for the encoder"
    learner.stage(0)
    assert 0 not in learner.shipper.staged, "a fragment with the encoder is not staged again"
    release.set()
    learner.shipper.send_encoded(block=True)
    assert threads and threads[0].startswith("encoder") and len(sent) == 1
    assert 0 not in learner.shipper.encoding and 0 in learner.book.in_flight


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


@pytest.mark.parametrize("codec", ["int8", "sparse2"])
def test_a_restart_keeps_the_checkpointed_local_work_on_the_new_global(
    tiny_config, tiny_corpus, tmp_path, codec
) -> None:
    """Invariant 6 across a crash: the local work no committed round holds is
    checkpointed as progress against its base and rebased onto whatever global state the
    restarted learner finds; the delta on its way is left out (if it merges after the
    crash it is in the global, else it is lost with the crash). What error feedback held
    back is local work too: it is checkpointed and the next delta carries it."""
    from p2pdiloco.peer.checkpoint import load_learner, save_learner

    tiny_config = with_codec(tiny_config, codec)
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    train(learner, 3)
    shipped_local = local_params(learner)
    ship(learner, 0)  # 3 steps on their way, never answered: the process dies
    train(learner, 2)
    kept = {n: local_params(learner)[n] - shipped_local[n] for n in shipped_local}
    save_learner(tmp_path, learner, "hash")

    restarted, new_state, restarted_sent = make_learner(tiny_config, tiny_corpus)
    apply(new_state)  # the swarm moved on while it was down
    restarted.take_over_updates()
    assert load_learner(tmp_path, restarted, "hash")
    base = new_state.fragment_params(0)[1]
    assert close(local_params(restarted), {n: base[n] + kept[n] for n in base})
    assert restarted.book.ledgers[0].steps == 2 and restarted.book.ledgers[0].last_step == 5
    saved, loaded = learner.feedback.state_dict(), restarted.feedback.state_dict()
    assert set(saved) == set(loaded) == set(base)
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    # the next delta carries the local work and the residual: bytes + new residual = both
    ship(restarted, 0)
    _, delta = sent_delta(restarted_sent)
    for name in base:
        carried = delta[name] + restarted.feedback.residual(name)
        assert torch.allclose(carried, saved[name] - kept[name], atol=1e-6), name
    # a checkpoint from before local work was kept restores nothing local, and says so
    assert restarted.restore_local_work(None) is not None
    assert close(local_params(restarted), base)


def test_no_delta_goes_to_a_round_the_swarm_closed_while_the_replica_cannot_follow(
    tiny_config, tiny_corpus
) -> None:
    """A learner whose replica cannot fetch the update of a closed round (no holder) must
    not ship to that round again every cycle: each would be late (a bandwidth storm). It
    ships again once the take-over moves its base."""
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    train(learner, 2)
    ship(learner, 0)
    sent[0][3].set_result(Outcome("late", 0, 0, "sync"))
    learner.collect_outcomes()
    train(learner, 1)
    ship(learner, 0)
    assert len(sent) == 1 and 0 in learner.book.due, "held back: round 0 is closed, the replica is at 0"
    apply(state)  # the update arrives after all
    learner.take_over_updates()
    ship(learner, 0)
    assert len(sent) == 2 and sent[1][1] == 1



def test_a_delta_merged_by_a_record_nobody_serves_is_folded_resent_and_merged_once(
    tiny_config, tiny_corpus
) -> None:
    """A synchronizer answers "merged" and withholds its update (issue 28, items 4 and
    10): once the record settles nothing on the replica (`round_unsettled`: unfetchable
    past `void_after_s`), the delta is folded and its work goes with the next delta to the
    round's re-run, which books it merged once. Before, it stayed in flight for good."""
    unsettled: set[tuple[int, int]] = set()
    listed: dict[tuple[int, int], frozenset[str]] = {}
    learner, state, sent = make_learner(tiny_config, tiny_corpus)
    learner.round_unsettled = lambda f, r: (f, r) in unsettled
    learner.contributors_of = lambda f, r: listed.get((f, r))
    train(learner, 3)
    ship(learner, 0)
    sent[0][3].set_result(Outcome("merged", 0, 0, "withholder", 0.5))
    learner.collect_outcomes()
    train(learner, 1)
    ship(learner, 0)
    assert len(sent) == 1 and 0 in learner.book.in_flight, "booked merged: it waits for the take-over"
    unsettled.add((0, 0))  # nobody served the update for void_after_s
    learner.collect_outcomes()
    assert 0 not in learner.book.in_flight and learner.progress.rounds_contributed == 0
    ship(learner, 0)
    assert len(sent) == 2 and sent[1][1] == 0, "resent to the round (its re-run)"
    msg, _ = sent_delta(sent)
    assert msg.meta["steps"] == 4, "the folded work goes with it"
    sent[1][3].set_result(Outcome("merged", 0, 0, "next", 0.5))
    unsettled.clear()  # the re-run's record, which every replica follows
    learner.collect_outcomes()
    listed[(0, 0)] = frozenset({"me"})
    apply(state)
    learner.take_over_updates()
    learner.settle()
    p = learner.progress
    assert p.rounds_contributed == 1 and p.steps_contributed == 4
