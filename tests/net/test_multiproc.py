"""A learner over several processes (torchrun, DDP on gloo) in a swarm of real peers.

One 2-process learner and two single-process learners train one model: every replica
holds the same global state after every round, the 2-process learner claims the tokens
of both its ranks, the merge weighs every learner by what it claimed, and the learner's
two ranks end with the same parameters.
"""

from __future__ import annotations

import pytest

from p2pdiloco.outer.step import token_weights

from .harness import start_peer_processes
from .swarm_util import Events, join_args, start_bootstrap, wait_all
from .test_swarm import assert_replicas_identical

pytestmark = pytest.mark.timeout(600)

ROUND_WAIT_S = 300
TOKENS_PER_RANK_STEP = 2 * 32
"""train.batch_size × model.seq_len of the tiny test run (swarm_util.TINY_RUN)."""
STALENESS_DISCOUNT = 0.5
"""sync.staleness_discount (the default), to recompute the merge weights."""


def torchrun(nproc: int, args: list[str]) -> list[str]:
    """`python -m torch.distributed.run ... -m p2pdiloco join ...`: one learner, `nproc` ranks."""
    assert args[:2] == ["-m", "p2pdiloco"]
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def last_claims(log: Events) -> dict[tuple[int, int], dict]:
    """(fragment, round) -> the last delta this peer sent to it (a resend replaces a claim)."""
    return {(e["fragment"], e["round"]): e for e in log.of("shipped")}


def test_two_process_learner_counts_double_and_replicas_stay_identical() -> None:
    boot = start_bootstrap()
    sets = [
        "sync.min_quorum=3",  # every round waits for all three learners
        "sync.num_fragments=2",
        # no share cap and no bound by the median claim (screening's rules, tested there):
        # the weights show the claims as they are
        "outer.max_weight_share=1.0",
        "screening.token_factor=100",
    ]
    flags = ["--max-rounds", "3", "--data-shards", "3"]
    many = [
        join_args(initial=boot.maddrs, sets=sets, flags=[*flags, "--data-rank", str(i)])
        for i in range(3)
    ]
    many[0] = torchrun(2, many[0])
    peers = start_peer_processes(many, ready_timeout_s=240)
    logs = [Events(p) for p in peers]
    wait_all(logs, lambda e: e.get("event") == "stopped", ROUND_WAIT_S)
    multi, singles = logs[0], logs[1:]

    # the global state: one hash per (fragment, round) across the three learners
    assert_replicas_identical(logs, min_common=6)

    # the 2-process learner claims both ranks' tokens, a single learner its own
    for log, ranks in [(multi, 2), *[(s, 1) for s in singles]]:
        claims = log.of("shipped")
        assert claims
        for claim in claims:
            assert claim["tokens"] == ranks * TOKENS_PER_RANK_STEP * claim["steps"], claim

    # and the merge weighs each contributor by its claim (Decoupled DiLoCo §3.2)
    claims = {log.peer.peer_id: last_claims(log) for log in logs}
    closed = [e for log in logs for e in log.of("round_closed")]
    assert len(closed) >= 6
    for event in closed:
        key = (event["fragment"], event["round"])
        assert sorted(event["contributors"]) == sorted(claims), event
        sent = [claims[p][key] for p in event["contributors"]]
        expected = token_weights(
            [c["tokens"] for c in sent],
            [c["steps"] for c in sent],
            staleness=[event["round"] - c["base_round"] for c in sent],
            staleness_discount=STALENESS_DISCOUNT,
        )
        assert event["weights"] == pytest.approx(expected, rel=1e-6), (event, sent)

    # its two ranks trained one replica: the same parameters on both at the end
    (finished,) = multi.of("trainer_finished")
    assert finished["world_size"] == 2 and finished["ranks_identical"], finished
    summary = multi.wait(lambda e: e.get("event") == "summary", 1)
    assert summary["tokens"] == 2 * TOKENS_PER_RANK_STEP * summary["steps"]
    for peer in peers:
        assert peer.stop() == 0
