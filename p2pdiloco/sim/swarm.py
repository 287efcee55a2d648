"""A swarm of many peers in one process, on virtual time, running the real protocol code.

Each simulated peer is wired as `peer.joined.JoinedPeer` wires a real one, minus the
trainer: `Membership` (heartbeats), `ReplicaSync` (canonical chain, record rules via the
transport, fetch, audits), `Synchronizer` (window machine, election, screening, merge,
commit) and `LearnerLink` (election, failover), on a `SimTransport`: the in-memory
transport, with a link model (`links.Link`: bandwidth queues, RTT, loss, NAT class) and
a DHT that keeps each key on its `DHT_REPLICAS` closest peers. What a trainer would do
is a compute model: a learner takes `inner_steps` steps at its own speed, then ships one
delta per fragment (a real CONTRIBUTION frame of a small model) and goes on computing,
as the real learner does; a delta no round merged is folded into the next one.

Time is virtual (`virtual_time.run_virtual`): the roles' deadlines, heartbeats and holds
run on the simulated clock; CPU work costs no simulated time. Bytes are counted by the
same `transport.traffic.Traffic` a real peer counts with, so a figure here and one from
real processes are the same quantity. Simulating a larger preset (`PresetBytes`), each
delta, update or audited frame is charged on the links the preset's tensor bytes in place
of the small model's (its header, the contributor lists, as they are), and a state part
the preset's parameter count in place of the small one's.

Left out on purpose: the DHT's own routing traffic (a lookup is charged its round trips
and ~200 bytes per hop, not hivemind's exact messages), TCP slow start, and relays' own
load beyond their bandwidth (`docs/scale.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pdiloco import __version__, compress, identity, wire
from p2pdiloco.config import RunConfig, config_hash, replace
from p2pdiloco.identity import Identity
from p2pdiloco.protocol import membership, rounds
from p2pdiloco.protocol.membership import Heartbeat
from p2pdiloco.roles.learner_link import LearnerLink
from p2pdiloco.roles.presence import Membership
from p2pdiloco.roles.replica import ReplicaSync
from p2pdiloco.roles.state import GlobalState
from p2pdiloco.roles.synchronizer import Synchronizer
from p2pdiloco.sim.fair_share import FairShareLinks
from p2pdiloco.sim.links import PUBLIC, RELAYED, Link, Population, StepTrace
from p2pdiloco.sim.virtual_time import InlineExecutor, VirtualClock, run_virtual
from p2pdiloco.transport.base import PayloadDeadlines, PeerUnreachable, TransportError
from p2pdiloco.transport.memory import MemoryNetwork, MemoryTransport
from p2pdiloco.transport.traffic import CATEGORIES, PROTOCOL, rpc_category
from p2pdiloco.trust import record_rules
from p2pdiloco.trust.record_rules import RunRecordRules
from p2pdiloco.wire import messages

log = logging.getLogger(__name__)

RUN = "sim"
DHT_REPLICAS = 5
"""Peers that keep each DHT key (hivemind's default `num_replicas`... of the closest)."""
LOOKUP_BYTES = 200
"""Bytes one DHT lookup hop costs each way (a find-node request and its answer)."""
PAYLOAD = ("deltas", "updates", "state", "audits")
PARAMS = 1024
BULK_BYTES = 64 * 1024
"""Transfers above this size share their links fairly with the other bulk flows (`FairShareLinks`)."""
"""Parameters of the small model whose frames the simulated peers really encode."""
SPARSE_MIN_KEPT = 4
"""Entries a simulated sparse2 fragment keeps at least (`Swarm._codec_of`): a quarter of a
16-element fragment, the density screening still holds to the sparse line."""
DRAIN_DEADLINES = 1.5
"""Round deadlines the learners' last deltas get to merge after they stop computing."""


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of `parts`' text that every process computes alike (Python's own
    `hash` of a string changes with each interpreter: a seeded run would not repeat)."""
    text = "\x00".join(map(repr, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def _distance(key: str, peer: str) -> int:
    a = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    b = int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "big")
    return a ^ b


class SimNetwork(MemoryNetwork):
    """The in-memory network with links: transfers queue on each peer's uplink and the
    other's downlink, take half a round trip to arrive, and lose time to loss; DHT keys
    live on their closest peers, whose links carry every store and read."""

    def __init__(
        self, clock: VirtualClock, preset: PresetBytes | None = None, seed: int = 0
    ) -> None:
        super().__init__(clock.wall)
        self.vclock = clock
        self.links: dict[str, Link] = {}
        self.preset = preset
        self.payload_moved: dict[tuple[str, str, str], float] = defaultdict(float)
        """(peer, category, "up"/"down") -> payload bytes charged on its links."""
        self.up_free: dict[str, float] = defaultdict(float)
        self.down_free: dict[str, float] = defaultdict(float)
        self.bulk = FairShareLinks(lambda: clock.elapsed_s, self._rates)
        self.key_bytes: dict[str, float] = defaultdict(float)
        """Bytes each DHT key moved on its replicas' links (stores in, reads out)."""
        self.peer_bytes: dict[str, float] = defaultdict(float)
        """Bytes every peer's links carried, serving the DHT and others included."""
        self.served_dht: dict[str, float] = defaultdict(float)
        self.on_line: list[str] = []
        self._replicas: dict[str, list[str]] = {}
        self.id_rng = random.Random(seed)

    def new_peer_id(self) -> str:
        """A peer id from the swarm's seeded generator, so a run with one seed elects the
        same synchronizers (rendezvous scores hash the ids) and measures the same figures."""
        key = Ed25519PrivateKey.from_private_bytes(self.id_rng.randbytes(32))
        made = Identity.from_key(key)
        self._identities[made.peer_id] = made
        return made.peer_id

    def charged(self, category: str, message: bytes, response: bool) -> float:
        """What a message of the small model weighs as one of the simulated preset's: a
        payload message that carries tensors (a delta, an update, a state part) grows by
        the preset's; a request or a reply without tensors (a get_update, a contribute
        reply, a MISSING) weighs what it weighs. An audit's reply (sealed contributions
        in a list, no frame of its own) is charged one frame's growth."""
        size = len(message)
        if self.preset is None or category not in PAYLOAD:
            return float(size)
        if category == "audits":
            return size + (self.preset.frame_extra_bytes if response else 0.0)
        carried = wire.tensor_bytes(message)
        if not carried:
            return float(size)
        if category == "state":
            return size + carried * (self.preset.element_scale - 1)
        if category == "updates":
            return size + self.preset.update_extra_bytes
        return size + self.preset.frame_extra_bytes

    def rtt(self, a: str, b: str) -> float:
        la, lb = self.links.get(a), self.links.get(b)
        rtt = ((la.rtt_s if la else 0.0) + (lb.rtt_s if lb else 0.0)) / 2
        if la is not None and lb is not None and RELAYED in (la.nat, lb.nat):
            rtt *= 2  # through a relay: one more leg each way
        return rtt

    async def transfer(self, src: str, dst: str, size: float) -> None:
        """Move `size` bytes from `src` to `dst`, arriving half a round trip after the
        links moved them; a lost segment costs a resend (`size` grows by twice the loss).

        Transfers over `BULK_BYTES` (deltas, updates, state parts of a real preset) share
        both links fairly with the other bulk flows (`FairShareLinks`; a cancelled call
        stops taking bandwidth). Smaller ones (heartbeats, records, replies) queue FIFO on
        src's uplink and dst's downlink, each link a server of its own rate, beside the
        bulk flows, as a small TCP flow gets its share of a link a bulk flow is filling."""
        if src == dst or size <= 0:
            return
        ls, ld = self.links.get(src), self.links.get(dst)
        size *= 1 + 2 * max(ls.loss if ls else 0.0, ld.loss if ld else 0.0)
        self.peer_bytes[src] += size
        self.peer_bytes[dst] += size
        now = self.vclock.elapsed_s
        if size > BULK_BYTES:
            await self.bulk.transfer(src, dst, size)
            finish = self.vclock.elapsed_s
        else:
            finish = now
            for free, peer, rate in ((self.up_free, src, ls.up_bps if ls else math.inf),
                                     (self.down_free, dst, ld.down_bps if ld else math.inf)):
                done = max(now, free[peer]) + (size / rate if rate < math.inf else 0.0)
                free[peer] = done
                finish = max(finish, done)
        delay = finish - self.vclock.elapsed_s + self.rtt(src, dst) / 2
        if delay > 0:
            await asyncio.sleep(delay)

    def _rates(self, peer: str) -> tuple[float, float]:
        link = self.links.get(peer)
        return (link.up_bps, link.down_bps) if link is not None else (math.inf, math.inf)

    def replicas_of(self, key: str) -> list[str]:
        cached = self._replicas.get(key)
        if cached is None or any(p not in self._peers for p in cached):
            cached = sorted(self.on_line, key=lambda p: _distance(key, p))[:DHT_REPLICAS]
            self._replicas[key] = cached
        return cached

    def lookup_hops(self) -> int:
        return max(1, math.ceil(math.log2(max(len(self.on_line), 2)) / 4))


