"""Allocation of the run state's arrays: aligned to a cache line, or lazily backed.

A decode matvec streams its weight rows from memory and reads the activation vector
from L1 on every 64-byte step. numpy's large allocations start 16 bytes into a page, so
every zmm load of such a vector straddles two cache lines. Measured on this Zen 4 VM:
the f16 output head (65.5 MB) streamed at 22.4 GB/s with a 16-byte-aligned input vector
and at 27-28 GB/s with a 64-byte-aligned one, in the same decode loop.
"""
from __future__ import annotations

import mmap

import numpy as np

ALIGN = 64          # one cache line, one AVX-512 register


def aligned_zeros(shape, dtype=np.float32, align: int = ALIGN) -> np.ndarray:
    """Zeros whose first element sits on an `align`-byte boundary (rows of a 2-D array are
    aligned too when a row's byte length is a multiple of `align`)."""
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.zeros(n * dt.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n * dt.itemsize].view(dt).reshape(shape)


def lazy_zeros(shape, dtype=np.float32) -> np.ndarray:
    """Zeros in their own anonymous mapping (page aligned): pages cost memory only once
    written, whatever malloc's thresholds (a calloc from the heap may touch every page)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
