"""IR helpers of the tiles' micro-kernels (kernels/blocks_gemm, kernels/blocks_head): a micro-kernel's activation
rows t0.. as pointers, 16-lane vectors of a panel (lane r weight row r of a tile), the dot instructions (`vpdpbusd`,
`vpdpwssd`, or their AVX2 equivalents with the same integers), broadcasts of an activation row's 4 bytes, the loop
over a tile's blocks; and the store of a pass's results into the output (alpha, accumulate).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils

from .blocks import _put2
from .blocks_ir import _arr_ptr, k_update
from .blocks_panels import R
from .cpu import HAVE_VNNI512

__all__ = ["KC", "Kernel", "activation_rows", "pass_width", "q6_block_end", "q6_block_sums", "store_rows", "xs_pairs"]

KC = 8                     # the k-quants' activation rows per pass

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_idx = ir.IntType(64)


def activation_rows(context, builder, sig, args, nacts, n):
    """A micro-kernel's arguments from index nacts (xq, xd, xs, t0, nb, res) -> (xq, xd, xs: pointers to their rows
    t0..t0+n as i8, f32, i32; t0; nb; res as f32*)."""
    xq, xd, xs = (context.make_array(sig.args[k])(context, builder, args[k]) for k in (nacts, nacts + 1, nacts + 2))
    t0 = args[nacts + 3]

    def rows(arr, ty):
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        base = builder.bitcast(arr.data, _i8.as_pointer())
        return [builder.bitcast(builder.gep(base, [builder.mul(builder.add(t0, ir.Constant(_idx, t)), stride)]),
                                ty.as_pointer()) for t in range(n)]
    return (rows(xq, _i8), rows(xd, _f32), rows(xs, _i32), t0, args[nacts + 4],
            _arr_ptr(context, builder, sig.args[nacts + 5], args[nacts + 5], _f32))


class Kernel:
    """IR helpers over the micro-kernels' arguments: the activations' rows t0.. (C of them) and 16-lane vectors."""

    def __init__(self, context, builder, sig, args, nacts):
        self.b = builder
        self.v16 = ir.VectorType(_i32, R)
        self.f16 = ir.VectorType(_f32, R)
        self.xq, self.xd, self.xs, self.t0, self.nb, self.res = activation_rows(context, builder, sig, args, nacts, KC)
        self.module = builder.module

    def _fn(self, name, ret, *args):
        return cgutils.get_or_insert_function(self.module, ir.FunctionType(ret, list(args)), name)

    def _halves(self, v, ty):
        """The two 8-lane halves of a 16-lane i32 vector as ty (256 bits each)."""
        v8 = ir.VectorType(_i32, 8)
        return [self.b.bitcast(self.b.shuffle_vector(v, v, ir.Constant(v8, list(range(8 * h, 8 * h + 8)))), ty)
                for h in range(2)]

    def _joined(self, lo, hi):
        return self.b.shuffle_vector(lo, hi, ir.Constant(self.v16, list(range(R))))

    def dpbusd(self, acc, w, x):
        """acc + the sums of 4 products u8 w times s8 x in each i32 lane: `vpdpbusd` with AVX-512 VNNI; on AVX2
        `vpmaddubsw` (pairs in i16) then `vpmaddwd` by ones on each 256-bit half, the same integers while a pair's
        sum stays within i16 (|w| <= 63 against |x| <= 127: the nibble and 6-bit kinds, not Q8_0's flipped bytes)."""
        if HAVE_VNNI512:
            return self.b.call(self._fn("llvm.x86.avx512.vpdpbusd.512", self.v16, self.v16, self.v16, self.v16),
                               [acc, w, x])
        v32, v16h, v8 = ir.VectorType(_i8, 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(_i32, 8)
        ubs = self._fn("llvm.x86.avx2.pmadd.ub.sw", v16h, v32, v32)
        wd = self._fn("llvm.x86.avx2.pmadd.wd", v8, v16h, v16h)
        ones = ir.Constant(v16h, [1] * 16)
        parts = [self.b.call(wd, [self.b.call(ubs, [wh, xh]), ones])
                 for wh, xh in zip(self._halves(w, v32), self._halves(x, v32))]
        return self.b.add(acc, self._joined(*parts))

    def dpwssd(self, acc, a, c):
        """acc + the sums of 2 products s16 a times s16 c in each i32 lane: `vpdpwssd`, or `vpmaddwd` on AVX2."""
        if HAVE_VNNI512:
            return self.b.call(self._fn("llvm.x86.avx512.vpdpwssd.512", self.v16, self.v16, self.v16, self.v16),
                               [acc, a, c])
        v16h, v8 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_i32, 8)
        wd = self._fn("llvm.x86.avx2.pmadd.wd", v8, v16h, v16h)
        parts = [self.b.call(wd, [ah, ch]) for ah, ch in zip(self._halves(a, v16h), self._halves(c, v16h))]
        return self.b.add(acc, self._joined(*parts))

    def vec(self, p, at, ty=None):
        """The 16 lanes at element `at` (i64) of pointer p."""
        ty = ty or self.v16
        return self.b.load(self.b.bitcast(self.b.gep(p, [at]), ty.as_pointer()), align=4)

    def splat(self, v, ty=None):
        ty = ty or self.v16
        s = self.b.insert_element(ir.Constant(ty, None), v, ir.Constant(_i32, 0))
        return self.b.shuffle_vector(s, ir.Constant(ty, None), ir.Constant(ir.VectorType(_i32, R), [0] * R))

    def x4(self, t, at):
        """Activation row t's 4 bytes at column `at` (i64), broadcast to the 16 lanes."""
        p = self.b.bitcast(self.b.gep(self.xq[t], [at]), _i32.as_pointer())
        return self.splat(self.b.load(p, align=1))

    def xs1(self, t, at):
        """Word `at` (i64) of activation row t's xs argument, broadcast: the tiles pass the k-quants' i16 pairs of
        activation sums there (xs_pairs)."""
        return self.splat(self.b.load(self.b.gep(self.xs[t], [at])))

    def c(self, v):
        return ir.Constant(_idx, v)

    def block_loop(self, nc, body):
        """acc[t] (16 f32 lanes per activation row) = body over blocks 0..nb, then stored to res[t*R:]."""
        b = self.b
        accs = [cgutils.alloca_once_value(b, ir.Constant(self.f16, None)) for _ in range(nc)]
        with cgutils.for_range(b, self.nb) as loop:
            body(loop.index, accs)
        for t in range(nc):
            p = b.bitcast(b.gep(self.res, [self.c(t * R)]), self.f16.as_pointer())
            b.store(b.load(accs[t]), p, align=4)


def q6_block_sums(k, blk, nc, value, scale):
    """A Q6_K block's integer sums in a micro-kernel pass of nc activation rows: per row t, sum over the 16 groups g of
    scale(g) times the group's 6-bit values (value(h, c, g): dword g of the values 128h + 32c.., 16 weight rows as
    lanes) times the row's activations (`vpdpbusd`, two groups of 16 values at a time)."""
    b = k.b
    zero = ir.Constant(k.v16, None)
    isum = [zero] * nc
    x0 = b.mul(blk, k.c(256))
    for h in range(2):
        for c in range(4):
            g0, g1 = [zero] * nc, [zero] * nc
            for g in range(8):
                v = value(h, c, g)
                for t in range(nc):
                    x = k.x4(t, b.add(x0, k.c(128 * h + 32 * c + 4 * g)))
                    if g < 4:
                        g0[t] = k.dpbusd(g0[t], v, x)
                    else:
                        g1[t] = k.dpbusd(g1[t], v, x)
            s0, s1 = scale(8 * h + 2 * c), scale(8 * h + 2 * c + 1)
            for t in range(nc):
                isum[t] = b.add(isum[t], b.add(b.mul(g0[t], s0), b.mul(g1[t], s1)))
    return isum


def q6_block_end(k, blk, accs, isum, pair, d):
    """The end of a Q6_K block in a micro-kernel pass (its panel's, kernels/blocks_gemm, or its tile's as stored,
    kernels/blocks_x16): isum[t], the integer sum of scale times 6-bit value (0..63) times activation over the block for
    activation row t, less 32 times the scales against the activations' 16-sums (pair(q): the scales 2q | 2q+1 << 16
    as i16 pairs, against xs_pairs(Xs, 1)), scaled by d (<16 x float>) and the row's d into accs[t] (k_update)."""
    b = k.b
    zero = ir.Constant(k.v16, None)
    off = [zero] * len(isum)
    for q in range(8):
        s = pair(q)
        for t in range(len(isum)):
            off[t] = k.dpwssd(off[t], s, k.xs1(t, b.add(b.mul(blk, k.c(8)), k.c(q))))
    five = k.splat(ir.Constant(_i32, 5))
    for t in range(len(isum)):
        xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), k.f16)
        b.store(k_update(b, b.load(accs[t]), b.sub(isum[t], b.shl(off[t], five)), d, xdb), accs[t])


