"""The global state on disk (peer.durable) and where checkpoints live (peer.checkpoint_dir).

A checkpoint holds each fragment's state with the signed round records that justify it;
a restart installs only what verifies offline, and puts the records back in the DHT
when the swarm has forgotten them. A damaged or tampered file is refused with a reason
and that fragment starts from the initial state: the peer never crashes on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from checked_events import CheckedEvents

from p2pdiloco import compress, wire
from p2pdiloco.config import PeerConfig, load_config
from p2pdiloco.errors import ConfigError
from p2pdiloco.identity import Identity
from p2pdiloco.peer import checkpoint_dir
from p2pdiloco.peer.durable import GlobalCheckpoint, wait_for_chain
from p2pdiloco.peer.saved_state import chain_problem, file_name, justifying_chain, read_fragment
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.protocol.rounds import (
    RoundRecord,
    record_subkey,
    records_of,
    rounds_key,
    signed_record,
)
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.wire.updates import new_update

RUN = "durable-test"
CONFIG = load_config(None, [])
LIMITS = wire.WireLimits()
HASH = "cfg-hash"


def fresh_state() -> GlobalState:
    """The run's initial state: every peer builds the same one (same seed)."""
    params = {"w": torch.linspace(-1, 1, 16).reshape(4, 4), "b": torch.ones(4), "c": torch.zeros(3)}
    return GlobalState(params, [["w"], ["b", "c"]], CONFIG.outer)


class Peer:
    """A replica and its ReplicaSync on a memory network, enough to save and restore."""

    def __init__(self, network: MemoryNetwork, directory: Path) -> None:
        self.transport = MemoryTransport(network)
        self.events: list[dict] = CheckedEvents()
        self.state = fresh_state()
        self.replicas = ReplicaSync(
            self.transport,
            RUN,
            self.state,
            lambda: {},
            LIMITS,
            ThreadPoolExecutor(1),
            void_after_s=60.0,
        )
        self.checkpoint = GlobalCheckpoint(
            str(directory), RUN, HASH, self.replicas, LIMITS, self.events.append
        )

    def commit_rounds(
        self, identity: Identity, fragment: int, rounds: int, scale: float = 0.01
    ) -> list[RoundRecord]:
        """Apply `rounds` outer updates to `fragment` as if `identity` synchronized them,
        with their signed records and frames where the replica keeps them."""
        records = []
        for round_id in range(
            self.state.round_of(fragment), self.state.round_of(fragment) + rounds
        ):
            parent = self.state.current_hash(fragment)
            grad = {
                n: torch.full_like(self.state.params[n], scale * (round_id + 1))
                for n in self.state.fragments[fragment]
            }
            new_hash = self.state.apply_update(fragment, round_id, grad)
            update = new_update(
                RUN,
                round_id,
                fragment,
                identity.peer_id,
                parent,
                new_hash,
                [],
                compress.encode_tensors(compress.make_codec("fp32"), grad),
            )
            record = signed_record(identity, RUN, RoundRecord(
                round=round_id, fragment=fragment, synchronizer=identity.peer_id, hash=new_hash,
                parent=parent, digest=update.digest, grace_s=0.0, closed_at=1000.0 + round_id,
            ))  # fmt: skip
            self.replicas.chains[fragment][round_id] = record
            self.replicas.keep(update)
            records.append(record)
        return records

    def save(self) -> list[int]:
        return self.checkpoint.save(asyncio.run(self.checkpoint.known()))


@pytest.fixture
def network() -> MemoryNetwork:
    return MemoryNetwork()


@pytest.fixture
def trained(network: MemoryNetwork, tmp_path: Path) -> tuple[Peer, list[RoundRecord]]:
    """A peer that applied 3 rounds of fragment 0 and 2 of fragment 1, and saved them."""
    peer = Peer(network, tmp_path)
    synchronizer = Identity.generate()
    records = peer.commit_rounds(synchronizer, 0, 3)
    peer.commit_rounds(synchronizer, 1, 2)
    assert peer.save() == [0, 1]
    return peer, records


# --- save and restore ----------------------------------------------------------------------


def test_a_restart_installs_the_saved_global_state_at_its_round_with_its_records(
    trained, network, tmp_path
) -> None:
    before, records = trained
    after = Peer(network, tmp_path)
    assert after.checkpoint.restore() == {0: 3, 1: 2}
    assert after.state.rounds == [3, 2]
    for fragment in range(2):
        assert after.state.fragment_hash(fragment) == before.state.fragment_hash(fragment)
        assert after.state.current_hash(fragment) == before.state.current_hash(fragment)
        assert after.replicas.chains[fragment] == before.replicas.chains[fragment]
    assert after.replicas.applied[0] == {2: records[-1].digest}
    # the last round's update is served again (a peer one round behind replays it from us)
    assert after.replicas.store.get(0, records[-1].digest) is not None
    # the genesis the chains start from is still the initial state's
    assert after.replicas.genesis == Peer(network, tmp_path / "other").replicas.genesis


