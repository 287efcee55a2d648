"""Config: defaults, TOML loading, overrides and the errors a user sees."""

from __future__ import annotations

import tomllib

import pytest

from p2pdiloco.config import (
    DEFAULT_TOML,
    PeerConfig,
    RunConfig,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
    render_toml,
)
from p2pdiloco.errors import ConfigError


def test_shipped_default_toml_equals_dataclass_defaults() -> None:
    assert load_config(DEFAULT_TOML) == RunConfig()


def test_render_toml_round_trips() -> None:
    config = load_config(None, ["sync.inner_steps=77", "data.source='/tmp/x y\"z'"])
    assert config_from_dict(tomllib.loads(render_toml(config))) == config


def test_overrides_parse_toml_values_and_bare_strings() -> None:
    config = load_config(
        None, ["outer.lr=0.5", "compress.zstd=true", "model.preset=tiny", "sync.max_grace_s=3"]
    )
    assert config.outer.lr == 0.5
    assert config.compress.zstd is True
    assert config.model.preset == "tiny"
    assert config.sync.max_grace_s == 3.0 and isinstance(config.sync.max_grace_s, float)


def test_file_then_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[sync]\ninner_steps = 30\nmin_quorum = 2\n")
    config = load_config(path, ["sync.min_quorum=3"])
    assert (config.sync.inner_steps, config.sync.min_quorum) == (30, 3)
    assert config.outer == RunConfig().outer


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sync.min_quorum=0", "sync.min_quorum must be >= 1, got 0"),
        ("sync.min_quorum=257", "sync.min_quorum must be at most 256 (the deltas a window takes)"),
        ("sync.commit_holders=33", "sync.commit_holders must be at most 32, got 33"),
        ("outer.merge='median'", "outer.merge must be one of"),
        ("sync.bogus=1", "unknown key sync.bogus"),
        ("bogus.key=1", "unknown config section [bogus]"),
        ("train.batch_size=2.5", "train.batch_size must be an integer"),
        ("compress.zstd=1", "compress.zstd must be a boolean"),
        ("model.preset=3", "model.preset must be a string"),
        ("sync.num_fragments=99", "sync.num_fragments must be in [1, sync.inner_steps=50]"),
        ("nodot=1", "must look like section.key=value"),
        ("peer.port=70000", "peer.port must be in [0, 65535], got 70000"),
        ("peer.run='../etc'", "peer.run must be a plain name"),
        ("peer.heartbeat_s=0", "peer.heartbeat_s must be in (0, 75]"),
        ("peer.heartbeat_s=100", "peer.heartbeat_s must be in (0, 75]"),
        ("peer.data_rank=-2", "peer.data_rank must be >= -1"),
        ("peer.max_rounds=-1", "peer.max_rounds must be >= 0"),
        ("peer.corrupt='bits'", "peer.corrupt must be one of"),
        ("peer.initial_peers='/ip4/1.2.3.4/tcp/1'", "peer.initial_peers must be a list of strings"),
        ("peer.announce_maddrs=[1]", "peer.announce_maddrs must be a list of strings"),
        ("sync.min_quorum", "must look like section.key=value"),
        ("network.transport='tcp'", "network.transport must be one of hivemind, libp2p"),
        ("train.compute_share=0", "train.compute_share must be in (0, 1], got 0"),
        ("train.compute_share=1.5", "train.compute_share must be in (0, 1], got 1.5"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_run_has_at_most_the_fragments_a_bootstrap_node_accepts() -> None:
    with pytest.raises(ConfigError, match="sync.num_fragments must be at most 64, got 65"):
        load_config(None, ["sync.inner_steps=200", "sync.num_fragments=65"])


def test_missing_and_invalid_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sync\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_configs_are_frozen() -> None:
    config = RunConfig()
    with pytest.raises(AttributeError):
        config.sync.min_quorum = 5  # type: ignore[misc]
    assert config_to_dict(config)["sync"]["min_quorum"] == 1


def test_peer_section_is_set_like_any_other() -> None:
    maddr = "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWEKA2Q78SUehS68gSmBu9ARDrqrWQd82a3w8KXMPyEbEp"
    config = load_config(
        None, ["peer.port=4000", f'peer.initial_peers=["{maddr}"]', "peer.client_mode=true"]
    )
    assert config.peer == PeerConfig(port=4000, initial_peers=(maddr,), client_mode=True)
    assert config_from_dict(tomllib.loads(render_toml(config))) == config


def test_peer_section_is_left_out_of_the_run_hash() -> None:
    base = config_hash(RunConfig())
    per_peer = load_config(
        None,
        [
            "peer.port=4000",
            "peer.identity_path='/keys/me.key'",
            "peer.run='other'",
            "peer.max_steps=9",
            "peer.crash_at='after_quorum'",
        ],
    )
    assert config_hash(per_peer) == base
    # a volunteer's own machine: how much of it the loop may use
    assert config_hash(load_config(None, ["train.compute_share=0.5"])) == base
    assert config_hash(load_config(None, ["sync.min_quorum=2"])) != base
    assert config_hash(load_config(None, ["compress.codec='int4'"])) != base


def test_the_transport_is_part_of_the_run_hash() -> None:
    """Peers of both transports cannot meet (docs/transport.md), so they are different runs."""
    libp2p = load_config(None, ["network.transport='libp2p'"])
    assert libp2p.network.transport == "libp2p"
    assert config_hash(libp2p) != config_hash(RunConfig())
