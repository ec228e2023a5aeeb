"""Q4_K matrices stored as 16-row tiles (the kind Q4_K_X16): the tiles' micro-kernels read the weights as they are
stored, with no panel laid out per call.

A Q4_K block is 36 dwords (d | dmin, the 12 packed scale bytes, the 128 bytes of nibbles). In a Q4_K_X16 matrix
rows 16i..16i+15 are one tile, and a tile's block b is the transpose of those 16 rows' block b: dword q of row r at
dword 16q + r of the tile's block (2304 bytes, the 16 rows' bytes moved, none added). Vector q of a tile's block is
then what kernels/blocks_panels lays out for the Q4_K tiles by register transposes at each call (its lanes are the
16 rows), so here a pass loads each 64 bytes of nibbles once, splits them into the two sub-blocks' values (`vpand`,
`vpsrld`) and multiplies them into every activation row of the pass; the scales and mins are unpacked from their
three vectors as each is needed (blocks_panels.k_scale, k_min_pair). The integers and float operations are the Q4_K tiles',
so every output keeps the bits of the row dots on the file's own Q4_K rows. A tile is 16 x row bytes contiguous, read
front to back (the next tile's same vector asked into L2 as each is loaded), and a decode token's one activation row
takes the same micro-kernel: no horizontal sum per row and block as the row dots do.

One thread, 2048 x 1024 matrices, ms a matrix, Q4_K rows (panel + tiles; one row: row dots) -> these tiles
(bench/tiles_x16.py): in L2 at 1 / 4 / 8 rows 0.072 / 0.098 / 0.138 -> 0.029 / 0.061 / 0.102; cycling through 64
(75 MB, memory) 0.097 / 0.133 / 0.169 -> 0.090 / 0.119 / 0.150.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .blocks import X16_ROWS, _put2, _rows_q4_k
from .blocks_ir import _arr_ptr, k_update
from .blocks_panels import R, f16_lanes, k_min_pair, k_scale
from .blocks_tile_ir import KC, Kernel, pass_width, store_rows, xs_pairs
from .cpu import HAVE_AVX2, HAVE_VNNI512
from .prefetch import prefetch_ahead

_i32, _f32 = ir.IntType(32), ir.FloatType()

QK_DWORDS = 36             # a Q4_K block's 144 bytes
assert X16_ROWS == R
# on AVX2 the same micro-kernels, each 16-lane vector in two 256-bit halves (blocks_tile_ir.Kernel.dpbusd: `vpmaddubsw`
# + `vpmaddwd`, exact on nibbles), at most 4 activation rows a pass (8 would hold 32 of the 16 ymm registers). One
# thread, bench-mixtral Q4_K_M forced to AVX2: the fused decode token 8.6-8.7 ms (the Q4_K rows' row dots 9.3-9.8;
# these tiles through a panel and blocks_avx2's passes 10.6-11.3), a 16-row step 69-72 ms either way
AVX2_PASS = 4


def _mk_q4kx(nc):
    def impl(typingctx, raw, r0, xq, xd, xs, t0, nb, res):
        sig = types.void(raw, r0, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 2)
            b = builder
            base = _arr_ptr(context, builder, signature.args[0], args[0], _i32)
            r0 = context.cast(b, args[1], signature.args[1], types.intp)
            row_words = b.mul(k.nb, k.c(QK_DWORDS))
            tile = b.gep(base, [b.mul(r0, row_words)])         # the tile's first dword
            zero = ir.Constant(k.v16, None)
            ahead = b.mul(row_words, k.c(4 * R))        # bytes: the next tile's same vector, into L2

            def splat(v):
                return ir.Constant(k.v16, [v] * R)

            def body(blk, accs):
                at = b.mul(blk, k.c(QK_DWORDS * R))

                def vec(q):
                    i = b.add(at, k.c(q * R))
                    prefetch_ahead(b, [b.gep(tile, [i])], ahead, ahead=0)
                    return k.vec(tile, i)
                h = [vec(q) for q in range(4)]
                isum = [zero] * nc
                x0 = b.mul(blk, k.c(256))
                for c in range(4):
                    sa, sb = [zero] * nc, [zero] * nc
                    for g in range(8):
                        v = vec(4 + 8 * c + g)
                        lo = b.and_(v, splat(0x0F0F0F0F))
                        hi = b.and_(b.lshr(v, splat(4)), splat(0x0F0F0F0F))
                        for t in range(nc):
                            sa[t] = k.dpbusd(sa[t], lo, k.x4(t, b.add(x0, k.c(64 * c + 4 * g))))
                            sb[t] = k.dpbusd(sb[t], hi, k.x4(t, b.add(x0, k.c(64 * c + 32 + 4 * g))))
                    s0, s1 = k_scale(b, h[1:], 2 * c, splat), k_scale(b, h[1:], 2 * c + 1, splat)
                    for t in range(nc):
                        isum[t] = b.add(isum[t], b.add(b.mul(sa[t], s0), b.mul(sb[t], s1)))
                msum = [zero] * nc
                for q in range(4):
                    m = k_min_pair(b, h[1:], q, splat)
                    for t in range(nc):
                        msum[t] = k.dpwssd(msum[t], m, k.xs1(t, b.add(b.mul(blk, k.c(4)), k.c(q))))
                d = f16_lanes(b, h[0])
                dmin = f16_lanes(b, b.lshr(h[0], splat(16)))
                for t in range(nc):
                    xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), k.f16)
                    b.store(k_update(b, b.load(accs[t]), isum[t], d, xdb, msum[t], dmin), accs[t])
            k.block_loop(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


_x8, _x4, _x3, _x2, _x1 = (_mk_q4kx(n) for n in (KC, 4, 3, 2, 1))


@njit(cache=True, inline="always")
def _pass(nc, raw, r0, Xq, Xd, XP, t0, nb, res):
    if nc == KC:
        _x8(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 4:
        _x4(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 3:
        _x3(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 2:
        _x2(raw, r0, Xq, Xd, XP, t0, nb, res)
    else:
        _x1(raw, r0, Xq, Xd, XP, t0, nb, res)


@njit(cache=True)
def untile(raw, r0, rows):
    # the Q4_K rows r0..r0+R of a Q4_K_X16 matrix into rows (R, row bytes): blocks.from_x16 for one tile
    w = raw.view(np.uint32)
    W = w.shape[1]
    out = rows.view(np.uint32)
    for q in range(W):
        blk, j = divmod(q, QK_DWORDS)
        for r in range(R):
            out[r, q] = w[r0 + (blk * QK_DWORDS * R + j * R + r) // W, (blk * QK_DWORDS * R + j * R + r) % W]


@njit(cache=True)
def gemm_rows_x16(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # blocks_gemm.gemm_rows for a Q4_K_X16 matrix (rows i0..i1, Xq rounded per 256): whole tiles through the micro-kernels
    # above (AVX-512 VNNI or AVX2), a tile cut by i0 or i1 and every tile without AVX2 as Q4_K rows again (untile)
    # through the row dots. The same bits every way. tmp: >= KC * R f32 words
    T, nb = Xq.shape[0], Xq.shape[1] // 256
    XP = xs_pairs(Xs, 2) if HAVE_AVX2 else np.empty((0, 0), np.int32)
    res = tmp[:KC * R]
    plain = np.empty((0, 0), np.uint8)
    part = np.empty((0, 0), np.float32)
    one, no = np.float32(1.0), np.bool_(False)
    for r0 in range(i0 // R * R, i1, R):
        a, e = max(i0, r0), min(i1, r0 + R)
        if HAVE_AVX2 and a == r0 and e == r0 + R:
            t0 = 0
            while t0 < T:
                nc = pass_width(T, t0) if HAVE_VNNI512 else min(AVX2_PASS, T - t0)
                _pass(nc, raw, r0, Xq, Xd, XP, t0, nb, res)
                store_rows(res, out, t0, nc, r0, alpha, accumulate)
                t0 += nc
            continue
        if plain.shape[0] == 0:
            plain = np.empty((R, raw.shape[1]), np.uint8)
            part = np.empty((T, R), np.float32)
        untile(raw, r0, plain)
        _rows_q4_k(plain, X, Xq, Xd, Xs, part, tmp, a - r0, e - r0, one, no)
        for t in range(T):
            for i in range(a, e):
                _put2(out, t, i, part[t, i - r0], alpha, accumulate)
