"""The run manifest and the operator commands: sign, certify, verify, pin, join config."""

from __future__ import annotations

import dataclasses

import pytest

from p2pdiloco.cli.main import main
from p2pdiloco.config import load_config
from p2pdiloco.identity import Identity, load_identity, save_identity
from p2pdiloco.trust.admission import read_certificate
from p2pdiloco.trust.manifest import (
    ManifestError,
    find_manifest,
    joined_config,
    parse_manifest,
    pin_operator,
    read_manifest,
)

RUN_SETS = ["--set", "model.preset='tiny'", "--set", "sync.inner_steps=10"]


@pytest.fixture
def operator_run(tmp_path, monkeypatch):
    """`run init` in a fresh folder (HOME for pins there too); returns (manifest, key)."""
    monkeypatch.setenv("P2PDILOCO_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    key = tmp_path / "operator.key"
    assert main(["run", "init", "demo-run", "--operator-key", str(key), *RUN_SETS]) == 0
    return tmp_path / "bootstrap_peers" / "demo-run.toml", key


def test_init_writes_a_signed_manifest_with_the_run_config(operator_run) -> None:
    path, key = operator_run
    manifest = read_manifest(path)
    assert manifest.operator == load_identity(key).peer_id
    assert manifest.synchronizers == "certified" and manifest.learners == "open"
    config = manifest.config()
    assert config.model.preset == "tiny" and config.sync.inner_steps == 10
    assert "[peer]" not in manifest.config_text


def test_certify_adds_a_certificate_for_the_peer_and_keeps_the_signature_valid(operator_run, capsys) -> None:
    path, key = operator_run
    peer = Identity.generate().peer_id
    assert main(["run", "certify", str(path), "--operator-key", str(key), "--peer", peer, "--days", "2"]) == 0
    manifest = read_manifest(path)
    (cert,) = manifest.certificates_of(peer)
    assert read_certificate(cert, manifest.operator, "demo-run").role == "synchronizer"
    assert main(["run", "show", str(path)]) == 0
    assert peer in capsys.readouterr().out


@pytest.mark.parametrize(
    "old, new",
    [
        ("inner_steps = 10", "inner_steps = 11"),  # the config
        ('synchronizers = "certified"', 'synchronizers = "open"'),  # the admission rules
    ],
)
def test_a_tampered_manifest_is_one_clear_error(operator_run, capsys, old, new) -> None:
    path, _ = operator_run
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(ManifestError, match="signature does not match"):
        read_manifest(path)
    code = main(["join", "--manifest", str(path), "--run", "demo-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "signature does not match" in err[0]


def test_a_manifest_signed_by_another_key_is_refused_after_the_first_use(operator_run) -> None:
    path, _ = operator_run
    manifest = read_manifest(path)
    pin_operator(manifest)
    impostor = Identity.generate()
    forged = dataclasses.replace(manifest, operator=impostor.peer_id)
    with pytest.raises(ManifestError, match="signed by operator"):
        pin_operator(forged)
    pin_operator(manifest)  # the known operator still passes


def test_resigning_after_an_edit_needs_the_operator_key(operator_run, tmp_path, capsys) -> None:
    path, key = operator_run
    path.write_text(path.read_text().replace("inner_steps = 10", "inner_steps = 12"))
    other = tmp_path / "other.key"
    save_identity(Identity.generate(), other)
    assert main(["run", "sign", str(path), "--operator-key", str(other)]) == 2
    assert "names operator" in capsys.readouterr().err
    assert main(["run", "sign", str(path), "--operator-key", str(key)]) == 0
    assert read_manifest(path).config().sync.inner_steps == 12


def test_a_joining_peer_may_change_only_its_own_settings(operator_run) -> None:
    path, _ = operator_run
    manifest = read_manifest(path)
    config = joined_config(manifest, ["peer.port=4100", "train.device='cpu'", "data.max_files=3"])
    assert config.peer.port == 4100 and config.peer.run == "demo-run"
    with pytest.raises(ManifestError, match="takes its config from its manifest"):
        joined_config(manifest, ["sync.inner_steps=99"])
    with pytest.raises(ManifestError, match="runs on the hivemind transport .* --transport libp2p cannot join"):
        joined_config(manifest, ["network.transport='libp2p'"])
    found = find_manifest(dataclasses.replace(load_config(None).peer, run="demo-run"))
    assert found == manifest


def test_junk_manifests_are_errors_not_crashes() -> None:
    for text in ["", "[run]\nname = 5", "x = [", "[run]\nname='a'\noperator='b'\nconfig=''\ncertificates=['!!']"]:
        with pytest.raises(ManifestError):
            parse_manifest(text)


def test_identity_prints_the_peer_id_a_certificate_names(tmp_path, capsys) -> None:
    key = tmp_path / "peer.key"
    assert main(["identity", str(key)]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["identity", str(key)]) == 0  # the same key, the same id
    assert capsys.readouterr().out.strip() == first == load_identity(key).peer_id


def test_init_refuses_a_bootstrap_address_that_is_not_a_multiaddr(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    key = tmp_path / "operator.key"
    argv = ["run", "init", "bad-run", "--operator-key", str(key), "--bootstrap", "1.2.3.4:4000"]
    assert main([*argv, *RUN_SETS]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bootstrap" in err[0] and "not a valid multiaddr" in err[0]
    assert not (tmp_path / "bootstrap_peers" / "bad-run.toml").exists()


def test_a_manifest_is_read_from_an_http_url_and_verified_like_a_file(operator_run, tmp_path) -> None:
    """`--manifest URL`: fetched (bounded in bytes and time), then the same signature and
    config checks as a file; a server that is down or sends junk is one ManifestError."""
    import functools
    import http.server
    import threading

    from p2pdiloco.trust.manifest import MAX_MANIFEST_BYTES, ManifestError

    path, _ = operator_run
    (tmp_path / "big.toml").write_bytes(b"x" * (MAX_MANIFEST_BYTES + 10))
    (tmp_path / "junk.toml").write_bytes(path.read_bytes().replace(b"demo-run", b"demo-rux"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path.parent.parent))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        fetched = read_manifest(f"{base}/bootstrap_peers/demo-run.toml")
        assert fetched.name == "demo-run" and fetched.operator == read_manifest(path).operator
        for name, why in (("big.toml", "larger than"), ("junk.toml", None), ("missing.toml", "cannot fetch")):
            with pytest.raises(ManifestError, match=why):
                read_manifest(f"{base}/{name}")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ManifestError, match="cannot fetch"):
        read_manifest(base + "/bootstrap_peers/demo-run.toml")  # the server is gone
