"""Round records read from a peer instead of the DHT key (a swarm of N = 1,000).

With record epochs (`network.record_epoch_rounds`), every replica read its epoch's key
each sync pass: at N = 1,000 that is 500 reads a second on the five peers that store one
key, queued on their home uplinks, so a replica learned of a round 11 s after its commit
at p90 (23 s at p99) and the rounds took 30-60 s to reach 90 % of the swarm.

Now three passes in four ask one reachable peer for the records it holds from this
replica's round on (`get_records`), and every fourth reads the DHT as before: the reads
spread over every reachable peer, and the DHT stays the place where rival records meet
(a peer serves what it read there). A record from a peer is checked like one from the DHT
(its synchronizer's signature, the run's entitlement, the chain rules), so a peer can
withhold records (then the next DHT read brings them) but forge none. What a reply may add
is bounded: records of the rounds asked for, at most `MAX_SERVED_RECORDS`, at most
`MAX_RECORDS_PER_ROUND` per round, each kept until its signed close plus the record TTL.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from p2pdiloco import wire
from p2pdiloco.protocol.election import rendezvous_order
from p2pdiloco.protocol.membership import Heartbeat, past_round, synchronizer_candidates
from p2pdiloco.protocol.rounds import open_record, record_subkey, subkey_round
from p2pdiloco.wire import MessageKind, register_kind

RPC_GET_RECORDS = "get_records"
RECORDS_REQUEST = "records_request"
"""peer -> peer: the round records you hold of (fragment) from `round` on."""
RECORDS_REPLY = "records_reply"
"""peer -> peer: sealed round records (each signed by its synchronizer)."""
DHT_READ_EVERY = 4
"""Sync passes per DHT read of the records epochs; the others ask a peer."""
MAX_SERVED_RECORDS = 32
"""Records one reply carries (and one reply may add)."""
MAX_RECORDS_PER_ROUND = 8
"""Records of one round a reply may add (rival records of one round are few)."""
MAX_REPLY_BYTES = 1 << 20
RECORDS_TIMEOUT_S = 10.0
"""Deadline of one `get_records` call: a slow peer costs one pass, the next asks another."""
RECORDS_SALT = "records"

register_kind(
    MessageKind(
        RECORDS_REQUEST,
        required={"peer": "str"},
        carries_tensors=False,
    )
)
register_kind(
    MessageKind(
        RECORDS_REPLY,
        required={"peer": "str", "records": "list"},
        carries_tensors=False,
    )
)


def records_request(run: str, fragment: int, from_round: int, me: str) -> bytes:
    """Ask for the records of `fragment` from `from_round` on."""
    message = wire.Message(
        kind=RECORDS_REQUEST, run=run, round=from_round, fragment=fragment, meta={"peer": me}
    )
    return wire.encode_message(message)


def records_reply(run: str, fragment: int, me: str, sealed: list[bytes]) -> bytes:
    message = wire.Message(
        kind=RECORDS_REPLY, run=run, round=0, fragment=fragment,
        meta={"peer": me, "records": sealed[:MAX_SERVED_RECORDS]},
    )  # fmt: skip
    return wire.encode_message(message)


def asked_rounds(from_round: int, epoch_rounds: int) -> range:
    """The rounds a `get_records` reply may add for a replica at `from_round`: its epoch
    and the next (what a DHT read of the same pass brings, `ReplicaSync._read_records`)."""
    first = from_round // epoch_rounds * epoch_rounds
    return range(first, first + 2 * epoch_rounds)


def served(
    raw: Mapping[str, tuple[bytes, float]], from_round: int, now: float, epoch_rounds: int = 0
) -> list[bytes]:
    """What this peer answers: the unexpired records it holds of rounds `from_round` on,
    lowest rounds first, at most `MAX_SERVED_RECORDS`; with epochs, only those of the
    rounds the asker keeps (`asked_rounds`): a peer far ahead sent up to 32 records of
    which a replica behind it kept 2 (with epochs of one round)."""
    until = asked_rounds(from_round, epoch_rounds).stop if epoch_rounds > 0 else None
    found = []
    for subkey, (sealed, expiration) in raw.items():
        round_id = subkey_round(subkey)
        if (
            expiration >= now and round_id is not None and round_id >= from_round
            and (until is None or round_id < until)
        ):  # fmt: skip
            found.append((round_id, subkey, sealed))
    return [sealed for _, _, sealed in sorted(found)[:MAX_SERVED_RECORDS]]


def parse_records_reply(raw: object, limits: wire.WireLimits, run: str) -> list[bytes] | str:
    """The sealed records of a `get_records` reply, or why it is refused (never raises)."""
    msg = wire.decode_message(raw, limits)
    if isinstance(msg, wire.Rejected):
        return msg.reason
    if msg.kind != RECORDS_REPLY or msg.run != run:
        return f"expected a {RECORDS_REPLY} of this run"
    records = msg.meta["records"]
    if len(records) > MAX_SERVED_RECORDS or not all(isinstance(r, bytes) for r in records):
        return f"records must be at most {MAX_SERVED_RECORDS} sealed records"
    return list(records)


def admit(
    kept: dict[str, tuple[bytes, float]],
    sealed_records: list[bytes],
    run: str,
    fragment: int,
    rounds: range,
    ttl_s: float,
    now: float,
) -> int:
    """Add the records of `fragment` and of `rounds` among `sealed_records` to `kept` (subkey ->
    sealed, expiration), as a DHT read would: under their own subkey, until their signed
    close plus `ttl_s` (never past now + `ttl_s`). At most `MAX_RECORDS_PER_ROUND` per
    round in all. Signatures are checked here, entitlement and chain rules where `kept`
    is read (`records_of`, `canonical_chain`). Returns how many were new."""
    per_round = Counter(r for r in map(subkey_round, kept) if r is not None)
    added = 0
    for sealed in sealed_records:
        record = open_record(run, sealed)
        if record is None or record.fragment != fragment or record.round not in rounds:
            continue
        subkey = record_subkey(record.round, record.synchronizer)
        if subkey in kept or per_round[record.round] >= MAX_RECORDS_PER_ROUND:
            continue
        kept[subkey] = (sealed, min(record.closed_at, now) + ttl_s)
        per_round[record.round] += 1
        added += 1
    return added


def records_source(
    me: str, members: Mapping[str, Heartbeat], fragment: int, round_id: int, pass_no: int
) -> str | None:
    """The reachable peer this pass asks: among the live peers that accept connections,
    those whose beat claims a later round of `fragment` first, one per pass in an order
    of this peer's own (a rendezvous hash over its id and the pass), so the reads of a
    thousand replicas spread over every reachable peer."""
    live = [p for p in synchronizer_candidates(members) if p != me]
    pool = past_round(members, live, fragment, round_id) or live
    if not pool:
        return None
    return rendezvous_order(f"{RECORDS_SALT}/{me}", pass_no, fragment, pool)[0]
