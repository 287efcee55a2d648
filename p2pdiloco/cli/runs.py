"""Operator and auditor commands: `p2pdiloco run init|sign|certify|show`, `runs`, `identity`,
`audit`.

An operator keeps one Ed25519 key (`--operator-key`, created by `run init`); it signs the
run manifest and the certificates that entitle peers to synchronize (or to learn, in a
certified-learners run). `audit` lets anyone check a round of a live run against the
signed contributions, without trusting the synchronizer or the peers it asks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from p2pdiloco.cli.options import add_config_options, add_watch_flags, observer_config
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError
from p2pdiloco.identity import Identity, is_peer_id, load_or_create_identity
from p2pdiloco.transport.bootstrap import check_multiaddr, known_runs, run_file
from p2pdiloco.trust.admission import (
    LEARNER_MODES,
    ROLES,
    SYNCHRONIZER_MODES,
    Certificate,
    issue_certificate,
)
from p2pdiloco.trust.manifest import (
    Manifest,
    ManifestError,
    config_text_of,
    describe,
    manifest_file_for,
    parse_manifest,
    read_manifest,
    render_manifest,
    sign_manifest,
    verify_manifest,
)

DAY_S = 86400.0


def _operator(path: Path) -> Identity:
    try:
        return load_or_create_identity(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--operator-key {path}: {exc}") from None


def _write(path: Path, manifest: Manifest) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render_manifest(manifest), encoding="utf-8")
    tmp.replace(path)


def _unsigned(path: Path) -> Manifest:
    """A manifest file as written, signature not required (for re-signing after edits)."""
    try:
        return parse_manifest(path.read_text(encoding="utf-8"), str(path))
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None


def cmd_run_init(args: argparse.Namespace) -> int:
    operator = _operator(args.operator_key)
    config = load_config(args.config, args.overrides)
    allowlist = tuple(args.allow or ())
    if any(not is_peer_id(p) for p in allowlist):
        raise ConfigError("--allow takes peer ids (12D3KooW...)")
    manifest = Manifest(
        name=args.name,
        operator=operator.peer_id,
        config_text=config_text_of(config),
        bootstrap=tuple(check_multiaddr(a, "--bootstrap") for a in args.bootstrap or ()),
        synchronizers=args.synchronizers,
        learners=args.learners,
        allowlist=allowlist,
    )
    manifest = sign_manifest(manifest, operator)
    verify_manifest(manifest)
    out = args.out or Path("bootstrap_peers") / f"{args.name}.toml"
    _write(out, manifest)
    print(f"wrote {out} (operator {operator.peer_id}, key {args.operator_key})")
    return 0


def cmd_run_sign(args: argparse.Namespace) -> int:
    manifest = sign_manifest(_unsigned(args.manifest), _operator(args.operator_key))
    verify_manifest(manifest)
    _write(args.manifest, manifest)
    print(f"signed {args.manifest}")
    return 0


def cmd_run_certify(args: argparse.Namespace) -> int:
    operator = _operator(args.operator_key)
    manifest = read_manifest(args.manifest)
    if not is_peer_id(args.peer):
        raise ConfigError(f"--peer {args.peer!r} is not a peer id (12D3KooW...)")
    expires = time.time() + args.days * DAY_S
    cert = issue_certificate(operator, Certificate(manifest.name, args.peer, args.role, expires))
    manifest = sign_manifest(
        dataclasses.replace(manifest, certificates=(*manifest.certificates, cert)), operator
    )
    _write(args.manifest, manifest)
    print(f"certified {args.peer} as {args.role} in {manifest.name} for {args.days:g} days")
    return 0


def cmd_run_show(args: argparse.Namespace) -> int:
    target = str(args.manifest)
    path = Path(target) if target.endswith(".toml") else manifest_file_for(target)
    if path is None:
        raise ManifestError(f"no manifest for run {target!r} (bootstrap_peers/{target}.toml)")
    print(describe(read_manifest(path)))
    return 0


def describe_run(name: str) -> dict:
    """What `p2pdiloco runs` says of one known run: its kind, bootstrap peers and file.

    A signed manifest (`<run>.toml`) wins over a bootstrap list (`<run>.txt`), as in `join`;
    a manifest that does not verify is listed with the reason, not raised.
    """
    manifest_path, list_path = run_file(name, ".toml"), run_file(name, ".txt")
    if manifest_path is not None:
        try:
            manifest = read_manifest(manifest_path)
        except ConfigError as exc:
            return {"run": name, "kind": "manifest", "bootstrap": 0, "file": str(manifest_path), "problem": str(exc)}
        return {
            "run": name,
            "kind": "manifest",
            "bootstrap": len(manifest.bootstrap),
            "file": str(manifest_path),
            "operator": manifest.operator,
            "model": manifest.config().model.preset,
        }
    assert list_path is not None, name  # known_runs() named it
    try:
        lines = list_path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return {"run": name, "kind": "open", "bootstrap": 0, "file": str(list_path), "problem": str(exc)}
    count = sum(1 for line in lines if line.split("#", 1)[0].strip())
    return {"run": name, "kind": "open", "bootstrap": count, "file": str(list_path)}


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs this installation knows by name (`join --run NAME`)."""
    runs = [describe_run(name) for name in known_runs()]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print("no known runs: pass --manifest PATH or --initial-peers to join one")
        return 0
    width = max(len(r["run"]) for r in runs)
    for run in runs:
        if "problem" in run:
            what = f"invalid: {run['problem']}"
        elif run["kind"] == "manifest":
            what = f"signed manifest, model {run['model']}, operator …{run['operator'][-8:]}"
        else:
            what = "open run (bootstrap list)"
        peers = f"{run['bootstrap']} bootstrap peer{'s' if run['bootstrap'] != 1 else ''}"
        print(f"{run['run']:<{width}}  {what}; {peers}  {run['file']}")
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    """Print the peer id of a key file (created if missing): what an operator certifies."""
    try:
        print(load_or_create_identity(args.path).peer_id)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{args.path}: {exc}") from None
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Audit the next round of a live run; exit 0 ok, 1 proven false, 3 unverifiable."""
    from p2pdiloco.peer.daemon import make_transport_for
    from p2pdiloco.roles.observer import audit_next_round
    from p2pdiloco.trust.audit import MISMATCH, OK

    config, admission = observer_config(args)
    transport = make_transport_for(dataclasses.replace(config.peer, client_mode=True), kind=config.network.transport)

    async def audit():
        await transport.start()
        try:
            return await audit_next_round(transport, config, admission, args.fragment, args.wait_s)
        finally:
            await transport.shutdown()

    result, record = asyncio.run(audit())
    report = {
        "verdict": result.verdict,
        "reason": result.reason,
        "round": record.round if record else None,
        "fragment": record.fragment if record else None,
        "synchronizer": record.synchronizer if record else None,
        "hash": record.hash if record else None,
        "recomputed": result.recomputed_hash,
    }
    print(json.dumps(report) if args.json else " ".join(f"{k}={v}" for k, v in report.items()))
    return 0 if result.verdict == OK else 1 if result.verdict == MISMATCH else 3


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`run init|sign|certify|show`, `runs`, `identity` and `audit` on the top-level parser."""
    run = sub.add_parser("run", help="operator tools: the signed run manifest and certificates")
    verbs = run.add_subparsers(dest="verb", metavar="VERB")
    init = verbs.add_parser("init", help="create a signed manifest (and the operator key)")
    init.add_argument("name", help="run name")
    add_config_options(init)
    init.add_argument("--operator-key", type=Path, required=True, help="operator key file (created if missing)")
    init.add_argument("--bootstrap", nargs="*", metavar="MULTIADDR", help="bootstrap multiaddrs")
    init.add_argument("--synchronizers", choices=SYNCHRONIZER_MODES, default="certified")
    init.add_argument("--learners", choices=LEARNER_MODES, default="open")
    init.add_argument("--allow", nargs="*", metavar="PEER_ID", help="learners' allowlist")
    init.add_argument("--out", type=Path, help="manifest path (default bootstrap_peers/<name>.toml)")
    init.set_defaults(handler=cmd_run_init)
    sign = verbs.add_parser("sign", help="re-sign a manifest after editing it")
    sign.add_argument("manifest", type=Path)
    sign.add_argument("--operator-key", type=Path, required=True)
    sign.set_defaults(handler=cmd_run_sign)
    certify = verbs.add_parser("certify", help="entitle a peer (synchronizer or learner)")
    certify.add_argument("manifest", type=Path)
    certify.add_argument("--operator-key", type=Path, required=True)
    certify.add_argument("--peer", required=True, help="peer id to certify")
    certify.add_argument("--role", choices=ROLES, default="synchronizer")
    certify.add_argument("--days", type=float, default=30.0, help="validity (default 30 days)")
    certify.set_defaults(handler=cmd_run_certify)
    show = verbs.add_parser("show", help="verify a manifest and print what it says")
    show.add_argument("manifest", help="a manifest file or a run name")
    show.set_defaults(handler=cmd_run_show)

    runs = sub.add_parser("runs", help="list the known runs (shipped with p2pdiloco or in ./bootstrap_peers)")
    runs.add_argument("--json", action="store_true", help="machine-readable output")
    runs.set_defaults(handler=cmd_runs)

    identity = sub.add_parser("identity", help="print the peer id of a key file (created if missing)")
    identity.add_argument("path", type=Path, help="Ed25519 key file, as given to join --identity")
    identity.set_defaults(handler=cmd_identity)

    audit = sub.add_parser("audit", help="recompute the next round of a live run from its signed contributions")
    add_config_options(audit)
    add_watch_flags(audit)
    audit.add_argument("--fragment", type=int, default=0, help="fragment to audit (default 0)")
    audit.add_argument("--wait-s", type=float, default=600.0, help="give up after this long")
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.set_defaults(handler=cmd_audit)
