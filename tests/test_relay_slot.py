"""A client-mode peer's relay slot watch: reported when taken and lost, the transport
renewed when none comes within the patience, which doubles after each fruitless renewal."""

from __future__ import annotations

import asyncio

from p2pdiloco.peer.relay_slot import SlotWatch, watch_relay_slot
from p2pdiloco.transport.base import TransportStartError

CIRCUIT = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWMe"
OTHER = "/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWRelay2/p2p-circuit/p2p/12D3KooWMe"


def test_a_slot_taken_is_reported_once_with_the_wait() -> None:
    watch = SlotWatch(patience_s=300)
    watch.start(0.0)
    assert watch.observe([], 10.0) == ([], False)
    events, renew = watch.observe([CIRCUIT], 190.0)
    assert events == [{"event": "relay_slot", "addresses": [CIRCUIT], "waited_s": 190.0}]
    assert not renew
    assert watch.observe([CIRCUIT], 2000.0) == ([], False)  # held: never renewed


def test_a_changed_set_is_reported_without_a_wait() -> None:
    watch = SlotWatch()
    watch.start(0.0)
    watch.observe([CIRCUIT], 5.0)
    events, _ = watch.observe([OTHER, CIRCUIT], 10.0)
    assert events == [{"event": "relay_slot", "addresses": sorted([CIRCUIT, OTHER])}]


def test_a_lost_slot_is_reported_and_its_patience_starts_then() -> None:
    watch = SlotWatch(patience_s=300)
    watch.start(0.0)
    watch.observe([CIRCUIT], 5.0)
    events, renew = watch.observe([], 1000.0)
    assert events == [{"event": "relay_slot_lost", "addresses": [CIRCUIT]}] and not renew
    assert watch.observe([], 1299.0) == ([], False)
    assert watch.observe([], 1300.0) == ([], True)


def test_no_slot_within_the_patience_renews_and_the_patience_doubles_up_to_the_cap() -> None:
    watch = SlotWatch(patience_s=300, max_patience_s=1000)
    watch.start(0.0)
    assert watch.observe([], 299.0)[1] is False
    assert watch.observe([], 300.0)[1] is True
    watch.renewed(310.0)
    assert watch.observe([], 909.0)[1] is False  # 600 s now
    assert watch.observe([], 910.0)[1] is True
    watch.renewed(910.0)
    assert watch.current_patience_s == 1000  # capped
    assert watch.observe([], 1910.0)[1] is True
    watch.renewed(1910.0)
    events, renew = watch.observe([CIRCUIT], 2000.0)  # a slot at last: patience back to 300
    assert events[0]["event"] == "relay_slot" and not renew
    assert watch.current_patience_s == 300


def test_an_unknown_answer_changes_nothing_but_the_patience_runs() -> None:
    watch = SlotWatch(patience_s=300)
    watch.start(0.0)
    watch.observe([CIRCUIT], 1.0)
    assert watch.observe(None, 500.0) == ([], False)  # still held as far as we know
    watch.observe([], 600.0)
    assert watch.observe(None, 899.0) == ([], False)
    assert watch.observe(None, 900.0) == ([], True)


class FakeTransport:
    """Answers `relay_addresses` from a script; counts renewals; may fail one."""

    def __init__(self, answers: list[list[str] | None], fail_renew: bool = False) -> None:
        self.answers = answers
        self.renewals = 0
        self.fail_renew = fail_renew

    async def relay_addresses(self) -> list[str] | None:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    async def renew(self) -> bool:
        self.renewals += 1
        if self.fail_renew:
            raise TransportStartError("port taken")
        self.answers = [[CIRCUIT]]
        return True


def run_watch(transport: FakeTransport, patience_s: float, until: str) -> tuple[list[dict], list[str]]:
    """Run the watch (polling every millisecond) until it emits `until` or ends by itself."""
    events: list[dict] = []
    failures: list[str] = []

    async def main() -> None:
        watch = SlotWatch(patience_s=patience_s)
        task = asyncio.create_task(
            watch_relay_slot(transport, events.append, failures.append, watch, poll_s=0.001)
        )
        async with asyncio.timeout(60):
            while not task.done() and not any(e["event"] == until for e in events):
                await asyncio.sleep(0.001)  # a test's own poll of a fast fake
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return events, failures


def test_the_watch_renews_a_stuck_transport_and_reports_the_slot_it_then_takes() -> None:
    transport = FakeTransport([[], []])
    events, failures = run_watch(transport, patience_s=0.01, until="relay_slot")
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["relay_renewed", "relay_slot"], events
    assert transport.renewals == 1 and not failures


def test_a_failed_renewal_is_reported_and_ends_the_watch() -> None:
    transport = FakeTransport([[]], fail_renew=True)
    events, failures = run_watch(transport, patience_s=0.01, until="never")
    assert [e["event"] for e in events] == ["relay_renewed"]
    assert len(failures) == 1 and "port taken" in failures[0]


def test_a_transport_that_takes_no_slot_is_not_watched() -> None:
    transport = FakeTransport([None])
    events: list[dict] = []
    asyncio.run(watch_relay_slot(transport, events.append, lambda why: None, poll_s=0.001))
    assert events == [] and transport.renewals == 0
