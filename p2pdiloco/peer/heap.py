"""What the C heap holds free: resident memory that no live object uses.

glibc's malloc keeps freed chunks in its arenas, and its mmap threshold grows to 32 MiB
after the first large free, so mid-sized tensors (a `150m` weight is at most 11 MiB) come
from those arenas and their pages may stay resident after the tensor is gone. A peak RSS
counts them; the memory model does not. A peer reports this figure in its summary so a
run can tell fragmentation from memory that is really held.
"""

from __future__ import annotations

import ctypes

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
           "fordblks", "keepcost")  # fmt: skip


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def heap_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in all its arenas now; None without glibc >= 2.33."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    mallinfo2.restype = _Mallinfo2
    mallinfo2.argtypes = []
    return int(mallinfo2().fordblks)
