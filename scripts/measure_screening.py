"""Experiment: the honest figures behind the thresholds of `p2pdiloco/outer/screening.py`.

M learners train the tiny model with plain DiLoCo (token-weighted merge, outer Nesterov)
for R rounds of H inner steps, in one process. At every round, before the outer step,
each fragment of an F-way split is measured the way a synchronizer screens it:

    momentum cosine     cos(delta, outer momentum of the fragment), rounds >= 1
    leave-one-out       cos(delta, sum of the other deltas' unit directions)
    ... one flipped     the same for an honest delta when one of the others is negated
    norm / history      norm / median of the norms of the previous `--history-rounds` rounds
    norm / params       norm / the fragment's parameter norm

for honest deltas, for a sign-flipped delta (a learner's own delta negated) and for a
random direction of the same norm. Then `screening.screen` with the default rules is run
on the honest windows (everything should be kept) and on attacked ones (x10, x100 and
x1000 alone with history, a flip among honest others, a random direction).

`--codec sparse2` (or any codec) sends each learner's delta through the codec with its own
error feedback, as a learner does, and measures and merges what the synchronizer decodes.

    python scripts/measure_screening.py            # ~1.5 min on one core
    python scripts/measure_screening.py --rounds 20 --inner-steps 30 --json out/screening.json
    python scripts/measure_screening.py --codec sparse2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from p2pdiloco import compress  # noqa: E402
from p2pdiloco.config import load_config, replace  # noqa: E402
from p2pdiloco.outer import screening  # noqa: E402
from p2pdiloco.outer.step import (  # noqa: E402
    OuterState,
    Params,
    merge,
    outer_step,
    pseudo_gradient,
    tensor_norm,
    token_weights,
)
from p2pdiloco.protocol.fragments import partition_fragments  # noqa: E402
from p2pdiloco.sim.common import global_state_of, learner_streams, load_params  # noqa: E402
from p2pdiloco.training.data import Corpus  # noqa: E402
from p2pdiloco.training.model import build_model  # noqa: E402
from p2pdiloco.training.train import InnerTrainer  # noqa: E402

MAX_TOKENS_PER_STEP = 1 << 20  # tokens are not what this experiment measures


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def part(params: Params, names: list[str]) -> Params:
    return {n: params[n] for n in names if n in params}


def random_like(delta: Params, norm: float, generator: torch.Generator) -> Params:
    noise = {n: torch.randn(t.shape, generator=generator) for n, t in delta.items()}
    scale = norm / tensor_norm(noise)
    return {n: t * scale for n, t in noise.items()}


def measure_window(
    stats: dict[str, list[float]],
    deltas: list[Params],
    params: Params,
    momentum: Params,
    history: list[float],
    round_index: int,
    late: bool,
    generator: torch.Generator,
) -> None:
    """Record every figure of one (round, fragment) window of honest deltas."""
    norms = [tensor_norm(d) for d in deltas]
    param_norm = tensor_norm(params)
    stats["norm/params"] += [n / param_norm for n in norms]
    if round_index == 0:
        stats["norm/params round 0"] += [n / param_norm for n in norms]
    if len(history) >= 3:
        reference = statistics.median(history)
        stats["norm/history"] += [n / reference for n in norms]
    flipped = [{k: -t for k, t in d.items()} for d in deltas]
    randoms = [random_like(d, n, generator) for d, n in zip(deltas, norms, strict=True)]
    cosines = screening.momentum_cosines(deltas, norms, momentum)
    if cosines is not None:
        stats["momentum honest"] += cosines
        if late:
            stats["momentum honest, late"] += cosines
        stats["momentum flipped"] += screening.momentum_cosines(flipped, norms, momentum)
        stats["momentum random"] += screening.momentum_cosines(randoms, norms, momentum)
    everyone = list(range(len(deltas)))
    honest = [c for c in screening.loo_cosines(deltas, norms, everyone) if c is not None]
    stats["loo honest"] += honest
    if late:
        stats["loo honest, late"] += honest
    for j in everyone:  # learner j's delta is replaced by its negation / a random one
        for name, bad in (("flipped", flipped[j]), ("random", randoms[j])):
            window = [bad if k == j else d for k, d in enumerate(deltas)]
            cosines = screening.loo_cosines(window, norms, everyone)
            if cosines[j] is not None:
                stats[f"loo {name}"].append(cosines[j])
            stats[f"loo honest, one {name}"] += [
                c for i, c in enumerate(cosines) if i != j and c is not None
            ]


def screen_outcomes(
    outcomes: dict[str, list[str]],
    rules: screening.ScreeningRules,
    deltas: list[Params],
    params: Params,
    momentum: Params,
    history: list[float],
    generator: torch.Generator,
) -> None:
    """Run `screening.screen` on the honest window and on attacked variants of it."""
    hist = screening.History(norms=tuple(history), tokens=())

    def run(window: list[Params]) -> screening.Screening:
        candidates = [screening.Candidate(f"p{i}", d, 1000, 10) for i, d in enumerate(window)]
        return screening.screen(
            candidates,
            hist,
            rules,
            momentum,
            params=params,
            max_tokens_per_step=MAX_TOKENS_PER_STEP,
        )

    def outcome(verdict: screening.Verdict) -> str:
        if not verdict.kept:
            return "refused"
        return "clipped" if verdict.scale < 1.0 else "kept"

    honest = run(deltas)
    outcomes["honest window"] += [outcome(v) for v in honest.verdicts]
    for i in range(len(deltas)):
        outcomes["honest alone (K=1)"].append(outcome(run([deltas[i]]).verdicts[0]))
    for factor in (10.0, 100.0, 1000.0):
        bad = {k: t * factor for k, t in deltas[0].items()}
        outcomes[f"x{factor:g} alone (K=1)"].append(outcome(run([bad]).verdicts[0]))
    flipped = {k: -t for k, t in deltas[0].items()}
    for i in range(len(deltas)):
        alone = {k: -t for k, t in deltas[i].items()}
        outcomes["flipped alone (K=1)"].append(outcome(run([alone]).verdicts[0]))
    result = run([flipped, *deltas[1:3]])
    outcomes["flipped + 2 honest"].append(outcome(result.verdicts[0]))
    outcomes["2 honest beside a flip"] += [outcome(v) for v in result.verdicts[1:]]
    noise = random_like(deltas[0], tensor_norm(deltas[0]), generator)
    outcomes["random + 2 honest"].append(outcome(run([noise, *deltas[1:3]]).verdicts[0]))


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"min {min(values):+.3f}  p5 {percentile(values, 5):+.3f}  "
        f"median {statistics.median(values):+.3f}  p95 {percentile(values, 95):+.3f}  "
        f"max {max(values):+.3f}  (n={len(values)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--fragments", default="1,4", help="F values, comma separated")
    parser.add_argument("--history-rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="1.0: constant lr after warm-up"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--codec", default="fp32", help="the learners' delta codec, with error feedback"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override (compress.*)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()
    config = load_config(
        None,
        [
            "model.preset='tiny'",
            "model.seq_len=64",
            "data.max_files=120",
            f"train.batch_size={args.batch_size}",
            f"train.lr={args.lr}",
            "train.device='cpu'",
            f"train.seed={args.seed}",
            f"train.warmup_steps={args.warmup_steps}",
            f"train.min_lr_ratio={args.min_lr_ratio}",
            f"sync.inner_steps={args.inner_steps}",
            f"compress.codec='{args.codec}'",
            *args.overrides,
        ],
    )
    config = replace(config, train={"total_steps": args.rounds * args.inner_steps})
    corpus = Corpus.from_config(config.data)
    base = build_model("tiny", seed=args.seed, max_seq_len=config.model.seq_len)
    global_params = global_state_of(base)
    trainers = [
        InnerTrainer(copy.deepcopy(base), config.train, torch.device("cpu"))
        for _ in range(args.learners)
    ]
    streams = learner_streams(config, corpus, args.learners)
    outer_state = OuterState()
    splits = {
        int(f): partition_fragments({n: t.numel() for n, t in global_params.items()}, int(f))
        for f in args.fragments.split(",")
    }
    rules = screening.ScreeningRules()
    generator = torch.Generator().manual_seed(args.seed)
    stats: dict[int, dict[str, list[float]]] = {f: defaultdict(list) for f in splits}
    outcomes: dict[int, dict[str, list[str]]] = {f: defaultdict(list) for f in splits}
    history: dict[tuple[int, int], list[list[float]]] = defaultdict(list)
    codec = compress.make_codec_from_config(config.compress)
    feedback = [compress.ErrorFeedback() for _ in trainers] if args.codec != "fp32" else None
    for round_index in range(args.rounds):
        deltas, tokens = [], []
        for rank, trainer in enumerate(trainers):
            load_params(trainer.model, global_params)
            tokens.append(sum(trainer.step(streams[rank]).tokens for _ in range(args.inner_steps)))
            delta = pseudo_gradient(global_params, dict(trainer.model.named_parameters()))
            if feedback is not None:  # what the synchronizer decodes of it
                sent = compress.encode_tensors(codec, delta, feedback[rank])
                delta = compress.decode_tensors(sent)
            deltas.append(delta)
        for f, fragments in splits.items():
            for index, names in enumerate(fragments):
                parts = [part(d, names) for d in deltas]
                recent = [n for norms in history[f, index][-args.history_rounds :] for n in norms]
                params, momentum = part(global_params, names), part(outer_state.momentum, names)
                late = round_index >= args.rounds // 2
                measure_window(
                    stats[f], parts, params, momentum, recent, round_index, late, generator
                )
                screen_outcomes(outcomes[f], rules, parts, params, momentum, recent, generator)
                history[f, index].append([tensor_norm(p) for p in parts])
        weights = token_weights(tokens, [args.inner_steps] * args.learners)
        outer_step(
            global_params,
            merge("token", deltas, weights),
            outer_state,
            lr=config.outer.lr,
            momentum=config.outer.momentum,
        )
        print(
            f"round {round_index + 1}/{args.rounds} done at {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "rules": vars(rules)}
    for f in splits:
        print(
            f"\n== F = {f} fragments: {args.learners} learners, H = {args.inner_steps}, "
            f"{args.rounds} rounds, codec {args.codec} =="
        )
        for name, values in stats[f].items():
            print(f"{name:28s} {summary(values)}")
        print("screen() with the default rules:")
        for name, results in outcomes[f].items():
            counts = {k: results.count(k) for k in ("kept", "clipped", "refused") if k in results}
            print(f"  {name:26s} {counts}")
        report[f"F={f}"] = {
            "stats": {
                k: {
                    "min": min(v),
                    "p5": percentile(v, 5),
                    "median": statistics.median(v),
                    "p95": percentile(v, 95),
                    "max": max(v),
                    "n": len(v),
                }
                for k, v in stats[f].items()
            },
            "screen": {
                k: {o: r.count(o) for o in ("kept", "clipped", "refused")}
                for k, r in outcomes[f].items()
            },
        }
    print(f"\n{time.monotonic() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
