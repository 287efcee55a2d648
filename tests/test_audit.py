"""Verifiable merges: peers recompute a round from its signed contributions.

Peers are wired as in `test_commit` (in-memory transport, real ReplicaSync,
Synchronizer and LearnerLink). One synchronizer lies: it publishes an update ten times
the merge it computed, with a record whose hash matches the lie. An auditing peer must
refuse it, prove it, ban the liar and tell the run; a peer that applied it without
auditing must verify the notice itself and repair; an honest round must pass every audit.
"""

from __future__ import annotations

import asyncio
import dataclasses

from test_commit import CONFIG, LIMITS, RUN, Cluster, Node, scenario

from p2pdiloco import compress
from p2pdiloco.outer.fragment_state import outer_update
from p2pdiloco.outer.step import tensor_norm
from p2pdiloco.protocol.election import synchronizer_order
from p2pdiloco.roles.audit_gate import Gate
from p2pdiloco.trust.audit import (
    MISMATCH,
    NOTICE_TTL_S,
    OK,
    Auditor,
    FraudNotice,
    notice_subkey,
    notices_key,
    open_notice,
    seal_notice,
)
from p2pdiloco.wire import messages
from p2pdiloco.wire.updates import new_update

ALWAYS = 64.0
"""An audit share above the number of contributors: every peer audits every round."""


def auditing(node: Node, share: float) -> None:
    node.replicas.audits.auditor = Auditor(RUN, CONFIG, LIMITS, node.state.fragments)
    node.replicas.audits.audit_share = share


def lying(node: Node, factor: float = 10.0) -> None:
    """Make `node`'s synchronizer publish `factor` times the merge it computed."""
    honest = node.sync.committer._merge

    def merge(window, grace_s):
        merged = honest(window, grace_s)
        if merged.update is None:
            return merged
        forged = {n: t * factor for n, t in merged.result.decoded.items()}
        encoded = {n: node.sync.committer.outer_codec.encode(t) for n, t in forged.items()}
        decoded = {n: compress.decode_tensor(e) for n, e in encoded.items()}
        advanced = outer_update(node.state.export_fragment(window.fragment), decoded, node.state.outer)
        forged_update = new_update(
            RUN, window.round, window.fragment, node.peer_id, merged.update.parent, advanced.hash,
            list(merged.update.contributors), encoded, grace_s,
        )
        return dataclasses.replace(merged, advanced=advanced, update=forged_update, norm=tensor_norm(decoded))

    node.sync.committer._merge = merge


def roles(cluster: Cluster, round_id: int) -> tuple[Node, list[Node]]:
    """(the synchronizer of `round_id`, the other peers)."""
    top = synchronizer_order(RUN, round_id, 0, list(cluster.nodes))[0]
    return cluster.nodes[top], [n for p, n in cluster.nodes.items() if p != top]


async def honest_round_zero(cluster: Cluster) -> None:
    _, learners = roles(cluster, 0)
    outcomes = await asyncio.gather(
        learners[0].link.contribute(0, 0, learners[0].frame(1.0)),
        learners[1].link.contribute(0, 0, learners[1].frame(2.0)),
    )
    assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
    for node in cluster.nodes.values():
        assert await node.replicas.sync_fragment(0)
        assert node.state.round_of(0) == 1


async def honest_round(cluster: Cluster, round_id: int) -> None:
    _, (first, second) = roles(cluster, round_id)
    outcomes = await asyncio.gather(
        first.link.contribute(0, round_id, first.frame(1.0, round_id=round_id)),
        second.link.contribute(0, round_id, second.frame(2.0, round_id=round_id)),
    )
    assert [o.status for o in outcomes] == [messages.Reply.MERGED, messages.Reply.MERGED]
    for node in cluster.nodes.values():
        assert await node.replicas.sync_fragment(0)


def audit_events(node: Node) -> list[dict]:
    return [e for e in node.events if e.get("event") == "audited"]


