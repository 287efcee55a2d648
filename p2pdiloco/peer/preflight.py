"""Preflight checks: will this machine hold the run's preset, and is its clock right?

Pure functions from measured figures to `Finding`s (one line each: what was found and
what to do); `p2pdiloco doctor` adds the network's findings (`p2pdiloco.cli.doctor`), and
`join` runs the local ones and refuses to start on a `fail` (`raise_if_fatal`).

The memory model is the one `scripts/bench_memory.py` checks against measured peers
(docs/benchmarks.md, "Memory"): a CPU learner holds about

    0.4 GiB runtime + N x (39 + 9/P) bytes                   N parameters, P fragments

(parameters, gradients, AdamW's two moments, the replica's parameters and outer state,
error feedback, host staging buffers, bases, three kept int8 deltas; per fragment
shipped its fp32 delta, int8 encoding and the copy rebase keeps), and a peer that may be
elected synchronizer holds a window on top: (N/P) x (1.016 M + 25) bytes for M
contributions. On an accelerator the model, its gradients and AdamW (16 bytes a
parameter) and the activations live on the device instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any, Literal

from p2pdiloco.errors import PreflightError
from p2pdiloco.peer.checkpoint_dir import checkpoint_location

Level = Literal["ok", "warn", "fail", "skip"]

GiB = 1 << 30
MiB = 1 << 20

RUNTIME_BASE_BYTES = 400 * MiB
"""Python, torch and the transport's client before any tensor (a `tiny` peer peaks at
~430 MiB)."""
LEARNER_BYTES_PER_PARAM = 4 + 4 + 8 + 4 + 4 + 4 + 4 + 4 + 3 * (1 + 2 / 256)
"""fp32 CPU learner: parameters, gradients, AdamW's two moments, the replica (global
parameters and outer state), error-feedback residuals, the host staging buffers, the
bases, and up to three int8 deltas a fragment kept to resend (bench_memory's census)."""
DEVICE_BYTES_PER_PARAM = 4 + 4 + 8
"""What moves to an accelerator: parameters, gradients and AdamW's two moments (fp32)."""
LEARNER_BYTES_PER_FRAGMENT_PARAM = 4 + 1 + 4
"""Per parameter of the fragment being shipped: its fp32 delta, the int8 encoding, and
the local parameters as shipped (kept by `sync.on_receive = "rebase"`)."""
SYNC_BYTES_PER_FRAGMENT_PARAM = 8 + 8 + 4 + 1 + 4
"""A synchronizer's window besides the contributions: the fragment's snapshot and its
prepared successor (parameters and momentum each), the merged outer gradient, its int8
encoding and its decoded form."""
INT8_BYTES_PER_PARAM = 1 + 2 / 256
"""One int8 contribution: a byte per element and an fp16 scale per block of 256."""
ACTIVATION_BYTES_PER_TOKEN = 34
"""Activations a layer keeps for the backward pass, bytes per token and unit of width, in
16-bit (Korthikanti et al. 2022, "Reducing activation recomputation", Eq. 2: s b h (34 +
5 a s / h)); doubled for fp32 CPU training."""
CHECKPOINT_BYTES_PER_PARAM = 4 + 8 + 4 + 8
"""A checkpoint: the replica, AdamW's moments and the error feedback (the learner's file),
and the global parameters and outer momentum (the global state's files)."""
CLOCK_FAIL_S = 3.0
"""hivemind's `MAX_DHT_TIME_DISCREPANCY_SECONDS`: its initial peers refuse a peer whose
clock is further off; records expire by these clocks (heartbeats live 4 beats, 8 s)."""
CLOCK_WARN_S = 1.0
SLOW_START_S = 30.0
"""A transport start slower than this is worth a warning (a loaded machine, slow DNS)."""


@dataclass(frozen=True)
class Finding:
    """One check's result: one line for a volunteer, with what to do about it."""

    check: str
    """What was checked: devices, memory, disk, clock, address, reachable, transport, ..."""
    level: Level
    """ok, warn (works, but worse than it could), fail (will not work), skip (not checked)."""
    message: str
    """What was found, with the figures."""
    advice: str = ""
    """What to do about it (empty when nothing)."""

    def line(self) -> str:
        return f"{self.message}: {self.advice}" if self.advice else self.message


# --- the memory model --------------------------------------------------------------------


def parameter_count(dim: int, num_layers: int, ffn_dim: int, vocab_size: int) -> int:
    """Parameters of our decoder (`model.Decoder`), without building it: per block the
    attention's qkv and output (4 d^2), SwiGLU's three matrices (3 d f) and two norms; the
    tied embedding and the final norm."""
    per_block = 4 * dim * dim + 3 * dim * ffn_dim + 2 * dim
    return num_layers * per_block + vocab_size * dim + dim


def preset_parameters(preset: str) -> int:
    """Parameters of a model preset (`model.PRESETS`)."""
    from p2pdiloco.training.model import PRESETS

    shape = PRESETS[preset]
    return parameter_count(shape.dim, shape.num_layers, shape.ffn_dim, shape.vocab_size)


@dataclass(frozen=True)
class MemoryNeed:
    """What a peer of a run is expected to hold, bytes."""

    parameters: int
    host_bytes: int
    """Host RAM: runtime, replica and the learner's host-side state, the window."""
    device_bytes: int
    """Accelerator memory (0 on the CPU)."""
    checkpoint_bytes: int
    """One checkpoint file (`--checkpoint-dir` holds two while it writes: see `check_disk`)."""


def memory_need(
    parameters: int,
    num_fragments: int,
    batch_size: int,
    seq_len: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    on_accelerator: bool,
    synchronizer: bool,
    contributions: int = 2,
) -> MemoryNeed:
    """The memory model (module docstring) for one peer."""
    n, p = parameters, max(num_fragments, 1)
    tokens = batch_size * seq_len
    activations = (
        num_layers * tokens * dim * (ACTIVATION_BYTES_PER_TOKEN + 5 * num_heads * seq_len / dim)
    )
    learner = n * (LEARNER_BYTES_PER_PARAM + LEARNER_BYTES_PER_FRAGMENT_PARAM / p)
    window = (
        (n / p) * (contributions * INT8_BYTES_PER_PARAM + SYNC_BYTES_PER_FRAGMENT_PARAM)
        if synchronizer
        else 0
    )
    if on_accelerator:
        host = RUNTIME_BASE_BYTES + learner - n * DEVICE_BYTES_PER_PARAM + window
        device = n * DEVICE_BYTES_PER_PARAM + activations
    else:
        host = RUNTIME_BASE_BYTES + learner + window + 2 * activations
        device = 0
    return MemoryNeed(n, int(host), int(device), int(n * CHECKPOINT_BYTES_PER_PARAM))


def need_of(config: Any, device_type: str) -> MemoryNeed:
    """The memory model for a peer of `config` (a `RunConfig`) training on `device_type`."""
    from p2pdiloco.training.model import PRESETS

    shape = PRESETS[config.model.preset]
    return memory_need(
        preset_parameters(config.model.preset),
        config.sync.num_fragments,
        config.train.batch_size,
        config.model.seq_len,
        shape.dim,
        shape.num_layers,
        shape.num_heads,
        on_accelerator=device_type != "cpu",
        synchronizer=not config.peer.client_mode,
        contributions=max(2, config.sync.min_quorum),
    )


# --- the checks ----------------------------------------------------------------------------


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB"


def check_memory(
    preset: str, need: MemoryNeed, total_bytes: int | None, available_bytes: int | None
) -> Finding:
    """Host RAM against the model: fail when the machine has less than the peer needs,
    warn when it has it but not free now."""
    what = f"{preset} ({need.parameters / 1e6:,.1f}M parameters) needs about {gib(need.host_bytes)} of RAM"
    if total_bytes is None or available_bytes is None:
        return Finding("memory", "skip", f"{what}; this machine's RAM is unknown")
    have = f"this machine has {gib(total_bytes)}, {gib(available_bytes)} free"
    if total_bytes < need.host_bytes:
        return Finding(
            "memory",
            "fail",
            f"{what}; {have}",
            "use a machine with more RAM, a GPU, or a run with a smaller model preset",
        )
    if available_bytes < need.host_bytes:
        return Finding("memory", "warn", f"{what}; {have}", "close other programs before joining")
    return Finding("memory", "ok", f"{what}; {have}")


def check_device_memory(device: str, need: MemoryNeed, total_bytes: int | None) -> Finding:
    """Accelerator memory against the model (skip on the CPU or when unknown)."""
    if device == "cpu" or need.device_bytes == 0:
        return Finding("device memory", "skip", "training on the CPU: no accelerator memory needed")
    what = f"training on {device} needs about {gib(need.device_bytes)} of its memory"
    if total_bytes is None:
        return Finding("device memory", "skip", f"{what}; its size is unknown")
    if total_bytes < need.device_bytes:
        return Finding(
            "device memory",
            "fail",
            f"{what}; it has {gib(total_bytes)}",
            "lower train.batch_size (raise train.grad_accum to keep the batch), or join a run with a smaller preset",
        )
    return Finding("device memory", "ok", f"{what}; it has {gib(total_bytes)}")


def check_disk(
    directory: str, need: MemoryNeed, free_bytes: int | None, writable: bool = True
) -> Finding:
    """The checkpoint directory: writable by this user (a root-owned folder mounted into a
    container is not), and its free space: a save writes a new file beside the previous
    one before it replaces it, so two fit or saves fail."""
    if not directory:
        return Finding("disk", "skip", "no --checkpoint-dir: nothing but logs is written")
    if not writable:
        return Finding(
            "disk",
            "fail",
            f"this user cannot write checkpoints in {directory}",
            "choose another --checkpoint-dir, or give this user the folder (chown)",
        )
    want = 2 * need.checkpoint_bytes
    if free_bytes is None:
        return Finding(
            "disk",
            "warn",
            f"cannot read the free space of {directory}",
            "check that it is writable",
        )
    what = f"checkpoints in {directory} need about {gib(want)} (two files while saving); {gib(free_bytes)} free"
    if free_bytes < want:
        return Finding("disk", "fail", what, "free some space or choose another --checkpoint-dir")
    return Finding("disk", "ok", what)


def check_devices(requested: str, visible: Sequence[str], problem: str = "") -> Finding:
    """The devices torch sees, and whether `train.device` is one of them."""
    seen = ", ".join(visible) or "none"
    if problem:
        return Finding("devices", "fail", f"torch sees {seen}; {problem}")
    return Finding("devices", "ok", f"train.device={requested}; torch sees {seen}")


def check_clock(readings: Iterable[Any], peers_asked: int) -> Finding:
    """Our clock against the run's peers (`ClockReading`s): the reading with the shortest
    round trip is the most exact (NTP's rule); fail past `CLOCK_FAIL_S`."""
    readings = list(readings)
    if not readings:
        if not peers_asked:
            return Finding("clock", "skip", "no run peers to compare with (doctor --run NAME)")
        return Finding(
            "clock",
            "skip",
            f"none of the {peers_asked} peers asked told its time",
            "they may run an older version; check that your clock follows NTP",
        )
    best = min(readings, key=lambda r: r.error_s)
    offset, error = best.offset_s, best.error_s
    side = "behind" if offset > 0 else "ahead of"
    what = f"{abs(offset):.2f} s (±{error:.2f} s) {side} the run's peers (…{best.peer_id[-6:]})"
    if abs(offset) - error > CLOCK_FAIL_S:
        return Finding(
            "clock",
            "fail",
            f"your clock is {what}",
            "synchronise it (`timedatectl set-ntp true`, or your OS's time settings): peers refuse "
            f"clocks more than {CLOCK_FAIL_S:g} s off and records expire by them",
        )
    if abs(offset) - error > CLOCK_WARN_S:
        return Finding("clock", "warn", f"your clock is {what}", "turn on NTP time synchronisation")
    if abs(offset) < 0.01:
        return Finding(
            "clock",
            "ok",
            f"your clock agrees with the run's peers' (±{max(error, 0.01):.2f} s, …{best.peer_id[-6:]})",
        )
    return Finding("clock", "ok", f"your clock is {what}")


def address_scope(maddr: str) -> str:
    """`public`, `private` (a LAN or carrier NAT), `loopback`, or `unknown` (a DNS name,
    an unparsable address) for a multiaddr's IP."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return "unknown"
    try:
        ip = ip_address(parts[2])
    except ValueError:
        return "unknown"
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "unknown"
    return "public" if ip.is_global else "private"


def check_addresses(maddrs: Sequence[str], client_mode: bool) -> Finding:
    """What the addresses this peer announces let others do."""
    if client_mode:
        return Finding(
            "addresses",
            "ok",
            "client mode: you dial out only; you learn and contribute but are never elected synchronizer",
        )
    scopes = {m: address_scope(m) for m in maddrs}
    public = [m for m, s in scopes.items() if s in ("public", "unknown")]
    if public:
        return Finding(
            "addresses",
            "ok",
            f"you announce {public[0]}" + (f" (+{len(public) - 1})" if len(public) > 1 else ""),
        )
    if any(s == "private" for s in scopes.values()):
        return Finding(
            "addresses",
            "warn",
            "you announce private addresses only: peers outside your network cannot dial you",
            "forward your port on the router and pass --announce-maddrs /ip4/<public ip>/tcp/<port>, or join with --client-mode",
        )
    return Finding(
        "addresses",
        "warn",
        "you listen on 127.0.0.1 only: no other machine can dial you",
        "--host 0.0.0.0 --port <port> (and --announce-maddrs with your public address), or join with --client-mode",
    )


def check_reachable(maddr: str, problem: str, client_mode: bool) -> Finding:
    """The self-dial: a second, client-mode transport on this machine dialled `maddr`."""
    if client_mode:
        return Finding("reachable", "skip", "client mode: nobody needs to dial you")
    if not maddr:
        return Finding("reachable", "skip", "no address to dial")
    if problem:
        return Finding(
            "reachable",
            "fail",
            f"could not dial {maddr} from this machine ({problem})",
            "open the port in your firewall (and forward it on the router), or join with --client-mode",
        )
    note = ""
    if address_scope(maddr) == "public":
        # a router that loops its public address back may hide a port it does not forward
        note = " (from this machine: a router that loops back can hide a closed port)"
    return Finding("reachable", "ok", f"dialled {maddr} from a second transport{note}")


def check_transport(kind: str, started_s: float | None, problem: str = "") -> Finding:
    """How long the transport took to start (and join the run's DHT), or why it did not."""
    if started_s is None:
        return Finding("transport", "fail", f"{kind} did not start: {problem}")
    if started_s > SLOW_START_S:
        return Finding(
            "transport",
            "warn",
            f"{kind} started in {started_s:.1f} s",
            "a slow start: keep --startup-timeout-s well above it",
        )
    return Finding("transport", "ok", f"{kind} started in {started_s:.1f} s")


# --- this machine ------------------------------------------------------------------------


def ram_bytes() -> tuple[int | None, int | None]:
    """(total, available) RAM of this machine, bytes (None when unknown)."""
    try:
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.total), int(memory.available)
    except Exception:  # noqa: BLE001 - psutil missing, or a platform it cannot read
        return None, None


def _existing(directory: str) -> Path:
    """`directory`, or its nearest existing parent (a checkpoint folder is made on save)."""
    path = Path(directory).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_disk_bytes(directory: str) -> int | None:
    """Free bytes on the file system that holds `directory` (or its nearest existing
    parent: it may not exist yet), None when unreadable."""
    try:
        return shutil.disk_usage(_existing(directory)).free
    except OSError:
        return None


def writable(directory: str) -> bool:
    """Whether this user may create files in `directory` (or make it, in its nearest
    existing parent)."""
    path = _existing(directory)
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def visible_devices() -> list[str]:
    """What torch sees: the CPU (cores), each CUDA GPU (name, memory), MPS, torch_xla."""
    import importlib.util

    import torch

    seen = [f"cpu ({os.cpu_count() or '?'} cores)"]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            seen.append(f"cuda:{index} {props.name} ({gib(props.total_memory)})")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        seen.append("mps")
    if importlib.util.find_spec("torch_xla") is not None:
        seen.append("xla (torch_xla installed)")
    return seen


def device_memory_bytes(device_type: str) -> int | None:
    """The smallest visible accelerator's memory (CUDA), None when unknown."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return min(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )


def local_findings(config: Any) -> list[Finding]:
    """The checks that need no network: devices, RAM, accelerator memory, disk."""
    from p2pdiloco.errors import DeviceError
    from p2pdiloco.training.train import resolve_device

    problem, device_type = "", "cpu"
    try:
        device_type = resolve_device(config.train.device).type
    except DeviceError as exc:
        problem = str(exc)
    findings = [check_devices(config.train.device, visible_devices(), problem)]
    need = need_of(config, device_type)
    total, available = ram_bytes()
    findings.append(check_memory(config.model.preset, need, total, available))
    findings.append(check_device_memory(device_type, need, device_memory_bytes(device_type)))
    directory = checkpoint_location(config.peer)
    if directory:
        findings.append(
            check_disk(directory, need, free_disk_bytes(directory), writable(directory))
        )
    else:
        findings.append(check_disk(directory, need, None))
    return findings


def raise_if_fatal(findings: Iterable[Finding], skippable: bool = True) -> None:
    """Raise a `PreflightError` naming the first failed check (`join` runs this)."""
    for finding in findings:
        if finding.level == "fail":
            skip = "; join --skip-preflight to try anyway" if skippable else ""
            raise PreflightError(
                f"preflight {finding.check}: {finding.line()} (`p2pdiloco doctor` checks everything{skip})"
            )


def render_findings(findings: Iterable[Finding]) -> list[str]:
    """One rich-markup line per finding: its level, the check, what and what to do."""
    from rich.markup import escape

    style = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
    lines = []
    for f in findings:
        advice = f" [dim]→[/] {escape(f.advice)}" if f.advice else ""
        lines.append(
            f"[{style[f.level]}]{f.level:<4}[/] [bold]{f.check:<14}[/] {escape(f.message)}{advice}"
        )
    return lines


def exit_code(findings: Iterable[Finding]) -> int:
    """0 when nothing failed, 1 otherwise (2 stays the usage error's)."""
    return 1 if any(f.level == "fail" for f in findings) else 0


def to_json(findings: Iterable[Finding]) -> list[dict[str, str]]:
    return [
        {"check": f.check, "level": f.level, "message": f.message, "advice": f.advice}
        for f in findings
    ]


__all__ = [
    "Finding",
    "MemoryNeed",
    "PreflightError",
    "check_addresses",
    "check_clock",
    "check_device_memory",
    "check_devices",
    "check_disk",
    "check_memory",
    "check_reachable",
    "check_transport",
    "local_findings",
    "memory_need",
    "parameter_count",
    "raise_if_fatal",
]
