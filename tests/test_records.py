"""The record table behind the in-memory DHT and the libp2p transport's DHT."""

from __future__ import annotations

from p2pdiloco.transport.records import (
    MAX_KEY_BYTES,
    MAX_OWNER_BYTES,
    RecordTable,
    make_room,
    merge_latest,
    order_of,
    owner_of,
    within_room,
)


def test_a_record_is_replaced_only_by_one_that_expires_later_and_expires_on_time() -> None:
    table = RecordTable()
    assert table.store("k", "a", b"one", expiration_time=110.0, now=100.0)
    assert not table.store("k", "a", b"older", expiration_time=105.0, now=100.0)
    assert not table.store("k", "a", b"same", expiration_time=110.0, now=100.0)
    assert table.store("k", "a", b"two", expiration_time=120.0, now=101.0)
    assert not table.store("k", "b", b"dead", expiration_time=99.0, now=100.0)
    assert table.get("k", now=102.0) == {"a": (b"two", 120.0)}
    assert table.get("k", now=120.0) == {}
    assert table.get("absent", now=0.0) == {}


def test_the_table_is_bounded_against_a_flood() -> None:
    table = RecordTable(max_keys=2, max_subkeys_per_key=3, max_value_bytes=8, max_key_bytes=16)
    assert not table.store("k", "a", b"x" * 9, 10.0, 0.0)  # too large
    assert all(table.store("k", s, b"v", 10.0, 0.0) for s in "abc")
    assert not table.store("k", "d", b"v", 10.0, 0.0)  # a fourth subkey
    assert table.store("k", "a", b"w", 11.0, 0.0)  # replacing one is fine
    assert table.store("k2", "a", b"v", 5.0, 0.0)
    assert not table.store("k3", "a", b"v", 10.0, 0.0)  # a third key
    assert table.store("k3", "a", b"v", 10.0, 6.0)  # once k2 has expired there is room
    assert table.store("k", "d", b"v", 20.0, 11.0)  # expired subkeys make room too
    assert table.store("k3", "b", b"x" * 8, 10.0, 6.0)
    assert not table.store("k3", "c", b"x" * 8, 10.0, 6.0)  # over the key's 16 bytes
    assert table.store("k3", "b", b"y" * 8, 11.0, 6.0)  # a replacement counts once


def test_answers_of_several_peers_merge_to_the_latest_record_per_subkey() -> None:
    found = {"a": (b"old", 10.0)}
    merge_latest(found, {"a": (b"new", 12.0), "b": (b"b", 5.0)})
    merge_latest(found, {"a": (b"stale", 11.0)})
    assert found == {"a": (b"new", 12.0), "b": (b"b", 5.0)}


# --- a key's room, shared among the peers that sign its records (issue 42, item 4) ----------

RECORD = 64 << 10  # the largest round record the rules let through


def test_one_signers_flood_of_valid_records_never_keeps_an_honest_commit_out() -> None:
    """The attack: ~190 records of 64 KiB (rounds ahead, one free key) filled the key's
    12 MiB, and every honest commit after was refused for the hour they lived."""
    table = RecordTable()
    for round_id in range(400):
        table.store("rounds", f"{round_id}/attacker", b"x" * RECORD, 3600.0, 0.0)
    for round_id in range(50):
        assert table.store("rounds", f"{round_id}/honest", b"h" * 900, 3600.0, 1.0)
    kept = table.get("rounds", 2.0)
    assert sum(s.endswith("/honest") for s in kept) == 50  # not one honest record lost
    assert sum(len(v) for v, _ in kept.values()) <= MAX_KEY_BYTES
    flood = sum(len(v) for s, (v, _) in kept.items() if s.endswith("/attacker"))
    assert flood <= MAX_OWNER_BYTES  # one key holds its share of the key at most


def test_a_flood_from_many_free_keys_costs_an_honest_signer_its_oldest_records_not_its_commit() -> None:
    table = RecordTable()
    for round_id in range(100):
        assert table.store("rounds", f"{round_id}/honest", b"h" * 900, 3600.0, 0.0)
    for n in range(400):  # one big record each: a Sybil per record
        table.store("rounds", f"{1000 + n}/sybil{n}", b"x" * RECORD, 3600.0, 0.0)
    assert table.store("rounds", "100/honest", b"h" * 900, 3601.0, 1.0)  # the next commit
    kept = table.get("rounds", 2.0)
    assert "100/honest" in kept and "99/honest" in kept  # the newest are kept
    assert sum(len(v) for v, _ in kept.values()) <= MAX_KEY_BYTES