class SimTransport(MemoryTransport):
    """A peer on a `SimNetwork`: the in-memory transport, its calls and records charged
    to the links (and counted in `traffic`, as a real transport counts them)."""

    network: SimNetwork

    async def _call(self, peer_id: str, name: str, request: bytes, max_response: int) -> bytes:
        net = self.network
        category = rpc_category(name)
        remote = net._route(peer_id)
        if remote is None or remote.client_mode:  # gone, or takes no inbound connection
            await asyncio.sleep(net.rtt(self.peer_id, peer_id) * 2)  # a dial that gets nothing
            raise PeerUnreachable(f"peer {peer_id} is unreachable")
        sent = net.charged(category, request, response=False)
        net.payload_moved[(self.peer_id, category, "up")] += sent
        net.payload_moved[(peer_id, category, "down")] += sent
        await net.transfer(self.peer_id, peer_id, sent)
        response = await super()._call(peer_id, name, request, max_response)
        got = net.charged(category, response, response=True)
        net.payload_moved[(peer_id, category, "up")] += got
        net.payload_moved[(self.peer_id, category, "down")] += got
        await net.transfer(peer_id, self.peer_id, got)
        if net._route(peer_id) is not remote:
            raise PeerUnreachable(f"peer {peer_id} went away during the call")
        return response

    async def _lookup(self, key: str) -> list[str]:
        net = self.network
        for _ in range(net.lookup_hops()):
            await asyncio.sleep(net.rtt(self.peer_id, net.on_line[0]) if net.on_line else 0.0)
        return net.replicas_of(key)

    async def store(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bool:
        self._check_open()
        replicas = await self._lookup(key)
        size = len(value) + len(subkey)
        net = self.network
        await asyncio.gather(*(net.transfer(self.peer_id, r, size) for r in replicas))
        for r in replicas:
            net.served_dht[r] += size
        net.key_bytes[key] += size * len(replicas)
        return await super().store(key, subkey, value, expiration_time)

    async def get(self, key: str, latest: bool = True) -> dict[str, tuple[bytes, float]]:
        self._check_open()
        replicas = await self._lookup(key)
        records = await super().get(key, latest)
        size = sum(len(v) + len(s) for s, (v, _) in records.items())
        net = self.network
        if replicas:
            source = replicas[stable_hash(self.peer_id, net.vclock.elapsed_s) % len(replicas)]
            await net.transfer(source, self.peer_id, size + LOOKUP_BYTES)
            net.served_dht[source] += size
        net.key_bytes[key] += size
        return records


@dataclass
class SimPeer:
    """One simulated peer: the real roles on a `SimTransport`, plus a compute model."""

    transport: SimTransport
    link: Link
    config: RunConfig
    state: GlobalState
    members: Membership
    replicas: ReplicaSync
    synchronizer: Synchronizer
    learner_link: LearnerLink
    joined_at: float = 0.0
    trace: StepTrace | None = None
    """The real learner's pace this one replays (`Swarm.step_traces`); None: `link.step_s`."""
    tokens_computed: int = 0
    tokens_merged: int = 0
    steps_done: int = 0
    in_flight_tokens: int = 0
    pending_tokens: dict[int, int] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def decided_tokens(self) -> int:
        """Tokens computed whose delta was answered: neither in flight nor folded back."""
        return self.tokens_computed - sum(self.pending_tokens.values()) - self.in_flight_tokens


@dataclass(frozen=True)
class PresetBytes:
    """How the small simulated model's payloads are charged as a larger preset's."""

    frame_extra_bytes: float
    """Added to each delta or audited frame: the preset's tensor bytes of one fragment
    minus the small model's, in the run's delta codec (`compress.codec` and its settings)."""
    element_scale: float
    """Parameters of the preset per parameter of the small model (state parts, and the
    roles' deadlines sized by a parameter count)."""
    frame_scale: float
    """A preset's delta frame of one fragment over the small model's (the roles'
    deadlines sized by a frame's bytes)."""
    update_extra_bytes: float = 0.0
    """`frame_extra_bytes` of an update frame, in the outer codec (`compress.outer_codec`)."""
    update_scale: float = 1.0
    """`frame_scale` of an update frame (the committer's push deadlines)."""

    def deadlines(self) -> PayloadDeadlines:
        """The roles' payload deadlines at the preset's sizes."""
        return PayloadDeadlines(self.update_scale, self.frame_scale, self.element_scale)

    @classmethod
    def of(cls, preset_params: int, config: RunConfig) -> PresetBytes:
        meta = {
            "peer": "x" * 52, "base_round": 0, "tokens": 0, "steps": 0, "step_time_s": 0.5,
            "first_step": 0, "last_step": 0,
        }  # fmt: skip
        fragments = config.sync.num_fragments

        def frame_bytes(codec: compress.Codec, params: int) -> int:
            # a delta-like tensor, not zeros: a sparse codec sends nothing of zeros (int8
            # sends the same bytes either way); sparse2 as the outer codec keeps its outer
            # k a chunk, all of a window of K x k / outer k learners' union or more
            values = torch.randn(params, generator=torch.Generator().manual_seed(params))
            tensors = compress.encode_tensors(codec, {"p0": values})
            message = wire.Message(kind=wire.CONTRIBUTION, run=RUN, round=0, fragment=0, meta=meta, tensors=tensors)
            return len(wire.encode_message(message))

        def extra_and_scale(codec: compress.Codec) -> tuple[float, float]:
            sample = 1 << 16  # per parameter beyond the header (15% of sparse2's 2^16 elements)
            per_param = (frame_bytes(codec, 2 * sample) - frame_bytes(codec, sample)) / sample
            extra = per_param * (preset_params - PARAMS) / fragments
            simulated = frame_bytes(codec, PARAMS // fragments)
            return extra, (simulated + extra) / simulated

        delta_extra, delta_scale = extra_and_scale(compress.make_codec_from_config(config.compress))
        update_extra, update_scale = extra_and_scale(compress.make_codec_from_config(config.compress, outer=True))
        return cls(delta_extra, preset_params / PARAMS, delta_scale, update_extra, update_scale)


def small_state(config: RunConfig) -> GlobalState:
    fragments = config.sync.num_fragments
    params = {f"p{f}": torch.zeros(PARAMS // fragments) for f in range(fragments)}
    return GlobalState(params, [[f"p{f}"] for f in range(fragments)], config.outer)


def applied_pace(applied: dict[tuple[int, int], list[float]], start: float, end: float) -> float:
    """Rounds per minute up to the last round applied: `applied` holds, per (fragment,
    round), the instants the peers applied it; per fragment, the rounds whose median
    instant falls in [start, end] over the time from `start` to the last of them,
    averaged over the fragments (NaN if none). Cut at the last apply, the pace does not
    count the time after it: a real peer that exits at `--max-rounds` some seconds after
    its last round, and a simulated span cut in the middle of one, count alike."""
    last: dict[int, tuple[int, float]] = {}
    counted: dict[int, int] = defaultdict(int)
    for (fragment, round_id), instants in applied.items():
        when = statistics.median(instants) if instants else math.nan
        if start <= when <= end:
            counted[fragment] += 1
            if round_id >= last.get(fragment, (-1, 0.0))[0]:
                last[fragment] = (round_id, when)
    paces = [60.0 * counted[f] / (when - start) for f, (_r, when) in last.items() if when > start]
    return sum(paces) / len(paces) if paces else math.nan


@dataclass
class SwarmFigures:
    """What one simulated run measured (per peer figures over the measured span)."""

    n: int
    seconds: float
    protocol_bytes_per_s_per_peer: dict[str, float]
    """p50, p90 and max over the peers; `max_whole_span`: over those that were there
    before the span began (a newcomer's span holds its one-time sweep of every shard
    and its first records, a join's cost, not a rate it keeps)."""
    by_role: dict[str, dict[str, float]]
    by_category: dict[str, dict[str, float]]
    busiest_key_bytes_per_s: float
    busiest_key: str
    busiest_peer_bytes_per_s: float
    round_latency_s: float
    rounds: int
    goodput: float
    stalls: int
    rounds_per_min: float = math.nan
    """Rounds applied per minute up to the last one applied in the span (`applied_pace`)."""
    goodput_decided: float = math.nan
    """Tokens merged / tokens whose fate is decided when the learners stop, before the
    drain: a delta in flight or folded back is neither (what the agreement compares with
    a real peer's summary at exit, `steps_contributed` over its steps less the local and
    undecided ones)."""
    forks: int = 0
    """(round, fragment) pairs two peers applied with different hashes (must stay 0),
    over the whole run: the joins and the warm-up included."""
    forks_measured: int = 0
    """Of `forks`, those of the windows opened in the measured span."""
    synchronizer_bytes_per_window: dict[str, float] = dataclasses.field(default_factory=dict)
    """Payload bytes a synchronizer moved (deltas received, updates sent: pushes and
    fetches it served) per window it closed in the span, at the simulated preset's size
    (`PresetBytes`): p50 and max over the peers that closed one."""
    windows: int = 0
    """Windows opened in the span that the chain committed."""
    busiest_link_use: dict[str, float] = dataclasses.field(default_factory=dict)
    """The most asked-of link over the span: payload bytes per second the peer's calls put
    on it (every transfer started, those whose caller gave up included) over its rate, for
    the reachable peers' links (`public`: synchronizers, holders, servers) and the
    client-mode learners' (`client`). 1.0 is a link full the whole span; above it, the
    link cannot carry what the protocol asks of it (calls time out and are retried)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Swarm:
    """N simulated peers sharing one `SimNetwork` (build, run, measure)."""

    def __init__(
        self,
        n: int,
        config: RunConfig,
        population: Population,
        seed: int = 0,
        preset: PresetBytes | None = None,
        tokens_per_step: int = 1024,
        step_times_s: list[float] | None = None,
        step_traces: list[StepTrace] | None = None,
        update_pushes: int | None = None,
    ) -> None:
        self.n = n
        self.deadlines = preset.deadlines() if preset is not None else PayloadDeadlines()
        """What each simulated peer's roles size their payload deadlines by: the preset's
        sizes, as a real peer of that preset computes them (set on each role)."""
        self.update_pushes = update_pushes
        """Learners a synchronizer pushes a committed update to beyond its holders (None:
        the roles' own `commit.MORE_PUSHES`; a large number is the former push to all)."""
        self.step_times_s = step_times_s
        """Per peer (cycled), seconds per inner step instead of the population's draw
        (the agreement check gives the real learners' measured step times)."""
        self.step_traces = step_traces
        """Per peer (cycled), a real learner's steps over time to replay (`StepTrace`)."""
        self.config = config
        self.delta_codec = compress.make_codec_from_config(config.compress)
        """The learners' codec with the run's settings (sparse2's chunk and k, zstd, ...)."""
        self.population = population
        self.rng = random.Random(seed)
        self.clock = VirtualClock()
        self.network = SimNetwork(self.clock, preset, seed)
        self.tokens_per_step = tokens_per_step
        self.rules = RunRecordRules(RUN, config.sync.num_fragments)
        self.config_hash = config_hash(config)
        self.peers: list[SimPeer] = []
        self.window_opened: dict[tuple[int, int], float] = {}
        self.applied: dict[tuple[int, int], list[float]] = defaultdict(list)
        self.worker = InlineExecutor()
        self.stalls = 0

    def _event(self, event: dict) -> None:
        if event.get("event") == "window_open":
            self.window_opened.setdefault(
                (event.get("fragment", 0), event.get("round", 0)), self.clock.elapsed_s
            )

    def add_peer(self) -> SimPeer:
        link = self.population.draw(self.rng)
        if self.step_times_s:
            link = dataclasses.replace(
                link, step_s=self.step_times_s[len(self.peers) % len(self.step_times_s)]
            )
        net = self.network
        client = link.nat != PUBLIC
        transport = SimTransport(net, client_mode=client, record_rules=self.rules)
        net.links[transport.peer_id] = link
        state = small_state(self.config)
        limits = wire.WireLimits()
        holder: dict[str, SimPeer] = {}

        def own_beat() -> Heartbeat:
            peer = holder["peer"]
            return Heartbeat(
                peer_id=transport.peer_id,
                status="training",
                client_mode=client,
                rounds=tuple(peer.state.rounds),
                config_hash=self.config_hash,
                tokens_contributed=peer.tokens_merged,
                software=f"p2pdiloco/{__version__}",
                # what a hivemind peer on one interface advertises: beats weigh as real ones
                maddrs=() if client else (f"/ip4/127.0.0.1/tcp/40000/p2p/{transport.peer_id}",),
                device="cpu",
                tokens_per_s=1234.5,
                loss=3.21,
                eval_loss=3.3,
                inner_step=12345,
                bytes_sent=12_345_678,
                bytes_received=12_345_678,
                last_weight=0.25,
            )

        members = Membership(
            transport,
            RUN,
            self.config.peer.heartbeat_s,
            self.config_hash,
            own_beat,
            self._event,
            shards=self.config.network.member_shards,
        )
        replicas = ReplicaSync(
            transport, RUN, state, members.view, limits, self.worker,
            void_after_s=self.config.sync.round_deadline_s, on_event=self._event,
            epoch_rounds=self.config.network.record_epoch_rounds,
        )  # fmt: skip
        members.clock_voters = replicas.entitlement.votes_on_clock
        replicas.entitlement.settled = members.settled
        synchronizer = Synchronizer(
            transport,
            RUN,
            self.config,
            state,
            members.view,
            limits,
            replicas,
            self.worker,
            on_event=self._event,
            screening_rules=self.config.screening,
        )
        link_ = LearnerLink(transport, RUN, self.config.sync, replicas, members.view, limits)
        for role in (synchronizer.committer, link_, replicas, replicas.downloads):
            role.deadlines = self.deadlines
        if self.update_pushes is not None:
            synchronizer.committer.more_pushes = self.update_pushes
        peer = SimPeer(transport, link, self.config, state, members, replicas, synchronizer, link_)
        if self.step_traces:
            peer.trace = self.step_traces[len(self.peers) % len(self.step_traces)]
        holder["peer"] = peer
        replicas.on_settled.append(
            lambda f, r, record: self.applied[(f, r)].append(self.clock.elapsed_s)
        )
        self.peers.append(peer)
        return peer

    async def start_peer(self, peer: SimPeer) -> None:
        await peer.transport.start()
        self.network.on_line.append(peer.peer_id)
        for server in _encoders(peer):
            server.encoder = self.worker
        await peer.replicas.start()
        await peer.synchronizer.start()
        peer.joined_at = self.clock.elapsed_s
        await peer.members.beat_bounded()
        peer.tasks.append(
            asyncio.create_task(peer.members.beat_forever(lambda: self._sync_soon(peer)))
        )
        peer.tasks.append(asyncio.create_task(self._learn(peer), name="learn"))

    def _sync_soon(self, peer: SimPeer) -> None:
        if not any(t.get_name() == "sync" and not t.done() for t in peer.tasks):
            peer.tasks = [t for t in peer.tasks if not t.done()]
            peer.tasks.append(asyncio.create_task(self._sync(peer), name="sync"))

    async def _sync(self, peer: SimPeer) -> None:
        for fragment in range(peer.state.num_fragments):
            try:
                await asyncio.wait_for(peer.replicas.sync_fragment(fragment), 60.0)
            except (TimeoutError, TransportError):
                pass

    def _frame(self, peer: SimPeer, fragment: int, round_id: int, tokens: int) -> bytes:
        """A CONTRIBUTION frame as `roles.shipping` sends it (its meta: the step time the
        synchronizer's grace window (Eq. 3) is computed from, the step span)."""
        size = PARAMS // peer.state.num_fragments

        def noise(*key: object) -> torch.Tensor:
            return torch.randn(size, generator=torch.Generator().manual_seed(stable_hash(*key) % 2**31))

        # learners of one model move alike (a shared descent direction, drifting by round)
        # plus their own noise, so the real screening (cosines) sees what it sees in a run
        direction = noise("direction", fragment) + 0.5 * noise("round", fragment, round_id)
        delta = {f"p{fragment}": 0.01 * (direction + 0.5 * noise(peer.peer_id, fragment, round_id))}
        steps = self.config.sync.inner_steps
        message = wire.Message(
            kind=wire.CONTRIBUTION, run=RUN, round=round_id, fragment=fragment,
            meta={
                "peer": peer.peer_id, "base_round": round_id, "tokens": tokens, "steps": steps,
                "step_time_s": peer.link.step_s, "first_step": max(0, peer.steps_done - steps), "last_step": peer.steps_done,
            },
            tensors=compress.encode_tensors(self._codec_of(size), delta),
        )  # fmt: skip
        return wire.encode_message(message)

    def _codec_of(self, size: int) -> compress.Codec:
        """The codec of a simulated fragment of `size` elements: the run's, except that
        sparse2 keeps at least `SPARSE_MIN_KEPT` entries of a fragment. A real fragment
        keeps thousands, and learners share enough of them that screening keeps honest
        deltas (cosines 0.03-0.12); the small model's (16 elements at 64 fragments) kept
        one, orthogonal to the others' or opposite to the momentum: screening refused a
        third of the deltas. Bytes are charged at the preset's size all the same."""
        cfg = self.config.compress
        kept = -(-cfg.sparse_k * min(size, cfg.sparse_chunk) // cfg.sparse_chunk)
        if cfg.codec != "sparse2" or kept >= SPARSE_MIN_KEPT or size <= SPARSE_MIN_KEPT:
            return self.delta_codec
        chunk = min(size, cfg.sparse_chunk)
        return compress.make_codec("sparse2", sparse_chunk=chunk, sparse_k=SPARSE_MIN_KEPT, zstd=cfg.zstd)

    async def _learn(self, peer: SimPeer) -> None:
        """Compute `inner_steps` at the peer's speed, then ship each fragment's delta
        (staggered over the period, as the real schedule is), never waiting for replies."""
        fragments = peer.state.num_fragments
        period = self.config.sync.inner_steps * peer.link.step_s
        tokens = self.config.sync.inner_steps * self.tokens_per_step // fragments
        steps = self.config.sync.inner_steps // fragments
        while True:
            for fragment in range(fragments):
                if peer.trace is None:
                    await asyncio.sleep(period / fragments)
                else:
                    due = peer.joined_at + peer.trace.seconds_at(peer.steps_done + steps)
                    await asyncio.sleep(max(0.0, due - self.clock.elapsed_s))
                peer.tokens_computed += tokens
                peer.steps_done += steps
                carried = peer.pending_tokens.pop(fragment, 0) + tokens
                round_id = peer.state.round_of(fragment)
                frame = self._frame(peer, fragment, round_id, carried)
                peer.tasks.append(
                    asyncio.create_task(self._ship(peer, fragment, round_id, frame, carried))
                )

    async def _ship(
        self, peer: SimPeer, fragment: int, round_id: int, frame: bytes, tokens: int
    ) -> None:
        peer.in_flight_tokens += tokens
        try:
            outcome = await peer.learner_link.contribute(fragment, round_id, frame)
        except TransportError:
            outcome = None
        finally:
            peer.in_flight_tokens -= tokens
        if outcome is not None and outcome.status == messages.Reply.MERGED:
            peer.tokens_merged += tokens
        else:  # folded into the next delta of the fragment, as the learner does
            peer.pending_tokens[fragment] = peer.pending_tokens.get(fragment, 0) + tokens

    async def leave(self, peer: SimPeer) -> None:
        for task in peer.tasks:
            task.cancel()
        self.network.kill(peer.peer_id)
        if peer.peer_id in self.network.on_line:
            self.network.on_line.remove(peer.peer_id)

    async def run(self, seconds: float, warmup_s: float) -> SwarmFigures:
        """Start every peer (staggered over the first seconds), run `seconds` of virtual
        time, and measure the last `seconds - warmup_s` of it."""
        for _ in range(self.n):
            self.add_peer()
        starting = []
        for peer in self.peers:  # joins spread over at most 10 s, each going on by itself
            starting.append(asyncio.ensure_future(self.start_peer(peer)))
            await asyncio.sleep(min(0.05, 10.0 / self.n))
        await asyncio.gather(*starting)
        await asyncio.sleep(max(warmup_s - self.clock.elapsed_s, 0.0))
        start = self.clock.elapsed_s
        base = {p.peer_id: dict(p.transport.traffic.bytes) for p in self.peers}
        key_base = dict(self.network.key_bytes)
        payload_base = dict(self.network.payload_moved)
        peer_base = dict(self.network.peer_bytes)
        # tokens carried into the span (folded, not merged yet) are work it may merge too
        tokens_base = {p.peer_id: (p.decided_tokens, p.tokens_merged) for p in self.peers}
        leavers = sorted(
            (p for p in self.peers if p.link.session_s < seconds), key=lambda p: p.link.session_s
        )
        for peer in leavers:
            wait = peer.link.session_s - (self.clock.elapsed_s - peer.joined_at)
            if wait > 0:
                await asyncio.sleep(min(wait, seconds - (self.clock.elapsed_s - start)))
            if self.clock.elapsed_s - start >= seconds - warmup_s:
                break
            await self.leave(peer)
            await self.start_peer(self.add_peer())  # a newcomer takes its place
        await asyncio.sleep(max(start + seconds - warmup_s - self.clock.elapsed_s, 0.0))
        span = self.clock.elapsed_s - start
        moved = {p.peer_id: dict(p.transport.traffic.bytes) for p in self.peers}
        key_end, peer_end = dict(self.network.key_bytes), dict(self.network.peer_bytes)
        self._payload_span = (payload_base, dict(self.network.payload_moved))
        at_stop = {p.peer_id: (p.decided_tokens, p.tokens_merged) for p in self.peers}
        # goodput: the learners stop computing; what they shipped gets a drain to merge
        for peer in self.peers:
            for task in peer.tasks:
                if task.get_name() == "learn":
                    task.cancel()
        await asyncio.sleep(DRAIN_DEADLINES * self.config.sync.round_deadline_s)
        figures = self._figures(
            span, base, moved, key_base, key_end, peer_base, peer_end, tokens_base, start
        )
        computed = sum(at_stop[p][0] - tokens_base.get(p, (0, 0))[0] for p in at_stop)
        merged = sum(at_stop[p][1] - tokens_base.get(p, (0, 0))[1] for p in at_stop)
        figures.goodput_decided = merged / computed if computed > 0 else math.nan
        figures.rounds_per_min = applied_pace(self.applied, start, start + span)
        return figures

    def _figures(
        self, span, base, end, key_base, key_end, peer_base, peer_end, tokens_base, start
    ) -> SwarmFigures:  # noqa: ANN001, PLR0913
        per_peer: list[float] = []
        roles: dict[str, list[float]] = defaultdict(list)
        categories: dict[str, dict[str, float]] = {c: {"up": 0.0, "down": 0.0} for c in CATEGORIES}
        for peer in self.peers:
            before = base.get(peer.peer_id, {})
            moved = {k: v - before.get(k, 0) for k, v in end.get(peer.peer_id, {}).items()}
            protocol = sum(v for (c, _), v in moved.items() if c in PROTOCOL) / span
            per_peer.append(protocol)
            role = (
                "synchronizer"
                if any(
                    r.synchronizer == peer.peer_id
                    for chain in peer.replicas.chains
                    for r in chain.values()
                )
                else ("client" if peer.transport.client_mode else "learner")
            )
            roles[role].append(sum(moved.values()) / span)
            for (c, d), v in moved.items():
                categories[c][d] += v / span / len(self.peers)
        keys = {k: (v - key_base.get(k, 0)) / span for k, v in key_end.items()}
        busiest_key = max(keys, key=keys.get) if keys else ""
        busiest_peer = max(
            ((v - peer_base.get(p, 0)) / span for p, v in peer_end.items()), default=0.0
        )
        latencies = []
        for key, opened in self.window_opened.items():
            applied = self.applied.get(key, [])
            if opened >= start and applied:
                latencies.append(_quantile(applied, 0.9) - opened)
        computed = sum(
            p.tokens_computed - tokens_base.get(p.peer_id, (0, 0))[0] for p in self.peers
        )
        merged = sum(p.tokens_merged - tokens_base.get(p.peer_id, (0, 0))[1] for p in self.peers)
        heads = [max(chain) + 1 if chain else 0 for chain in self.peers[0].replicas.chains]
        closed = self._windows_closed(start)
        payload_base, payload_end = self._payload_span

        def moved(peer: str, category: str, direction: str) -> float:
            key = (peer, category, direction)
            return payload_end.get(key, 0.0) - payload_base.get(key, 0.0)

        per_window = [
            (moved(p, "deltas", "down") + moved(p, "updates", "up")) / count for p, count in closed.items()
        ]
        use: dict[str, float] = {}
        for peer in self.peers:
            link = self.network.links[peer.peer_id]
            kind = "client" if peer.transport.client_mode else "public"
            up = sum(moved(peer.peer_id, c, "up") for c in PAYLOAD) / span / link.up_bps
            down = sum(moved(peer.peer_id, c, "down") for c in PAYLOAD) / span / link.down_bps
            use[kind] = max(use.get(kind, 0.0), up, down)
        seen: dict[tuple[int, int], set[str]] = defaultdict(set)
        for peer in self.peers:
            for fragment, hashes in enumerate(peer.state.applied_hashes):
                for round_id, hash_ in hashes.items():
                    seen[(fragment, round_id)].add(hash_)
        return SwarmFigures(
            n=self.n, seconds=span,
            protocol_bytes_per_s_per_peer={
                "p50": statistics.median(per_peer), "p90": _quantile(per_peer, 0.9), "max": max(per_peer),
                "max_whole_span": max(
                    (b for b, p in zip(per_peer, self.peers, strict=True) if p.joined_at <= start), default=math.nan
                ),
            },
            by_role={r: {"peers": len(v), "bytes_per_s_p50": statistics.median(v), "max": max(v)} for r, v in roles.items()},
            by_category=categories,
            busiest_key_bytes_per_s=keys.get(busiest_key, 0.0), busiest_key=busiest_key,
            busiest_peer_bytes_per_s=busiest_peer,
            round_latency_s=statistics.median(latencies) if latencies else math.nan,
            rounds=sum(heads), goodput=merged / computed if computed else math.nan, stalls=self.stalls,
            forks=sum(len(h) > 1 for h in seen.values()),
            forks_measured=sum(
                len(seen.get(key, ())) > 1 for key, opened in self.window_opened.items() if opened >= start
            ),
            synchronizer_bytes_per_window=(
                {"p50": statistics.median(per_window), "max": max(per_window)} if per_window else {}
            ),
            windows=sum(closed.values()),
            busiest_link_use=use,
        )  # fmt: skip

    def _windows_closed(self, start: float) -> Counter[str]:
        """Synchronizer -> windows opened since `start` that the chain (as any peer
        applied it) committed under its name."""
        records: dict[tuple[int, int], str] = {}
        for peer in self.peers:
            for fragment, chain in enumerate(peer.replicas.chains):
                for round_id, record in chain.items():
                    records.setdefault((fragment, round_id), record.synchronizer)
        return Counter(
            records[key] for key, opened in self.window_opened.items()
            if opened >= start and key in records
        )  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank below)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def _encoders(peer: SimPeer) -> list:
    """The roles' own encoder threads (state parts): replaced by the inline executor."""
    server = getattr(peer.replicas, "server", None)
    return [server] if server is not None and hasattr(server, "encoder") else []


def simulate(
    n: int,
    seconds: float,
    config: RunConfig | None = None,
    population: Population | None = None,
    seed: int = 0,
    warmup_s: float = 30.0,
    step_times_s: list[float] | None = None,
    update_pushes: int | None = None,
    step_traces: list[StepTrace] | None = None,
    preset_params: int = PARAMS,
) -> SwarmFigures:
    """One simulated run of `n` peers for `seconds` of virtual time. `update_pushes`:
    how many learners a synchronizer pushes a committed update to beyond its holders
    (`commit.MORE_PUSHES`; a large number is the former push to every learner).
    `preset_params`: the parameters of the model preset whose payloads the links carry
    (`PresetBytes`; the default, the small simulated model itself). `step_traces`: real
    learners' steps over time, replayed by the simulated learners (`StepTrace`)."""
    config = config or sim_config()
    preset = PresetBytes.of(preset_params, config) if preset_params != PARAMS else None
    swarm = Swarm(
        n, config, population or Population(), seed, preset, step_times_s=step_times_s,
        step_traces=step_traces, update_pushes=update_pushes,
    )
    package_log = logging.getLogger("p2pdiloco")
    level = package_log.level
    package_log.setLevel(logging.ERROR)  # a thousand peers' routine warnings, not the figures
    drawn = random.getstate()
    random.seed(seed)  # the roles' own draws (audit sampling, backoff jitter)
    try:
        with shared_verdicts():
            return run_virtual(swarm.run(seconds, warmup_s), swarm.clock)
    finally:
        package_log.setLevel(level)
        random.setstate(drawn)


@contextlib.contextmanager
def shared_verdicts() -> Iterator[None]:
    """Signature checks and record decoding memoised for the whole simulated swarm: pure
    functions of the bytes, which a thousand real peers each compute on their own CPU;
    here one CPU would compute them a thousand times. Bytes moved are counted all the same."""
    patched = [
        (identity, "verify"), (rounds, "open_record"), (record_rules, "open_record"),
        (membership, "open_heartbeat"), (record_rules, "open_heartbeat"),
    ]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name in patched]
    memos = {}
    for module, name, function in saved:
        memo = memos.setdefault(function, functools.lru_cache(maxsize=1 << 18)(function))
        setattr(module, name, memo)
    try:
        yield
    finally:
        for module, name, function in saved:
            setattr(module, name, function)


def sim_config(compress: dict[str, Any] | None = None, **sync: Any) -> RunConfig:
    """The embedded default's protocol settings (quorum, grace, deadlines, fragments,
    heartbeats) with int8 deltas and updates, or the `compress` settings given (e.g.
    {"codec": "sparse2", "outer_codec": "sparse2"}): the simulated peers encode with them."""
    base = RunConfig()
    return replace(base, sync={**sync}, compress={"codec": "int8", "outer_codec": "int8", **(compress or {})})
