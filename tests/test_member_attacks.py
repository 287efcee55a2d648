"""Issue 28, items 1, 3, 12 and 13: heartbeat replay, clock skew, Sybil heartbeats with
valid keys, and certificates judged at the time a record is judged."""

from __future__ import annotations

import asyncio

import pytest

from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import (
    CLOCK_SLACK_S,
    Heartbeat,
    live_members,
    members_key,
    seal_heartbeat,
    synchronizer_candidates,
)
from p2pdiloco.protocol.rounds import RoundRecord, record_subkey, rounds_key, seal_record
from p2pdiloco.roles.presence import Membership
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.transport.records import RecordTable
from p2pdiloco.trust import admission as admission_module
from p2pdiloco.trust.admission import Admission, Certificate, issue_certificate
from p2pdiloco.trust.entitlement import Entitlement
from p2pdiloco.trust.record_rules import RECORD_MAX_TTL_S, RunRecordRules

RUN = "members-attacks"
NOW = 1_800_000_000.0
RULES = RunRecordRules(RUN, 1)
PEER = Identity.generate()
OPERATOR = Identity.generate()


def beat(identity: Identity = PEER, sent_at: float = NOW, live_s: float = 8.0, **fields) -> bytes:
    heartbeat = Heartbeat(peer_id=identity.peer_id, sent_at=sent_at, live_s=live_s, **fields)
    return seal_heartbeat(identity, RUN, heartbeat)


# --- item 1: replay ---------------------------------------------------------------------


def test_an_old_beat_replayed_with_a_far_expiration_is_refused() -> None:
    """The attack: a certified synchronizer's `leaving` beat, captured earlier, replayed
    with expiration now+299 hid its fresh beats for five minutes."""
    captured = beat(sent_at=NOW - 100, status="leaving")
    assert RULES.check(members_key(RUN), PEER.peer_id, captured, NOW + 299, NOW) is not None
    fresh = beat(sent_at=NOW)
    assert RULES.check(members_key(RUN), PEER.peer_id, fresh, NOW + 8 + CLOCK_SLACK_S, NOW) is None


def test_a_replay_with_the_furthest_expiration_it_may_have_never_replaces_a_newer_beat() -> None:
    table = RecordTable()
    key = members_key(RUN)
    captured = beat(sent_at=NOW - 5, status="leaving")
    fresh = beat(sent_at=NOW)
    assert table.store(key, PEER.peer_id, fresh, NOW + 8 + CLOCK_SLACK_S, NOW)
    furthest = NOW - 5 + 8 + CLOCK_SLACK_S  # what the rules let the replay have
    assert RULES.check(key, PEER.peer_id, captured, furthest, NOW) is None
    assert not table.store(key, PEER.peer_id, captured, furthest, NOW)
    live, _ = live_members(RUN, table.get(key, NOW), NOW)
    assert live[PEER.peer_id].status == "starting"


def test_a_beat_is_live_for_the_life_it_signed_not_the_dht_expiry() -> None:
    records = {PEER.peer_id: (beat(sent_at=NOW - 20, live_s=8.0), NOW + 40)}
    live, _ = live_members(RUN, records, NOW)
    assert live == {}


# --- item 3: clock skew -----------------------------------------------------------------


class SkewedTransport(MemoryTransport):
    """A peer whose clock is `skew_s` off (the records keep the network's clock)."""

    def __init__(self, network: MemoryNetwork, skew_s: float) -> None:
        super().__init__(network, record_rules=RunRecordRules(RUN, 1))
        self.skew_s = skew_s

    def now(self) -> float:
        return self.network.clock() + self.skew_s


async def beat_a_while(skew_s: float, periods: int = 4) -> list[Membership]:
    """Two honest peers and one whose clock is `skew_s` off beat for a few periods."""
    clock = [NOW]
    network = MemoryNetwork(clock=lambda: clock[0])
    members = []
    for offset in (0.0, 0.0, skew_s):
        transport = SkewedTransport(network, offset)
        await transport.start()

        def own(peer: str = transport.peer_id) -> Heartbeat:
            return Heartbeat(peer_id=peer, config_hash="h")

        members.append(Membership(transport, RUN, 2.0, "h", own, lambda e: None))
    for _ in range(periods):
        clock[0] += 2.0
        for membership in members:
            await membership.beat()
    return members


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
def test_a_peer_30_s_off_stays_visible_and_sees_the_others(skew_s: float) -> None:
    """The attack seen: a peer 8 s behind was invisible (its beats arrived expired), one
    ahead saw nobody and elected itself."""
    members = asyncio.run(beat_a_while(skew_s))
    ids = {m.transport.peer_id for m in members}
    for membership in members:
        assert set(membership.view()) == ids, f"{membership.transport.peer_id[-6:]} sees too few"
    assert abs(members[2].offset_s + skew_s) < 5.0
    assert members[0].offset_s == 0.0 and members[1].offset_s == 0.0
    assert len(synchronizer_candidates(members[2].view())) == 3  # it does not elect itself alone


