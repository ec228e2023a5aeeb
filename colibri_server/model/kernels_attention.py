"""Attention over the KV cache (causal, grouped-query, optional sliding window), with its
numpy twin. Split from kernels.py (re-exported there as kernels.attention / attention_ref).

Per query head: scores = K @ q with the matvec kernel (one key row at a time, long
vectorised dot), max, exp with kernels.expf (vectorises: no libm call), then the
weighted sum of V four rows per pass. Every loop runs over a slice starting at 0: an
index Numba cannot prove non-negative gets wraparound code that blocks vectorisation.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _REDUCE_FM, _matvec_core, _max_finite, expf

__all__ = ["attention", "attention_ref"]


@njit(cache=True)
def _scores(qv, K, sc, scores):
    # qv (hd,), K (P,hd) -> scores (P,) = sc * K @ qv (the 8-rows-per-pass matvec); returns max(scores)
    _matvec_core(K, qv, scores, sc, False)
    return _max_finite(scores)


@njit(cache=True, fastmath=_REDUCE_FM, error_model="numpy")
def _softmax_weights(scores, m):
    # scores (P,) <- exp(scores - m) (vectorised expf); returns their sum
    tot = np.float32(0.0)
    for j in range(scores.shape[0]):
        e = expf(scores[j] - m)
        scores[j] = e
        tot += e
    return tot


@njit(cache=True)
def _weighted_sum(scores, V, inv, ov):
    # scores (P,), V (P,hd) -> ov (hd,) = inv * scores @ V; 4 rows of V per pass
    # (loops start at 0 over slices: an index that might be negative costs Numba's wraparound
    # code, which keeps LLVM from vectorising)
    hd = ov.shape[0]
    P = V.shape[0]
    for c in range(hd):
        ov[c] = np.float32(0.0)
    j = 0
    while j + 4 <= P:
        e0 = scores[j]
        e1 = scores[j + 1]
        e2 = scores[j + 2]
        e3 = scores[j + 3]
        v0 = V[j]
        v1 = V[j + 1]
        v2 = V[j + 2]
        v3 = V[j + 3]
        for c in range(hd):
            ov[c] += (e0 * v0[c] + e1 * v1[c]) + (e2 * v2[c] + e3 * v3[c])
        j += 4
    while j < P:
        e0 = scores[j]
        v0 = V[j]
        for c in range(hd):
            ov[c] += e0 * v0[c]
        j += 1
    for c in range(hd):
        ov[c] *= inv


@njit(cache=True)
def attention(q, kcache, vcache, start, window, scale, out, scores):
    # q (T,H,hd), k/vcache (Hkv,S,hd), causal GQA from abs pos start(+t), sliding window if >0 -> out (T,H,hd); scores (S,) scratch
    T, H, hd = q.shape
    Hkv, S, _ = kcache.shape
    if H % Hkv != 0:
        raise ValueError("attention: H must be a multiple of Hkv")
    if start < 0 or start + T > S:
        raise ValueError("attention: positions beyond the cache")
    group = H // Hkv
    sc = np.float32(scale)
    for t in range(T):
        p = start + t
        lo = 0
        if window > 0:
            lo = p - window + 1
            if lo < 0:
                lo = 0
        for h in range(H):
            kh = h // group
            sv = scores[:p + 1 - lo]
            m = _scores(q[t, h], kcache[kh, lo:p + 1], sc, sv)
            tot = _softmax_weights(sv, m)
            _weighted_sum(sv, vcache[kh, lo:p + 1], np.float32(1.0) / tot, out[t, h])


def attention_ref(q, kcache, vcache, start, window, scale, out=None):
    T, H, hd = q.shape
    Hkv, S, _ = kcache.shape
    group = H // Hkv
    r = np.zeros((T, H, hd), np.float32)
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            k = kcache[h // group, lo : p + 1].astype(np.float64)
            v = vcache[h // group, lo : p + 1].astype(np.float64)
            s = (k @ q[t, h].astype(np.float64)) * scale
            s = np.exp(s - s.max())
            r[t, h] = (s / s.sum()) @ v
    if out is not None:
        out[...] = r
    return r
