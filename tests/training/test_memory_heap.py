"""The heap of a CPU training run: :func:`scpdr.training.memory.trim_heap` hands freed heap pages
back to the system (glibc), where plain ``free`` keeps them resident."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from scpdr.training.memory import trim_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap"
)


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_heap_blocks_go_back_to_the_system_only_when_trimmed():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    size, n = 64 * 1024, 1600  # 100 MiB in blocks below the mmap threshold: on the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for b in blocks[:-1]:  # the last block pins the heap's top: free alone returns nothing
        libc.free(b)
    before = _rss_bytes()
    assert trim_heap(collect=True)
    after = _rss_bytes()
    libc.free(blocks[-1])
    assert before - after > 0.8 * size * (n - 1)  # the freed 100 MiB left the process
