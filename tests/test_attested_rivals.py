"""A record for the open round whose update nobody holds must not take the round.

A key the chain named once (one merged delta, in an open run) can sign a record for the
round being merged, on the right parent, naming an update that exists nowhere and any
holders it likes. Before holder receipts, the round's synchronizer yielded to any such
rival ("committed elsewhere") and every replica waited on the forged update until the
round was re-run, a round deadline later, every round the attacker signed
(`bench_attack --network forged_state`: 0.00 of the clean rate). Now a holder signs a
receipt for the update it keeps; a record carrying one from a peer another synchronizer's
record named outranks a record only its signer vouches for (`rounds.attested_records`),
and a synchronizer holding receipts does not yield to such a rival.

The pure rule first (records signed by real keys), then the real roles (`test_commit`'s
cluster: in-memory transport, real ReplicaSync, Synchronizer, LearnerLink and holders).
"""

from __future__ import annotations

import os
from dataclasses import replace

from test_commit import RUN, Cluster
from test_rerun_held import LIE_ROUND, contribute_all, honest_rounds, scenario, top_of

from p2pdiloco.identity import Identity
from p2pdiloco.protocol.rounds import (
    ROUND_RECORD_TTL_S,
    RoundRecord,
    attested_records,
    canonical_chain,
    decode_round_record,
    open_record,
    rank,
    record_subkey,
    rounds_key,
    seal_record,
    sign_receipt,
    standing_key,
)
from p2pdiloco.wire import messages

GENESIS = "genesis"
KEYS = [Identity.generate() for _ in range(6)]


def signed(key: Identity, record: RoundRecord, run: str = RUN) -> RoundRecord:
    """`record` as a peer reads it from the DHT: sealed by `key`, opened again."""
    opened = open_record(run, seal_record(key, run, record))
    assert opened is not None
    return opened


def chain_of(run: str, length: int, signers: list[Identity], named: list[Identity]) -> list[RoundRecord]:
    """`length` honest rounds from genesis, synchronizers taking turns, every key of
    `named` a contributor of each."""
    records, parent = [], GENESIS
    for round_id in range(length):
        key = signers[round_id % len(signers)]
        record = RoundRecord(
            round=round_id, fragment=0, synchronizer=key.peer_id, hash=f"h{round_id}", parent=parent,
            digest=f"d{round_id}", contributors=tuple((k.peer_id, 1.0, 64) for k in named), closed_at=100.0 + round_id,
        )  # fmt: skip
        records.append(signed(key, record, run))
        parent = record.hash
    return records


def rival(run: str, key: Identity, round_id: int, parent: str, holders: list[Identity], receipts: list[Identity]) -> RoundRecord:
    """A record of (round, fragment 0) by `key` naming `holders`, with the receipts
    `receipts` signed for its digest (in the holders' order)."""
    digest = os.urandom(8).hex()
    return signed(
        key,
        RoundRecord(
            round=round_id, fragment=0, synchronizer=key.peer_id, hash=os.urandom(8).hex(), parent=parent,
            digest=digest, holders=tuple(h.peer_id for h in holders),
            receipts=tuple(sign_receipt(h, run, round_id, 0, digest) for h in receipts), closed_at=200.0,
        ),  # fmt: skip
        run,
    )


def ranked_pair(run: str, round_id: int) -> tuple[Identity, Identity]:
    """(better, worse): two of KEYS by their rank for (round, fragment 0)."""
    probes = {k.peer_id: k for k in KEYS[:2]}
    order = sorted(probes, key=lambda p: rank(run, RoundRecord(round_id, 0, p, "")))
    return probes[order[0]], probes[order[1]]


def test_an_attested_record_outranks_a_better_ranked_one_only_its_signer_vouches_for() -> None:
    attacker, honest = ranked_pair(RUN, 5)  # the attacker's key ranks first for round 5
    holder, other = KEYS[2], KEYS[3]
    history = chain_of(RUN, 5, [honest, attacker, other], [holder, other, honest, attacker])
    head = history[-1].hash
    forged = rival(RUN, attacker, 5, head, holders=[holder, other], receipts=[])  # named, no receipt
    honest_record = rival(RUN, honest, 5, head, holders=[holder], receipts=[holder])

    assert canonical_chain(RUN, [*history, forged], GENESIS)[5] == forged  # alone, it is followed
    chain = canonical_chain(RUN, [*history, forged, honest_record], GENESIS, open_run=True)
    assert chain[5] == honest_record
    assert chain == canonical_chain(RUN, [*history, honest_record, forged], GENESIS, open_run=True)
    # two attested rivals: rank decides, as before receipts
    attested_forgery = rival(RUN, attacker, 5, head, holders=[other], receipts=[other])
    assert canonical_chain(RUN, [*history, honest_record, attested_forgery], GENESIS)[5] == attested_forgery