def test_an_honest_round_passes_every_audit() -> None:
    async def body(cluster: Cluster) -> None:
        for node in cluster.nodes.values():
            auditing(node, ALWAYS)
        await honest_round_zero(cluster)
        synchronizer, _ = roles(cluster, 0)
        audits = [e for n in cluster.nodes.values() for e in audit_events(n)]
        assert audits, "nobody audited"
        assert {e["verdict"] for e in audits} == {OK}
        assert all(e["synchronizer"] == synchronizer.peer_id for e in audits)
        hashes = {n.state.fragment_hash(0) for n in cluster.nodes.values()}
        assert len(hashes) == 1

    scenario(3, body)


def test_a_false_merge_is_refused_proven_and_its_synchronizer_banned() -> None:
    async def body(cluster: Cluster) -> None:
        await honest_round_zero(cluster)
        liar, (first, second) = roles(cluster, 1)
        lying(liar)
        auditing(first, ALWAYS)  # audits every round
        auditing(second, 0.0)  # audits nothing: must act on the notice, after checking it
        honest_hash = first.state.fragment_hash(0)
        await asyncio.gather(
            first.link.contribute(0, 1, first.frame(1.0, round_id=1)),
            second.link.contribute(0, 1, second.frame(2.0, round_id=1)),
        )
        # the auditor refused the update, proved it false, banned the liar
        verdicts = [e["verdict"] for e in audit_events(first)]
        assert MISMATCH in verdicts, first.events
        assert first.state.round_of(0) == 1 and first.state.fragment_hash(0) == honest_hash
        assert liar.peer_id in first.replicas.entitlement.banned
        assert not first.replicas.entitlement.may_synchronize(dataclasses.replace(next(iter(first.members().values())), peer_id=liar.peer_id))
        # ... and told the run, with a notice signed by the auditor
        notices = cluster.network._get(notices_key(RUN))
        (subkey, (raw, _)), = notices.items()
        notice = open_notice(RUN, subkey, raw)
        assert notice.synchronizer == liar.peer_id and notice.auditor == first.peer_id
        # the peer that applied the lie checks the notice itself, then repairs
        assert second.state.round_of(0) == 2
        await second.replicas.check_notices()
        assert liar.peer_id in second.replicas.entitlement.banned
        assert second.state.round_of(0) == 1 and second.state.fragment_hash(0) == honest_hash, second.events[-6:]
        assert any(e.get("event") == "convicted" for e in second.events)

    scenario(3, body)


def test_a_false_notice_changes_nothing() -> None:
    async def body(cluster: Cluster) -> None:
        await honest_round_zero(cluster)
        synchronizer, (accuser, reader) = roles(cluster, 0)
        for node in (accuser, reader):
            auditing(node, 0.0)
        record = reader.replicas.committed(0, 0)
        lie = FraudNotice(0, 0, record.synchronizer, record.digest, accuser.peer_id)
        await accuser.transport.store(
            notices_key(RUN), notice_subkey(0, 0, accuser.peer_id),
            seal_notice(accuser.transport.identity, RUN, lie), accuser.transport.now() + NOTICE_TTL_S,
        )
        before = reader.state.fragment_hash(0)
        await reader.replicas.check_notices()
        # the reader is past round 0 and the accuser too: nobody holds the parent state,
        # so the notice is not verified and nothing happens
        assert reader.state.fragment_hash(0) == before
        assert synchronizer.peer_id not in reader.replicas.entitlement.banned

    scenario(3, body)


def test_an_audit_with_a_tampered_record_is_a_mismatch_and_a_missing_contribution_unverifiable() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, learners = roles(cluster, 0)
        snapshot = learners[0].state.export_fragment(0)
        await honest_round_zero(cluster)
        record = learners[0].replicas.committed(0, 0)
        contributions = synchronizer.sync.kept.get(0, 0)
        auditing(learners[0], ALWAYS)
        auditor = learners[0].replicas.audits.auditor
        chain = {}
        assert auditor.check(record, contributions, snapshot, chain).verdict == OK
        heavier = tuple((p, w * 1.5, t) for p, w, t in record.contributors)
        assert auditor.check(dataclasses.replace(record, contributors=heavier), contributions, snapshot, chain).verdict == MISMATCH
        assert auditor.check(dataclasses.replace(record, hash="f" * 32), contributions, snapshot, chain).verdict == MISMATCH
        assert auditor.check(record, contributions[:1], snapshot, chain).verdict == "unverifiable"
        moved = dataclasses.replace(snapshot, hash="other")
        assert auditor.check(record, contributions, moved, chain).verdict == "unverifiable"

    scenario(3, body)


