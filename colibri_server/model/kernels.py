"""Numba CPU kernels for colibri-server, each with a plain-numpy twin.

Conventions (shared with the rest of the project):

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
from concurrent.futures import wait

import numba
import numpy as np
from llvmlite import ir
from numba import literal_unroll, njit, types
from numba.extending import intrinsic, overload



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

__all__ = [
    "to_f32",
    "weights_to_f32",
    "rmsnorm",
    "rmsnorm_ref",
    "rmsnorm_heads",
    "rmsnorm_heads_ref",
    "matvec",
    "matvec_ref",
    "rows_to_f32",
    "rows_to_f32_ref",
    "matmul",
    "matmul_ref",
    "embed",
    "embed_ref",
    "rope",
    "rope_ref",
    "attention",
    "attention_ref",
    "silu_mul",
    "silu_mul_ref",
    "route",
    "route_ref",
    "group_by_expert",
    "group_by_expert_ref",
    "expert_ffn",
    "expert_ffn_ref",
    "argmax",
    "argmax_ref",
]

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
        w = _panels.from_panels(w.p)
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
# rmsnorm
# ---------------------------------------------------------------------------


@njit(cache=True, fastmath=_REDUCE_FM)
def _sumsq(v):
    # v (n,) f32 -> sum(v*v) as float32 (vectorised reduction)
    s = np.float32(0.0)
    for j in range(v.shape[0]):
        s += v[j] * v[j]
    return s


@njit(cache=True)
def rmsnorm(x, w, eps, out):
    # x (T,D) f32, w (D,) f32, eps -> out (T,D) = w * (x * rsqrt(mean(x^2) + eps)); out may alias x
    T, D = x.shape
    epsf = np.float32(eps)
    for t in range(T):
        xt = x[t]
        ot = out[t]
        var = _sumsq(xt) / np.float32(D)
        inv = np.float32(1.0) / np.sqrt(var + epsf)
        for j in range(D):
            ot[j] = w[j] * (xt[j] * inv)


def rmsnorm_ref(x, w, eps, out=None):
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    inv = np.float32(1.0) / np.sqrt(var + np.float32(eps))
    r = (w.astype(np.float32) * (x * inv)).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


def rmsnorm_heads(x, w, eps, out):
    """x (T,H,hd) f32, w (hd,) -> out (T,H,hd): rmsnorm of each head over hd
    (Qwen3 q/k norm).  Thin wrapper: reshapes to 2-D and calls rmsnorm."""
    T, H, hd = x.shape
    rmsnorm(x.reshape(T * H, hd), w, eps, out.reshape(T * H, hd))


def rmsnorm_heads_ref(x, w, eps, out=None):
    return rmsnorm_ref(x, w, eps, out)


# ---------------------------------------------------------------------------
# matvec family
# ---------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _store(out, i, a, alpha, accumulate):
    # out[i] = alpha*a, or += when accumulate
    if accumulate:
        out[i] += alpha * a
    else:
        out[i] = alpha * a


@njit(cache=True, fastmath=_REDUCE_FM)
def _matvec_core(W, x, out, alpha, accumulate):
    # W (d,n) any, x (n,) f32 -> out (d,) = alpha * W@x (+ out if accumulate); one row at a time
    # (measured on this VM: one sequential stream reads at ~95% of the bandwidth, 8 interleaved
    # row streams at ~70%; LLVM keeps 4 vector accumulators per row, so the FMAs do not stall)
    # W may also be a panel array (nb,d,PANEL) of an f16p/bf16p matrix (panels.py)
    if _KF.float_rows(W, x, out, alpha, accumulate):     # f16/bf16 on AVX-512: the row loop in IR
        return
    _matvec_loop(W, x, out, alpha, accumulate)


@njit(cache=True, fastmath=_REDUCE_FM)
def _rows_loop(W, x, out, alpha, accumulate):
    d, n = W.shape
    for i in range(d):
        r = W[i]
        a = np.float32(0.0)
        for j in range(n):
            a += to_f32(r[j]) * x[j]
        _store(out, i, a, alpha, accumulate)


@njit(cache=True, fastmath=_REDUCE_FM)
def _panels_loop(W, x, out, alpha, accumulate):
    # W (nb,d,P) panels: row i is W[0,i] | W[1,i] | ...
    nb, d, P = W.shape
    for i in range(d):
        a = np.float32(0.0)
        for b in range(nb):
            r = W[b, i]
            for j in range(P):
                a += to_f32(r[j]) * x[b * P + j]
        _store(out, i, a, alpha, accumulate)


def _matvec_loop(W, x, out, alpha, accumulate):
    raise NotImplementedError           # Numba only: the overload picks the loop by W's rank


@overload(_matvec_loop)
def _matvec_loop_overload(W, x, out, alpha, accumulate):
    if isinstance(W, types.Array) and W.ndim == 3:
        return lambda W, x, out, alpha, accumulate: _panels_loop(W, x, out, alpha, accumulate)
    return lambda W, x, out, alpha, accumulate: _rows_loop(W, x, out, alpha, accumulate)


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
def matvec(W, x, out):
    # W (d,n) f32|u16(f16)|i16(bf16), x (n,) f32 -> out (d,) f32 = W @ x
    # asm (znver3, AVX2): hot loop = 1 row x 32 cols, 4 ymm accumulators; f32 vfmadd231ps ymm,mem; f16 vcvtph2ps mem->ymm + vfmadd231ps; bf16 vpmovzxwd + vpslld $16 + vfmadd231ps
    _matvec_core(W, x, out, np.float32(1.0), False)


@njit(cache=True)
def matvec_stack(Ws, x, out):
    # (W_0, W_1, ..) (d_k,n) of one type (f16/bf16 rows or panels), x (n,) f32 -> out (sum d_k,) = rows stacked @ x;
    # decode's q|k|v: on AVX2 their rows stream together (kernels_float), else one matvec each, same bits per row
    if _KF.float_rows_stack(Ws, x, out, np.float32(1.0), False):
        return
    o = 0
    for W in literal_unroll(Ws):                     # a tuple of mixed array types too
        d = nrows(W)
        _matvec_core(W, x, out[o:o + d], np.float32(1.0), False)
        o += d


def matvec_ref(W, x, out=None):
    r = (weights_to_f32(W).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


@njit(cache=True, nogil=True)      # nogil: matmul_par's threads convert tiles side by side
def rows_to_f32(W, r0, r1, out):
    # W (d,n) any, rows r0:r1 -> out (r1-r0, n) f32
    n = W.shape[1]
    for i in range(r0, r1):
        src = W[i]
        dst = out[i - r0]
        for j in range(n):
            dst[j] = to_f32(src[j])


@njit(cache=True, nogil=True)
def panel_rows_to_f32(W, r0, r1, out):
    # W (nb,d,P) panels, rows r0:r1 -> out (r1-r0, nb*P) f32 (the same rows as rows_to_f32 of the matrix)
    nb, _, P = W.shape
    for i in range(r0, r1):
        dst = out[i - r0]
        for b in range(nb):
            src = W[b, i]
            for j in range(P):
                dst[b * P + j] = to_f32(src[j])


def rows_to_f32_ref(W, r0, r1, out=None):
    r = np.ascontiguousarray(weights_to_f32(W[r0:r1]))
    if out is not None:
        out[...] = r
    return r


def matmul(X, W, out, scratch, tmp=None):
    """X (T,n) f32, W (d,n) any, a quant.QTensor or a panels.Panels -> out (T,d) f32 = X @ W.T.

    Plain Python. f32 weights go straight to BLAS; f16/bf16/quantized weights are
    converted tile by tile (``scratch`` (tile_rows, n) f32, e.g. 256 rows) and each
    tile is multiplied with BLAS into ``tmp`` (T, tile_rows) (allocated when not
    given), then copied into ``out[:, r0:r1]``. Quantized weights on AVX2 or AVX-512 VNNI take the
    integer GEMM of kernels_gemm instead (the same arithmetic as the matvec kernels). T == 1
    uses the matvec kernels (no
    conversion pass, streams the weights once; the quantized ones take their xs/xi scratch
    from the two ends of ``scratch``)."""
    T, n = X.shape
    q = getattr(W, "q", None)
    d = _check_shapes(X, W, out)
    if q is None and W.dtype == np.float32:
        np.matmul(X, W.T, out=out)
        return out
    pan = W.p if hasattr(W, "p") else None             # a matrix stored in panels
    if T == 1:
        if q is None:
            matvec(W if pan is None else pan, X[0], out[0])
        else:
            flat = scratch.reshape(-1)
            ni, nf = _KQ.xi_len(n), _KQ.scratch_len(n)
            if flat.size >= nf + ni // 2 + 1:
                xs, xi = flat[:nf], flat[-(ni // 2 + 1):].view(np.int16)[:ni]
            else:                                       # a scratch too small for both (tiny n)
                xs, xi = _KQ.scratch(n)
            _KQ.matvec_q(q, W.s, X[0], out[0], xs, xi)
        return out
    if q is not None and _GEMM.HAVE_GEMM:              # integer GEMM, no float tiles (kernels_gemm)
        (_GEMM.matmul_q4_i8 if q.dtype == np.uint8 else _GEMM.matmul_q8_i16)(q, W.s, X, out)
        return out
    _check_tile(scratch, n)
    return _tiles(X, W, out, scratch, tmp, 0, d)


def _check_shapes(X, W, out):
    """W's row count, after checking X (T,n) @ W (d,n).T -> out (T,d)."""
    q = getattr(W, "q", None)
    d = W.shape[0] if q is None else q.shape[0]
    if (W.shape[1] if q is None else W.s.shape[1]) != X.shape[1] or out.shape != (X.shape[0], d):
        raise ValueError(f"matmul shapes: X {X.shape}, W {W.shape}, out {out.shape}")
    return d


