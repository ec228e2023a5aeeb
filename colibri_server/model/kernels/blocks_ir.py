"""The integer row dots of the block kinds (kernels/blocks), written as LLVM vector IR.

Numba types integer arithmetic at 64 bits, so a plain loop of int8 products widens to i64 lanes
and LLVM cannot find the byte instructions. Here each dot is vector expressions over whole
sub-blocks: Q8_0 and Q4_0 blocks with `vpdpbusd` (AVX-512 VNNI / AVX-VNNI) or `vpmaddwd`, their f32
scale per 32-block (their row loops are kernels/blocks_row32's); the k-quants (Q4_K, Q5_K, Q6_K) with
`vpmaddubsw` (values times activations, pairs in i16) and `vpmaddwd` by the sub-block scales, so a
256-block's sum is one exact int32 and its float step (k_update) is shared with the tiled GEMM
(kernels/blocks_gemm). On CPUs without AVX2 LLVM lowers portable IR of the same integers to what the
target has.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import FEATURES, HAVE_AVX2, HAVE_VNNI512
from .prefetch import prefetch_ahead

# vpdpbusd on 256-bit registers: AVX-512 VNNI with VL (Zen 4, Ice Lake on), or AVX-VNNI (Alder Lake on)
HAVE_VNNI256 = (HAVE_VNNI512 and "avx512vl" in FEATURES) or "avxvnni" in FEATURES
# byte shuffles across two 512-bit registers (`vpermt2b`, Zen 4, Ice Lake on): the Q4_0 row dot reads 8 blocks
# with whole 64-byte loads and gathers their values and scales in registers (row_q4_0_sw)
HAVE_VBMI = HAVE_VNNI512 and "avx512vbmi" in FEATURES

_i8, _i32 = ir.IntType(8), ir.IntType(32)
# bytes ahead of the block being read that the row loops ask into L2 (kernels/prefetch). Measured on the
# shared Zen 4 machine, 48 2048x1024 matrices in turn from DRAM, one thread, 0 vs 4096: Q4_0 387 vs 227 us
# a matrix, Q8_0 334 / 330, Q4_K 240 / 246, Q6_K 315 / 319 (the machine loaded by other work: noisy)
BLOCK_AHEAD = 4096
# Q8_0's row dot asks for the bytes BLOCK_AHEAD on only where it multiplies with `vpmaddubsw` (AVX2): there, one thread,
# 64 2048 x 1024 Q8_0 matrices in turn from DRAM (a 2-vCPU Zen 3), 0.166 -> 0.126 ms a matrix (1024 bytes ahead 0.133,
# 16384 0.126); with `vpdpbusd` (a Zen 4) one prefetch a 34-byte block cost 5-8% of a decode token on one thread


def _load(builder, p, n):
    return builder.load(builder.bitcast(p, ir.VectorType(_i8, n).as_pointer()), align=1)


def _reduce(builder, prod, n):
    vd = ir.VectorType(_i32, n)
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, [vd]), f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(f, [prod])


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
    """<32 x i8> weights (signed, or unsigned values 0..127) . <32 x i8> activations (|x| <= 127, the int8 rounding's)
    -> <8 x i32>, lane l the sum of the products of bytes 4l..4l+3: signed weights through llama.cpp's sign trick
    (|w| times x with w's sign), then one `vpdpbusd` where the CPU has it, else on AVX2 `vpmaddubsw` (pairs of
    |w| <= 128 times |x| <= 127 within i16: exact) and `vpmaddwd` by ones; else sign-extended pairs."""
    if not (HAVE_VNNI256 or HAVE_AVX2):
        return _pairs(builder, _i16(builder, w, 32, signed), _i16(builder, x, 32, True), 32)
    vd = ir.VectorType(_i32, 8)
    if signed:
        x, w = sign_trick(builder, w, x)
    if not HAVE_VNNI256:
        return _scaled_dot(builder, w, x, ir.Constant(ir.VectorType(ir.IntType(16), 16), [1] * 16))
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), "llvm.x86.avx512.vpdpbusd.256")
    return builder.call(f, [ir.Constant(vd, None), builder.bitcast(w, vd), builder.bitcast(x, vd)])


def sign_trick(builder, w, x):
    """<32 x i8> signed weights w and activations x -> (x with w's sign, |w|): llama.cpp's sign trick, so that a
    `vpmaddubsw` (unsigned times signed) multiplies signed bytes. x is negated where w < 0 and zeroed where w == 0
    (its product with |w| = 0 is 0 either way); |-128| is 128 as the unsigned byte. On AVX2 one `vpsignb` and one
    `vpabsb` (a select on w < 0 compiled to a compare, an xor and a subtract for x: 4 vector instructions a block
    of the Q8_0 row dot instead of 2)."""
    vt, zero = w.type, ir.Constant(w.type, None)
    neg = builder.icmp_signed("<", w, zero)
    if HAVE_AVX2 and vt.count == 32:
        sign = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt]), "llvm.x86.avx2.psign.b")
        x = builder.call(sign, [x, w])
    else:
        x = builder.select(neg, builder.sub(zero, x), x)
    return x, builder.select(neg, builder.sub(zero, w), w)


def _nibbles32(builder, bb):
    """<16 x i8> of packed nibbles -> <32 x i8>: the low nibbles, then the high ones (Q4_0's value order). On AVX2
    the 16 bytes in both halves of a register, the upper half shifted by 4 (`vbroadcasti128`, `vpsrlvd`, `vpand`)
    rather than split and joined (a shift, an insert and an and): the Q4_0 matrix above 0.110 -> 0.100 ms."""
    vt, m32 = ir.VectorType(_i8, 32), ir.VectorType(_i32, 32)
    if HAVE_AVX2:
        both = builder.bitcast(builder.shuffle_vector(bb, bb, ir.Constant(m32, list(range(16)) * 2)), ir.VectorType(_i32, 8))
        shifted = builder.lshr(both, ir.Constant(ir.VectorType(_i32, 8), [0] * 4 + [4] * 4))
        return builder.and_(builder.bitcast(shifted, vt), ir.Constant(vt, [15] * 32))
    v16 = ir.VectorType(_i8, 16)
    return builder.shuffle_vector(builder.and_(bb, ir.Constant(v16, [15] * 16)), builder.lshr(bb, ir.Constant(v16, [4] * 16)),
                                  ir.Constant(m32, list(range(32))))


def _widen(builder, v):
    """<16 x i8> -> <64 x i8>, the upper 48 bytes zero."""
    z = ir.Constant(v.type, None)
    return builder.shuffle_vector(v, z, ir.Constant(ir.VectorType(_i32, 64), list(range(16)) + [16] * 48))


def _gather(builder, a, b, picks):
    """Bytes of the 128-byte a ++ b at `picks` (one `vpermt2b` for up to 64 of them, AVX-512 VBMI)."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, len(picks)), picks))


def _dot64(builder, w, x, acc):
    """acc (<16 x i32>) + <64 x i8> unsigned weights . <64 x i8> activations, lane l the sum of bytes 4l..4l+3's
    products (one 512-bit `vpdpbusd`)."""
    vd = ir.VectorType(_i32, 16)
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(f, [acc, builder.bitcast(w, vd), builder.bitcast(x, vd)])


def _i16(builder, v, n, signed):
    vw = ir.VectorType(ir.IntType(16), n)
    return builder.sext(v, vw) if signed else builder.zext(v, vw)


# ---------------------------------------------------------------------------- whole rows and blocks
# The accumulator stays in a register for a whole row (Q8_0, Q4_0) or a whole 256-block (the k-quants,
# whose sums are integer over the block: one float step per block, k_update).

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


def fold_pairs(builder, ps, n: int):
    """A power-of-two count of <n x iK> vectors folded into one: each round, two vectors become one whose
    lanes 0..n/2-1 are the first's adjacent pairs added and the rest the second's (exact: integers). After
    log2(n) rounds of n vectors, lane i is the sum of ps[i]'s lanes."""
    mask = ir.VectorType(_i32, n)
    if n == 8 and len(ps) == 8 and HAVE_AVX2 and not HAVE_VNNI512:
        return _fold8_avx2(builder, ps)
    ev, od = ir.Constant(mask, list(range(0, 2 * n, 2))), ir.Constant(mask, list(range(1, 2 * n, 2)))
    while len(ps) > 1:
        ps = [builder.add(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od))
              for a, b in zip(ps[0::2], ps[1::2])]
    return ps[0]


def _fold8_avx2(builder, ps):
    """fold_pairs of 8 <8 x i32> on AVX2: two rounds of pair sums within each 128-bit half (`vphaddd`, which the
    pairs across the halves each needed a `vpermq` after), then the halves' sums added across (two `vperm2i128`
    and an add): 9 instructions instead of 14, the same integers. One thread on a Zen 3, a 2048 x 1024 matrix in cache,
    one activation row: Q4_0 0.136 -> 0.110 ms, Q8_0 0.119 -> 0.094."""
    m8 = ir.VectorType(_i32, 8)

    def pairs(a, b):        # [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(m8, [0, 2, 8, 10, 4, 6, 12, 14])),
                           builder.shuffle_vector(a, b, ir.Constant(m8, [1, 3, 9, 11, 5, 7, 13, 15])))
    r = [pairs(ps[i], ps[i + 1]) for i in range(0, 8, 2)]
    s0, s1 = pairs(r[0], r[1]), pairs(r[2], r[3])       # lane j < 4: ps[j]'s lanes 0-3, lane 4 + j: its lanes 4-7
    return builder.add(builder.shuffle_vector(s0, s1, ir.Constant(m8, [0, 1, 2, 3, 8, 9, 10, 11])),
                       builder.shuffle_vector(s0, s1, ir.Constant(m8, [4, 5, 6, 7, 12, 13, 14, 15])))


def fold_blocks(builder, ps):
    """Vectors of 8 or 16 i32 lanes, 8 blocks' (or rows') integers in order, one a vector -> <8 x i32>, lane i the
    sum of ps[i]'s lanes (exact: integers). Also 4 vectors of 16 lanes holding two blocks each (block 2j in lanes 0-7
    of vector j, block 2j + 1 in lanes 8-15): the same folds give lane i block i's sum."""
    v = fold_pairs(builder, ps, ps[0].type.count)
    if v.type.count == 8:
        return v
    m = ir.VectorType(_i32, 8)       # 16 lanes: ps[i]'s sum is in lanes 2i, 2i + 1
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(m, list(range(0, 16, 2)))),
                       builder.shuffle_vector(v, v, ir.Constant(m, list(range(1, 16, 2)))))


