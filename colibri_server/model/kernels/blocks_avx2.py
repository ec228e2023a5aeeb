"""The k-quant, Q4_0 and Q8_0 tiles' micro-kernels for AVX2 (no VNNI): the panels of kernels/blocks_panels (16 weight rows
as the i32 lanes of a vector) read a 256-bit half at a time, 8 rows, with up to KC2 activation rows a pass; and the
Q4_K_X16 and Q6_K_X16 tiles as stored (kernels/blocks_x16), the same way, their values unpacked in registers.

AVX2 has no `vpdpbusd`; the 16-lane kernels of kernels/blocks_gemm build it from `vpmaddubsw` (u8 x s8 pairs summed
in i16), `vpmaddwd` by ones (the pairs to i32) and an add, 32 products in three instructions, and then multiply each
sub-block's i32 sums by its scale (`vpmulld`); their 16-lane vectors are two ymm registers each, so 8 activation
rows' sums do not fit in AVX2's 16 registers. Here a sub-block's (Q6_K: half a group's) `vpmaddubsw` results are
added in i16 (`vpaddw`) and one `vpmaddwd` by the sub-block's scale (the i32 scale as two equal i16) turns them
into the scaled i32 sum: about 2 instructions per 32 products rather than 3 and a share of `vpmulld`. The i16
sums are exact where they cannot leave i16: the activations are within +-127 (int8 rounding, max|x| / 127) and a
lane adds 2 products per step, so Q4_K's values (0..15) take a sub-block's 8 steps (2*8*15*127 = 30480), Q5_K's
(0..31) 4 steps (31496), Q6_K's (0..63) 2 steps (32004). The integers are those of the row dots and of the
16-lane tiles (each sub-block's scale times its sum, added over the block), then the same float step
(blocks_ir.k_update) on 8 rows: each output keeps its bits. Q8_0's signed bytes take llama.cpp's sign trick
(_mk_b32): |w| on the unsigned side, pairs of 128 x 127 within i16, each pair summed to i32 at once.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks_ir import _arr_ptr, k_update, sign_trick
from .blocks_panels import Q6_WORDS, R, k_min_pair, k_scale, q6_scale, q6_value, q6x_ptr
from .blocks_row32 import b32_total, b32_update
from .blocks_tile_ir import activation_rows
from .prefetch import prefetch_ahead

KC2 = 4                    # the k-quants' activation rows per pass (per row: an i16 sum, an i32 sum and the f32 accumulator)
# Q4_0's (per row 8 f32 accumulators, one a block mod 8, as the row dots sum them): one thread, 2048 x 1024 at 128 rows,
# 2 rows a pass 3.6 ms, 4 rows 7.9 ms (spilled)
KC40 = 2
KC80 = 4                   # Q8_0's (its sums need no correction: 8 f32 accumulators a row and the i32 sum)
X16_K_DWORDS = 36          # a Q4_K block's 144 bytes: a Q4_K_X16 tile's block is 36 16-lane vectors
H = 8                      # weight rows (i32 lanes) of a ymm register: a panel's 16 in two halves

_i8, _i16, _i32, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_idx = ir.IntType(64)
_v8, _f8 = ir.VectorType(_i32, H), ir.VectorType(_f32, H)
_b32, _w16 = ir.VectorType(_i8, 32), ir.VectorType(_i16, 16)


class _Half:
    """IR over a micro-kernel's arguments (the panel's, then xq, xd, xs, t0, nb, res): 8-lane vectors."""

    def __init__(self, context, builder, sig, args, nacts, nc):
        self.b = builder
        self.xq, self.xd, self.xs, self.t0, self.nb, self.res = activation_rows(context, builder, sig, args, nacts, nc)
        m = builder.module
        self.ubsw = cgutils.get_or_insert_function(m, ir.FunctionType(_w16, [_b32, _b32]), "llvm.x86.avx2.pmadd.ub.sw")
        self.wd = cgutils.get_or_insert_function(m, ir.FunctionType(_v8, [_w16, _w16]), "llvm.x86.avx2.pmadd.wd")

    def c(self, v):
        return ir.Constant(_idx, v)

    def vec(self, p, vi, h, ty=_v8):
        """Lanes 8h..8h+8 of the panel's 16-lane vector vi (i64) at pointer p."""
        b = self.b
        at = b.add(b.mul(vi, self.c(R)), self.c(H * h))
        return b.load(b.bitcast(b.gep(p, [at]), ty.as_pointer()), align=4)

    def splat(self, v, ty=_v8):
        s = self.b.insert_element(ir.Constant(ty, None), v, ir.Constant(_i32, 0))
        return self.b.shuffle_vector(s, ir.Constant(ty, None), ir.Constant(ir.VectorType(_i32, H), [0] * H))

    def x4(self, t, at):
        """Activation row t's 4 bytes at column `at` (i64), broadcast to 32 bytes."""
        p = self.b.bitcast(self.b.gep(self.xq[t], [at]), _i32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1)), _b32)

    def pairs(self, v):
        """An i32 vector as 16 i16 with each lane's value in both halves (its low 16 bits)."""
        b = self.b
        lo = b.and_(v, self.splat(ir.Constant(_i32, 0xFFFF)))
        return b.bitcast(b.or_(lo, b.shl(v, self.splat(ir.Constant(_i32, 16)))), _w16)

    def madd(self, acc, a, c):
        """acc + the i32 sums of the i16 pairs a * c (`vpmaddwd`)."""
        return self.b.add(acc, self.b.call(self.wd, [a, c]))

    def sums16(self, ws, t, xs_at):
        """The `vpmaddubsw` of weight vectors ws with activation row t's 4 bytes at each xs_at, added in i16."""
        b = self.b
        s = None
        for w, at in zip(ws, xs_at):
            p = b.call(self.ubsw, [w, self.x4(t, at)])
            s = p if s is None else b.add(s, p)
        return s

    def xs_pair(self, t, a0, a1):
        """(sum a0) & 0xFFFF | (sum a1) << 16 of activation row t's 16-sums at the i64 indices in a0 and a1."""
        b = self.b

        def total(ats):
            s = None
            for at in ats:
                v = b.load(b.gep(self.xs[t], [at]))
                s = v if s is None else b.add(s, v)
            return s
        lo = b.and_(total(a0), ir.Constant(_i32, 0xFFFF))
        return b.bitcast(self.splat(b.or_(lo, b.shl(total(a1), ir.Constant(_i32, 16)))), _w16)

    def store_halves(self, accs):
        """accs[t][h] (8 f32 lanes: rows 8h.. of the pass's activation row t) to res[t*R + 8h:]."""
        for t, pair in enumerate(accs):
            for h, a in enumerate(pair):
                p = self.b.bitcast(self.b.gep(self.res, [self.c(t * R + H * h)]), _f8.as_pointer())
                self.b.store(self.b.load(a), p, align=4)

    def halves(self, nc, body):
        """For each half h of the panel: acc[t] (8 f32 lanes) = body over blocks 0..nb, stored to res[t*R + 8h:]."""
        b = self.b
        for h in range(2):
            accs = [cgutils.alloca_once_value(b, ir.Constant(_f8, None)) for _ in range(nc)]
            with cgutils.for_range(b, self.nb) as loop:
                body(loop.index, h, accs)
            for t in range(nc):
                p = b.bitcast(b.gep(self.res, [self.c(t * R + H * h)]), _f8.as_pointer())
                b.store(b.load(accs[t]), p, align=4)


