"""The decoupled simulator: the swarm's schedule on a simulated clock, with real training."""

from __future__ import annotations

from p2pdiloco.config import replace
from p2pdiloco.sim.simulate import simulate


def decoupled(config, **simulate_fields):
    return replace(config, simulate={"mode": "decoupled", "baseline": False, **simulate_fields})


def test_equal_speeds_and_a_quorum_of_all_is_exactly_lockstep_diloco(tiny_config, tiny_corpus) -> None:
    """With every learner as fast and K = M, every window closes once all M deltas are in
    and every learner starts its next H steps from the result: plain DiLoCo, bit for bit
    (fp32 deltas and outer gradient: the decoupled simulator runs the learners' own codec
    and the swarm's merge, screening included, which passes honest deltas untouched)."""
    config = replace(
        tiny_config, sync={"min_quorum": 2}, simulate={"rounds": 2},
        compress={"codec": "fp32", "outer_codec": "fp32"},
    )  # fmt: skip
    lockstep = simulate(replace(config, simulate={"baseline": False}), corpus=tiny_corpus)
    schedule = simulate(decoupled(config), corpus=tiny_corpus)
    assert schedule.tokens == lockstep.tokens
    assert schedule.diloco.eval_loss[-1] == lockstep.diloco.eval_loss[-1]
    assert schedule.schedule["rounds"] == [config.simulate.rounds]
    assert schedule.schedule["merged"] == config.simulate.rounds * config.simulate.learners
    assert schedule.schedule["stale_merged"] == schedule.schedule["dropped"] == 0


def test_a_schedule_is_reproduced_from_its_seeds_and_slow_learners_change_it(tiny_config, tiny_corpus) -> None:
    config = decoupled(
        replace(tiny_config, sync={"min_quorum": 1, "max_grace_s": 0.5}),
        speeds="1,0.5", jitter=0.2, link_s=0.5, seed=3,
    )
    one, two = (simulate(config, corpus=tiny_corpus) for _ in range(2))
    assert one.diloco.eval_loss == two.diloco.eval_loss and one.schedule == two.schedule
    # K = 1 with a learner at half speed: the fast one closes rounds alone, so the run
    # takes more rounds than lockstep's, and the model still learns
    assert one.schedule["rounds"][0] > config.simulate.rounds
    # nobody waits: the two share the baseline's steps, the fast one taking more of them
    fast, slow = one.schedule["steps"]
    assert fast + slow == 2 * config.simulate.rounds * config.sync.inner_steps and fast > slow
    assert one.tokens == (fast + slow) * 4 * 64
    times = one.schedule["eval_times_s"]
    assert len(times) == len(one.diloco.eval_loss) and times == sorted(times)
    assert all(-1.0 <= rho <= 1.0 for rho in [one.schedule["rho_mean"]])
    assert one.diloco_eval_loss < one.diloco.eval_loss[0] - 0.5
    lockstep = simulate(replace(config, simulate={"mode": "lockstep"}), corpus=tiny_corpus)
    assert one.diloco_eval_loss != lockstep.diloco_eval_loss
