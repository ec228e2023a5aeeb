"""X (B, n) @ W.T for the few rows of a serving step: each weight row streamed once for all B rows.

A continuous-batching step multiplies every matrix by B rows (the next token of each decoding
sequence, B = 1..32, and per expert only the rows routed to it, ~B*top_k/E). The prefill path
(dense.matmul) converts 256-row tiles of f16/bf16 weights to f32 and calls BLAS, built for
hundreds of rows; at 4-16 rows it spends its time converting and writing tiles. Here a weight
element is loaded and converted once, in a register, and multiplied into 4 rows of X at a time
(2 weight rows x 4 rows of X: 8 accumulators), so 16 rows cost 4 passes over L1-resident
activations and one pass over the weights.

Weights are 3-D float arrays (nb, d, P): the panels of a f16p/bf16p matrix as stored (panels.py),
or a row-major (d, n) matrix viewed as one panel (1, d, n); f32, f16 (uint16 bits) or bf16 (int16
bits), converted by base.to_f32. Each output row t is its own sum over n: the rows of X do not
interact, so a row's result does not depend on which other rows share the call.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .base import _REDUCE_FM, to_f32

__all__ = ["rowgemm", "rowgemm_par", "rowgemm_ref"]


@njit(cache=True, fastmath=_REDUCE_FM, inline="always")
def _dots_2x4(w0, w1, x0, x1, x2, x3):
    # two weight rows (P,) x four activation rows (P,) -> 8 dots; each weight converted once
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for j in range(w0.shape[0]):
        u = to_f32(w0[j])
        v = to_f32(w1[j])
        y0 = x0[j]
        y1 = x1[j]
        y2 = x2[j]
        y3 = x3[j]
        a0 += u * y0
        a1 += u * y1
        a2 += u * y2
        a3 += u * y3
        b0 += v * y0
        b1 += v * y1
        b2 += v * y2
        b3 += v * y3
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(cache=True, fastmath=_REDUCE_FM, inline="always")
def _dots_1x4(w0, x0, x1, x2, x3):
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for j in range(w0.shape[0]):
        u = to_f32(w0[j])
        a0 += u * x0[j]
        a1 += u * x1[j]
        a2 += u * x2[j]
        a3 += u * x3[j]
    return a0, a1, a2, a3


@njit(cache=True, fastmath=_REDUCE_FM)   # (the inlined dots keep their reassociation only so)
def _rows(P, X, out, r0, r1):
    # P (nb,d,Pw) weights, X (T,nb*Pw) f32 -> out[:, r0:r1] = (X @ W.T)[:, r0:r1]
    nb, d, Pw = P.shape
    T = X.shape[0]
    for t in range(T):
        for i in range(r0, r1):
            out[t, i] = 0.0
    last = T - 1
    for b in range(nb):
        c0 = b * Pw
        for t in range(0, T, 4):
            # a group of 4 rows of X; past the end the last row is read again and its sums dropped
            x0 = X[t, c0:c0 + Pw]
            x1 = X[min(t + 1, last), c0:c0 + Pw]
            x2 = X[min(t + 2, last), c0:c0 + Pw]
            x3 = X[min(t + 3, last), c0:c0 + Pw]
            n = min(4, T - t)
            i = r0
            while i + 1 < r1:
                a0, a1, a2, a3, b0, b1, b2, b3 = _dots_2x4(P[b, i], P[b, i + 1], x0, x1, x2, x3)
                out[t, i] += a0
                out[t, i + 1] += b0
                if n > 1:
                    out[t + 1, i] += a1
                    out[t + 1, i + 1] += b1
                if n > 2:
                    out[t + 2, i] += a2
                    out[t + 2, i + 1] += b2
                if n > 3:
                    out[t + 3, i] += a3
                    out[t + 3, i + 1] += b3
                i += 2
            if i < r1:
                a0, a1, a2, a3 = _dots_1x4(P[b, i], x0, x1, x2, x3)
                out[t, i] += a0
                if n > 1:
                    out[t + 1, i] += a1
                if n > 2:
                    out[t + 2, i] += a2
                if n > 3:
                    out[t + 3, i] += a3


@njit(cache=True)
def rowgemm(P, X, out):
    # P (nb,d,Pw) f32/f16/bf16 weights, X (T,n) f32 -> out (T,d) f32 = X @ W.T
    _rows(P, X, out, 0, P.shape[1])


@njit(cache=True, parallel=True)
def rowgemm_par(P, X, out, nchunks):
    # rowgemm with the weight rows split into nchunks runs of even length on Numba threads
    d = P.shape[1]
    for c in prange(nchunks):
        r0 = (c * d // nchunks) & ~1
        r1 = d if c == nchunks - 1 else ((c + 1) * d // nchunks) & ~1
        _rows(P, X, out, r0, r1)


def rowgemm_ref(W, X):
    """numpy twin: W a logical (d, n) float32 matrix."""
    return (np.asarray(X, np.float64) @ np.asarray(W, np.float64).T).astype(np.float32)