@njit(cache=True, inline="always")
def store_rows(res, out, t0, nc, r0, alpha, accumulate):
    for t in range(nc):
        for r in range(R):
            _put2(out, t0 + t, r0 + r, res[t * R + r], alpha, accumulate)


@njit(cache=True)
def xs_pairs(Xs, group):
    # the k-quant micro-kernels' i16 pairs of activation sums, packed once per call rather than in every pass of every
    # tile (4 loads, adds, shifts and a broadcast from a general register per pair, beside the passes' vector work: one
    # thread, 2048x1024 Q4_K at 128 rows 155 -> 165 G MAC/s, at 32 rows 138 -> 150): group 2, Q4_K / Q5_K's 32-sums of sub-blocks 2p, 2p+1 (Xs[t, 4p] + Xs[t, 4p+1] | Xs[t, 4p+2] + Xs[t, 4p+3]
    # << 16, against the mins' pairs), or 1, Q6_K's 16-sums (Xs[t, 2p] | Xs[t, 2p+1] << 16, against its scales' pairs)
    T, m = Xs.shape
    w = m // (2 * group)
    XP = np.empty((T, w), np.int32)
    for t in range(T):
        for p in range(w):
            if group == 2:
                lo, hi = Xs[t, 4 * p] + Xs[t, 4 * p + 1], Xs[t, 4 * p + 2] + Xs[t, 4 * p + 3]
            else:
                lo, hi = Xs[t, 2 * p], Xs[t, 2 * p + 1]
            XP[t, p] = np.int32((lo & 0xFFFF) | (hi << 16))
    return XP


@njit(cache=True, inline="always")
def pass_width(T, t0):
    # the rows of the 16-lane micro-kernels' next pass from t0: KC while KC remain, then 4, then the last 1-3 in one
    left = T - t0
    return KC if left >= KC else 4 if left >= 4 else left
