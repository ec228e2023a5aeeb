"""The C allocator of a process that computes: freed memory kept for the next step, not given back to the kernel.

A serving step's kernels and numpy take large temporaries from malloc (a MoE layer's gathered rows, their
intermediate activations: megabytes at a 256-row prefill step) and free them before the next layer. glibc's
malloc serves anything above its mmap threshold (128 KiB, raised by each free of such a block up to 32 MiB) with
its own mmap and trims the top of its heap above the trim threshold (twice that) at each free: so the same
megabytes went back to the kernel after each layer and came back as fresh zeroed pages, one page fault a 4 KiB
page. bench-mixtral Q4_K_M on 2 threads (the 2-vCPU Xeon), a 16-sequence prefill of 32-token prompts (3 steps):
42,500 page faults and 343 ms; with both thresholds at 1 GiB, 1,000 faults and 293-298 ms. Decode steps were not
affected (25 faults a step either way). Setting only the trim threshold turns off the mmap threshold's raising and
made decode steps fault 1,000 times each (29.6 ms against 26.9): both are set.

The cost: up to `keep` bytes of freed memory stay in the process between steps (a worker's RSS holds its
largest step's temporaries, as a workspace sized for them would). glibc only; elsewhere nothing changes.
"""
from __future__ import annotations

import ctypes

__all__ = ["KEEP", "keep_freed_memory"]

KEEP = 1 << 30          # bytes: blocks below this come from the heap, and freed ones stay there up to this much
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(keep: int = KEEP) -> bool:
    """Make glibc's malloc serve blocks below `keep` bytes from its heap and keep up to `keep` bytes of freed memory
    for reuse. False where the C library is not glibc or refuses."""
    try:
        libc = ctypes.CDLL(None)               # the C library the process runs on
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    keep = min(int(keep), (1 << 31) - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, keep)) and bool(mallopt(_M_TRIM_THRESHOLD, keep))
