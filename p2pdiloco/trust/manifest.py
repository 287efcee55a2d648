"""The run manifest: one signed file that says what a run is and whom it trusts.

`bootstrap_peers/<run>.toml` holds the run's name, bootstrap multiaddrs, the operator's
public key (as a peer id), the admission rules, the run config (as TOML text) and the
operator's certificates for peers, all signed by the operator. A volunteer types
`p2pdiloco join --run NAME` and nothing else: the config comes from here, verified.

What the signature proves: the file was written by the holder of the operator key it
names. What pins that key: the first manifest of a run a machine accepts records the
operator in `known_runs.toml` (trust on first use, like ssh); a later manifest of the
same run signed by another key is refused with one clear error. Whoever distributes the
manifest (this repository, the run's website) is the root of trust for the first use.
"""

from __future__ import annotations

import base64
import json
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from p2pdiloco.config import PeerConfig, RunConfig, apply_overrides, config_from_dict, config_hash
from p2pdiloco.errors import ConfigError
from p2pdiloco.identity import Identity, is_peer_id, verify
from p2pdiloco.transport.bootstrap import check_multiaddr, run_file
from p2pdiloco.trust.admission import LEARNER_MODES, SYNCHRONIZER_MODES, Admission, read_certificate

MANIFEST_DOMAIN = "manifest"
MAX_MANIFEST_BYTES = 1 << 20


class ManifestError(ConfigError):
    """A manifest that is unreadable, tampered with, or signed by an unexpected operator."""


