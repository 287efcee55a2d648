"""Heartbeats: round trip, expiry, protocol versions and malformed records."""

from __future__ import annotations

import msgpack

from p2pdiloco.membership import (
    PROTOCOL_VERSION,
    Heartbeat,
    decode_heartbeat,
    learners,
    live_members,
    synchronizer_candidates,
)


def test_round_trip() -> None:
    beat = Heartbeat(peer_id="A", rounds=(3, 4), tokens_per_s=12.5, synchronizing=(1,))
    assert decode_heartbeat(beat.encode()) == beat


def test_live_membership_drops_expired_foreign_and_malformed_records() -> None:
    now = 100.0
    records = {
        "A": (Heartbeat(peer_id="A").encode(), 105.0),
        "B": (Heartbeat(peer_id="B").encode(), 99.0),  # expired
        "C": (msgpack.packb({**{"peer_id": "C"}, "protocol": PROTOCOL_VERSION + 1}), 105.0),
        "D": (b"\xff\x00garbage", 105.0),
        "E": (Heartbeat(peer_id="X").encode(), 105.0),  # stored under someone else's subkey
        "F": (Heartbeat(peer_id="F", client_mode=True).encode(), 105.0),
        "G": (Heartbeat(peer_id="G", role="observer").encode(), 105.0),
    }
    live, rejected = live_members(records, now)
    assert sorted(live) == ["A", "F", "G"]
    assert "incompatible protocol version" in rejected["C"]
    assert "undecodable" in rejected["D"] or "not a map" in rejected["D"]
    assert "stored under" in rejected["E"]
    assert synchronizer_candidates(live) == ["A"]
    assert learners(live) == ["A", "F"]


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
        "A": (Heartbeat(peer_id="A", config_hash=ours).encode(), 10.0),
        "B": (Heartbeat(peer_id="B", config_hash=theirs).encode(), 10.0),
    }
    live, rejected = live_members(records, 0.0, ours)
    assert list(live) == ["A"] and "another run config" in rejected["B"]
