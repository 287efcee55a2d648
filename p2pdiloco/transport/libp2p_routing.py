"""Kademlia's iterative lookup for the libp2p transport's records (on the trio thread).

`find_closest` finds the peers closest to a key (XOR distance of SHA-256 hashes, as in
Kademlia) anywhere in the swarm, not only among those this peer knows: it asks the
closest peers it knows for the closest peers *they* know, asks those it was told of, and
goes on until the `count` closest it has heard of have all answered or failed. Each
known peer's table holds more peers near itself than far from it (`SwarmPeers`' buckets),
so every answer halves the distance left, about: O(log N) rounds of questions for N
peers, with tables of O(log N) peers.

Why our own lookup and not py-libp2p's `kad_dht`: its `PeerRouting` walks the swarm only
as part of a `KadDHT` service that speaks `/ipfs/kad/1.0.0` (protobuf, one value per key
chosen by a validator), fills its own routing table from every peer that connects, with
no probe before a peer counts and no quarantine for one that failed, and hashes the peer
ids' bytes where our records hash their text. Our records are `{subkey: (value,
expiration)}` dictionaries checked with the run's rules where they are stored; mapping
them onto its values would mean a second protocol and a second table to keep honest. The
question "which peers do you know closest to this key?" rides instead on the record RPC
we already serve (`~records.get`, with its framing limits, deadlines and authenticated
callers), and the same answer carries the records, as Kademlia's FIND_VALUE does.

Every question has its own deadline (`per_peer_s`, well under the lookup's): a silent
peer costs one of those, in parallel with the others, never the whole lookup; a peer
named by another is asked (probed) before it counts, and one that fails is forgotten and
quarantined by `SwarmPeers`.
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable

import msgpack
import trio

from p2pdiloco.transport.base import TransportError
from p2pdiloco.transport.libp2p_peers import BUCKET_SIZE, SwarmPeers, key_digest

Ask = Callable[[str], Awaitable[list]]
"""One question to one peer: `await ask(peer_id)` returns the `[peer_id, [address, ...]]`
items the peer named, or raises one of QUERY_FAULTS."""
QUERY_FAULTS = (
    TransportError,
    TimeoutError,
    trio.TooSlowError,
    ValueError,
    TypeError,
    msgpack.UnpackException,
)
"""What a question to a peer that is gone, slow or lying raises."""
ALPHA = 3
"""Questions in flight while a lookup still finds closer peers (Kademlia's alpha)."""
MAX_QUERIES = 96
"""Questions one lookup asks at most: a liar naming fresh close ids (which then fail)
cannot keep it going."""


async def find_closest(
    key: str,
    peers: SwarmPeers,
    ask: Ask,
    count: int,
    per_peer_s: float,
    deadline_s: float,
    include_me: bool,
) -> list[str]:
    """The `count` peers closest to `key` that answered within `deadline_s` (this peer
    among them when `include_me` and it is that close), closest first.

    The closest unasked peers heard of so far are asked, ALPHA at a time while closer
    ones may still turn up, then all the rest of the `count` closest at once, each within
    `per_peer_s`; every answer names up to BUCKET_SIZE peers (so that a few dead ones
    among them do not starve the lookup when `count` is small). A peer that answers
    becomes known (`SwarmPeers.answered`, if its bucket has room); one that fails is
    counted (`SwarmPeers.failed`) and dropped from the lookup.
    """
    target = key_digest(key)

    def by_distance(peer: str) -> int:
        return key_digest(peer) ^ target

    heard: dict[str, list[str]] = {p: [] for p in peers.closest_known(key, max(count, BUCKET_SIZE))}
    """Peers this lookup may ask: their addresses if a peer named them ([]: known)."""
    asked: set[str] = set()
    done: set[str] = set()
    answered: list[str] = []

    async def question(peer: str, nursery: trio.Nursery) -> None:
        try:
            with trio.fail_after(per_peer_s):
                named = await ask(peer)
        except QUERY_FAULTS:
            heard.pop(peer, None)
            peers.failed(peer)
        else:
            answered.append(peer)
            peers.answered(peer)
            for item in named[:BUCKET_SIZE] if isinstance(named, list) else []:
                found = peers.named(item)
                if found is not None and found[0] not in heard and found[0] not in asked:
                    heard[found[0]] = found[1]
        done.add(peer)
        ask_next(nursery)

    def ask_next(nursery: trio.Nursery) -> None:
        top = heapq.nsmallest(count, heard, key=by_distance)
        # ALPHA at a time while closer peers may turn up; once the ALPHA closest heard of
        # have answered, the rest of the closest at once
        limit = count if all(p in done for p in top[:ALPHA]) else ALPHA
        in_flight = len(asked) - len(done)
        for peer in top:
            if in_flight >= limit or len(asked) >= MAX_QUERIES:
                break
            if peer in asked:
                continue
            asked.add(peer)
            in_flight += 1
            if heard[peer]:
                peers.hear(peer, heard[peer])  # so that the call can dial it
            nursery.start_soon(question, peer, nursery)

    with trio.move_on_after(deadline_s):
        async with trio.open_nursery() as nursery:
            ask_next(nursery)
    return heapq.nsmallest(count, answered + ([peers.me] if include_me else []), key=by_distance)


def parse_answer(raw: bytes) -> tuple[dict, list]:
    """(records, named peers) of a `~records.get` answer: `[records, peers]`, or a bare
    records dictionary (a peer that names none). Raises ValueError on anything else."""
    answer = msgpack.unpackb(raw, raw=False)
    if isinstance(answer, dict):
        return answer, []
    if (
        isinstance(answer, list)
        and len(answer) == 2
        and isinstance(answer[0], dict)
        and isinstance(answer[1], list)
    ):
        return answer[0], answer[1]
    raise ValueError("a records answer is [records, peers]")
