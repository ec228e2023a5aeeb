"""A decode token's products: 8 rows of a k-quant matrix (Q4_K, Q5_K, Q6_K) times one activation row at once.

The row dot (kernels/blocks, blocks_ir.kblock_*) sums a block's integers across its vector lanes and steps one
scalar accumulator per block: two horizontal sums and a scalar float step for every 256 weights, about half
of a Q4_K block's instructions, which keeps one thread at a third of the read bandwidth (bench/blocks.py).
Here the same integers of 8 consecutive weight rows (blocks_ir.q45_ints / q6_ints: the same vector code per
row) are folded into one <8 x i32> whose lane r is row r's sum (blocks_ir.fold_blocks), and the float step
(blocks_ir.k_update) runs once for the 8 rows as vector lanes: lane r does row r's scalar operations on row
r's values in the same order, so every output has the row dot's bits. The activation's loads and its
32-sums are shared by the 8 rows.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks_ir import _arr_ptr, _f32, _i8, _i32, fold_blocks, k_update, q6_ints, q45_ints
from .prefetch import prefetch_ahead

ROWS = 8
AHEAD_ROWS = 8      # prefetched into L2: the block being read, this many rows further on (the next group's)
_idx = ir.IntType(64)
_i16 = ir.IntType(16)


def lanes(builder, vals):
    """Scalars of one type as the lanes of a vector, in order."""
    v = ir.Constant(ir.VectorType(vals[0].type, len(vals)), None)
    for r, x in enumerate(vals):
        v = builder.insert_element(v, x, ir.Constant(_i32, r))
    return v


def word(builder, rp, o, ty):
    """The integer of type ty at byte o of the i8 pointer rp."""
    return builder.load(builder.bitcast(builder.gep(rp, [o]), ty.as_pointer()), align=1)


def f16_lanes(builder, v):
    """<8 x i32> or <8 x i16> -> <8 x float>: each lane's low 16 bits as an f16, widened (exact: the same values as
    blocks_ir._f16_at, converted 8 at once)."""
    h = v if v.type.element == _i16 else builder.trunc(v, ir.VectorType(_i16, ROWS))
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), ROWS)), ir.VectorType(_f32, ROWS))


def _mk(kind):
    size, dmin = {12: (144, True), 13: (176, True), 14: (210, False)}[kind]

    def impl(typingctx, raw, i0, xq, xd, xs, nb, res):
        sig = types.void(raw, i0, xq, xd, xs, nb, res)

        def codegen(context, builder, signature, args):
            a = signature.args
            arr = context.make_array(a[0])(context, builder, args[0])
            base = builder.bitcast(arr.data, _i8.as_pointer())
            stride = builder.extract_value(arr.strides, 0)
            rows = [builder.gep(base, [builder.mul(builder.add(args[1], ir.Constant(_idx, r)), stride)])
                    for r in range(ROWS)]
            xp = _arr_ptr(context, builder, a[2], args[2], _i8)
            dp = _arr_ptr(context, builder, a[3], args[3], _f32)
            sp = _arr_ptr(context, builder, a[4], args[4], _i32)
            vf = ir.VectorType(_f32, ROWS)
            acc = cgutils.alloca_once_value(builder, ir.Constant(vf, None))
            dist = builder.mul(stride, ir.Constant(_idx, AHEAD_ROWS))
            with cgutils.for_range(builder, args[5]) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(_idx, size))
                xd = builder.load(builder.gep(dp, [b]))
                xdv = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), xd, ir.Constant(_i32, 0)),
                                             ir.Constant(vf, None), ir.Constant(ir.VectorType(_i32, ROWS), [0] * ROWS))
                for line in range(0, size, 64):          # the same block of the next 8 rows
                    prefetch_ahead(builder, rows, builder.add(o, dist), ahead=line)
                if dmin:
                    parts = [q45_ints(builder, rp, o, xp, sp, b, kind == 13, ahead=False) for rp in rows]
                    isum = fold_blocks(builder, [p[0] for p in parts])
                    msum = fold_blocks(builder, [p[1] for p in parts])
                    w = lanes(builder, [word(builder, rp, o, _i32) for rp in rows])    # d | dmin << 16
                    d, dm = f16_lanes(builder, w), f16_lanes(builder, builder.lshr(w, ir.Constant(w.type, [16] * ROWS)))
                    builder.store(k_update(builder, builder.load(acc), isum, d, xdv, msum, dm), acc)
                else:
                    isum = fold_blocks(builder, [q6_ints(builder, rp, o, xp, sp, b, ahead=False) for rp in rows])
                    d = f16_lanes(builder, lanes(builder, [word(builder, rp, builder.add(o, ir.Constant(_idx, 208)), _i16)
                                                         for rp in rows]))
                    builder.store(k_update(builder, builder.load(acc), isum, d, xdv), acc)
            out = _arr_ptr(context, builder, a[6], args[6], _f32)
            builder.store(builder.load(acc), builder.bitcast(out, vf.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return impl


rows8_q4_k = intrinsic(_mk(12))
rows8_q4_k.__doc__ = """raw (d, row bytes) u8 Q4_K rows i0..i0+7 . one activation row (xq, xd, xs as kblock_q4_k), nb blocks
-> res[0:8] f32, row r in res[r], bit for bit the row dot's"""
rows8_q5_k = intrinsic(_mk(13))
rows8_q5_k.__doc__ = "rows8_q4_k for Q5_K"
rows8_q6_k = intrinsic(_mk(14))
rows8_q6_k.__doc__ = "rows8_q4_k for Q6_K"
