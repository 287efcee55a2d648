"""An address book: the multiaddrs of peers this peer saw, kept beside its checkpoint.

A run whose only bootstrap node is gone goes on, but a peer restarted afterwards finds
no initial peer that answers. So a peer remembers whom it saw (`peers.json` in the
checkpoint directory) and tries them after its bootstrap nodes. Pure functions: no
network imports; the daemon decides when to remember and what to dial.

File format (version 1), proven peers first, then most recently seen first:

    {"version": 1, "peers": [{"peer_id": "12D3Koo...", "last_seen": 1700000000.0,
                              "addrs": ["/ip4/203.0.113.5/tcp/31337/p2p/12D3Koo..."],
                              "proven": true}]}

A peer is *proven* when the run's canonical chain named it (it synchronized or
contributed a round): its address was reachable. Anyone can publish a heartbeat with an
address, so a flood of free identities could otherwise fill the book and leave a
restarted peer nothing to dial but the attacker: proven peers are kept and dialed first,
and at most MAX_UNPROVEN peers that only showed a heartbeat are kept.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pdiloco.peer.checkpoint import atomic_write_bytes

log = logging.getLogger(__name__)

FILE_NAME = "peers.json"
VERSION = 1
MAX_ADDR_LEN = 512
MAX_ADDRESSES = 64
"""Most addresses `load_addresses` returns."""
MAX_PEERS = 64
"""Most peers the file keeps."""
MAX_UNPROVEN = 16
"""Most peers kept that only showed a heartbeat (the rest of MAX_PEERS is for proven ones)."""
MAX_ADDRS_PER_PEER = 8
MAX_AGE_S = 7 * 24 * 3600.0
"""A peer not seen for a week is forgotten."""
MAX_FILE_BYTES = 1 << 20
"""A bigger file is not ours (64 peers x 8 addresses x 512 chars is well under this)."""

_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
"""A base58 libp2p peer id (`12D3Koo...`, `Qm...`)."""
_MULTIADDR = re.compile(
    r"/(?P<proto>ip4|ip6|dns|dns4|dns6|dnsaddr)/(?P<host>[^/]+)"
    r"(?P<middle>(?:/[A-Za-z0-9._~-]+)*?)"
    r"/p2p/(?P<peer_id>[1-9A-HJ-NP-Za-km-z]+)"
)
_TRANSPORT = re.compile(r"/(?:tcp|udp)/(?P<port>[0-9]{1,5})(?:/.*)?")
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def _is_peer_id(text: Any) -> bool:
    return isinstance(text, str) and _PEER_ID.fullmatch(text) is not None


def peer_id_of(addr: str) -> str | None:
    """The peer id a multiaddr ends in (`.../p2p/<id>`), None if it names none."""
    head, sep, tail = addr.rpartition("/p2p/")
    return tail if sep and head and "/" not in tail and tail else None


def is_plausible_multiaddr(addr: Any) -> bool:
    """Whether `addr` looks like a dialable peer multiaddr: `/ip4|ip6|dns*/host/tcp|udp/port/
    .../p2p/<id>` (dnsaddr needs no port), at most MAX_ADDR_LEN characters.

    A syntax check without the multiaddr package: enough to refuse garbage from a file.
    """
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_LEN or not addr.isascii():
        return False
    match = _MULTIADDR.fullmatch(addr)
    if match is None or not _is_peer_id(match["peer_id"]):
        return False
    proto, host, middle = match["proto"], match["host"], match["middle"]
    try:
        if proto == "ip4":
            ipaddress.IPv4Address(host)
        elif proto == "ip6":
            ipaddress.IPv6Address(host)
        elif _HOSTNAME.fullmatch(host) is None:
            return False
    except ValueError:
        return False
    transport = _TRANSPORT.fullmatch(middle)
    if transport is None:
        return proto == "dnsaddr" and middle == ""
    return 0 < int(transport["port"]) <= 65535


def _read_records(directory: str | Path) -> list[dict[str, Any]]:
    """The file's valid peer records, most recent first; [] (and a warning) if it is bad."""
    path = Path(directory) / FILE_NAME
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("address book unreadable path=%s error=%r", path, exc)
        return []
    if len(raw) > MAX_FILE_BYTES:
        log.warning("address book too large path=%s max_bytes=%d", path, MAX_FILE_BYTES)
        return []
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        log.warning("address book malformed path=%s error=%r", path, exc)
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION:
        log.warning("address book malformed path=%s problem=%s", path, "not a version 1 object")
        return []
    peers = data.get("peers")
    if not isinstance(peers, list):
        log.warning("address book malformed path=%s problem=%s", path, "peers is not a list")
        return []
    records: list[dict[str, Any]] = []
    skipped = 0
    for entry in peers[:MAX_PEERS]:
        record = _valid_record(entry)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    if skipped:
        log.warning("address book entries skipped path=%s skipped=%d", path, skipped)
    return _ordered(records)


