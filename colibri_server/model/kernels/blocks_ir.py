"""The integer inner dots of the block kinds (kernels/blocks), written as LLVM vector IR.

Numba types integer arithmetic at 64 bits, so a plain loop of int8 products widens to i64 lanes
and LLVM cannot find the byte instructions. Here each dot is one vector expression over a whole
sub-block, 8-bit values widened to i32, multiplied and summed with `llvm.vector.reduce.add`; the
x86 back end turns it into `vpmaddwd` (signed x signed) or, for unsigned nibbles times signed
activations on AVX-512 VNNI / AVX-VNNI, `vpdpbusd` (asm checked with inspect_asm; bench/blocks.py).
On other CPUs LLVM lowers the same IR to what the target has.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_i8, _i32 = ir.IntType(8), ir.IntType(32)


def _ptr(context, builder, aty, arr, off):
    a = context.make_array(aty)(context, builder, arr)
    return builder.gep(builder.bitcast(a.data, _i8.as_pointer()), [off])


def _load(builder, p, n):
    return builder.load(builder.bitcast(p, ir.VectorType(_i8, n).as_pointer()), align=1)


def _splat(builder, v, n):
    vt = ir.VectorType(_i8, n)
    s = builder.insert_element(ir.Constant(vt, None), builder.trunc(v, _i8), ir.Constant(_i32, 0))
    return builder.shuffle_vector(s, ir.Constant(vt, None), ir.Constant(ir.VectorType(_i32, n), [0] * n))


def _reduce(builder, prod, n):
    vd = ir.VectorType(_i32, n)
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, [vd]), f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(f, [prod])


def _dot(builder, w_u8, x_s8, n, unsigned):
    vd = ir.VectorType(_i32, n)
    w = builder.zext(w_u8, vd) if unsigned else builder.sext(w_u8, vd)
    return _reduce(builder, builder.mul(w, builder.sext(x_s8, vd)), n)


@intrinsic
def dot_i8(typingctx, w, wo, x, xo):
    """sum_k int8(w[wo+k]) * x[xo+k], k < 32: w u8 array (its bytes read as int8), x int8 array -> int32."""
    sig = types.int32(w, wo, x, xo)

    def codegen(context, builder, signature, args):
        wv = _load(builder, _ptr(context, builder, signature.args[0], args[0], args[1]), 32)
        xv = _load(builder, _ptr(context, builder, signature.args[2], args[2], args[3]), 32)
        return _dot(builder, wv, xv, 32, False)
    return sig, codegen


@intrinsic
def dot_nib(typingctx, w, wo, sh, x, xo, n):
    """sum_k ((w[wo+k] >> sh) & 15) * x[xo+k], k < n (n a literal 16 or 32): 4-bit values times int8 -> int32."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    cnt = n.literal_value
    sig = types.int32(w, wo, sh, x, xo, n)

    def codegen(context, builder, signature, args):
        b = _load(builder, _ptr(context, builder, signature.args[0], args[0], args[1]), cnt)
        v = builder.and_(builder.lshr(b, _splat(builder, args[2], cnt)), ir.Constant(ir.VectorType(_i8, cnt), [15] * cnt))
        xv = _load(builder, _ptr(context, builder, signature.args[3], args[3], args[4]), cnt)
        return _dot(builder, v, xv, cnt, True)
    return sig, codegen


@intrinsic
def dot_q6(typingctx, w, lo, sh4, hi, sh2, x, xo):
    """Q6_K's 16 values: sum_k (((w[lo+k] >> sh4) & 15) | (((w[hi+k] >> sh2) & 3) << 4)) * x[xo+k], k < 16 -> int32
    (the 6-bit values 0..63, before Q6_K's offset of 32)."""
    sig = types.int32(w, lo, sh4, hi, sh2, x, xo)

    def codegen(context, builder, signature, args):
        n = 16
        vt = ir.VectorType(_i8, n)
        bl = _load(builder, _ptr(context, builder, signature.args[0], args[0], args[1]), n)
        bh = _load(builder, _ptr(context, builder, signature.args[0], args[0], args[3]), n)
        low = builder.and_(builder.lshr(bl, _splat(builder, args[2], n)), ir.Constant(vt, [15] * n))
        high = builder.and_(builder.lshr(bh, _splat(builder, args[4], n)), ir.Constant(vt, [3] * n))
        v = builder.or_(low, builder.shl(high, ir.Constant(vt, [4] * n)))
        xv = _load(builder, _ptr(context, builder, signature.args[5], args[5], args[6]), n)
        return _dot(builder, v, xv, n, True)
    return sig, codegen
