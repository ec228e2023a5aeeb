"""X (B, n) @ W.T for the few rows of a serving step: each weight row streamed once for all B rows.

A continuous-batching step multiplies every matrix by B rows (the next token of each decoding
sequence, B = 1..32, and per expert only the rows routed to it, ~B*top_k/E). The prefill path
(dense.matmul) converts 256-row tiles of f16/bf16 weights to f32 and calls BLAS, built for
hundreds of rows; at 4-16 rows it spends its time converting and writing tiles. Here a weight
element is loaded and converted once, in a register, and multiplied into 4 rows of X at a time
(2 weight rows x 4 rows of X: 8 accumulators), so 16 rows cost 4 passes over L1-resident
activations and one pass over the weights.

With AVX-512 (or AVX2) and f16/bf16 weights whose panel width is whole vectors, the tile is
LLVM IR instead (`_tile`): R weight rows x C rows of X (4 x 4 on zmm, 2 x 4 on ymm), R*C vector
accumulators kept across all the panels of a row and reduced once per row, the R rows' weights
read from memory once for every group of C rows of X (they stay in L1 for the next group; a last
group of fewer rows runs the tile of its own width, C = 1..3), and
asked for 4 KB ahead (kernels/prefetch: without it the tile read DRAM at a third of the matvec's rate).
The Numba loop above reduces its 8 sums once per panel and ran at ~34 GFLOP/s on one core of a
2-vCPU AVX-512 Xeon whatever T; the IR tile at 50-65 (bench-mixtral's shapes, T = 4..32; 4 x 4 was the
best of 2x8, 3x8, 4x6, 6x4, 8x2 over those shapes, one thread).

Weights are 3-D float arrays (nb, d, P): the panels of a f16p/bf16p matrix as stored (panels.py),
or a row-major (d, n) matrix viewed as one panel (1, d, n); f32, f16 (uint16 bits) or bf16 (int16
bits), converted by base.to_f32. Each output row t is its own sum over n: the rows of X do not
interact, so a row's result does not depend on which other rows share the call.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..numba_link import by_reference
from .base import _REDUCE_FM, to_f32
from .dense import _matvec_core
from .float_ir import HAVE_FLOAT_IR, HAVE_FLOAT_IR8, _widen
from .moe import silu_mul
from .prefetch import prefetch_ahead

__all__ = ["rowgemm", "rowgemm_par", "rowgemm_ref", "experts_rows", "experts_rows_par", "weighted_rows"]


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


# -- the IR tile ---------------------------------------------------------------------------------

TILE_R, TILE_C, LANES = (4, 4, 16) if HAVE_FLOAT_IR else (2, 4, 8) if HAVE_FLOAT_IR8 else (2, 4, 0)


def _make_tile(R, C, L, bf16):
    @intrinsic
    def tile(typingctx, P, i, X, t):
        # P (nb,d,Pw) 16-bit weights, C-contiguous, Pw a multiple of L; X (T,n) f32 with contiguous rows;
        # t (C,) int64 rows of X -> the R*C dots sum_b P[b,i+r] . X[t[c], b*Pw:(b+1)*Pw], r-major
        ret = types.UniTuple(types.float32, R * C)

        def codegen(context, builder, sig, args):
            pa = context.make_array(sig.args[0])(context, builder, args[0])
            xa = context.make_array(sig.args[2])(context, builder, args[2])
            ta = context.make_array(sig.args[3])(context, builder, args[3])
            i = args[1]
            f32, i16, i8, idx = ir.FloatType(), ir.IntType(16), ir.IntType(8), ir.IntType(64)
            vf, vi = ir.VectorType(f32, L), ir.VectorType(i16, L)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{L}f32")
            fadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vf]),
                                                  f"llvm.vector.reduce.fadd.v{L}f32")
            nb, d, Pw = cgutils.unpack_tuple(builder, pa.shape, 3)
            xstride = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
            wbase = builder.bitcast(pa.data, i16.as_pointer())
            xbase = builder.bitcast(xa.data, i8.as_pointer())
            tbase = builder.bitcast(ta.data, idx.as_pointer())
            xrows = [builder.bitcast(builder.gep(xbase, [builder.mul(builder.load(builder.gep(tbase, [ir.Constant(idx, c)])),
                                                                     xstride)]), f32.as_pointer()) for c in range(C)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(R * C)]
            with cgutils.for_range(builder, nb) as bl:
                b = bl.index
                wrows = [builder.gep(wbase, [builder.mul(builder.add(builder.mul(b, d), builder.add(i, ir.Constant(idx, r))),
                                                         Pw)]) for r in range(R)]
                xoff = builder.mul(b, Pw)
                with cgutils.for_range(builder, builder.sdiv(Pw, ir.Constant(idx, L))) as kl:
                    k = builder.mul(kl.index, ir.Constant(idx, L))
                    xk = builder.add(xoff, k)
                    xs = [builder.load(builder.bitcast(builder.gep(xrows[c], [xk]), vf.as_pointer()), align=4)
                          for c in range(C)]
                    prefetch_ahead(builder, wrows, builder.mul(k, ir.Constant(idx, 2)))     # 2 bytes a weight
                    for r in range(R):
                        raw = builder.load(builder.bitcast(builder.gep(wrows[r], [k]), vi.as_pointer()), align=2)
                        w = _widen(builder, raw, bf16, lanes=L)
                        for c in range(C):
                            a = accs[r * C + c]
                            builder.store(builder.call(fma, [w, xs[c], builder.load(a)]), a)
            sums = [builder.call(fadd, [ir.Constant(f32, 0.0), builder.load(a)], fastmath=("reassoc",)) for a in accs]
            return context.make_tuple(builder, sig.return_type, sums)
        return ret(P, i, X, t), codegen
    return tile


# one tile per group width c = 1..TILE_C: a step's expert gets ~B*top_k/E rows, and a group of fewer
# than TILE_C rows runs the tile of its own width instead of padding it with a repeated row (5 rows cost
# 4 + 1 columns of FMAs, not 4 + 4). A row's sums are the same FMA chain in every width: the same bits.
_tiles = {(bf16, c): _make_tile(TILE_R, c, LANES, bf16) for bf16 in (False, True) for c in range(1, TILE_C + 1)} \
    if LANES else {}


@njit(cache=True, inline="always")
def _put(out, s, t0, i, n, R):
    # a tile's R*n sums (r-major) into out[t0:t0+n, i:i+R]
    for c in range(n):
        for r in range(R):
            out[t0 + c, i + r] = s[r * n + c]


def _tiled(P, X, out, r0, r1):
    """Python stand-in (never called): Numba picks the overload below by the types."""
    raise NotImplementedError


@overload(_tiled)
def _tiled_overload(P, X, out, r0, r1):
    # the IR tile over rows r0.. in steps of TILE_R; returns the first row it did not do (r0 when it cannot)
    ok = (LANES and isinstance(P, types.Array) and P.dtype in (types.uint16, types.int16)
          and isinstance(X, types.Array) and X.dtype == types.float32)
    if not ok:
        return lambda P, X, out, r0, r1: r0
    bf16 = P.dtype == types.int16
    R, C = TILE_R, TILE_C
    assert C == 4, "the branches below are written for groups of up to 4 rows"
    tile1, tile2, tile3, tile4 = (_tiles[(bf16, c)] for c in (1, 2, 3, 4))

    def impl(P, X, out, r0, r1):
        nb, d, Pw = P.shape
        T = X.shape[0]
        if (Pw % LANES != 0 or P.strides[2] != 2 or P.strides[1] != 2 * Pw or P.strides[0] != 2 * Pw * d
                or X.strides[1] != 4 or X.shape[1] < nb * Pw):
            return r0
        t = np.empty(C, np.int64)
        i = r0
        while i + R <= r1:
            for t0 in range(0, T, C):
                n = min(C, T - t0)
                for c in range(n):
                    t[c] = t0 + c
                if n == 4:
                    _put(out, tile4(P, i, X, t), t0, i, 4, R)
                elif n == 3:
                    _put(out, tile3(P, i, X, t), t0, i, 3, R)
                elif n == 2:
                    _put(out, tile2(P, i, X, t), t0, i, 2, R)
                else:
                    _put(out, tile1(P, i, X, t), t0, i, 1, R)
            i += R
        return i
    return impl


@by_reference          # its tiles and row dots, copied into ~11 libraries otherwise: compiled once (model/numba_link)
@njit(cache=True)
def _any_rows(P, X, out, r0, r1):
    i = _tiled(P, X, out, r0, r1)
    if i < r1:
        _rows(P, X, out, i, r1)


@njit(cache=True)
def rowgemm(P, X, out):
    # P (nb,d,Pw) f32/f16/bf16 weights, X (T,n) f32 -> out (T,d) f32 = X @ W.T
    _any_rows(P, X, out, np.int64(0), P.shape[1])


@njit(cache=True, parallel=True)
def rowgemm_par(P, X, out, nchunks):
    # rowgemm with the weight rows split into nchunks runs (multiples of 4 rows) on Numba threads
    d = P.shape[1]
    for c in prange(nchunks):
        r0 = (c * d // nchunks) & ~3
        r1 = d if c == nchunks - 1 else ((c + 1) * d // nchunks) & ~3
        _any_rows(P, X, out, r0, r1)


def rowgemm_ref(W, X):
    """numpy twin: W a logical (d, n) float32 matrix."""
    return (np.asarray(X, np.float64) @ np.asarray(W, np.float64).T).astype(np.float32)


# -- a step's experts in one call -------------------------------------------------------------------
# The MoE of a serving step: every expert that got rows runs its SwiGLU over them (rows gathered, w1 and
# w3, silu*up, w2), each result row stored apart by its flat position t*k+a; the caller weights and sums
# them. One call per layer instead of a Python loop of three matrix calls per expert (bench-mixtral, 16
# rows: ~10 ms of Python and parallel launches per step); on threads the experts are shared out among
# them (each expert on one thread: no two threads write one row). A matrix with one row is a matvec,
# with more the rowgemm tile: the same kernels, so the same bits, as Workspace.mm gives each expert.

def _panel_view(W):
    """Python stand-in (never called): a matrix as rowgemm takes it, (nb,d,P) panels or (1,d,n) rows."""
    raise NotImplementedError


@overload(_panel_view, inline="always")
def _panel_view_overload(W):
    if W.ndim == 2:
        return lambda W: W.reshape((1, W.shape[0], W.shape[1]))
    return lambda W: W


@njit(cache=True)
def _expert_rows(W1, W3, W2, X, order, k, lo, hi, Y):
    # W1, W3 (I,D), W2 (D,I): one expert's matrices, rows or panels (nb,d,P); order[lo:hi] its flat
    # positions t*k+a; X (T,D) -> Y[flat] (D,) = w2 @ (silu(w1 @ x_t) * (w3 @ x_t))
    c = hi - lo
    D = X.shape[1]
    I = W1.shape[W1.ndim - 2]
    xe = np.empty((c, D), np.float32)
    for r in range(c):
        xe[r] = X[order[lo + r] // k]
    g = np.empty((c, I), np.float32)
    u = np.empty((c, I), np.float32)
    y = np.empty((c, D), np.float32)
    if c == 1:                      # Workspace.mm's one-row path: the matvec
        _matvec_core(W1, xe[0], g[0], np.float32(1.0), np.bool_(False))
        _matvec_core(W3, xe[0], u[0], np.float32(1.0), np.bool_(False))
    else:
        _any_rows(_panel_view(W1), xe, g, np.int64(0), I)
        _any_rows(_panel_view(W3), xe, u, np.int64(0), I)
    silu_mul(g, u, g)
    if c == 1:
        _matvec_core(W2, g[0], y[0], np.float32(1.0), np.bool_(False))
    else:
        _any_rows(_panel_view(W2), g, y, np.int64(0), D)
    for r in range(c):
        Y[order[lo + r]] = y[r]


@njit(cache=True)
def experts_rows(P1, P3, P2, X, order, offsets, k, Y):
    # P1, P3 (E,I,D), P2 (E,D,I) 16-bit expert stacks, rows or panels (E,nb,d,P); order/offsets the rows
    # grouped by expert (moe.group_by_expert); X (T,D) -> Y (T*k,D): row t*k+a = the a-th chosen expert
    # of row t on x_t
    for e in range(P1.shape[0]):
        if offsets[e + 1] > offsets[e]:
            _expert_rows(P1[e], P3[e], P2[e], X, order, k, offsets[e], offsets[e + 1], Y)


@njit(cache=True, parallel=True)
def experts_rows_par(P1, P3, P2, X, order, offsets, k, Y, active):
    # experts_rows with the experts that got rows (active, ascending) shared out among Numba threads
    for j in prange(active.shape[0]):
        e = active[j]
        _expert_rows(P1[e], P3[e], P2[e], X, order, k, offsets[e], offsets[e + 1], Y)


@njit(cache=True)
def weighted_rows(Y, wts, out):
    # Y (T*k,D), wts (T,k) f32 -> out (T,D) = sum over a (in order) of wts[t,a] * Y[t*k+a]
    T, k = wts.shape
    for t in range(T):
        o = out[t]
        o[:] = 0.0
        for a in range(k):
            w = wts[t, a]
            y = Y[t * k + a]
            for j in range(o.shape[0]):
                o[j] += w * y[j]
