"""Checkpoints survive a writer killed at any point, and a bad file is reported, not raised.

The crash test runs this file as a script in a real child process that saves checkpoints
in a loop; the test SIGKILLs it at different points and then loads what is on disk.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pdiloco.errors import ConfigError
from p2pdiloco.peer import checkpoint
from p2pdiloco.peer.checkpoint import FILE_NAME, atomic_write_bytes, load_learner, save_learner

CONFIG_HASH = "test-config"
NUMEL = 512 * 1024
"""Float32 elements per tensor: two tensors make a checkpoint of about 4 MB."""
REPO_ROOT = Path(__file__).resolve().parents[1]


# --- a fake learner with exactly the attributes save_learner / load_learner use ------------


@dataclasses.dataclass
class FakeProgress:
    """Stands in for LearnerProgress: `step` mirrors the content counter."""

    step: int = 0
    tokens: int = 0
    status: str = "starting"
    latencies_s: list[float] = dataclasses.field(default_factory=list)


class TensorBag:
    """A model or optimizer stand-in: a dict of plain tensors behind (load_)state_dict."""

    def __init__(self, state: dict[str, torch.Tensor] | None = None) -> None:
        self.state: dict[str, torch.Tensor] = dict(state or {})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = dict(state)


@dataclasses.dataclass
class FakeTrainer:
    model: TensorBag
    optimizer: TensorBag
    step_index: int = 0


@dataclasses.dataclass
class FakeLearner:
    progress: FakeProgress
    trainer: FakeTrainer
    feedback: Any = None

    def local_work(self) -> dict:
        return {}

    def restore_local_work(self, work: object) -> str | None:
        return None


def content(counter: int) -> torch.Tensor:
    """The tensor a checkpoint with this counter holds: different for every counter."""
    generator = torch.Generator().manual_seed(counter)
    return torch.rand(NUMEL, generator=generator)


def crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.numpy().tobytes())


def make_learner(counter: int) -> FakeLearner:
    """A learner whose every part (model, optimizer, counters) encodes `counter`."""
    weights, moments = content(counter), content(counter + 1_000_000)
    model = TensorBag(
        {
            "w": weights,
            "counter": torch.tensor(counter),
            "checksum": torch.tensor(crc(weights), dtype=torch.int64),
        }
    )
    optimizer = TensorBag({"m": moments, "counter": torch.tensor(counter)})
    return FakeLearner(
        progress=FakeProgress(step=counter, tokens=counter * 10),
        trainer=FakeTrainer(model=model, optimizer=optimizer, step_index=counter),
    )


def blank_learner() -> FakeLearner:
    """A learner that holds no checkpoint yet; model keys/shapes as `make_learner`'s."""
    model = TensorBag(
        {"w": torch.zeros(NUMEL), "counter": torch.tensor(-1), "checksum": torch.tensor(0)}
    )
    return FakeLearner(
        progress=FakeProgress(step=-1),
        trainer=FakeTrainer(model=model, optimizer=TensorBag(), step_index=-1),
    )


def assert_consistent(learner: FakeLearner) -> int:
    """Every part of a loaded learner comes from one and the same save; returns its counter."""
    model = learner.trainer.model.state
    counter = int(model["counter"])
    assert crc(model["w"]) == int(model["checksum"])
    assert torch.equal(model["w"], content(counter))
    assert int(learner.trainer.optimizer.state["counter"]) == counter
    assert torch.equal(learner.trainer.optimizer.state["m"], content(counter + 1_000_000))
    assert learner.trainer.step_index == counter
    assert learner.progress.step == counter
    assert learner.progress.tokens == counter * 10
    return counter


def child_main(directory: str, first: int) -> None:
    """The writer process: save checkpoints with counters first, first+1, ... until killed."""
    counter = first
    while True:
        learner = make_learner(counter)
        print(f"saving {counter}", flush=True)
        save_learner(directory, learner, CONFIG_HASH)
        print(f"saved {counter}", flush=True)
        counter += 1


# --- the crash test -------------------------------------------------------------------------


class LineReader:
    """Reads a child's stdout lines on a thread so the test can wait with a deadline."""

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, deadline: float) -> str:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError("timed out waiting for the writer process")
        try:
            line = self.lines.get(timeout=remaining)
        except queue.Empty:
            raise AssertionError("timed out waiting for the writer process") from None
        if line is None:
            raise AssertionError("the writer process exited before it was killed")
        return line

    def rest(self, deadline: float) -> list[str]:
        """The lines left once the process is gone (up to the end of its output)."""
        lines: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the writer's output did not end") from None
            if line is None:
                return lines
            lines.append(line)


