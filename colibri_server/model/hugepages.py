"""The model mapping on 2 MiB pages: advice, pre-faulting, and how much of it got them.

Decode streams the whole of the active weights every token; on 4 KiB pages a core walks
page tables as it goes. Linux (6.x, ext4/xfs) keeps a file's page cache in large folios
when it reads the file with readahead, and maps a 2 MiB folio with one page-table entry
(FilePmdMapped in smaps) whatever the THP sysfs mode; pages that entered the cache by a
write (the converter's, a cp) stay 4 KiB folios. Measured on a Zen 3 VM, bench-mixtral f16,
the decode-order matvecs over two copies of one file, alternating, 40 tokens each: 17.06
GB/s with the copy 954 of 955 MiB PMD-mapped against 15.89 with none (1.064x).

So: advise MADV_HUGEPAGE before faulting (readahead then allocates 2 MiB folios), fault
with MADV_POPULATE_READ, and when most of a large file still came back on small pages,
drop the file's unmapped cached pages (POSIX_FADV_DONTNEED: only pages nobody maps; dirty
or mapped ones stay) and read it again. The page cache stays one shared copy either way.
Everything here is best effort: a kernel or filesystem without it leaves 4 KiB pages.
"""
from __future__ import annotations

import mmap
import os

__all__ = ["advise", "populate", "address", "pmd_mapped", "drop_cached", "MIN_RECACHE"]

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)     # Linux >= 5.14
MIN_RECACHE = 64 << 20          # smaller files: too little to gain for a re-read


def advise(mm: mmap.mmap) -> bool:
    """Ask for 2 MiB pages on the mapping; False where the kernel refuses or lacks it."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (AttributeError, OSError, ValueError):
        return False


def populate(mm: mmap.mmap, size: int) -> None:
    """Fault every page of the mapping in (read), as MAP_POPULATE would, after the advice."""
    try:
        mm.madvise(MADV_POPULATE_READ)
        return
    except (AttributeError, OSError, ValueError):
        pass
    import numpy as np                   # older kernels: touch a byte of every page
    buf = np.frombuffer(mm, np.uint8, count=size)
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


def drop_cached(path: str) -> None:
    """Drop the file's cached pages that no process maps and that are clean (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass
    finally:
        os.close(fd)