def test_one_value_near_the_old_ttl_limit_is_accepted_by_a_reader_whose_clock_is_behind() -> None:
    """hivemind validates a returned dictionary as one: one subkey a reader refuses drops
    the whole members dictionary of that answer. A storer accepted now+299; a reader 30 s
    behind must accept it too."""
    sybil = Identity.generate()
    crafted = beat(sybil, sent_at=NOW, live_s=240.0)
    assert RULES.check(members_key(RUN), sybil.peer_id, crafted, NOW + 299, NOW) is None
    assert RULES.check(members_key(RUN), sybil.peer_id, crafted, NOW + 299, NOW - 30) is None


# --- item 12: Sybil heartbeats ----------------------------------------------------------


def record(round_id: int, synchronizer: str, contributors: list[str], closed_at: float = NOW, **fields) -> RoundRecord:
    return RoundRecord(
        round=round_id, fragment=0, synchronizer=synchronizer, hash=f"h{round_id}",
        contributors=tuple((p, 1.0, 10) for p in contributors), closed_at=closed_at, **fields,
    )


def test_an_open_run_elects_only_peers_the_chain_shows_reachable() -> None:
    honest = [Identity.generate().peer_id for _ in range(3)]
    sybils = [Identity.generate().peer_id for _ in range(30)]
    members = {p: Heartbeat(peer_id=p, status="training") for p in honest + sybils}
    entitlement = Entitlement(RUN, Admission(), lambda: NOW)
    chains = [{}]
    entitlement.follow(chains)
    # before any record: every live learner (a run must be able to start)
    assert len(synchronizer_candidates(members, entitlement.may_synchronize, entitlement.proven(0))) == 33
    chains[0] = {0: record(0, honest[0], honest[1:])}
    assert synchronizer_candidates(members, entitlement.may_synchronize, entitlement.proven(0)) == sorted(honest)
    # the proven peers left: the run goes on with whoever is live
    alone = {p: members[p] for p in sybils}
    assert len(synchronizer_candidates(alone, entitlement.may_synchronize, entitlement.proven(0))) == 30


def test_a_rerun_elects_only_peers_the_rounds_own_ancestry_names() -> None:
    """A held record of round 4 names a contributor no earlier round named. Electing that
    peer to re-run round 4 made a record `record_standing` skips (its ancestry, rounds
    0-3, never named it): round 4 then had no record at all (flaky `test_rerun_held`)."""
    a, b, c, newcomer = (Identity.generate().peer_id for _ in range(4))
    members = {p: Heartbeat(peer_id=p, status="training") for p in (a, b, c, newcomer)}
    entitlement = Entitlement(RUN, Admission(), lambda: NOW)
    chains = [{0: record(0, a, [b]), 1: record(1, a, [b]), 2: record(2, c, [newcomer])}]
    entitlement.follow(chains)
    assert synchronizer_candidates(members, entitlement.may_synchronize, entitlement.proven(0, 2)) == sorted([a, b])
    assert newcomer in synchronizer_candidates(members, entitlement.may_synchronize, entitlement.proven(0, 3))
    assert newcomer in entitlement.proven(0)  # the whole chain, as the address book keeps it
    # a new chain dict of the same shape is read afresh (no stale cache by object id)
    chains[0] = {0: record(0, a, [c]), 1: record(1, a, [c]), 2: record(2, b, [newcomer])}
    assert entitlement.proven(0, 2) == frozenset({a, c})


def test_certificates_are_verified_once_per_peer_and_certificate_not_at_every_election_step(monkeypatch) -> None:
    admission = Admission(synchronizers="certified", operator=OPERATOR.peer_id)
    cert = issue_certificate(OPERATOR, Certificate(RUN, PEER.peer_id, "synchronizer", NOW + 60))
    now = [NOW]
    entitlement = Entitlement(RUN, admission, lambda: now[0])
    calls = []
    real = admission_module.read_certificate
    monkeypatch.setattr(admission_module, "read_certificate", lambda *a: calls.append(1) or real(*a))
    member = Heartbeat(peer_id=PEER.peer_id, certificates=(cert,))
    assert all(entitlement.may_synchronize(member) for _ in range(100))
    assert len(calls) == 1
    now[0] = NOW + 61  # the cached verdict still expires on time
    assert not entitlement.may_synchronize(member)


