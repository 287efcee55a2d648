"""A fragment's state moves in parts that fit the wire limits, and only as one whole state."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from p2pdiloco import wire
from p2pdiloco.config import OuterConfig
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire.state_transfer import (
    PartsAssembler,
    decode_part,
    encode_part,
    part_budget,
    split_parts,
)

RUN = "parts"
NAMES = ["a", "b", "c"]
SHAPES = {"a": (4, 3), "b": (5,), "c": (2, 2)}
SMALL = wire.WireLimits(max_total_elements=24)
"""A budget of 12 elements a part: the 3 tensors, their momentum and sums need 5 parts."""


def donor_state(rounds: int = 1) -> GlobalState:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}
    state = GlobalState(params, [NAMES], OuterConfig())
    for r in range(rounds):
        state.apply_update(0, r, {n: torch.full(s, 0.01 * (r + 1)) for n, s in SHAPES.items()})
    return state


def all_parts(state: GlobalState, limits: wire.WireLimits) -> list[bytes]:
    snapshot = state.export_fragment(0)
    frames, part = [], 0
    while (frame := encode_part(RUN, "donor", snapshot, part, limits)) is not None:
        frames.append(frame)
        part += 1
    return frames


def test_parts_keep_their_order_and_budget_and_a_big_tensor_goes_alone() -> None:
    assert split_parts({"x": 5, "y": 5, "z": 3, "w": 30, "v": 1}, 10) == [["x", "y"], ["z"], ["w"], ["v"]]
    assert part_budget(SMALL) == 12
    assert part_budget(wire.WireLimits()) == 1 << 24  # 64 MiB parts, not half a GiB


def test_a_state_sent_in_parts_arrives_whole_and_hashes_to_its_claim() -> None:
    donor = donor_state()
    frames = all_parts(donor, SMALL)
    assert len(frames) >= 4
    assembler = PartsAssembler(0, NAMES)
    for frame in frames:
        piece = decode_part(frame, RUN, 0, SHAPES, SMALL)
        assert not isinstance(piece, str), piece
        assert assembler.add(piece) == ""
    state = assembler.state()
    assert not isinstance(state, str)
    joiner = GlobalState({n: torch.zeros(s) for n, s in SHAPES.items()}, [NAMES], OuterConfig())
    assert joiner.import_verified(state) == donor.fragment_hash(0)


def test_parts_of_two_states_out_of_order_or_repeated_are_refused() -> None:
    first, later = all_parts(donor_state(1), SMALL), all_parts(donor_state(2), SMALL)

    def piece(frame):
        return decode_part(frame, RUN, 0, SHAPES, SMALL)

    mixed = PartsAssembler(0, NAMES)
    assert mixed.add(piece(first[0])) == ""
    assert mixed.add(piece(later[1])) == "the donor's state changed during the download"
    skipped = PartsAssembler(0, NAMES)
    assert "where 0 was asked for" in skipped.add(piece(first[1]))
    incomplete = PartsAssembler(0, NAMES)
    incomplete.add(piece(first[0]))
    assert incomplete.state() == "download incomplete"


@pytest.mark.parametrize("junk", [b"", b"\x00" * 64, b"P2PD" + b"\xff" * 100])
def test_junk_is_a_reason_not_an_exception(junk: bytes) -> None:
    assert isinstance(decode_part(junk, RUN, 0, SHAPES, SMALL), str)


def test_a_reply_naming_an_unknown_tensor_or_shape_is_refused() -> None:
    snapshot = donor_state().export_fragment(0)
    renamed = dataclasses.replace(snapshot, params={**snapshot.params, "zz": snapshot.params.pop("c")})
    frame = encode_part(RUN, "donor", renamed, 0, wire.WireLimits())
    assert "unknown tensor" in decode_part(frame, RUN, 0, SHAPES, wire.WireLimits())
    reshaped = dataclasses.replace(snapshot, params={**snapshot.params, "c": torch.zeros(4)})
    frame = encode_part(RUN, "donor", reshaped, 0, wire.WireLimits())
    assert isinstance(decode_part(frame, RUN, 0, SHAPES, wire.WireLimits()), str)


def test_a_joiner_downloads_every_part_from_a_donor_over_the_transport() -> None:
    async def body() -> None:
        network = MemoryNetwork()
        worker = ThreadPoolExecutor(1)
        donor_transport, joiner_transport = MemoryTransport(network), MemoryTransport(network)
        donor = donor_state(3)
        joiner = GlobalState({n: torch.zeros(s) for n, s in SHAPES.items()}, [NAMES], OuterConfig())
        syncs = [
            ReplicaSync(t, RUN, s, dict, SMALL, worker, void_after_s=30.0)
            for t, s in ((donor_transport, donor), (joiner_transport, joiner))
        ]
        for transport, sync in zip((donor_transport, joiner_transport), syncs, strict=True):
            await transport.start()
            await sync.start()
        state = await syncs[1].downloads.fetch(donor_transport.peer_id, 0, head=3)
        assert state is not None and state.round == 3
        assert joiner.import_verified(state) == donor.fragment_hash(0)
        assert syncs[1].bytes_received > 0
        assert not syncs[0].server._serving  # the donor's copy went with the last part
        # a peer still at genesis has nothing to give: a refusal, not a hang
        fresh_transport = MemoryTransport(network)
        fresh = GlobalState({n: torch.zeros(s) for n, s in SHAPES.items()}, [NAMES], OuterConfig())
        await fresh_transport.start()
        await ReplicaSync(fresh_transport, RUN, fresh, dict, SMALL, worker, void_after_s=30.0).start()
        assert await syncs[1].downloads.fetch(fresh_transport.peer_id, 0, head=3) is None
        worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))
