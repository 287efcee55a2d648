"""Who synchronises a (round, fragment): rendezvous hashing over the live membership.

Every peer computes the same order from the same member ids, with no coordination; the
top peer is the synchronizer, the rest is the failover order. Because the score of a
peer depends only on (run, round, fragment, peer), the role rotates every round, the
fragments of one round spread over different peers, and a peer leaving only moves the
(round, fragment)s it was top for (highest-random-weight hashing, Thaler & Ravishankar).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def rendezvous_score(run: str, round_id: int, fragment_id: int, peer_id: str) -> int:
    """A peer's 64-bit score for a (run, round, fragment); higher wins."""
    digest = hashlib.blake2b(
        f"{run}\x00{round_id}\x00{fragment_id}\x00{peer_id}".encode(), digest_size=8
    )
    return int.from_bytes(digest.digest(), "big")


def rendezvous_order(
    salt: str, round_id: int, fragment_id: int, peer_ids: Iterable[str]
) -> list[str]:
    """`peer_ids` (each once) by rendezvous score for (salt, round, fragment), highest
    first, ties broken by peer id: an order every peer computes alike from the same ids."""
    unique = set(peer_ids)
    return sorted(unique, key=lambda p: (-rendezvous_score(salt, round_id, fragment_id, p), p))


def synchronizer_order(
    run: str, round_id: int, fragment_id: int, peer_ids: Iterable[str]
) -> list[str]:
    """Candidates in failover order: the synchronizer first (ties broken by peer id)."""
    return rendezvous_order(run, round_id, fragment_id, peer_ids)


