"""A frame held for its synchronizer is kept once its round is committed and applied
(issue 28, item 10, found by the networked `hold_flood`, tests/net/test_attacks_audits.py).

Held frames live in bounded quotas (`serving.ServedFrames`) that frames from other
admitted senders, or the same sender's next rounds, evict. A holder that applied the
round from its held copy kept nothing, so after a flood (or two more rounds of that
synchronizer) only the synchronizer served the committed frame: the R holders a commit
waits for were gone. Now applying a held frame keeps it.
"""

from __future__ import annotations

import torch
from test_replica_forks import CODEC, RUN, Swarm, scenario

from p2pdiloco.identity import Identity
from p2pdiloco.roles.serving import MAX_HELD_PER_FRAGMENT
from p2pdiloco.wire.updates import new_update


def test_a_held_frame_applied_by_its_holder_survives_a_hold_flood() -> None:
    async def body(swarm: Swarm) -> None:
        synchronizer, holder = swarm.by_id
        record, update = synchronizer.commit(1.0, holders=(holder.peer_id,))
        holder.replicas.store.hold(update, synchronizer.peer_id)  # pushed before the commit
        await synchronizer.install(record, update)
        assert await holder.replicas.sync_fragment(0)
        assert holder.hash() == record.hash
        encoded = {"w": CODEC.encode(torch.ones(4, 4)), "b": CODEC.encode(torch.ones(4))}
        for _ in range(MAX_HELD_PER_FRAGMENT):  # admitted senders, two frames each
            sender = Identity.generate().peer_id
            for round_id in (1, 2):
                junk = new_update(RUN, round_id, 0, sender, "p" * 32, "h" * 32, [], encoded)
                holder.replicas.store.hold(junk, sender)
        assert update.digest not in holder.replicas.store.held[0], "the flood evicts the held copy"
        served = holder.replicas.store.get(0, update.digest)
        assert served is not None and served.frame == update.frame

    scenario(2, body)