def test_receipts_count_only_from_independent_named_holders_with_valid_signatures() -> None:
    attacker, honest = ranked_pair(RUN, 5)
    holder, free = KEYS[2], KEYS[4]  # `free`: a key no honest record ever named
    history = chain_of(RUN, 5, [honest, KEYS[3]], [holder, attacker])
    head = history[-1].hash

    def attested(record: RoundRecord, records: list[RoundRecord] = history) -> bool:
        return standing_key(record) in attested_records(RUN, [*records, record])

    assert attested(rival(RUN, honest, 5, head, [holder], [holder]))
    assert not attested(rival(RUN, attacker, 5, head, [attacker], [attacker]))  # its own receipt
    assert not attested(rival(RUN, attacker, 5, head, [free], [free]))  # a free key's
    assert not attested(rival(RUN, attacker, 5, head, [holder], [free]))  # another key's signature
    assert not attested(rival(RUN, attacker, 5, head, [holder], [holder]), [])  # no known ancestry
    other_run = rival("another-run", honest, 5, head, [holder], [holder])
    assert not attested(replace(other_run, sealed=b""))
    # a receipt for another digest (copied from an honest record) does not carry over
    honest_record = rival(RUN, honest, 5, head, [holder], [holder])
    copied = signed(attacker, replace(honest_record, synchronizer=attacker.peer_id, digest="elsewhere"))
    assert not attested(copied)
    # the attacker names the free key in records of its own, copying honest hashes: those
    # names do not count for its records
    minted = [
        signed(attacker, replace(r, synchronizer=attacker.peer_id, contributors=((free.peer_id, 1.0, 64),)))
        for r in history
    ]
    assert not attested(rival(RUN, attacker, 5, head, [free], [free]), [*history, *minted])


def test_a_record_with_more_receipts_than_holders_or_odd_sized_ones_is_not_a_record() -> None:
    good = rival(RUN, KEYS[0], 1, GENESIS, [KEYS[1]], [KEYS[1]])
    assert decode_round_record(good.encode()) == good
    assert decode_round_record(replace(good, receipts=(*good.receipts, good.receipts[0])).encode()) is None
    assert decode_round_record(replace(good, receipts=(b"x" * 63,)).encode()) is None
    assert decode_round_record(replace(good, receipts=("x" * 64,)).encode()) is None
    # a record without receipts keeps the bytes it always had
    assert b"receipts" not in replace(good, receipts=()).packed()


def test_a_named_peers_record_for_the_open_round_whose_update_nobody_holds_does_not_take_it() -> None:
    """The attacker is a peer the chain named (it contributed honestly before); it signs a
    record for the round being merged, on the right parent, naming the round's learners
    as holders (without their receipts). The elected synchronizer still commits, with its
    holders' receipts, and every replica follows its record at once (no re-run)."""

    async def body(cluster: Cluster) -> None:
        await honest_rounds(cluster, range(LIE_ROUND))
        top = top_of(cluster, LIE_ROUND)
        attacker = next(n for n in cluster.nodes.values() if n is not top)
        learners = [n for n in cluster.nodes.values() if n not in (top, attacker)]
        now = attacker.transport.now()
        forged = RoundRecord(
            round=LIE_ROUND, fragment=0, synchronizer=attacker.peer_id, hash=os.urandom(16).hex(),
            parent=top.hash(), digest=os.urandom(16).hex(), holders=tuple(n.peer_id for n in learners),
            contributors=((attacker.peer_id, 1.0, 64),), closed_at=now,
        )  # fmt: skip
        sealed = seal_record(attacker.transport.identity, RUN, forged)
        key, subkey = rounds_key(RUN, 0), record_subkey(LIE_ROUND, attacker.peer_id)
        assert await attacker.transport.store(key, subkey, sealed, now + ROUND_RECORD_TTL_S)

        outcomes = await contribute_all(learners, LIE_ROUND)
        assert {o.status for o in outcomes} == {messages.Reply.MERGED}, outcomes
        for node in cluster.nodes.values():
            assert await node.replicas.sync_fragment(0)
            record = node.replicas.committed(0, LIE_ROUND)
            assert record is not None and record.synchronizer == top.peer_id, node.peer_id
            assert node.state.round_of(0) == LIE_ROUND + 1
        assert record.receipts and set(record.holders[: len(record.receipts)]) <= {n.peer_id for n in learners}
        assert standing_key(record) in attested_records(RUN, cluster.dht_records().values())
        assert len({n.hash() for n in cluster.nodes.values()}) == 1
        await honest_rounds(cluster, range(LIE_ROUND + 1, LIE_ROUND + 2))  # and the run goes on

    scenario(4, body)