def _mk_q45_k(nc, five):
    def impl(typingctx, P, SC, MN, DD, DM, xq, xd, xs, t0, nb, res):
        sig = types.void(P, SC, MN, DD, DM, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = _Half(context, builder, signature, args, 5, nc)
            b = builder
            p, sc, mn, dd, dm = (_arr_ptr(context, builder, signature.args[i], args[i], _f32 if i > 2 else _i32)
                                 for i in range(5))
            zero = ir.Constant(_v8, None)
            step = 4 if five else 8         # i16 sums of at most this many vpmaddubsw (see the module docstring)

            def body(blk, h, accs):
                isum, msum = [zero] * nc, [zero] * nc
                x0 = b.mul(blk, k.c(256))
                for j in range(8):
                    # sub-block j: the panel's vectors 64b + 8j + g (blocks_panels.prep_q45_k), columns 32j + 4g
                    s = k.pairs(k.vec(sc, b.add(b.mul(blk, k.c(8)), k.c(j)), h))
                    for g0 in range(0, 8, step):
                        ws = [b.bitcast(k.vec(p, b.add(b.mul(blk, k.c(64)), k.c(8 * j + g)), h), _b32)
                              for g in range(g0, g0 + step)]
                        ats = [b.add(x0, k.c(32 * j + 4 * g)) for g in range(g0, g0 + step)]
                        for t in range(nc):
                            isum[t] = k.madd(isum[t], k.sums16(ws, t, ats), s)
                for q in range(4):
                    m = b.bitcast(k.vec(mn, b.add(b.mul(blk, k.c(4)), k.c(q)), h), _w16)
                    for t in range(nc):
                        a = b.add(b.mul(blk, k.c(16)), k.c(4 * q))
                        pair = k.xs_pair(t, [a, b.add(a, k.c(1))], [b.add(a, k.c(2)), b.add(a, k.c(3))])
                        msum[t] = k.madd(msum[t], m, pair)
                d = k.vec(dd, blk, h, _f8)
                dmin = k.vec(dm, blk, h, _f8)
                for t in range(nc):
                    xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                    b.store(k_update(b, b.load(accs[t]), isum[t], d, xdb, msum[t], dmin), accs[t])
            k.halves(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_q6_k(nc):
    def impl(typingctx, P, SC, SP, DD, xq, xd, xs, t0, nb, res):
        sig = types.void(P, SC, SP, DD, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = _Half(context, builder, signature, args, 4, nc)
            b = builder
            p, sc, sp, dd = (_arr_ptr(context, builder, signature.args[i], args[i], _f32 if i == 3 else _i32)
                             for i in range(4))
            zero = ir.Constant(_v8, None)

            def body(blk, h, accs):
                isum, off = [zero] * nc, [zero] * nc
                x0 = b.mul(blk, k.c(256))
                for gi in range(16):
                    # group gi of 16 values: the panel's vectors 64b + 32(gi // 8) + 8((gi % 8) // 2) + 4(gi % 2) + g
                    # (blocks_panels.prep_q6_k), 2 of the 4 a time in i16
                    s = k.pairs(k.vec(sc, b.add(b.mul(blk, k.c(16)), k.c(gi)), h))
                    v0 = 32 * (gi // 8) + 8 * ((gi % 8) // 2) + 4 * (gi % 2)
                    col = 128 * (gi // 8) + 32 * ((gi % 8) // 2) + 16 * (gi % 2)
                    for g0 in (0, 2):
                        ws = [b.bitcast(k.vec(p, b.add(b.mul(blk, k.c(64)), k.c(v0 + g)), h), _b32) for g in (g0, g0 + 1)]
                        ats = [b.add(x0, k.c(col + 4 * g)) for g in (g0, g0 + 1)]
                        for t in range(nc):
                            isum[t] = k.madd(isum[t], k.sums16(ws, t, ats), s)
                for q in range(8):
                    s2 = b.bitcast(k.vec(sp, b.add(b.mul(blk, k.c(8)), k.c(q)), h), _w16)
                    for t in range(nc):
                        a = b.add(b.mul(blk, k.c(16)), k.c(2 * q))
                        off[t] = k.madd(off[t], s2, k.xs_pair(t, [a], [b.add(a, k.c(1))]))
                d = k.vec(dd, blk, h, _f8)
                for t in range(nc):
                    xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                    it = b.sub(isum[t], b.shl(off[t], k.splat(ir.Constant(_i32, 5))))
                    b.store(k_update(b, b.load(accs[t]), it, d, xdb), accs[t])
            k.halves(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_b32(nc, nibbles):
    """The 32-block kinds (kernels/blocks_panels.prep_b32's panels) a block at a time, each block's exact integer sum of
    each row, then blocks_row32.b32_update into accumulator b mod 8 and b32_total, as the row dots and the 16-lane tiles do.
    Q4_0 (nibbles): the block's 8 `vpmaddubsw` (its 4 dwords' low and high nibbles, 0..15) added in i16, one `vpmaddwd`
    by ones, minus 8 times the activations' sum. Q8_0 (its panel: each byte + 128, which `vpmaddubsw` would saturate
    on): each byte flipped back to its signed value, llama.cpp's sign trick (|w| as the unsigned side, the activation
    given w's sign by `vpsignb`), one `vpmaddubsw` (pairs of 128 x 127, within i16) and one `vpmaddwd` by ones a
    dword, added over the block."""
    def impl(typingctx, P, DD, xq, xd, xs, t0, nb, res):
        sig = types.void(P, DD, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = _Half(context, builder, signature, args, 2, nc)
            b = builder
            p = _arr_ptr(context, builder, signature.args[0], args[0], _i32)
            dd = _arr_ptr(context, builder, signature.args[1], args[1], _f32)
            mask = k.splat(ir.Constant(_i32, 0x0F0F0F0F))
            four = k.splat(ir.Constant(_i32, 4))
            ones = ir.Constant(_w16, [1] * 16)
            flip = ir.Constant(_b32, [-128] * 32)

            def q40_sums(blk, x0, h):
                ws, ats = [], []
                for g in range(4):
                    w = k.vec(p, b.add(b.mul(blk, k.c(4)), k.c(g)), h)
                    ws += [b.bitcast(b.and_(w, mask), _b32), b.bitcast(b.and_(b.lshr(w, four), mask), _b32)]
                    ats += [b.add(x0, k.c(4 * g)), b.add(x0, k.c(16 + 4 * g))]
                out = []
                for t in range(nc):
                    s2 = b.gep(k.xs[t], [b.mul(blk, k.c(2))])
                    corr = b.mul(b.add(b.load(s2), b.load(b.gep(s2, [k.c(1)]))), ir.Constant(_i32, 8))
                    out.append(b.sub(k.madd(ir.Constant(_v8, None), k.sums16(ws, t, ats), ones), k.splat(corr)))
                return out

            def q80_sums(blk, x0, h):
                isum = [ir.Constant(_v8, None)] * nc
                for g in range(8):
                    w = b.xor(b.bitcast(k.vec(p, b.add(b.mul(blk, k.c(8)), k.c(g)), h), _b32), flip)
                    for t in range(nc):     # |w| the same for every row (LLVM computes it once)
                        sx, aw = sign_trick(b, w, k.x4(t, b.add(x0, k.c(4 * g))))
                        isum[t] = k.madd(isum[t], b.call(k.ubsw, [aw, sx]), ones)
                return isum
            for h in range(2):
                accs = [[cgutils.alloca_once_value(b, ir.Constant(_f8, None)) for _ in range(8)] for _ in range(nc)]
                with cgutils.for_range(b, b.sdiv(k.nb, k.c(8))) as loop:        # 8 blocks: accumulator b mod 8
                    for i in range(8):
                        blk = b.add(b.mul(loop.index, k.c(8)), k.c(i))
                        its = (q40_sums if nibbles else q80_sums)(blk, b.mul(blk, k.c(32)), h)
                        d = k.vec(dd, blk, h, _f8)
                        for t in range(nc):
                            xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                            b.store(b32_update(b, b.load(accs[t][i]), its[t], d, xdb), accs[t][i])
                for t in range(nc):
                    tot = b32_total(b, [b.load(a) for a in accs[t]])
                    b.store(tot, b.bitcast(b.gep(k.res, [k.c(t * R + H * h)]), _f8.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_q4kx(nc):
    """Q4_K_X16 tiles as stored (kernels/blocks_x16: a tile's block is the 16 rows' 36 dwords transposed), a 256-bit half
    (8 rows) at a time: each half's nibbles split in registers (`vpand`, `vpsrlw`) where a panel would hold them as
    bytes, then the panel passes' i16 sums, one `vpmaddwd` by the sub-block's scale; the scales and mins unpacked from
    the half's three header dwords (blocks_panels.k_scale, k_min_pair); xs: the activations' 32-sum pairs
    (blocks_tile_ir.xs_pairs, group 2). Blocks outer, halves inner: the tile's bytes are read from memory once."""
    def impl(typingctx, raw, r0, xq, xd, xs, t0, nb, res):
        sig = types.void(raw, r0, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = _Half(context, builder, signature, args, 2, nc)
            b = builder
            base = _arr_ptr(context, builder, signature.args[0], args[0], _i32)
            r0 = context.cast(b, args[1], signature.args[1], types.intp)
            row_words = b.mul(k.nb, k.c(X16_K_DWORDS))
            tile = b.gep(base, [b.mul(r0, row_words)])
            ahead = b.mul(row_words, k.c(4 * R))        # bytes: the next tile's same line, into L2
            zero = ir.Constant(_v8, None)

            def splat(v):
                return ir.Constant(_v8, [v] * H)
            mask, four = splat(0x0F0F0F0F), splat(4)
            accs = [[cgutils.alloca_once_value(b, ir.Constant(_f8, None)) for _ in range(2)] for _ in range(nc)]
            with cgutils.for_range(b, k.nb) as loop:
                blk = loop.index
                at = b.mul(blk, k.c(X16_K_DWORDS))            # vector q of the block: tile's vector at + q

                def vec(q, h):
                    if h == 0:
                        prefetch_ahead(b, [b.gep(tile, [b.mul(b.add(at, k.c(q)), k.c(R))])], ahead, ahead=0)
                    return k.vec(tile, b.add(at, k.c(q)), h)
                x0 = b.mul(blk, k.c(256))
                for h in range(2):
                    hd = [vec(q, h) for q in range(4)]
                    isum, msum = [zero] * nc, [zero] * nc
                    for j in range(8):
                        # sub-block j: the low (j even) or high nibbles of vectors 4 + 8(j // 2) + g, columns 32j + 4g
                        s = k.pairs(k_scale(b, hd[1:], j, splat))
                        ws = []
                        for g in range(8):
                            v = vec(4 + 8 * (j // 2) + g, h)
                            ws.append(b.bitcast(b.and_(v if j % 2 == 0 else b.lshr(v, four), mask), _b32))
                        ats = [b.add(x0, k.c(32 * j + 4 * g)) for g in range(8)]
                        for t in range(nc):
                            isum[t] = k.madd(isum[t], k.sums16(ws, t, ats), s)
                    for q in range(4):
                        m = b.bitcast(k_min_pair(b, hd[1:], q, splat), _w16)
                        for t in range(nc):
                            pair = b.load(b.gep(k.xs[t], [b.add(b.mul(blk, k.c(4)), k.c(q))]))
                            msum[t] = k.madd(msum[t], m, b.bitcast(k.splat(pair), _w16))
                    d = _f16_lanes(b, hd[0])
                    dmin = _f16_lanes(b, b.lshr(hd[0], splat(16)))
                    for t in range(nc):
                        xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                        b.store(k_update(b, b.load(accs[t][h]), isum[t], d, xdb, msum[t], dmin), accs[t][h])
            k.store_halves(accs)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


class _Q6Half:
    """Vectors first.. of a Q6_K_X16 tile's block, lanes 8lh..8lh+8 (rows of the half lh), each loaded where it is used
    (the first half's load asks for the next tile's same line into L2)."""

    def __init__(self, b, tile, blk, first, lh, ahead):
        self.b, self.tile, self.blk, self.first, self.lh, self.ahead = b, tile, blk, first, lh, ahead

    def __getitem__(self, q):
        b = self.b
        p = b.gep(q6x_ptr(b, self.tile, self.blk, self.first + q), [ir.Constant(_idx, 4 * H * self.lh)])
        if self.lh == 0:
            prefetch_ahead(b, [p], self.ahead, ahead=0)
        return b.load(b.bitcast(p, _v8.as_pointer()), align=4)


def _mk_q6kx(nc):
    """Q6_K_X16 tiles as stored (kernels/blocks_x16: ql, qh and the scales as 16-lane dwords, then the 16 rows' d), a
    256-bit half at a time: each group's 6-bit values rebuilt in registers (blocks_panels.q6_value) where a panel
    would hold them, then the Q6_K panel passes' i16 sums (2 `vpmaddubsw` a time) and one `vpmaddwd` by the group's
    scale; xs: the activations' 16-sum pairs (blocks_tile_ir.xs_pairs, group 1) against the scales' pairs."""
    def impl(typingctx, raw, r0, xq, xd, xs, t0, nb, res):
        sig = types.void(raw, r0, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = _Half(context, builder, signature, args, 2, nc)
            b = builder
            base = _arr_ptr(context, builder, signature.args[0], args[0], _i8)
            r0 = context.cast(b, args[1], signature.args[1], types.intp)
            row_bytes = b.mul(k.nb, k.c(210))
            tile = b.gep(base, [b.mul(r0, row_bytes)])
            ahead = b.mul(row_bytes, k.c(R))                # bytes: the next tile's same line, into L2
            zero = ir.Constant(_v8, None)

            def splat(v):
                return ir.Constant(_v8, [v] * H)
            accs = [[cgutils.alloca_once_value(b, ir.Constant(_f8, None)) for _ in range(2)] for _ in range(nc)]
            with cgutils.for_range(b, k.nb) as loop:
                blk = loop.index
                x0 = b.mul(blk, k.c(256))
                for lh in range(2):
                    ql, qh, sv = (_Q6Half(b, tile, blk, first, lh, ahead) for first in (0, 32, 48))
                    isum, off = [zero] * nc, [zero] * nc
                    for gi in range(16):
                        # group gi: values 128h + 32c + 16(gi % 2).., dwords g = 4(gi % 2).. of q6_value(h, c, g)
                        h, c = gi // 8, (gi % 8) // 2
                        s = k.pairs(q6_scale(b, sv, gi, splat))
                        for g0 in (0, 2):
                            gs = [4 * (gi % 2) + g0, 4 * (gi % 2) + g0 + 1]
                            ws = [b.bitcast(q6_value(b, ql, qh, h, c, g, splat), _b32) for g in gs]
                            ats = [b.add(x0, k.c(128 * h + 32 * c + 4 * g)) for g in gs]
                            for t in range(nc):
                                isum[t] = k.madd(isum[t], k.sums16(ws, t, ats), s)
                    for q in range(8):
                        pair = b.or_(b.and_(q6_scale(b, sv, 2 * q, splat), splat(0xFFFF)),
                                     b.shl(q6_scale(b, sv, 2 * q + 1, splat), splat(16)))
                        for t in range(nc):
                            xp = b.load(b.gep(k.xs[t], [b.add(b.mul(blk, k.c(8)), k.c(q))]))
                            off[t] = k.madd(off[t], b.bitcast(pair, _w16), b.bitcast(k.splat(xp), _w16))
                    dp = b.gep(q6x_ptr(b, tile, blk, Q6_WORDS), [k.c(2 * H * lh)])
                    d = b.fpext(b.load(b.bitcast(dp, ir.VectorType(ir.HalfType(), H).as_pointer()), align=2), _f8)
                    for t in range(nc):
                        xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                        it = b.sub(isum[t], b.shl(off[t], splat(5)))
                        b.store(k_update(b, b.load(accs[t][lh]), it, d, xdb), accs[t][lh])
            k.store_halves(accs)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _f16_lanes(b, v):
    """The low 16 bits of each of 8 i32 lanes as IEEE half -> <8 x float>, exact."""
    h = b.bitcast(b.trunc(v, ir.VectorType(_i16, H)), ir.VectorType(ir.HalfType(), H))
    return b.fpext(h, _f8)


_q4k_4, _q4k_3, _q4k_2, _q4k_1 = (_mk_q45_k(n, False) for n in (4, 3, 2, 1))
_q5k_4, _q5k_3, _q5k_2, _q5k_1 = (_mk_q45_k(n, True) for n in (4, 3, 2, 1))
_q6k_4, _q6k_3, _q6k_2, _q6k_1 = (_mk_q6_k(n) for n in (4, 3, 2, 1))
_q40_2, _q40_1 = _mk_b32(2, True), _mk_b32(1, True)
_q80_4, _q80_3, _q80_2, _q80_1 = (_mk_b32(n, False) for n in (4, 3, 2, 1))
_q4kx_4, _q4kx_3, _q4kx_2, _q4kx_1 = (_mk_q4kx(n) for n in (4, 3, 2, 1))
_q6kx_4, _q6kx_3, _q6kx_2, _q6kx_1 = (_mk_q6kx(n) for n in (4, 3, 2, 1))


@njit(cache=True, inline="always")
def pass_width(T, t0):
    # the rows of the next pass from t0: KC2 while KC2 remain, then the last 1-3 in one pass
    left = T - t0
    return KC2 if left >= KC2 else left


@njit(cache=True, inline="always")
def pass_q45_k(nc, five, P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..KC2) through a Q4_K (Q5_K: five) panel
    if nc == 4:
        if five:
            _q5k_4(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
        else:
            _q4k_4(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
    elif nc == 3:
        if five:
            _q5k_3(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
        else:
            _q4k_3(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
    elif nc == 2:
        if five:
            _q5k_2(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
        else:
            _q4k_2(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
    else:
        if five:
            _q5k_1(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
        else:
            _q4k_1(P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)


@njit(cache=True, inline="always")
def pass_q6_k(nc, P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..KC2) through a Q6_K panel
    if nc == 4:
        _q6k_4(P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res)
    elif nc == 3:
        _q6k_3(P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res)
    elif nc == 2:
        _q6k_2(P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res)
    else:
        _q6k_1(P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res)


@njit(cache=True, inline="always")
def pass_q40(nc, P, DD, Xq, Xd, Xs, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..KC40) through a Q4_0 panel
    if nc == 2:
        _q40_2(P, DD, Xq, Xd, Xs, t0, nb, res)
    else:
        _q40_1(P, DD, Xq, Xd, Xs, t0, nb, res)


@njit(cache=True, inline="always")
def pass_x16(six, nc, raw, r0, Xq, Xd, XP, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..KC2) through the Q4_K_X16 (six: Q6_K_X16) tile at row r0, as stored
    if nc == 4:
        if six:
            _q6kx_4(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _q4kx_4(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 3:
        if six:
            _q6kx_3(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _q4kx_3(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif nc == 2:
        if six:
            _q6kx_2(raw, r0, Xq, Xd, XP, t0, nb, res)
        else:
            _q4kx_2(raw, r0, Xq, Xd, XP, t0, nb, res)
    elif six:
        _q6kx_1(raw, r0, Xq, Xd, XP, t0, nb, res)
    else:
        _q4kx_1(raw, r0, Xq, Xd, XP, t0, nb, res)


@njit(cache=True, inline="always")
def pass_q80(nc, P, DD, Xq, Xd, Xs, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..KC80) through a Q8_0 panel
    if nc == 4:
        _q80_4(P, DD, Xq, Xd, Xs, t0, nb, res)
    elif nc == 3:
        _q80_3(P, DD, Xq, Xd, Xs, t0, nb, res)
    elif nc == 2:
        _q80_2(P, DD, Xq, Xd, Xs, t0, nb, res)
    else:
        _q80_1(P, DD, Xq, Xd, Xs, t0, nb, res)
