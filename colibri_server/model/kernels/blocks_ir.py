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


# ---------------------------------------------------------------------------- multiply-accumulate forms
# acc (8,) f32 += float(p) * scale, p the <8 x i32> of pairwise-summed products (even + odd lanes: the
# `vpmaddwd` pattern, which AVX-512 VNNI folds into `vpdpwssd`): the horizontal sum is left to the end
# of the row (one per row instead of one per block).

_f32 = ir.FloatType()


def _pairs(builder, w16, x16, n):
    """<n x i16> w, x -> <8 x i32>: products summed in adjacent pairs, then the halves folded to 8 lanes."""
    vd = ir.VectorType(_i32, n)
    prod = builder.mul(builder.sext(w16, vd), builder.sext(x16, vd))
    half = n // 2
    ev = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_i32, half), list(range(0, n, 2))))
    od = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_i32, half), list(range(1, n, 2))))
    s = builder.add(ev, od)
    while half > 8:
        half //= 2
        lo = builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(_i32, half), list(range(half))))
        hi = builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(_i32, half), list(range(half, 2 * half))))
        s = builder.add(lo, hi)
    return s


def _mac(context, builder, aty, acc_arr, p8, scale):
    a = context.make_array(aty)(context, builder, acc_arr)
    vf = ir.VectorType(_f32, 8)
    ptr = builder.bitcast(a.data, vf.as_pointer())
    sv = builder.insert_element(ir.Constant(vf, None), scale, ir.Constant(_i32, 0))
    sv = builder.shuffle_vector(sv, ir.Constant(vf, None), ir.Constant(ir.VectorType(_i32, 8), [0] * 8))
    builder.store(builder.fadd(builder.load(ptr, align=4), builder.fmul(builder.sitofp(p8, vf), sv)), ptr, align=4)


def _i16(builder, v, n, signed):
    vw = ir.VectorType(ir.IntType(16), n)
    return builder.sext(v, vw) if signed else builder.zext(v, vw)


@intrinsic
def mac_i8(typingctx, acc, w, wo, x, xo, scale):
    """acc (8,) f32 += pairs(int8(w[wo:wo+32]) * x[xo:xo+32]) * scale (Q8_0's block)."""
    sig = types.void(acc, w, wo, x, xo, scale)

    def codegen(context, builder, signature, args):
        a = signature.args
        wv = _load(builder, _ptr(context, builder, a[1], args[1], args[2]), 32)
        xv = _load(builder, _ptr(context, builder, a[3], args[3], args[4]), 32)
        _mac(context, builder, a[0], args[0], _pairs(builder, _i16(builder, wv, 32, True), _i16(builder, xv, 32, True), 32),
             args[5])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mac_q4_0(typingctx, acc, w, wo, x, xo, scale):
    """acc (8,) f32 += pairs((nibbles of w[wo:wo+16], low then high) - 8) * x[xo:xo+32]) * scale (Q4_0's block)."""
    sig = types.void(acc, w, wo, x, xo, scale)

    def codegen(context, builder, signature, args):
        a = signature.args
        vt = ir.VectorType(_i8, 16)
        b = _load(builder, _ptr(context, builder, a[1], args[1], args[2]), 16)
        lo = builder.and_(b, ir.Constant(vt, [15] * 16))
        hi = builder.lshr(b, ir.Constant(vt, [4] * 16))
        q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
        q = builder.sub(q, ir.Constant(ir.VectorType(_i8, 32), [8] * 32))
        xv = _load(builder, _ptr(context, builder, a[3], args[3], args[4]), 32)
        _mac(context, builder, a[0], args[0], _pairs(builder, _i16(builder, q, 32, True), _i16(builder, xv, 32, True), 32),
             args[5])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mac_nib(typingctx, acc, w, wo, sh, x, xo, scale):
    """acc (8,) f32 += pairs(((w[wo:wo+32] >> sh) & 15) * x[xo:xo+32]) * scale (a Q4_K sub-block, before its min)."""
    sig = types.void(acc, w, wo, sh, x, xo, scale)

    def codegen(context, builder, signature, args):
        a = signature.args
        b = _load(builder, _ptr(context, builder, a[1], args[1], args[2]), 32)
        q = builder.and_(builder.lshr(b, _splat(builder, args[3], 32)), ir.Constant(ir.VectorType(_i8, 32), [15] * 32))
        xv = _load(builder, _ptr(context, builder, a[4], args[4], args[5]), 32)
        _mac(context, builder, a[0], args[0], _pairs(builder, _i16(builder, q, 32, False), _i16(builder, xv, 32, True), 32),
             args[6])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mac_q6(typingctx, acc, w, lo, sh4, hi, sh2, x, xo, scale):
    """acc (8,) f32 += pairs((6-bit values - 32) * x[xo:xo+16]) * scale: Q6_K's 16 values sharing one scale."""
    sig = types.void(acc, w, lo, sh4, hi, sh2, x, xo, scale)

    def codegen(context, builder, signature, args):
        a = signature.args
        n = 16
        vt = ir.VectorType(_i8, n)
        bl = _load(builder, _ptr(context, builder, a[1], args[1], args[2]), n)
        bh = _load(builder, _ptr(context, builder, a[1], args[1], args[4]), n)
        low = builder.and_(builder.lshr(bl, _splat(builder, args[3], n)), ir.Constant(vt, [15] * n))
        high = builder.and_(builder.lshr(bh, _splat(builder, args[5], n)), ir.Constant(vt, [3] * n))
        q = builder.sub(builder.or_(low, builder.shl(high, ir.Constant(vt, [4] * n))), ir.Constant(vt, [32] * n))
        xv = _load(builder, _ptr(context, builder, a[6], args[6], args[7]), n)
        _mac(context, builder, a[0], args[0], _pairs(builder, _i16(builder, q, n, True), _i16(builder, xv, n, True), n),
             args[8])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mac_q5(typingctx, acc, w, wo, sh, h, hsh, x, xo, scale):
    """acc (8,) f32 += pairs(((w[wo+k] >> sh) & 15 | ((w[h+k] >> hsh) & 1) << 4) * x[xo+k], k < 32) * scale
    (a Q5_K sub-block, before its min)."""
    sig = types.void(acc, w, wo, sh, h, hsh, x, xo, scale)

    def codegen(context, builder, signature, args):
        a = signature.args
        n = 32
        vt = ir.VectorType(_i8, n)
        bl = _load(builder, _ptr(context, builder, a[1], args[1], args[2]), n)
        bh = _load(builder, _ptr(context, builder, a[1], args[1], args[4]), n)
        low = builder.and_(builder.lshr(bl, _splat(builder, args[3], n)), ir.Constant(vt, [15] * n))
        high = builder.and_(builder.lshr(bh, _splat(builder, args[5], n)), ir.Constant(vt, [1] * n))
        q = builder.or_(low, builder.shl(high, ir.Constant(vt, [4] * n)))
        xv = _load(builder, _ptr(context, builder, a[6], args[6], args[7]), n)
        _mac(context, builder, a[0], args[0], _pairs(builder, _i16(builder, q, n, False), _i16(builder, xv, n, True), n),
             args[8])
        return context.get_dummy_value()
    return sig, codegen
