"""The heap figure a peer reports: glibc's free bytes, which grow when blocks are freed."""

from __future__ import annotations

import pytest

from p2pdiloco.peer.heap import heap_free_bytes

BLOCK = 64 * 1024
"""Under glibc's default mmap threshold (128 KiB): served from the heap, not mmap."""


@pytest.mark.skipif(heap_free_bytes() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_freed_blocks_below_a_live_one_show_up_as_free_heap() -> None:
    blocks = [bytearray(BLOCK) for _ in range(200)]
    fence = bytearray(BLOCK)  # keeps the freed blocks off the heap's top, so none is trimmed
    before = heap_free_bytes()
    del blocks
    after = heap_free_bytes()
    assert after - before >= 100 * BLOCK, (before, after)
    assert len(fence) == BLOCK
