"""Releasing a file mapping that numpy views still export.

Python's mmap refuses to close while a buffer taken from it is alive, and a .colibri file's views live
in the model's weights, its fused-token tuples and its workspace: objects in reference cycles, which
only the cyclic collector frees, and which a master's gc.freeze() (its first generation) keeps for good.
A closed generation's mapping then stayed, one per reload: its pages mapped, their mlocks held, a
replaced file's disk space kept. release() replaces the range with an anonymous PROT_NONE reservation
in place (MAP_FIXED): the file goes at once, a stray read of a dead view faults rather than reading
anything, and the range is unmapped when the Python mmap object is freed with the last view.
"""
from __future__ import annotations

import ctypes
import mmap

_MAP_FIXED, _MAP_NORESERVE, _PROT_NONE = 0x10, 0x4000, 0


def release(addr: int, size: int) -> bool:
    """Replace the mapping at [addr, addr + size) by an inaccessible reservation. False if the kernel refuses
    (the mapping then stays until its last view goes, as Python's mmap leaves it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    return libc.mmap(addr, size, _PROT_NONE, flags, -1, 0) == addr
