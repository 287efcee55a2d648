"""Heartbeats: signed by the peer they speak for, strictly typed, expiring."""

from __future__ import annotations

import math

import msgpack
import pytest

from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import (
    HEARTBEATS,
    PROTOCOL_VERSION,
    Heartbeat,
    decode_heartbeat,
    learners,
    live_members,
    open_heartbeat,
    seal_heartbeat,
    synchronizer_candidates,
)

RUN = "t"
KEYS = {name: Identity.generate() for name in "ABCDEFG"}
ID = {name: key.peer_id for name, key in KEYS.items()}


def sealed(name: str, **fields) -> bytes:
    return seal_heartbeat(KEYS[name], RUN, Heartbeat(peer_id=ID[name], **fields))


def test_round_trip() -> None:
    beat = Heartbeat(
        peer_id=ID["A"], rounds=(3, 4), tokens_per_s=12.5, synchronizing=(1,), maddrs=("/ip4/1",), joined_at=99.5
    )
    assert decode_heartbeat(beat.encode()) == beat
    assert open_heartbeat(RUN, ID["A"], seal_heartbeat(KEYS["A"], RUN, beat)) == beat


def test_a_beat_carries_only_the_fields_that_differ_from_their_defaults() -> None:
    """Every peer reads a shard of beats per beat (and a newcomer all of them): the zeros of
    a learner's beat (audits, staleness, eval loss, certificates...) are not sent; the
    reader fills them in, and the protocol version is always there to be checked."""
    bare = Heartbeat(peer_id=ID["A"])
    assert set(msgpack.unpackb(bare.encode())) == {"peer_id", "protocol"}
    assert decode_heartbeat(bare.encode()) == bare
    busy = Heartbeat(peer_id=ID["A"], status="training", rounds=(0,), loss=2.5, client_mode=True)
    assert set(msgpack.unpackb(busy.encode())) == {"peer_id", "protocol", "status", "rounds", "loss", "client_mode"}
    assert decode_heartbeat(busy.encode()) == busy


def test_live_membership_drops_expired_foreign_unsigned_and_malformed_records() -> None:
    now = 100.0
    other_protocol = msgpack.packb({"peer_id": ID["C"], "protocol": PROTOCOL_VERSION + 1})
    records = {
        ID["A"]: (sealed("A"), 105.0),
        ID["B"]: (sealed("B"), 99.0),  # expired
        ID["C"]: (KEYS["C"].seal(HEARTBEATS.domain(RUN), other_protocol), 105.0),
        ID["D"]: (b"\xff\x00garbage", 105.0),
        ID["E"]: (sealed("A"), 105.0),  # A's signed beat replayed under E's subkey
        ID["F"]: (sealed("F", client_mode=True), 105.0),
        ID["G"]: (sealed("G", role="observer"), 105.0),
    }
    live, rejected = live_members(RUN, records, now)
    assert sorted(live) == sorted([ID["A"], ID["F"], ID["G"]])
    assert "incompatible protocol version" in rejected[ID["C"]]
    assert "sealed" in rejected[ID["D"]]
    assert "bad signature" in rejected[ID["E"]]
    assert synchronizer_candidates(live) == [ID["A"]]
    assert learners(live) == sorted([ID["A"], ID["F"]])


def test_a_forged_heartbeat_for_an_honest_peer_is_refused() -> None:
    """The attack seen: status=leaving, client_mode=true written for someone else."""
    forger = Identity.generate()
    forged = forger.seal(
        HEARTBEATS.domain(RUN), Heartbeat(peer_id=ID["A"], status="leaving", client_mode=True).encode()
    )
    live, rejected = live_members(RUN, {ID["A"]: (forged, 1e12)}, 0.0)
    assert not live and "bad signature" in rejected[ID["A"]]


def test_a_heartbeat_signed_for_another_run_is_refused() -> None:
    beat = seal_heartbeat(KEYS["A"], "other-run", Heartbeat(peer_id=ID["A"]))
    assert "bad signature" in open_heartbeat(RUN, ID["A"], beat)


def test_fake_ids_are_not_members() -> None:
    records = {f"fake{i}": (sealed("A"), 10.0) for i in range(1000)}
    live, rejected = live_members(RUN, records, 0.0)
    assert not live and len(rejected) == 1000
    assert all(r == "subkey is not a peer id" for r in rejected.values())


@pytest.mark.parametrize(
    "field, value",
    [
        ("rounds", [math.inf]),
        ("rounds", [-1]),
        ("rounds", ["3"]),
        ("rounds", 5),
        ("config_hash", 5),
        ("tokens_per_s", math.nan),
        ("client_mode", "yes"),
        ("status", "emperor"),
        ("inner_step", 1 << 63),
        ("certificates", [b"x" * 5000]),
        ("maddrs", ["a"] * 100),
    ],
)
def test_a_signed_heartbeat_with_a_bad_field_is_a_rejection_not_an_exception(field, value) -> None:
    data = msgpack.unpackb(Heartbeat(peer_id=ID["A"]).encode(), raw=False)
    data[field] = value
    raw = KEYS["A"].seal(HEARTBEATS.domain(RUN), msgpack.packb(data, use_bin_type=True))
    live, rejected = live_members(RUN, {ID["A"]: (raw, 10.0)}, 0.0, config_hash="abc")
    assert not live and ID["A"] in rejected


def test_learners_with_another_run_config_are_not_members() -> None:
    from p2pdiloco.config import config_hash, load_config

    ours = config_hash(load_config(None))
    theirs = config_hash(load_config(None, ["sync.inner_steps=7"]))
    # per-peer choices do not change the hash
    assert (
        config_hash(
            load_config(None, ["train.device='cpu'", "train.batch_size=3", "data.source='/x'"])
        )
        == ours
    )
    records = {
        ID["A"]: (sealed("A", config_hash=ours), 10.0),
        ID["B"]: (sealed("B", config_hash=theirs), 10.0),
    }
    live, rejected = live_members(RUN, records, 0.0, ours)
    assert list(live) == [ID["A"]] and "another run config" in rejected[ID["B"]]
