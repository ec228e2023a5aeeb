"""A serving step's block-kind experts in one call: the counterpart of experts_q (q8/q4) for llama.cpp's block kinds.

moe() ran a step's block-kind experts one after another from Python, three matrix calls each (gather,
w1, w3, w2, scatter), each matrix on the threads only when big enough, and at a few rows per expert
(16 rows, top-2 of 8: ~4) each call through the tiled GEMM, whose panel layout costs more than those
rows' products. Here one call per layer runs every expert that got rows: their rows gathered and
rounded once, then each thread part takes its share of the weight rows of every active expert's w1
and w3 (one parallel region) and of w2 (a second), each through blocks_gemm.gemm_rows (the tiles,
or kernels/blocks_small's small-T product where they do not run), so the work is even however the
rows fell on the experts. The rows' gathering and rounding, the SwiGLU between and the scatter back are split
over the same parts (rows for the first two, the part's own output columns for the scatter), so on two threads
no step runs on one alone. Every product is the row dot's bits for its rows (rounded the same way), so
the output is the per-expert path's. A decode token's chosen experts on threads (experts_decode_par) take the same
gemm_rows in two parallel regions, each thread part whole tiles of rows (q4_k_x16's and q6_k_x16's tiles are read whole).

Legend as in moe.py: T rows, k chosen experts per row, D hidden, I expert intermediate, n = T*k.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks import QB, SB, _kround, round_rows
from .blocks_gemm import R, gemm_rows
from .moe import _silu_mul_1d, silu_mul

__all__ = ["experts_decode_par", "experts_rows_blocks"]


@njit(cache=True, inline="always")
def _share(d, p, nparts):
    # part p's weight rows of d: whole tiles of R rows (the tiles' boundaries), the parts even
    tiles = (d + R - 1) // R
    return min(d, p * tiles // nparts * R), min(d, (p + 1) * tiles // nparts * R)


@njit(cache=True, parallel=True)
def _up(r1, k1, r3, k3, xe, q1, d1, s1, q3, d3, s3, offsets, active, G, U, tmps):
    nparts = tmps.shape[0]
    one, no = np.float32(1.0), np.bool_(False)     # not literals: gemm_rows' one compile with matmul_blocks' types
    for p in prange(nparts):
        i0, i1 = _share(G.shape[1], p, nparts)
        for j in range(active.shape[0]):
            e = active[j]
            lo, hi = offsets[e], offsets[e + 1]
            gemm_rows(r1[e], k1, xe[lo:hi], q1[lo:hi], d1[lo:hi], s1[lo:hi], G[lo:hi], tmps[p], i0, i1, one, no)
            gemm_rows(r3[e], k3, xe[lo:hi], q3[lo:hi], d3[lo:hi], s3[lo:hi], U[lo:hi], tmps[p], i0, i1, one, no)


@njit(cache=True, parallel=True)
def _down(r2, k2, G, gq, gd, gs, offsets, active, Yg, order, Y, tmps, first, last):
    # each part's columns of Yg (its share of w2's rows), then those columns of rows first..last scattered to Y (row
    # order[r] = Yg[r]): a part owns its columns, so no other part waits for it
    nparts = tmps.shape[0]
    one, no = np.float32(1.0), np.bool_(False)     # not literals: gemm_rows' one compile with matmul_blocks' types
    for p in prange(nparts):
        i0, i1 = _share(Yg.shape[1], p, nparts)
        for j in range(active.shape[0]):
            e = active[j]
            lo, hi = offsets[e], offsets[e + 1]
            gemm_rows(r2[e], k2, G[lo:hi], gq[lo:hi], gd[lo:hi], gs[lo:hi], Yg[lo:hi], tmps[p], i0, i1, one, no)
        for r in range(first, last):
            Y[order[r], i0:i1] = Yg[r, i0:i1]


@njit(cache=True, parallel=True)
def _gather_round(X, order, k, k1, k3, xe, q1, d1, s1, q3, d3, s3, nparts):
    # X's rows in expert order (xe[r] = X[order[r] // k]) rounded for k1 (and k3 when its rounding differs), the
    # rows split over nparts
    n = order.shape[0]
    same = _kround(k1) == _kround(k3)
    for p in prange(nparts):
        r0, r1 = p * n // nparts, (p + 1) * n // nparts
        for r in range(r0, r1):
            xe[r] = X[order[r] // k]
        round_rows(k1, xe[r0:r1], q1[r0:r1], d1[r0:r1], s1[r0:r1])
        if not same:
            round_rows(k3, xe[r0:r1], q3[r0:r1], d3[r0:r1], s3[r0:r1])


@njit(cache=True, parallel=True)
def _silu_round(G, U, k2, gq, gd, gs, nparts):
    # G = silu(G) * U, then G rounded for k2, the rows split over nparts
    n = G.shape[0]
    for p in prange(nparts):
        r0, r1 = p * n // nparts, (p + 1) * n // nparts
        silu_mul(G[r0:r1], U[r0:r1], G[r0:r1])
        round_rows(k2, G[r0:r1], gq[r0:r1], gd[r0:r1], gs[r0:r1])


@njit(cache=True)
def experts_rows_blocks(r1, k1, r3, k3, r2, k2, X, order, offsets, k, Y, active, tmps):
    # r1, r3 (E,I,row bytes) / r2 (E,D,row bytes) block-kind expert stacks of GGML types k1, k3, k2; order/offsets
    # the rows grouped by expert (moe.group_by_expert), active the experts with rows (or consecutive ones of them,
    # ascending: only their rows, lo..hi, are read and written; moe() may run a step's experts a few at a time);
    # X (T,D) -> Y (T*k,D): row t*k+a = the a-th chosen expert of row t on x_t. tmps (parts, >=
    # blocks_gemm.scratch_words(max(D, I))) f32: one scratch per thread part
    n = order.shape[0]
    lo, hi = offsets[active[0]], offsets[active[-1] + 1]
    D = X.shape[1]
    I = r1.shape[1]
    nparts = tmps.shape[0]
    xe = np.empty((n, D), np.float32)            # X's rows in expert order
    q1, d1, s1 = np.empty((n, D), np.int8), np.empty((n, D // QB), np.float32), np.empty((n, D // SB), np.int32)
    if _kround(k1) == _kround(k3):               # one rounding of the rows serves both up matrices
        q3, d3, s3 = q1, d1, s1
    else:
        q3, d3, s3 = np.empty((n, D), np.int8), np.empty((n, D // QB), np.float32), np.empty((n, D // SB), np.int32)
    _gather_round(X, order[lo:hi], k, k1, k3, xe[lo:hi], q1[lo:hi], d1[lo:hi], s1[lo:hi], q3[lo:hi], d3[lo:hi],
                  s3[lo:hi], nparts)
    G = np.empty((n, I), np.float32)
    U = np.empty((n, I), np.float32)
    _up(r1, k1, r3, k3, xe, q1, d1, s1, q3, d3, s3, offsets, active, G, U, tmps)
    gq, gd, gs = np.empty((n, I), np.int8), np.empty((n, I // QB), np.float32), np.empty((n, I // SB), np.int32)
    _silu_round(G[lo:hi], U[lo:hi], k2, gq[lo:hi], gd[lo:hi], gs[lo:hi], nparts)
    Yg = np.empty((n, D), np.float32)
    _down(r2, k2, G, gq, gd, gs, offsets, active, Yg, order, Y, tmps, lo, hi)


@njit(cache=True, parallel=True)
def experts_decode_par(r1, k1, r3, k3, r2, k2, idx, wts, x, H1, H3, out, Xq, Xd, Xs, Hq, Hd, Hs, tmps):
    # one token's chosen experts (idx (A,), weights wts (A,)) of block-kind stacks r1, r3 (E, I, row bytes), r2 (E, D, row
    # bytes) on x (1, D) -> out (1, D) += sum_a wts[a] * expert idx[a](x), in two parallel regions (the up rows of every
    # chosen expert split over tmps.shape[0] parts, then the down rows), the same products and order as one
    # expert after another on one thread (each part whole tiles: _share). Scratch: H1, H3 (A, I) f32; Xq/Xd/Xs x's
    # rounding; Hq/Hd/Hs (A, ...) H1's
    A = idx.shape[0]
    I = H1.shape[1]
    D = out.shape[1]
    nt = tmps.shape[0]
    round_rows(k1, x, Xq, Xd, Xs)
    same = _kround(k1) == _kround(k3)           # one rounding of x serves both up matrices
    one = np.float32(1.0)
    for p in prange(nt):
        i0, i1 = _share(I, p, nt)
        for a in range(A):
            e = idx[a]
            gemm_rows(r1[e], k1, x, Xq, Xd, Xs, H1[a:a + 1], tmps[p], i0, i1, one, np.bool_(False))
            if same:
                gemm_rows(r3[e], k3, x, Xq, Xd, Xs, H3[a:a + 1], tmps[p], i0, i1, one, np.bool_(False))
    if not same:
        round_rows(k3, x, Xq, Xd, Xs)
        for p in prange(nt):
            i0, i1 = _share(I, p, nt)
            for a in range(A):
                gemm_rows(r3[idx[a]], k3, x, Xq, Xd, Xs, H3[a:a + 1], tmps[p], i0, i1, one, np.bool_(False))
    for a in range(A):
        _silu_mul_1d(H1[a], H3[a])
    round_rows(k2, H1, Hq, Hd, Hs)
    for p in prange(nt):
        j0, j1 = _share(D, p, nt)
        for a in range(A):
            gemm_rows(r2[idx[a]], k2, H1[a:a + 1], Hq[a:a + 1], Hd[a:a + 1], Hs[a:a + 1], out, tmps[p], j0, j1,
                      wts[a], np.bool_(True))
