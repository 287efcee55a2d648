"""A fraud notice's verification never holds the replica's sync pass.

Verifying a notice may download a whole fragment from its notifier, a stranger who may
answer slowly or never. It ran at the start of every sync pass, so a flood of notices from
free identities held every round's apply for up to the pass's timeout (`bench_attack`
`notice_flood`: 0.62 of the clean round rate). Now the peer runs the two as separate tasks
after each beat, one of each at a time (`JoinedPeer._start_replica_sync`).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from p2pdiloco.peer.joined import JoinedPeer


class StuckNotices:
    """A replica whose notice check waits on a notifier that never answers."""

    def __init__(self, fragments: int) -> None:
        self.notice_checks = 0
        self.synced: list[int] = []
        self.all_synced = asyncio.Event()
        self.fragments = fragments

    async def check_notices(self) -> None:
        self.notice_checks += 1
        await asyncio.Event().wait()  # the notifier's state never comes

    async def sync_fragment(self, fragment: int) -> bool:
        self.synced.append(fragment)
        if len(self.synced) % self.fragments == 0:
            self.all_synced.set()
        return True


class Peer:
    """The part of `JoinedPeer` that starts the sync pass and the notice check."""

    _start_replica_sync = JoinedPeer._start_replica_sync
    _sync_all = JoinedPeer._sync_all
    _check_notices = JoinedPeer._check_notices

    def __init__(self, fragments: int) -> None:
        self._tasks: list[asyncio.Task] = []
        self.replicas = StuckNotices(fragments)
        self.state = SimpleNamespace(num_fragments=fragments)
        self._synced_once = False


def test_a_notice_check_that_never_ends_does_not_hold_the_sync_pass() -> None:
    async def main() -> None:
        peer = Peer(fragments=2)
        for beat in range(3):
            peer.replicas.all_synced.clear()
            peer._start_replica_sync()  # a beat
            await asyncio.wait_for(peer.replicas.all_synced.wait(), 30)
            assert peer.replicas.synced == [0, 1] * (beat + 1)
        assert peer._synced_once
        assert peer.replicas.notice_checks == 1  # one at a time: the stuck one is not doubled
        for task in peer._tasks:
            task.cancel()
        await asyncio.gather(*peer._tasks, return_exceptions=True)

    asyncio.run(main())
