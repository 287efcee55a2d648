"""What a replica serves to strangers is rate-limited per caller and never runs on the
worker that merges and applies (issue 28, item 14): a flooder of `get_state` parts,
`get_update` or `get_contributions` is refused while an honest caller is still served."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from test_commit import scenario
from test_state_transfer import NAMES, RUN, SHAPES, SMALL, donor_state
from test_update_store import update

from p2pdiloco import wire
from p2pdiloco.config import OuterConfig
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.serving import UpdateServer
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire import messages
from p2pdiloco.wire.contributions import encode_audit_request

FLOODER, HONEST = "flooder", "honest"


def state_request(part: int, fragment: int = 0) -> bytes:
    return wire.encode_message(
        wire.Message(kind=wire.STATE_REQUEST, run=RUN, round=0, fragment=fragment, meta={"peer": "asker", "part": part})
    )


def refused(answer: bytes) -> bool:
    msg = wire.decode_message(answer, SMALL)
    return not isinstance(msg, wire.Rejected) and msg.kind == messages.CONTRIBUTE_REPLY and msg.meta.get("status") == messages.Reply.REJECTED


def make_server(worker: ThreadPoolExecutor) -> UpdateServer:
    return UpdateServer(MemoryTransport(MemoryNetwork()), RUN, donor_state(2), SMALL, worker)


def test_a_flood_of_state_parts_is_refused_while_an_honest_joiner_is_served() -> None:
    async def body() -> None:
        worker = ThreadPoolExecutor(1)
        server = make_server(worker)
        # the flooder asks again and again for a middle part (not what a first part costs)
        answers = [await server.rpc_get_state(FLOODER, state_request(1)) for _ in range(100)]
        num_refused = sum(map(refused, answers))
        assert num_refused >= 100 - 2 * server.state_parts()
        # an honest joiner downloads every part
        part, parts = 0, None
        while parts is None or part < parts:
            answer = await server.rpc_get_state(HONEST, state_request(part))
            assert not refused(answer), f"honest part {part} refused"
            parts = wire.decode_message(answer, SMALL).meta["parts"]
            part += 1
        worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_state_parts_are_served_while_the_merge_worker_is_busy() -> None:
    async def body() -> None:
        worker = ThreadPoolExecutor(1)
        server = make_server(worker)
        busy = threading.Event()
        worker.submit(busy.wait, 30)  # a long merge holds the worker
        try:
            answer = await asyncio.wait_for(server.rpc_get_state(HONEST, state_request(0)), 10)
            assert not refused(answer)
        finally:
            busy.set()
            worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_state_parts_past_the_encoding_cap_are_refused_at_once_not_queued() -> None:
    async def body() -> None:
        worker = ThreadPoolExecutor(1)
        server = make_server(worker)
        with server.state.lock:  # every copy waits on the lock: the encoder is stuck
            held = [asyncio.ensure_future(server.rpc_get_state(f"p{i}", state_request(0))) for i in range(2)]
            await asyncio.sleep(0.05)
            answer = await asyncio.wait_for(server.rpc_get_state(HONEST, state_request(0)), 5)
            assert refused(answer) and b"busy" in answer
        assert not any(map(refused, await asyncio.gather(*held)))
        worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_flood_of_get_update_is_refused_while_an_honest_caller_is_served() -> None:
    async def body() -> None:
        worker = ThreadPoolExecutor(1)
        server = make_server(worker)
        kept = update(0)
        server.store.put(kept)
        request = wire.encode_message(
            wire.Message(kind=messages.UPDATE_REQUEST, run=RUN, round=0, fragment=0, meta={"peer": "asker", "digest": kept.digest})
        )
        answers = [await server.rpc_get_update(FLOODER, request) for _ in range(500)]
        served = sum(answer == kept.frame for answer in answers)
        assert served <= server.update_limiter.burst + 5  # a burst, then the refill rate
        assert served + sum(map(refused, answers)) == 500
        assert await server.rpc_get_update(HONEST, request) == kept.frame
        worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_flood_of_get_contributions_is_refused_while_an_auditor_is_served() -> None:
    async def body(cluster) -> None:  # noqa: ANN001 - test_commit.Cluster
        committer = cluster[0].sync.committer
        committer.kept.put(0, 0, [b"sealed-1", b"sealed-2"])
        request = encode_audit_request(0, 0)
        outcomes = []
        for _ in range(200):
            try:
                await committer.rpc_get_contributions(FLOODER, request)
                outcomes.append("served")
            except PermissionError:
                outcomes.append("refused")
        assert outcomes.count("served") < 20 and outcomes.count("refused") > 180
        assert await committer.rpc_get_contributions(HONEST, request)

    scenario(1, body)


def test_a_joiner_still_downloads_over_the_transport() -> None:
    """The limits leave a whole download (every part, once) well inside one caller's burst."""

    async def body() -> None:
        network = MemoryNetwork()
        worker = ThreadPoolExecutor(1)
        donor_transport, joiner_transport = MemoryTransport(network), MemoryTransport(network)
        joiner = GlobalState({n: torch.zeros(s) for n, s in SHAPES.items()}, [NAMES], OuterConfig())
        syncs = [
            ReplicaSync(t, RUN, s, dict, SMALL, worker, void_after_s=30.0)
            for t, s in ((donor_transport, donor_state(3)), (joiner_transport, joiner))
        ]
        for transport, sync in zip((donor_transport, joiner_transport), syncs, strict=True):
            await transport.start()
            await sync.start()
        for _ in range(2):
            state = await syncs[1].downloads.fetch(donor_transport.peer_id, 0, head=3)
            assert state is not None and state.round == 3
        worker.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))
