"""A serving step's quantized (q8/q4) experts in one call: the counterpart of rowgemm.experts_rows.

moe() ran a step's experts one after another from Python, three matrix calls each (on threads,
three parallel regions per expert): bench-mixtral q4, 16 rows on 2 threads, 192 calls and their
gathers and scatters a step, about a third of it. Here one call per layer runs every expert that
got rows. An expert with one row takes the q8/q4 matvec's row groups (kernels/quant), one with more
the integer GEMM's (kernels/gemm): what Workspace.mm gives each matrix, so the same numbers. On
threads each thread takes its share of every active expert's row groups (w1 and w3 in one parallel
region, w2 in a second), so the work is even however the rows fell on the experts.

Legend as in moe.py: T rows, k chosen experts per row, D hidden, I expert intermediate, n = T*k.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .gemm import q_groups
from .moe import silu_mul
from .quant import _qmv_groups

__all__ = ["experts_rows_q"]


@njit(cache=True)
def _groups_of(q, s, X, out, lo, hi, part, nparts, xs, xi):
    # out[lo:hi, rows of part `part` of the row groups] = X[lo:hi] @ W.T for one expert's rows lo..hi
    ng = s.shape[0]
    g0, g1 = part * ng // nparts, (part + 1) * ng // nparts
    if g1 <= g0:
        return
    if hi - lo == 1:
        _qmv_groups(q, s, X[lo], out[lo], xs, xi, g0, g1, np.float32(1.0), np.bool_(False))
    else:
        q_groups(q, s, X[lo:hi], out[lo:hi], g0, g1)


@njit(cache=True, parallel=True)
def _up(q1, s1, q3, s3, xe, offsets, active, G, U, xs2, xi2):
    # each part p: its groups of every active expert's w1 and w3 on that expert's rows of xe -> G, U
    nparts = xs2.shape[0]
    for p in prange(nparts):
        for j in range(active.shape[0]):
            e = active[j]
            lo, hi = offsets[e], offsets[e + 1]
            _groups_of(q1[e], s1[e], xe, G, lo, hi, p, nparts, xs2[p], xi2[p])
            _groups_of(q3[e], s3[e], xe, U, lo, hi, p, nparts, xs2[p], xi2[p])


@njit(cache=True, parallel=True)
def _down(q2, s2, G, offsets, active, Yg, xs2, xi2):
    nparts = xs2.shape[0]
    for p in prange(nparts):
        for j in range(active.shape[0]):
            e = active[j]
            _groups_of(q2[e], s2[e], G, Yg, offsets[e], offsets[e + 1], p, nparts, xs2[p], xi2[p])


@njit(cache=True)
def experts_rows_q(q1, s1, q3, s3, q2, s2, X, order, offsets, k, Y, active, xs2, xi2):
    # (q, s) (E,I,D) / (E,D,I) quantized expert stacks (q8 or q4, each its own); order/offsets the rows grouped by
    # expert (moe.group_by_expert), active the experts with rows; X (T,D) -> Y (T*k,D): row t*k+a = the a-th
    # chosen expert of row t on x_t. xs2, xi2: one row of matvec scratch (kernels/quant.scratch) per thread part
    # (active: consecutive ones of those, ascending; only their rows, lo..hi, are read and written: moe() may run a
    # step's experts a few at a time)
    n = order.shape[0]
    D = X.shape[1]
    I = q1.shape[1]
    lo, hi = offsets[active[0]], offsets[active[-1] + 1]
    xe = np.empty((n, D), np.float32)            # X's rows in expert order
    for r in range(lo, hi):
        xe[r] = X[order[r] // k]
    G = np.empty((n, I), np.float32)
    U = np.empty((n, I), np.float32)
    Yg = np.empty((n, D), np.float32)
    _up(q1, s1, q3, s3, xe, offsets, active, G, U, xs2, xi2)
    silu_mul(G[lo:hi], U[lo:hi], G[lo:hi])
    _down(q2, s2, G, offsets, active, Yg, xs2, xi2)
    for r in range(lo, hi):
        Y[order[r]] = Yg[r]
