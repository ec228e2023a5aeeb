"""The row dots of the 32-block kinds (Q8_0, Q4_0), written as LLVM vector IR (kernels/blocks_ir's parts).

A row's blocks go 8 at a time: block b's exact integer sum times d_b * xd_b into partial sum b mod 8 (b32_update,
one <8 x f32> vector), the 8 partials summed at the end of the row (b32_total). The tiled and small-row products
(kernels/blocks_gemm, blocks_avx2, blocks_small) take the same float step on the same integers, so every path
gives the row dot's bits.

With AVX-512 VNNI a Q8_0 row takes two blocks a 512-bit `vpdpbusd` (q8_0_group8). A decode token's Q4_0
rows (AVX-512 VBMI) read their activations swizzled once per product (acts_q4_0_swizzle): 8 blocks' nibbles
are gathered from whole 64-byte loads so that 32-bit lane l of every vector belongs to block l mod 8, four
512-bit `vpdpbusd` accumulate in one register and no sum is folded across blocks (the fold was a third of
the row dot's time). Bench-mixtral Q4_0 on a 2-vCPU Zen 4: the experts' products from the mapped file 12.6
-> 20.4 GB/s, decode 131 -> 176 tok/s on one thread. The integer sums, and so the bits, are the plain row
dot's.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks_ir import (
    BLOCK_AHEAD,
    HAVE_VBMI,
    HAVE_VNNI256,
    _arr_ptr,
    _dot8,
    _dot64,
    _f16_at,
    _f32,
    _gather,
    _i8,
    _i32,
    _load,
    _nibbles32,
    _reduce,
    _sum8,
    _vload,
    _widen,
    fold_blocks,
    sums32,
)
from .blocks_rows8 import _i16, f16_lanes, lanes, word
from .cpu import HAVE_VNNI512
from .prefetch import prefetch_ahead


def b32_update(builder, acc, isum, d, xd):
    """The 32-block kinds' float step, shared with the tiled GEMM (kernels/blocks_gemm): acc + float(isum) * (d * xd),
    acc one of 8 partial sums (block b goes to lane b mod 8 here, to accumulator b mod 8 there)."""
    return builder.fadd(acc, builder.fmul(builder.sitofp(isum, acc.type), builder.fmul(d, xd)))


def b32_total(builder, accs):
    """The 8 partial sums of a 32-block row: ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))."""
    return builder.fadd(builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3])),
                        builder.fadd(builder.fadd(accs[4], accs[5]), builder.fadd(accs[6], accs[7])))


def b32_row(builder, nb, dp, block, group_sum, one_sum, group8=None, ahead=None):
    """The 32-block kinds' row loop, as f32: block(b) -> (block b's products, its weight scale as f32); block b's
    integer sum times d_b * xd_b (dp: the activations' f32 scales) to partial sum b mod 8 (b32_update), 8 blocks at a
    time as one vector (group_sum(products of blocks b0..b0+7, b0) -> <8 x i32>; or group8(b0) -> (that <8 x i32>, the
    8 scales <8 x f32>) where a kind reads 8 blocks at once), the last nb mod 8 one at a time in their lanes
    (one_sum(products, b) -> i32); the partials summed by b32_total. ahead(b0), if given, runs first in each group of 8
    read by block (the row's prefetches)."""
    idx = ir.IntType(64)
    vf = ir.VectorType(_f32, 8)
    acc = cgutils.alloca_once_value(builder, ir.Constant(vf, None))
    eight = ir.Constant(idx, 8)
    with cgutils.for_range(builder, builder.sdiv(nb, eight)) as loop:      # 8 blocks, one per lane
        b0 = builder.mul(loop.index, eight)
        if ahead is not None and group8 is None:
            ahead(b0)
        if group8 is not None:
            isum, ds = group8(b0)
        else:
            ps, ds = [], ir.Constant(vf, None)
            for i in range(8):
                p, d = block(builder.add(b0, ir.Constant(idx, i)))
                ps.append(p)
                ds = builder.insert_element(ds, d, ir.Constant(_i32, i))
            isum = group_sum(ps, b0)
        builder.store(b32_update(builder, builder.load(acc), isum, ds, _vload(builder, dp, b0, vf)), acc)
    with cgutils.for_range_slice(builder, builder.mul(builder.sdiv(nb, eight), eight), nb,
                                 ir.Constant(idx, 1)) as (b, _):           # the rest: lane b mod 8 alone
        p, d = block(b)
        isum = one_sum(p, b)
        lane = builder.trunc(builder.srem(b, eight), _i32)
        v = builder.load(acc)
        upd = b32_update(builder, builder.extract_element(v, lane), isum, d, builder.load(builder.gep(dp, [b])))
        builder.store(builder.insert_element(v, upd, lane), acc)
    v = builder.load(acc)
    return b32_total(builder, [builder.extract_element(v, ir.Constant(_i32, i)) for i in range(8)])


def _row32(nibbles, swizzled=False):
    """The row dot of a 32-block kind with an f16 scale first: Q8_0 (34 bytes) or Q4_0 (18). Block b's exact
    integer sum (Q4_0: its nibbles' 8 taken out through the activations' 16-sums) times d_b * xd_b goes to
    partial sum b mod 8 (b32_update), 8 blocks at a time as one vector; the partials summed by b32_total.
    swizzled (Q4_0): whole groups of 8 blocks read the activations as acts_q4_0_swizzle lays them out (one more
    argument, xw, after xq), the rest of the row xq."""
    size = 18 if nibbles else 34

    def typed(*args):
        sig = types.float32(*args)

        def codegen(context, builder, signature, args):
            a = signature.args
            idx = ir.IntType(64)
            rp = _arr_ptr(context, builder, a[0], args[0], _i8)
            xp = _arr_ptr(context, builder, a[1], args[1], _i8)
            k = 3 if swizzled else 2
            wsp = _arr_ptr(context, builder, a[2], args[2], _i8) if swizzled else None
            dp = _arr_ptr(context, builder, a[k], args[k], _f32)
            sp = _arr_ptr(context, builder, a[k + 1], args[k + 1], _i32)
            v8 = ir.VectorType(_i32, 8)

            def block(b):
                """(block b's exact integer sum, its f16 scale as f32)."""
                o = builder.mul(b, ir.Constant(idx, size))
                xv = _load(builder, builder.gep(xp, [builder.mul(b, ir.Constant(idx, 32))]), 32)
                wp = builder.gep(rp, [builder.add(o, ir.Constant(idx, 2))])
                if nibbles:
                    p8 = _dot8(builder, _nibbles32(builder, _load(builder, wp, 16)), xv, False)
                else:
                    p8 = _dot8(builder, _load(builder, wp, 32), xv, True)
                return p8, _f16_at(builder, rp, o)

            def ahead(b0):
                """8 blocks' lines BLOCK_AHEAD bytes on, one prefetch a 64-byte line, where one a block asked for
                each line two to four times."""
                for line in range(0, 8 * size, 64):
                    prefetch_ahead(builder, [rp], builder.mul(b0, ir.Constant(idx, size)), ahead=BLOCK_AHEAD + line)

            def correction(b0, n):
                """Q4_0: 8 * the activations' 32-sums of blocks b0..b0+n (<8 x i32>, n <= 8 lanes)."""
                return builder.mul(sums32(builder, sp, builder.mul(b0, ir.Constant(idx, 2))), ir.Constant(v8, [8] * 8))

            def group_sum(ps, b0):
                isum = _sum8(builder, ps)
                return builder.sub(isum, correction(b0, 8)) if nibbles else isum

            def group8_q8_0(b0):
                """Q8_0 blocks b0..b0+7 on AVX-512 VNNI (q8_0_group8)."""
                return q8_0_group8(builder, rp, xp, b0)

            def group8_q4_0(b0):
                """Q4_0 blocks b0..b0+7 against the swizzled activations (q4_0_group8)."""
                (isum,), ds = q4_0_group8(builder, rp, b0, [builder.gep(wsp, [builder.mul(b0, ir.Constant(idx, 32))])])
                return builder.sub(isum, correction(b0, 8)), ds

            def one_sum(p8, b):
                isum = _reduce(builder, p8, 8)
                if nibbles:
                    s2 = builder.gep(sp, [builder.mul(b, ir.Constant(idx, 2))])
                    xsum = builder.add(builder.load(s2), builder.load(builder.gep(s2, [ir.Constant(idx, 1)])))
                    isum = builder.sub(isum, builder.mul(xsum, ir.Constant(_i32, 8)))
                return isum
            # without VBMI (an AVX2 build) the swizzled dot is the plain one: xw unread
            group8 = group8_q4_0 if swizzled and HAVE_VBMI else None
            if not nibbles and HAVE_VNNI512:
                group8 = group8_q8_0
            return b32_row(builder, args[-1], dp, block, group_sum, one_sum, group8,
                           ahead if nibbles or not HAVE_VNNI256 else None)      # Q8_0's: see BLOCK_AHEAD
        return sig, codegen

    if swizzled:
        def impl(typingctx, r, xq, xw, xd, xs, nb):
            return typed(r, xq, xw, xd, xs, nb)
    else:
        def impl(typingctx, r, xq, xd, xs, nb):
            return typed(r, xq, xd, xs, nb)
    return impl


def q8_0_group8(builder, rp, xp, b0):
    """Q8_0 blocks b0..b0+7 of the row at i8 pointer rp . the activations at i8 pointer xp, on AVX-512 VNNI: (<8 x i32>,
    lane b block b's exact integer sum; the blocks' f16 scales as <8 x f32>). Two blocks a 512-bit `vpdpbusd` (their
    32 weight bytes joined from two loads, the sign trick on a byte mask: `vpmovb2m`, a masked `vpsubb`, `vpabsb`),
    the four vectors folded to the 8 blocks' sums, and the 8 scales read into one vector (`vpinsrw`) for one
    `vcvtph2ps`: a loop of 65 instructions for 8 blocks where one block at a time (_dot8, _sum8, a conversion and an
    insert a scale) took 91. The same integers and scales, so the same bits. One thread, a 2048 x 1024 matrix, one row, a
    2-vCPU Zen 5: 0.098-0.100 -> 0.063 ms in cache, 0.101-0.105 -> 0.085-0.094 from DRAM (64 matrices in turn)."""
    idx = ir.IntType(64)
    v64, v16 = ir.VectorType(_i8, 64), ir.VectorType(_i32, 16)
    zero = ir.Constant(v64, None)
    o = builder.mul(b0, ir.Constant(idx, 34))
    ps = []
    for j in range(4):                  # blocks b0 + 2j, b0 + 2j + 1
        at = builder.add(o, ir.Constant(idx, 68 * j + 2))
        w = builder.shuffle_vector(_load(builder, builder.gep(rp, [at]), 32),
                                   _load(builder, builder.gep(rp, [builder.add(at, ir.Constant(idx, 34))]), 32),
                                   ir.Constant(ir.VectorType(_i32, 64), list(range(64))))
        x = _load(builder, builder.gep(xp, [builder.add(builder.mul(b0, ir.Constant(idx, 32)), ir.Constant(idx, 64 * j))]), 64)
        neg = builder.icmp_signed("<", w, zero)
        ps.append(_dot64(builder, builder.select(neg, builder.sub(zero, w), w), builder.select(neg, builder.sub(zero, x), x),
                         ir.Constant(v16, None)))
    scales = lanes(builder, [word(builder, rp, builder.add(o, ir.Constant(idx, 34 * i)), _i16) for i in range(8)])
    return fold_blocks(builder, ps), f16_lanes(builder, scales)


def q4_0_group8(builder, rp, b0, xws):
    """Q4_0 blocks b0..b0+7 of the row at i8 pointer rp . the swizzled activations of those blocks at each i8 pointer
    of xws (one an activation row): ([<8 x i32> a row, lane b block b's integer sum of nibble . activation, the 8's
    correction left to the caller], the blocks' f16 scales as <8 x f32>). The 8 blocks are read as whole 64-byte
    registers (prefetched ahead), their nibbles and scales gathered by byte shuffles (`vpermt2b`) into four vectors
    that meet the activations' four (SWIZZLE: 32-bit lane l holds 4 values of block l mod 8), four `vpdpbusd` a row
    into one register, its lanes b and b + 8 added: no fold across blocks."""
    idx, size = ir.IntType(64), 18
    o = builder.mul(b0, ir.Constant(idx, size))
    for k in range(0, 8 * size, 64):
        prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, k)), ahead=BLOCK_AHEAD)
    base = builder.gep(rp, [o])
    regs = [_load(builder, builder.gep(base, [ir.Constant(idx, k)]), 64) for k in (0, 64)]
    regs.append(_widen(builder, _load(builder, builder.gep(base, [ir.Constant(idx, 8 * size - 16)]), 16)))
    v64 = ir.VectorType(_i8, 64)
    accs = [ir.Constant(ir.VectorType(_i32, 16), None)] * len(xws)
    for half in range(2):           # nibble bytes 0-7, then 8-15, of every block: their low nibbles, their high ones
        at = [k * size + 2 + 8 * half + 4 * (ln // 8) + i for ln in range(16) for k in [ln % 8] for i in range(4)]
        first = _gather(builder, regs[0], regs[1], [c if c < 128 else 0 for c in at])   # blocks 0-6
        g = _gather(builder, first, regs[2], [j if at[j] < 128 else 64 + at[j] - 128 for j in range(64)])
        for j, w in enumerate((builder.and_(g, ir.Constant(v64, [15] * 64)), builder.lshr(g, ir.Constant(v64, [4] * 64)))):
            accs = [_dot64(builder, w, _load(builder, builder.gep(xw, [ir.Constant(idx, 64 * (2 * half + j))]), 64), acc)
                    for xw, acc in zip(xws, accs)]
    v8 = ir.VectorType(_i32, 8)
    sums = [builder.add(builder.shuffle_vector(acc, acc, ir.Constant(v8, list(range(8)))),
                        builder.shuffle_vector(acc, acc, ir.Constant(v8, list(range(8, 16))))) for acc in accs]
    s16 = _gather(builder, regs[0], regs[1], [k * size + t for k in range(8) for t in (0, 1)])
    h8 = builder.bitcast(builder.bitcast(s16, ir.VectorType(ir.IntType(16), 8)), ir.VectorType(ir.HalfType(), 8))
    return sums, builder.fpext(h8, ir.VectorType(_f32, 8))


# The swizzled activations of a Q4_0 row dot (row_q4_0_sw), per group of 8 blocks (256 bytes): four 64-byte vectors,
# vector j's 32-bit lane l the 4 values 32 * (l mod 8) + SWIZZLE[j] + 4 * (l // 8) + (0..3), those that meet the low
# (j even) or high (j odd) nibbles of nibble bytes 8 * (j // 2) + 4 * (l // 8) + (0..3) of block l mod 8
SWIZZLE = (0, 16, 8, 24)


def _acts_q4_0_swizzle(typingctx, xq, xw, ng):
    sig = types.void(xq, xw, ng)

    def codegen(context, builder, signature, args):
        a = signature.args
        idx = ir.IntType(64)
        src = _arr_ptr(context, builder, a[0], args[0], _i8)
        dst = _arr_ptr(context, builder, a[1], args[1], _i8)
        v64 = ir.VectorType(_i8, 64)
        if not HAVE_VBMI:          # row_q4_0_sw reads xq alone there
            return context.get_dummy_value()
        with cgutils.for_range(builder, args[2]) as loop:
            o = builder.mul(loop.index, ir.Constant(idx, 256))
            xs = [_load(builder, builder.gep(src, [builder.add(o, ir.Constant(idx, 64 * c))]), 64) for c in range(4)]
            for j, off in enumerate(SWIZZLE):
                at = [32 * (ln % 8) + off + 4 * (ln // 8) + i for ln in range(16) for i in range(4)]
                lo = _gather(builder, xs[0], xs[1], [c if c < 128 else 0 for c in at])
                hi = _gather(builder, xs[2], xs[3], [c - 128 if c >= 128 else 0 for c in at])
                v = _gather(builder, lo, hi, [j2 if at[j2] < 128 else 64 + j2 for j2 in range(64)])
                p = builder.gep(dst, [builder.add(o, ir.Constant(idx, 64 * j))])
                builder.store(v, builder.bitcast(p, v64.as_pointer()), align=1)
        return context.get_dummy_value()
    return sig, codegen


row_q8_0 = intrinsic(_row32(False))
row_q8_0.__doc__ = "r (row bytes,) u8 Q8_0 row . xq (n,) i8 with scales xd (n/32,) f32 (xs unused), nb blocks -> f32"
row_q4_0 = intrinsic(_row32(True))
row_q4_0.__doc__ = "r (row bytes,) u8 Q4_0 row . xq (n,) i8 with scales xd (n/32,) f32 and 16-sums xs, nb blocks -> f32"
row_q4_0_sw = intrinsic(_row32(True, swizzled=True))
row_q4_0_sw.__doc__ = ("row_q4_0 with xw, xq's whole 256-groups as acts_q4_0_swizzle lays them out (AVX-512 VBMI: "
                       "HAVE_VBMI): r, xq, xw, xd, xs, nb -> f32, the same bits")
acts_q4_0_swizzle = intrinsic(_acts_q4_0_swizzle)
acts_q4_0_swizzle.__doc__ = "xq (n,) i8 -> xw (>= n bytes, any dtype): ng groups of 256 values swizzled (SWIZZLE)"
