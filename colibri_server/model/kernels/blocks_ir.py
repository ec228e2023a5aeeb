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

from .cpu import FEATURES, HAVE_VNNI512
from .prefetch import prefetch_ahead

# vpdpbusd on 256-bit registers: AVX-512 VNNI with VL (Zen 4, Ice Lake on), or AVX-VNNI (Alder Lake on)
HAVE_VNNI256 = (HAVE_VNNI512 and "avx512vl" in FEATURES) or "avxvnni" in FEATURES

_i8, _i32 = ir.IntType(8), ir.IntType(32)
# bytes ahead of the block being read that the row loops ask into L2 (kernels/prefetch). Measured on the
# shared Zen 4 machine, 48 2048x1024 matrices in turn from DRAM, one thread, 0 vs 4096: Q4_0 387 vs 227 us
# a matrix, Q8_0 334 / 330, Q4_K 240 / 246, Q6_K 315 / 319 (the machine loaded by other work: noisy)
BLOCK_AHEAD = 4096


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


def _dot8(builder, w, x, signed):
    """<32 x i8> weights (signed, or unsigned values 0..127) . <32 x i8> activations -> <8 x i32>, lane l
    the sum of the products of bytes 4l..4l+3: one `vpdpbusd` where the CPU has it (signed weights
    through llama.cpp's sign trick: |w| times x with w's sign), else sign-extended pairs (`vpmaddwd`)."""
    if not HAVE_VNNI256:
        return _pairs(builder, _i16(builder, w, 32, signed), _i16(builder, x, 32, True), 32)
    vt, vd = ir.VectorType(_i8, 32), ir.VectorType(_i32, 8)
    if signed:
        neg = builder.icmp_signed("<", w, ir.Constant(vt, None))
        x = builder.select(neg, builder.sub(ir.Constant(vt, None), x), x)
        w = builder.select(neg, builder.sub(ir.Constant(vt, None), w), w)
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), "llvm.x86.avx512.vpdpbusd.256")
    return builder.call(f, [ir.Constant(vd, None), builder.bitcast(w, vd), builder.bitcast(x, vd)])


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


# ---------------------------------------------------------------------------- whole rows and blocks
# The forms above keep the accumulator in memory, one load and store per sub-block: a dependency chain
# of ~8 cycles per 32 weights (Q8_0 at 19 GB/s). These keep it in a register for a whole row (Q8_0,
# Q4_0) or a whole 256-block (the k-quants, their sub-block scales computed beforehand).

def _arr_ptr(context, builder, aty, arr, ty):
    return builder.bitcast(context.make_array(aty)(context, builder, arr).data, ty.as_pointer())


def _splat_f(builder, s):
    vf = ir.VectorType(_f32, 8)
    v = builder.insert_element(ir.Constant(vf, None), s, ir.Constant(_i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vf, None), ir.Constant(ir.VectorType(_i32, 8), [0] * 8))


def _hsum(builder, acc):
    lanes = [builder.extract_element(acc, ir.Constant(_i32, i)) for i in range(8)]
    return builder.fadd(builder.fadd(builder.fadd(lanes[0], lanes[1]), builder.fadd(lanes[2], lanes[3])),
                        builder.fadd(builder.fadd(lanes[4], lanes[5]), builder.fadd(lanes[6], lanes[7])))


