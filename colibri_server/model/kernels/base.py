"""The kernels' base: the threading layer (chosen before any parallel kernel compiles), the
f16/bf16 bit loads (to_f32), expf, and the shape helpers every family uses.

Conventions (shared by every kernel module, and with the rest of the project):

* Activations are float32, C-contiguous.
* Weights are (usually read-only, mmap-backed) numpy arrays of one of three
  dtypes, and the dtype alone selects the conversion to float32:

  - ``float32`` -> float32 weights;
  - ``uint16``  -> IEEE float16 bit patterns (Numba has no CPU float16);
  - ``int16``   -> bfloat16 bit patterns (the upper half of a float32).

* :func:`to_f32` is the single generic scalar loader; every kernel is written
  once on top of it and Numba specialises it per weight dtype.  The f16 path
  is an LLVM ``bitcast i16 -> half; fpext half -> float`` which vectorises to
  ``vcvtph2ps``; the bf16 path is ``zext; shl 16; bitcast``.
* Kernels do not allocate: outputs and scratch buffers are passed in.
* Every kernel ``foo`` has a numpy twin ``foo_ref`` (simple, obviously correct,
  used by the tests).  Twins take f16/bf16 weights as uint16/int16 as well and
  convert them with :func:`weights_to_f32`.
* ``fastmath`` is only used with ``{"reassoc", "contract"}`` and only on
  functions whose floating point work is a reduction (dot products, sums of
  squares); everything elementwise is compiled without it, so it rounds like
  numpy.  No ``nnan``/``ninf`` anywhere: NaN/inf propagate as in numpy.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .packing import from_panels


def _load_tbb() -> bool:
    """True when Numba's tbb threading layer can load. `pip install tbb` puts libtbb.so.12 in
    <prefix>/lib, outside the loader's path, so it is loaded here by path first."""
    import ctypes
    import sys
    for d in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = os.path.join(d, "lib", "libtbb.so.12")
        if os.path.exists(lib):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                pass
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401  (loads the library, starts no thread)
        return True
    except ImportError:
        return False


# Parallel kernels (threads > 1) run in forked workers, so the layer must be fork-safe (GNU
# OpenMP does not survive a fork once its pool exists). tbb when installed: its workers spin a
# moment before sleeping, so a launch costs microseconds; workqueue wakes sleeping threads
# with a futex, ~50-100 us per launch on a VM, which made 2 threads slower than 1 in decode
# (measured on bench-mixtral f16: 1 thread 67 tok/s, 2 on workqueue 48, 2 on tbb 83).
# Chosen before any parallel kernel compiles, unless the user chose (NUMBA_THREADING_LAYER).
if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "tbb" if _load_tbb() else "workqueue"


def parallel_runtime() -> None:
    """Load the threading layer and register its symbols (allocate_sched, ...) with LLVM, as compiling
    any parallel kernel does. Call it before compiling or loading threaded kernels: a cached function
    that was compiled in a process where its parallel callees came from the cache carries no reload
    hook for them, and loading it where the layer was never loaded aborts the process ("LLVM ERROR:
    Symbol not found: allocate_sched"), seen in a pre-fork master on its second start."""
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()

# Flags for reduction-only functions (needed for LLVM to vectorise the
# floating point reductions; changes only the summation order).
_REDUCE_FM = {"reassoc", "contract"}

# ---------------------------------------------------------------------------
# scalar conversion
# ---------------------------------------------------------------------------


