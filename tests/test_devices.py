"""Device plumbing of the inner loop: host staging, the loss kept on the device, and a
learner that ships a fragment one step after staging it. Runs on the CPU; the CUDA path
of the stager runs where a GPU is visible."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from p2pdiloco import compress, wire
from p2pdiloco.config import TrainConfig
from p2pdiloco.protocol.fragments import partition_fragments
from p2pdiloco.roles.learner import Learner
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.training.data import learner_batches
from p2pdiloco.training.devices import HostStager, device_stats
from p2pdiloco.training.model import build_model
from p2pdiloco.training.train import InnerTrainer


def stager_round_trip(device: torch.device) -> None:
    source = {
        "a": torch.arange(6.0, device=device).reshape(2, 3),
        "b": torch.ones(4, device=device),
    }
    stager = HostStager(device)
    staged = stager.stage(source)
    source["a"].add_(100.0)  # the next step overwrites the parameters at once
    host = staged.wait()
    assert staged.ready()
    assert host["a"].device.type == "cpu" and host["a"].dtype == torch.float32
    assert torch.equal(host["a"], torch.arange(6.0).reshape(2, 3)), "a copy, not a view"
    again = stager.stage(source).wait()
    assert again["a"].data_ptr() == host["a"].data_ptr(), "host buffers are reused"
    assert torch.equal(again["a"], torch.arange(6.0).reshape(2, 3) + 100.0)


def test_staging_on_the_cpu_copies_into_reused_buffers() -> None:
    stager_round_trip(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_on_cuda_copies_into_pinned_buffers_off_the_training_stream() -> None:
    stager_round_trip(torch.device("cuda"))
    staged = HostStager(torch.device("cuda")).stage({"x": torch.ones(8, device="cuda")})
    assert staged.done is not None and staged.wait()["x"].is_pinned()


def test_the_cpu_has_no_counters_to_watch() -> None:
    assert device_stats(torch.device("cpu")) == {}


def test_the_loss_stays_on_the_device_until_read_at_a_log_point() -> None:
    config = TrainConfig(device="cpu", batch_size=2, warmup_steps=1, total_steps=20)
    trainer = InnerTrainer(build_model("tiny", max_seq_len=16), config, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    batches = iter(lambda: torch.randint(0, 256, (2, 17), generator=generator), None)
    assert trainer.read_loss() is None
    losses = [float(trainer.step(batches).loss) for _ in range(3)]
    assert trainer.read_loss() == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert trainer.read_loss() is None, "a read resets the running sum"
    last = float(trainer.step(batches).loss)
    assert trainer.read_loss() == pytest.approx(last, rel=1e-6)


def test_a_staged_fragment_is_shipped_as_it_was_when_staged(tiny_config, tiny_corpus) -> None:
    model = build_model("tiny", seed=0, max_seq_len=tiny_config.model.seq_len)
    params = {n: p.detach() for n, p in model.named_parameters()}
    fragments = partition_fragments({n: p.numel() for n, p in params.items()}, 1)
    state = GlobalState(params, fragments, tiny_config.outer)
    trainer = InnerTrainer(model, tiny_config.train, torch.device("cpu"))
    batches = learner_batches(tiny_corpus, 0, 1, 2, 32, seed=0)
    sent: list[bytes] = []

    def submit(fragment: int, target_round: int, frame: bytes) -> Future:
        sent.append(frame)
        return Future()

    learner = Learner("me", "run", tiny_config, trainer, batches, state, submit, [])
    trainer.step(batches)
    learner._count(1, 0.1)
    at_stage = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    learner.stage(0)
    with torch.no_grad():  # the loop sends one step later: the replica has moved on
        for p in trainer.model.parameters():
            p.add_(1.0)
    assert not sent
    learner.send_staged()
    delta = compress.decode_tensors(wire.decode_message(sent[0], wire.WireLimits()).tensors)
    base = state.fragment_params(0)[1]
    for name, tensor in delta.items():
        assert torch.allclose(tensor, base[name] - at_stage[name], atol=0.05), name
    assert not learner.shipper.staged and 0 in learner.book.in_flight