def _row32(nibbles):
    """The row loop of a 32-block kind with an f16 scale first: Q8_0 (34 bytes) or Q4_0 (18)."""
    size = 18 if nibbles else 34

    def impl(typingctx, r, xq, xd, xs, nb):
        sig = types.float32(r, xq, xd, xs, nb)
        offset = nibbles and HAVE_VNNI256     # Q4_0 as unsigned nibbles, its 8 taken out through the 16-sums

        def codegen(context, builder, signature, args):
            a = signature.args
            idx = ir.IntType(64)
            rp = _arr_ptr(context, builder, a[0], args[0], _i8)
            xp = _arr_ptr(context, builder, a[1], args[1], _i8)
            dp = _arr_ptr(context, builder, a[2], args[2], _f32)
            vf = ir.VectorType(_f32, 8)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(2)]
            sp = _arr_ptr(context, builder, a[3], args[3], _i32)
            corr = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
            nb = args[4]

            def block(b, acc):
                o = builder.mul(b, ir.Constant(idx, size))
                prefetch_ahead(builder, [rp], o, ahead=BLOCK_AHEAD)
                hp = builder.bitcast(builder.gep(rp, [o]), ir.IntType(16).as_pointer())
                d = builder.fpext(builder.bitcast(builder.load(hp, align=1), ir.HalfType()), _f32)
                scale = builder.fmul(d, builder.load(builder.gep(dp, [b])))
                xv = _load(builder, builder.gep(xp, [builder.mul(b, ir.Constant(idx, 32))]), 32)
                wp = builder.gep(rp, [builder.add(o, ir.Constant(idx, 2))])
                if nibbles:
                    vt = ir.VectorType(_i8, 16)
                    bb = _load(builder, wp, 16)
                    q = builder.shuffle_vector(builder.and_(bb, ir.Constant(vt, [15] * 16)),
                                               builder.lshr(bb, ir.Constant(vt, [4] * 16)),
                                               ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
                    if offset:
                        s2 = builder.gep(sp, [builder.mul(b, ir.Constant(idx, 2))])
                        xsum = builder.add(builder.load(s2), builder.load(builder.gep(s2, [ir.Constant(idx, 1)])))
                        c = builder.fmul(scale, builder.sitofp(builder.mul(xsum, ir.Constant(_i32, 8)), _f32))
                        builder.store(builder.fadd(builder.load(corr), c), corr)
                    else:
                        q = builder.sub(q, ir.Constant(ir.VectorType(_i8, 32), [8] * 32))
                else:
                    q = _load(builder, wp, 32)
                p8 = _dot8(builder, q, xv, not offset)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(p8, vf), _splat_f(builder, scale))),
                              acc)
            two = ir.Constant(idx, 2)
            with cgutils.for_range(builder, builder.sdiv(nb, two)) as loop:      # two blocks, two accumulators
                b0 = builder.mul(loop.index, two)
                block(b0, accs[0])
                block(builder.add(b0, ir.Constant(idx, 1)), accs[1])
            with cgutils.for_range_slice(builder, builder.mul(builder.sdiv(nb, two), two), nb,
                                         ir.Constant(idx, 1)) as (b, _):
                block(b, accs[0])
            acc = builder.fadd(builder.load(accs[0]), builder.load(accs[1]))
            return builder.fsub(_hsum(builder, acc), builder.load(corr))
        return sig, codegen
    return impl


row_q8_0 = intrinsic(_row32(False))
row_q8_0.__doc__ = "r (row bytes,) u8 Q8_0 row . xq (n,) i8 with scales xd (n/32,) f32 (xs unused), nb blocks -> f32"
row_q4_0 = intrinsic(_row32(True))
row_q4_0.__doc__ = "r (row bytes,) u8 Q4_0 row . xq (n,) i8 with scales xd (n/32,) f32 and 16-sums xs, nb blocks -> f32"


@intrinsic
def block_q4_k(typingctx, r, o, xq, xo, sc):
    """sum over Q4_K's 8 sub-blocks i of the block at r[o:] (qs at o+16) of sc[i] * (nibbles_i . xq[xo+32i:+32])
    -> f32 (sc (8,) f32: each sub-block's scale times its activations' scale; the mins are the caller's)."""
    sig = types.float32(r, o, xq, xo, sc)

    def codegen(context, builder, signature, args):
        a = signature.args
        idx = ir.IntType(64)
        rp = _arr_ptr(context, builder, a[0], args[0], _i8)
        xp = _arr_ptr(context, builder, a[2], args[2], _i8)
        sp = _arr_ptr(context, builder, a[4], args[4], _f32)
        vf = ir.VectorType(_f32, 8)
        vt = ir.VectorType(_i8, 32)
        acc = ir.Constant(vf, None)
        for c in range(4):
            bb = _load(builder, builder.gep(rp, [builder.add(args[1], ir.Constant(idx, 16 + 32 * c))]), 32)
            for half in range(2):
                q = builder.and_(bb, ir.Constant(vt, [15] * 32)) if half == 0 else builder.lshr(bb, ir.Constant(vt, [4] * 32))
                i = 2 * c + half
                xv = _load(builder, builder.gep(xp, [builder.add(args[3], ir.Constant(idx, 32 * i))]), 32)
                p8 = _pairs(builder, _i16(builder, q, 32, False), _i16(builder, xv, 32, True), 32)
                s = builder.load(builder.gep(sp, [ir.Constant(idx, i)]))
                acc = builder.fadd(acc, builder.fmul(builder.sitofp(p8, vf), _splat_f(builder, s)))
        return _hsum(builder, acc)
    return sig, codegen


