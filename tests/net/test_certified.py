"""A certified run, end to end: the operator's manifest decides who may synchronize.

The operator runs `p2pdiloco run init` (certified synchronizers, open learners) and
`run certify` for two peers; three learners join with `--manifest` and their own key
files, the third without a certificate. Every round is closed by a certified peer, the
uncertified one still learns and contributes, and its heartbeats (which carry no
certificate) never get it elected. Outsiders then audit a round, and export and sample the
run's current global model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from safetensors import safe_open

from p2pdiloco.cli.argv import child_join_args, set_args
from p2pdiloco.protocol.election import synchronizer_order

from .harness import start_peer_processes, write_identity
from .swarm_util import TINY_RUN, Events, applied, start_bootstrap, wait_all

pytestmark = pytest.mark.timeout(900)

ROUND_WAIT_S = 300
PER_PEER = {"data.max_files", "train.batch_size", "train.device"}


def p2pdiloco(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pdiloco", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_only_certified_peers_synchronize_a_certified_run(tmp_path) -> None:
    env = {**os.environ, "P2PDILOCO_HOME": str(tmp_path / "home")}
    manifest, key = tmp_path / "certrun.toml", tmp_path / "operator.key"
    run_sets = set_args(item for item in TINY_RUN if item.split("=")[0] not in PER_PEER)
    made = p2pdiloco(
        "run",
        "init",
        "certrun",
        "--operator-key",
        str(key),
        "--out",
        str(manifest),
        *run_sets,
        env=env,
    )
    assert made.returncode == 0, made.stderr
    ids = [write_identity(tmp_path / f"peer{i}.key") for i in range(3)]
    for peer in ids[:2]:
        done = p2pdiloco(
            "run", "certify", str(manifest), "--operator-key", str(key), "--peer", peer, env=env
        )
        assert done.returncode == 0, done.stderr

    boot = start_bootstrap("--manifest", str(manifest))  # stores only what the run's rules allow
    per_peer = [item for item in TINY_RUN if item.split("=")[0] in PER_PEER]
    joins = [
        child_join_args(
            "--manifest", str(manifest), "--identity", str(tmp_path / f"peer{i}.key"),
            "--initial-peers", *boot.maddrs, "--max-rounds", "500", sets=per_peer,
        )
        for i in range(3)
    ]  # fmt: skip
    peers = start_peer_processes(joins, ready_timeout_s=240, envs=[env] * 3)
    assert [p.peer_id for p in peers] == ids
    logs = [Events(p) for p in peers]
    # Run until a round that the uncertified peer would have closed, were certification
    # ignored (rendezvous election among all three), has been closed by someone else.
    would_win = next(r for r in range(2, 1000) if synchronizer_order("certrun", r, 0, ids)[0] == ids[2])
    wait_all(logs, applied(would_win), ROUND_WAIT_S)
    for log in logs:
        log.drain(quiet_s=1.0, max_s=5.0)

    certified, uncertified = set(ids[:2]), ids[2]
    closers = {e["round"]: log.peer.peer_id for log in logs for e in log.of("round_closed")}
    assert closers and set(closers.values()) <= certified, closers
    assert would_win in closers, closers
    assert not logs[2].of("round_closed")
    contributors = set().union(*(e["contributors"] for log in logs for e in log.of("round_closed")))
    assert uncertified in contributors  # open learners: it trains and is merged
    tables = [log.hashes() for log in logs]
    for key_ in set.intersection(*(set(t) for t in tables)):
        assert len({t[key_] for t in tables}) == 1, key_

    # an outsider audits the next round: catches up by a verified download, recomputes it
    audited = p2pdiloco(
        "audit", "--manifest", str(manifest), "--initial-peers", *boot.maddrs,
        "--wait-s", "240", "--json", env=env, timeout=360,
    )
    assert audited.returncode == 0, audited.stdout + audited.stderr[-3000:]
    report = json.loads(audited.stdout.strip().splitlines()[-1])
    assert report["verdict"] == "ok" and report["synchronizer"] in certified, report
    assert report["recomputed"] == report["hash"]

    # a volunteer takes the model home: the run's current global model, verified by hash
    # like a joiner's download, exported for transformers; and a few tokens from it
    found = ["--manifest", str(manifest), "--initial-peers", *boot.maddrs, "--wait-s", "240"]
    out = tmp_path / "model"
    exported = p2pdiloco("export", *found, "--out", str(out), env=env, timeout=360)
    assert exported.returncode == 0, exported.stdout + exported.stderr[-3000:]
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        meta, names = weights.metadata(), set(weights.keys())
    assert meta["source"] == "run certrun" and "model.embed_tokens.weight" in names
    for log in logs:
        log.drain(quiet_s=1.0, max_s=5.0)
    held = {key: h for log in logs for key, h in log.hashes().items()}
    rounds, hashes = meta["rounds"].split(","), meta["hashes"].split(",")
    for fragment, (round_id, hash_) in enumerate(zip(rounds, hashes, strict=True)):
        assert int(round_id) >= 1 and held.get((fragment, int(round_id) - 1)) == hash_, meta
    generated = p2pdiloco("generate", *found, "--max-new-tokens", "8", "def ", env=env, timeout=360)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith("def ")
    for peer in peers:
        peer.request_stop(signal.SIGTERM)
    assert [peer.wait_exit(60) for peer in peers] == [0, 0, 0]
