"""Per-head matrix products: every head's rows times that head's own matrix, with its numpy twin.

Latent attention (model/mla.py) multiplies each query head by its own (r, nope) matrix to bring it
into the latent space, and each head's latent output by its own (v, r) matrix to bring it back:
out[t, h] = W[h] @ X[t, h] for every row t and head h. Each head is one small matrix product through
contiguous scratch: a matvec for one row (dense._matvec_core), rowgemm for more (each weight converted
once for all the rows); the heads split over the Numba threads in the _par variant (the same bits:
heads are independent). Measured on bench-deepseek (f16, 16 heads, r 256, nope 64, one thread): the
first version (a scalar dot per weight row and row of X, on strided views) took 2.0 of 3.0 s of a
128-token prefill and 64 decode steps.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..numba_link import by_reference
from .dense import _matvec_core
from .rowgemm import rowgemm

__all__ = ["heads_matmul", "heads_matmul_par", "heads_matmul_ref"]


@njit(cache=True)
def _head(X, W, out, h, xs, ys):
    # head h: out[:, h] (T,d) = X[:, h] (T,n) @ W[h].T, through contiguous scratch xs (T,n), ys (T,d): one row a
    # matvec (dense._matvec_core: f16/bf16 rows in IR on AVX-512), more rows rowgemm (each weight converted once
    # for all of them, the IR tile on AVX-512)
    T = X.shape[0]
    for t in range(T):
        xs[t, :] = X[t, h, :]
    if T == 1:
        _matvec_core(W[h], xs[0], ys[0], np.float32(1.0), np.bool_(False))
    else:
        rowgemm(W[h:h + 1], xs, ys)
    for t in range(T):
        out[t, h, :] = ys[t, :]


@njit(cache=True)
def _check(X, W, out):
    if W.shape[0] != X.shape[1] or W.shape[2] != X.shape[2] or out.shape[0] != X.shape[0] \
            or out.shape[1] != X.shape[1] or out.shape[2] != W.shape[1]:
        raise ValueError("heads_matmul: X (T,H,n), W (H,d,n) and out (T,H,d) disagree")


@by_reference          # latent attention's per-head products, in the token and the general path: compiled once
@njit(cache=True)
def heads_matmul(X, W, out):
    # out (T,H,d) = per head h: X[:, h] (T,n) @ W[h].T
    _check(X, W, out)
    T, H, n = X.shape
    xs = np.empty((T, n), np.float32)
    ys = np.empty((T, W.shape[1]), np.float32)
    for h in range(H):
        _head(X, W, out, h, xs, ys)


@by_reference          # as heads_matmul
@njit(cache=True, parallel=True)
def heads_matmul_par(X, W, out):
    _check(X, W, out)
    T, H, n = X.shape
    for h in prange(H):
        xs = np.empty((T, n), np.float32)
        ys = np.empty((T, W.shape[1]), np.float32)
        _head(X, W, out, h, xs, ys)


def heads_matmul_ref(X, W):
    """numpy twin, float64 inside."""
    from .base import weights_to_f32
    Wf = weights_to_f32(np.ascontiguousarray(W)).astype(np.float64)
    return np.einsum("thn,hdn->thd", X.astype(np.float64), Wf).astype(np.float32)
