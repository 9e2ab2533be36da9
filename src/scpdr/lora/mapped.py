"""Whether a tensor's memory is still a safetensors checkpoint's own bytes, told without reading
the tensor (Linux ``/proc/self/maps`` and ``/proc/self/pagemap``).

Why: the fast path re-lays out each base weight from a copy read from the checkpoint, so that
the model's own memory-mapped weight is never paged in (:func:`scpdr.lora.layers.
matching_source`). Checking that copy against the module by reading a few of the module's rows
pages in the module's mapping around them, and with the page cache's large folios (Linux 6.x)
each read maps up to 2 MiB of the file: for SmolLM2-135M's 211 linears, 219 MiB of the
checkpoint stayed resident in the serving process for its whole life (Intel Xeon, Linux 6.18;
peak RSS 1.31 GB against 0.96 GB for one model). A module weight that *is* the checkpoint's
bytes needs no such check: its address lies in a mapping of the same file (same device and
inode) at the tensor's offset in it, with its dtype and shape, and no page of it has been
written since (a write to a private file mapping leaves an anonymous page in its place, which
``pagemap`` reports without touching it).

:func:`holds` answers True only when all of that is established; False when the tensor is a
view of the file whose pages were written (the module's weight differs from the file: the
checkpoint's copy must not be used); None when it cannot tell (not Linux, not a file view of
that tensor, anything unreadable), where callers fall back to reading.
"""

from __future__ import annotations

import json
import os
import struct
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["holds", "tensor_offsets"]

#: safetensors dtype names of the floating dtypes the fast path re-lays out
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# /proc/self/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61


@lru_cache(maxsize=16)
def _header(path: str, mtime_ns: int, size: int) -> dict[str, tuple[int, int, str, tuple]]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    start = 8 + n
    return {
        key: (
            start + v["data_offsets"][0],
            start + v["data_offsets"][1],
            v["dtype"],
            tuple(v["shape"]),
        )
        for key, v in header.items()
        if key != "__metadata__"
    }


def tensor_offsets(path: str | os.PathLike[str]) -> dict[str, tuple[int, int, str, tuple]]:
    """``{key: (first byte, end byte, safetensors dtype, shape)}`` of a safetensors file, the
    byte offsets absolute in the file (read from its header; cached per file version)."""
    p = os.path.realpath(os.fspath(path))
    st = os.stat(p)
    return _header(p, st.st_mtime_ns, st.st_size)


def _mapping_of(addr: int, end: int) -> tuple[int, int, int, int, str] | None:
    """``(mapping start, file offset of the start, device, inode, path)`` of the mapping holding
    ``[addr, end)`` whole, or None."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                if end > hi or len(parts) < 6:
                    return None
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                return (
                    lo,
                    int(parts[2], 16),
                    os.makedev(major, minor),
                    int(parts[4]),
                    parts[5].rstrip("\n"),
                )
    return None


def _written(addr: int, end: int) -> bool:
    """Whether any page of ``[addr, end)`` is anonymous now (present but not a file page, or
    swapped out): written since it was mapped from its file."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = addr // page, (end - 1) // page
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for lo in range(first, last + 1, 1 << 16):  # 512 KiB of entries at a time
            hi = min(last + 1, lo + (1 << 16))
            raw = os.pread(fd, (hi - lo) * 8, lo * 8)
            if len(raw) != (hi - lo) * 8:
                raise OSError("short read of /proc/self/pagemap")
            for (entry,) in struct.iter_unpack("<Q", raw):
                # anonymous: present or swapped out, and not a file page (a file page being
                # migrated shows as swapped *and* file: not written)
                if entry & (_PRESENT | _SWAPPED) and not entry & _FILE:
                    return True
    finally:
        os.close(fd)
    return False


def holds(t: Tensor, path: str | os.PathLike[str], key: str) -> bool | None:
    """Whether CPU tensor ``t`` is the unwritten memory map of tensor ``key`` of the safetensors
    file ``path`` (same file, offset, dtype and shape): True, False (it is that view, but some
    of its pages were written since), or None (cannot tell: see the module docstring). Reads
    only the file's header and the process's maps and page table, never ``t``."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    try:
        meta = tensor_offsets(path).get(key)
        if meta is None:
            return None
        first, end_byte, dtype, shape = meta
        if _DTYPES.get(dtype) != t.dtype or shape != tuple(t.shape):
            return None
        nbytes = t.numel() * t.element_size()
        if end_byte - first != nbytes:
            return None
        addr = t.data_ptr()
        found = _mapping_of(addr, addr + nbytes)
        if found is None:
            return None
        lo, offset, dev, inode, name = found
        real = os.path.realpath(os.fspath(path))
        st = os.stat(real)
        # the same file: device and inode, or (btrfs subvolumes, overlayfs before Linux 6.8,
        # where maps names another device) the same inode under the same path
        same = (dev, inode) == (st.st_dev, st.st_ino) or (inode == st.st_ino and name == real)
        if not same or offset + (addr - lo) != first:
            return None
        return not _written(addr, addr + nbytes)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