def test_a_merge_of_fewer_contributions_than_the_quorum_is_a_mismatch() -> None:
    """The quorum rule is the merge's (`RoundMerge.quorate`): the synchronizer commits
    only a quorate merge, and the audit refuses a record whose merge is not, so a
    synchronizer cannot commit a merge of one delta in a run whose quorum is two."""

    async def body(cluster: Cluster) -> None:
        _, learners = roles(cluster, 0)
        snapshot = learners[0].state.export_fragment(0)
        await honest_round_zero(cluster)  # two contributions merged
        record = learners[0].replicas.committed(0, 0)
        synchronizer, _ = roles(cluster, 0)
        contributions = synchronizer.sync.kept.get(0, 0)
        assert len(record.contributors) == 2
        for quorum, verdict in ((2, OK), (3, MISMATCH)):
            config = dataclasses.replace(CONFIG, sync=dataclasses.replace(CONFIG.sync, min_quorum=quorum))
            auditor = Auditor(RUN, config, LIMITS, learners[0].state.fragments)
            result = auditor.check(record, contributions, snapshot, {})
            assert result.verdict == verdict, result
            if verdict == MISMATCH:
                assert "quorum (3)" in result.reason

    scenario(3, body)


def test_the_audit_gate_says_apply_convicted_or_moved_in_one_call() -> None:
    """`Audits.judge` is the one question the replica asks before applying: with every
    peer auditing, an honest record on its parent state is APPLY, the same record with its
    result forged is CONVICTED (with the reason), and one whose parent this replica has
    already moved past is MOVED (a local race: no audit, no distrust)."""

    async def body(cluster: Cluster) -> None:
        _, learners = roles(cluster, 0)
        parent = learners[0].state.export_fragment(0)
        await honest_round_zero(cluster)
        record = learners[0].replicas.committed(0, 0)
        auditing(learners[0], ALWAYS)
        gate = learners[0].replicas.audits
        chain = learners[0].replicas.chains[0]

        async def state_of(snapshot):
            return snapshot

        moved = learners[0].state.export_fragment(0)  # round 0 applied: past its parent
        assert await gate.judge(record, 1.0, lambda: state_of(parent), chain) == (Gate.APPLY, "")
        forged = dataclasses.replace(record, hash="f" * 32)
        verdict, why = await gate.judge(forged, 1.0, lambda: state_of(parent), chain)
        assert verdict is Gate.CONVICTED and "hash differs" in why
        assert await gate.judge(record, 1.0, lambda: state_of(moved), chain) == (Gate.MOVED, "")
        gate.auditor = None  # a peer that does not audit applies what the chain commits
        assert await gate.judge(forged, 1.0, lambda: state_of(parent), chain) == (Gate.APPLY, "")

    scenario(3, body)


def test_an_update_out_of_line_is_audited_by_everyone_even_with_no_sampling() -> None:
    async def body(cluster: Cluster) -> None:
        for node in cluster.nodes.values():
            auditing(node, 0.0)  # no sampled audits at all
        for round_id in range(4):  # a history of honest updates
            await honest_round(cluster, round_id)
        assert not [e for n in cluster.nodes.values() for e in audit_events(n)]
        liar, (first, second) = roles(cluster, 4)
        lying(liar, factor=10.0)
        honest_hash = first.state.fragment_hash(0)
        await asyncio.gather(
            first.link.contribute(0, 4, first.frame(1.0, round_id=4)),
            second.link.contribute(0, 4, second.frame(2.0, round_id=4)),
        )
        for node in (first, second):  # ten times the usual step: audited, proven, refused
            assert MISMATCH in [e["verdict"] for e in audit_events(node)], [
                (n.peer_id[-4:], e) for n in cluster.nodes.values() for e in n.events if e["event"] in ("audited", "convicted")
            ]
            assert liar.peer_id in node.replicas.entitlement.banned
            assert node.state.round_of(0) == 4 and node.state.fragment_hash(0) == honest_hash

    scenario(3, body)


