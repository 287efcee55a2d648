"""The network and the volunteers a swarm simulation draws: links, NAT, churn, compute.

Every peer gets an uplink, a downlink, a round-trip time to the internet's core, a loss
rate, a NAT class and a compute speed, drawn per peer from the distributions below
(`Population.draw`). The defaults describe a public volunteer run; each figure says where
it comes from (docs/scale.md lists them with the sources):

- Bandwidth: fixed broadband in 2024-2025 has a median download near 100 Mbit/s and an
  upload near 20 Mbit/s, with a long tail both ways (Ookla Speedtest Global Index, fixed
  broadband medians; M-Lab NDT shows the same shape, lower). Log-normal around those.
- RTT: 20-300 ms between volunteers' homes (the issue's range): 10-150 ms to the core,
  log-normal, a pair's RTT the sum of its two halves (M-Lab NDT minimum RTTs, RIPE Atlas).
- Loss: 0-1 % (home links; TCP hides it as added delay: one extra RTT per lost window).
- NAT: about 70 % of volunteer hosts are behind a NAT that takes no unsolicited inbound
  connection; 10-15 % of those are symmetric NATs that hole punching cannot open, which
  then need a relay (Halkes & Pouwelse, "UDP NAT and firewall puncturing in the wild",
  IFIP Networking 2011; the libp2p DCUtR measurement campaign, 2023: ~70 % punch success).
- Churn: volunteer sessions are heavy-tailed; median session about an hour (Stutzbach &
  Rejaie, "Understanding churn in peer-to-peer networks", IMC 2006; BOINC host traces).
- Compute: consumer GPUs to CPUs, a 10x spread: log-normal speed around the preset's
  nominal step time.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""

PUBLIC, NATTED, RELAYED = "public", "nat", "relayed"
"""NAT classes: accepts connections; behind NAT (dials out, hole punching works);
behind a NAT nothing opens (reached only through a relay)."""


@dataclass(frozen=True)
class Link:
    """One peer's access link and machine."""

    up_bps: float
    """Uplink, bytes per second."""
    down_bps: float
    rtt_s: float
    """Round trip to the core (a pair's RTT: the sum of their halves)."""
    loss: float
    nat: str
    step_s: float
    """Seconds per inner step on this peer's hardware."""
    session_s: float
    """How long the peer stays before it leaves (inf: the whole run)."""


@dataclass(frozen=True)
class Population:
    """Distributions of the links and machines of a run's volunteers (see module doc)."""

    up_mbit_median: float = 20.0
    down_mbit_median: float = 100.0
    bandwidth_sigma: float = 0.8
    """Log-normal spread of bandwidth (0.8: a 10th-90th percentile ratio near 8)."""
    rtt_half_median_s: float = 0.04
    rtt_sigma: float = 0.6
    loss_max: float = 0.01
    natted_share: float = 0.7
    symmetric_share: float = 0.12
    """Of the NAT'd peers, those that need a relay."""
    step_s_median: float = 0.5
    step_sigma: float = 0.6
    session_median_s: float = 3600.0
    churn: bool = True
    public_link_mbit: float | None = None
    """Set: every public peer (the synchronizer, holder and donor candidates) gets a
    symmetric link of this many Mbit/s instead of a home link (to check that a
    synchronizer on a 100 Mbit/s link is not a round's bottleneck)."""

    def draw(self, rng: random.Random) -> Link:
        """One volunteer's link and machine."""
        up = self.up_mbit_median * MBIT * math.exp(rng.gauss(0.0, self.bandwidth_sigma))
        down = self.down_mbit_median * MBIT * math.exp(rng.gauss(0.0, self.bandwidth_sigma))
        half = min(self.rtt_half_median_s * math.exp(rng.gauss(0.0, self.rtt_sigma)), 0.25)
        nat = PUBLIC
        if rng.random() < self.natted_share:
            nat = RELAYED if rng.random() < self.symmetric_share else NATTED
        if nat == PUBLIC and self.public_link_mbit is not None:
            up = down = self.public_link_mbit * MBIT
        step = self.step_s_median * math.exp(rng.gauss(0.0, self.step_sigma))
        session = math.inf
        if self.churn:  # log-normal sessions (heavy tail), median session_median_s
            session = self.session_median_s * math.exp(rng.gauss(0.0, 1.2))
        return Link(
            up, down, 2 * max(half, 0.002), rng.uniform(0.0, self.loss_max), nat, step, session
        )


LOOPBACK = Population(
    up_mbit_median=1400.0,
    down_mbit_median=1400.0,
    bandwidth_sigma=0.0,
    rtt_half_median_s=0.0001,
    rtt_sigma=0.0,
    loss_max=0.0,
    natted_share=0.0,
    step_sigma=0.0,
    churn=False,
)
"""This machine's loopback (hivemind streams ~178 MB/s): what the agreement check with
real processes runs on."""


@dataclass(frozen=True)
class StepTrace:
    """When a real learner had done how many inner steps: (seconds since its start, steps)
    points, the `step` events of a real run. A simulated learner that replays one trains
    at the real learner's pace moment by moment, not at its mean: on a machine shared
    with other work a learner's speed comes in bursts, and a round closes when its quorum
    of learners gets there, so the pace of rounds follows the learners that were fast at
    that moment; with every learner at its mean, the simulator closed rounds 12-14 % slower
    than the real swarm on a CI worker."""

    points: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        pairs = itertools.pairwise(self.points)
        if len(self.points) < 2 or any(b[1] <= a[1] or b[0] < a[0] for a, b in pairs):
            raise ValueError("a step trace needs 2+ points, steps rising, time not falling")

    def seconds_at(self, steps: float) -> float:
        """When the learner had done `steps` (linear between points; before the first and
        after the last, at the pace of the nearest segment), never before 0."""
        points = self.points
        i = 1
        while i < len(points) - 1 and points[i][1] < steps:
            i += 1
        (t0, s0), (t1, s1) = points[i - 1], points[i]
        return max(0.0, t0 + (steps - s0) * (t1 - t0) / (s1 - s0))
