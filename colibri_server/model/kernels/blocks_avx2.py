"""The k-quant and Q4_0 tiles' micro-kernels for AVX2 (no VNNI): the panels of kernels/blocks_panels (16 weight rows as the
i32 lanes of a vector) read a 256-bit half at a time, 8 rows, with up to KC2 activation rows a pass.

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
(blocks_ir.k_update) on 8 rows: each output keeps its bits.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks_ir import _arr_ptr, b32_total, b32_update, k_update
from .blocks_panels import R
from .blocks_tile_ir import activation_rows

KC2 = 4                    # the k-quants' activation rows per pass (per row: an i16 sum, an i32 sum and the f32 accumulator)
# Q4_0's (per row 8 f32 accumulators, one a block mod 8, as the row dots sum them): one thread, 2048 x 1024 at 128 rows,
# 2 rows a pass 3.6 ms, 4 rows 7.9 ms (spilled)
KC40 = 2
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


def _mk_q40(nc):
    """Q4_0 (kernels/blocks_panels.prep_b32's nibble panel): a block's 8 `vpmaddubsw` (its 4 dwords' low and high
    nibbles, 0..15) added in i16, one `vpmaddwd` by ones, minus 8 times the activations' sum; then blocks_ir.b32_update
    into accumulator b mod 8 and b32_total, as the row dots and the 16-lane tiles do."""
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
            for h in range(2):
                accs = [[cgutils.alloca_once_value(b, ir.Constant(_f8, None)) for _ in range(8)] for _ in range(nc)]
                with cgutils.for_range(b, b.sdiv(k.nb, k.c(8))) as loop:        # 8 blocks: accumulator b mod 8
                    for i in range(8):
                        blk = b.add(b.mul(loop.index, k.c(8)), k.c(i))
                        x0 = b.mul(blk, k.c(32))
                        ws, ats = [], []
                        for g in range(4):
                            w = k.vec(p, b.add(b.mul(blk, k.c(4)), k.c(g)), h)
                            ws += [b.bitcast(b.and_(w, mask), _b32), b.bitcast(b.and_(b.lshr(w, four), mask), _b32)]
                            ats += [b.add(x0, k.c(4 * g)), b.add(x0, k.c(16 + 4 * g))]
                        d = k.vec(dd, blk, h, _f8)
                        for t in range(nc):
                            s2 = b.gep(k.xs[t], [b.mul(blk, k.c(2))])
                            corr = b.mul(b.add(b.load(s2), b.load(b.gep(s2, [k.c(1)]))), ir.Constant(_i32, 8))
                            it = b.sub(k.madd(ir.Constant(_v8, None), k.sums16(ws, t, ats), ones), k.splat(corr))
                            xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), _f8)
                            b.store(b32_update(b, b.load(accs[t][i]), it, d, xdb), accs[t][i])
                for t in range(nc):
                    tot = b32_total(b, [b.load(a) for a in accs[t]])
                    b.store(tot, b.bitcast(b.gep(k.res, [k.c(t * R + H * h)]), _f8.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


_q4k_4, _q4k_3, _q4k_2, _q4k_1 = (_mk_q45_k(n, False) for n in (4, 3, 2, 1))
_q5k_4, _q5k_3, _q5k_2, _q5k_1 = (_mk_q45_k(n, True) for n in (4, 3, 2, 1))
_q6k_4, _q6k_3, _q6k_2, _q6k_1 = (_mk_q6_k(n) for n in (4, 3, 2, 1))
_q40_2, _q40_1 = _mk_q40(2), _mk_q40(1)


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
