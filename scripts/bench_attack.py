"""Benchmark: what one Byzantine learner does to the model with the defences on, and what
the defences cost when nobody attacks.

Same seed, same learners, the synchronizer's own merge (`merging.merge_round`: screening,
bounded token weights, the outer codec) and outer step (`GlobalState.apply_update`), in
one process: a clean run of M-1 honest learners (learner 0 is absent: it sends nothing),
then one run per attack in which learner 0 joins them and sends, every round, what the
attack makes of its own honest delta. Each delta goes through the run's codec, as on the
wire. Figures:

- `loss_shift` per attack: (held-out loss attacked - clean) / clean, at the end: what
  the attacker changed (target at most +1% each; below zero, its work helped).
  `vs_all_honest`: the same against a run in which learner 0 is honest too (what
  refusing it costs: its data is lost with it).
  `honest_rounds_kept`: the share of rounds in which no honest delta was refused;
  `attacker_weight`: its mean merge weight. `undefended_x1000` is the x1000 attack with
  screening switched off: the damage the defences prevent.
- `defence_cost` at zero attackers, per peer and round, as a share of the round: seconds
  (signing its contribution; verifying the signatures and records it reads; screening,
  amortised over the M peers that take turns as synchronizer; the sampled audit:
  `sync.audit_share / M` of recomputing a round from its M signed contributions) against
  the compute of a round of the embedded default (its batch, sequence length and H on
  the bench's model); bytes (signatures and envelopes, and the audit's
  download of M contributions at the same rate) against its traffic (a contribution up,
  an update down). Target below 2% each.

The network attacks (forged and malformed records and frames, floods) never reach the
merge: tests/net/test_attacks.py shows each refused at the door.

    python scripts/bench_attack.py --quick               # ~1 min on 2 cores
    python scripts/bench_attack.py --json out/attack.json  # tiny, M=4, H=20, 16 rounds
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco import compress, wire  # noqa: E402
from p2pdiloco.config import load_config, replace  # noqa: E402
from p2pdiloco.identity import Identity  # noqa: E402
from p2pdiloco.outer import screening  # noqa: E402
from p2pdiloco.outer.fragment_state import outer_update  # noqa: E402
from p2pdiloco.outer.step import Params, pseudo_gradient, tensor_norm  # noqa: E402
from p2pdiloco.protocol.merge import max_tokens_per_step, merge_round  # noqa: E402
from p2pdiloco.protocol.rounds import RoundRecord, open_record, seal_record  # noqa: E402
from p2pdiloco.roles.state import GlobalState  # noqa: E402
from p2pdiloco.sim.common import global_state_of, learner_streams, load_params  # noqa: E402
from p2pdiloco.training.data import Corpus, heldout_batches  # noqa: E402
from p2pdiloco.training.model import build_model  # noqa: E402
from p2pdiloco.training.train import InnerTrainer, evaluate  # noqa: E402
from p2pdiloco.wire.contributions import open_contribution, seal_contribution  # noqa: E402

ATTACKER = 0
RUN = "bench"
Attack = Callable[[Params, int, dict], tuple[Params, int]]


def scaled(factor: float) -> Attack:
    return lambda delta, tokens, memory: ({n: t * factor for n, t in delta.items()}, tokens)


def random_direction(delta: Params, tokens: int, memory: dict) -> tuple[Params, int]:
    generator = memory.setdefault("generator", torch.Generator().manual_seed(7))
    noise = {n: torch.randn(t.shape, generator=generator) for n, t in delta.items()}
    scale = tensor_norm(delta) / tensor_norm(noise)
    return {n: t * scale for n, t in noise.items()}, tokens


def silent(delta: Params, tokens: int, memory: dict) -> tuple[Params, int]:
    """Learner 0 absent: it sends no work (refused for it), as if it had never joined."""
    return {n: torch.zeros_like(t) for n, t in delta.items()}, 0


def inflated_tokens(delta: Params, tokens: int, memory: dict) -> tuple[Params, int]:
    return delta, tokens * 1000


def stale_replay(delta: Params, tokens: int, memory: dict) -> tuple[Params, int]:
    return memory.setdefault("first", delta), tokens


ATTACKS: dict[str, Attack] = {
    "x1000": scaled(1000.0),
    "sign_flip": scaled(-1.0),
    "flip_x10": scaled(-10.0),
    "random_direction": random_direction,
    "inflated_tokens": inflated_tokens,
    "stale_replay": stale_replay,
    "x2.5_under_clip": scaled(2.5),
}
UNDEFENDED = screening.ScreeningRules(
    clip_factor=1e30, refuse_factor=1e30, max_param_ratio=1e30, momentum_min_cosine=-1.0,
    loo_min_cosine=-1.0, token_factor=1e30,
)


@dataclasses.dataclass
class RunFigures:
    eval_loss: float
    rounds_applied: int
    honest_rounds_kept: float
    honest_refused: int
    """Honest deltas the merge refused, over all rounds."""
    attacker_weight: float
    step_s: float
    """Mean seconds of one inner step (the round's compute is H of them)."""
    last_round: dict | None = None
    """The last round's inputs (candidates, history, state), for the cost figures."""


def run(config, corpus: Corpus, eval_set, attack: Attack | None, rules) -> RunFigures:
    """One simulated run; learner ATTACKER applies `attack` to each delta it sends."""
    learners, steps, rounds = config.simulate.learners, config.sync.inner_steps, config.simulate.rounds
    base = build_model(config.model.preset, seed=config.train.seed, max_seq_len=config.model.seq_len)
    params = global_state_of(base)
    state = GlobalState(params, [list(params)], config.outer)
    trainers = [InnerTrainer(copy.deepcopy(base), config.train, torch.device("cpu")) for _ in range(learners)]
    streams = learner_streams(config, corpus, learners)
    codec = compress.make_codec_from_config(config.compress)
    outer_codec = compress.make_codec_from_config(config.compress, outer=True)
    cap = max_tokens_per_step(config)
    records: list[list[tuple[float, int]]] = []
    memory: dict = {}
    honest_kept = honest_refused = attacker_weights = applied = 0
    step_time = 0.0
    last = None
    for round_id in range(rounds):
        candidates = []
        for rank, trainer in enumerate(trainers):
            load_params(trainer.model, state.params)
            started, tokens = time.perf_counter(), 0
            for _ in range(steps):
                tokens += trainer.step(streams[rank]).tokens
            step_time += (time.perf_counter() - started) / steps
            delta = pseudo_gradient(state.params, dict(trainer.model.named_parameters()))
            if attack is not None and rank == ATTACKER:
                delta, tokens = attack(delta, tokens, memory)
            sent = compress.decode_tensors(compress.encode_tensors(codec, delta), finite=False)
            candidates.append(screening.Candidate(f"peer{rank}", sent, tokens, steps))
        snapshot = state.export_fragment(0)
        history = screening.history_of(records, rules.history_rounds)
        result = merge_round(
            candidates, history=history, params=snapshot.params, momentum=snapshot.momentum,
            outer=config.outer, sync=config.sync, rules=rules, max_tokens_per_step=cap,
            outer_codec=outer_codec,
        )
        verdicts = {v.peer: v for v in result.screening.verdicts}
        honest = [v for p, v in verdicts.items() if p != f"peer{ATTACKER}"]
        honest_kept += all(v.kept for v in honest)
        honest_refused += sum(not v.kept for v in honest)
        attacker_weights += verdicts[f"peer{ATTACKER}"].weight
        kept = result.screening.kept
        if result.decoded is not None and len(kept) >= config.sync.min_quorum:
            try:
                state.apply_update(0, round_id, result.decoded)
            except ValueError:  # non-finite: the round is skipped (only possible undefended)
                state.rounds[0] = round_id + 1
            else:
                applied += 1
                records.append([(v.history_norm, v.tokens) for v in kept])
        else:
            state.rounds[0] = round_id + 1
        last = {"candidates": candidates, "history": history, "snapshot": snapshot, "result": result}
    eval_model = copy.deepcopy(base)
    load_params(eval_model, state.params)
    loss = evaluate(eval_model, eval_set, torch.device("cpu"))
    return RunFigures(
        eval_loss=loss if loss == loss else float("inf"),
        rounds_applied=applied,
        honest_rounds_kept=honest_kept / rounds,
        honest_refused=honest_refused,
        attacker_weight=attacker_weights / rounds,
        step_s=step_time / (rounds * learners),
        last_round=last,
    )


def timed(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median seconds of `fn()`."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def default_round_s(config) -> float:
    """Seconds of one round of the embedded default's schedule (its batch, sequence length
    and H inner steps) on the bench's model: what a defence's cost is a share of."""
    default = load_config(None, [])
    settings = replace(
        config,
        model={"seq_len": default.model.seq_len},
        train={"batch_size": default.train.batch_size, "warmup_steps": 0},
    )
    model = build_model(settings.model.preset, seed=0, max_seq_len=settings.model.seq_len)
    trainer = InnerTrainer(model, settings.train, torch.device("cpu"))
    stream = learner_streams(settings, Corpus.from_config(settings.data), 1)[0]
    trainer.step(stream)  # warm-up
    return default.sync.inner_steps * timed(lambda: trainer.step(stream), 5)


def defence_cost(config, clean: RunFigures, rules) -> dict:
    """Seconds and bytes the defences add per peer and round, at zero attackers."""
    last = clean.last_round
    learners, steps = config.simulate.learners, config.sync.inner_steps
    codec = compress.make_codec_from_config(config.compress)
    me = Identity.generate()
    frames = []
    for candidate in last["candidates"]:
        message = wire.Message(
            kind=wire.CONTRIBUTION, run=RUN, round=0, fragment=0,
            meta={"peer": me.peer_id, "base_round": 0, "tokens": candidate.tokens, "steps": steps},
            tensors=compress.encode_tensors(codec, candidate.delta),
        )
        frames.append(wire.encode_message(message))
    sealed = [seal_contribution(me, RUN, f) for f in frames]
    record = RoundRecord(
        round=0, fragment=0, synchronizer=me.peer_id, hash="a" * 32, parent="b" * 32, digest="c" * 32,
        contributions=tuple("d" * 32 for _ in frames), norms=tuple(1.0 for _ in frames),
        contributors=tuple((f"peer{i}", 0.25, 100) for i in range(len(frames))),
    )
    sealed_record = seal_record(me, RUN, record)
    update_bytes = sum(len(e.payload) for e in last["result"].encoded.values())

    seal_s = timed(lambda: seal_contribution(me, RUN, frames[0]))
    open_s = timed(lambda: open_contribution(RUN, me.peer_id, sealed[0], 1 << 30))
    record_s = timed(lambda: open_record(RUN, sealed_record))
    snapshot = last["snapshot"]

    def screen() -> None:
        screening.screen(
            last["candidates"], last["history"], rules, snapshot.momentum, params=snapshot.params,
            max_tokens_per_step=max_tokens_per_step(config), max_weight_share=config.outer.max_weight_share,
        )

    def audit() -> None:  # what `audit.audit_round` does: open, decode, merge, outer step on a copy
        for item in sealed:
            frame = open_contribution(RUN, me.peer_id, item, 1 << 30)
            msg = wire.decode_message(frame, wire.WireLimits())
            wire.decode_tensors(msg, {n: tuple(t.shape) for n, t in last["candidates"][0].delta.items()})
        merged = merge_round(
            last["candidates"], history=last["history"], params=snapshot.params, momentum=snapshot.momentum,
            outer=config.outer, sync=config.sync, rules=rules, max_tokens_per_step=max_tokens_per_step(config),
            outer_codec=compress.make_codec_from_config(config.compress, outer=True),
        )
        outer_update(GlobalState(dict(snapshot.params), [list(snapshot.params)], config.outer).checked_copy(snapshot),
                     merged.decoded, config.outer)

    screen_s, audit_s = timed(screen, 3), timed(audit, 3)
    audit_rate = min(1.0, config.sync.audit_share / learners)  # per peer and round
    round_s = default_round_s(config)
    seconds = {
        "sign_and_verify": seal_s + open_s + 2 * record_s,  # its contribution; the synchronizer's check; records
        "screening": screen_s / learners,
        "audit": audit_rate * audit_s,
    }
    envelope = len(sealed[0]) - len(frames[0]) + len(sealed_record) - len(record.encode())
    round_bytes = len(frames[0]) + update_bytes
    bytes_ = {"signatures": envelope, "audit": audit_rate * sum(len(s) for s in sealed)}
    return {
        "round": "the embedded default's batch, seq_len and inner_steps on the bench model",
        "round_s": round_s,
        "round_bytes": round_bytes,
        "seconds": seconds,
        "bytes": bytes_,
        "seconds_share": sum(seconds.values()) / round_s,
        "bytes_share": sum(bytes_.values()) / round_bytes,
        "audit_once_s": audit_s,
        "audit_share": config.sync.audit_share,
    }


NETWORK_ATTACKS: dict[str, str] = {
    # benchmark name: the tests/net/adversary.py attacks it runs, in order (comma-separated)
    "none": "",  # a second clean swarm: the noise floor of every figure below
    "sybil_heartbeats": "sybil_heartbeats",
    "heartbeat_replay": "replayed_beats",
    "hijacked_rounds": "sybil_heartbeats,hijacked_rounds",
    "slow_bodies": "slow_bodies",
    "notice_flood": "notice_flood",
    "hold_flood": "hold_flood",
    "forgeries": "forged_heartbeats,plain_values,fake_members,forged_records,bad_contributions,state_flood",
    # issue 42: learner 0's key (named by the chain) signs late rivals of old rounds and
    # floods the round key; a free key keeps a chain longer than the head
    "late_rivals": "late_rivals",
    "record_flood": "record_flood",
    "free_chain": "free_chain",
    "forged_state": "forged_state",
    "full_stop": "",  # every peer stops, all come back two hours on (attack_swarm.run_full_stop)
}
"""Attacks a stranger runs over the network against real peer processes (attack_swarm.py)."""
QUICK_NETWORK = ("none", "sybil_heartbeats", "hijacked_rounds", "slow_bodies")


def merge_attacks(config, corpus, eval_set, names: list[str]) -> tuple[dict, RunFigures, RunFigures]:
    """The in-process attacks on the merge: a Byzantine learner's deltas (see the top)."""
    all_honest = run(config, corpus, eval_set, None, config.screening)
    clean = run(config, corpus, eval_set, silent, config.screening)
    attacks = {}
    for name in names:
        figures = run(config, corpus, eval_set, ATTACKS[name], config.screening)
        attacks[name] = {
            "rounds_ratio": figures.rounds_applied / max(clean.rounds_applied, 1),
            "loss_shift": (figures.eval_loss - clean.eval_loss) / clean.eval_loss,
            "honest_lost": figures.honest_refused,
            "eval_loss": figures.eval_loss,
            "vs_all_honest": (figures.eval_loss - all_honest.eval_loss) / all_honest.eval_loss,
            "honest_rounds_kept": figures.honest_rounds_kept,
            "attacker_weight": figures.attacker_weight,
            "rounds_applied": figures.rounds_applied,
            "where": "merge (in-process)",
        }
        print(f"{name:18s} loss {figures.eval_loss:.5f} shift {attacks[name]['loss_shift']:+.2%} "
              f"honest kept {figures.honest_rounds_kept:.0%} attacker weight {figures.attacker_weight:.3f}")
    return attacks, clean, all_honest


def network_attacks(names: list[str], quick: bool) -> tuple[dict, dict]:
    """Each network attack against its own real swarm, and a clean swarm for the loss."""
    import attack_swarm  # noqa: PLC0415 - a sibling script; spawns processes only when asked

    setting = attack_swarm.NetSetting(learners=3, window_s=30.0 if quick else 60.0, inner_steps=10)
    print(f"network attacks: {setting.learners} learners, windows of {setting.window_s:.0f} s")
    reference = attack_swarm.run_swarm(setting, None, print)
    attacks = {}
    for name in names:
        if name == "full_stop":
            attacked = attack_swarm.run_full_stop(setting, print)
        else:
            attacked = attack_swarm.run_swarm(setting, NETWORK_ATTACKS[name] or None, print)
        attacks[name] = {**attack_swarm.attack_figures(attacked, reference), "where": "network (real processes)"}
    clean = {
        "setting": {**dataclasses.asdict(setting), "sets": setting.sets()},
        "rounds_per_min_ratio_clean_vs_clean": attack_swarm.attack_figures(reference, reference)["rounds_ratio"],
    }
    return attacks, clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="merge attacks, comma-separated")
    parser.add_argument(
        "--network", default=None,
        help=f"network attacks, comma-separated (default: all; --quick: {','.join(QUICK_NETWORK)}; 'none': skip)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)
    rounds, steps, seq_len = (6, 6, 32) if args.quick else (16, 20, 64)
    config = load_config(
        None,
        [
            "model.preset='tiny'", f"model.seq_len={seq_len}", "train.batch_size=4", "train.device='cpu'",
            "train.warmup_steps=10", f"sync.inner_steps={steps}", f"simulate.rounds={rounds}",
            "simulate.learners=4", "sync.min_quorum=2", f"data.max_files={60 if args.quick else 200}",
        ],
    )
    config = replace(config, train={"total_steps": rounds * steps})
    corpus = Corpus.from_config(config.data)
    eval_set = heldout_batches(corpus, 8, config.train.batch_size, config.model.seq_len)
    started = time.perf_counter()
    attacks, clean, all_honest = merge_attacks(config, corpus, eval_set, args.attacks.split(","))
    undefended = run(config, corpus, eval_set, ATTACKS["x1000"], UNDEFENDED)
    cost = defence_cost(config, all_honest, config.screening)
    network = args.network or ",".join(QUICK_NETWORK if args.quick else NETWORK_ATTACKS)
    network_setting: dict = {}
    if network != "none":
        found, network_setting = network_attacks(network.split(","), args.quick)
        attacks.update(found)
    report = {
        "setting": {
            "merge": {
                "model": "tiny", "learners": 4, "inner_steps": steps, "rounds": rounds, "seq_len": seq_len,
                "batch_size": 4, "attacker": "learner 0 of 4", "quick": args.quick,
            },
            "network": network_setting,
        },
        "clean_eval_loss": clean.eval_loss,
        "all_honest_eval_loss": all_honest.eval_loss,
        "attacks": attacks,
        "undefended_x1000": {
            "eval_loss": undefended.eval_loss,
            "loss_shift": (undefended.eval_loss - clean.eval_loss) / clean.eval_loss,
        },
        "defence_cost": cost,
        "worst_loss_shift": max(
            a["loss_shift"] for n, a in attacks.items() if a["loss_shift"] is not None and n != "none"
        ),
        "worst_rounds_ratio": min(a["rounds_ratio"] for n, a in attacks.items() if n != "none"),
        "honest_lost": sum(a["honest_lost"] for n, a in attacks.items() if n != "none"),
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(
        f"bench_attack: {len(attacks)} attacks; worst rounds ratio {report['worst_rounds_ratio']:.2f}, "
        f"worst loss shift {report['worst_loss_shift']:+.2%}, honest lost {report['honest_lost']} "
        f"(undefended x1000: {report['undefended_x1000']['loss_shift']:+.0%}); "
        f"defences cost {cost['seconds_share']:.2%} of a round's time, {cost['bytes_share']:.2%} of its bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