def test_a_save_writes_only_fragments_that_moved_and_that_records_sign(trained) -> None:
    peer, _records = trained
    assert peer.save() == []  # nothing moved
    peer.state.apply_update(1, 2, {n: torch.ones_like(peer.state.params[n]) for n in ("b", "c")})
    assert peer.save() == []  # applied, but no record signs that state: not justified


def test_an_empty_directory_restores_nothing(network, tmp_path) -> None:
    peer = Peer(network, tmp_path / "empty")
    assert peer.checkpoint.restore() == {}
    assert peer.state.rounds == [0, 0] and not peer.checkpoint.refused


# --- refused files: logged, that fragment from scratch, never a crash -----------------------


def rewrite(path: Path, change) -> None:
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)


def restore_with_refusal(network, tmp_path, caplog) -> Peer:
    peer = Peer(network, tmp_path)
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.peer.durable"):
        peer.checkpoint.restore()
    return peer


def test_a_tampered_state_is_refused_and_its_fragment_starts_from_the_initial_state(
    trained, network, tmp_path, caplog
) -> None:
    rewrite(tmp_path / file_name(0), lambda p: p["params"]["w"].add_(1e-3))
    peer = restore_with_refusal(network, tmp_path, caplog)
    assert peer.state.rounds == [0, 2]  # fragment 1's file is intact and restored
    assert peer.state.fragment_hash(0) == fresh_state().fragment_hash(0)
    assert peer.checkpoint.refused[0] == "state does not hash to what its round record signs"
    assert "global checkpoint refused" in caplog.text and "fragment=0" in caplog.text


def test_a_record_whose_signature_breaks_is_refused(trained, network, tmp_path, caplog) -> None:
    def flip(payload: dict) -> None:
        sealed = bytearray(payload["records"][1])
        sealed[-5] ^= 0x01
        payload["records"][1] = bytes(sealed)

    rewrite(tmp_path / file_name(0), flip)
    peer = restore_with_refusal(network, tmp_path, caplog)
    assert peer.state.rounds == [0, 2]
    assert "not signed by its synchronizer" in peer.checkpoint.refused[0]


def test_a_chain_re_signed_by_a_stranger_over_another_state_is_refused(
    trained, network, tmp_path, caplog
) -> None:
    """A stranger's records, validly signed, that do not lead to the saved state."""
    stranger = Peer(network, tmp_path / "stranger")
    forged = stranger.commit_rounds(Identity.generate(), 0, 3, scale=0.02)
    rewrite(tmp_path / file_name(0), lambda p: p.update(records=[r.sealed for r in forged]))
    peer = restore_with_refusal(network, tmp_path, caplog)
    assert peer.state.rounds == [0, 2]
    assert peer.checkpoint.refused[0] == "state does not hash to what its round record signs"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda path: path.write_bytes(b"not a checkpoint"), "unreadable"),
        (
            lambda path: rewrite(path, lambda p: p.update(config_hash="other")),
            "of another run or run config",
        ),
        (
            lambda path: rewrite(path, lambda p: p.update(round=7)),
            "records end at round 2, the state is at round 7",
        ),
        (
            lambda path: rewrite(path, lambda p: p["params"].update(w=torch.zeros(2))),
            "state malformed",
        ),
        (
            lambda path: rewrite(path, lambda p: p["params"]["w"].fill_(float("nan"))),
            "state malformed",
        ),
    ],
)
def test_a_damaged_file_is_refused_with_its_reason(
    trained, network, tmp_path, caplog, damage, reason
) -> None:
    damage(tmp_path / file_name(0))
    peer = restore_with_refusal(network, tmp_path, caplog)
    assert peer.state.rounds == [0, 2]
    assert peer.checkpoint.refused[0].startswith(reason)


# --- the chain rules (pure) -----------------------------------------------------------------


def chain_of(count: int, genesis: str = "g0") -> list[RoundRecord]:
    parent, out = genesis, []
    for r in range(count):
        out.append(RoundRecord(round=r, fragment=0, synchronizer="s", hash=f"h{r}", parent=parent))
        parent = f"h{r}"
    return out