KILL_POINTS = (("saved", 1, 0.0), ("saving", 2, 0.0), ("saving", 2, 0.3), ("saving", 2, 0.6))
KILL_POINTS += (("saving", 2, 0.9), ("saving", 3, 1.2), ("saving", 2, 2.5))
"""(line, N, fraction): once the writer printed `<line> first+N`, SIGKILL it after that
fraction of its mean save time so far. `saved 1` is right after its second save; `saving 2`
plus 0..0.9 of a save lands inside the third save (serializing, writing, fsync, rename);
more than 1 lands between saves or in the next one."""


def run_writer_and_kill(directory: Path, first: int, kill_point: tuple[str, int, float]) -> int:
    """Start a writer at counter `first`, SIGKILL it at `kill_point` (see KILL_POINTS).

    Returns the counter of its last completed save (at least its second one).
    """
    verb, offset, fraction = kill_point
    target = (verb, first + offset)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    process = subprocess.Popen(
        [sys.executable, __file__, str(directory), str(first)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    last_saved: int | None = None
    started: dict[int, float] = {}
    durations: list[float] = []
    try:
        reader = LineReader(process.stdout)
        deadline = time.monotonic() + 120
        while True:
            line_verb, number = reader.next_line(deadline).split()
            if line_verb == "saving":
                started[int(number)] = time.monotonic()
            else:
                last_saved = int(number)
                durations.append(time.monotonic() - started[last_saved])
            if (line_verb, int(number)) == target:
                break
        if fraction > 0:  # where in the save the kill lands, not synchronisation
            time.sleep(fraction * sum(durations) / len(durations))
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
        for line in reader.rest(deadline):  # what it printed before the kill landed
            line_verb, number = line.split()
            if line_verb == "saved":
                last_saved = int(number)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert last_saved is not None and last_saved >= first + 1  # two saves completed
    return last_saved


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX")
@pytest.mark.timeout(600)
def test_sigkilled_writer_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """A writer SIGKILLed at several points, in one directory: what is on disk loads whole.

    Every round starts a fresh writer process in the directory the killed ones left
    (their temp files included) with counters of its own (1000, 2000, ...), so a loaded
    checkpoint says which process and which save it came from; its content is checked
    against the checksum and the counter stored in it.
    """
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / ".learner.crashed.tmp").write_bytes(b"half a checkpoint")
    for round_index, kill_point in enumerate(KILL_POINTS):
        first = 1000 * (round_index + 1)
        last_saved = run_writer_and_kill(directory, first, kill_point)
        learner = blank_learner()
        assert load_learner(directory, learner, CONFIG_HASH) is True
        counter = assert_consistent(learner)
        # The last completed save, or the one in progress if its rename had happened.
        assert counter in (last_saved, last_saved + 1), (kill_point, counter, last_saved)
        assert [p.name for p in directory.iterdir()] == [FILE_NAME]  # leftovers removed


# --- unit tests ---------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = save_learner(tmp_path / "a" / "b", make_learner(7), CONFIG_HASH)
    assert path == tmp_path / "a" / "b" / FILE_NAME
    learner = blank_learner()
    assert load_learner(path.parent, learner, CONFIG_HASH) is True
    assert assert_consistent(learner) == 7
    assert learner.progress.status == "starting"  # not restored
    assert sorted(p.name for p in path.parent.iterdir()) == [FILE_NAME]


def test_error_feedback_residuals_survive_a_restart(tmp_path: Path) -> None:
    """The residual is local work (what sparse2 has not sent yet): saved and restored
    bit for bit, with the model and optimizer of the same save."""
    from p2pdiloco import compress

    saved, codec = make_learner(3), compress.make_codec("sparse2")
    saved.feedback = compress.ErrorFeedback()
    generator = torch.Generator().manual_seed(3)
    delta = {"w": torch.randn(NUMEL, generator=generator), "b": torch.randn(10, generator=generator)}
    compress.encode_tensors(codec, delta, saved.feedback)
    save_learner(tmp_path, saved, CONFIG_HASH)
    learner = blank_learner()
    learner.feedback = compress.ErrorFeedback()
    assert load_learner(tmp_path, learner, CONFIG_HASH) is True
    assert assert_consistent(learner) == 3
    for name in delta:
        assert torch.equal(learner.feedback.residual(name), saved.feedback.residual(name))
    assert learner.feedback.residual("w").count_nonzero() > 0.98 * NUMEL  # 1.6% was sent


def test_save_fsyncs_file_and_directory_and_removes_stale_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / ".learner.abc123.tmp"
    stale.write_bytes(b"left by a killed writer")
    other = tmp_path / ".peers.abc.tmp"
    other.write_bytes(b"not ours to remove")
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}") if os.path.isdir("/proc") else True)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_learner(tmp_path, make_learner(1), CONFIG_HASH)
    assert len(synced) == 2  # the temp file, then the directory
    if os.path.isdir("/proc/self/fd"):
        assert synced == [False, True]
    assert not stale.exists()
    assert other.exists()


