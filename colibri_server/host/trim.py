"""Giving back what compiling or loading the kernels left behind, once they are ready.

Numba's kernels run as machine code in anonymous memory and call no LLVM function; LLVM's shared
library (llvmlite's libllvmlite.so: ~70 MiB of it touched by a compile or by loading the kernel cache)
is not used again until something compiles. Its touched pages stay in the page cache: mapped
executable, the kernel keeps them on its active list, and in a memory cgroup they are charged beside
the weights (bench/memory_breakdown.py: 69 MiB in the master, none faulted back by decoding). Freed
heap chunks likewise stay mapped until malloc gives them back.

trim() advises MADV_PAGEOUT on the library's read-only mappings (clean file pages: dropped, read back
from disk by a later compile) and asks glibc's malloc_trim to return the heap's free pages. Only pages
this process alone maps are paged out (the kernel skips shared ones), so it is called before forking.
It never fails: where the kernel (before 5.4) or the C library lacks a call, that part is skipped.
"""
from __future__ import annotations

import ctypes
import os

from .memory import rss

MADV_PAGEOUT = 21
LIBRARIES = ("libllvmlite", "libLLVM")     # llvmlite's library, or a system LLVM it links to


def _library_ranges(names=LIBRARIES):
    """[(start, end)] of this process's read-only (code and constants) mappings of the named libraries."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or "w" in parts[1]:
                    continue
                if any(os.path.basename(parts[5].strip()).startswith(n) for n in names):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        pass
    return out


def page_out(names=LIBRARIES) -> None:
    """Advise MADV_PAGEOUT on this process's read-only mappings of the files named (base names starting so)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for lo, hi in _library_ranges(names):
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_PAGEOUT)   # EINVAL before 5.4: kept


def trim() -> int:
    """Page out LLVM's library and trim the malloc heap; returns the resident bytes given back."""
    before = rss(os.getpid())
    page_out()
    trim_heap = getattr(ctypes.CDLL(None), "malloc_trim", None)                      # glibc only
    if trim_heap is not None:
        trim_heap(ctypes.c_size_t(0))
    return max(0, before - rss(os.getpid()))