def test_a_chain_justifies_a_state_only_when_it_links_from_the_initial_state_to_its_hash() -> None:
    chain = chain_of(4)
    assert chain_problem(chain, 0, 4, "h3", "g0") is None
    assert chain_problem(chain[2:], 0, 4, "h3", "g0") is None  # an older prefix may be gone
    assert (
        chain_problem(chain, 0, 4, "h3", "another-genesis")
        == "chain does not start at this run's initial state"
    )
    assert chain_problem([chain[0], chain[2], chain[3]], 0, 4, "h3", "g0").startswith(
        "records skip"
    )
    broken = [*chain[:2], dataclasses.replace(chain[2], parent="elsewhere"), chain[3]]
    assert chain_problem(broken, 0, 4, "h3", "g0").endswith("does not follow round 1")
    assert (
        chain_problem(chain, 0, 4, "h-other", "g0")
        == "state does not hash to what its round record signs"
    )
    assert chain_problem(chain, 1, 4, "h3", "g0").startswith("record of round 0 is of fragment")
    assert "does not entitle" in chain_problem(
        chain, 0, 4, "h3", "g0", entitled=lambda r: r.round != 2
    )
    assert chain_problem([], 0, 4, "h3", "g0") == "no round records"


def test_the_justifying_chain_goes_back_as_far_as_its_links_and_the_limit() -> None:
    records = {r.round: r for r in chain_of(6)}
    assert [r.round for r in justifying_chain(records, 6, "h5")] == [0, 1, 2, 3, 4, 5]
    assert [r.round for r in justifying_chain(records, 6, "h5", limit=2)] == [4, 5]
    records[2] = dataclasses.replace(records[2], hash="rival")  # round 3 does not follow it
    assert [r.round for r in justifying_chain(records, 6, "h5")] == [3, 4, 5]
    assert justifying_chain(records, 6, "not-signed") == []
    assert justifying_chain(records, 0, "g0") == []


# --- republishing after a full stop ---------------------------------------------------------


def test_restored_records_go_back_into_a_dht_that_forgot_them(trained, network, tmp_path) -> None:
    _before, records = trained
    peer = Peer(network, tmp_path)
    peer.checkpoint.restore()

    async def republish_and_read() -> set[tuple[int, str]]:
        await peer.transport.start()
        await peer.checkpoint.republish()
        return set(records_of(RUN, await peer.transport.get(rounds_key(RUN, 0)), 0))

    assert asyncio.run(republish_and_read()) == {(r.round, r.synchronizer) for r in records}
    assert peer.events == [
        {"event": "republished", "fragment": 0, "round": 3, "records": 3},
        {"event": "republished", "fragment": 1, "round": 2, "records": 2},
    ]


def test_nothing_is_republished_where_the_swarm_went_past_the_restored_round(
    trained, network, tmp_path
) -> None:
    _before, records = trained
    ahead = Peer(network, tmp_path / "ahead")
    synchronizer = Identity.generate()
    newer = ahead.commit_rounds(synchronizer, 0, 4)[-1]  # the swarm's round 3, beyond our 3 rounds
    peer = Peer(network, tmp_path)
    peer.checkpoint.restore()

    async def run() -> set[tuple[int, str]]:
        await peer.transport.start()
        key = rounds_key(RUN, 0)
        await peer.transport.store(
            key, record_subkey(3, newer.synchronizer), newer.sealed, peer.transport.now() + 60
        )
        await peer.checkpoint.republish()
        return set(records_of(RUN, await peer.transport.get(key), 0))

    assert asyncio.run(run()) == {(3, newer.synchronizer)}


# --- where checkpoints live -----------------------------------------------------------------


def test_checkpoints_are_on_by_default_in_the_users_data_directory(tmp_path) -> None:
    assert PeerConfig().checkpoint_dir == checkpoint_dir.AUTO
    env = {"HOME": str(tmp_path / "home")}
    assert checkpoint_dir.data_home(env) == tmp_path / "home/.local/share/p2pdiloco"
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    assert checkpoint_dir.data_home(env) == tmp_path / "xdg/p2pdiloco"
    env[checkpoint_dir.DATA_HOME_ENV] = str(tmp_path / "mine")
    assert checkpoint_dir.data_home(env) == tmp_path / "mine"
    peer = PeerConfig(run="r1")
    assert checkpoint_dir.resolve(peer, "12D3KooWpeer", env) == str(
        tmp_path / "mine/r1/12D3KooWpeer/checkpoints"
    )
    assert (tmp_path / "mine/r1/12D3KooWpeer/checkpoints/owner.pid").read_text().strip() == str(
        os.getpid()
    )


def test_the_tests_own_data_directory_is_a_temporary_one() -> None:
    """conftest points every test (and every peer it starts) away from the real home."""
    assert checkpoint_dir.data_home() != Path.home() / ".local/share/p2pdiloco"
    assert checkpoint_dir.DATA_HOME_ENV in os.environ


@pytest.mark.parametrize("value", ["", "none", "NONE"])
def test_checkpoints_can_be_turned_off(value: str) -> None:
    peer = PeerConfig(checkpoint_dir=value)
    assert checkpoint_dir.resolve(peer, "12D3KooWpeer") == ""
    assert (
        checkpoint_dir.concrete_dir(peer) == "" and checkpoint_dir.checkpoint_location(peer) == ""
    )