def _check_tile(scratch, n):
    if scratch.shape[0] < 1 or scratch.shape[1] != n:
        raise ValueError(f"matmul scratch shape {scratch.shape} for n={n}")


def _tiles(X, W, out, scratch, tmp, r_lo, r_hi):
    """out[:, r_lo:r_hi] = X @ W[r_lo:r_hi].T, W's rows converted to f32 scratch.shape[0] at a
    time from r_lo (f16/bf16 rows or panels, or a quantized matrix) and multiplied with BLAS."""
    T = X.shape[0]
    tile = scratch.shape[0]
    q = getattr(W, "q", None)
    pan = W.p if hasattr(W, "p") else None
    # numpy does not hand a column slice out[:, r0:r1] to sgemm (measured 2.4x
    # slower), so each tile goes through one contiguous (T, tile) temporary.
    if tmp is None or tmp.shape[1] < tile or tmp.shape[0] < T:
        tmp = np.empty((T, tile), np.float32)
    else:
        tmp = tmp.reshape(-1)[:T * tile].reshape(T, tile)
    for r0 in range(r_lo, r_hi, tile):
        r1 = min(r_hi, r0 + tile)
        rows = r1 - r0
        buf = scratch[:rows]
        if pan is not None:
            panel_rows_to_f32(pan, r0, r1, buf)
        elif q is None:
            rows_to_f32(W, r0, r1, buf)
        else:
            _KQ.rows_to_f32_q(q, W.s, r0, r1, buf)
        if rows == tile:
            np.matmul(X, buf.T, out=tmp)
            out[:, r0:r1] = tmp
        else:
            out[:, r0:r1] = np.matmul(X, buf.T)
    return out