def test_an_owner_keeps_the_records_that_expire_last_and_a_replay_cannot_push_them_out() -> None:
    table = RecordTable(max_per_owner=3)
    for round_id in (5, 6, 7):
        assert table.store("k", f"{round_id}/a", b"v", 10.0 + round_id, 0.0)
    assert not table.store("k", "4/a", b"v", 14.0, 0.0)  # replayed with its old expiry
    assert table.store("k", "8/a", b"v", 18.0, 0.0)  # its next commit: the first to expire goes
    assert table.store("k", "1/b", b"v", 10.0, 0.0)  # another owner is not touched
    assert sorted(table.get("k", 0.0)) == ["1/b", "6/a", "7/a", "8/a"]


def test_a_key_flooding_rounds_far_ahead_cannot_keep_its_own_next_commit_out() -> None:
    """By round, an owner kept its highest: a named key that signed 300 rounds ahead
    made every DHT node refuse its next real commit (older than all it kept), and its
    windows failed (a bench swarm lost 11 deltas in 30 s)."""
    table = RecordTable()
    for n in range(300):
        table.store("rounds", f"{1000 + n}/named", b"x" * 5000, 1800.0, 0.0)
    assert table.store("rounds", "10/named", b"h" * 900, 3601.0, 1.0)
    assert "10/named" in table.get("rounds", 2.0)


def test_a_full_key_of_one_record_owners_refuses_newcomers_and_drops_nobody() -> None:
    held = {f"peer{n}": (10, 5.0) for n in range(4)}  # heartbeats: one record per peer
    assert make_room(held, "peer9", 10, 9.0, max_bytes=40) is None
    assert make_room(held, "peer9", 10, 9.0, max_bytes=40, max_count=4) is None
    assert make_room(held, "peer1", 10, 9.0, max_bytes=40) == []  # a peer's own renewal fits


def test_owner_and_order_of_a_subkey() -> None:
    assert (owner_of("12/QmSigner"), order_of("12/QmSigner")) == ("QmSigner", 12)
    assert (owner_of("QmPeer"), order_of("QmPeer")) == ("QmPeer", 0)
    assert order_of("x/QmSigner") == 0 and order_of("9" * 40 + "/a") == 0


def test_hiveminds_storage_shares_a_keys_room_the_same_way() -> None:
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from p2pdiloco.transport.hivemind_dht import SharedRoomStorage

    storage = SharedRoomStorage()
    key, expires = DHTID.generate(source="rounds"), get_dht_time() + 3600
    for round_id in range(400):
        storage.store_subkey(key, f"{round_id}/attacker", b"x" * RECORD, expires)
    assert storage.store_subkey(key, "0/honest", b"h" * 900, expires)
    entries = storage.get(key).value
    assert sum(len(item.value) for _, item in entries.items()) <= MAX_KEY_BYTES
    assert entries.get("0/honest") is not None


def test_a_reader_bounds_an_answer_as_a_table_would_newest_first_owners_in_turn() -> None:
    """A stranger's DHT node answers with all it keeps: the reader goes on with each
    owner's newest records within its share, owners taking turns, before any signature
    is checked."""
    answer = {f"{r}/attacker": (b"x" * RECORD, 9.0) for r in range(400)}
    answer.update({f"{r}/sybil{r}": (b"x" * RECORD, 9.0) for r in range(1000, 1400)})
    answer.update({f"{r}/honest": (b"h" * 900, 9.0) for r in range(100)})
    kept = within_room(answer)
    assert sum(len(v) for v, _ in kept.values()) <= MAX_KEY_BYTES
    assert sum(len(v) for s, (v, _) in kept.items() if s.endswith("/attacker")) <= MAX_OWNER_BYTES
    alone = within_room({s: r for s, r in answer.items() if "sybil" not in s})
    assert "399/attacker" in alone and "0/attacker" not in alone  # an owner's newest first
    assert {f"{r}/honest" for r in range(40, 100)} <= set(kept)  # owners in turn, small first
    small = {f"{r}/a": (b"v", 9.0) for r in range(10)}
    assert within_room(small) == small
    assert list(within_room(small, max_per_owner=3)) == ["9/a", "8/a", "7/a"]