@intrinsic
def block_q6_k(typingctx, r, o, xq, xo, sc):
    """sum over Q6_K's 16 groups g of the block at r[o:] of sc[g] * ((6-bit values - 32) . xq[xo+16g:+16]) -> f32
    (sc (16,) f32: d * the group's scale * its activations' scale)."""
    sig = types.float32(r, o, xq, xo, sc)

    def codegen(context, builder, signature, args):
        a = signature.args
        idx = ir.IntType(64)
        rp = _arr_ptr(context, builder, a[0], args[0], _i8)
        xp = _arr_ptr(context, builder, a[2], args[2], _i8)
        sp = _arr_ptr(context, builder, a[4], args[4], _f32)
        vf = ir.VectorType(_f32, 8)
        vt = ir.VectorType(_i8, 32)
        acc = ir.Constant(vf, None)

        def at(off):
            return builder.add(args[1], ir.Constant(idx, off))
        for h in range(2):
            qh = _load(builder, builder.gep(rp, [at(128 + 32 * h)]), 32)
            for c in range(4):
                ql = _load(builder, builder.gep(rp, [at(64 * h + 32 * (c % 2))]), 32)
                low = builder.and_(builder.lshr(ql, ir.Constant(vt, [4 * (c // 2)] * 32)), ir.Constant(vt, [15] * 32))
                high = builder.and_(builder.lshr(qh, ir.Constant(vt, [2 * c] * 32)), ir.Constant(vt, [3] * 32))
                q = builder.sub(builder.or_(low, builder.shl(high, ir.Constant(vt, [4] * 32))), ir.Constant(vt, [32] * 32))
                xv = _load(builder, builder.gep(xp, [builder.add(args[3], ir.Constant(idx, 128 * h + 32 * c))]), 32)
                q16, x16 = _i16(builder, q, 32, True), _i16(builder, xv, 32, True)
                for part in range(2):            # the two groups of 16 in these 32 values, each its own scale
                    sel = ir.Constant(ir.VectorType(_i32, 16), list(range(16 * part, 16 * part + 16)))
                    p8 = _pairs(builder, builder.shuffle_vector(q16, q16, sel), builder.shuffle_vector(x16, x16, sel), 16)
                    s = builder.load(builder.gep(sp, [ir.Constant(idx, 8 * h + 2 * c + part)]))
                    acc = builder.fadd(acc, builder.fmul(builder.sitofp(p8, vf), _splat_f(builder, s)))
        return _hsum(builder, acc)
    return sig, codegen


def _vload(builder, base, off, vt):
    return builder.load(builder.bitcast(builder.gep(base, [off]), vt.as_pointer()), align=1)


def _bcast(builder, vec, i):
    """Lane i of an <8|16 x float> broadcast to <8 x float>."""
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_i32, 8), [i] * 8))


@intrinsic
def kblock_q4_k(typingctx, r, o, xq, xd, xs, b):
    """Q4_K's 256-block b at r[o:] . the activations' block (xq int8, xd (n/32,) f32 scales, xs (n/16,) i32 sums)
    -> f32: its 8 scales and mins decoded as vectors (llama.cpp's masks), the sub-block dots accumulated in
    two 8-lane registers, the mins folded through the activations' 32-sums."""
    sig = types.float32(r, o, xq, xd, xs, b)

    def codegen(context, builder, signature, args):
        a = signature.args
        idx = ir.IntType(64)
        rp = _arr_ptr(context, builder, a[0], args[0], _i8)
        xp = _arr_ptr(context, builder, a[2], args[2], _i8)
        dp = _arr_ptr(context, builder, a[3], args[3], _f32)
        sp = _arr_ptr(context, builder, a[4], args[4], _i32)
        o, b = args[1], args[5]
        vf, vt = ir.VectorType(_f32, 8), ir.VectorType(_i8, 32)

        def c32(v):
            return ir.Constant(_i32, v)
        u = [builder.load(builder.bitcast(builder.gep(rp, [builder.add(o, ir.Constant(idx, 4 + 4 * k))]),
                                          _i32.as_pointer()), align=1) for k in range(3)]
        k1, k2, k3 = c32(0x3F3F3F3F), c32(0x0F0F0F0F), c32(0x03030303)
        u3 = builder.or_(builder.and_(builder.lshr(u[2], c32(4)), k2),
                         builder.shl(builder.and_(builder.lshr(u[1], c32(6)), k3), c32(4)))
        m0 = builder.and_(u[1], k1)
        s1 = builder.or_(builder.and_(u[2], k2), builder.shl(builder.and_(builder.lshr(u[0], c32(6)), k3), c32(4)))
        s0 = builder.and_(u[0], k1)
        v2 = ir.VectorType(_i32, 2)

        def bytes8(lo, hi):
            p = builder.insert_element(builder.insert_element(ir.Constant(v2, None), lo, c32(0)), hi, c32(1))
            return builder.uitofp(builder.bitcast(p, ir.VectorType(_i8, 8)), vf)
        hp = builder.bitcast(builder.gep(rp, [o]), ir.IntType(16).as_pointer())
        d = builder.fpext(builder.bitcast(builder.load(hp, align=1), ir.HalfType()), _f32)
        hp2 = builder.bitcast(builder.gep(rp, [builder.add(o, ir.Constant(idx, 2))]), ir.IntType(16).as_pointer())
        dmin = builder.fpext(builder.bitcast(builder.load(hp2, align=1), ir.HalfType()), _f32)
        a0 = builder.mul(b, ir.Constant(idx, 8))
        xd8 = _vload(builder, dp, a0, vf)
        scales = builder.fmul(builder.fmul(bytes8(s0, s1), _splat_f(builder, d)), xd8)
        xs16 = _vload(builder, sp, builder.mul(a0, ir.Constant(idx, 2)), ir.VectorType(_i32, 16))
        ev = builder.shuffle_vector(xs16, xs16, ir.Constant(ir.VectorType(_i32, 8), list(range(0, 16, 2))))
        od = builder.shuffle_vector(xs16, xs16, ir.Constant(ir.VectorType(_i32, 8), list(range(1, 16, 2))))
        xsum = builder.fmul(builder.sitofp(builder.add(ev, od), vf), xd8)
        mins = builder.fmul(builder.fmul(bytes8(m0, u3), _splat_f(builder, dmin)), xsum)
        accs = [ir.Constant(vf, None), ir.Constant(vf, None)]
        for line in range(0, 144, 64):
            prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, line)), ahead=BLOCK_AHEAD)
        x0 = builder.mul(b, ir.Constant(idx, 256))
        for c in range(4):
            bb = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, 16 + 32 * c))]), 32)
            for half in range(2):
                q = builder.and_(bb, ir.Constant(vt, [15] * 32)) if half == 0 else builder.lshr(bb, ir.Constant(vt, [4] * 32))
                i = 2 * c + half
                xv = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 32 * i))]), 32)
                p8 = _dot8(builder, q, xv, False)
                accs[half] = builder.fadd(accs[half], builder.fmul(builder.sitofp(p8, vf), _bcast(builder, scales, i)))
        return builder.fsub(_hsum(builder, builder.fadd(accs[0], accs[1])), _hsum(builder, mins))
    return sig, codegen


