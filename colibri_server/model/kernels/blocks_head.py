"""The output head's Q6_K tiles: 16 weight rows of a Q6_K head at once against int16 activations (a kind id + ACTS16).

llama-quantize writes the head of its k-quant and Q4_0 files in Q6_K, and colibri rounds the head's activations to
int16 (kernels/blocks_wide: its two best logits can be near enough for an int8 rounding to swap them). The row dots
there decode each weight row once for 8 activation rows and reduce each block's 16 lanes per row: at 16 rows, one
thread, 32000 x 1024 took 11.4 ms, against 5.0 for the same head's int8 tiles (kernels/blocks_gemm). A serving step
pays that every step: 20% of a 16-row step of bench-mixtral Q4_K_M.

Here a tile is blocks_panels.prep_q6_k's int8 panel (the 6-bit values 0..63 as bytes, lane r weight row r) and each
int16 activation X = 256 H + L is split into its high byte H (signed) and its low byte L (0..255) once per call
(split16, into an array of T x 2n bytes the call allocates, as kernels/experts_blocks allocates its rows), so
that q . X = 256 (q . H) + L . q takes two `vpdpbusd` on 4 values of 16 rows: values as the unsigned side against
H, L as the unsigned side against the values (0..63 fit the signed side). Per block and activation row, exact in i32 lanes:
A = sum_g s_g (q . H)_g and B = sum_g s_g (L . q)_g over the 16 groups (|A| <= 16 * 128 * 16 * 63 * 128, |B| <= 16 *
128 * 16 * 63 * 255, both < 2^31), O = sum_g s_g S_g with S_g the group's 16-sum of X (|O| <= 16 * 128 * 16 * 32767
< 2^31); then in i64 I = 256 A + B - 32 O: the block integer sum_g s_g ((q - 32) . X)_g of the row dots
(blocks_wide._krow), and the same float step (blocks_ir.k_update), so each output has their bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .blocks_ir import _arr_ptr, k_update
from .blocks_panels import R, prep_q6_k, q6_panel
from .blocks_tile_ir import Kernel, store_rows

__all__ = ["HEAD_TILE_MIN_ROWS", "split16", "tiles_q6_kw"]

# from this many activation rows the Q6_K head runs through these tiles rather than blocks_wide's row dots
HEAD_TILE_MIN_ROWS = 4
HEAD_PASS = 4              # activation rows per pass (5 vectors live a row: two group sums, A, B, O)

_i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()


@njit(cache=True)
def split16(Xq, X2):
    # the int16 activations in Xq (T, >= 2n) i8 -> X2 (T, 2n) u8: row t's low bytes L (0..255) in X2[t, :n], its high
    # bytes H (as u8, read as i8 by the kernel) in X2[t, n:]
    n = X2.shape[1] // 2
    for t in range(X2.shape[0]):
        v = Xq[t][:2 * n].view(np.int16)
        for k in range(n):
            x = np.int32(v[k])
            X2[t, k] = np.uint8(x & 255)
            X2[t, n + k] = np.uint8((x >> 8) & 255)


def _mk_q6_kw(nc):
    def impl(typingctx, P, SC, DD, x2, xd, xs, t0, nb, res):
        sig = types.void(P, SC, DD, x2, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 3)
            b = builder
            p, sc = (_arr_ptr(context, builder, signature.args[i], args[i], _i32) for i in range(2))
            dd = _arr_ptr(context, builder, signature.args[2], args[2], _f32)
            zero = ir.Constant(k.v16, None)
            v64 = ir.VectorType(_i64, R)
            n = b.mul(k.nb, k.c(256))

            def wide(v, m):
                return b.mul(b.sext(v, v64), ir.Constant(v64, [m] * R))

            def body(blk, accs):
                A, B, O = [zero] * nc, [zero] * nc, [zero] * nc
                x0 = b.mul(blk, k.c(256))
                for gi in range(16):        # group gi: values 16 gi .. 16 gi + 15 of the block
                    h, c, g0 = gi // 8, (gi % 8) // 2, 4 * (gi % 2)
                    gh, gl = [zero] * nc, [zero] * nc
                    for g in range(g0, g0 + 4):
                        q = k.vec(p, b.mul(b.add(b.mul(blk, k.c(64)), k.c(32 * h + 8 * c + g)), k.c(R)))
                        col = b.add(x0, k.c(128 * h + 32 * c + 4 * g))
                        for t in range(nc):
                            gh[t] = k.dpbusd(gh[t], q, k.x4(t, b.add(n, col)))
                            gl[t] = k.dpbusd(gl[t], k.x4(t, col), q)
                    s = k.vec(sc, b.mul(b.add(b.mul(blk, k.c(16)), k.c(gi)), k.c(R)))
                    for t in range(nc):
                        A[t] = b.add(A[t], b.mul(gh[t], s))
                        B[t] = b.add(B[t], b.mul(gl[t], s))
                        O[t] = b.add(O[t], b.mul(k.xs1(t, b.add(b.mul(blk, k.c(16)), k.c(gi))), s))
                d = k.vec(dd, b.mul(blk, k.c(R)), k.f16)
                for t in range(nc):
                    it = b.sub(b.add(wide(A[t], 256), wide(B[t], 1)), wide(O[t], 32))
                    xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), k.f16)
                    b.store(k_update(b, b.load(accs[t]), it, d, xdb), accs[t])
            k.block_loop(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


_q6kw_4, _q6kw_3, _q6kw_2, _q6kw_1 = (_mk_q6_kw(n) for n in (4, 3, 2, 1))


@njit(cache=True, inline="always")
def _pass(nc, P, SC, DD, X2, Xd, Xs, t0, nb, res):
    if nc == 4:
        _q6kw_4(P, SC, DD, X2, Xd, Xs, t0, nb, res)
    elif nc == 3:
        _q6kw_3(P, SC, DD, X2, Xd, Xs, t0, nb, res)
    elif nc == 2:
        _q6kw_2(P, SC, DD, X2, Xd, Xs, t0, nb, res)
    else:
        _q6kw_1(P, SC, DD, X2, Xd, Xs, t0, nb, res)


@njit(cache=True)
def tiles_q6_kw(raw, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # rows i0..i0 + R*k (whole tiles) of a Q6_K matrix times every row of Xq (T, 2n) i8 holding the int16 activations
    # (blocks_wide.round_rows16: Xd their per-256 scales, Xs their 16-sums); tmp >= blocks_gemm.scratch_words(n) f32
    nb = Xq.shape[1] // 512
    T = Xq.shape[0]
    X2 = np.empty((T, 512 * nb), np.uint8)
    split16(Xq, X2)
    P, SC, SP, DD, rest = q6_panel(tmp, nb)
    res = rest[:HEAD_PASS * R]
    for r0 in range(i0, i1 - R + 1, R):
        prep_q6_k(raw, r0, nb, P, SC, SP, DD)
        t0 = 0
        while t0 < T:
            nc = min(HEAD_PASS, T - t0)
            _pass(nc, P, SC, DD, X2, Xd, Xs, t0, nb, res)
            store_rows(res, out, t0, nc, r0, alpha, accumulate)
            t0 += nc
