"""The record table behind the in-memory DHT and the libp2p transport's DHT."""

from __future__ import annotations

from p2pdiloco.transport.records import RecordTable, merge_latest


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
