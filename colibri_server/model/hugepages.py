"""The model mapping on 2 MiB pages: advice, pre-faulting, and how much of it got them.

Decode streams the whole of the active weights every token; on 4 KiB pages a core walks
page tables as it goes. Linux (6.x, ext4/xfs) keeps a file's page cache in large folios
when it reads the file with readahead, and maps a 2 MiB folio with one page-table entry
(FilePmdMapped in smaps) whatever the THP sysfs mode; pages that entered the cache by a
write (the converter's, a cp) stay 4 KiB folios. Measured on a Zen 3 VM, bench-mixtral f16,
the decode-order matvecs over two copies of one file, alternating, 40 tokens each: 17.06
GB/s with the copy 954 of 955 MiB PMD-mapped against 15.89 with none (1.064x).

So: advise MADV_HUGEPAGE before faulting (readahead then allocates 2 MiB folios), fault
with MADV_POPULATE_READ, then read again once the parts of a large file that came back on
small pages: in our mapping, zap them (MADV_DONTNEED), drop them from the page cache
(POSIX_FADV_DONTNEED: only pages nobody maps; dirty or mapped ones stay) and fault them
again. Which 2 MiB pieces are small comes from the PAGEMAP_SCAN ioctl (Linux >= 6.7, no
privilege: categories only, never frame numbers); without it, the whole file is read again
when smaps counts less than half of it on 2 MiB pages. Small pieces appear when part of the
file was evicted and came back through read() or a mapping without the advice (after a
20-minute bench run, 738 of bench-mixtral's 955 MiB were still on 2 MiB pages). The page cache stays one shared copy either way.
Everything here is best effort: a kernel or filesystem without it leaves 4 KiB pages.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

__all__ = ["advise", "populate", "address", "pmd_mapped", "small_pieces", "gaps", "rehome", "drop_cached",
           "MIN_RECACHE", "PMD_SIZE"]

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)     # Linux >= 5.14
MIN_RECACHE = 64 << 20          # smaller files: too little to gain for a re-read
PMD_SIZE = 2 << 20              # what one page-table entry maps on x86-64 and arm64 (4 KiB base pages)


def advise(mm: mmap.mmap) -> bool:
    """Ask for 2 MiB pages on the mapping; False where the kernel refuses or lacks it."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (AttributeError, OSError, ValueError):
        return False


def populate(mm: mmap.mmap, size: int, start: int = 0) -> None:
    """Fault the mapping's bytes [start, start + size) in (read), as MAP_POPULATE would, after
    the advice."""
    try:
        mm.madvise(MADV_POPULATE_READ, start, size)
        return
    except (AttributeError, OSError, ValueError):
        pass
    import numpy as np  # older kernels: touch a byte of every page
    buf = np.frombuffer(mm, np.uint8, count=size, offset=start)
    int(buf[::mmap.PAGESIZE].sum(dtype=np.uint64))


def address(mm: mmap.mmap) -> int:
    """The mapping's first address (read-only mappings refuse ctypes' from_buffer; numpy doesn't)."""
    import numpy as np
    return int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)


def pmd_mapped(path: str, start: int | None = None, size: int = 0, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of this process's mappings of `path` mapped with 2 MiB entries (FilePmdMapped), only
    those within [start, start + size) when start is given (one mapping: a reload maps the file twice);
    None where smaps does not say (not Linux, or a kernel without the field)."""
    real = os.path.realpath(path)
    total, mine, seen = 0, False, False
    try:
        with open(smaps) as f:
            for line in f:
                first = line.split(None, 1)[0] if line.strip() else ""
                if "-" in first and not first.endswith(":"):              # a mapping header
                    fields = line.split(None, 5)
                    mine = len(fields) > 5 and fields[5].rstrip("\n") == real
                    if mine and start is not None:
                        mine = start <= int(first.split("-")[0], 16) < start + size
                elif mine and first == "FilePmdMapped:":
                    total += int(line.split()[1]) * 1024
                    seen = True
    except (OSError, ValueError):
        return None
    return total if seen else None


class _ScanArg(ctypes.Structure):        # struct pm_scan_arg, linux/fs.h
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):         # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16   # _IOWR('f', 16, ...)
PAGE_IS_HUGE = 1 << 6                  # the page is mapped by a 2 MiB entry


def small_pieces(start: int, size: int) -> list[tuple[int, int]] | None:
    """The 2 MiB-aligned pieces of this process's mapping [start, start + size) that are not
    mapped with 2 MiB entries, as merged (offset, length) pairs from the mapping's start; only
    whole pieces (the file's tail short of 2 MiB can never be one). None where the kernel has no
    PAGEMAP_SCAN. A mapping that does not start on a 2 MiB boundary cannot use 2 MiB entries: []."""
    if start % PMD_SIZE:
        return []
    end = start + size // PMD_SIZE * PMD_SIZE
    vec = (_Region * 512)()
    huge, pos = [], start
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            while pos < end:
                arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=pos, end=end, vec=ctypes.addressof(vec),
                               vec_len=len(vec), category_mask=PAGE_IS_HUGE, return_mask=PAGE_IS_HUGE)
                n = fcntl.ioctl(f.fileno(), PAGEMAP_SCAN, arg)
                huge += [(r.start, r.end) for r in vec[:n]]
                if n < len(vec) or arg.walk_end <= pos:
                    break
                pos = arg.walk_end
    except OSError:                      # ENOTTY/EINVAL before 6.7, or no /proc
        return None
    return gaps(huge, start, end)


def gaps(huge: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) outside the sorted address runs `huge`, as (offset from start,
    length) pairs, each from and to a 2 MiB boundary."""
    small, at = [], start
    for lo, hi in list(huge) + [(end, end)]:
        lo = min(max(lo // PMD_SIZE * PMD_SIZE, at), end)
        if lo > at:
            small.append((at - start, lo - at))
        at = max(at, min(hi, end))
    return small


def rehome(path: str, mm: mmap.mmap, size: int) -> int | None:
    """After populate(): read the large file's pieces found on small pages again, once (they come
    back on 2 MiB pages where the kernel can). Returns the bytes now mapped on 2 MiB pages (None:
    unknown)."""
    start = address(mm)
    huge = pmd_mapped(path, start, size)
    if huge is None or size < MIN_RECACHE:
        return huge
    pieces = small_pieces(start, size)
    if pieces is None:                   # no per-piece view: the whole file, when mostly small
        pieces = [(0, size)] if huge < size // 2 else []
    if not pieces:
        return huge
    zapped = []
    for off, length in pieces:
        try:
            mm.madvise(mmap.MADV_DONTNEED, off, length)     # our entries: pages we map cannot be dropped
        except (AttributeError, OSError, ValueError):
            break
        zapped.append((off, length))
    if not zapped:
        return huge
    drop_cached(path, zapped)
    for off, length in reversed(zapped):        # last first: a fault's readahead runs forward and would
        populate(mm, length, off)               # fill a later hole with small folios before its turn
    return pmd_mapped(path, start, size)


def drop_cached(path: str, pieces: list[tuple[int, int]] | None = None) -> None:
    """Drop the file's cached pages (in `pieces`, (offset, length) pairs; default all) that no
    process maps and that are clean (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)      # a FIFO put at the path must not block
    except OSError:
        return
    try:
        for off, length in pieces or [(0, 0)]:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass
    finally:
        os.close(fd)


def _install() -> None:
    import sys

    from . import format as fmt
    fmt.use_pages(sys.modules[__name__])     # the module itself: a monkeypatched function is the one called


_install()