# --- what cannot be verified is not applied (issue 28, item 7) ---------------------------


def refusing_audits(node: Node) -> None:
    """`node` keeps no contributions to serve: every `get_contributions` is refused."""
    node.sync.committer.kept.get = lambda *args: None


def test_an_out_of_line_update_whose_synchronizer_refuses_audits_is_not_applied() -> None:
    async def body(cluster: Cluster) -> None:
        for node in cluster.nodes.values():
            auditing(node, 0.0)
        for round_id in range(4):
            await honest_round(cluster, round_id)
        liar, (first, second) = roles(cluster, 4)
        lying(liar, factor=10.0)
        refusing_audits(liar)
        honest_hash = first.state.fragment_hash(0)
        await asyncio.gather(
            first.link.contribute(0, 4, first.frame(1.0, round_id=4)),
            second.link.contribute(0, 4, second.frame(2.0, round_id=4)),
        )
        for node in (first, second):
            await node.replicas.sync_fragment(0)  # another pass: still held
            # before: the audit was "unverifiable" and the update applied anyway
            assert node.state.round_of(0) == 4 and node.state.fragment_hash(0) == honest_hash
            assert [e for e in node.events if e["event"] == "unverified"]
            record = node.replicas.committed(0, 4)
            assert record.digest in node.replicas.audits.unverified_since
        assert liar.state.round_of(0) == 5  # the liar installed its own

    scenario(3, body)


def test_an_in_line_update_whose_synchronizer_refuses_a_sampled_audit_is_applied() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, learners = roles(cluster, 0)
        refusing_audits(synchronizer)
        for node in learners:
            auditing(node, ALWAYS)
        await honest_round_zero(cluster)  # asserts every peer reached round 1
        assert not [e for n in learners for e in n.events if e["event"] == "unverified"]

    scenario(3, body)


def test_a_record_claiming_no_history_where_the_chain_holds_it_is_unverifiable() -> None:
    async def body(cluster: Cluster) -> None:
        for node in cluster.nodes.values():
            auditing(node, 0.0)
        for round_id in range(4):
            await honest_round(cluster, round_id)
        synchronizer, (first, _) = roles(cluster, 3)
        record = first.replicas.committed(0, 3)
        assert record.history_from >= 0
        contributions = synchronizer.sync.kept.get(3, 0)
        auditor = first.replicas.audits.auditor
        chain = dict(first.replicas.chains[0])
        snapshot = first.state.export_fragment(0)  # not round 3's parent: checked after
        result = auditor.check(dataclasses.replace(record, history_from=-1), contributions, snapshot, chain)
        # before: "-1" was taken on trust and the merge recomputed with no history
        assert result.verdict == "unverifiable" and "claims no history" in result.reason

    scenario(3, body)


def test_the_sampling_rate_does_not_divide_by_what_the_synchronizer_lists() -> None:
    from p2pdiloco.roles.audit_gate import sampling_divisor

    assert sampling_divisor(1000, 4) == 4  # a record listing 1000 contributions: 4 live learners
    assert sampling_divisor(2, 10) == 2
    assert sampling_divisor(0, 0) == 1


# --- a flood of fraud notices (issue 28, item 11) ---------------------------------------


async def flood_notices(cluster: Cluster, record, count: int) -> list[str]:
    """`count` fresh, valid identities each publish a signed notice against `record`."""
    from p2pdiloco.identity import Identity

    notifiers = []
    for _ in range(count):
        identity = Identity.generate()
        notice = FraudNotice(record.fragment, record.round, record.synchronizer, record.digest, identity.peer_id)
        cluster.network._store(
            notices_key(RUN), notice_subkey(record.fragment, record.round, identity.peer_id),
            seal_notice(identity, RUN, notice), cluster[0].transport.now() + NOTICE_TTL_S,
        )
        notifiers.append(identity.peer_id)
    return notifiers


