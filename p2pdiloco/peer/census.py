"""Where a peer's memory is: the large buffers reachable from it, summed by owner.

A diagnostic for the gap between a peer's measured peak RSS and the memory model of
docs/benchmarks.md. `census(root)` walks the object graph from `root` through attributes,
dict items and sequence items, finds every tensor storage and byte buffer of at least
`min_bytes`, counts each once (by its storage address) under the first attribute path that
reaches it, and sums the bytes by that path cut to `depth` names. Tensors that are alive
but not reachable from the root (a running thread's locals, autograd's saved tensors)
appear as `unowned`, found through the garbage collector's list of live tensors.

Read-only and best effort: other threads may change containers during the walk, so a
container that changes under it is skipped, never an error. Enabled in a peer by the
`P2PDILOCO_MEMORY_CENSUS` environment variable (a `memory` event after an applied round,
at most every 30 s; `bench_memory --census`).
"""

from __future__ import annotations

import gc
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from p2pdiloco.peer.heap import heap_free_bytes

MiB = 1 << 20
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.FrameType, str, int, float, bool, complex, type(None))  # fmt: skip
_BUFFERS = (bytes, bytearray, memoryview)


def _storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a CPU tensor's storage; None for storages we cannot read."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # meta, sparse or functional tensors
        return None


def _buffer_of(buffer: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(identity, bytes) of a byte buffer: a memoryview counts its underlying object."""
    if isinstance(buffer, memoryview):
        owner = buffer.obj
        size = len(owner) if isinstance(owner, bytes | bytearray) else buffer.nbytes
        return id(owner), size
    return id(buffer), len(buffer)


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(name, child) pairs of a container or an object's attributes."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            label = key if isinstance(key, str | int) else type(key).__name__
            yield f"[{label}]", value
            if isinstance(key, torch.Tensor):  # optimizer state is keyed by parameters
                yield "[key]", key
    elif isinstance(obj, list | tuple | deque | set | frozenset):
        for index, value in enumerate(list(obj)):
            yield f"[{index}]", value
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in list(attrs.items()):
                yield f".{key}", value
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                yield f".{slot}", getattr(obj, slot)


def _cut(path: str, depth: int) -> str:
    """The path's first `depth` names ('.a[b].c' -> '.a[b]' at depth 2), indices as [*]."""
    names, current = [], ""
    for char in path:
        if char in ".[" and current:
            names.append(current)
            current = ""
        current += char
    names.append(current)
    cut = [("[*]" if n.startswith("[") and n[1:-1].isdigit() else n) for n in names[:depth]]
    return "".join(cut)


def census(root: Any, *, depth: int = 3, min_bytes: int = 64 << 10, max_objects: int = 2_000_000) -> dict[str, Any]:
    """Bytes of tensor storages and byte buffers reachable from `root`, by owner path."""
    seen_objects: set[int] = set()
    counted: set[int] = set()
    by_owner: dict[str, int] = {}
    queue: deque[tuple[str, Any]] = deque([("", root)])
    visited = 0
    while queue and visited < max_objects:
        path, obj = queue.popleft()
        if id(obj) in seen_objects or isinstance(obj, _SKIP):
            continue
        seen_objects.add(id(obj))
        visited += 1
        found = None
        if isinstance(obj, torch.Tensor):
            found = _storage_of(obj)
            if obj.grad is not None:
                queue.append((f"{path}.grad", obj.grad))
        elif isinstance(obj, _BUFFERS):
            found = _buffer_of(obj)
        if found is not None:
            address, size = found
            if size >= min_bytes and address not in counted:
                counted.add(address)
                owner = _cut(path, depth) or "(root)"
                by_owner[owner] = by_owner.get(owner, 0) + size
            continue
        try:
            queue.extend((path + name, child) for name, child in _children(obj))
        except (RuntimeError, TypeError, ReferenceError):  # changed under us, or not walkable
            continue
    unowned = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # isinstance would wake lazy deprecated objects
            found = _storage_of(obj)
            if found and found[1] >= min_bytes and found[0] not in counted:
                counted.add(found[0])
                unowned += found[1]
    owned = sum(by_owner.values())
    top = dict(sorted(by_owner.items(), key=lambda kv: -kv[1]))
    return {"owned_bytes": owned, "unowned_tensor_bytes": unowned, "by_owner": top, "objects": visited}


ENV_VAR = "P2PDILOCO_MEMORY_CENSUS"
"""Set (to anything but "" or "0") to have a peer emit `memory` events (`CensusOnEvent`)."""


def status_bytes(field: str = "VmRSS", pid: int | str = "self") -> int | None:
    """A memory line of Linux's `/proc/PID/status` in bytes (`VmRSS`: resident now, `VmHWM`:
    its peak); None where there is no such file (another OS, a process that exited)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CensusOnEvent:
    """Takes a census of `root` in a daemon thread when asked, at most one at a time and
    one every `min_interval_s`; asks that come meanwhile are dropped. A census of a `150m`
    peer walks millions of objects, so it stays off the thread that applies rounds."""

    def __init__(self, root: Any, emit: Callable[[dict], None], min_interval_s: float = 30.0) -> None:
        self.root = root
        self.emit = emit
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._busy = False
        self._last = float("-inf")

    def request(self, fragment: int, round_index: int) -> bool:
        """Start a census unless one runs or ran less than `min_interval_s` ago."""
        with self._lock:
            now = time.monotonic()
            if self._busy or now - self._last < self.min_interval_s:
                return False
            self._busy, self._last = True, now
        threading.Thread(target=self._take, args=(fragment, round_index), name="census", daemon=True).start()
        return True

    def _take(self, fragment: int, round_index: int) -> None:
        try:
            started = time.monotonic()
            found = census(self.root, depth=2)
            self.emit({"event": "memory", "fragment": fragment, "round": round_index,
                       "rss_bytes": status_bytes(), "heap_free_bytes": heap_free_bytes(),
                       "census_s": round(time.monotonic() - started, 2), **found})  # fmt: skip
        finally:
            with self._lock:
                self._busy = False