def _ordered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Proven peers first, each group most recently seen first."""
    return sorted(records, key=lambda r: (not r["proven"], -r["last_seen"]))


def _valid_record(entry: Any) -> dict[str, Any] | None:
    """A peer record with its valid addresses, or None if it is not one."""
    if not isinstance(entry, dict):
        return None
    peer_id, last_seen, addrs = entry.get("peer_id"), entry.get("last_seen"), entry.get("addrs")
    if not _is_peer_id(peer_id) or not isinstance(addrs, list):
        return None
    if isinstance(last_seen, bool) or not isinstance(last_seen, int | float):
        return None
    if not math.isfinite(last_seen):
        return None
    kept = [a for a in addrs if is_plausible_multiaddr(a) and peer_id_of(a) == peer_id]
    kept = list(dict.fromkeys(kept))[:MAX_ADDRS_PER_PEER]
    if not kept:
        return None
    return {"peer_id": peer_id, "last_seen": float(last_seen), "addrs": kept, "proven": entry.get("proven") is True}


def load_addresses(directory: str | Path, now: float | None = None) -> list[str]:
    """The remembered multiaddrs under `directory`: proven peers first, each group most
    recently seen first.

    [] when the file is missing, unreadable or malformed (logged, never raised); invalid
    entries are skipped. With `now`, peers not seen for MAX_AGE_S are left out.
    At most MAX_ADDRESSES.
    """
    addrs: list[str] = []
    for record in _read_records(directory):
        if now is not None and record["last_seen"] < now - MAX_AGE_S:
            continue
        addrs.extend(record["addrs"])
    return list(dict.fromkeys(addrs))[:MAX_ADDRESSES]


def _normalized_addrs(peer_id: str, addrs: Sequence[str]) -> list[str]:
    """`addrs` of `peer_id` as full multiaddrs (`/p2p/<id>` appended where missing)."""
    kept: list[str] = []
    for addr in addrs:
        if not isinstance(addr, str):
            continue
        if peer_id_of(addr) is None:
            addr = f"{addr.rstrip('/')}/p2p/{peer_id}"
        if is_plausible_multiaddr(addr) and peer_id_of(addr) == peer_id:
            kept.append(addr)
    return list(dict.fromkeys(kept))[:MAX_ADDRS_PER_PEER]


def remember_addresses(
    directory: str | Path,
    seen: Mapping[str, Sequence[str]],
    now: float,
    proven: Collection[str] = (),
) -> None:
    """Merge `seen` (peer id -> its multiaddrs, seen at `now`) into the address book;
    peers in `proven` (named by the canonical chain) are marked so, for good.

    A peer seen again gets its new addresses (its old ones may be stale ports) and
    last-seen time; peers unseen for MAX_AGE_S are dropped, at most MAX_PEERS kept,
    proven ones first, and of the others at most MAX_UNPROVEN, most recent first.
    Written atomically; a failure to write is logged, never raised (the address book is
    a fallback, not worth stopping a peer for).
    """
    merged = {record["peer_id"]: record for record in _read_records(directory)}
    for peer_id, addrs in seen.items():
        if not _is_peer_id(peer_id) or isinstance(addrs, str):
            continue
        kept = _normalized_addrs(peer_id, addrs)
        was_proven = peer_id in merged and merged[peer_id]["proven"]
        if kept:
            merged[peer_id] = {
                "peer_id": peer_id, "last_seen": float(now), "addrs": kept,
                "proven": was_proven or peer_id in proven,
            }  # fmt: skip
    records = _ordered([
        {**record, "last_seen": min(record["last_seen"], float(now))}  # no future times
        for record in merged.values()
        if record["last_seen"] >= now - MAX_AGE_S
    ])  # fmt: skip
    unproven = [r for r in records if not r["proven"]][:MAX_UNPROVEN]
    records = [r for r in records if r["proven"]] + unproven
    data = {"version": VERSION, "peers": records[:MAX_PEERS]}
    path = Path(directory) / FILE_NAME
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(data, indent=1).encode("utf-8") + b"\n")
    except OSError as exc:
        log.warning("address book not saved path=%s error=%r", path, exc)
        return
    log.debug("address book saved path=%s peers=%d", path, len(data["peers"]))


def initial_peers_with_fallback(
    bootstrap: Sequence[str], remembered: Sequence[str], own_peer_id: str
) -> list[str]:
    """The initial peers to dial: `bootstrap` first, then `remembered` addresses that are
    not already listed and not our own (a restarted peer keeps its id and may find itself).
    """
    peers = list(dict.fromkeys(bootstrap))
    listed = set(peers)
    for addr in remembered:
        if addr in listed or not is_plausible_multiaddr(addr):
            continue
        if own_peer_id and peer_id_of(addr) == own_peer_id:
            continue
        peers.append(addr)
        listed.add(addr)
    return peers