def _sum8(builder, ps):
    """8 <8 x i32> vectors -> one <8 x i32>, lane i the sum of ps[i]'s lanes (exact: integers)."""
    return fold_pairs(builder, ps, 8)


def _vload(builder, base, off, vt):
    return builder.load(builder.bitcast(builder.gep(base, [off]), vt.as_pointer()), align=1)


def sums32(builder, sp, at):
    """<8 x i32>: the activations' 32-sums from element `at` (i64) of their 16-sums (sp, an i32 pointer): lane i
    16-sums 2i and 2i + 1 added (a 256-block's 8 sub-blocks at at = 16 b, or 8 32-blocks at at = 2 b0)."""
    v8 = ir.VectorType(_i32, 8)
    xs16 = _vload(builder, sp, at, ir.VectorType(_i32, 16))
    return builder.add(builder.shuffle_vector(xs16, xs16, ir.Constant(v8, list(range(0, 16, 2)))),
                       builder.shuffle_vector(xs16, xs16, ir.Constant(v8, list(range(1, 16, 2)))))


def k_values32(builder, rp, o, h, six, qh=None):
    """The 4 sub-blocks of 32 values of half h of the k-quant block at byte o of rp, each a <32 x i8> of its unsigned
    values in order (values 128h + 32c.., c = 0..3), 32 bytes a load (the AVX2 paths): Q6_K's (six, 0..63), Q4_K's
    (0..15) or, given qh (the 32 bytes of fifth bits at o + 16), Q5_K's (0..31)."""
    idx = ir.IntType(64)

    def at(off):
        return builder.gep(rp, [builder.add(o, ir.Constant(idx, off))])

    def c8(v):
        return ir.Constant(ir.VectorType(_i8, 32), [v] * 32)
    qs = []
    if six:
        high = _load(builder, at(128 + 32 * h), 32)
        for c in range(4):
            low = builder.and_(builder.lshr(_load(builder, at(64 * h + 32 * (c % 2)), 32), c8(4 * (c // 2))), c8(15))
            qs.append(builder.or_(low, builder.shl(builder.and_(builder.lshr(high, c8(2 * c)), c8(3)), c8(4))))
        return qs
    for c in (2 * h, 2 * h + 1):
        bb = _load(builder, at((16 if qh is None else 48) + 32 * c), 32)
        for half in range(2):
            q = builder.and_(bb, c8(15)) if half == 0 else builder.lshr(bb, c8(4))
            if qh is not None:  # Q5_K: bit j of qh[k] is the fifth bit of sub-block j's value k
                q = builder.or_(q, builder.shl(builder.and_(builder.lshr(qh, c8(2 * c + half)), c8(1)), c8(4)))
            qs.append(q)
    return qs


def _f16_at(builder, rp, off):
    """The f16 at byte off of the i8 pointer rp, as f32."""
    hp = builder.bitcast(builder.gep(rp, [off]), ir.IntType(16).as_pointer())
    return builder.fpext(builder.bitcast(builder.load(hp, align=1), ir.HalfType()), _f32)


def _scaled_dot(builder, q, x, s16):
    """<32 x i8> values 0..63 . <32 x i8> activations, each 16 bytes' products times their i16 scale: s16
    <16 x i16> (lanes 0-7 the scale of bytes 0-15, lanes 8-15 of bytes 16-31) -> <8 x i32> partial sums,
    exact (`vpmaddubsw`: pairs <= 2*63*127, no saturation; `vpmaddwd` by the scales)."""
    vw, vd = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_i32, 8)
    if HAVE_AVX2:
        mub = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vw, [ir.VectorType(_i8, 32)] * 2),
                                             "llvm.x86.avx2.pmadd.ub.sw")
        mwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vw, vw]), "llvm.x86.avx2.pmadd.wd")
        return builder.call(mwd, [builder.call(mub, [q, x]), s16])
    v32 = ir.VectorType(_i32, 32)
    s32 = builder.sext(builder.shuffle_vector(s16, s16, ir.Constant(v32, [k // 16 * 8 for k in range(32)])), v32)
    prod = builder.mul(builder.mul(builder.zext(q, v32), builder.sext(x, v32)), s32)
    lo = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_i32, 16), list(range(16))))
    hi = builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_i32, 16), list(range(16, 32))))
    s = builder.add(lo, hi)
    return builder.add(builder.shuffle_vector(s, s, ir.Constant(vd, list(range(8)))),
                       builder.shuffle_vector(s, s, ir.Constant(vd, list(range(8, 16)))))


