"""Numba kernels for group-quantized weights (layout: quant.py), each with a numpy twin.

A quantized matrix is a pair (q, s): values q (d, n) int8 for q8, or (d, n/2) uint8
for q4 (byte k = column k low nibble | column k + n/2 high nibble, value = nibble - 8),
and f16 scales s (d/G, n) viewed as uint16, W[i, j] = s[i // G, j] * v[i, j].

Decode (matvec): for each group of G rows the scales are folded into the activations
once, xs = s[g] * x (n multiplies per G*n weights), then each row is a dot product of
its integer values with xs: one long inner loop with 8 rows per pass, which LLVM
vectorises to `vpmovsxbd`/`vpmovzxbd` + `vcvtdq2ps` + `vfmadd231ps` (asm checked on
znver3/AVX2). For q4 the offset 8 is taken out once per group: v.xs = u.xs - 8*sum(xs).

Prefill: on AVX2 and AVX-512 VNNI the integer GEMM of kernels/gemm (the same rounding as decode);
elsewhere rows_to_f32 dequantizes a tile of rows for BLAS (kernels.matmul).

Kernels allocate nothing: the scratch xs (n,) f32 is passed in. Parallel variants split
the row groups across Numba threads (prange) and are used only when a Model runs with
threads > 1 (the threading layer: base.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..numba_link import by_reference
from .base import _REDUCE_FM, to_f32
from .buffers import aligned_zeros
from .cpu import HAVE_AVX2
from .moe import _silu_mul_1d
from .quant_ir import ACT_GROUPS, SUMS_MAX, q4_groups_i8, q8_groups_i16

__all__ = ["matvec_q", "matvec_q_ref", "rows_to_f32_q", "rows_to_f32_q_ref", "expert_ffn_q",
           "expert_ffn_q_ref", "matvec_q_par", "matvec_q_qkv_par", "expert_ffn_q_par"]


# ---------------------------------------------------------------------------- scale folding

@njit(cache=True, fastmath=_REDUCE_FM, inline="always")
def _fold(sg, x, xs):
    # sg (n,) u16 f16 scales of one row group, x (n,) f32 -> xs (n,) = sg * x; returns sum(xs)
    tot = np.float32(0.0)
    for j in range(x.shape[0]):
        v = to_f32(sg[j]) * x[j]
        xs[j] = v
        tot += v
    return tot


@njit(cache=True, inline="always")
def _put(out, i, a, alpha, accumulate):
    if accumulate:
        out[i] += alpha * a
    else:
        out[i] = alpha * a


# ---------------------------------------------------------------------------- q8 rows

@njit(cache=True, fastmath=_REDUCE_FM)
def _q8_group(q, xs, out, i0, G, alpha, accumulate):
    # q (d,n) i8, rows i0..i0+G of one group, xs (n,) f32 folded -> out[i] = alpha * q[i].xs (+=)
    n = q.shape[1]
    zero = np.float32(0.0)
    i = i0
    end = i0 + G
    while i + 8 <= end:
        r0 = q[i]
        r1 = q[i + 1]
        r2 = q[i + 2]
        r3 = q[i + 3]
        r4 = q[i + 4]
        r5 = q[i + 5]
        r6 = q[i + 6]
        r7 = q[i + 7]
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        a4 = zero
        a5 = zero
        a6 = zero
        a7 = zero
        for j in range(n):
            xj = xs[j]
            a0 += np.float32(r0[j]) * xj
            a1 += np.float32(r1[j]) * xj
            a2 += np.float32(r2[j]) * xj
            a3 += np.float32(r3[j]) * xj
            a4 += np.float32(r4[j]) * xj
            a5 += np.float32(r5[j]) * xj
            a6 += np.float32(r6[j]) * xj
            a7 += np.float32(r7[j]) * xj
        _put(out, i, a0, alpha, accumulate)
        _put(out, i + 1, a1, alpha, accumulate)
        _put(out, i + 2, a2, alpha, accumulate)
        _put(out, i + 3, a3, alpha, accumulate)
        _put(out, i + 4, a4, alpha, accumulate)
        _put(out, i + 5, a5, alpha, accumulate)
        _put(out, i + 6, a6, alpha, accumulate)
        _put(out, i + 7, a7, alpha, accumulate)
        i += 8
    while i < end:
        r0 = q[i]
        a0 = zero
        for j in range(n):
            a0 += np.float32(r0[j]) * xs[j]
        _put(out, i, a0, alpha, accumulate)
        i += 1


@njit(cache=True, fastmath=_REDUCE_FM)
def _q4_group(q, xs, off, out, i0, G, alpha, accumulate):
    # q (d,n/2) u8 packed, rows i0..i0+G, xs (n,) folded, off = 8*sum(xs) -> out[i] = alpha * (u[i].xs - off)
    h = q.shape[1]
    lo = xs[:h]
    hi = xs[h:]
    zero = np.float32(0.0)
    m = np.int32(15)
    four = np.int32(4)
    i = i0
    end = i0 + G
    while i + 4 <= end:
        r0 = q[i]
        r1 = q[i + 1]
        r2 = q[i + 2]
        r3 = q[i + 3]
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        c0 = zero
        c1 = zero
        c2 = zero
        c3 = zero
        for k in range(h):
            lk = lo[k]
            hk = hi[k]
            b0 = np.int32(r0[k])
            b1 = np.int32(r1[k])
            b2 = np.int32(r2[k])
            b3 = np.int32(r3[k])
            a0 += np.float32(np.int32(b0 & m)) * lk
            c0 += np.float32(np.int32(b0 >> four)) * hk
            a1 += np.float32(np.int32(b1 & m)) * lk
            c1 += np.float32(np.int32(b1 >> four)) * hk
            a2 += np.float32(np.int32(b2 & m)) * lk
            c2 += np.float32(np.int32(b2 >> four)) * hk
            a3 += np.float32(np.int32(b3 & m)) * lk
            c3 += np.float32(np.int32(b3 >> four)) * hk
        _put(out, i, (a0 + c0) - off, alpha, accumulate)
        _put(out, i + 1, (a1 + c1) - off, alpha, accumulate)
        _put(out, i + 2, (a2 + c2) - off, alpha, accumulate)
        _put(out, i + 3, (a3 + c3) - off, alpha, accumulate)
        i += 4
    while i < end:
        r0 = q[i]
        a0 = zero
        for k in range(h):
            b0 = np.int32(r0[k])
            a0 += np.float32(np.int32(b0 & m)) * lo[k] + np.float32(np.int32(b0 >> four)) * hi[k]
        _put(out, i, a0 - off, alpha, accumulate)
        i += 1


def _groups(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
    """Rows of the row groups g0..g1. Compile-time dispatch on the value dtype (int8 -> q8, uint8 ->
    q4) and the CPU (AVX2: the integer kernels of kernels/quant_ir; else the float ones above). Numba only."""
    raise NotImplementedError


@overload(_groups, inline="always")
def _groups_overload(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
    if q.dtype == types.int8:
        if HAVE_AVX2:
            return lambda q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate: q8_groups_i16(
                q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate)

        def q8_float(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
            G = q.shape[0] // s.shape[0]
            for g in range(g0, g1):
                _fold(s[g], x, xs)
                _q8_group(q, xs, out, g * G, G, alpha, accumulate)
        return q8_float
    if q.dtype == types.uint8:
        if HAVE_AVX2:
            return lambda q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate: q4_groups_i8(
                q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate)

        def q4_float(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
            G = q.shape[0] // s.shape[0]
            for g in range(g0, g1):
                tot = _fold(s[g], x, xs)
                _q4_group(q, xs, np.float32(8.0) * tot, out, g * G, G, alpha, accumulate)
        return q4_float
    return None


@njit(cache=True)
def _qmv_groups(q, s, x, out, xs, xi, g0, g1, alpha, accumulate):
    # (q, s) quantized (d,n), x (n,) -> out rows of groups g0..g1 = alpha * W @ x (+=); xs (scratch_len(n),) f32, xi (xi_len(n),) i16 scratch
    n = s.shape[1]
    _groups(q, s, x, xs[:n], xi, xs[n:], out, g0, g1, alpha, accumulate)


@njit(cache=True)
def _qmv_core(q, s, x, out, xs, xi, alpha, accumulate):
    _qmv_groups(q, s, x, out, xs, xi, np.int64(0), s.shape[0], alpha, accumulate)


def scratch_len(n: int) -> int:
    """Length of the f32 scratch `xs` of a quantized matvec with n columns (the int16 `xi`: xi_len(n));
    whole cache lines, so each thread's row of a scratch(n, rows) starts aligned like the first."""
    return -(-(n + 2 * ACT_GROUPS * (n // 1024 + 2) + SUMS_MAX) // 16) * 16


def xi_len(n: int) -> int:
    """Length of the int16 scratch `xi`: the rounded activations of ACT_GROUPS row groups (whole cache lines)."""
    return -(-ACT_GROUPS * n // 32) * 32


def scratch(n: int, rows: int = 0):
    """(xs f32, xi int16) scratch for matvecs of up to n columns; rows > 0: one row per thread chunk."""
    shape = (rows,) if rows else ()
    return aligned_zeros(shape + (scratch_len(n),), np.float32), aligned_zeros(shape + (xi_len(n),), np.int16)


@by_reference          # the q8/q4 matvec under the token and the general path: compiled once (model/numba_link)
@njit(cache=True)
def matvec_q(q, s, x, out, xs, xi):
    # (q i8 (d,n) | u8 (d,n/2), s u16 (d/G,n)), x (n,) f32 -> out (d,) f32 = W @ x; xs (scratch_len(n),) f32, xi (xi_len(n),) i16 scratch
    _qmv_core(q, s, x, out, xs, xi, np.float32(1.0), np.bool_(False))


def _dequant(q, s):
    from .packing import dequantize_q4, dequantize_q8
    return dequantize_q8(q, s) if q.dtype == np.int8 else dequantize_q4(q, s)


def matvec_q_ref(q, s, x, out=None):
    r = (_dequant(q, s).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


@njit(cache=True, inline="always")
def _deq_row_q8(sg, src, dst):
    # sg (n,) u16, src (n,) i8 -> dst (n,) f32
    for j in range(dst.shape[0]):
        dst[j] = to_f32(sg[j]) * np.float32(src[j])


@njit(cache=True, inline="always")
def _deq_row_q4(sg, src, dst):
    # sg (n,) u16, src (n/2,) u8 packed -> dst (n,) f32; two passes (one per nibble) so each vectorises
    h = src.shape[0]
    lo = dst[:h]
    hi = dst[h:]
    slo = sg[:h]
    shi = sg[h:]
    for k in range(h):
        lo[k] = to_f32(slo[k]) * np.float32(np.int32(np.int32(src[k]) & np.int32(15)) - np.int32(8))
    for k in range(h):
        hi[k] = to_f32(shi[k]) * np.float32(np.int32(np.int32(src[k]) >> np.int32(4)) - np.int32(8))


def _deq_row(sg, src, dst):
    raise NotImplementedError


@overload(_deq_row, inline="always")
def _deq_row_overload(sg, src, dst):
    if src.dtype == types.int8:
        return lambda sg, src, dst: _deq_row_q8(sg, src, dst)
    if src.dtype == types.uint8:
        return lambda sg, src, dst: _deq_row_q4(sg, src, dst)
    return None


@njit(cache=True, nogil=True)      # nogil: kernels.matmul_par's threads
def rows_to_f32_q(q, s, r0, r1, out):
    # (q, s) quantized (d,n), rows r0:r1 -> out (r1-r0, n) f32 dequantized
    G = q.shape[0] // s.shape[0]
    for i in range(r0, r1):
        _deq_row(s[i // G], q[i], out[i - r0])


def rows_to_f32_q_ref(q, s, r0, r1, out=None):
    r = np.ascontiguousarray(_dequant(q, s)[r0:r1])
    if out is not None:
        out[...] = r
    return r


@njit(cache=True)
def expert_ffn_q(w1q, w1s, w3q, w3s, w2q, w2s, e, x, weight, h1, h3, out, xs, xi):
    # quantized w1,w3 (E,I,D), w2 (E,D,I); x (D,) -> out (D,) += weight * w2[e] @ (silu(w1[e]@x) * (w3[e]@x)); h1,h3 (I,), xs/xi scratch for max(D,I)
    one = np.float32(1.0)
    _qmv_core(w1q[e], w1s[e], x, h1, xs, xi, one, np.bool_(False))
    _qmv_core(w3q[e], w3s[e], x, h3, xs, xi, one, np.bool_(False))
    _silu_mul_1d(h1, h3)
    _qmv_core(w2q[e], w2s[e], h1, out, xs, xi, np.float32(weight), np.bool_(True))


def expert_ffn_q_ref(w1q, w1s, w3q, w3s, w2q, w2s, e, x, weight, out):
    """Returns out + weight * ffn(x) (does not modify out)."""
    from .moe import silu_mul_ref
    g = matvec_q_ref(w1q[e], w1s[e], x)
    u = matvec_q_ref(w3q[e], w3s[e], x)
    h = silu_mul_ref(g[None], u[None])[0]
    return (out + np.float32(weight) * matvec_q_ref(w2q[e], w2s[e], h)).astype(np.float32)


# ---------------------------------------------------------------------------- threads

@by_reference          # as matvec_q, on threads
@njit(cache=True, parallel=True)
def _qmv_par(q, s, x, out, xs2, xi2, alpha, accumulate):
    # as _qmv_core, row groups split in xs2.shape[0] chunks run by threads; xs2/xi2 one scratch row per chunk
    ng = s.shape[0]
    nt = xs2.shape[0]
    for c in prange(nt):
        g0 = c * ng // nt
        g1 = (c + 1) * ng // nt
        _qmv_groups(q, s, x, out, xs2[c], xi2[c], g0, g1, alpha, accumulate)


@njit(cache=True)
def matvec_q_par(q, s, x, out, xs2, xi2):
    # matvec_q with the row groups split over xs2.shape[0] chunks run by Numba threads
    _qmv_par(q, s, x, out, xs2, xi2, np.float32(1.0), np.bool_(False))


@njit(cache=True, parallel=True)
def matvec_q_qkv_par(q0, s0, q1, s1, q2, s2, x, out, xs2, xi2):
    # three quantized pairs (q, k, v: one n, q8 and q4 may mix), x (n,) -> out = their stacked rows @ x;
    # chunk c (one per row of xs2/xi2) takes its share of each matrix's row groups: one region for the three
    nt = xs2.shape[0]
    d0, d1 = q0.shape[0], q1.shape[0]
    n0, n1, n2 = s0.shape[0], s1.shape[0], s2.shape[0]
    one = np.float32(1.0)
    for c in prange(nt):
        _qmv_groups(q0, s0, x, out[:d0], xs2[c], xi2[c], c * n0 // nt, (c + 1) * n0 // nt, one, np.bool_(False))
        _qmv_groups(q1, s1, x, out[d0:d0 + d1], xs2[c], xi2[c], c * n1 // nt, (c + 1) * n1 // nt, one, np.bool_(False))
        _qmv_groups(q2, s2, x, out[d0 + d1:], xs2[c], xi2[c], c * n2 // nt, (c + 1) * n2 // nt, one, np.bool_(False))


@njit(cache=True, parallel=True)
def _qmv_pair_par(q1, s1, q3, s3, x, h1, h3, xs2, xi2):
    # h1 = W1@x, h3 = W3@x (quantized, same shape) in ONE parallel region of 2*chunks (rows of xs2)
    ng = s1.shape[0]
    nt = xs2.shape[0] // 2
    one = np.float32(1.0)
    for c2 in prange(2 * nt):
        c = c2 % nt
        g0 = c * ng // nt
        g1 = (c + 1) * ng // nt
        if c2 < nt:
            _qmv_groups(q1, s1, x, h1, xs2[c2], xi2[c2], g0, g1, one, np.bool_(False))
        else:
            _qmv_groups(q3, s3, x, h3, xs2[c2], xi2[c2], g0, g1, one, np.bool_(False))


@njit(cache=True)
def expert_ffn_q_par(w1q, w1s, w3q, w3s, w2q, w2s, e, x, weight, h1, h3, out, xs2, xi2):
    # expert_ffn_q on threads: two parallel regions (w1 and w3 together, then w2); xs2/xi2 (2*chunks, ...) scratch
    _qmv_pair_par(w1q[e], w1s[e], w3q[e], w3s[e], x, h1, h3, xs2, xi2)
    _silu_mul_1d(h1, h3)
    _qmv_par(w2q[e], w2s[e], h1, out, xs2[:xs2.shape[0] // 2], xi2[:xi2.shape[0] // 2], np.float32(weight), np.bool_(True))
