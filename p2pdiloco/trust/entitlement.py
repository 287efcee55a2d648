"""Who may synchronize and learn in a run, as one peer sees it now: the run's admission
(operator certificates) less the synchronizers this peer proved to have published a false
merge, and, in an open run, only peers the canonical chain shows reachable."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from p2pdiloco.protocol.membership import CLOCK_SLACK_S, Heartbeat, synchronizer_candidates
from p2pdiloco.protocol.rounds import RoundRecord, record_time
from p2pdiloco.trust.admission import Admission
from p2pdiloco.trust.record_rules import record_time_refusal

MAX_VERDICTS = 4096
"""Certificate verdicts remembered (one per peer and certificate set; then start over)."""


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
        self.distrusted: dict[str, float] = {}
        """Synchronizers whose out-of-line update this peer could not verify (they did not
        serve its contributions), with until when (DHT time): not elected here meanwhile.
        Local, like its reason (a refusal cannot be proven to others): their records
        still count as any other's, so nothing that forks depends on it."""
        self.settled: Callable[[Heartbeat], bool] | None = None
        """Whether every peer has read a member's beat by now (`Membership.settled`, set
        where the roles are built); None: every live member counts as settled."""
        self._chains: Sequence[dict[int, RoundRecord]] = ()
        self._proven: dict[tuple, tuple[dict[int, RoundRecord], frozenset[str]]] = {}
        self._verdicts: dict[tuple[str, tuple[bytes, ...]], float | None] = {}
        """(peer, certificates) -> expiry of its synchronizer certificate (None: refused),
        so an election step compares two floats instead of checking signatures."""

    def follow(self, chains: Sequence[dict[int, RoundRecord]]) -> None:
        """Judge with the canonical chains in `chains` (one dict per fragment, kept current
        by the replica): who an open run elects, and which close times a record may sign."""
        self._chains = chains

    def ban(self, synchronizer: str, round_id: int) -> None:
        """A false merge of `synchronizer` at `round_id` was proven."""
        self.banned[synchronizer] = min(round_id, self.banned.get(synchronizer, round_id))

    def distrust(self, synchronizer: str, for_s: float) -> None:
        """Do not elect `synchronizer` for `for_s` seconds: it did not let this peer
        verify an update it must verify."""
        if len(self.distrusted) >= MAX_VERDICTS:
            self.distrusted.clear()
        self.distrusted[synchronizer] = self.now() + for_s

    def trust_again(self, synchronizer: str) -> None:
        """The update that made us distrust `synchronizer` was verified after all."""
        self.distrusted.pop(synchronizer, None)

    def is_distrusted(self, peer: str) -> bool:
        until = self.distrusted.get(peer)
        return until is not None and self.now() < until

    def may_synchronize(self, beat: Heartbeat) -> bool:
        """Whether the run entitles this live peer to be elected synchronizer (and this
        peer does not distrust it: `distrust`)."""
        if beat.peer_id in self.banned or self.is_distrusted(beat.peer_id):
            return False
        if self.admission.synchronizers == "open":
            return True
        expires_at = self._certificate_expiry(beat.peer_id, beat.certificates)
        return expires_at is not None and expires_at >= self.now()

    def proven(self, fragment: int, before: int | None = None) -> frozenset[str] | None:
        """In an open run, the peers the canonical chain of `fragment` shows reachable: the
        synchronizer and contributors of every canonical record this peer holds of it
        (records live an hour: the last hour's). None in a certified run, where the
        certificates decide, or before any record. It is the set the chain itself requires
        (`rounds.record_standing`: a record whose synchronizer its ancestry never named is
        skipped), so an elected synchronizer's record always counts; the whole hour, not
        the last few rounds, so that peers whose reads lag a round agree on who is in it.

        With `before` (the round being elected), only records of earlier rounds count: the
        ancestry of a record of that round. A record of the round itself that this peer
        holds unverified (and whose re-run the election is for) names its own contributors,
        who are no ancestors of the re-run: electing one of them made a record nobody
        counts (a flaky failure of `test_rerun_held`, 1 run in ~60 under load)."""
        if self.admission.synchronizers != "open" or not 0 <= fragment < len(self._chains):
            return None
        chain = self._chains[fragment]
        head = max(chain, default=-1)
        bound = head + 1 if before is None else min(before, head + 1)
        # the chain dict itself is kept (not its id: a freed dict's id is reused by the next)
        key = (fragment, len(chain), head, bound)
        cached = self._proven.get(key)
        if cached is None or cached[0] is not chain:
            if len(self._proven) > 8 * len(self._chains):
                self._proven.clear()
            cached = self._proven[key] = (chain, self._proven_in(chain, bound))
        return cached[1] or None

    def candidates(self, members: Mapping[str, Heartbeat], fragment: int, round_id: int) -> list[str]:
        """Who this peer may elect synchronizer of (round, fragment) among `members`: the
        entitled, proven, settled live learners (`synchronizer_candidates`)."""
        return synchronizer_candidates(members, self.may_synchronize, self.proven(fragment, round_id), self.settled)

    def votes_on_clock(self, beat: Heartbeat) -> bool:
        """Whether `beat`'s signed send time may set the swarm clock: in a certified run,
        a peer entitled to synchronize; in an open run, a peer the chain named (anyone
        before the first record). A free identity cannot move the swarm's clock."""
        if self.admission.synchronizers != "open":
            return self.may_synchronize(beat)
        proven = self.proven_anywhere()
        return not proven or beat.peer_id in proven

    def proven_anywhere(self) -> frozenset[str]:
        """Peers the canonical chain of any fragment shows reachable (the address book
        keeps them first; a hold is accepted from a synchronizer of any fragment)."""
        return frozenset().union(*(self.proven(f) or () for f in range(len(self._chains))))

    @staticmethod
    def _proven_in(chain: dict[int, RoundRecord], before: int) -> frozenset[str]:
        peers: set[str] = set()
        for round_id, record in chain.items():
            if round_id >= before:
                continue
            peers.update(record.named)
        return frozenset(peers)

    def learner_refusal(self, peer: str, certificates: tuple[bytes, ...]) -> str | None:
        """Why the run does not admit `peer`'s contributions (None: it does)."""
        if self.admission.learners == "open":
            return None
        refusal = self.admission.learner_refusal(self.run, peer, certificates, self.now())
        return f"learner not admitted: {refusal}" if refusal else None

    def entitled(self, record: RoundRecord) -> bool:
        """Whether the run entitled the record's synchronizer to commit it: a certificate
        valid at the close the record signs, a close (or resume: `rounds.record_time`)
        plausible now (`record_time_refusal`), not before the canonical record of the round
        before, and for a resumed record a peer the run entitles at the resume time."""
        if record.round >= self.banned.get(record.synchronizer, record.round + 1):
            return False
        if record_time_refusal(record_time(record), self.now()) is not None:
            return False
        if self._closes_before_its_parent(record):
            return False
        if self.admission.synchronizers == "open":
            return True
        expires_at = self._certificate_expiry(record.synchronizer, record.certificates)
        if expires_at is None or expires_at < record.closed_at:
            return False
        if not record.resumed_by:
            return True
        resumer_expires_at = self._certificate_expiry(record.resumed_by, record.resumed_certificates)
        return resumer_expires_at is not None and resumer_expires_at >= record.resumed_at

    def _closes_before_its_parent(self, record: RoundRecord) -> bool:
        """A record that signs a close before the canonical close of the round it follows
        was backdated (rounds close in order); clocks may differ by CLOCK_SLACK_S."""
        if not 0 <= record.fragment < len(self._chains):
            return False
        parent = self._chains[record.fragment].get(record.round - 1)
        return parent is not None and record.closed_at < parent.closed_at - CLOCK_SLACK_S

    def _certificate_expiry(self, peer: str, certificates: tuple[bytes, ...]) -> float | None:
        """When `peer`'s synchronizer certificate among `certificates` expires (None: it
        shows none the operator signed); signatures checked once per (peer, certificates)."""
        key = (peer, tuple(certificates))
        if key not in self._verdicts:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            expiry = self.admission.certificate_expiry(self.run, peer, "synchronizer", certificates)
            self._verdicts[key] = None if isinstance(expiry, str) else expiry
        return self._verdicts[key]