def test_peers_without_identity_never_share_a_folder(tmp_path) -> None:
    env = {checkpoint_dir.DATA_HOME_ENV: str(tmp_path)}
    taken = tmp_path / "r1/default/checkpoints"
    taken.mkdir(parents=True)
    (taken / checkpoint_dir.OWNER_FILE).write_text(f"{os.getppid()}\n")  # a live process
    assert checkpoint_dir.resolve(PeerConfig(run="r1"), "", env) == str(
        tmp_path / "r1/default-2/checkpoints"
    )
    (taken / checkpoint_dir.OWNER_FILE).write_text("999999999\n")  # its writer is gone
    assert checkpoint_dir.resolve(PeerConfig(run="r1"), "", env) == str(taken)


def test_a_named_folder_another_live_peer_writes_is_refused(tmp_path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / checkpoint_dir.OWNER_FILE).write_text(f"{os.getppid()}\n")
    with pytest.raises(ConfigError, match="in use by another peer"):
        checkpoint_dir.resolve(PeerConfig(checkpoint_dir=str(folder)), "")


def test_a_restored_checkpoint_is_read_by_hash_not_by_its_claims(
    trained, network, tmp_path
) -> None:
    """The file's hash fields are not trusted: only what the tensors hash to."""
    found = read_fragment(
        tmp_path, 0, RUN, HASH, fresh_state(), fresh_state().current_hash(0), LIMITS
    )
    assert not isinstance(found, str) and found is not None
    assert found.state.hash == trained[0].state.current_hash(0)


# --- a joiner does not start the run over while it resumes ----------------------------------


class FakeReplicas:
    """What `wait_for_chain` reads: a replica at round 0, peers' beats, the DHT's chain."""

    def __init__(self, rounds_of_others: tuple[int, ...], chains: list[dict]) -> None:
        self.state = fresh_state()
        self.transport = type("T", (), {"peer_id": "me"})()
        self.beats = {
            "me": Heartbeat(peer_id="me", rounds=(0, 0)),
            "other": Heartbeat(peer_id="other", rounds=rounds_of_others),
        }
        self.chains = chains
        self.reads = 0

    def members(self) -> dict[str, Heartbeat]:
        return self.beats

    async def read_chain(self, fragment: int) -> dict:
        self.reads += 1
        return self.chains.pop(0) if len(self.chains) > 1 else self.chains[0]


def test_a_joiner_waits_for_the_records_of_peers_past_round_zero() -> None:
    replicas = FakeReplicas((4, 4), [{}, {}, {3: "a record"}])
    assert asyncio.run(wait_for_chain(replicas, 0, poll_s=0.001, timeout_s=30)) is True
    assert replicas.reads == 3


def test_a_joiner_of_a_new_run_does_not_wait_and_a_liar_costs_a_bounded_wait() -> None:
    new_run = FakeReplicas((0, 0), [{}])
    assert asyncio.run(wait_for_chain(new_run, 0, poll_s=0.001, timeout_s=30)) is True
    assert new_run.reads == 0
    liar = FakeReplicas((999, 999), [{}])  # claims rounds no record shows
    assert asyncio.run(wait_for_chain(liar, 1, poll_s=0.001, timeout_s=0.05)) is False


def test_join_turns_checkpoints_off_with_one_flag_and_throwaway_swarms_keep_them_off() -> None:
    from p2pdiloco.cli.argv import child_join_args
    from p2pdiloco.cli.main import build_parser
    from p2pdiloco.cli.options import config_from_args

    def config_of(*argv: str):
        return config_from_args(build_parser().parse_args(list(argv)))

    assert config_of("join").peer.checkpoint_dir == "auto"
    assert config_of("join", "--no-checkpoint").peer.checkpoint_dir == "none"
    assert config_of(*child_join_args()[2:]).peer.checkpoint_dir == "none"
    # a folder named by a test or a script still wins over the throwaway default
    assert config_of(*child_join_args("--checkpoint-dir", "/x")[2:]).peer.checkpoint_dir == "/x"


def test_an_identity_finds_its_own_folder_again(tmp_path, monkeypatch) -> None:
    from p2pdiloco.identity import load_or_create_identity

    monkeypatch.setenv(checkpoint_dir.DATA_HOME_ENV, str(tmp_path / "data"))
    key = tmp_path / "id.key"
    config = dataclasses.replace(CONFIG, peer=PeerConfig(run="r1", identity_path=str(key)))
    resolved = checkpoint_dir.with_checkpoint_dir(config).peer.checkpoint_dir
    peer_id = load_or_create_identity(key).peer_id
    assert resolved == str(tmp_path / "data" / "r1" / peer_id / "checkpoints")
    again = checkpoint_dir.with_checkpoint_dir(config).peer.checkpoint_dir
    assert again == resolved  # this process owns it already