def _join(builder, lo, hi):
    """Two <32 x i8> as one <64 x i8>: lo's bytes, then hi's."""
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 64), list(range(64))))


def _scaled_dot64(builder, q, x, s32):
    """_scaled_dot on 512-bit registers (AVX-512 BW): <64 x i8> values 0..63 . <64 x i8> activations, the
    products of bytes 2k, 2k+1 summed in i16 lane k and times s32's lane k (<32 x i16>) -> <16 x i32>, exact."""
    vw, vd = ir.VectorType(ir.IntType(16), 32), ir.VectorType(_i32, 16)
    mub = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vw, [ir.VectorType(_i8, 64)] * 2),
                                         "llvm.x86.avx512.pmaddubs.w.512")
    mwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vw, vw]), "llvm.x86.avx512.pmaddw.d.512")
    return builder.call(mwd, [builder.call(mub, [q, x]), s32])


def _s16(builder, sa, sb):
    """<16 x i16>: lanes 0-7 the i16 sa, 8-15 sb."""
    vw = ir.VectorType(ir.IntType(16), 16)
    v = builder.insert_element(builder.insert_element(ir.Constant(vw, None), sa, ir.Constant(_i32, 0)),
                               sb, ir.Constant(_i32, 8))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, 16), [0] * 8 + [8] * 8))