def matmul_par(X, W, out, scratches, tmps, pool):
    """matmul of T > 1 rows X with a converted (non-f32) W, its tiles split in len(scratches)
    contiguous runs: the first on this thread, the others on `pool` (a concurrent.futures
    executor), each with its own tile scratch and temporary. Every tile is converted and
    multiplied exactly as matmul does it, so out has the same bits."""
    d = _check_shapes(X, W, out)
    n = X.shape[1]
    for sc in scratches:
        _check_tile(sc, n)
    tile = scratches[0].shape[0]
    ntiles = -(-d // tile)
    k = min(len(scratches), ntiles)
    bounds = [min(d, (ntiles * i // k) * tile) for i in range(k + 1)]
    futs = [pool.submit(_tiles, X, W, out, scratches[i], tmps[i], bounds[i], bounds[i + 1]) for i in range(1, k)]
    try:
        _tiles(X, W, out, scratches[0], tmps[0], bounds[0], bounds[1])
    finally:
        wait(futs)                       # every run done before anything returns or raises: none
    for f in futs:                       # may still write into the workspace afterwards
        f.result()
    return out


def matmul_ref(X, W, out=None):
    Wf = _KQ._dequant(W.q, W.s) if hasattr(W, "q") else weights_to_f32(W)
    r = (np.asarray(X, np.float64) @ Wf.astype(np.float64).T).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


# ---------------------------------------------------------------------------
# embedding
# ---------------------------------------------------------------------------


@njit(cache=True)
def embed(table, ids, out):
    # table (V,D) any, ids (T,) int64 -> out (T,D) f32 = table[ids]
    V, D = table.shape
    for t in range(ids.shape[0]):
        r = ids[t]
        if r < 0 or r >= V:
            raise IndexError("embed: token id out of range")
        src = table[r]
        dst = out[t]
        for j in range(D):
            dst[j] = to_f32(src[j])


def embed_ref(table, ids, out=None):
    r = weights_to_f32(table[np.asarray(ids)]).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


# ---------------------------------------------------------------------------
# rotary embedding (HF rotate_half convention)
# ---------------------------------------------------------------------------


@njit(cache=True)
def rope(x, positions, cos, sin):
    # x (T,H,hd) f32 in place, positions (T,) i64, cos/sin (P, hd//2) f32: HF rotate_half (not interleaved)
    T, H, hd = x.shape
    half = hd // 2
    P = cos.shape[0]
    for t in range(T):
        p = positions[t]
        if p < 0 or p >= P:
            raise IndexError("rope: position out of range of the cos/sin tables")
        c = cos[p]
        s = sin[p]
        for h in range(H):
            v = x[t, h]
            for i in range(half):
                x1 = v[i]
                x2 = v[i + half]
                v[i] = x1 * c[i] - x2 * s[i]
                v[i + half] = x2 * c[i] + x1 * s[i]


def rope_ref(x, positions, cos, sin):
    """Returns a new array (the kernel works in place)."""
    hd = x.shape[-1]
    half = hd // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    r = x.copy()
    r[..., :half] = x1 * c - x2 * s
    r[..., half : 2 * half] = x2 * c + x1 * s
    return r


# ---------------------------------------------------------------------------
# argmax
# ---------------------------------------------------------------------------


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


@njit(cache=True, fastmath={"reassoc"})
def _finite_probe(x):
    # x (n,) f32 -> 0.0 iff every element is finite (x*0 is NaN for NaN/inf)
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        s += x[j] * np.float32(0.0)
    return s


@njit(cache=True)
def argmax(x):
    # x (n,) f32 -> int: first index of the max, same result as np.argmax (incl. NaN: first NaN)
    n = x.shape[0]
    if n == 0:
        raise ValueError("argmax of an empty array")
    if _finite_probe(x) == np.float32(0.0):
        m = _max_finite(x)
        for j in range(n):
            if x[j] == m:
                return j
    # NaN/inf present (or, defensively, no match): exact scalar scan, numpy semantics
    best = 0
    bv = x[0]
    if bv != bv:
        return 0
    for j in range(1, n):
        v = x[j]
        if v != v:
            return j
        if v > bv:
            bv = v
            best = j
    return best


def argmax_ref(x):
    return int(np.argmax(x))


# quantized kernels and attention (they build on the loaders and kernels above)
from .kernels_moe import (  # noqa: E402,F401
    _matvec_pair_par, _matvec_par, _silu_mul_1d, expert_ffn, expert_ffn_par, expert_ffn_ref, group_by_expert,
    group_by_expert_ref, matvec_par, matvec_qkv_par, route, route_ref, silu_mul, silu_mul_ref)
from . import kernels_float as _KF  # noqa: E402
from . import kernels_quant as _KQ  # noqa: E402
from . import panels as _panels  # noqa: E402
from . import kernels_gemm as _GEMM  # noqa: E402
from .kernels_attention import attend, attention, attention_par, attention_ref  # noqa: E402,F401
