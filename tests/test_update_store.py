"""The update store is bounded by count and by bytes, so a big model's peer does not hold
dozens of full-size updates (a `150m` update with P = 2 is ~150 MB held)."""

from __future__ import annotations

import asyncio

from test_commit import scenario

from p2pdiloco import compress
from p2pdiloco.wire.updates import MIN_KEPT_PER_FRAGMENT, Update, UpdateStore


def update(round_id: int, fragment: int = 0, size: int = 1000) -> Update:
    tensor = compress.EncodedTensor("fp32", (size // 4,), {}, b"\0" * size)
    return Update(
        frame=bytes([round_id % 256]) * size,
        digest=f"d{fragment}-{round_id}",
        round=round_id,
        fragment=fragment,
        synchronizer="s",
        parent="p",
        hash="h",
        contributors=(),
        tensors={"w": tensor},
    )


def test_the_oldest_updates_go_first_past_the_byte_budget() -> None:
    store = UpdateStore(max_per_fragment=48, max_bytes_per_fragment=10_000)
    for r in range(10):
        store.put(update(r))  # 2,000 bytes held each: 5 fit
    assert [r for r in range(10) if store.get(0, f"d0-{r}")] == [5, 6, 7, 8, 9]
    assert sum(store.get(0, f"d0-{r}").nbytes for r in range(5, 10)) == 10_000


def test_the_newest_updates_stay_even_when_one_is_over_the_budget() -> None:
    store = UpdateStore(max_per_fragment=48, max_bytes_per_fragment=1_000)
    for r in range(6):
        store.put(update(r, size=5_000))
    kept = [r for r in range(6) if store.get(0, f"d0-{r}")]
    assert kept == list(range(6 - MIN_KEPT_PER_FRAGMENT, 6))


def test_fragments_have_their_own_budgets_and_the_count_cap_still_holds() -> None:
    store = UpdateStore(max_per_fragment=3, max_bytes_per_fragment=1 << 30)
    for r in range(5):
        store.put(update(r, fragment=0))
        store.put(update(r, fragment=1))
    assert [r for r in range(5) if store.get(0, f"d0-{r}")] == [2, 3, 4]
    assert [r for r in range(5) if store.get(1, f"d1-{r}")] == [2, 3, 4]


def test_a_replica_behind_updates_nobody_keeps_downloads_the_state() -> None:
    """Stores bounded by bytes drop old updates: a replica that needs one of those
    downloads the state (verified by hash) instead of waiting forever to replay."""
    async def body(cluster) -> None:  # noqa: ANN001 - test_commit.Cluster
        a, b, c = cluster[0], cluster[1], cluster[2]
        a.view = b.view = {a.peer_id, b.peer_id}  # c never synchronizes nor contributes
        for node in (a, b):
            node.replicas.store.max_per_fragment = 1
        for r in range(3):
            await asyncio.gather(
                a.link.contribute(0, r, a.frame(0.1 * (r + 1), r)),
                b.link.contribute(0, r, b.frame(0.2, r)),
            )
            assert a.state.round_of(0) == b.state.round_of(0) == r + 1
        assert c.state.round_of(0) == 0
        assert await c.replicas.sync_fragment(0)
        assert c.state.round_of(0) == 3 and c.hash() == a.hash()
        assert [e["round"] for e in c.events if e.get("event") == "downloaded"] == [3]

    scenario(3, body)
