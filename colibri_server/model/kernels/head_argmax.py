"""The int16 output head's argmax from the int8 head's logits: a greedy row's token at the int8 dots' speed.

A block-kind head multiplies the hidden state rounded to int16 (exact_head, kernels/blocks_wide), twice the dots of
the int8 rounding llama.cpp uses. A row whose token is the argmax of its logits needs only which logit is largest.
In real numbers (the kernels' integer sums are exact), the int8 and int16 logits of weight row v differ by
w_v . (x8 - x16), x8 and x16 the two roundings of the row's hidden state as the kernels see them (scale times
integer), so by at most |w_v|_2 |x8 - x16|_2 (Cauchy-Schwarz): with W2 = max_v |w_v|_2 (head_l2_max) and the
float steps' rounding added, E bounds |int8 logit - int16 logit| for every v. refine_argmax takes the row's int8
logits (bias added), recomputes every one within 2E of their maximum with the int16 row dot (the int16 head's bits:
its tiles equal the row dots), bias added the same way, and leaves the rest: each of those is below the int16 value
of the int8 maximum's row, so the row's argmax is the int16 head's, ties included. On bench-mixtral Q4_K_M's
32000-row head a 16-row step recomputes 6.8 logits a row on average (40 steps: 6-9 a row a step).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks import ACTS16, _kround, deq_row, round_rows
from .blocks_gemm import gemm_rows
from .blocks_wide import round_rows16

__all__ = ["head_l2_max", "refine_argmax", "refine_argmax_par"]


@njit(cache=True)
def head_l2_max(raw, kind, n):
    # max over the rows of raw (d, row bytes) of GGML type kind of |w_v|_2, the row dequantized (float64 sums)
    y = np.empty(n, np.float32)
    best = 0.0
    for v in range(raw.shape[0]):
        deq_row(kind, raw[v], y)
        s = 0.0
        for i in range(n):
            s += np.float64(y[i]) * np.float64(y[i])
        best = max(best, s)
    return np.sqrt(best)


@njit(cache=True, inline="always")
def _row_max(r):
    # the largest of r (V,) f32, NaN ignored: 16 running maxima side by side (vector blends, not a serial chain)
    V = r.shape[0]
    m = np.full(16, -np.inf, np.float32)
    v = 0
    while v + 16 <= V:
        for k in range(16):
            x = r[v + k]
            m[k] = x if x > m[k] else m[k]
        v += 16
    top = np.float32(-np.inf)
    for k in range(16):
        top = m[k] if m[k] > top else top
    for u in range(v, V):
        top = r[u] if r[u] > top else top
    return top


@njit(cache=True)
def _refine_row(raw, kind, X, L, t, bias, bmax, l2, tmp, q8, d8, s8, q16, d16, s16):
    # row t of refine_argmax -> the logits recomputed
    n = X.shape[1]
    B = 256 if _kround(kind) else 32
    x = X[t:t + 1]
    round_rows(kind, x, q8, d8, s8)
    round_rows16(kind + ACTS16, x, q16, d16, s16)
    v16 = q16[0].view(np.int16)
    dd, xx = 0.0, 0.0
    for i in range(n):
        a = np.float64(d8[0, i // B]) * np.float64(q8[0, i])
        c = np.float64(d16[0, i // B]) * np.float64(v16[i])
        dd += (a - c) * (a - c)
        xx += max(a * a, c * c)
    r = L[t]
    top = np.float64(_row_max(r))
    if not np.isfinite(top) or not np.isfinite(dd):
        return 0                    # non-finite logits: the caller faults the row, whichever head
    # |x8 - x16|_2 W2, and the float steps of both products (a few roundings a block of sums <= W2 |x|_2) and of
    # the bias, each with room to spare
    E = 1.01 * l2 * np.sqrt(dd) + (n // B + 8) * 2.0 ** -21 * l2 * np.sqrt(xx) + 2.0 ** -20 * (abs(top) + bmax)
    low = np.float32(top - 2.0 * E)
    one, no = np.float32(1.0), np.bool_(False)
    done = 0
    V = r.shape[0]
    for v0 in range(0, V, 16):
        v1 = min(V, v0 + 16)
        hit = False
        for v in range(v0, v1):
            hit |= r[v] >= low
        if not hit:
            continue
        for v in range(v0, v1):
            if r[v] >= low:
                gemm_rows(raw, kind + ACTS16, x, q16, d16, s16, L[t:t + 1], tmp, v, v + 1, one, no)
                if bias.shape[0]:
                    r[v] += bias[v]
                done += 1
    return done


@njit(cache=True, inline="always")
def _scratch(n):
    return (np.empty((1, n), np.int8), np.empty((1, n // 32), np.float32), np.empty((1, n // 16), np.int32),
            np.empty((1, 2 * n), np.int8), np.empty((1, n // 32), np.float32), np.empty((1, n // 16), np.int32))


@njit(cache=True, inline="always")
def _bias_max(bias):
    bmax = 0.0
    for v in range(bias.shape[0]):
        bmax = max(bmax, abs(np.float64(bias[v])))
    return bmax


@njit(cache=True)
def refine_argmax(raw, kind, X, L, rows, bias, l2, tmp):
    # rows t of X (T, n) f32 (the head's input) whose L[t] (T, d) f32 holds the int8 head's logits (+ bias (d,) f32, or
    # size 0): every logit within 2E of the row's maximum replaced by the int16 head's (kind: the head's GGML id,
    # one of blocks.FAST, those with an int16 rounding; l2: head_l2_max; tmp >= blocks_gemm.scratch_words(n) f32). Returns the logits recomputed.
    q8, d8, s8, q16, d16, s16 = _scratch(X.shape[1])
    bmax = _bias_max(bias)
    done = 0
    for j in range(rows.shape[0]):
        done += _refine_row(raw, kind, X, L, rows[j], bias, bmax, l2, tmp, q8, d8, s8, q16, d16, s16)
    return done


@njit(cache=True, parallel=True)
def refine_argmax_par(raw, kind, X, L, rows, bias, l2, tmps):
    # refine_argmax with the rows split over tmps.shape[0] parts (tmps: one scratch a part), the same logits
    nparts = tmps.shape[0]
    bmax = _bias_max(bias)
    done = np.zeros(nparts, np.int64)
    for p in prange(nparts):
        q8, d8, s8, q16, d16, s16 = _scratch(X.shape[1])
        for j in range(p * rows.shape[0] // nparts, (p + 1) * rows.shape[0] // nparts):
            done[p] += _refine_row(raw, kind, X, L, rows[j], bias, bmax, l2, tmps[p], q8, d8, s8, q16, d16, s16)
    return done.sum()
