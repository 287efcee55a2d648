"""The memory census: large buffers reachable from a root, counted once, by owner path."""

from __future__ import annotations

import threading

import torch

from p2pdiloco.peer.census import CensusOnEvent, MiB, _cut, census, status_bytes


class Holder:
    def __init__(self) -> None:
        self.weights = {"a": torch.zeros(MiB // 4), "b": torch.zeros(MiB // 2)}  # 1 and 2 MiB
        self.view = self.weights["b"][:10]  # the same storage as b: counted once
        self.frames = [b"x" * (3 * MiB), bytearray(2 * MiB)]
        self.small = torch.zeros(10)  # under min_bytes


class Root:
    def __init__(self) -> None:
        self.holder = Holder()
        self.model = torch.nn.Linear(512, 1024)  # 2 MiB of weight
        self.model.weight.grad = torch.ones_like(self.model.weight)


def test_census_sums_each_buffer_once_under_the_first_path_that_reaches_it():
    root = Root()
    found = census(root, depth=2)
    by_owner = found["by_owner"]
    # b's storage is counted once, under the shorter path that reaches it (the view)
    assert by_owner[".holder.weights"] + by_owner[".holder.view"] == 3 * MiB
    assert by_owner[".holder.frames"] == 5 * MiB
    assert by_owner[".model._parameters"] == 4 * MiB  # the weight and its gradient
    assert ".holder.small" not in by_owner
    assert found["owned_bytes"] == sum(by_owner.values())


def test_gradients_are_found_through_their_parameter():
    root = Root()
    by_owner = census(root, depth=4)["by_owner"]
    assert by_owner[".model._parameters[weight].grad"] == 2 * MiB


def test_live_tensors_not_reachable_from_the_root_are_unowned():
    root = Root()
    hidden = torch.zeros(MiB)  # 4 MiB, held only by this frame
    found = census(root)
    assert found["unowned_tensor_bytes"] >= 4 * MiB
    del hidden


def test_a_container_changed_by_another_thread_does_not_break_the_walk():
    root = Root()
    root.holder.busy = {i: torch.zeros(1) for i in range(2000)}
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            root.holder.busy[10_000 + i % 50] = None
            root.holder.busy.pop(10_000 + (i + 25) % 50, None)
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(5):
            assert census(root, depth=2)["by_owner"][".holder.frames"] == 5 * MiB
    finally:
        stop.set()
        thread.join()


def test_paths_are_cut_to_depth_with_indices_folded():
    assert _cut(".parts.learner.bases[0][1]", 3) == ".parts.learner.bases"
    assert _cut(".store[3].payload", 2) == ".store[*]"
    assert _cut(".a[key].b", 2) == ".a[key]"


def test_rss_is_read_on_linux():
    assert (status_bytes() or 0) > 10 * MiB
    assert status_bytes("VmHWM") >= status_bytes("VmRSS") - MiB
    assert status_bytes(pid=2**30) is None  # no such process


def test_census_on_event_runs_one_at_a_time_and_drops_asks_meanwhile():
    events: list[dict] = []
    done = threading.Event()
    release = threading.Event()

    def emit(event: dict) -> None:
        release.wait(60)  # holds the census thread "busy" until the test lets it go
        events.append(event)
        done.set()

    taker = CensusOnEvent(Root(), emit, min_interval_s=0.0)
    assert taker.request(0, 1)
    assert not taker.request(0, 2)  # one is running: dropped
    release.set()
    assert done.wait(60)
    assert events[0]["round"] == 1 and events[0]["by_owner"][".holder.frames"] == 5 * MiB
    assert events[0]["rss_bytes"] > 0
    for _ in range(600):  # the thread clears its busy flag right after emitting
        if taker.request(0, 3):
            break
        threading.Event().wait(0.1)
    else:
        raise AssertionError("a census was refused after the last one finished")


def test_census_on_event_keeps_its_interval():
    taker = CensusOnEvent(Root(), lambda event: None, min_interval_s=3600.0)
    assert taker.request(0, 1)
    assert not taker.request(0, 2)
