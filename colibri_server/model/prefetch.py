"""A worker's reader thread: faults ranges of the model file in ahead of the layer that needs them.

madvise(MADV_WILLNEED) reads a range through the kernel's forced readahead, which fills the page cache
with 4 KiB pages: in a memory limit each is allocated, charged and reclaimed on its own, in the thread
that asks (it blocked the forward pass for about as long as the read took), and the layer then maps
them 4 KiB at a time. Faulting the range in with MADV_POPULATE_READ (Linux 5.14) reads it as a layer's
own faults would: on the model's mapping advised MADV_HUGEPAGE (hugepages.py) each fault reads one
2 MiB folio and maps it whole. A thread of its own does it, so the forward pass goes on while the disk
reads; a layer that reaches a range before the thread does faults it in itself, beside it. (Two or
four such threads gave batch-1 decode at 50% of bench-mixtral f16 nothing: 16.4-17.7 tok/s against
16.8-17.0 with one.)

bench/readahead.py (the file read an expert-sized piece ahead of the one touched, in a memory cgroup of
300 MiB): WILLNEED from the touching thread 1.8-2.0 GB/s, this thread 1.5-4.6 GB/s.

On a mapping without that advice, and where MADV_POPULATE_READ is unknown (before 5.14), ask() asks with
WILLNEED itself, in calls of at most READ_CHUNK: one call reads no more than the device's readahead
window (Linux's force_page_cache_ra: max(read_ahead_kb, max_sectors_kb)), and the rest of a larger range
would be read by the layer's faults, a page at a time under MADV_RANDOM (a 13.6 MiB range in one call
left 41% unread: 233 ms until the layer's faults had it; 2 MiB calls had it in 14 ms).
The thread belongs to the process that started it: a forked child that asks starts its own.
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading

MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
READ_CHUNK = 2 << 20        # bytes of one madvise(WILLNEED): it reads no more than the readahead window

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _supported(advice: int) -> bool:
    """Whether this kernel knows the advice (madvise checks it before it looks at an empty range)."""
    return _libc.madvise(mmap.PAGESIZE, 0, advice) == 0


class Prefetcher:
    """ask(addr, n): have bytes [addr, addr + n) of a mapping (page-aligned addresses) read. With populate
    (the mapping advised 2 MiB pages) and a kernel that has MADV_POPULATE_READ, a daemon thread faults each
    range in, in the order asked, with one call (the GIL released for all of it: the forward pass's kernels
    hold it while they run, so a thread that needed it between 2 MiB pieces would read one piece per
    hand-over); ask() never blocks. Otherwise ask() itself asks WILLNEED in calls of at most READ_CHUNK (a
    thread doing it read 0.09 GB/s in bench/readahead.py: the toucher, holding the GIL, faulted the range
    4 KiB at a time under MADV_RANDOM before the thread could ask). Never raises for what the kernel
    refuses: a range not read is faulted by the layer that needs it."""

    def __init__(self, populate: bool = True):
        self._pid = None
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.populate = populate and _supported(MADV_POPULATE_READ)
        self.busy = 0

    def ask(self, addr: int, n: int) -> None:
        if not self.populate:
            for o in range(addr, addr + n, READ_CHUNK):
                _libc.madvise(o, min(READ_CHUNK, addr + n - o), MADV_WILLNEED)
            return
        if self._pid != os.getpid():                        # first ask here, or a forked child's
            self._cv = threading.Condition()
            self._queue = collections.deque()
            self._pid = os.getpid()
            threading.Thread(target=self._run, name="colibri-prefetch", daemon=True).start()
        with self._cv:
            self._queue.append((addr, n))
            self._cv.notify()

    def idle(self) -> bool:
        """Whether every range asked for has been read (the tests wait on it)."""
        with self._cv:
            return not self._queue and not self.busy

    def _run(self) -> None:
        cv, queue = self._cv, self._queue
        while True:
            with cv:
                while not queue:
                    cv.wait()
                o, n = queue.popleft()
                self.busy += 1
            _libc.madvise(o, n, MADV_POPULATE_READ)
            with cv:
                self.busy -= 1