def k_update(builder, acc, isum, d, xd, msum=None, dmin=None):
    """The k-quants' float step of a 256-block, the same operations in the row dots here and in the tiled
    GEMM (kernels/blocks_gemm, 16 rows a vector): acc + float(I) * (d * xd) [- float(M) * (dmin * xd)]."""
    acc = builder.fadd(acc, builder.fmul(builder.sitofp(isum, acc.type), builder.fmul(d, xd)))
    if msum is not None:
        acc = builder.fsub(acc, builder.fmul(builder.sitofp(msum, acc.type), builder.fmul(dmin, xd)))
    return acc


def _k_scales_mins(builder, rp, o):
    """Q4_K / Q5_K: the 8 6-bit sub-block scales and the 8 mins of the block at byte o of rp (its 12 packed
    bytes L at o + 4), as two <8 x i8>, unpacked in one vector: scale j < 4 is L[j] & 63, j >= 4 is
    (L[j + 4] & 15) | (L[j - 4] >> 6) << 4; min j < 4 is L[j + 4] & 63, j >= 4 is L[j + 4] >> 4 | (L[j] >> 6) << 4."""
    v16 = ir.VectorType(_i8, 16)
    m16 = ir.VectorType(_i32, 16)

    def sh(v, mask):
        return builder.shuffle_vector(v, v, ir.Constant(m16, mask))

    def c(vals):
        return ir.Constant(v16, vals)
    L = _vload(builder, rp, builder.add(o, ir.Constant(ir.IntType(64), 4)), v16)     # bytes 12..15: qs's, unused
    low = sh(L, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])       # lanes 0-7 the scales', 8-15 the mins'
    lo = builder.or_(builder.and_(low, c([63] * 4 + [15] * 4 + [63] * 4 + [0] * 4)),
                     builder.and_(builder.lshr(low, c([4] * 16)), c([0] * 12 + [15] * 4)))
    top = sh(L, [0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])           # their two high bits, lanes 4-7, 12-15
    hi = builder.and_(builder.shl(builder.lshr(top, c([6] * 16)), c([4] * 16)), c(([0] * 4 + [48] * 4) * 2))
    r = builder.or_(lo, hi)
    v8 = ir.VectorType(_i32, 8)
    return (builder.shuffle_vector(r, r, ir.Constant(v8, list(range(8)))),
            builder.shuffle_vector(r, r, ir.Constant(v8, list(range(8, 16)))))


