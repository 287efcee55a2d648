"""The dashboard: each panel rendered from a pinned snapshot, and the observer's reading of a
run (admission applied, one record a round, the figures heartbeats carry)."""

from __future__ import annotations

import asyncio
import json
import re
from io import StringIO

from rich.console import Console

from p2pdiloco.cli.dashboard import Observer, admission_label, snapshot_json
from p2pdiloco.cli.panels import (
    render_audits,
    render_bytes,
    render_contributions,
    render_dashboard,
    render_header,
    render_loss,
    render_peers,
    render_windows,
    weight_shares,
)
from p2pdiloco.cli.snapshot import SwarmSnapshot
from p2pdiloco.identity import Identity
from p2pdiloco.protocol.membership import (
    BeatTally,
    Heartbeat,
    decode_heartbeat,
    members_key,
    seal_heartbeat,
)
from p2pdiloco.protocol.rounds import RoundRecord, record_subkey, rounds_key, signed_record
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.trust.admission import Admission, Certificate, issue_certificate

RUN = "panel-run"
NOW = 1_000_000.0
KEYS = [Identity.generate() for _ in range(3)]
A, B, C = (k.peer_id for k in KEYS)
OPERATOR = Identity.generate()


def text_of(renderable, width: int = 120) -> str:
    console = Console(file=StringIO(), width=width, color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


def record(
    round_id: int,
    synchronizer: str,
    contributors,
    fragment: int = 0,
    grace_s: float = 1.5,
    refused=(),
) -> RoundRecord:
    return RoundRecord(
        round=round_id,
        fragment=fragment,
        synchronizer=synchronizer,
        hash=f"h{round_id}",
        contributors=tuple(contributors),
        refused=tuple(refused),
        grace_s=grace_s,
        closed_at=NOW - 10 + round_id,
    )


def snapshot() -> SwarmSnapshot:
    members = {
        A: Heartbeat(
            peer_id=A,
            loss=2.50,
            eval_loss=2.61,
            staleness=0,
            bytes_sent=4_000_000,
            reply_bytes=1_000,
            replica_bytes=9_000_000,
            bytes_received=9_001_000,
            audits_ok=3,
            status="training",
        ),
        B: Heartbeat(
            peer_id=B,
            loss=2.40,
            eval_loss=2.60,
            staleness=1,
            bytes_sent=3_000_000,
            reply_bytes=2_000,
            replica_bytes=8_000_000,
            bytes_received=8_002_000,
            audits_unverifiable=1,
            status="syncing",
            synchronizing=(0,),
        ),
        C: Heartbeat(peer_id=C, loss=3.10, staleness=3, status="straggling"),
    }
    history = [
        [
            record(4, A, [(A, 0.5, 1000), (B, 0.5, 1000)]),
            record(
                5,
                B,
                [(A, 0.25, 500), (B, 0.5, 1000), (C, 0.25, 500)],
                refused=("d1",),
                grace_s=3.25,
            ),
        ]
    ]
    return SwarmSnapshot(
        run=RUN,
        taken_at=NOW,
        members=members,
        rounds=[history[0][-1]],
        loss_history=[2.9, 2.7, 2.6],
        last_seen={A: NOW, B: NOW - 2, C: NOW - 1},
        history=history,
        min_quorum=2,
        max_grace_s=5.0,
        admission={A: "certified", B: "learner", C: "not admitted"},
        admission_modes="synchronizers certified, learners certified",
    )


def test_contributions_show_each_learners_weight_share_and_staleness() -> None:
    shares = {s.peer_id: s for s in weight_shares(snapshot())}
    assert shares[B].mean == 0.5 and shares[B].last == 0.5 and shares[B].rounds == 2
    assert shares[A].mean == 0.375 and shares[A].last == 0.25 and shares[C].tokens == 500
    out = text_of(render_contributions(snapshot()))
    assert "contributions (last 2 rounds)" in out
    row_b = next(line for line in out.splitlines() if f"…{B[-6:]}" in line)
    assert "0.50" in row_b and " 1 " in row_b and "2,000" in row_b
    row_c = next(line for line in out.splitlines() if f"…{C[-6:]}" in line)
    assert "0.25" in row_c and " 3 " in row_c  # stale by 3 rounds
    assert "rounds between the base and the round" in out and "avg" in out


def test_windows_show_quorum_refusals_and_the_grace_waited() -> None:
    out = text_of(render_windows(snapshot()))
    assert "quorum K=2" in out and "grace ≤ 5 s" in out
    latest = next(line for line in out.splitlines() if "3/2" in line)
    assert " 6 " in latest and "3.2 s" in latest and f"…{B[-6:]}" in latest and " 1 " in latest
    earlier = next(line for line in out.splitlines() if "2/2" in line)
    assert f"…{A[-6:]}✓" in earlier and "1.5 s" in earlier  # a certified synchronizer
    empty = SwarmSnapshot(run=RUN, taken_at=NOW, history=[[]])
    assert "no round closed yet" in text_of(render_windows(empty))


def test_bytes_are_split_by_kind_with_a_total() -> None:
    out = text_of(render_bytes(snapshot()))
    assert "sent: deltas" in out and "recv: replies" in out and "recv: replica" in out
    total = next(line for line in out.splitlines() if line.strip("│ ").startswith("all"))
    assert "7.0 MB" in total and "3.0 KB" in total and "17.0 MB" in total


def test_audits_count_verdicts_and_flag_a_proven_false_merge() -> None:
    out = text_of(render_audits(snapshot()))
    total = next(line for line in out.splitlines() if line.strip("│ ").startswith("all"))
    assert total.split() == ["│", "all", "│", "3", "│", "0", "│", "1", "│"]
    snap = snapshot()
    snap.members[C] = Heartbeat(peer_id=C, audits_mismatch=1)
    assert "false merge was proven" in text_of(render_audits(snap))
    quiet = SwarmSnapshot(run=RUN, taken_at=NOW, members={A: Heartbeat(peer_id=A)})
    assert "no audits yet" in text_of(render_audits(quiet))


def test_loss_spread_across_learners() -> None:
    out = text_of(render_loss(snapshot()))
    assert (
        "train: 2.4000" in out
        and "median 2.5000" in out
        and "3.1000" in out
        and "spread 0.7000" in out
    )
    assert "held-out: 2.6000" in out and "spread 0.0100" in out
    row_c = next(line for line in out.splitlines() if f"…{C[-6:]}" in line)
    assert "+24.0%" in row_c
    nothing = SwarmSnapshot(run=RUN, taken_at=NOW, members={A: Heartbeat(peer_id=A)})
    assert "no learner has reported a loss yet" in text_of(render_loss(nothing))


def test_header_and_peers_show_the_admission() -> None:
    header = text_of(render_header(snapshot()))
    assert "synchronizers certified, learners certified" in header and "not admitted 1" in header
    peers = text_of(render_peers(snapshot()))
    assert f"…{A[-6:]}" in peers and "learner ✓" in peers and "not admitted" in peers
    assert "certified synchronizer" in peers
    open_run = snapshot()
    open_run.admission, open_run.admission_modes = {}, ""
    assert "admission" not in text_of(render_header(open_run)) and "✓" not in text_of(
        render_peers(open_run)
    )


def test_the_whole_screen_fits_a_demo_terminal_and_status_json_has_the_panels() -> None:
    out = text_of(render_dashboard(snapshot()), width=120)
    for title in ("contributions", "windows", "bytes by kind", "audits", "loss across learners"):
        assert title in out
    # every "…" starts a short peer id: rich cut no cell short
    assert f"…{A[-6:]}✓" in out and out.count("…") == len(
        re.findall(r"…[1-9A-HJ-NP-Za-km-z]{6}", out)
    )
    assert max(len(line) for line in out.splitlines()) <= 120
    # two panels a row at 120 columns; one under another in a pipe's 80, still uncut
    assert any("contributions" in line and "windows" in line for line in out.splitlines())
    narrow = text_of(render_dashboard(snapshot()), width=80)
    assert not any("contributions" in line and "windows" in line for line in narrow.splitlines())
    assert "closed by" in narrow and "recv: replica" in narrow and "vs median" in narrow
    data = json.loads(json.dumps(snapshot_json(snapshot())))
    assert (
        data["admission"] == "synchronizers certified, learners certified"
        and data["min_quorum"] == 2
    )
    assert data["windows"][0][-1]["refused"] == 1 and data["windows"][0][-1]["grace_s"] == 3.25
    assert {p["peer_id"]: p["admission"] for p in data["peers"]}[C] == "not admitted"
    assert data["loss_spread"]["train"]["width"] > 0.69
    assert {s["peer_id"]: s["mean"] for s in data["weight_shares"]}[B] == 0.5


def test_heartbeats_carry_the_panels_figures_and_old_ones_still_decode() -> None:
    beat = Heartbeat(
        peer_id=A,
        staleness=2,
        reply_bytes=5,
        replica_bytes=7,
        audits_ok=1,
        audits_mismatch=2,
        audits_unverifiable=3,
    )
    assert decode_heartbeat(beat.encode()) == beat
    import msgpack

    old = msgpack.unpackb(Heartbeat(peer_id=A).encode())
    for name in (
        "staleness",
        "reply_bytes",
        "replica_bytes",
        "audits_ok",
        "audits_mismatch",
        "audits_unverifiable",
    ):
        old.pop(name, None)  # a beat leaves out its zeros now; an old one never had these
    assert decode_heartbeat(msgpack.packb(old)) == Heartbeat(peer_id=A)


def test_the_tally_reads_staleness_and_verdicts_from_events() -> None:
    tally = BeatTally()
    tally.on_event({"event": "shipped", "fragment": 0, "round": 7, "base_round": 5})
    tally.on_event({"event": "delta_merged", "fragment": 0, "round": 6})  # not ours: ignored
    assert tally.staleness == 0
    tally.on_event({"event": "delta_merged", "fragment": 0, "round": 7})
    for verdict in ("ok", "ok", "unverifiable", "weird"):
        tally.on_event({"event": "audited", "verdict": verdict})
    assert tally.staleness == 2 and tally.audits == {"ok": 2, "mismatch": 0, "unverifiable": 1}


def certificate(identity: Identity, role: str = "synchronizer") -> bytes:
    return issue_certificate(OPERATOR, Certificate(RUN, identity.peer_id, role, NOW + 3600))


def test_the_observer_applies_the_manifests_admission() -> None:
    admission = Admission(synchronizers="certified", operator=OPERATOR.peer_id)
    certified, uncertified = KEYS[0], KEYS[1]

    async def observe() -> SwarmSnapshot:
        network = MemoryNetwork(clock=lambda: NOW)
        writer = MemoryTransport(network)
        await writer.start()
        for identity, certs in ((certified, (certificate(certified),)), (uncertified, ())):
            beat = Heartbeat(peer_id=identity.peer_id, certificates=certs)
            await writer.store(
                members_key(RUN), identity.peer_id, seal_heartbeat(identity, RUN, beat), NOW + 60
            )
        good = RoundRecord(
            round=3,
            fragment=0,
            synchronizer=certified.peer_id,
            hash="good",
            contributors=((certified.peer_id, 1.0, 10),),
            closed_at=NOW - 1,
            certificates=(certificate(certified),),
        )
        forged = RoundRecord(
            round=4, fragment=0, synchronizer=uncertified.peer_id, hash="forged", closed_at=NOW - 1
        )
        for rec, identity in ((good, certified), (forged, uncertified)):
            sealed = signed_record(identity, RUN, rec).sealed
            await writer.store(
                rounds_key(RUN, 0), record_subkey(rec.round, rec.synchronizer), sealed, NOW + 60
            )
        reader = MemoryTransport(network, client_mode=True)
        await reader.start()
        return await Observer(
            reader, RUN, 1, admission=admission, min_quorum=2, max_grace_s=5.0
        ).refresh()

    snap = asyncio.run(observe())
    assert (
        snap.rounds[0] is not None and snap.rounds[0].hash == "good"
    )  # the uncertified record is ignored
    assert [r.round for r in snap.history[0]] == [3]
    assert snap.admission == {certified.peer_id: "certified", uncertified.peer_id: "learner"}
    assert snap.min_quorum == 2 and snap.admission_modes == "synchronizers certified, learners open"
    assert admission_label(Admission(), RUN, Heartbeat(peer_id=A), NOW) == "open"
    allowlist = Admission(learners="allowlist", allowlist=frozenset({B}))
    assert admission_label(allowlist, RUN, Heartbeat(peer_id=A), NOW) == "not admitted"
