"""Float kernels (f32, f16/bf16 rows or panels): rmsnorm, the matvec family, rows_to_f32,
embed, rope, argmax, each with its numpy twin; conventions in base.py. On AVX-512/AVX2 the f16/bf16
matvec rows run in float_ir's LLVM IR loops, elsewhere in the Numba loops here."""

from __future__ import annotations

import numpy as np
from numba import literal_unroll, njit, types
from numba.extending import overload

from ..numba_link import by_reference
from . import float_ir as _KF
from .base import _REDUCE_FM, _max_finite, nrows, to_f32, weights_to_f32  # noqa: F401

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


@njit(cache=True, fastmath=_REDUCE_FM)
def layernorm(x, w, b, eps, out):
    # x (T,D) f32, w, b (D,) f32 -> out (T,D) = w * (x - mean) / sqrt(var + eps) + b (Phi-MoE); out may alias x
    T, D = x.shape
    epsf = np.float32(eps)
    for t in range(T):
        xt = x[t]
        ot = out[t]
        mean = np.float32(0.0)
        for j in range(D):
            mean += xt[j]
        mean /= np.float32(D)
        var = np.float32(0.0)
        for j in range(D):
            d = xt[j] - mean
            var += d * d
        inv = np.float32(1.0) / np.sqrt(var / np.float32(D) + epsf)
        for j in range(D):
            ot[j] = w[j] * ((xt[j] - mean) * inv) + b[j]


def layernorm_ref(x, w, b, eps):
    x = np.asarray(x, np.float64)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (w * (x - m) / np.sqrt(v + eps) + b).astype(np.float32)


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


@by_reference          # the float matvec under the token, the heads and the general path: compiled once (model/numba_link)
@njit(cache=True, fastmath=_REDUCE_FM)
def _matvec_core(W, x, out, alpha, accumulate):
    # W (d,n) any, x (n,) f32 -> out (d,) = alpha * W@x (+ out if accumulate); one row at a time
    # (measured on this VM: one sequential stream reads at ~95% of the bandwidth, 8 interleaved
    # row streams at ~70%; LLVM keeps 4 vector accumulators per row, so the FMAs do not stall)
    # W may also be a panel array (nb,d,PANEL) of an f16p/bf16p matrix (panels.py)
    if _KF.float_rows(W, x, out, alpha, accumulate):     # f16/bf16 on AVX-512: the row loop in IR
        return
    _matvec_loop(W, x, out, alpha, accumulate)


@by_reference          # the float matvec's rows, under every float kernel: compiled once (model/numba_link)
@njit(cache=True, fastmath=_REDUCE_FM)
def _rows_loop(W, x, out, alpha, accumulate):
    d, n = W.shape
    for i in range(d):
        r = W[i]
        a = np.float32(0.0)
        for j in range(n):
            a += to_f32(r[j]) * x[j]
        _store(out, i, a, alpha, accumulate)


@by_reference          # as _rows_loop, for panels
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


@njit(cache=True)
def matvec(W, x, out):
    # W (d,n) f32|u16(f16)|i16(bf16), x (n,) f32 -> out (d,) f32 = W @ x
    # asm (znver3, AVX2): hot loop = 1 row x 32 cols, 4 ymm accumulators; f32 vfmadd231ps ymm,mem; f16 vcvtph2ps mem->ymm + vfmadd231ps; bf16 vpmovzxwd + vpslld $16 + vfmadd231ps
    _matvec_core(W, x, out, np.float32(1.0), np.bool_(False))


@njit(cache=True)
def matvec_stack(Ws, x, out):
    # (W_0, W_1, ..) (d_k,n) of one type (f16/bf16 rows or panels), x (n,) f32 -> out (sum d_k,) = rows stacked @ x;
    # decode's q|k|v: on AVX2 their rows stream together (kernels/float_ir), else one matvec each, same bits per row
    if _KF.float_rows_stack(Ws, x, out, np.float32(1.0), np.bool_(False)):
        return
    o = 0
    for W in literal_unroll(Ws):                     # a tuple of mixed array types too
        d = nrows(W)
        _matvec_core(W, x, out[o:o + d], np.float32(1.0), np.bool_(False))
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
