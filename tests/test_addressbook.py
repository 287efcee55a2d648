"""The address book: remembered peers survive restarts, bad files never stop a peer."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from p2pdiloco.peer import addressbook
from p2pdiloco.peer.addressbook import (
    FILE_NAME,
    MAX_ADDR_LEN,
    MAX_ADDRESSES,
    MAX_AGE_S,
    MAX_PEERS,
    MAX_UNPROVEN,
    initial_peers_with_fallback,
    is_plausible_multiaddr,
    load_addresses,
    peer_id_of,
    remember_addresses,
)

BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
NOW = 1_700_000_000.0


def peer_id(n: int) -> str:
    """A distinct, well-formed libp2p peer id (52 base58 characters, like 12D3KooW...)."""
    digits = ""
    for _ in range(44):
        n, r = divmod(n, 58)
        digits += BASE58[r]
    return "12D3KooW" + digits


A, B, C, ME = peer_id(1), peer_id(2), peer_id(3), peer_id(99)


def addr(pid: str, host: str = "203.0.113.5", port: int = 31337) -> str:
    return f"/ip4/{host}/tcp/{port}/p2p/{pid}"


def write_book(directory: Path, data: Any) -> None:
    (directory / FILE_NAME).write_text(json.dumps(data))


# --- multiaddr validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        addr(A),
        f"/ip4/127.0.0.1/udp/4001/quic/p2p/{A}",
        f"/ip4/10.0.0.1/udp/4001/quic-v1/p2p/{A}",
        f"/ip6/::1/tcp/4001/p2p/{A}",
        f"/ip6/2001:db8::5/tcp/4001/p2p/{A}",
        f"/dns4/boot.example.org/tcp/443/wss/p2p/{A}",
        f"/dns/boot.example.org/tcp/31337/p2p/{A}",
        f"/dnsaddr/bootstrap.example.org/p2p/{A}",
        f"/ip4/198.51.100.1/tcp/4001/p2p/{B}/p2p-circuit/p2p/{A}",
        "/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
    ],
)
def test_plausible_multiaddrs(text: str) -> None:
    assert is_plausible_multiaddr(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage",
        addr(A)[1:],
        "/ip4/1.2.3.4/tcp/31337",  # no peer id
        f"/ip4/1.2.3.999/tcp/1/p2p/{A}",
        f"/ip4/localhost/tcp/1/p2p/{A}",
        f"/ip6/not:an:ip::zz/tcp/1/p2p/{A}",
        f"/ip4/1.2.3.4/tcp/0/p2p/{A}",
        f"/ip4/1.2.3.4/tcp/65536/p2p/{A}",
        f"/ip4/1.2.3.4/tcp/port/p2p/{A}",
        f"/ip4/1.2.3.4/p2p/{A}",  # no transport
        f"/dns4/bad_host!/tcp/1/p2p/{A}",
        f"/dns4/-bad.example/tcp/1/p2p/{A}",
        f"/memory/{A}/p2p/{A}",
        f"/unix/tmp/sock/p2p/{A}",
        "/ip4/1.2.3.4/tcp/1/p2p/0OIl-not-base58-peer-id-at-all-xxxxxxxxxxxx",
        "/ip4/1.2.3.4/tcp/1/p2p/12D3Koo",  # too short
        f"/ip4/1.2.3.4/tcp/1/p2p/{A}/",
        f"/ip4/1.2.3.4/tcp/1 /p2p/{A}",
        f"/ip4/1.2.3.4/tcp/1/p2p/{A}\n",
        f"/ip4/1.2.3.4/tcp/1/é/p2p/{A}",
        "/ip4/1.2.3.4/tcp/1" + "/ws" * 200 + f"/p2p/{A}",  # over MAX_ADDR_LEN
        None,
        42,
        [addr(A)],
        b"/ip4/1.2.3.4/tcp/1/p2p/x",
    ],
)
def test_implausible_multiaddrs(text: Any) -> None:
    assert not is_plausible_multiaddr(text)


def test_length_limit_is_inclusive() -> None:
    short = f"/ip4/1.2.3.4/tcp/1/x/p2p/{A}"
    longest = short.replace("/x/", "/" + "x" * (MAX_ADDR_LEN - len(short) + 1) + "/")
    assert len(longest) == MAX_ADDR_LEN
    assert is_plausible_multiaddr(longest)
    assert not is_plausible_multiaddr(longest.replace("/x", "/xx"))


def test_peer_id_of() -> None:
    assert peer_id_of(addr(A)) == A
    assert peer_id_of(f"/ip4/1.2.3.4/tcp/1/p2p/{B}/p2p-circuit/p2p/{A}") == A
    assert peer_id_of("/ip4/1.2.3.4/tcp/1") is None
    assert peer_id_of(f"/p2p/{A}/") is None


# --- load_addresses -----------------------------------------------------------------------


def test_missing_file_or_directory_is_empty(tmp_path: Path) -> None:
    assert load_addresses(tmp_path) == []
    assert load_addresses(tmp_path / "nowhere") == []


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,  # deep nesting
        b"NaN",
        b"[]",
        b"null",
        b'"peers"',
        b'{"peers": []}',  # no version
        b'{"version": 2, "peers": []}',
        b'{"version": "1", "peers": []}',
        b'{"version": 1, "peers": {}}',
        b'{"version": 1, "peers": "12D3KooW"}',
        b'{"version": 1}',
    ],
)
def test_malformed_file_is_empty_and_warns(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=addressbook.__name__):
        assert load_addresses(tmp_path) == []
    assert any("address book" in r.getMessage() for r in caplog.records)


def test_unreadable_file_is_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE_NAME).mkdir()  # a directory where the file should be
    with caplog.at_level(logging.WARNING, logger=addressbook.__name__):
        assert load_addresses(tmp_path) == []
    assert "unreadable" in caplog.text


def test_oversized_file_is_empty(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_bytes(b" " * (addressbook.MAX_FILE_BYTES + 1))
    assert load_addresses(tmp_path) == []


def test_bad_entries_are_skipped_good_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"peer_id": A, "last_seen": NOW, "addrs": [addr(A)]}
    bad_entries: list[Any] = [
        "not a dict",
        None,
        [addr(B)],
        {"peer_id": B, "last_seen": NOW},  # no addrs
        {"peer_id": B, "last_seen": NOW, "addrs": addr(B)},  # a string, not a list
        {"peer_id": B, "last_seen": "yesterday", "addrs": [addr(B)]},
        {"peer_id": B, "last_seen": True, "addrs": [addr(B)]},
        {"peer_id": B, "last_seen": None, "addrs": [addr(B)]},
        {"peer_id": B, "last_seen": "INFINITY", "addrs": [addr(B)]},
        {"peer_id": 5, "last_seen": NOW, "addrs": [addr(B)]},
        {"peer_id": "not-an-id", "last_seen": NOW, "addrs": [addr(B)]},
        {"peer_id": B, "last_seen": NOW, "addrs": [addr(C)]},  # someone else's address
        {"peer_id": B, "last_seen": NOW, "addrs": ["x" * 10_000, 7, None, {}]},
        {"peer_id": B, "last_seen": NOW, "addrs": []},
    ]
    write_book(tmp_path, {"version": 1, "peers": [*bad_entries, good]})
    (tmp_path / FILE_NAME).write_text(
        (tmp_path / FILE_NAME).read_text().replace('"INFINITY"', "Infinity")
    )
    with caplog.at_level(logging.WARNING, logger=addressbook.__name__):
        assert load_addresses(tmp_path) == [addr(A)]
    assert f"skipped={len(bad_entries)}" in caplog.text


def test_oversized_and_invalid_addresses_dropped_valid_kept(tmp_path: Path) -> None:
    long_one = "/ip4/1.2.3.4/tcp/1" + "/ws" * 200 + f"/p2p/{A}"
    entry = {"peer_id": A, "last_seen": NOW, "addrs": [long_one, "junk", addr(A), addr(A)]}
    write_book(tmp_path, {"version": 1, "peers": [entry]})
    assert load_addresses(tmp_path) == [addr(A)]


def test_most_recent_first_capped_and_aged(tmp_path: Path) -> None:
    peers = [
        {"peer_id": peer_id(i), "last_seen": NOW - i, "addrs": [addr(peer_id(i))]}
        for i in range(10, 0, -1)  # oldest first in the file
    ]
    write_book(tmp_path, {"version": 1, "peers": peers})
    assert load_addresses(tmp_path) == [addr(peer_id(i)) for i in range(1, 11)]
    stale = peer_id(500)
    old = {"peer_id": stale, "last_seen": NOW - MAX_AGE_S - 1, "addrs": [addr(stale)]}
    write_book(tmp_path, {"version": 1, "peers": [*peers, old]})
    assert load_addresses(tmp_path)[-1] == addr(stale)
    assert load_addresses(tmp_path, now=NOW) == [addr(peer_id(i)) for i in range(1, 11)]


def test_at_most_max_addresses(tmp_path: Path) -> None:
    peers = [
        {
            "peer_id": peer_id(i),
            "last_seen": NOW - i,
            "addrs": [addr(peer_id(i), port=p) for p in (1, 2, 3)],
        }
        for i in range(MAX_PEERS)
    ]
    write_book(tmp_path, {"version": 1, "peers": peers})
    loaded = load_addresses(tmp_path)
    assert len(loaded) == MAX_ADDRESSES
    assert loaded[:3] == [addr(peer_id(0), port=p) for p in (1, 2, 3)]


# --- remember_addresses -------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    remember_addresses(tmp_path, {A: [addr(A), f"/ip6/::1/tcp/5/p2p/{A}"]}, NOW)
    remember_addresses(tmp_path, {B: [addr(B, port=2)]}, NOW + 10)
    assert load_addresses(tmp_path) == [addr(B, port=2), addr(A), f"/ip6/::1/tcp/5/p2p/{A}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]  # no temp files left
    data = json.loads((tmp_path / FILE_NAME).read_text())
    assert data["version"] == 1
    assert [(p["peer_id"], p["last_seen"]) for p in data["peers"]] == [(B, NOW + 10), (A, NOW)]


def test_seen_again_updates_time_and_addresses(tmp_path: Path) -> None:
    remember_addresses(tmp_path, {A: [addr(A, port=1)], B: [addr(B)]}, NOW)
    remember_addresses(tmp_path, {A: [addr(A, port=2)]}, NOW + 5)
    assert load_addresses(tmp_path) == [addr(A, port=2), addr(B)]


def test_creates_directory_and_adds_missing_peer_id(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    remember_addresses(directory, {A: ["/ip4/1.2.3.4/tcp/7", "/ip4/1.2.3.4/tcp/8/"]}, NOW)
    assert load_addresses(directory) == [addr(A, "1.2.3.4", 7), addr(A, "1.2.3.4", 8)]


def test_invalid_seen_entries_ignored(tmp_path: Path) -> None:
    seen: dict[Any, Any] = {
        "not-a-peer-id": [addr(A)],
        B: addr(B),  # a bare string is not a list of addresses
        C: [addr(A), "junk", 5, "x" * 1000],  # none of them C's
        A: [addr(A)],
    }
    remember_addresses(tmp_path, seen, NOW)
    assert load_addresses(tmp_path) == [addr(A)]


def test_old_peers_dropped_and_at_most_max_peers(tmp_path: Path) -> None:
    remember_addresses(tmp_path, {A: [addr(A)]}, NOW - MAX_AGE_S - 1)
    remember_addresses(tmp_path, {B: [addr(B)]}, NOW - MAX_AGE_S + 1)
    remember_addresses(
        tmp_path, {peer_id(100 + i): [addr(peer_id(100 + i))] for i in range(3)}, NOW
    )
    loaded = load_addresses(tmp_path)
    assert addr(A) not in loaded and loaded[-1] == addr(B) and len(loaded) == 4

    many = {peer_id(1000 + i): [addr(peer_id(1000 + i))] for i in range(MAX_PEERS + 10)}
    remember_addresses(tmp_path, many, NOW + 1, proven=set(many))
    data = json.loads((tmp_path / FILE_NAME).read_text())
    assert len(data["peers"]) == MAX_PEERS
    assert all(p["last_seen"] == NOW + 1 for p in data["peers"])


def test_a_flood_of_sybil_heartbeats_never_pushes_out_the_peers_the_chain_proved(tmp_path: Path) -> None:
    """Issue 28, item 12: free identities with heartbeats filled the book, so a restarted
    peer dialed only the attacker. Proven peers stay, first; the others are capped."""
    honest = {peer_id(10 + i): [addr(peer_id(10 + i))] for i in range(3)}
    remember_addresses(tmp_path, honest, NOW, proven=set(honest))
    sybils = {peer_id(5000 + i): [addr(peer_id(5000 + i))] for i in range(300)}
    remember_addresses(tmp_path, sybils, NOW + 10)  # seen later, never in a record
    loaded = load_addresses(tmp_path)
    assert loaded[:3] == [addr(p) for p in sorted(honest, key=list(honest).index)]
    assert len(loaded) <= 3 + MAX_UNPROVEN


def test_future_times_clamped(tmp_path: Path) -> None:
    write_book(
        tmp_path,
        {"version": 1, "peers": [{"peer_id": A, "last_seen": NOW * 2, "addrs": [addr(A)]}]},
    )
    remember_addresses(tmp_path, {B: [addr(B)]}, NOW)
    data = json.loads((tmp_path / FILE_NAME).read_text())
    assert [p["last_seen"] for p in data["peers"]] == [NOW, NOW]


def test_malformed_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_bytes(b"{ broken")
    remember_addresses(tmp_path, {A: [addr(A)]}, NOW)
    assert load_addresses(tmp_path) == [addr(A)]


def test_write_failure_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    remember_addresses(tmp_path, {A: [addr(A)]}, NOW)

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with caplog.at_level(logging.WARNING, logger=addressbook.__name__):
        remember_addresses(tmp_path, {B: [addr(B)]}, NOW + 1)
    assert "not saved" in caplog.text
    monkeypatch.undo()
    assert load_addresses(tmp_path) == [addr(A)]  # the old book, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]


# --- initial_peers_with_fallback ----------------------------------------------------------


def test_bootstrap_first_then_remembered() -> None:
    bootstrap = [addr(A), addr(B)]
    remembered = [addr(C), addr(B), addr(ME), addr(C), "junk", addr(A, port=9)]
    assert initial_peers_with_fallback(bootstrap, remembered, ME) == [
        addr(A),
        addr(B),
        addr(C),
        addr(A, port=9),
    ]


def test_no_bootstrap_only_remembered() -> None:
    assert initial_peers_with_fallback([], [addr(ME), addr(A)], ME) == [addr(A)]


def test_bootstrap_kept_as_given_without_duplicates() -> None:
    bootstrap = [addr(B), addr(B), "/ip4/1.2.3.4/tcp/1/p2p/custom"]
    assert initial_peers_with_fallback(bootstrap, [], ME) == [addr(B), bootstrap[2]]


def test_nothing_to_dial() -> None:
    assert initial_peers_with_fallback([], [], ME) == []
    assert initial_peers_with_fallback((), (addr(ME),), ME) == []
