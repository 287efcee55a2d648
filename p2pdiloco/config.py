"""Run configuration: frozen dataclasses, one per component, loaded from TOML.

Every field has a working default and a docstring-style comment with its unit.
`load_config(path, overrides)` reads a TOML file (optional) and then applies
`section.key=value` overrides; unknown sections or keys, wrong types and values out
of range are `ConfigError`s naming the dotted field. The shipped `default.toml`
equals these defaults (a test checks it).

All sections but `[peer]` describe the run every peer shares; `[peer]` holds this one
peer's settings (address, identity, limits), which `config_hash` leaves out.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.errors import ConfigError

MODEL_PRESETS = ("tiny", "small", "150m", "1b")
DEVICES = ("auto", "cpu", "cuda", "mps", "xla")
MERGE_RULES = ("mean", "token", "radial", "trimmed")
RADIAL_NORMS = ("mean", "median")
ON_RECEIVE = ("overwrite", "rebase", "mix")
CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "fp4", "topk", "sparse2")
TRANSPORTS = ("hivemind", "libp2p")
SIMULATE_MODES = ("lockstep", "decoupled")


def _check(cond: bool, name: str, message: str) -> None:
    """ConfigError "`name` `message`" unless `cond`."""
    if not cond:
        raise ConfigError(f"{name} {message}")


# The rules most fields follow. Each reads the field its dotted name ends in from the
# section being validated and words the error as the rule is written, e.g.
# "sync.min_quorum must be >= 1, got 0". NaN fails every comparison, so it is refused too.


def _field(section: Any, dotted: str) -> Any:
    """The value of `section.key` for a dotted name "section.key"."""
    return getattr(section, dotted.rpartition(".")[2])


def _at_least(section: Any, dotted: str, low: float) -> None:
    """ConfigError unless the field is >= `low`."""
    value = _field(section, dotted)
    _check(value >= low, dotted, f"must be >= {low}, got {value}")


def _positive(section: Any, dotted: str) -> None:
    """ConfigError unless the field is > 0."""
    value = _field(section, dotted)
    _check(value > 0, dotted, f"must be > 0, got {value}")


def _within(section: Any, dotted: str, interval: str, note: str = "") -> None:
    """ConfigError unless the field lies in `interval`, written as the message shows it
    ("[0, 1)", "(0, 10]"); `note` is added in parentheses after it."""
    value = _field(section, dotted)
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    hint = f" ({note})" if note else ""
    _check(above and below, dotted, f"must be in {interval}{hint}, got {value}")


def _one_of(section: Any, dotted: str, choices: tuple[str, ...]) -> None:
    """ConfigError unless the field is one of `choices`."""
    value = _field(section, dotted)
    _check(value in choices, dotted, f"must be one of {choices}, got {value!r}")


def _not_empty(section: Any, dotted: str) -> None:
    """ConfigError if the field is empty."""
    _check(bool(_field(section, dotted)), dotted, "must not be empty")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder to train."""

    preset: str = "small"
    """Size preset: tiny (~1M params, tests), small (~10M, CPU demos), 150m, 1b."""
    seq_len: int = 128
    """Tokens (bytes) per training sequence."""

    def __post_init__(self) -> None:
        _one_of(self, "model.preset", MODEL_PRESETS)
        _within(self, "model.seq_len", "[8, 65536]")


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it is split."""

    source: str = "stdlib"
    """`stdlib` (the running Python's standard library source), a path to .txt/.jsonl/.parquet
    files or a folder of them, or `hf:NAME` for a Hugging Face dataset (needs the `hf` extra)."""
    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet records and Hugging Face datasets."""
    heldout_fraction: float = 0.05
    """Fraction of files (by stable hash of their relative path) kept for evaluation."""
    max_files: int = 0
    """Read at most this many files (0 = all); keeps demos and tests fast."""

    def __post_init__(self) -> None:
        _not_empty(self, "data.source")
        _not_empty(self, "data.text_field")
        _within(self, "data.heldout_fraction", "(0, 1)")
        _at_least(self, "data.max_files", 0)


@dataclass(frozen=True)
class TrainConfig:
    """The inner loop each learner runs on its own replica (AdamW)."""

    device: str = "auto"
    """Compute device: auto, cpu, cuda, mps or xla (TPU via torch_xla)."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per inner step."""
    lr: float = 3e-3
    """Peak inner learning rate (AdamW)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    warmup_steps: int = 50
    """Linear warm-up length, in inner steps."""
    total_steps: int = 2000
    """Inner steps of the cosine schedule; after it the lr stays at its floor."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule as a fraction of `lr`."""
    grad_clip: float = 1.0
    """Max global gradient L2 norm (0 disables clipping)."""
    seed: int = 0
    """Seed for model init (shared by all peers) and, mixed with the peer's rank, data order."""
    compute_share: float = 1.0
    """Share of wall-clock time the training loop may compute, in (0, 1]: a volunteer's
    "use at most half of this machine" is 0.5. After each inner step the loop rests so its
    busy time stays at this share (1: it never rests)."""

    def __post_init__(self) -> None:
        _one_of(self, "train.device", DEVICES)
        _at_least(self, "train.batch_size", 1)
        _at_least(self, "train.grad_accum", 1)
        _within(self, "train.lr", "(0, 1)")
        _at_least(self, "train.weight_decay", 0)
        _within(self, "train.beta1", "[0, 1)")
        _within(self, "train.beta2", "[0, 1)")
        _at_least(self, "train.warmup_steps", 0)
        _at_least(self, "train.total_steps", 1)
        _within(self, "train.min_lr_ratio", "[0, 1]")
        _at_least(self, "train.grad_clip", 0)
        _within(self, "train.compute_share", "(0, 1]")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer and the merge rule applied to learners' deltas."""

    lr: float = 1.0
    """Outer learning rate. DiLoCo used 0.7 with momentum 0.9, tuned for thousands of
    outer steps; our quality study (docs/benchmarks.md) finds lr 1 without momentum best
    for runs of tens to hundreds of rounds (docs/operate.md has the rule)."""
    momentum: float = 0.0
    """Outer Nesterov momentum (0 = none; DiLoCo used 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (True) or heavy-ball (False)."""
    merge: str = "token"
    """Merge rule: mean, token (token-weighted mean), radial (radial-directional) or trimmed
    (coordinate-wise trimmed mean, robust to a minority of outliers per coordinate). Token:
    as good as radial with equal learners and 5-6% better with unequal ones (benchmarks)."""
    trim_fraction: float = 0.2
    """Share of the deltas dropped at each end of every coordinate by the trimmed rule."""
    max_weight_share: float = 0.5
    """No learner gets more than this share of the total merge weight (1.0 = no cap)."""
    radial_norm: str = "mean"
    """Radial term of the radial-directional rule: weighted mean or median of norms."""
    delayed_nesterov_every: int = 1
    """Apply momentum once per this many merges (1 = ordinary Nesterov)."""

    def __post_init__(self) -> None:
        _within(self, "outer.lr", "(0, 10]")
        _within(self, "outer.momentum", "[0, 1)")
        _one_of(self, "outer.merge", MERGE_RULES)
        _within(self, "outer.trim_fraction", "[0, 0.5)")
        _within(self, "outer.max_weight_share", "(0, 1]")
        _one_of(self, "outer.radial_norm", RADIAL_NORMS)
        _at_least(self, "outer.delayed_nesterov_every", 1)


MAX_FRAGMENTS = 64
"""The most fragments a run may have: a bootstrap node of an open run, which does not know
the run's count, stores the round records of this many (record_rules)."""
MAX_WINDOW_DELTAS = 256
"""The most deltas one (round, fragment) window takes: its record names each (peer id,
weight, tokens, contribution digest, norm: ~150 bytes, incompressible), and a record
must fit `rounds.MAX_RECORD_BYTES` (64 KiB) or no replica reads it. A full window closes
at once; later deltas get `late` and go to the next round (test_rounds.py checks that
the largest record fits)."""
MAX_COMMIT_HOLDERS = 32
"""The most holders a record may name beyond its synchronizer (the same budget)."""


@dataclass(frozen=True)
class SyncConfig:
    """When fragments are synchronised and how a synchronizer closes a round."""

    inner_steps: int = 50
    """H: inner steps between two synchronisations of the same fragment."""
    num_fragments: int = 1
    """F: parameter fragments, staggered by H/F steps (1 = plain DiLoCo)."""
    min_quorum: int = 1
    """K: learners that must report before a round may close."""
    min_token_fraction: float = 0.0
    """Also require this fraction of the tokens expected from live learners (0 = off)."""
    warm_steps: int = 0
    """Warm start: a learner's first this many inner steps synchronise every
    `warm_inner_steps` steps, all fragments together, close to synchronous training
    (0 = off). Only a learner that starts the run from round 0 does it."""
    warm_inner_steps: int = 1
    """H during the warm start."""
    overlap_steps: int = 2
    """tau: inner steps of compute that overlap a synchronisation (paper Eq. 3); with
    `on_receive = "rebase"` learners overlap a whole cycle, so tau is at least H
    (`windows.overlap_steps_of`)."""
    grace_gamma: float = 0.5
    """gamma < 1: share of the slack spent waiting for stragglers (paper Eq. 3)."""
    max_grace_s: float = 5.0
    """Upper bound on the grace window, in seconds."""
    round_deadline_s: float = 60.0
    """A round with no result after this many seconds fails over to the next synchronizer."""
    max_staleness_rounds: int = 2
    """Deltas whose base is more than this many rounds old are rejected."""
    staleness_discount: float = 0.5
    """Weight multiplier per round of staleness of an accepted delta."""
    on_receive: str = "rebase"
    """rebase (keep the steps taken while the delta was away), overwrite (the paper's) or mix
    (blend with mix_alpha). Rebase reached DDP's loss 21x faster at 10 Mbit/s, where
    overwrite did not reach it (docs/benchmarks.md, WAN)."""
    mix_alpha: float = 0.5
    """Weight of the global fragment in `mix` mode."""
    commit_holders: int = 2
    """R: peers besides the synchronizer that must hold a round's update before the round
    is committed (fewer when fewer other learners are live), so it survives the
    synchronizer's death, and one holder that withholds cannot make it unfetchable."""
    audit_share: float = 0.03
    """Expected audits of each round across the swarm: each peer that applies a round
    recomputes it from its signed contributions with probability audit_share /
    contributors before applying it (so the cost per peer does not grow with the swarm; 0.03 keeps it
    under 2% of a round's traffic). Updates out of line with the last ones are always
    audited (see security.md)."""

    def __post_init__(self) -> None:
        # in this order: the cross-field checks divide by (or compare with) a checked field
        _at_least(self, "sync.commit_holders", 0)
        _check(
            self.commit_holders <= MAX_COMMIT_HOLDERS,
            "sync.commit_holders",
            f"must be at most {MAX_COMMIT_HOLDERS}, got {self.commit_holders}",
        )
        _at_least(self, "sync.inner_steps", 1)
        _check(
            1 <= self.num_fragments <= self.inner_steps,
            "sync.num_fragments",
            f"must be in [1, sync.inner_steps={self.inner_steps}], got {self.num_fragments}",
        )
        _check(
            self.num_fragments <= MAX_FRAGMENTS,
            "sync.num_fragments",
            f"must be at most {MAX_FRAGMENTS}, got {self.num_fragments}",
        )
        _at_least(self, "sync.warm_steps", 0)
        _check(
            1 <= self.warm_inner_steps <= self.inner_steps,
            "sync.warm_inner_steps",
            f"must be in [1, sync.inner_steps={self.inner_steps}], got {self.warm_inner_steps}",
        )
        _check(
            self.warm_steps % self.warm_inner_steps == 0,
            "sync.warm_steps",
            f"must be a multiple of sync.warm_inner_steps={self.warm_inner_steps}, got {self.warm_steps}",
        )
        _at_least(self, "sync.min_quorum", 1)
        _check(
            self.min_quorum <= MAX_WINDOW_DELTAS,
            "sync.min_quorum",
            f"must be at most {MAX_WINDOW_DELTAS} (the deltas a window takes), got {self.min_quorum}",
        )
        _within(self, "sync.min_token_fraction", "[0, 1]")
        _at_least(self, "sync.overlap_steps", 0)
        _within(self, "sync.grace_gamma", "[0, 1)")
        _at_least(self, "sync.max_grace_s", 0)
        _positive(self, "sync.round_deadline_s")
        _at_least(self, "sync.max_staleness_rounds", 0)
        _within(self, "sync.staleness_discount", "(0, 1]")
        _within(self, "sync.audit_share", "[0, 64]")
        _one_of(self, "sync.on_receive", ON_RECEIVE)
        _within(self, "sync.mix_alpha", "[0, 1]")


@dataclass(frozen=True)
class CompressConfig:
    """Codecs for learner deltas and for the published outer gradient."""

    codec: str = "int8"
    """Codec of learner deltas: fp32, fp16, bf16, int8, int4, fp4, topk or sparse2."""
    outer_codec: str = "int8"
    """Codec of the merged outer gradient the synchronizer publishes."""
    block_size: int = 256
    """Elements per absmax-scale block of the int8/int4/fp4 codecs."""
    topk_fraction: float = 0.05
    """Share of entries the topk codec keeps."""
    sparse_chunk: int = 4096
    """Elements per chunk of the sparse2 codec (offsets take ceil(log2) bits: 12 for 4096)."""
    sparse_k: int = 64
    """Entries the sparse2 codec keeps per full chunk (64 of 4096: 1.56%, as SparseLoCo)."""
    outer_sparse_k: int = 256
    """Entries a sparse2 outer update keeps per full chunk: the merge of K sparse deltas is
    their union, up to K x `sparse_k` entries (256: all of K = 4 learners' at the default
    k, 0.108 bytes/param; a larger window's union loses its smallest entries). Above
    `sparse_chunk` it keeps every entry of a chunk."""
    error_feedback: bool = True
    """Keep what a lossy codec did not send and add it to the next delta (SparseLoCo)."""
    zstd: bool = False
    """Add a lossless zstd stage on top of the codec."""

    def __post_init__(self) -> None:
        _one_of(self, "compress.codec", CODECS)
        _one_of(self, "compress.outer_codec", CODECS)
        _check(
            2 <= self.block_size <= 1 << 20 and self.block_size % 2 == 0,
            "compress.block_size",
            f"must be even and in [2, 1048576], got {self.block_size}",
        )
        _within(self, "compress.topk_fraction", "(0, 1]")
        _check(
            2 <= self.sparse_chunk <= 1 << 16,
            "compress.sparse_chunk",
            f"must be in [2, 65536], got {self.sparse_chunk}",
        )
        _check(
            1 <= self.sparse_k <= min(self.sparse_chunk, 65535),
            "compress.sparse_k",
            f"must be in [1, min(compress.sparse_chunk, 65535)], got {self.sparse_k}",
        )
        _check(
            1 <= self.outer_sparse_k <= 65535,
            "compress.outer_sparse_k",
            f"must be in [1, 65535], got {self.outer_sparse_k}",
        )


@dataclass(frozen=True)
class SimulateConfig:
    """The in-process simulator and its synchronous data-parallel baseline."""

    learners: int = 4
    """M: learners simulated round-robin in one process."""
    rounds: int = 10
    """Outer rounds to run (each is sync.inner_steps inner steps per learner)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    eval_every_rounds: int = 1
    """Evaluate both runs after every this many rounds."""
    baseline: bool = True
    """Also run synchronous data parallel on the same tokens and compute."""
    baseline_lr: float = 0.0
    """The baseline's learning rate (0 = train.lr). Its batch is M learners' batches, so
    its best lr is higher than a learner's: give each run the lr tuned for its batch."""
    mode: str = "lockstep"
    """lockstep: plain DiLoCo, every delta merged every round; decoupled: the swarm's
    schedule on a simulated clock (speeds, quorum, grace, staleness: p2pdiloco.sim.decoupled)."""
    speeds: str = "1"
    """Decoupled: relative speed of each learner, comma separated, cycled ("1,1,0.5,0.5")."""
    jitter: float = 0.0
    """Decoupled: each step takes its learner's step time x uniform(1 - jitter, 1 + jitter)."""
    step_time_s: float = 1.0
    """Decoupled: simulated seconds of one inner step at speed 1."""
    link_s: float = 0.0
    """Decoupled: simulated seconds a delta, or a result, takes on the wire."""
    sync_s: float = 0.0
    """Decoupled: simulated seconds from a window's close to its result leaving."""
    seed: int = 0
    """Decoupled: seed of the schedule (start offsets, jitter)."""

    def __post_init__(self) -> None:
        _within(self, "simulate.learners", "[1, 256]")
        _at_least(self, "simulate.rounds", 1)
        _within(self, "simulate.baseline_lr", "[0, 1]", note="0 = train.lr")
        _at_least(self, "simulate.eval_batches", 1)
        _at_least(self, "simulate.eval_every_rounds", 1)
        _check(
            self.mode in SIMULATE_MODES,
            "simulate.mode",
            f"must be one of {', '.join(SIMULATE_MODES)}, got {self.mode!r}",
        )
        try:
            speeds = [float(s) for s in self.speeds.split(",") if s.strip()]
        except ValueError:
            speeds = []
        _check(
            bool(speeds) and all(0.0 < s < 1e6 for s in speeds),
            "simulate.speeds",
            f'must be positive numbers separated by commas, e.g. "1,1,0.5", got {self.speeds!r}',
        )
        _within(self, "simulate.jitter", "[0, 1)")
        _positive(self, "simulate.step_time_s")
        _at_least(self, "simulate.link_s", 0)
        _at_least(self, "simulate.sync_s", 0)


CORRUPTIONS = ("", "nan", "garbage")
REACHABILITY = ("auto", "public", "client")


@dataclass(frozen=True)
class NetworkConfig:
    """The peer-to-peer stack of the run: every peer uses the same (docs/transport.md)."""

    transport: str = "hivemind"
    """hivemind (go-libp2p daemon, hivemind's DHT) or libp2p (py-libp2p, one process)."""
    member_shards: int = 1
    """DHT keys the heartbeats are split over (a power of two, at most 1024): each beat
    reads one shard in a rotation, so a peer's membership cost is ~N / shards heartbeats
    per period instead of N. About one shard per 16 expected peers (docs/scale.md); 1 for
    a swarm of a few dozen."""

    record_epoch_rounds: int = 0
    """Rounds per DHT key of round records (0: one key per fragment, read whole). With N,
    a replica reads the keys of its own epoch and the next (and those of the head the
    heartbeats claim, when it is behind) and keeps the records it read, so a read brings
    at most ~2N records, not the hour's (docs/scale.md)."""

    def __post_init__(self) -> None:
        _check(
            self.transport in TRANSPORTS,
            "network.transport",
            f"must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}",
        )
        shards = self.member_shards
        _check(
            isinstance(shards, int) and 1 <= shards <= 1024 and shards & (shards - 1) == 0,
            "network.member_shards",
            f"must be a power of two from 1 to 1024, got {shards!r}",
        )
        epoch = self.record_epoch_rounds
        _check(
            isinstance(epoch, int) and 0 <= epoch <= 4096 and epoch & (epoch - 1) == 0,
            "network.record_epoch_rounds",
            f"must be 0 or a power of two up to 4096, got {epoch!r}",
        )


@dataclass(frozen=True)
class PeerConfig:
    """How this one peer joins and runs: its own choice, never part of the run's hash.

    Every `p2pdiloco join` flag is a shorthand for one of these fields (`--port 4000` is
    `--set peer.port=4000`); the defaults live here only.
    """

    # --- joining ----------------------------------------------------------------------
    run: str = "local"
    """Run name: the namespace of every DHT key and RPC; names bootstrap_peers/<run>.txt."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs to bootstrap from (empty: the run's bootstrap file, or none with `new_run`)."""
    bootstrap_file: str = ""
    """Bootstrap file to read initial peers from ("": bootstrap_peers/<run>.txt)."""
    manifest: str = ""
    """Signed run manifest, a path or an http(s) URL ("": the run's shipped or local
    `<run>.toml` when it exists): it then gives
    the run config, the bootstrap peers, the admission rules and the certificates."""
    new_run: bool = False
    """Start a new swarm: no bootstrap peers needed (the run's first peer)."""
    startup_timeout_s: float = 120.0
    """Bound on joining the DHT, in seconds."""

    # --- network ----------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Listen address (0.0.0.0: every interface)."""
    port: int = 0
    """Listen port (0: any free port)."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to announce instead of the listen ones (public IP behind port forwarding)."""
    client_mode: bool = False
    """Behind NAT: only outgoing connections; never elected synchronizer."""
    reachability: str = "auto"
    """auto: after joining, ask up to 3 initial peers to dial this one back, and go on as
    a client-mode learner if none can; public: serve without asking; client: the same as
    `client_mode` (docs/join.md, "NAT and reachability")."""
    use_relay: bool = True
    """Reach peers through libp2p circuit relays when a direct dial fails, and relay for
    others once the daemon finds itself public (hivemind's `use_relay`)."""
    use_auto_relay: bool = True
    """In client mode: hold a slot on a relay (the initial peers) and announce the relayed
    address, so others can reach this peer through it (hivemind's `use_auto_relay`)."""
    identity_path: str = ""
    """Ed25519 key file, created if missing, so the peer id survives restarts ("": a new id)."""
    heartbeat_s: float = 2.0
    """Seconds between heartbeats; a peer silent for 4 heartbeats is gone."""

    # --- training -----------------------------------------------------------------------
    data_rank: int = -1
    """This peer's data shard (-1: derived from the peer id)."""
    data_shards: int = 1
    """Data shards the run is split into (1: every peer reads all, in its own order)."""
    wait_peers: int = 0
    """Start training only once this many learners (this one included) are live, so peers
    started together begin together (0: start at once). Bounded by `wait_peers_timeout_s`."""
    wait_peers_timeout_s: float = 300.0
    """Seconds after which the peer starts anyway (with a warning): a barrier never hangs."""
    max_rounds: int = 0
    """Leave once every fragment reached this round (0: run until stopped)."""
    max_steps: int = 0
    """Leave after this many inner steps (0: run until stopped)."""
    eval_batches: int = 2
    """Held-out batches evaluated after each round of fragment 0 (0: none)."""
    torch_threads: int = 0
    """Threads for torch's CPU kernels (0: torch's default). Several peers on one machine
    should use 1 each, or their busy-waiting thread pools starve one another."""
    events: bool = False
    """Print one JSON line per event on stdout (tests and the demo read these)."""
    metrics_port: int = 0
    """Serve Prometheus metrics over HTTP on this port (0: no metrics; docs/operate.md)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on (0.0.0.0: every interface)."""

    # --- checkpoints --------------------------------------------------------------------
    checkpoint_dir: str = "auto"
    """Where the global state (with the round records that justify it) and this learner's
    local state are saved, periodically and on leaving, and restored on start: "auto" is
    `<data>/<run>/<peer id or default>/checkpoints` in the user's data directory
    ($P2PDILOCO_DATA_HOME, else $XDG_DATA_HOME/p2pdiloco, else ~/.local/share/p2pdiloco;
    p2pdiloco.peer.checkpoint_dir); "none" or "": no checkpoints; else that folder."""
    checkpoint_every_s: float = 60.0
    """Seconds between periodic checkpoints while training (with `checkpoint_dir`)."""

    # --- fault injection: tests and benchmarks only, off by default ----------------------
    straggle_s: float = 0.0
    """Test only: delay contributions to the first `straggle_rounds` rounds by this, seconds."""
    straggle_rounds: int = 0
    """Test only: rounds (from 0) whose contributions are delayed by `straggle_s`."""
    corrupt: str = ""
    """Test only: send `nan` deltas or `garbage` frames to the first `corrupt_rounds` rounds."""
    corrupt_rounds: int = 0
    """Test only: rounds (from 0) whose contributions are corrupted."""
    crash_at: str = ""
    """Test only: `PHASE[:ROUND]`, die (SIGKILL) at that phase of a commit (see faults)."""
    split_view_rounds: int = 0
    """Test only: see only itself and ignore rival records for the first rounds (forces
    two commits of one round; see faults.SplitView)."""

    def __post_init__(self) -> None:
        _check(
            bool(self.run) and "/" not in self.run and not self.run.startswith("."),
            "peer.run",
            f"must be a plain name like 'community-150m', got {self.run!r}",
        )
        _positive(self, "peer.startup_timeout_s")
        _not_empty(self, "peer.host")
        _within(self, "peer.port", "[0, 65535]")
        _within(self, "peer.metrics_port", "[0, 65535]", note="0: no metrics")
        _not_empty(self, "peer.metrics_host")
        _within(
            self,
            "peer.heartbeat_s",
            "(0, 75]",
            note="a heartbeat signs a life of 4 periods, and no life over 300 s is accepted",
        )
        _at_least(self, "peer.data_rank", -1)
        _at_least(self, "peer.data_shards", 1)
        for name in (
            "wait_peers",
            "max_rounds",
            "max_steps",
            "eval_batches",
            "torch_threads",
            "straggle_rounds",
            "corrupt_rounds",
            "split_view_rounds",
            "wait_peers_timeout_s",
            "straggle_s",
        ):
            _at_least(self, f"peer.{name}", 0)
        _positive(self, "peer.checkpoint_every_s")
        _one_of(self, "peer.corrupt", CORRUPTIONS)
        _one_of(self, "peer.reachability", REACHABILITY)


@dataclass(frozen=True)
class ScreeningRules:
    """How contributions are screened (`screening.screen`); every replica and auditor uses
    the same values."""

    clip_factor: float = 3.0
    """Deltas above this times the reference norm are scaled down to it."""
    refuse_factor: float = 4.0
    """Deltas above this times the clip threshold are refused instead of scaled."""
    max_param_ratio: float = 4.0
    """Until there is history, the clip threshold is at most this times the fragment's
    parameter norm (the only bound on a lone delta in round 0)."""
    history_rounds: int = 4
    """Records of the fragment's canonical chain (the latest before the window's round)
    whose contributors make up the `History` (see `history_of`)."""
    min_history: int = 3
    """Accepted norms (or token counts) the history needs before it is the reference."""
    momentum_min_cosine: float = -0.05
    """Refuse a delta whose cosine with the outer momentum is below this (momentum != 0)."""
    loo_min_cosine: float = 0.05
    """Refuse a delta whose cosine with the others' summed directions is below this."""
    sparse_loo_min_cosine: float = 0.01
    """The same line for a sparse delta (at most `screening.SPARSE_DENSITY` of its entries
    nonzero: sparse2, topk): learners' top-k sets overlap only in part, so honest sparse
    cosines are ~4x lower than dense ones (measured: min 0.027 against 0.17)."""
    min_loo_peers: int = 3
    """Deltas needed for the leave-one-out check (two cannot tell which one is off)."""
    token_factor: float = 2.0
    """Tokens counted at most this times the median accepted token count, and a weight
    at most this times the window's median weight."""

    def __post_init__(self) -> None:
        _at_least(self, "screening.clip_factor", 1)
        _at_least(self, "screening.refuse_factor", 1)
        _positive(self, "screening.max_param_ratio")
        _at_least(self, "screening.history_rounds", 1)
        _at_least(self, "screening.min_history", 1)
        _within(self, "screening.momentum_min_cosine", "[-1, 1]")
        _within(self, "screening.loo_min_cosine", "[-1, 1]")
        _within(self, "screening.sparse_loo_min_cosine", "[-1, 1]")
        _at_least(self, "screening.min_loo_peers", 3)
        _at_least(self, "screening.token_factor", 1)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run agrees on, one section per component, and this peer's own `peer`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    screening: ScreeningRules = field(default_factory=ScreeningRules)
    """How synchronizers screen learners' deltas (auditors redo it: part of the run hash)."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The transport: peers of one run must share it (part of the run hash)."""
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    """Per peer, not shared: left out of `config_hash`."""


DEFAULT_TOML = Path(__file__).with_name("default.toml")


def _coerce(value: Any, kind: Any, name: str) -> Any:
    """Check `value` against the field type `kind`; ints are accepted for floats and
    TOML arrays of strings for `tuple[str, ...]`."""
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f'{name} must be a list of strings, e.g. ["/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."], got {value!r}'
            )
        return tuple(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a boolean (true/false), got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config field type {kind!r} for {name}")


def _build_section(cls: type, name: str, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]} (known: {', '.join(sorted(known))})")
    kwargs = {key: _coerce(val, hints[key], f"{name}.{key}") for key, val in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a validated `RunConfig` from nested plain data (as TOML gives it)."""
    hints = typing.get_type_hints(RunConfig)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise ConfigError(f"unknown config section [{unknown[0]}] (known: {', '.join(hints)})")
    sections = {}
    for name, cls in hints.items():
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table, got {values!r}")
        sections[name] = _build_section(cls, name, values)
    return RunConfig(**sections)


def config_to_dict(config: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain data of a config (inverse of `config_from_dict`)."""
    return dataclasses.asdict(config)


def _parse_override_value(text: str) -> Any:
    """Parse the value of `--set key=value` as a TOML value, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with `section.key=value` overrides applied."""
    merged = {key: dict(val) if isinstance(val, dict) else val for key, val in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(
                f"override {item!r} must look like section.key=value, e.g. sync.min_quorum=2"
            )
        merged.setdefault(section, {})
        if not isinstance(merged[section], dict):
            raise ConfigError(f"[{section}] must be a table")
        merged[section][name] = _parse_override_value(text.strip())
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from TOML (defaults when `path` is None), then apply overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return config_from_dict(apply_overrides(raw, overrides or []))


def replace(config: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """A copy of `config` with some fields of some sections changed (validated again)."""
    raw = config_to_dict(config)
    for name, values in sections.items():
        raw[name].update(values)
    return config_from_dict(raw)


def render_toml(config: RunConfig) -> str:
    """Render a config as TOML (flat sections of scalars), e.g. to publish a run's config."""
    lines: list[str] = []
    for section, values in config_to_dict(config).items():
        lines.append(f"[{section}]")
        for key, val in values.items():
            lines.append(f"{key} = {_toml_value(val)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(val: Any) -> str:
    """A scalar, or a tuple of strings, as a TOML value."""
    if isinstance(val, bool):
        return "true" if val else "false"
    if isinstance(val, str):
        return '"' + val.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(val, tuple):
        return "[" + ", ".join(_toml_value(v) for v in val) + "]"
    return repr(val)


PER_PEER_FIELDS = {
    "train": {"device", "batch_size", "grad_accum", "compute_share"},
    "sync": {"audit_share"},
}
"""Fields each volunteer may choose for its own machine (token weighting absorbs them)."""


def config_hash(
    config: RunConfig,
    sections: tuple[str, ...] = (
        "model",
        "train",
        "outer",
        "sync",
        "compress",
        "screening",
        "network",
    ),
) -> str:
    """A short hash of what every peer of a run must agree on.

    Left out: `data` (each volunteer may train on its own text), `simulate`, `peer`
    (ports, identities, limits and fault injection are each peer's own), and the per-peer
    fields of `PER_PEER_FIELDS`.
    """
    import hashlib
    import json

    data = {name: values for name, values in config_to_dict(config).items() if name in sections}
    for section, fields in PER_PEER_FIELDS.items():
        data[section] = {k: v for k, v in data[section].items() if k not in fields}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
