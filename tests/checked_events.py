"""The in-process clusters' event sink: a list that refuses an event not matching its
declaration (`p2pdiloco.events.KINDS`), as a peer's sink does under the test suite."""

from __future__ import annotations

from p2pdiloco.events import EventContractError, contract_breach


class CheckedEvents(list):
    """A list to use as an in-process role's `on_event` (its `append`): appending an event
    that does not match its declaration fails the test."""

    def append(self, event: dict) -> None:
        breach = contract_breach(event)
        if breach is not None:
            raise EventContractError(breach)
        super().append(event)
