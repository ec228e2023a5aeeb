"""host/trim.py: what compiling the kernels left behind is given back before the workers fork."""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

PAGE = mmap.PAGESIZE


def _cached_pages(path: str) -> int:
    """Pages of `path` in the page cache (mincore on a fresh mapping, which faults nothing in)."""
    n = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = np.zeros((n + PAGE - 1) // PAGE, np.uint8)
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), ctypes.c_void_p(vec.ctypes.data)) == 0
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))
        return int(np.count_nonzero(vec & 1))
    finally:
        os.close(fd)


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_PAGEOUT is Linux's")
def test_page_out_drops_a_library_only_this_process_maps(tmp_path):
    lib = tmp_path / "libexample-compiler.so"
    lib.write_bytes(os.urandom(64 * PAGE))
    with open(lib, "rb+") as f:         # clean and out of the cache: the child's faults read it, as a library's are
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    # a child maps it read-only and executable as the loader would, touches every page, pages it out; on one
    # CPU: a page just faulted in waits in that CPU's LRU batch, which madvise drains only where it runs
    code = f"""
import mmap, os, sys
from colibri_server.host import trim
os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[0]])
f = open({str(lib)!r}, "rb")
mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC)
sum(mm[i] for i in range(0, len(mm), mmap.PAGESIZE))
before = len(trim._library_ranges(("libexample-compiler",)))
if sys.argv[1] == "out":
    trim.page_out(("libexample-compiler",))
print(before)
input()                                  # the mapping stays while the parent looks
"""
    for mode, expect_gone in (("keep", False), ("out", True)):
        p = subprocess.Popen([sys.executable, "-c", code, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout.readline().strip() == "1"           # the mapping was found by name
            cached = _cached_pages(str(lib))
        finally:
            p.communicate("\n", timeout=30)
        if expect_gone:
            assert cached < 8, f"{cached} of 64 pages still cached after MADV_PAGEOUT"
        else:
            assert cached == 64


def test_trim_leaves_the_kernels_callable_and_a_compile_working():
    code = """
import numpy as np
from numba import njit
from colibri_server.host import trim
@njit(cache=False)
def twice(x):
    return x * 2
assert twice(np.arange(3)).tolist() == [0, 2, 4]
assert trim._library_ranges(), "llvmlite's library not found among the mappings"
assert trim.trim() >= 0
assert twice(np.arange(3)).tolist() == [0, 2, 4]
@njit(cache=False)
def thrice(x):                 # a compile after the library was paged out reads it back
    return x * 3
assert thrice(np.arange(3)).tolist() == [0, 3, 6]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
