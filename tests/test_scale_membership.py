"""Issue 29, item 2: membership in shards and round records in epochs, so a peer's
protocol cost stays bounded as the swarm grows (docs/scale.md). Real Membership objects
on the in-memory transport with the run's record rules; the chain across epochs by the
simulator's real roles."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pdiloco import wire
from p2pdiloco.config import ConfigError, OuterConfig, RunConfig, replace
from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import (
    Heartbeat,
    member_shard,
    member_shard_key,
    members_key,
    seal_heartbeat,
    shard_of_key,
    synchronizer_candidates,
)
from p2pdiloco.protocol.rounds import (
    RoundRecord,
    epoch_of_key,
    record_subkey,
    rounds_key,
    seal_record,
)
from p2pdiloco.roles.presence import Membership, read_members
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.sim.links import LOOPBACK
from p2pdiloco.sim.swarm import sim_config, simulate
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.trust.record_rules import RunRecordRules

RUN = "scale"
NOW = 1_800_000_000.0
HEARTBEAT_S = 2.0


def test_shard_and_epoch_keys_round_trip_and_one_shard_is_the_old_key() -> None:
    assert member_shard_key(RUN, 0, 1) == members_key(RUN)
    assert shard_of_key(RUN, member_shard_key(RUN, 5, 64)) == (5, 64)
    assert shard_of_key(RUN, f"{members_key(RUN)}/3/1") is None  # not a power of two
    assert shard_of_key(RUN, f"{members_key(RUN)}/64/64") is None
    assert rounds_key(RUN, 0, 17, 0) == rounds_key(RUN, 0)
    assert epoch_of_key(RUN, 0, rounds_key(RUN, 0, 17, 8)) == (8, 2)
    assert epoch_of_key(RUN, 1, rounds_key(RUN, 0, 17, 8)) is None


def test_the_record_rules_keep_each_heartbeat_in_its_shard_and_each_record_in_its_epoch() -> None:
    rules = RunRecordRules(RUN, 1)
    peer = Identity.generate()
    sealed = seal_heartbeat(peer, RUN, Heartbeat(peer_id=peer.peer_id, sent_at=NOW, live_s=8.0))
    own = member_shard(peer.peer_id, 16)
    assert rules.check(member_shard_key(RUN, own, 16), peer.peer_id, sealed, NOW + 60, NOW) is None
    other = member_shard_key(RUN, (own + 1) % 16, 16)
    assert "another peer's membership shard" in rules.check(
        other, peer.peer_id, sealed, NOW + 60, NOW
    )
    record = seal_record(
        peer,
        RUN,
        RoundRecord(round=17, fragment=0, synchronizer=peer.peer_id, hash="h", closed_at=NOW),
    )
    subkey = record_subkey(17, peer.peer_id)
    assert rules.check(rounds_key(RUN, 0, 17, 8), subkey, record, NOW + 60, NOW) is None
    assert "another epoch" in rules.check(rounds_key(RUN, 0, 8, 8), subkey, record, NOW + 60, NOW)


def test_member_shards_must_be_a_power_of_two() -> None:
    with pytest.raises(ConfigError, match="member_shards"):
        replace(RunConfig(), network={"member_shards": 3})
    with pytest.raises(ConfigError, match="record_epoch_rounds"):
        replace(RunConfig(), network={"record_epoch_rounds": -1})


def test_a_sharded_membership_reads_one_shard_per_beat_and_still_sees_everyone() -> None:
    """12 peers, 4 shards: each beat reads one shard key; after one rotation every peer's
    view holds all 12; a peer that stops beating is gone once its shard is read again
    after its signed life ran out."""
    now = [NOW]

    async def main() -> None:
        network = MemoryNetwork(clock=lambda: now[0])
        rules = RunRecordRules(RUN, 1)
        transports = [MemoryTransport(network, record_rules=rules) for _ in range(12)]
        members = []
        for transport in transports:
            await transport.start()
            beat = Heartbeat(peer_id=transport.peer_id, status="training")
            members.append(
                Membership(
                    transport, RUN, HEARTBEAT_S, "", lambda b=beat: b, lambda e: None, shards=4
                )
            )
        for _ in range(8):  # two rotations: each shard read once after all peers beat
            for m in members:
                await m.beat()
            now[0] += HEARTBEAT_S
        ids = {t.peer_id for t in transports}
        for m in members:
            assert set(m.view()) == ids, f"{m.transport.peer_id[-6:]} sees {len(m.view())}"
        for m in members:  # only shard keys were read, never a whole-membership key
            read = {k for k in m.transport.traffic.by_key if "members" in k}
            assert read and all(shard_of_key(RUN, k) is not None for k in read)
        everyone = await read_members(transports[0], RUN, 4)  # what the dashboard reads
        assert set(everyone) == ids
        gone = members.pop()
        for _ in range(
            12
        ):  # its life (4 periods, + the clock dead band) ends, its shard is read again
            for m in members:
                await m.beat()
            now[0] += HEARTBEAT_S
        for m in members:
            assert gone.transport.peer_id not in m.view()
            assert len(m.view()) == 11

    asyncio.run(main())


def test_a_newcomer_sees_every_shard_at_once_and_is_elected_only_once_everyone_has_read_it() -> None:
    """8 shards: a newcomer's first beat reads all of them (its view is whole at once,
    not after 8 beats). The others see it only when their rotation reaches its shard, so
    it is no candidate in any view (its own included) until a rotation has passed; then
    it is one in every view. A swarm where nobody has settled yet elects its oldest peer,
    the one every view holds, so its first rotation makes no rival records either."""
    now = [NOW]

    async def main() -> None:
        network = MemoryNetwork(clock=lambda: now[0])
        rules = RunRecordRules(RUN, 1)

        async def join() -> Membership:
            transport = MemoryTransport(network, record_rules=rules)
            await transport.start()
            beat = Heartbeat(peer_id=transport.peer_id, status="training")
            member = Membership(transport, RUN, HEARTBEAT_S, "", lambda: beat, lambda e: None, shards=8)
            await member.beat()
            return member

        async def beat_for(periods: int) -> None:
            for _ in range(periods):
                now[0] += HEARTBEAT_S
                for m in members:
                    await m.beat()

        members = []
        for _ in range(11):  # joins a tenth of a second apart: each sweeps the ones before
            members.append(await join())
            now[0] += 0.1
        first = members[0].transport.peer_id
        views = [set(m.view()) for m in members]
        assert len(views[0]) == 1 and len(views[-1]) == 11  # the views disagree ...
        for m in members:  # ... but every one elects the oldest
            assert synchronizer_candidates(m.view(), settled=m.settled) == [first]
        assert len(synchronizer_candidates(members[-1].view())) == 11  # unsharded rule: all
        await beat_for(10)  # (8 shards + 2) periods: all 11 settled
        newcomer = await join()
        members.append(newcomer)
        everyone = {m.transport.peer_id for m in members}
        assert set(newcomer.view()) == everyone
        assert newcomer.transport.traffic.by_key.keys() >= {member_shard_key(RUN, s, 8) for s in range(8)}
        for m in members:
            assert newcomer.transport.peer_id not in synchronizer_candidates(m.view(), settled=m.settled)
        await beat_for(10)
        for m in members:
            assert set(synchronizer_candidates(m.view(), settled=m.settled)) == everyone

    asyncio.run(main())


def test_a_sweep_cut_off_by_its_deadline_goes_on_with_the_shards_it_had_not_read() -> None:
    """8 shards, 8 peers: a newcomer's first beat reads every shard, but the reads of
    shards 4-7 hang and the beat's deadline cuts it off. What arrived is in its view at
    once; its next beat reads shards 4-7 only (not all 8 again), and the beat after that
    starts the rotation: one shard."""
    now = [NOW]

    class Hanging(MemoryTransport):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.hang: set[str] = set()
            self.released = asyncio.Event()
            self.reads: list[str] = []

        async def get(self, key: str, *args, **kwargs):
            self.reads.append(key)
            if key in self.hang:
                await self.released.wait()
            return await super().get(key, *args, **kwargs)

    async def main() -> None:
        network = MemoryNetwork(clock=lambda: now[0])
        rules = RunRecordRules(RUN, 1)
        others = []
        for _ in range(8):
            transport = MemoryTransport(network, record_rules=rules)
            await transport.start()
            beat = Heartbeat(peer_id=transport.peer_id, status="training")
            others.append(Membership(transport, RUN, HEARTBEAT_S, "", lambda b=beat: b, lambda e: None, shards=8))
            await others[-1].transport.store(
                member_shard_key(RUN, member_shard(transport.peer_id, 8), 8), transport.peer_id,
                others[-1].sealed_beat()[0], NOW + 60,
            )  # fmt: skip
        keys = [member_shard_key(RUN, s, 8) for s in range(8)]
        transport = Hanging(network, record_rules=rules)
        await transport.start()
        transport.hang = set(keys[4:])
        beat = Heartbeat(peer_id=transport.peer_id, status="training")
        newcomer = Membership(transport, RUN, HEARTBEAT_S, "", lambda: beat, lambda e: None, shards=8)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(newcomer.beat(), 5.0)
        expected = {o.transport.peer_id for o in others if member_shard(o.transport.peer_id, 8) < 4}
        assert set(newcomer.view()) - {transport.peer_id} == expected
        transport.released.set()
        transport.reads.clear()
        await newcomer.beat()
        assert sorted(transport.reads) == sorted(keys[4:])
        assert set(newcomer.view()) == {transport.peer_id} | {o.transport.peer_id for o in others}
        transport.reads.clear()
        await newcomer.beat()
        assert len(transport.reads) == 1

    asyncio.run(main())


def test_records_in_epochs_keep_one_chain_across_epoch_boundaries() -> None:
    """Real roles (the simulator's peers) on records split into epochs of 2 rounds and
    membership in 2 shards: rounds go on past several epochs, one hash per round."""
    config = replace(
        sim_config(inner_steps=20), network={"member_shards": 2, "record_epoch_rounds": 2}
    )
    figures = simulate(4, 150.0, config=config, population=LOOPBACK, warmup_s=10.0)
    assert figures.rounds >= 5, figures.rounds
    assert figures.forks == 0
    assert figures.busiest_key.startswith("p2pdiloco/sim/")


def test_a_branch_whose_link_lies_in_an_epoch_read_before_makes_the_replica_read_it_again() -> None:
    """A rival record stored late in an epoch this replica had moved past was never read:
    the branch built on it looked like a free start here while other peers counted it from
    round 0, and the swarm followed two branches for good (simulated at N = 1,000). The
    replica now reads the epoch of any parent no record it read shows (within bounds)."""
    state = GlobalState({"w": torch.zeros(4)}, [["w"]], OuterConfig())
    replica = ReplicaSync(
        MemoryTransport(MemoryNetwork()), RUN, state, dict, wire.WireLimits(), None,  # type: ignore[arg-type]
        void_after_s=60.0, epoch_rounds=2,
    )  # fmt: skip

    def record(round_id: int, parent: str, hash_: str) -> RoundRecord:
        return RoundRecord(round=round_id, fragment=0, synchronizer="s", hash=hash_, parent=parent)

    linked = [record(10, "h9", "h10"), record(11, "h10", "h11")]
    replica._epochs_this_pass[0] = {5, 6}
    assert replica._parent_epochs_unread(0, linked) == {4}  # round 9 lives in epoch 4
    replica._epochs_this_pass[0] = {4, 5, 6}
    assert replica._parent_epochs_unread(0, linked) == set()  # read: a free start indeed
    assert replica._parent_epochs_unread(0, [record(11, "h10", "h11")]) == set()  # same epoch
    far = [record(200, "h199", "h200")]  # beyond MAX_EPOCHS_PER_READ back from round 300
    state.rounds[0] = 300
    assert replica._parent_epochs_unread(0, far) == set()


def test_hivemind_finds_shard_and_epoch_keys_by_their_hash_for_a_learner_and_a_bootstrap() -> None:
    """hivemind shows its validator a key's hash only. The validator knew the run's fixed
    keys, so it refused every sharded heartbeat and every epoch record a real peer stored
    (a sharded run formed no swarm outside the simulator). The key now follows from the
    subkey and the run's layout; a bootstrap node, which has no run config, tries every
    layout a run may choose."""
    import time

    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from p2pdiloco.transport.hivemind_dht import RunRecordValidator
    from p2pdiloco.trust.record_rules import bootstrap_rules

    now = time.time()
    peer = Identity.generate()
    beat = seal_heartbeat(peer, RUN, Heartbeat(peer_id=peer.peer_id, sent_at=now, live_s=8.0))
    closed = RoundRecord(round=17, fragment=1, synchronizer=peer.peer_id, hash="h", closed_at=now)
    record = seal_record(peer, RUN, closed)

    def stored(key: str, subkey: str, value: bytes) -> DHTRecord:
        return DHTRecord(
            key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
            value=MSGPackSerializer.dumps(value), expiration_time=now + 8.0 if "members" in key else now + 60,
        )  # fmt: skip

    own = member_shard(peer.peer_id, 16)
    learner = RunRecordValidator(RunRecordRules(RUN, 2, member_shards=16, epoch_rounds=8))
    bootstrap = RunRecordValidator(bootstrap_rules(RUN, None, RunRecordRules(RUN, 1).admission))
    for validator in (learner, bootstrap):
        assert validator.validate(stored(member_shard_key(RUN, own, 16), peer.peer_id, beat))
        assert not validator.validate(stored(member_shard_key(RUN, (own + 1) % 16, 16), peer.peer_id, beat))
        assert validator.validate(stored(rounds_key(RUN, 1, 17, 8), record_subkey(17, peer.peer_id), record))
        assert not validator.validate(stored(rounds_key(RUN, 1, 8, 8), record_subkey(17, peer.peer_id), record))
        assert not validator.validate(stored("p2pdiloco/another/key", peer.peer_id, beat))
    # a learner refuses another layout than its run's (the bootstrap takes any)
    assert not learner.validate(stored(member_shard_key(RUN, member_shard(peer.peer_id, 8), 8), peer.peer_id, beat))
    assert bootstrap.validate(stored(rounds_key(RUN, 1, 17, 4), record_subkey(17, peer.peer_id), record))