def test_a_flood_of_notices_from_valid_identities_costs_a_bounded_number_of_verifications() -> None:
    async def body(cluster: Cluster) -> None:
        synchronizer, (reader, _) = roles(cluster, 0)
        auditing(reader, 0.0)
        await honest_round_zero(cluster)
        record = reader.replicas.committed(0, 0)
        notifiers = await flood_notices(cluster, record, 100)
        audits = reader.replicas.audits
        fetches = []
        original = reader.replicas.downloads.fetch

        async def counted(donor, fragment, round_id):
            fetches.append(donor)
            return await original(donor, fragment, round_id)

        reader.replicas.downloads.fetch = counted
        clock = [0.0]
        audits.clock = lambda: clock[0]
        # strangers (no heartbeat): not one verification, however often it is read
        for _ in range(10):
            await reader.replicas.check_notices()
            clock[0] += 60.0
        assert audits.notice_verifications == 0 and not fetches
        # the same identities with live heartbeats (Sybils): a bounded few, ever
        audits.live_learners = lambda: notifiers + list(cluster.nodes)
        audits._notices_seen.clear()
        for _ in range(50):
            await reader.replicas.check_notices()
            clock[0] += 60.0
        # before: every notice verified on every peer, each a fragment download
        assert 1 <= audits.notice_verifications <= 2, audits.notice_verifications
        assert len(fetches) <= 2
        assert synchronizer.peer_id not in reader.replicas.entitlement.banned

    scenario(3, body)


def test_notices_are_not_read_on_every_sync_pass() -> None:
    async def body(cluster: Cluster) -> None:
        _, (reader, _) = roles(cluster, 0)
        auditing(reader, 0.0)
        await honest_round_zero(cluster)
        reads = []
        original = reader.transport.get

        async def counted(key, latest=True):
            if key == notices_key(RUN):
                reads.append(key)
            return await original(key, latest)

        reader.transport.get = counted
        for _ in range(20):  # twenty sync passes in a row
            await reader.replicas.check_notices()
        assert len(reads) == 1

    scenario(3, body)


def test_notices_of_strangers_that_fail_to_check_out_do_not_use_up_an_honest_auditors_try() -> None:
    """The audit: two notices used up a record's tries whoever sent them. A liar's two
    Sybils (free keys with live beats) accuse its own false record first; their notices
    cannot be checked (they serve no evidence). Then an honest auditor's notice arrives:
    before, the record's tries were spent and the lie stood on every peer that had applied
    it; now a notifier the chain named has a try of its own (and goes first)."""

    async def body(cluster: Cluster) -> None:
        await honest_round_zero(cluster)
        liar, (first, second) = roles(cluster, 1)
        lying(liar)
        auditing(first, ALWAYS)
        auditing(second, 0.0)
        honest_hash = first.state.fragment_hash(0)
        await asyncio.gather(
            first.link.contribute(0, 1, first.frame(1.0, round_id=1)),
            second.link.contribute(0, 1, second.frame(2.0, round_id=1)),
        )
        records = cluster.network._dht._records[notices_key(RUN)]
        (honest_subkey, honest_notice), = records.items()
        del records[honest_subkey]  # it comes later: the Sybils' go first
        lie = second.replicas.committed(0, 1)
        sybils = await flood_notices(cluster, lie, 2)
        audits = second.replicas.audits
        audits.live_learners = lambda: sybils + list(cluster.nodes)
        clock = [0.0]
        audits.clock = lambda: clock[0]
        for _ in range(4):
            await second.replicas.check_notices()
            clock[0] += 60.0
        assert audits.notice_verifications == 2 and liar.peer_id not in second.replicas.entitlement.banned
        records[honest_subkey] = honest_notice
        await second.replicas.check_notices()
        assert liar.peer_id in second.replicas.entitlement.banned
        assert second.state.round_of(0) == 1 and second.state.fragment_hash(0) == honest_hash

    scenario(3, body)
