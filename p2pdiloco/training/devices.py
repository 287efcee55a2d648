"""What the inner loop needs to know about its accelerator, kept out of the loop itself.

Three things differ by device: how a step's work is handed to the device (XLA traces it
and runs it at `torch_xla.sync()`; CUDA queues it; the CPU runs it at once), how a
fragment's parameters reach the host for shipping without stalling the training stream,
and which counters say whether the device is used well (XLA compilations, CUDA memory).
`torch_xla` is imported only when the device is `xla`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["HostStager", "StagedCopy", "device_stats", "sync_device"]


def sync_device(device: torch.device) -> None:
    """Hand the work traced so far to the device (XLA); a no-op elsewhere.

    On XLA the inner step is traced lazily and compiled once per distinct graph: one
    sync per step keeps the step one graph, and a sync after writing parameters from
    outside the step keeps those writes out of it (else every round would trace a new,
    larger step graph and compile it).
    """
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def device_stats(device: torch.device) -> dict[str, int]:
    """Counters worth watching on this device (empty on the CPU).

    XLA: `xla_compiles` (graphs compiled; flat after warm-up, or the step recompiles),
    `xla_executions` (graphs run), `xla_host_reads` (device-to-host transfers: a per-step
    `.item()` would show here). CUDA: `peak_memory_bytes` allocated since start.
    """
    if device.type == "xla":
        import torch_xla.debug.metrics as metrics

        def count(name: str) -> int:
            data = metrics.metric_data(name)
            return int(data[0]) if data else 0

        return {
            "xla_compiles": count("CompileTime"),
            "xla_executions": count("ExecuteTime"),
            "xla_host_reads": count("TransferFromDeviceTime"),
        }
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device))}
    return {}


@dataclass
class StagedCopy:
    """Tensors on their way to host memory; `wait()` returns them once they are there."""

    tensors: dict[str, torch.Tensor]
    """Host (fp32) copies by name; valid until the next `stage` of the same names."""
    done: torch.cuda.Event | None = None
    """Recorded on the copy stream after the last copy (CUDA only)."""

    def ready(self) -> bool:
        """True once the copy has landed (never blocks)."""
        return self.done is None or self.done.query()

    def wait(self) -> dict[str, torch.Tensor]:
        """Block this (host) thread until the copy landed; the device keeps training."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensors


class HostStager:
    """Copies a fragment's parameters to host memory without stalling the training stream.

    On CUDA the copy takes two moves: a device-side snapshot on the training stream
    (device-to-device, so it is ordered after the step that produced the values and
    the next step may overwrite the parameters at once), then a non-blocking copy of
    the snapshot into pinned host buffers on a side stream. The training stream never
    waits on the copy; whoever ships the delta waits on the side stream's event, and the
    learner does that one step later, when the next step is already queued. Elsewhere
    the copy is synchronous (the CPU, and XLA after its step's sync, hold materialised
    values). Host buffers are kept per name and reused (pinned on CUDA).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.shape != like.shape:
            buffer = torch.empty(
                like.shape, dtype=torch.float32, pin_memory=self.stream is not None
            )
            self.buffers[name] = buffer
        return buffer

    @torch.no_grad()
    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StagedCopy:
        """Start copying `tensors` (any device) to host fp32 buffers."""
        if self.stream is None:
            host = {}
            for name, tensor in tensors.items():
                host[name] = self._buffer(name, tensor)
                host[name].copy_(tensor.detach())
            return StagedCopy(host)
        training = torch.cuda.current_stream(self.device)
        snapshot = {name: t.detach().float().clone() for name, t in tensors.items()}
        self.stream.wait_stream(training)  # the snapshot is taken before the copy reads it
        host = {}
        with torch.cuda.stream(self.stream):
            for name, tensor in snapshot.items():
                host[name] = self._buffer(name, tensor)
                host[name].copy_(tensor, non_blocking=True)
                # the allocator must not hand the snapshot's memory to the training
                # stream before the side stream has read it
                tensor.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return StagedCopy(host, done)
