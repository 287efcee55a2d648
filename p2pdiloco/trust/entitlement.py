"""Who may synchronize and learn in a run, as one peer sees it now: the run's admission
(operator certificates) less the synchronizers this peer proved to have published a false
merge."""

from __future__ import annotations

from collections.abc import Callable

from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import RoundRecord
from p2pdiloco.trust.admission import Admission


class Entitlement:
    """The run's admission for synchronizers, and the bans this peer's audits proved."""

    def __init__(self, run: str, admission: Admission, now: Callable[[], float]) -> None:
        self.run = run
        self.admission = admission
        self.now = now
        self.banned: dict[str, int] = {}
        """Synchronizers proven to have published a false merge, with the round of the
        first proven lie: not elected again, and none of their records from then on count
        (earlier ones were applied and checked like any other)."""

    def ban(self, synchronizer: str, round_id: int) -> None:
        """A false merge of `synchronizer` at `round_id` was proven."""
        self.banned[synchronizer] = min(round_id, self.banned.get(synchronizer, round_id))

    def may_synchronize(self, beat: Heartbeat) -> bool:
        """Whether the run entitles this live peer to be elected synchronizer."""
        if beat.peer_id in self.banned:
            return False
        return self.admission.synchronizer_refusal(self.run, beat.peer_id, beat.certificates, self.now()) is None

    def learner_refusal(self, peer: str, certificates: tuple[bytes, ...]) -> str | None:
        """Why the run does not admit `peer`'s contributions (None: it does)."""
        if self.admission.learners == "open":
            return None
        refusal = self.admission.learner_refusal(self.run, peer, certificates, self.now())
        return f"learner not admitted: {refusal}" if refusal else None

    def entitled(self, record: RoundRecord) -> bool:
        """Whether the run entitled the record's synchronizer to commit it."""
        if record.round >= self.banned.get(record.synchronizer, record.round + 1):
            return False
        refusal = self.admission.synchronizer_refusal(
            self.run, record.synchronizer, record.certificates, record.closed_at
        )
        return refusal is None