@intrinsic
def kblock_q6_k(typingctx, r, o, xq, xd, xs, b):
    """Q6_K's 256-block b at r[o:] . the activations' block (xq int8, xd (n/32,) f32 scales, xs (n/16,) i32 sums)
    -> f32: its 16 scales as one vector, the group dots accumulated in two 8-lane registers (with VNNI: the
    values 0..63 times the activations in `vpdpbusd`, lanes 0-3 one group and 4-7 the next, Q6_K's offset
    of 32 taken out once per block through the 16-sums)."""
    sig = types.float32(r, o, xq, xd, xs, b)

    def codegen(context, builder, signature, args):
        a = signature.args
        idx = ir.IntType(64)
        rp = _arr_ptr(context, builder, a[0], args[0], _i8)
        xp = _arr_ptr(context, builder, a[2], args[2], _i8)
        dp = _arr_ptr(context, builder, a[3], args[3], _f32)
        o, b = args[1], args[5]
        vf, vt = ir.VectorType(_f32, 8), ir.VectorType(_i8, 32)
        v16 = ir.VectorType(_f32, 16)

        def at(off):
            return builder.add(o, ir.Constant(idx, off))
        hp = builder.bitcast(builder.gep(rp, [at(208)]), ir.IntType(16).as_pointer())
        d = builder.fpext(builder.bitcast(builder.load(hp, align=1), ir.HalfType()), _f32)
        sc = builder.sitofp(_vload(builder, rp, at(192), ir.VectorType(_i8, 16)), v16)
        xd8 = _vload(builder, dp, builder.mul(b, ir.Constant(idx, 8)), vf)
        xd16 = builder.shuffle_vector(xd8, xd8, ir.Constant(ir.VectorType(_i32, 16), [g // 2 for g in range(16)]))
        dv = builder.insert_element(ir.Constant(v16, None), d, ir.Constant(_i32, 0))
        dv = builder.shuffle_vector(dv, ir.Constant(v16, None), ir.Constant(ir.VectorType(_i32, 16), [0] * 16))
        scales = builder.fmul(builder.fmul(sc, dv), xd16)
        accs = [ir.Constant(vf, None), ir.Constant(vf, None)]
        for line in range(0, 210, 64):
            prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, line)), ahead=BLOCK_AHEAD)
        x0 = builder.mul(b, ir.Constant(idx, 256))
        for h in range(2):
            qh = _load(builder, builder.gep(rp, [at(128 + 32 * h)]), 32)
            for c in range(4):
                ql = _load(builder, builder.gep(rp, [at(64 * h + 32 * (c % 2))]), 32)
                low = builder.and_(builder.lshr(ql, ir.Constant(vt, [4 * (c // 2)] * 32)), ir.Constant(vt, [15] * 32))
                high = builder.and_(builder.lshr(qh, ir.Constant(vt, [2 * c] * 32)), ir.Constant(vt, [3] * 32))
                q = builder.or_(low, builder.shl(high, ir.Constant(vt, [4] * 32)))
                xv = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 128 * h + 32 * c))]), 32)
                if HAVE_VNNI256:
                    g = 8 * h + 2 * c
                    sv = builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(_i32, 8), [g] * 4 + [g + 1] * 4))
                    p8 = _dot8(builder, q, xv, False)
                    accs[c % 2] = builder.fadd(accs[c % 2], builder.fmul(builder.sitofp(p8, vf), sv))
                    continue
                q = builder.sub(q, ir.Constant(vt, [32] * 32))
                q16, x16 = _i16(builder, q, 32, True), _i16(builder, xv, 32, True)
                for part in range(2):
                    sel = ir.Constant(ir.VectorType(_i32, 16), list(range(16 * part, 16 * part + 16)))
                    p8 = _pairs(builder, builder.shuffle_vector(q16, q16, sel), builder.shuffle_vector(x16, x16, sel), 16)
                    s = _bcast(builder, scales, 8 * h + 2 * c + part)
                    accs[part] = builder.fadd(accs[part], builder.fmul(builder.sitofp(p8, vf), s))
        total = _hsum(builder, builder.fadd(accs[0], accs[1]))
        if not HAVE_VNNI256:
            return total
        sp = _arr_ptr(context, builder, a[4], args[4], _i32)                # the offset: 32 * sum_g scale_g * xsum_g
        xs16 = builder.sitofp(_vload(builder, sp, builder.mul(b, ir.Constant(idx, 16)), ir.VectorType(_i32, 16)), v16)
        corr = builder.fmul(scales, xs16)
        lanes = [builder.extract_element(corr, ir.Constant(_i32, i)) for i in range(16)]
        while len(lanes) > 1:
            lanes = [builder.fadd(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
        return builder.fsub(total, builder.fmul(lanes[0], ir.Constant(_f32, 32.0)))
    return sig, codegen