@dataclass(frozen=True)
class Manifest:
    name: str
    operator: str
    """Peer id of the operator's Ed25519 key."""
    config_text: str
    """The run config as TOML (every section but [peer])."""
    bootstrap: tuple[str, ...] = ()
    synchronizers: str = "certified"
    learners: str = "open"
    allowlist: tuple[str, ...] = ()
    certificates: tuple[bytes, ...] = ()
    signature: bytes = b""

    def body(self) -> bytes:
        """The canonical bytes the operator signs (everything but the signature)."""
        data = {
            "name": self.name,
            "operator": self.operator,
            "config": self.config_text,
            "bootstrap": list(self.bootstrap),
            "synchronizers": self.synchronizers,
            "learners": self.learners,
            "allowlist": sorted(self.allowlist),
            "certificates": [base64.b64encode(c).decode() for c in self.certificates],
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def admission(self) -> Admission:
        return Admission(self.synchronizers, self.learners, self.operator, frozenset(self.allowlist))

    def config(self) -> RunConfig:
        try:
            return config_from_dict(tomllib.loads(self.config_text))
        except tomllib.TOMLDecodeError as exc:
            raise ManifestError(f"manifest {self.name!r}: its config is not TOML ({exc})") from None

    def certificates_of(self, peer: str) -> tuple[bytes, ...]:
        """The certificates the manifest holds for `peer` (to show in its heartbeat)."""
        out = []
        for raw in self.certificates:
            cert = read_certificate(raw, self.operator, self.name)
            if not isinstance(cert, str) and cert.peer == peer:
                out.append(raw)
        return tuple(out)


def sign_manifest(manifest: Manifest, operator: Identity) -> Manifest:
    """The manifest signed by `operator` (whose peer id it must name)."""
    if operator.peer_id != manifest.operator:
        raise ManifestError(
            f"the key signs as {operator.peer_id}, but the manifest names operator {manifest.operator}"
        )
    return replace(manifest, signature=operator.sign(MANIFEST_DOMAIN, manifest.body()))


def verify_manifest(manifest: Manifest) -> RunConfig:
    """Check signature, admission rules, certificates and config; returns the run config."""
    where = f"manifest {manifest.name!r}"
    if not verify(manifest.operator, MANIFEST_DOMAIN, manifest.body(), manifest.signature):
        raise ManifestError(f"{where}: the operator's signature does not match: the file was changed after signing")
    try:
        manifest.admission()
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    for raw in manifest.certificates:
        cert = read_certificate(raw, manifest.operator, manifest.name)
        if isinstance(cert, str):
            raise ManifestError(f"{where}: {cert}")
    config = manifest.config()
    if any(not is_peer_id(p) for p in manifest.allowlist):
        raise ManifestError(f"{where}: the allowlist holds something that is not a peer id")
    return config


def _text(table: dict, key: str, where: str, default: str | None = None) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise ManifestError(f"{where}: `{key}` must be a string")
    return value


def _texts(table: dict, key: str, where: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where}: `{key}` must be a list of strings")
    return tuple(value)


def parse_manifest(text: str, where: str = "manifest") -> Manifest:
    """A manifest from its TOML text; raises ManifestError naming `where` and the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{where}: not TOML ({exc})") from None
    run = data.get("run")
    if not isinstance(run, dict):
        raise ManifestError(f"{where}: no [run] table")
    try:
        certificates = tuple(base64.b64decode(c, validate=True) for c in _texts(run, "certificates", where))
        signature = base64.b64decode(_text(data.get("signature", {}), "value", where, ""), validate=True)
    except ValueError:
        raise ManifestError(f"{where}: a certificate or the signature is not base64") from None
    manifest = Manifest(
        name=_text(run, "name", where),
        operator=_text(run, "operator", where),
        config_text=_text(run, "config", where),
        bootstrap=tuple(check_multiaddr(a, where) for a in _texts(run, "bootstrap", where)),
        synchronizers=_text(run, "synchronizers", where, "certified"),
        learners=_text(run, "learners", where, "open"),
        allowlist=_texts(run, "allowlist", where),
        certificates=certificates,
        signature=signature,
    )
    if manifest.synchronizers not in SYNCHRONIZER_MODES or manifest.learners not in LEARNER_MODES:
        raise ManifestError(f"{where}: unknown admission mode")
    return manifest


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def _toml_text(value: str) -> str:
    """A multi-line literal string (readable, byte-exact) when the text allows one."""
    if "'''" in value or "\r" in value:
        return _toml_string(value)
    return "'''\n" + value + "'''"


def _toml_list(values) -> str:
    return "[" + ", ".join(_toml_string(v) for v in values) + "]"


def render_manifest(manifest: Manifest) -> str:
    """The manifest as the TOML file operators publish."""
    lines = [
        "# p2pdiloco run manifest, signed by the run's operator: edit it only with",
        "# `p2pdiloco run sign|certify` (any other change breaks the signature).",
        f"# Join with: p2pdiloco join --run {manifest.name}",
        "",
        "[run]",
        f"name = {_toml_string(manifest.name)}",
        f"operator = {_toml_string(manifest.operator)}",
        f"bootstrap = {_toml_list(manifest.bootstrap)}",
        f"synchronizers = {_toml_string(manifest.synchronizers)}",
        f"learners = {_toml_string(manifest.learners)}",
        f"allowlist = {_toml_list(manifest.allowlist)}",
        f"certificates = {_toml_list(base64.b64encode(c).decode() for c in manifest.certificates)}",
        f"config = {_toml_text(manifest.config_text)}",
        "",
        "[signature]",
        f"value = {_toml_string(base64.b64encode(manifest.signature).decode())}",
        "",
    ]
    return "\n".join(lines)


def manifest_file_for(run: str) -> Path | None:
    """./bootstrap_peers/<run>.toml, else the shipped one (see `bootstrap.run_folders`),
    else None."""
    return run_file(run, ".toml")


MANIFEST_FETCH_TIMEOUT_S = 20.0
"""Bound on fetching a manifest by URL (connect and read)."""


def fetch_manifest_bytes(url: str, timeout_s: float = MANIFEST_FETCH_TIMEOUT_S) -> bytes:
    """The bytes at an http(s) `url`, at most MAX_MANIFEST_BYTES + 1 of them, within
    `timeout_s`; ManifestError on any failure. Trust comes from the signature and the
    pinned operator (`pin_operator`), not from the server, so plain http is allowed."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) only
            return response.read(MAX_MANIFEST_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ManifestError(f"cannot fetch the manifest {url}: {reason}") from None


def is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def read_manifest(path: Path | str) -> Manifest:
    """Read and verify a manifest file or http(s) URL (signature, certificates, config)."""
    if isinstance(path, str) and is_url(path):
        raw = fetch_manifest_bytes(path)
    else:
        path = Path(path)
        try:
            raw = path.read_bytes()[: MAX_MANIFEST_BYTES + 1]
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    manifest = parse_manifest(text, str(path))
    verify_manifest(manifest)
    return manifest


def known_runs_path() -> Path:
    """Where this machine remembers each run's operator (P2PDILOCO_HOME or ~/.p2pdiloco)."""
    home = os.environ.get("P2PDILOCO_HOME") or os.path.join(os.path.expanduser("~"), ".p2pdiloco")
    return Path(home) / "known_runs.toml"


def pin_operator(manifest: Manifest, path: Path | None = None) -> None:
    """Trust on first use: remember the run's operator; refuse a manifest signed by another."""
    path = path or known_runs_path()
    known: dict = {}
    if path.exists():
        try:
            known = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from None
    pinned = known.get(manifest.name)
    if isinstance(pinned, str):
        if pinned != manifest.operator:
            raise ManifestError(
                f"run {manifest.name!r} was signed by operator {pinned} before, this manifest by "
                f"{manifest.operator}: refusing it (if the operator really changed keys, delete "
                f"the line from {path})"
            )
        return
    known[manifest.name] = manifest.operator
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(f"{_toml_string(k)} = {_toml_string(v)}\n" for k, v in sorted(known.items()) if isinstance(v, str))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("# run name = operator peer id (trusted on first use)\n" + body, encoding="utf-8")
    os.replace(tmp, path)


def config_text_of(config: RunConfig) -> str:
    """The TOML of everything a run shares (the [peer] section is each peer's own)."""
    from p2pdiloco.config import render_toml

    text = render_toml(config)
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skipping = line.strip() == "[peer]"
        if not skipping:
            kept.append(line)
    return "\n".join(kept).strip() + "\n"


def describe(manifest: Manifest) -> str:
    """A few lines for `p2pdiloco run show`."""
    config = manifest.config()
    lines = [
        f"run {manifest.name}: operator {manifest.operator}",
        f"  config {config_hash(config)} (model {config.model.preset}, H={config.sync.inner_steps})",
        f"  synchronizers: {manifest.synchronizers}, learners: {manifest.learners}",
        f"  bootstrap: {len(manifest.bootstrap)} peer(s), certificates: {len(manifest.certificates)}",
    ]
    for raw in manifest.certificates:
        cert = read_certificate(raw, manifest.operator, manifest.name)
        if not isinstance(cert, str):
            lines.append(f"    {cert.role:<12} {cert.peer} until {cert.expires_at:.0f}")
    return "\n".join(lines)


def find_manifest(peer: PeerConfig) -> Manifest | None:
    """The verified manifest a peer joins with: `peer.manifest`, else the run's file, else None."""
    path: Path | str | None
    if peer.manifest:
        path = peer.manifest if is_url(peer.manifest) else Path(peer.manifest)
    else:
        path = manifest_file_for(peer.run)
    if path is None:
        return None
    manifest = read_manifest(path)
    if manifest.name != peer.run and peer.run != PeerConfig().run:
        raise ManifestError(f"{path} is the manifest of run {manifest.name!r}, not of {peer.run!r}")
    return manifest


def joined_config(manifest: Manifest, overrides: list[str]) -> RunConfig:
    """The run config of `manifest` with this peer's overrides, which may change only what
    is its own (`[peer]`, `[data]`, per-peer fields): anything else would split the run."""
    try:
        raw = tomllib.loads(manifest.config_text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"manifest {manifest.name!r}: its config is not TOML ({exc})") from None
    config = config_from_dict(apply_overrides(raw, overrides))
    ran = manifest.config().network.transport
    if config.network.transport != ran:
        raise ManifestError(
            f"run {manifest.name!r} runs on the {ran} transport (its manifest says so): "
            f"a peer started with --transport {config.network.transport} cannot join it"
        )
    if config_hash(config) != config_hash(manifest.config()):
        raise ManifestError(
            f"run {manifest.name!r} takes its config from its manifest: --set may change only "
            "[peer], [data] and per-peer fields (train.device, train.batch_size, train.grad_accum)"
        )
    return replace(config, peer=replace(config.peer, run=manifest.name))
