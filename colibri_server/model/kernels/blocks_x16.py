"""Q4_K and Q6_K matrices stored as 16-row tiles (the kinds Q4_K_X16, Q6_K_X16): the tiles' micro-kernels read the
weights as they are stored, with no panel laid out per call.

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

A Q6_K block is 210 bytes: its first 52 dwords (ql, qh, the 16 int8 scales) are transposed the same way (vector q at
byte 64q of the tile's block), the 16 rows' d follow as 16 f16 (blocks.to_x16). A pass rebuilds each dword of 6-bit
values from a ql and a qh vector (blocks_panels.q6_value: 2 shifts, 2 ands, an or) and sign-extends each group's
scale from the scale vectors (q6_scale), where the Q6_K panels store both per call. 1024 x 2048 Q6_K, 64 matrices
(110 MB), Q6_K rows -> these tiles (bench/tiles_x16.py --kind q6_k --shape 1024 2048): 1 row 0.132 -> 0.131, 2 rows
0.200 -> 0.141, 4 rows 0.237 -> 0.166, 8 rows 0.284 -> 0.227, 16 rows 0.395 -> 0.375 ms.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .blocks import X16_ROWS, _put2, _rows_q4_k, _rows_q6_k
from .blocks_avx2 import KC2, pass_x16
from .blocks_ir import _arr_ptr, k_update
from .blocks_panels import Q6_WORDS, R, f16_lanes, k_min_pair, k_scale, q6_scale, q6_value, q6x_d, q6x_ptr
from .blocks_tile_ir import KC, Kernel, pass_width, q6_block_end, q6_block_sums, store_rows, xs_pairs
from .cpu import HAVE_AVX2, HAVE_VNNI512
from .prefetch import prefetch_ahead

_i32, _f32 = ir.IntType(32), ir.FloatType()

QK_DWORDS = 36             # a Q4_K block's 144 bytes
assert X16_ROWS == R
# on AVX2 kernels/blocks_avx2's micro-kernels for the same tiles (pass_x16): a 256-bit half (8 rows) at a time, 4
# activation rows a pass, sums in i16 as its panel passes add them. One thread, 64 matrices from memory
# (bench/tiles_x16.py, in turns), ms a matrix, against these micro-kernels with each 16-lane vector in two halves
# (Kernel.dpbusd's `vpmaddubsw` + `vpmaddwd` + `vpmulld` per dword): Q4_K 2048 x 1024 at 2 / 3 / 4 rows 0.126-0.131 /
# 0.155-0.172 / 0.179-0.208 -> 0.105-0.122 / 0.121-0.137 / 0.141-0.155; Q6_K 1024 x 2048 at 3 / 4 rows 0.200-0.208 /
# 0.236-0.245 -> 0.172 / 0.204-0.208. A decode token's one row takes them too: bench-mixtral Q4_K_M's fused token
# against these 16-lane kernels (bench/decode_ab.py, 2 x 3 rounds), on a Zen 3 (AVX2 its own) 1.038x / 1.030x on one
# thread and 1.062x / 1.049x on two; on a Xeon with AVX2 forced (--avx2) it had been 0.984x / 0.993x


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


class _Vectors:
    """Vectors first.. of a Q6_K_X16 tile's block, each loaded where it is used (and the next tile's same bytes asked
    into L2)."""

    def __init__(self, b, tile, blk, first, ahead, ty):
        self.b, self.tile, self.blk, self.first, self.ahead, self.ty = b, tile, blk, first, ahead, ty

    def __getitem__(self, q):
        p = q6x_ptr(self.b, self.tile, self.blk, self.first + q)
        prefetch_ahead(self.b, [p], self.ahead, ahead=0)
        return self.b.load(self.b.bitcast(p, self.ty.as_pointer()), align=4)


def _mk_q6kx(nc):
    def impl(typingctx, raw, r0, xq, xd, xs, t0, nb, res):
        sig = types.void(raw, r0, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 2)
            b = builder
            base = _arr_ptr(context, builder, signature.args[0], args[0], ir.IntType(8))
            r0 = context.cast(b, args[1], signature.args[1], types.intp)
            row_bytes = b.mul(k.nb, k.c(210))
            tile = b.gep(base, [b.mul(r0, row_bytes)])           # the tile's first byte
            ahead = b.mul(row_bytes, k.c(R))                    # bytes: the next tile's same vector, into L2

            def splat(v):
                return ir.Constant(k.v16, [v] * R)

            def body(blk, accs):
                ql, qh, sv = (_Vectors(b, tile, blk, f, ahead, k.v16) for f in (0, 32, 48))
                isum = q6_block_sums(k, blk, nc, lambda h, c, g: q6_value(b, ql, qh, h, c, g, splat),
                                     lambda g: q6_scale(b, sv, g, splat))
                q6_block_end(k, blk, accs, isum, lambda q: b.or_(b.and_(q6_scale(b, sv, 2 * q, splat), splat(0xFFFF)),
                                                                 b.shl(q6_scale(b, sv, 2 * q + 1, splat), splat(16))),
                             q6x_d(b, q6x_ptr(b, tile, blk, Q6_WORDS)))
            k.block_loop(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


_y8, _y4, _y3, _y2, _y1 = (_mk_q6kx(n) for n in (KC, 4, 3, 2, 1))


@njit(cache=True, inline="always")
def _pass(six, nc, raw, r0, Xq, Xd, XP, t0, nb, res):
    # activation rows t0..t0+nc through the Q4_K_X16 (six: Q6_K_X16) tile at row r0
    if nc == KC:
        if six:
            _y8(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _x8(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 4:
        if six:
            _y4(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _x4(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 3:
        if six:
            _y3(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _x3(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 2:
        if six:
            _y2(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _x2(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif six:
        _y1(raw, r0, Xq, Xd, XP, t0, nb, res)
    else:
        _x1(raw, r0, Xq, Xd, XP, t0, nb, res)


@njit(cache=True)
def untile(raw, size, r0, rows):
    # the rows r0..r0+R of a matrix of `size`-byte blocks stored as tiles into rows (R, row bytes): blocks.from_x16 for
    # one tile (each block: size // 4 dwords of the 16 rows transposed, then the rows' size % 4 last bytes in turn)
    n = raw.shape[1]
    w = size // 4
    tail = size - 4 * w
    for blk in range(n // size):
        for r in range(R):
            for j in range(size):
                k = blk * R * size + (64 * (j // 4) + 4 * r + j % 4 if j < 4 * w else 64 * w + tail * r + j - 4 * w)
                rows[r, blk * size + j] = raw[r0 + k // n, k % n]


@njit(cache=True)
def gemm_rows_x16(raw, six, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # blocks_gemm.gemm_rows for a Q4_K_X16 (six: Q6_K_X16) matrix (rows i0..i1, Xq rounded per 256): whole tiles through
    # the micro-kernels above (AVX-512 VNNI or AVX2), a tile cut by i0 or i1 and every tile without AVX2 as the rows
    # again (untile) through the row dots. The same bits every way. tmp: >= KC * R f32 words
    T, nb = Xq.shape[0], Xq.shape[1] // 256
    XP = xs_pairs(Xs, 1 if six else 2) if HAVE_AVX2 else np.empty((0, 0), np.int32)
    res = tmp[:KC * R]
    plain = np.empty((0, 0), np.uint8)
    part = np.empty((0, 0), np.float32)
    one, no = np.float32(1.0), np.bool_(False)
    for r0 in range(i0 // R * R, i1, R):
        a, e = max(i0, r0), min(i1, r0 + R)
        if HAVE_AVX2 and a == r0 and e == r0 + R:
            t0 = 0
            while t0 < T:
                nc = pass_width(T, t0) if HAVE_VNNI512 else min(KC2, T - t0)
                if HAVE_VNNI512:
                    _pass(six, nc, raw, r0, Xq, Xd, XP, t0, nb, res)
                else:
                    pass_x16(six, nc, raw, r0, Xq, Xd, XP, t0, nb, res)
                store_rows(res, out, t0, nc, r0, alpha, accumulate)
                t0 += nc
            continue
        if plain.shape[0] == 0:
            plain = np.empty((R, raw.shape[1]), np.uint8)
            part = np.empty((T, R), np.float32)
        if six:
            untile(raw, 210, r0, plain)
            _rows_q6_k(plain, X, Xq, Xd, Xs, part, tmp, a - r0, e - r0, one, no)
        else:
            untile(raw, 144, r0, plain)
            _rows_q4_k(plain, X, Xq, Xd, Xs, part, tmp, a - r0, e - r0, one, no)
        for t in range(T):
            for i in range(a, e):
                _put2(out, t, i, part[t, i - r0], alpha, accumulate)
