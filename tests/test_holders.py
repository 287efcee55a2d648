"""Who holds a round's update before its commit (issue 28, item 10).

The holders were the contributors in peer-id order, so the lowest id held every round it
contributed to (with R = 1 alone), whether or not anyone could dial it; and `hold_update`
kept a frame from anyone, in the store whose bounds evict the frames a replica serves.
Now: holders in rendezvous order among reachable learners, R = 2 by default, a frame is
held only from a synchronizer the election could have picked, and held frames live apart,
a few per sender.
"""

from __future__ import annotations

import torch
from test_commit import RUN, Cluster, hold, scenario

from p2pdiloco import compress
from p2pdiloco.config import RunConfig
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.roles.commit import holder_order
from p2pdiloco.roles.serving import MAX_HELD_PER_FRAGMENT, MAX_HELD_PER_SENDER, ServedFrames
from p2pdiloco.wire import messages
from p2pdiloco.wire.updates import new_update, update_digest


def _ids(count: int) -> list[str]:
    return [f"peer-{i:03d}" for i in range(count)]


def _members(ids: list[str], **overrides: dict) -> dict[str, Heartbeat]:
    return {p: Heartbeat(peer_id=p, **({"status": "training"} | overrides.get(p, {}))) for p in ids}


def test_the_lowest_id_is_not_the_first_holder_of_every_round() -> None:
    ids = _ids(8)
    firsts = [holder_order(RUN, r, 0, "sync", ids, _members(ids))[0] for r in range(200)]
    # before: the lowest contributor id, every round
    assert firsts.count(ids[0]) < 60
    assert len(set(firsts)) == len(ids)


def test_holders_are_contributors_first_then_other_learners_never_client_mode_or_leaving() -> None:
    ids = _ids(6)
    members = _members(ids, **{ids[1]: {"client_mode": True}, ids[2]: {"status": "leaving"}})
    order = holder_order(RUN, 3, 0, ids[5], [ids[0], ids[1], ids[3]], members)
    assert set(order[:2]) == {ids[0], ids[3]}
    assert order[2:] == [ids[4]]
    assert holder_order(RUN, 3, 0, ids[5], [ids[0], ids[1], ids[3]], members) == order


def test_the_embedded_default_asks_two_holders() -> None:
    assert RunConfig().sync.commit_holders >= 2


def _frame(synchronizer: str, parent: str, round_id: int = 0, tag: int = 0) -> bytes:
    tensors = compress.encode_tensors(
        compress.make_codec("fp32"), {"w": torch.full((4, 4), float(tag)), "b": torch.ones(4)}
    )
    return new_update(RUN, round_id, 0, synchronizer, parent, f"hash-{tag}", [("a", 1.0, 64)], tensors).frame


def test_hold_update_from_a_peer_the_election_cannot_pick_is_refused() -> None:
    async def body(cluster: Cluster) -> None:
        holder, stranger = cluster[1], cluster[5]  # 6th of the order: past the failovers
        frame = _frame(stranger.peer_id, holder.replicas.genesis[0])
        reply = await hold(stranger, holder, frame)
        assert reply.meta["status"] == messages.Reply.REJECTED
        assert "not a synchronizer" in reply.meta["reason"]
        assert holder.replicas.store.get(0, update_digest(frame)) is None
        # a round far from the holder's: refused too, even from the elected synchronizer
        far = _frame(cluster[0].peer_id, holder.replicas.genesis[0], round_id=50)
        assert (await hold(cluster[0], holder, far)).meta["status"] == messages.Reply.REJECTED
        # the elected synchronizer of the round is held
        genuine = _frame(cluster[0].peer_id, holder.replicas.genesis[0])
        assert (await hold(cluster[0], holder, genuine)).meta["status"] == messages.Reply.HELD

    scenario(6, body)


def test_a_flood_of_holds_cannot_evict_a_genuine_frame() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, flooder, holder = cluster[0], cluster[1], cluster[2]
        parent = holder.replicas.genesis[0]
        genuine = _frame(synchronizer.peer_id, parent, tag=-1)
        assert (await hold(synchronizer, holder, genuine)).meta["status"] == messages.Reply.HELD
        kept = new_update(RUN, 0, 0, "x", parent, "kept", [], {})
        holder.replicas.keep(kept)
        for tag in range(60):  # more than the store keeps (48 a fragment)
            reply = await hold(flooder, holder, _frame(flooder.peer_id, parent, tag=tag))
            assert reply.meta["status"] == messages.Reply.HELD  # a failover may hold, within its quota
        store = holder.replicas.store
        assert store.get(0, update_digest(genuine)) is not None
        assert store.get(0, kept.digest) is not None
        assert sum(1 for u in store.of_round(0, 0) if u.synchronizer == flooder.peer_id) == MAX_HELD_PER_SENDER

    scenario(3, body)


def test_held_frames_are_evicted_from_the_sender_holding_the_most() -> None:
    frames = ServedFrames()

    def update(sender: str, tag: int):
        tensors = compress.encode_tensors(compress.make_codec("fp32"), {"w": torch.full((2,), float(tag))})
        return new_update(RUN, 0, 0, sender, "p", f"h{tag}", [], tensors)

    honest = update("honest", 0)
    frames.hold(honest, "honest")
    for i in range(80):  # eight senders admitted (failovers of a few rounds), ten frames each
        frames.hold(update(f"sybil-{i % 8}", i + 1), f"sybil-{i % 8}")
    assert len(frames.held[0]) == MAX_HELD_PER_FRAGMENT
    assert frames.get(0, honest.digest) is honest
