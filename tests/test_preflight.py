"""Preflight checks: the memory model, and one line a check that says what to do."""

from __future__ import annotations

import os
import shutil

import pytest

from p2pdiloco.config import load_config
from p2pdiloco.errors import PreflightError
from p2pdiloco.peer.preflight import (
    CLOCK_FAIL_S,
    Finding,
    GiB,
    address_scope,
    check_addresses,
    check_clock,
    check_device_memory,
    check_disk,
    check_memory,
    check_reachable,
    check_transport,
    exit_code,
    free_disk_bytes,
    local_findings,
    memory_need,
    need_of,
    preset_parameters,
    raise_if_fatal,
    writable,
)
from p2pdiloco.training.model import PRESETS, build_model, count_parameters
from p2pdiloco.transport.base import ClockReading


def test_the_parameter_count_is_the_models_without_building_it() -> None:
    for preset in ("tiny", "small"):
        assert preset_parameters(preset) == count_parameters(build_model(preset, max_seq_len=64))
    assert preset_parameters("150m") == 149_710_848  # docs/benchmarks.md, Memory
    assert preset_parameters("1b") == 1_130_983_424


def test_the_memory_model_is_the_benchmarked_one() -> None:
    shape = PRESETS["150m"]
    n = preset_parameters("150m")
    need = memory_need(
        n,
        2,
        1,
        1,
        shape.dim,
        shape.num_layers,
        shape.num_heads,
        on_accelerator=False,
        synchronizer=False,
    )
    # docs/benchmarks.md: learner ~ 0.4 GiB + N x (39 + 9/P): 6.5 GiB for 150m, P = 2
    assert need.host_bytes / GiB == pytest.approx(0.39 + n * (39.0234 + 4.5) / GiB, abs=0.05)
    assert 6.3 < need.host_bytes / GiB < 6.7
    full = memory_need(
        n,
        2,
        1,
        1,
        shape.dim,
        shape.num_layers,
        shape.num_heads,
        on_accelerator=False,
        synchronizer=True,
        contributions=8,
    )
    # plus the window: (N/P) x (1.016 M + 25), 2.3 GiB at M = 8
    assert (full.host_bytes - need.host_bytes) / GiB == pytest.approx(2.3, abs=0.1)
    gpu = memory_need(
        n,
        2,
        8,
        128,
        shape.dim,
        shape.num_layers,
        shape.num_heads,
        on_accelerator=True,
        synchronizer=False,
    )
    assert gpu.device_bytes > 16 * n and gpu.host_bytes == pytest.approx(
        need.host_bytes - 16 * n, rel=0.01
    )
    assert need.checkpoint_bytes == 24 * n