@intrinsic
def _f16_bits_to_f32(typingctx, v):
    """uint16 (IEEE half bits) -> float32, exact (fpext)."""
    if v != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        h = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, v):
    """int16 (bfloat16 bits) -> float32, exact (bf16 = upper half of f32)."""
    if v != types.int16:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        z = builder.zext(args[0], i32)
        s = builder.shl(z, ir.Constant(i32, 16))
        return builder.bitcast(s, ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _i32_bits_to_f32(typingctx, v):
    """int32 bit pattern -> float32 (bitcast)."""
    if v != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_EXP_HI = np.float32(88.72283)       # exp overflows to inf above
_EXP_LO = np.float32(-86.0)          # below: 0 (exp(-86) = 4e-38; numpy gives tiny values down to -103.9)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_RND = np.float32(12582912.0)        # 1.5 * 2^23: (v + R) - R rounds to the nearest integer


@njit(cache=True, inline="always")
def expf(x):
    # float32 exp without a libm call, so loops over it vectorise (Cephes expf: range reduction
    # by ln2, degree-6 polynomial, exponent by bit assembly; no shifts or branches, which would
    # keep LLVM from vectorising); within 1 ulp of np.exp on [-86, 88.7]; +inf -> inf, NaN -> NaN,
    # x < -86 -> 0
    x = np.float32(x)
    xc = min(max(x, _EXP_LO), _EXP_HI)
    n = (xc * _LOG2E + _RND) - _RND                                    # in -124..128
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    # 2^n = 2 * 2^(n-1): the exponent field n + 126 stays in 2..254
    e = (p * np.float32(2.0)) * _i32_bits_to_f32(np.int32(np.int32(np.int32(n) + np.int32(126)) * np.int32(8388608)))
    e = np.float32(np.inf) if x > _EXP_HI else e
    e = np.float32(0.0) if x < _EXP_LO else e
    return e


def to_f32(v):
    """Convert one weight scalar to float32 (pure-Python fallback; in Numba
    code the overload below is used and specialises on the scalar type)."""
    if isinstance(v, np.uint16):
        return np.array(v, dtype=np.uint16).view(np.float16).astype(np.float32)[()]
    if isinstance(v, np.int16):
        return (np.array(v, dtype=np.int16).astype(np.uint16).astype(np.uint32) << 16).view(
            np.float32
        )[()]
    return np.float32(v)


@overload(to_f32, inline="always")
def _to_f32_overload(v):
    if v == types.uint16:
        return lambda v: _f16_bits_to_f32(v)
    if v == types.int16:
        return lambda v: _bf16_bits_to_f32(v)
    if v == types.float32:
        return lambda v: v
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    return None


def weights_to_f32(w: np.ndarray) -> np.ndarray:
    """numpy twin of the conversion (tests / reference code only); a panels.Panels gives its
    logical (row-major) matrix."""
    if hasattr(w, "p"):
        w = from_panels(w.p)
    w = np.asarray(w)
    if w.dtype == np.float32:
        return w
    if w.dtype == np.uint16:
        return w.view(np.float16).astype(np.float32)
    if w.dtype == np.int16:
        return (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if w.dtype == np.float16:  # convenience for callers holding real f16
        return w.astype(np.float32)
    raise TypeError(f"unsupported weight dtype {w.dtype}")


# ---------------------------------------------------------------------------
# matrix shape helpers (row-major (d,n) or panels (nb,d,P))
# ---------------------------------------------------------------------------


def nrows(W):
    raise NotImplementedError           # Numba only: rows of a matrix, row-major (d,n) or panels (nb,d,P)


@overload(nrows)
def _nrows_overload(W):
    if isinstance(W, types.Array) and W.ndim == 3:
        return lambda W: W.shape[1]
    return lambda W: W.shape[0]


def row_slice(W, r0, r1):
    raise NotImplementedError           # Numba only: rows r0:r1 of a row-major or a panel matrix


@overload(row_slice)
def _row_slice_overload(W, r0, r1):
    if isinstance(W, types.Array) and W.ndim == 3:
        return lambda W, r0, r1: W[:, r0:r1]
    return lambda W, r0, r1: W[r0:r1]


@njit(cache=True)
def _max_finite(x):
    # x (n,) f32, n >= 1, no NaN -> max(x); 8 independent lanes (LLVM will not
    # vectorise a float max reduction for Numba, and the SLP pass is off)
    n = x.shape[0]
    m0 = x[0]
    m1 = m0
    m2 = m0
    m3 = m0
    m4 = m0
    m5 = m0
    m6 = m0
    m7 = m0
    n8 = n - n % 8
    for j in range(0, n8, 8):
        m0 = max(m0, x[j])
        m1 = max(m1, x[j + 1])
        m2 = max(m2, x[j + 2])
        m3 = max(m3, x[j + 3])
        m4 = max(m4, x[j + 4])
        m5 = max(m5, x[j + 5])
        m6 = max(m6, x[j + 6])
        m7 = max(m7, x[j + 7])
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for j in range(n8, n):
        m = max(m, x[j])
    return m