def _kblock_q45_k(five):
    def impl(typingctx, r, o, xq, xd, xs, b, acc):
        return types.float32(r, o, xq, xd, xs, b, acc), lambda context, builder, signature, args: _q45_codegen(
            context, builder, signature, args, five)
    return impl


def _q45_codegen(context, builder, signature, args, five):
    a = signature.args
    rp = _arr_ptr(context, builder, a[0], args[0], _i8)
    xp = _arr_ptr(context, builder, a[2], args[2], _i8)
    dp = _arr_ptr(context, builder, a[3], args[3], _f32)
    sp = _arr_ptr(context, builder, a[4], args[4], _i32)
    o, b = args[1], args[5]
    ivec, mprod = q45_ints(builder, rp, o, xp, sp, b, five)
    return k_update(builder, args[6], _reduce(builder, ivec, ivec.type.count), _f16_at(builder, rp, o),
                    builder.load(builder.gep(dp, [b])), _reduce(builder, mprod, 8),
                    _f16_at(builder, rp, builder.add(o, ir.Constant(ir.IntType(64), 2))))


def q45_ints(builder, rp, o, xp, sp, b, five, ahead=True):
    """Q4_K / Q5_K's block at byte o of rp . the activations' block b: (ivec, mprod), two vectors whose lanes sum
    to the block's exact integers I = sum_j sc_j * (q_j . x_j) and M = sum_j m_j * (x_j's 32-sum) (<16 x i32>
    with AVX-512, two sub-blocks an instruction, else <8 x i32>; mprod <8 x i32>). The sums are left to the
    caller: one row's dot reduces them, kernels/blocks_rows8 folds 8 rows' into one vector. ahead: prefetch the
    bytes BLOCK_AHEAD beyond the block (False: the caller prefetches)."""
    idx = ir.IntType(64)
    vt = ir.VectorType(_i8, 32)
    i16 = ir.IntType(16)
    sc8, mn8 = _k_scales_mins(builder, rp, o)
    for line in range(0, (176 if five else 144) if ahead else 0, 64):
        prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, line)), ahead=BLOCK_AHEAD)
    x0 = builder.mul(b, ir.Constant(idx, 256))
    qs = 48 if five else 16
    if five:
        qh = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, 16))]), 32)
    if HAVE_VNNI512:
        # two sub-blocks an instruction, from whole 64-byte loads: qs's bytes 64h..64h+63 hold sub-blocks 4h and 4h+2
        # in their low nibbles (bytes 0-31, 32-63) and 4h+1, 4h+3 in their high ones, so the activations' sub-blocks
        # are paired the same way (two shuffles of their two 64-byte loads, shared by kernels/blocks_rows8's 8 rows)
        v64 = ir.VectorType(_i8, 64)
        sc16 = builder.zext(sc8, ir.VectorType(i16, 8))
        ivec = ir.Constant(ir.VectorType(_i32, 16), None)
        if five:                # bytes 0-31 qh, 32-63 qh >> 2: bit 4h (+1) of a byte is the fifth bit of lo's (hi's)
            qh2 = _join(builder, qh, builder.lshr(qh, ir.Constant(vt, [2] * 32)))
        for h in range(2):
            bb = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, qs + 64 * h))]), 64)
            xa = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 128 * h))]), 64)
            xb = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 128 * h + 64))]), 64)
            lo, hi = builder.and_(bb, ir.Constant(v64, [15] * 64)), builder.lshr(bb, ir.Constant(v64, [4] * 64))
            if five:
                one, four = ir.Constant(v64, [1] * 64), ir.Constant(v64, [4] * 64)
                lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(qh2, ir.Constant(v64, [4 * h] * 64)), one), four))
                hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(qh2, ir.Constant(v64, [4 * h + 1] * 64)), one),
                                                 four))
            for q, half in ((lo, 0), (hi, 1)):
                xv = builder.shuffle_vector(xa, xb, ir.Constant(ir.VectorType(_i32, 64),
                                                                [32 * half + k for k in range(32)]
                                                                + [64 + 32 * half + k for k in range(32)]))
                j = 4 * h + half
                s = builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(_i32, 32), [j] * 16 + [j + 2] * 16))
                ivec = builder.add(ivec, _scaled_dot64(builder, q, xv, s))
    else:
        ivec = ir.Constant(ir.VectorType(_i32, 8), None)
        # the 8 scales as i16 in both 128-bit halves, so that each sub-block's scale is an in-lane broadcast (one
        # `vpshufb`), not a scalar extracted and broadcast again
        sc8x2 = builder.zext(builder.shuffle_vector(sc8, sc8, ir.Constant(ir.VectorType(_i32, 16), list(range(8)) * 2)),
                             ir.VectorType(i16, 16))
        for h in range(2):
            for c, q in enumerate(k_values32(builder, rp, o, h, False, qh if five else None)):
                j = 4 * h + c
                xv = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 32 * j))]), 32)
                s = builder.shuffle_vector(sc8x2, sc8x2, ir.Constant(ir.VectorType(_i32, 16), [j] * 8 + [8 + j] * 8))
                ivec = builder.add(ivec, _scaled_dot(builder, q, xv, s))
    return ivec, builder.mul(builder.zext(mn8, ir.VectorType(_i32, 8)), sums32(builder, sp, builder.mul(b, ir.Constant(idx, 16))))