def test_memory_fails_when_the_machine_is_smaller_and_warns_when_busy() -> None:
    need = need_of(load_config(None, ["model.preset='small'"]), "cpu")
    assert check_memory("small", need, 64 * GiB, 60 * GiB).level == "ok"
    busy = check_memory("small", need, 64 * GiB, need.host_bytes // 2)
    assert busy.level == "warn" and "close other programs" in busy.advice
    small = check_memory("small", need, need.host_bytes // 2, need.host_bytes // 4)
    assert small.level == "fail" and "smaller model preset" in small.advice
    assert "GiB" in small.message and "small (10.0M parameters)" in small.message
    assert check_memory("small", need, None, None).level == "skip"


def test_device_memory_and_disk() -> None:
    need = need_of(load_config(None, ["model.preset='150m'"]), "cuda")
    assert check_device_memory("cpu", need_of(load_config(None, []), "cpu"), None).level == "skip"
    assert check_device_memory("cuda", need, 80 * GiB).level == "ok"
    tight = check_device_memory("cuda", need, 1 * GiB)
    assert tight.level == "fail" and "train.batch_size" in tight.advice
    assert check_disk("", need, None).level == "skip"
    assert check_disk("/ckpt", need, 100 * GiB).level == "ok"
    full = check_disk("/ckpt", need, need.checkpoint_bytes)  # one file fits, two do not
    assert full.level == "fail" and "--checkpoint-dir" in full.advice


def test_free_disk_is_read_from_the_nearest_existing_parent(tmp_path, monkeypatch) -> None:
    # the folder asked about is recorded, not the free bytes compared: other processes
    # write to the same disk between two readings (a test beside this one did, once)
    asked: list[str] = []
    real_usage = shutil.disk_usage

    def disk_usage(path):  # noqa: ANN001, ANN202 - shutil's own signature
        asked.append(str(path))
        return real_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    assert free_disk_bytes(str(tmp_path / "not" / "yet")) > 0
    assert asked == [str(tmp_path)]
    assert free_disk_bytes(str(tmp_path / "no-such" / "place")) is not None and len(asked) == 2


def test_a_checkpoint_folder_this_user_cannot_write_fails() -> None:
    need = need_of(load_config(None, ["model.preset='tiny'"]), "cpu")
    refused = check_disk("/data/ckpt", need, 10 * GiB, writable=False)
    assert (
        refused.level == "fail" and "cannot write" in refused.message and "chown" in refused.advice
    )


def test_writable_looks_at_the_nearest_existing_folder(tmp_path) -> None:
    assert writable(str(tmp_path / "not" / "yet"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway: nothing to see here
            pytest.skip("this user may write everywhere")
        assert not writable(str(locked / "ckpt"))
    finally:
        locked.chmod(0o700)


def reading(offset_s: float, rtt_s: float = 0.02, peer: str = "12D3KooWpeer") -> ClockReading:
    return ClockReading(peer, 1000.0, 1000.0 + rtt_s / 2 + offset_s, 1000.0 + rtt_s)


def test_clock_offset_is_ntps_and_the_shortest_round_trip_wins() -> None:
    assert reading(2.5).offset_s == pytest.approx(2.5) and reading(0, 0.4).error_s == pytest.approx(
        0.2
    )
    assert check_clock([reading(0.001)], 1).level == "ok"
    assert check_clock([reading(1.5)], 1).level == "warn"
    behind = check_clock([reading(10.0, 0.01), reading(0.0, 30.0)], 2)
    assert behind.level == "fail" and "10.00 s" in behind.message and "behind" in behind.message
    assert "timedatectl" in behind.advice
    ahead = check_clock([reading(-CLOCK_FAIL_S - 1)], 1)
    assert ahead.level == "fail" and "ahead of" in ahead.message
    # an offset inside the reading's error is not held against the clock
    assert check_clock([reading(CLOCK_FAIL_S + 0.5, 2.0)], 1).level != "fail"
    assert check_clock([], 0).level == "skip" and check_clock([], 3).level == "skip"


def test_addresses_say_who_can_dial() -> None:
    assert address_scope("/ip4/203.0.113.7/tcp/1/p2p/x") == "private"  # documentation range
    assert address_scope("/ip4/8.8.8.8/tcp/31337") == "public"
    assert address_scope("/ip4/192.168.1.4/tcp/31337") == "private"
    assert address_scope("/ip4/127.0.0.1/tcp/31337") == "loopback"
    assert address_scope("/dns4/example.org/tcp/31337") == "unknown"
    assert check_addresses(["/ip4/8.8.8.8/tcp/31337/p2p/x"], False).level == "ok"
    lan = check_addresses(["/ip4/192.168.1.4/tcp/31337/p2p/x"], False)
    assert lan.level == "warn" and "--announce-maddrs" in lan.advice
    local = check_addresses(["/ip4/127.0.0.1/tcp/31337/p2p/x"], False)
    assert local.level == "warn" and "--host 0.0.0.0" in local.advice
    assert check_addresses([], True).level == "ok"


def test_reachability_and_transport_lines() -> None:
    assert check_reachable("/ip4/8.8.8.8/tcp/1", "", False).level == "ok"
    closed = check_reachable("/ip4/8.8.8.8/tcp/1", "TCP connection refused", False)
    assert (
        closed.level == "fail" and "--client-mode" in closed.advice and "refused" in closed.message
    )
    assert check_reachable("", "", True).level == "skip"
    assert check_transport("hivemind", 2.0).level == "ok"
    assert check_transport("hivemind", 45.0).level == "warn"
    assert check_transport("hivemind", None, "boom").level == "fail"


def test_join_refuses_a_failed_check_with_one_line() -> None:
    findings = [Finding("memory", "ok", "fine"), Finding("disk", "fail", "full", "free some space")]
    with pytest.raises(PreflightError) as caught:
        raise_if_fatal(findings)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("preflight disk: full: free some space")
    assert "--skip-preflight" in message
    with pytest.raises(PreflightError) as caught:
        raise_if_fatal(findings, skippable=False)
    assert "--skip-preflight" not in str(caught.value)
    raise_if_fatal(findings[:1])
    assert exit_code(findings) == 1 and exit_code(findings[:1]) == 0


def test_local_findings_on_this_machine() -> None:
    findings = local_findings(load_config(None, ["model.preset='tiny'", "train.device='cpu'"]))
    assert [f.check for f in findings] == ["devices", "memory", "device memory", "disk"]
    assert findings[0].level == "ok" and "cpu" in findings[0].message
    assert findings[1].level in ("ok", "warn")  # a tiny model fits any machine that runs the tests
    missing = local_findings(load_config(None, ["model.preset='tiny'", "train.device='xla'"]))
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        assert missing[0].level == "fail" and "torch_xla" in missing[0].message
