"""Windows move up the rendezvous order; learners follow, and failover does not move back.

Three synchronizers and learner links on the in-memory transport, each peer with its own
membership view (a dict the test edits), so the split views of peers that started
together are reproduced exactly.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch
from checked_events import CheckedEvents

from p2pdiloco import compress, wire
from p2pdiloco.config import RunConfig, replace
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.roles.commit import NOT_PROVEN
from p2pdiloco.roles.learner_link import LearnerLink, with_unreachable
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.synchronizer import Synchronizer
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import seal_contribution

RUN = "moves"
CONFIG = replace(RunConfig(), sync={"min_quorum": 2, "max_grace_s": 0.2, "round_deadline_s": 30.0})
LIMITS = wire.WireLimits()


def fresh_state() -> GlobalState:
    params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    return GlobalState(params, [["w", "b"]], CONFIG.outer)


class Peer:
    """A synchronizer and a learner link sharing one transport, state and view."""

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.transport = MemoryTransport(network, peer_id)
        self.view: dict[str, Heartbeat] = {}
        self.events: list[dict] = CheckedEvents()
        self.opened = asyncio.Event()
        self.state = fresh_state()
        self.worker = ThreadPoolExecutor(max_workers=1)
        self.replicas = ReplicaSync(
            self.transport, RUN, self.state, lambda: self.view, LIMITS, self.worker, 30.0
        )
        self.sync = Synchronizer(
            self.transport,
            RUN,
            CONFIG,
            self.state,
            lambda: self.view,
            LIMITS,
            self.replicas,
            self.worker,
            on_event=self.on_event,
        )
        self.link = LearnerLink(
            self.transport, RUN, CONFIG.sync, self.replicas, lambda: self.view, LIMITS
        )

    def on_event(self, event: dict) -> None:
        self.events.append(event)
        if event["event"] == "window_open":
            self.opened.set()

    def sees(self, *peer_ids: str) -> None:
        self.view = {p: Heartbeat(peer_id=p, status="training") for p in peer_ids}

    def frame(self, scale: float) -> bytes:
        delta = {"w": torch.full((4, 4), scale), "b": torch.full((4,), scale)}
        message = wire.Message(
            kind=wire.CONTRIBUTION,
            run=RUN,
            round=0,
            fragment=0,
            meta={"peer": self.transport.peer_id, "base_round": 0, "tokens": 64, "steps": 2},
            tensors=compress.encode_tensors(compress.make_codec("fp32"), delta),
        )
        return wire.encode_message(message)


async def three_peers() -> tuple[MemoryNetwork, Peer, Peer, Peer]:
    """(network, top, second, third) in the rendezvous order of (round 0, fragment 0)."""
    network = MemoryNetwork()
    ids = [network.new_peer_id() for _ in range(3)]
    top, second, third = synchronizer_order(RUN, 0, 0, ids)
    peers = [Peer(network, p) for p in (top, second, third)]
    for peer in peers:
        await peer.transport.start()
        await peer.replicas.start()
        await peer.sync.start()
    return network, *peers


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_window_held_alone_moves_to_the_better_placed_peer_once_it_is_seen() -> None:
    async def scenario() -> None:
        _, top, second, third = await three_peers()
        everyone = (top.transport.peer_id, second.transport.peer_id, third.transport.peer_id)
        top.sees(*everyone)
        third.sees(*everyone)
        second.sees(second.transport.peer_id)  # started together: sees only itself
        alone = asyncio.create_task(second.link.contribute(0, 0, second.frame(1.0)))
        await second.opened.wait()
        second.sees(*everyone)  # its heartbeats arrive
        other = asyncio.create_task(third.link.contribute(0, 0, third.frame(3.0)))
        outcomes = await asyncio.gather(alone, other)
        for outcome in outcomes:
            assert outcome.status == messages.Reply.MERGED
            assert outcome.synchronizer == top.transport.peer_id
        moved = [e for e in second.events if e["event"] == "window_moved"]
        assert moved and moved[0]["to"] == top.transport.peer_id
        # one outer step from both deltas, the same on every replica that applied it
        assert second.state.round_of(0) == third.state.round_of(0) == top.state.round_of(0) == 1
        assert second.state.applied_hashes[0][0] == top.state.applied_hashes[0][0]

    run(scenario())


def test_a_peer_below_the_top_refuses_to_open_a_window_and_names_the_top() -> None:
    async def scenario() -> None:
        _, top, second, _third = await three_peers()
        second.sees(top.transport.peer_id, second.transport.peer_id)
        raw = await top.transport.call(
            second.transport.peer_id, f"{RUN}.{messages.RPC_CONTRIBUTE}",
            seal_contribution(top.transport.identity, RUN, top.frame(1.0)), 10
        )
        reply = wire.decode_message(raw, LIMITS)
        assert reply.meta["status"] == messages.Reply.MOVED
        assert reply.meta["moved_to"] == top.transport.peer_id
        assert not second.sync.windows

    run(scenario())


def test_failover_past_a_dead_top_that_is_still_in_the_views_does_not_move_back() -> None:
    async def scenario() -> None:
        network, top, second, third = await three_peers()
        everyone = (top.transport.peer_id, second.transport.peer_id, third.transport.peer_id)
        for peer in (second, third):
            peer.sees(*everyone)  # the dead peer's heartbeat has not expired yet
        network.kill(top.transport.peer_id)
        outcomes = await asyncio.gather(
            second.link.contribute(0, 0, second.frame(1.0)),
            third.link.contribute(0, 0, third.frame(3.0)),
        )
        for outcome in outcomes:
            assert outcome.status == messages.Reply.MERGED
            assert outcome.synchronizer == second.transport.peer_id
        assert not [e for e in second.events if e["event"] == "window_moved"]

    run(scenario())


def test_a_peer_the_chain_never_named_opens_no_window_and_sends_the_delta_to_one_it_names() -> None:
    """An open run's failover to a peer no record names: its record would be UNPROVEN,
    skipped by every other peer, so its commit is refused (`NOT_PROVEN`). It now refuses
    the window at intake: moved to the best-placed named peer the learner did not report
    unreachable, or no quorum at once when it reported them all, instead of a window's
    wait for a commit that cannot count."""

    async def scenario() -> None:
        network = MemoryNetwork()
        ids = [network.new_peer_id() for _ in range(4)]
        newcomer = synchronizer_order(RUN, 1, 0, ids)[0]  # first in round 1's order
        named = [p for p in ids if p != newcomer]
        top, second, third = (Peer(network, p) for p in synchronizer_order(RUN, 0, 0, named))
        late = Peer(network, newcomer)
        for peer in (top, second, third, late):
            await peer.transport.start()
            await peer.replicas.start()
            await peer.sync.start()
            peer.sees(*named)
        # round 0 without the newcomer: its record names the three others
        outcomes = await asyncio.gather(
            second.link.contribute(0, 0, second.frame(1.0)), third.link.contribute(0, 0, third.frame(3.0))
        )
        assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
        late.sees(*ids)
        assert await late.replicas.sync_fragment(0) and late.state.round_of(0) == 1
        assert late.sync.elected_elsewhere(1, 0) is None  # it tops round 1's order by itself

        def frame(unreachable: list[str]) -> bytes:
            message = wire.decode_message(second.frame(1.0), LIMITS)
            message = wire.Message(message.kind, RUN, 1, 0, {**message.meta, "base_round": 1}, message.tensors)
            return with_unreachable(wire.encode_message(message), unreachable, LIMITS)

        async def send(unreachable: list[str]) -> wire.Message:
            raw = await second.transport.call(
                newcomer, f"{RUN}.{messages.RPC_CONTRIBUTE}",
                seal_contribution(second.transport.identity, RUN, frame(unreachable)), 10,
            )  # fmt: skip
            return wire.decode_message(raw, LIMITS)

        reply = await send([])
        assert reply.meta["status"] == messages.Reply.MOVED
        assert reply.meta["moved_to"] == synchronizer_order(RUN, 1, 0, named)[0]
        best = synchronizer_order(RUN, 1, 0, named)[0]
        reply = await send([best])
        assert reply.meta["moved_to"] == synchronizer_order(RUN, 1, 0, [p for p in named if p != best])[0]
        reply = await send(named)
        assert reply.meta["status"] == messages.Reply.NO_QUORUM
        assert reply.meta["reason"] == NOT_PROVEN
        assert not late.sync.windows

    run(scenario())