def test_stale_temp_files_are_removed_on_load(tmp_path: Path) -> None:
    stale = tmp_path / ".learner.x.tmp"
    stale.write_bytes(b"partial")
    assert load_learner(tmp_path, blank_learner(), CONFIG_HASH) is False
    assert not stale.exists()


def test_failed_save_removes_its_temp_file_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_learner(tmp_path, make_learner(3), CONFIG_HASH)

    def broken_save(obj: Any, file: Any) -> None:
        file.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        save_learner(tmp_path, make_learner(4), CONFIG_HASH)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]
    learner = blank_learner()
    assert load_learner(tmp_path, learner, CONFIG_HASH) is True
    assert assert_consistent(learner) == 3


def test_failed_rename_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_replace(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "peers.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_bytes_replaces_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "peers.json"
    atomic_write_bytes(target, b"first version, longer than the second")
    atomic_write_bytes(str(target), b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]


def test_atomic_write_bytes_needs_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "missing" / "peers.json", b"{}")


def test_unwritable_checkpoint_dir_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot create checkpoint dir"):
        save_learner(blocker / "ckpt", make_learner(1), CONFIG_HASH)


def _corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _corrupt_flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(0, 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _not_a_dict(path: Path) -> None:
    torch.save([1, 2, 3], path)


def _missing_keys(path: Path) -> None:
    torch.save({"config_hash": CONFIG_HASH, "model": {}}, path)


def _wrong_types(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    payload["progress"] = "not a dict"
    torch.save(payload, path)


def _wrong_shape(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    payload["model"]["w"] = torch.zeros(3)
    torch.save(payload, path)


def _unsafe_pickle(path: Path) -> None:
    torch.save({"config_hash": CONFIG_HASH, "model": FakeProgress()}, path)


def _other_run(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    payload["config_hash"] = "another run"
    torch.save(payload, path)


@pytest.mark.parametrize(
    "damage",
    [
        _corrupt_truncated,
        _corrupt_empty,
        _corrupt_garbage,
        _corrupt_flipped,
        _corrupt_directory,
        _not_a_dict,
        _missing_keys,
        _wrong_types,
        _wrong_shape,
        _unsafe_pickle,
        _other_run,
    ],
)
def test_bad_checkpoint_is_reported_and_learner_left_untouched(
    tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    save_learner(tmp_path, make_learner(5), CONFIG_HASH)
    damage(tmp_path / FILE_NAME)
    learner = blank_learner()
    before = {k: v.clone() for k, v in learner.trainer.model.state.items()}
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert load_learner(tmp_path, learner, CONFIG_HASH) is False
    assert caplog.records, "a bad checkpoint is logged"
    assert all(torch.equal(before[k], v) for k, v in learner.trainer.model.state.items())
    assert learner.trainer.optimizer.state == {}
    assert learner.trainer.step_index == -1
    assert learner.progress.step == -1


def test_missing_checkpoint_is_false(tmp_path: Path) -> None:
    assert load_learner(tmp_path / "nowhere", blank_learner(), CONFIG_HASH) is False


def test_real_optimizer_with_other_param_groups_is_rejected(tmp_path: Path) -> None:
    """A torch optimizer's groups are checked before the model is overwritten."""
    model = torch.nn.Linear(4, 2)
    saved = FakeLearner(
        progress=FakeProgress(step=9),
        trainer=FakeTrainer(model=model, optimizer=torch.optim.AdamW(model.parameters())),
    )
    save_learner(tmp_path, saved, CONFIG_HASH)
    fresh = torch.nn.Linear(4, 2)
    before = fresh.weight.detach().clone()
    groups = [{"params": [fresh.weight]}, {"params": [fresh.bias]}]
    learner = FakeLearner(
        progress=FakeProgress(),
        trainer=FakeTrainer(model=fresh, optimizer=torch.optim.AdamW(groups)),
    )
    assert load_learner(tmp_path, learner, CONFIG_HASH) is False
    assert torch.equal(fresh.weight, before)
    learner.trainer.optimizer = torch.optim.AdamW(fresh.parameters())
    assert load_learner(tmp_path, learner, CONFIG_HASH) is True
    assert torch.equal(fresh.weight, model.weight)
    assert learner.progress.step == 9


if __name__ == "__main__":  # the writer process of the crash test
    child_main(sys.argv[1], int(sys.argv[2]))