kblock_q4_k = intrinsic(_kblock_q45_k(False))
kblock_q4_k.__doc__ = """acc + Q4_K's 256-block b at r[o:] . the activations' block b (xq int8 rounded per 256 with scale
xd[b], xs (n/16,) i32 sums) -> f32. The integer sums are exact: I = sum_j sc_j * (q_j . x_j) and M = sum_j m_j *
(x_j's sum) over the 8 sub-blocks j, then acc + I * (d * xd) - M * (dmin * xd) (k_update): any kernel that sums
the same integers gives the same bits."""
kblock_q5_k = intrinsic(_kblock_q45_k(True))
kblock_q5_k.__doc__ = "kblock_q4_k for Q5_K's 176-byte block (qh at 16, its fifth bits; qs at 48)"


@intrinsic
def kblock_q6_k(typingctx, r, o, xq, xd, xs, b, acc):
    """acc + Q6_K's 256-block b at r[o:] . the activations' block b (as kblock_q4_k) -> f32: I = sum_g sc_g *
    (q_g . x_g - 32 * x_g's sum) over the 16 groups g of 16 (q the 6-bit values 0..63), exact, then
    acc + I * (d * xd) (k_update)."""
    sig = types.float32(r, o, xq, xd, xs, b, acc)

    def codegen(context, builder, signature, args):
        a = signature.args
        rp = _arr_ptr(context, builder, a[0], args[0], _i8)
        xp = _arr_ptr(context, builder, a[2], args[2], _i8)
        dp = _arr_ptr(context, builder, a[3], args[3], _f32)
        sp = _arr_ptr(context, builder, a[4], args[4], _i32)
        o, b = args[1], args[5]
        isum = _reduce(builder, q6_ints(builder, rp, o, xp, sp, b), 16)
        return k_update(builder, args[6], isum, _f16_at(builder, rp, builder.add(o, ir.Constant(ir.IntType(64), 208))),
                        builder.load(builder.gep(dp, [b])))
    return sig, codegen


