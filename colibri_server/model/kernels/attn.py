"""Attention over the KV cache (causal, grouped-query, optional sliding window), with its
numpy twin. The package's face re-exports attend, attention, attention_par and attention_ref.

Per kv head, for the `group` query heads that share it at once: scores = K @ q of every head
with each key row read once (the group's dots beside each other), the max, exp with
kernels.expf (vectorises: no libm call), then the weighted sum of V, four rows per pass, each
row read once for all the group's heads. Reading the cache once per group instead of once per
query head matters as the context grows: the cache of one layer is 2 * Hkv * positions * hd
floats (bench-mixtral at 4096 positions: 8.4 MB a layer, 67 MB a token), more than the weights
of a q4 model at a few thousand positions. Every loop runs over a slice starting at 0: an index
Numba cannot prove non-negative gets wraparound code that blocks vectorisation.

With AVX2 and FMA and a head dim that is a multiple of 8, the two inner loops are LLVM IR
(kernels/attn_ir): scores 8 keys at a time (KEY_BLOCK), the sum of V in registers over
chunks of ROW_CHUNK rows, both kept small enough that the group's heads read them from L1.
Measured on a Zen 3 VM at bench-mixtral's shape (16 heads, 4 kv heads, head dim 64), one layer,
one token: 192 positions 34.9 -> 26.3 us (scores 14.1 -> 10.2, V sum 10.8 -> 6.3 for the 4 kv
heads); 4096 positions 926 -> 826 us.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..numba_link import by_reference
from .attn_ir import HAVE_ATTN_IR, scores8, wsum_rows
from .base import _REDUCE_FM, _max_finite, expf

KEY_BLOCK = 8      # keys per scores8 call: each block's rows read from L1 by all the group's heads
ROW_CHUNK = 64     # V rows per wsum_rows call, for the same reason (64 x hd floats stay in L1)

__all__ = ["attend", "attention", "attention_par", "attention_ref"]


@by_reference          # in the decode token and each attention kernel: compiled once, not into every caller (model/numba_link)
@njit(cache=True, fastmath=_REDUCE_FM)
def _scores_group(Q, K, sc, S):
    # Q (g,hd) the query heads of one kv head, K (P,hd) -> S (g,P) = sc * Q @ K.T, each key row read once
    g, hd = Q.shape
    P = K.shape[0]
    j0 = 0
    if HAVE_ATTN_IR and hd % 8 == 0:
        while j0 + KEY_BLOCK <= P:
            for h in range(g):
                scores8(K, j0, Q[h], sc, S[h])
            j0 += KEY_BLOCK
    for j in range(j0, P):
        k = K[j]
        for h in range(g):
            q = Q[h]
            a = np.float32(0.0)
            for c in range(hd):
                a += q[c] * k[c]
            S[h, j] = sc * a


@njit(cache=True, fastmath=_REDUCE_FM, error_model="numpy")
def _softmax_weights(scores, m):
    # scores (P,) <- exp(scores - m) (vectorised expf); returns their sum
    tot = np.float32(0.0)
    for j in range(scores.shape[0]):
        e = expf(scores[j] - m)
        scores[j] = e
        tot += e
    return tot


@by_reference          # as _scores_group
@njit(cache=True)
def _weighted_sum_group(S, V, O):
    # S (g,P) weights, V (P,hd) -> O (g,hd) = S @ V; 4 rows of V per pass, each read once for the g heads
    # (loops start at 0 over slices: an index that might be negative costs Numba's wraparound
    # code, which keeps LLVM from vectorising)
    g, P = S.shape
    hd = O.shape[1]
    for h in range(g):
        for c in range(hd):
            O[h, c] = np.float32(0.0)
    if HAVE_ATTN_IR and hd % 8 == 0:
        for j0 in range(0, P, ROW_CHUNK):
            j1 = min(P, j0 + ROW_CHUNK)
            for h in range(g):
                wsum_rows(S[h, j0:j1], V[j0:j1], O[h])
        return
    j = 0
    while j + 4 <= P:
        v0 = V[j]
        v1 = V[j + 1]
        v2 = V[j + 2]
        v3 = V[j + 3]
        for h in range(g):
            e0 = S[h, j]
            e1 = S[h, j + 1]
            e2 = S[h, j + 2]
            e3 = S[h, j + 3]
            o = O[h]
            for c in range(hd):
                o[c] += (e0 * v0[c] + e1 * v1[c]) + (e2 * v2[c] + e3 * v3[c])
        j += 4
    while j < P:
        v0 = V[j]
        for h in range(g):
            e0 = S[h, j]
            o = O[h]
            for c in range(hd):
                o[c] += e0 * v0[c]
        j += 1


@njit(cache=True)
def _checked_group(q, kcache, start, nscores):
    # the query heads per kv head, after attention's checks of the shapes and the scratch
    T, H, _ = q.shape
    Hkv, S, _ = kcache.shape
    if H % Hkv != 0:
        raise ValueError("attention: H must be a multiple of Hkv")
    if start < 0 or start + T > S:
        raise ValueError("attention: positions beyond the cache")
    group = H // Hkv
    if nscores < group * (start + T):
        raise ValueError("attention: the scores scratch is smaller than (H/Hkv) x positions")
    return group


@njit(cache=True, inline="always")
def _first(p, window):
    # the first position that position p attends to
    lo = 0
    if window > 0:
        lo = p - window + 1
        if lo < 0:
            lo = 0
    return lo


@njit(cache=True)
def _attend_kv(qt, kcache, vcache, kh, h0, lo, p, sc, sv, ot, sinks):
    # the query heads h0..h0+g-1 of kv head kh (qt (H,hd) one position's) over positions lo..p -> ot's rows of
    # them; sv (g, p+1-lo) the scores scratch; sinks (H,) f32 logits in every softmax's sum (GPT-OSS), or size 0
    group = sv.shape[0]
    _scores_group(qt[h0:h0 + group], kcache[kh, lo:p + 1], sc, sv)
    for h in range(group):
        row = sv[h]
        m = _max_finite(row)
        if sinks.shape[0] > 0 and sinks[h0 + h] > m:
            m = sinks[h0 + h]
        tot = _softmax_weights(row, m)
        if sinks.shape[0] > 0:
            tot += expf(sinks[h0 + h] - m)
        inv = np.float32(1.0) / tot
        for j in range(row.shape[0]):
            row[j] *= inv
    _weighted_sum_group(sv, vcache[kh, lo:p + 1], ot[h0:h0 + group])


@njit(cache=True)
def attention(q, kcache, vcache, start, window, scale, out, scores, sinks):
    # q (T,H,hd), k/vcache (Hkv,S,hd), causal GQA from abs pos start(+t), sliding window if >0 -> out (T,H,dv)
    # (dv <= hd: the first dims of each value row, latent attention); scores (>= H//Hkv * S,) scratch;
    # sinks (H,) per-head logits in the softmax's sum, or size 0
    group = _checked_group(q, kcache, start, scores.shape[0])
    sc = np.float32(scale)
    for t in range(q.shape[0]):
        p = start + t
        lo = _first(p, window)
        n = p + 1 - lo
        sv = scores[:group * n].reshape((group, n))                                       # (g,n)
        for kh in range(kcache.shape[0]):
            _attend_kv(q[t], kcache, vcache, kh, kh * group, lo, p, sc, sv, out[t], sinks)


@njit(cache=True, parallel=True)
def attention_par(q, kcache, vcache, start, window, scale, out, scores2, sinks):
    # attention on Numba threads, one region for every position: scores2 (Hkv*C, >= ceil(H/Hkv/C) * S) one
    # scratch row per (kv head, chunk of its query heads); C = 1 splits the kv heads, C > 1 also splits each
    # kv head's query heads into C chunks (latent attention: 1 kv head for all of them), each chunk reading
    # its kv head's rows itself. Every head is computed as on one thread: the same bits as attention.
    Hkv = kcache.shape[0]
    if scores2.shape[0] < Hkv:
        raise ValueError("attention: the scores scratch has fewer rows than kv heads")
    if scores2.shape[0] % Hkv != 0:
        raise ValueError("attention: the scores scratch rows are not a multiple of the kv heads")
    group = _checked_group(q, kcache, start, (q.shape[1] // Hkv) * (start + q.shape[0]))   # shapes
    chunks = scores2.shape[0] // Hkv
    per = (group + chunks - 1) // chunks
    if scores2.shape[1] < per * (start + q.shape[0]):
        raise ValueError("attention: the scores scratch is smaller than its heads x positions")
    sc = np.float32(scale)
    for i in prange(Hkv * chunks):               # one region: each thread's (kv head, chunk) at every position
        kh, c = i // chunks, i % chunks
        g0, g1 = c * per, min(group, (c + 1) * per)
        if g1 <= g0:
            continue
        for t in range(q.shape[0]):
            p = start + t
            lo = _first(p, window)
            n = p + 1 - lo
            _attend_kv(q[t], kcache, vcache, kh, kh * group + g0, lo, p, sc,
                       scores2[i, :(g1 - g0) * n].reshape((g1 - g0, n)), out[t], sinks)


def attend(q, kcache, vcache, start, window, scale, out, scores, sinks):
    """attention, or attention_par when the scratch is 2-D (one row per kv head): a call site's
    threads are those of the scratch it is given (Workspace.attention_scores)."""
    (attention_par if scores.ndim == 2 else attention)(q, kcache, vcache, start, window, scale, out, scores, sinks)


@overload(attend)
def _attend_overload(q, kcache, vcache, start, window, scale, out, scores, sinks):
    if isinstance(scores, types.Array) and scores.ndim == 2:
        return lambda q, kcache, vcache, start, window, scale, out, scores, sinks: attention_par(
            q, kcache, vcache, start, window, scale, out, scores, sinks)
    return lambda q, kcache, vcache, start, window, scale, out, scores, sinks: attention(
        q, kcache, vcache, start, window, scale, out, scores, sinks)


def attention_ref(q, kcache, vcache, start, window, scale, out=None, sinks=None):
    T, H, hd = q.shape
    Hkv, S, _ = kcache.shape
    group = H // Hkv
    dv = out.shape[2] if out is not None else vcache.shape[2]
    r = np.zeros((T, H, dv), np.float32)
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            k = kcache[h // group, lo : p + 1].astype(np.float64)
            v = vcache[h // group, lo : p + 1, :dv].astype(np.float64)
            s = (k @ q[t, h].astype(np.float64)) * scale
            sink = -np.inf if sinks is None or len(sinks) == 0 else float(sinks[h])
            m = max(s.max(), sink)
            s = np.exp(s - m)
            r[t, h] = (s / (s.sum() + np.exp(sink - m))) @ v
    if out is not None:
        out[...] = r
    return r
