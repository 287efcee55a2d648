"""One update, followed from the synchronizer's merge to every replica: each peer decodes
it at most once and hashes one state a round (the result; never the parent again)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
from test_commit import Cluster, poll, scenario

from p2pdiloco.outer import fragment_state as fragment_module
from p2pdiloco.wire import messages
from p2pdiloco.wire.updates import Update


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Counter]:
    """(decodes, hashes) counted by the thread that did them (each peer has its own worker)."""
    decodes: Counter = Counter()
    hashes: Counter = Counter()
    decode, fragment_hash = Update.decode, fragment_module.fragment_hash

    def counted_decode(self: Update):
        decodes[threading.current_thread().name] += 1
        return decode(self)

    def counted_hash(*args, **kwargs):
        hashes[threading.current_thread().name] += 1
        return fragment_hash(*args, **kwargs)

    monkeypatch.setattr(Update, "decode", counted_decode)
    monkeypatch.setattr(fragment_module, "fragment_hash", counted_hash)
    return decodes, hashes


def test_each_peer_decodes_an_update_once_and_hashes_only_its_result(counted) -> None:
    decodes, hashes = counted

    peers: list[str] = []

    async def body(cluster: Cluster) -> None:
        peers.extend(cluster.order)  # the synchronizer of round 0 first
        decodes.clear(), hashes.clear()  # genesis hashes are taken once, at start
        outcomes = await asyncio.gather(cluster[1].contribute(1.0), cluster[2].contribute(3.0))
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
        await poll(lambda: all(node.state.rounds == [1] for node in cluster.nodes.values()))

    scenario(3, body)
    synchronizer, *learners = peers
    workers = {peer: f"worker-{peer}_0" for peer in peers}
    assert decodes[workers[synchronizer]] == 0, decodes  # it merged the tensors it holds
    assert all(decodes[workers[p]] == 1 for p in learners), decodes
    assert all(hashes[workers[p]] == 1 for p in peers), hashes
    assert set(decodes) | set(hashes) <= set(workers.values()), (decodes, hashes)