def q6_ints(builder, rp, o, xp, sp, b, ahead=True):
    """Q6_K's block at byte o of rp . the activations' block b: a <16 x i32> whose lanes sum to the block's exact
    integer I (kblock_q6_k); the sum left to the caller, as q45_ints."""
    idx = ir.IntType(64)
    vt = ir.VectorType(_i8, 32)
    i16 = ir.IntType(16)

    def at(off):
        return builder.add(o, ir.Constant(idx, off))
    sc = _vload(builder, rp, at(192), ir.VectorType(_i8, 16))
    for line in range(0, 210 if ahead else 0, 64):
        prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, line)), ahead=BLOCK_AHEAD)
    x0 = builder.mul(b, ir.Constant(idx, 256))
    v16 = ir.VectorType(_i32, 16)
    if HAVE_VNNI512:            # two sub-blocks an instruction: c = 2p, 2p+1
        v64 = ir.VectorType(_i8, 64)
        ivec = ir.Constant(v16, None)
        s16 = builder.sext(sc, ir.VectorType(i16, 16))
        for h in range(2):
            ql = _load(builder, builder.gep(rp, [at(64 * h)]), 64)       # sub-block c's low bits: ql[32(c%2):] >> 4(c//2)
            qh = _load(builder, builder.gep(rp, [at(128 + 32 * h)]), 32)
            qh2 = _join(builder, qh, builder.lshr(qh, ir.Constant(vt, [2] * 32)))     # c's high bits: qh >> 2c
            for p in range(2):
                low = builder.and_(builder.lshr(ql, ir.Constant(v64, [4 * p] * 64)), ir.Constant(v64, [15] * 64))
                high = builder.and_(builder.lshr(qh2, ir.Constant(v64, [4 * p] * 64)), ir.Constant(v64, [3] * 64))
                q = builder.or_(low, builder.shl(high, ir.Constant(v64, [4] * 64)))
                xv = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 128 * h + 64 * p))]), 64)
                g = 8 * h + 4 * p
                s = builder.shuffle_vector(s16, s16, ir.Constant(ir.VectorType(_i32, 32), [k // 8 + g for k in range(32)]))
                ivec = builder.add(ivec, _scaled_dot64(builder, q, xv, s))
    else:
        ivec = ir.Constant(ir.VectorType(_i32, 8), None)
        s16 = builder.sext(sc, ir.VectorType(i16, 16))
        for h in range(2):
            # the half's 8 group scales in both 128-bit halves: each sub-block's pair (g, g + 1) an in-lane shuffle
            sh = builder.shuffle_vector(s16, s16, ir.Constant(ir.VectorType(_i32, 16), list(range(8 * h, 8 * h + 8)) * 2))
            for c, q in enumerate(k_values32(builder, rp, o, h, True)):
                xv = _load(builder, builder.gep(xp, [builder.add(x0, ir.Constant(idx, 128 * h + 32 * c))]), 32)
                pair = builder.shuffle_vector(sh, sh, ir.Constant(ir.VectorType(_i32, 16), [2 * c] * 8 + [9 + 2 * c] * 8))
                ivec = builder.add(ivec, _scaled_dot(builder, q, xv, pair))     # groups 8h + 2c, 8h + 2c + 1
        ivec = builder.shuffle_vector(ivec, ir.Constant(ivec.type, None), ir.Constant(v16, list(range(16))))
    xs16 = _vload(builder, sp, builder.mul(b, ir.Constant(idx, 16)), v16)
    off = builder.mul(builder.mul(builder.sext(sc, v16), xs16), ir.Constant(v16, [32] * 16))
    return builder.sub(ivec, off)