# --- item 13: certificates judged now ---------------------------------------------------


def certified_record(closed_at: float, cert_expires_at: float, round_id: int = 5) -> RoundRecord:
    cert = issue_certificate(OPERATOR, Certificate(RUN, PEER.peer_id, "synchronizer", cert_expires_at))
    return record(round_id, PEER.peer_id, [PEER.peer_id], closed_at=closed_at, certificates=(cert,))


def test_an_expired_key_cannot_backdate_a_record() -> None:
    admission = Admission(synchronizers="certified", operator=OPERATOR.peer_id)
    expired_at = NOW - 2 * RECORD_MAX_TTL_S  # the key ran out long ago
    backdated = certified_record(closed_at=expired_at - 1, cert_expires_at=expired_at)
    entitlement = Entitlement(RUN, admission, lambda: NOW)
    assert not entitlement.entitled(backdated)
    rules = RunRecordRules(RUN, 1, admission)
    sealed = seal_record(PEER, RUN, backdated)
    subkey = record_subkey(5, PEER.peer_id)
    assert rules.check(rounds_key(RUN, 0), subkey, sealed, NOW + 3000, NOW) is not None


def test_a_record_may_not_close_before_the_round_it_follows() -> None:
    """Within the hour, a key that expired can still sign a close time from before its
    expiry; the chain's order stops it: the round before closed after that time."""
    admission = Admission(synchronizers="certified", operator=OPERATOR.peer_id)
    expired_at = NOW - 600
    entitlement = Entitlement(RUN, admission, lambda: NOW)
    chains = [{4: record(4, Identity.generate().peer_id, [], closed_at=NOW - 30)}]
    entitlement.follow(chains)
    assert not entitlement.entitled(certified_record(closed_at=expired_at - 1, cert_expires_at=expired_at))


def test_a_committed_record_stays_valid_to_follow_after_its_certificate_ran_out() -> None:
    """A record closed while its certificate was valid is followed for the hour it lives."""
    admission = Admission(synchronizers="certified", operator=OPERATOR.peer_id)
    entitlement = Entitlement(RUN, admission, lambda: NOW)
    chains = [{4: record(4, PEER.peer_id, [], closed_at=NOW - 1860)}]
    entitlement.follow(chains)
    assert entitlement.entitled(certified_record(closed_at=NOW - 1800, cert_expires_at=NOW - 1700))


def test_a_record_closing_in_the_future_or_kept_longer_than_its_close_allows_is_refused() -> None:
    entitlement = Entitlement(RUN, Admission(), lambda: NOW)
    assert not entitlement.entitled(record(1, PEER.peer_id, [], closed_at=NOW + 3600))
    sealed = seal_record(PEER, RUN, record(1, PEER.peer_id, [], closed_at=NOW - 1000))
    refusal = RULES.check(rounds_key(RUN, 0), record_subkey(1, PEER.peer_id), sealed, NOW + 3600, NOW)
    assert refusal is not None and "after its close" in refusal


def test_aged_sybil_beats_do_not_pull_the_swarm_clock_once_the_chain_named_its_peers() -> None:
    """30 free identities publish one beat each (a life of 240 s) and let it age: each
    reads as a clock `age` seconds behind. Counted as votes, they pulled every honest
    peer's swarm clock back by their age (measured: rounds per minute fell ~30% under 30
    Sybils); only peers the chain named (or entitled, in a certified run) vote."""
    from p2pdiloco.protocol.membership import swarm_offset_s

    honest = [Identity.generate().peer_id for _ in range(3)]
    sybils = [Identity.generate().peer_id for _ in range(30)]
    opened = {p: (Heartbeat(peer_id=p, status="training", sent_at=NOW - 1.0, live_s=8.0), NOW + 60) for p in honest}
    opened.update(
        {p: (Heartbeat(peer_id=p, status="training", sent_at=NOW - 30.0, live_s=240.0), NOW + 269) for p in sybils}
    )
    assert swarm_offset_s(opened, NOW, honest[0]) <= -25.0  # the attack, counted as votes
    entitlement = Entitlement(RUN, Admission(), lambda: NOW)
    entitlement.follow([{0: record(0, honest[0], honest[1:])}])
    assert swarm_offset_s(opened, NOW, honest[0], entitlement.votes_on_clock) == 0.0
    # before the first record every beat votes (a run must be able to start)
    fresh = Entitlement(RUN, Admission(), lambda: NOW)
    fresh.follow([{}])
    assert all(fresh.votes_on_clock(b) for b, _ in opened.values())
