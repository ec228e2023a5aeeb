"""Per-head matrix products: every head's rows times that head's own matrix, with its numpy twin.

Latent attention (model/mla.py) multiplies each query head by its own (r, nope) matrix to bring it
into the latent space, and each head's latent output by its own (v, r) matrix to bring it back:
out[t, h] = W[h] @ X[t, h] for every row t and head h. Each weight row is loaded once for all the
rows of a step (converted from f16/bf16 in the loop, like dense.matvec), the heads split over the
Numba threads in the _par variant (the same bits: heads are independent).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .base import _REDUCE_FM, to_f32

__all__ = ["heads_matmul", "heads_matmul_par", "heads_matmul_ref"]


@njit(cache=True, fastmath=_REDUCE_FM, inline="always")
def _head(X, W, out, h):
    # X (T,H,n) f32, W (H,d,n) f32 or f16/bf16 bits -> out[:, h] (T,d)
    T, n = X.shape[0], X.shape[2]
    for i in range(W.shape[1]):
        w = W[h, i]
        for t in range(T):
            x = X[t, h]
            a = np.float32(0.0)
            for c in range(n):
                a += x[c] * to_f32(w[c])
            out[t, h, i] = a


@njit(cache=True)
def _check(X, W, out):
    if W.shape[0] != X.shape[1] or W.shape[2] != X.shape[2] or out.shape[0] != X.shape[0] \
            or out.shape[1] != X.shape[1] or out.shape[2] != W.shape[1]:
        raise ValueError("heads_matmul: X (T,H,n), W (H,d,n) and out (T,H,d) disagree")


@njit(cache=True)
def heads_matmul(X, W, out):
    # out (T,H,d) = per head h: X[:, h] (T,n) @ W[h].T
    _check(X, W, out)
    for h in range(X.shape[1]):
        _head(X, W, out, h)


@njit(cache=True, parallel=True)
def heads_matmul_par(X, W, out):
    _check(X, W, out)
    for h in prange(X.shape[1]):
        _head(X, W, out, h)


def heads_matmul_ref(X, W):
    """numpy twin, float64 inside."""
    from .base import weights_to_f32
    Wf = weights_to_f32(np.ascontiguousarray(W)).astype(np.float64)
    return np.einsum("thn,hdn->thd", X.astype(np.float64), Wf).astype(np.float32)
