"""The output head's products: block-kind rows times activations rounded to 16 bits (a kind id + ACTS16).

llama.cpp rounds the activations to int8 for its integer dots (kernels/blocks.quant_acts): a step of
max|x_b| / 127 per block, which can swap a real model's two best first tokens when they are near
(SmolLM2's Q4_1 file answers "L'Étoile..." for "Paris": docs/models.md, "The output head"). For the head
the activations are rounded to int16 instead: x ~ d_b * X_b with d_b = max|x_b| / 32767 per block (32
weights for Q8_0 / Q4_0, 256 for the k-quants, as the int8 rounding's blocks): a step 258 times finer, what
two int8 roundings (the value, then its remainder) would give, in one pass. The dots stay integer: the
weight values widened to i16 in registers and multiplied in pairs (`vpdpwssd` on AVX-512 VNNI, 32 weights
an instruction; `vpmaddwd` elsewhere), exact sums per block:

* Q8_0, Q4_0 (its values - 8): one <16 x i32> per block, 8 blocks summed lane-wise into one vector (lane b
  the block b's sum, at most 32 * 128 * 32767), then kernels/blocks_row32's float step b32_update, 8 partial
  sums per row as the int8 row dots have;
* Q4_K, Q5_K, Q6_K: the sub-block scales multiplied into the widened values (`vpmullw`: at most 63 * 31 or
  32 * 128, i16), the block's 16 lanes (each at most 16 products of 4096 * 32767 < 2^31) summed in i64 and
  one float step per block (blocks_ir.k_update), Q4_K / Q5_K's mins through the activations' 16-sums; a
  block's weights decoded once for 8 activation rows, their exact sums folded together (a serving step's, a
  prefill's), each row's integers and float steps those of its dot alone.

The kinds without integer dots take the f32 activations as they are (kernels/blocks' generic path) with or
without the flag. Every caller (batch-1 matvec, a serving step's rows, prefill, threads) goes through these
row dots, each weight row read once for all the activation rows, or, from a few activation rows, through tiles of
16 weight rows with the same integers and float steps (Q8_0 / Q4_0: kernels/blocks_gemm; Q6_K: kernels/blocks_head):
the same bits whatever the caller.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks import ACTS16, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, SB, _put2, _rows
from .blocks_ir import (
    BLOCK_AHEAD,
    HAVE_VBMI,
    _arr_ptr,
    _f16_at,
    _join,
    _k_scales_mins,
    _load,
    _reduce,
    _scaled_dot,
    _scaled_dot64,
    _vload,
    fold_blocks,
    fold_pairs,
    k_update,
    k_values32,
    sums32,
)
from .blocks_row32 import b32_row
from .blocks_rows8 import ROWS as ROWS8
from .blocks_rows8 import f16_lanes, lanes, word
from .cpu import HAVE_AVX2, HAVE_VNNI512
from .prefetch import prefetch_ahead
from .quant_ir import _round

__all__ = ["ACTS16", "quant_acts16", "round_rows16", "rows16"]

_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16 = ir.VectorType(_i32, 16)
_W32 = ir.VectorType(_i16, 32)
Q16 = np.float32(32767.0)


# ---------------------------------------------------------------------------- activations

@njit(cache=True, inline="always")
def quant_acts16(x, xq, xd, xs, B):
    # x (n,) f32 -> int16 values X = round(x / d_b) per B-block b (B = 32 or 256) in xq (2n,) i8 (read as i16),
    # xd[b] = d_b = max|x_b| / 32767, xs (n/16,) i32 the sums of 16 consecutive values
    n = x.shape[0]
    v = xq[:2 * n].view(np.int16)
    for b in range(n // B):
        m = np.float32(0.0)
        for k in range(b * B, b * B + B):
            m = max(m, abs(x[k]))
        d = m / Q16
        xd[b] = d
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for g in range(b * B // SB, (b + 1) * B // SB):
            s = np.int32(0)
            for k in range(g * SB, g * SB + SB):
                a = _round(x[k] * inv)
                v[k] = np.int16(a)
                s += a
            xs[g] = s


@njit(cache=True)
def round_rows16(kind, X, Xq, Xd, Xs):
    # every row of X (T, n) rounded to int16 for kind + ACTS16: Xq (T, >= 2n) i8 holding the i16 values, Xd (T, n/32)
    # f32 (the k-quants': n/256 of them), Xs (T, n/16) i32; nothing for the kinds that take f32 activations
    k = kind & (ACTS16 - 1)
    if k != Q8_0 and k != Q4_0 and k != Q4_K and k != Q5_K and k != Q6_K:
        return
    B = 256 if k == Q4_K or k == Q5_K or k == Q6_K else 32
    for t in range(X.shape[0]):
        quant_acts16(X[t], Xq[t], Xd[t], Xs[t], B)


# ---------------------------------------------------------------------------- IR helpers

def _dot16(builder, acc, w, x):
    """acc <16 x i32> + the products of <32 x i16> w and x summed in adjacent pairs (lane l: 2l and 2l+1):
    one `vpdpwssd` on AVX-512 VNNI, else `vpmaddwd` and an add (exact: no saturation)."""
    if HAVE_VNNI512:
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                           "llvm.x86.avx512.vpdpwssd.512")
        return builder.call(f, [acc, builder.bitcast(w, _V16), builder.bitcast(x, _V16)])
    v32 = ir.VectorType(_i32, 32)
    prod = builder.mul(builder.sext(w, v32), builder.sext(x, v32))
    ev = builder.shuffle_vector(prod, prod, ir.Constant(_V16, list(range(0, 32, 2))))
    od = builder.shuffle_vector(prod, prod, ir.Constant(_V16, list(range(1, 32, 2))))
    return builder.add(acc, builder.add(ev, od))


def _x16(builder, xp, at):
    """<32 x i16>: the activations' int16 values at element `at` (i64) of the i16 pointer xp."""
    return builder.load(builder.bitcast(builder.gep(xp, [at]), _W32.as_pointer()), align=2)


def _sum64(builder, v):
    """The 16 lanes of a <16 x i32> summed in i64 (exact)."""
    v64 = ir.VectorType(_i64, 16)
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i64, [v64]), "llvm.vector.reduce.add.v16i64")
    return builder.call(f, [builder.sext(v, v64)])


def _sums64(builder, vs):
    """Each <16 x i32> of vs summed in i64 (exact), as a list of i64: for 8 vectors their halves added in <8 x i64>
    and pairs of vectors folded into one (lanes 0-3 the first's adjacent pairs, 4-7 the second's) three times, one
    lane a vector at the end (the same integers as _sum64's, a fraction of its shuffles); otherwise _sum64 each."""
    if len(vs) % 8:
        return [_sum64(builder, v) for v in vs]
    if len(vs) > 8:
        return [s for i in range(0, len(vs), 8) for s in _sums64(builder, vs[i:i + 8])]
    s = _sums64_lanes(builder, vs)
    return [builder.extract_element(s, ir.Constant(_i32, t)) for t in range(8)]


def _sums64_lanes(builder, vs):
    """8 <16 x i32> -> <8 x i64>, lane t the sum of vs[t]'s lanes (exact): their halves added in <8 x i64>, then
    pairs of vectors folded into one three times (blocks_ir.fold_pairs)."""
    v8, v64 = ir.VectorType(_i32, 8), ir.VectorType(_i64, 8)
    lo, hi = ir.Constant(v8, list(range(8))), ir.Constant(v8, list(range(8, 16)))
    ps = [builder.add(builder.sext(builder.shuffle_vector(v, v, lo), v64),
                      builder.sext(builder.shuffle_vector(v, v, hi), v64)) for v in vs]
    return fold_pairs(builder, ps, 8)


# ---------------------------------------------------------------------------- 32-block kinds: whole rows

def _row32w(nibbles):
    """The row dot of Q8_0 (34-byte blocks) or Q4_0 (18) with int16 activations: block b's exact sum (Q4_0's
    values - 8 in bytes) times d_b * xd_b goes to partial sum b mod 8 (b32_update), 8 blocks at a time."""
    size = 18 if nibbles else 34

    def impl(typingctx, r, xq, xd, nb):
        sig = types.float32(r, xq, xd, nb)

        def codegen(context, builder, signature, args):
            a = signature.args
            idx = ir.IntType(64)
            rp = _arr_ptr(context, builder, a[0], args[0], _i8)
            xp = _arr_ptr(context, builder, a[1], args[1], _i16)
            dp = _arr_ptr(context, builder, a[2], args[2], _f32)
            zero = ir.Constant(_V16, None)

            def block(b):
                """(block b's 16 lanes of pair sums, its f16 scale as f32)."""
                o = builder.mul(b, ir.Constant(idx, size))
                prefetch_ahead(builder, [rp], o, ahead=BLOCK_AHEAD)
                xv = _x16(builder, xp, builder.mul(b, ir.Constant(idx, 32)))
                wp = builder.gep(rp, [builder.add(o, ir.Constant(idx, 2))])
                if nibbles:
                    vt = ir.VectorType(_i8, 16)
                    bb = _load(builder, wp, 16)
                    q = builder.shuffle_vector(builder.and_(bb, ir.Constant(vt, [15] * 16)),
                                               builder.lshr(bb, ir.Constant(vt, [4] * 16)),
                                               ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
                    w = builder.sub(q, ir.Constant(ir.VectorType(_i8, 32), [8] * 32))
                else:
                    w = _load(builder, wp, 32)
                return _dot16(builder, zero, builder.sext(w, _W32), xv), _f16_at(builder, rp, o)

            return b32_row(builder, args[3], dp, block, lambda ps, b0: fold_blocks(builder, ps),
                           lambda p, b: _reduce(builder, p, 16))
        return sig, codegen
    return impl


row16_q8_0 = intrinsic(_row32w(False))
row16_q8_0.__doc__ = "r (row bytes,) u8 Q8_0 row . int16 activations in xq (2n,) i8 with scales xd (n/32,) f32, nb blocks -> f32"
row16_q4_0 = intrinsic(_row32w(True))
row16_q4_0.__doc__ = "row16_q8_0 for a Q4_0 row (18-byte blocks)"


# ---------------------------------------------------------------------------- k-quants: a row times C activation rows
# A 256-block's weights are decoded once (values widened to i16, times their sub-block scale) and dotted with the
# block of each of C activation rows: per row the same integers and float steps as alone (C = 1), so a batch's
# rows get the bits of each row's own product.

def _kscales(builder, rp, o, kind, ahead=True):
    """A k-quant block's per-row parts at byte o (prefetching the bytes BLOCK_AHEAD beyond it unless ahead is
    False): Q6_K (its 16 group scales <16 x i16>,); Q4_K / Q5_K (the 8 sub-block scales <8 x i16>, the mins
    <8 x i8>, Q5_K's fifth bits as _k_half takes them or None)."""
    idx = ir.IntType(64)
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[kind]
    for line in range(0, size if ahead else 0, 64):
        prefetch_ahead(builder, [rp], builder.add(o, ir.Constant(idx, line)), ahead=BLOCK_AHEAD)
    if kind == Q6_K:
        return (builder.sext(_vload(builder, rp, builder.add(o, ir.Constant(idx, 192)), ir.VectorType(_i8, 16)),
                             ir.VectorType(_i16, 16)),)
    sc8, mn8 = _k_scales_mins(builder, rp, o)
    qh = None
    if kind == Q5_K:
        vt = ir.VectorType(_i8, 32)
        qh = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, 16))]), 32)
        if HAVE_VNNI512:        # bytes 0-31 qh, 32-63 qh >> 2 (the pairing of _k_half's 64-byte loads)
            qh = _join(builder, qh, builder.lshr(qh, ir.Constant(vt, [2] * 32)))
    return builder.zext(sc8, ir.VectorType(_i16, 8)), mn8, qh


def _halves32(builder, v):
    """<64 x i8> -> its bytes 0-31 and 32-63."""
    m = ir.VectorType(_i32, 32)
    return (builder.shuffle_vector(v, v, ir.Constant(m, list(range(32)))),
            builder.shuffle_vector(v, v, ir.Constant(m, list(range(32, 64)))))


def _k_bytes(builder, rp, o, kind, h, parts):
    """AVX-512: half h of the k-quant block at byte o (parts its _kscales) as two <64 x i8> of its unsigned values,
    two sub-blocks each: Q6_K (values 0..63) sub-blocks 0, 1 then 2, 3 of the half (values 128h..128h+127 in
    order); Q4_K / Q5_K sub-blocks 4h | 4h+2, then 4h+1 | 4h+3 (the low and high nibbles of qs's 64 bytes)."""
    idx = ir.IntType(64)

    def c8(v):
        return ir.Constant(ir.VectorType(_i8, 64), [v] * 64)
    if kind == Q6_K:            # ql's 64 bytes: sub-blocks 0, 1 in the low nibbles, 2, 3 in the high; qh's 2-bit fields
        ql = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, 64 * h))]), 64)
        qh = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, 128 + 32 * h))]), 32)
        qh2 = _join(builder, qh, builder.lshr(qh, ir.Constant(ir.VectorType(_i8, 32), [2] * 32)))
        return (builder.or_(builder.and_(ql, c8(15)), builder.shl(builder.and_(qh2, c8(3)), c8(4))),
                builder.or_(builder.lshr(ql, c8(4)), builder.shl(builder.and_(builder.lshr(qh2, c8(4)), c8(3)), c8(4))))
    qh = parts[2]
    bb = _load(builder, builder.gep(rp, [builder.add(o, ir.Constant(idx, (48 if kind == Q5_K else 16) + 64 * h))]), 64)
    lo, hi = builder.and_(bb, c8(15)), builder.lshr(bb, c8(4))
    if kind == Q5_K:            # qh's bytes 0-31 and, shifted by 2, 32-63 (_kscales): bit 4h (+1) the fifth bit
        lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(qh, c8(4 * h)), c8(1)), c8(4)))
        hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(qh, c8(4 * h + 1)), c8(1)), c8(4)))
    return lo, hi


def _k_half(builder, rp, o, kind, h, parts):
    """The 4 sub-blocks of half h (values 128h..128h+127) of the k-quant block at byte o, parts its _kscales: a list
    of (<32 x i16> values times their scale (Q6_K's values - 32), their activations' offset). With AVX-512 the bytes
    are unpacked 64 at a time (two sub-blocks an instruction), else 32."""
    def c8(v, n=32):
        return ir.Constant(ir.VectorType(_i8, n), [v] * n)

    def scaled(q, sv, signed):
        return builder.mul((builder.sext if signed else builder.zext)(q, _W32), sv)
    if kind == Q6_K:
        s16 = parts[0]

        def sv(g):
            return builder.shuffle_vector(s16, s16, ir.Constant(ir.VectorType(_i32, 32), [g] * 16 + [g + 1] * 16))
        if HAVE_VNNI512:
            qa, qb = _k_bytes(builder, rp, o, kind, h, parts)
            qs = [*_halves32(builder, builder.sub(qa, c8(32, 64))), *_halves32(builder, builder.sub(qb, c8(32, 64)))]
        else:
            qs = [builder.sub(q, c8(32)) for q in _values32(builder, rp, o, kind, h, parts)]
        return [(scaled(q, sv(8 * h + 2 * c), True), 128 * h + 32 * c) for c, q in enumerate(qs)]   # |w| <= 32 * 128
    sc16 = parts[0]

    def sv(j):
        return builder.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(_i32, 32), [j] * 32))
    if HAVE_VNNI512:
        lo, hi = _k_bytes(builder, rp, o, kind, h, parts)
        (a, b), (c, d) = _halves32(builder, lo), _halves32(builder, hi)
        qs = [a, c, b, d]       # sub-blocks 4h, 4h+1, 4h+2, 4h+3
    else:
        qs = _values32(builder, rp, o, kind, h, parts)
    return [(scaled(q, sv(4 * h + k), False), 32 * (4 * h + k)) for k, q in enumerate(qs)]      # at most 63 * 31


def _values32(builder, rp, o, kind, h, parts):
    """blocks_ir.k_values32 of a k-quant kind, parts its _kscales: the 4 sub-blocks of half h as unsigned bytes."""
    return k_values32(builder, rp, o, h, kind == Q6_K, None if kind == Q6_K else parts[2])


def _split_ints_avx2(builder, rps, parts, o, xp, sp, b, kind):
    """_split_ints on AVX2 (no VBMI, 32-byte registers): the same exact block integers of 8 weight rows . one int16
    activation row (xp its i16 pointer), each X = 256 H + L and q . X = 256 (q . H) + L . q with `vpmaddubsw` and the
    sub-block scales' `vpmaddwd` (blocks_ir._scaled_dot: pairs at most 2 * 255 * 63, no saturation), the activations'
    bytes parted once a block for the 8 rows; the rows one after another (16 registers). -> <8 x i64>, lane r row
    r's I, _krows8's integers."""
    idx = ir.IntType(64)
    m32 = ir.VectorType(_i32, 32)
    x0 = builder.mul(b, ir.Constant(idx, 256))
    xs = []                     # per sub-block of 32 values (128h + 32c): its activations' (L, H) bytes
    for k in range(8):
        v = builder.bitcast(_x16(builder, xp, builder.add(x0, ir.Constant(idx, 32 * k))), ir.VectorType(_i8, 64))
        xs.append(tuple(builder.shuffle_vector(v, v, ir.Constant(m32, list(range(e, 64, 2)))) for e in (0, 1)))
    hs, ls = [], []
    for r, rp in enumerate(rps):
        sc = parts[r][0]
        if kind == Q6_K:        # the 16 group scales as pairs (g, g + 1) of a sub-block, in-lane shuffles
            halves = [builder.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(_i32, 16), list(range(8 * h, 8 * h + 8)) * 2))
                      for h in range(2)]
        else:                   # the 8 scales in both 128-bit halves
            sc2 = builder.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(_i32, 16), list(range(8)) * 2))
        hv = lv = ir.Constant(ir.VectorType(_i32, 8), None)
        for h in range(2):
            for c, q in enumerate(_values32(builder, rp, o, kind, h, parts[r])):
                if kind == Q6_K:
                    s16 = builder.shuffle_vector(halves[h], halves[h], ir.Constant(ir.VectorType(_i32, 16),
                                                                                   [2 * c] * 8 + [9 + 2 * c] * 8))
                else:
                    j = 4 * h + c
                    s16 = builder.shuffle_vector(sc2, sc2, ir.Constant(ir.VectorType(_i32, 16), [j] * 8 + [8 + j] * 8))
                lo, hi = xs[4 * h + c]
                hv = builder.add(hv, _scaled_dot(builder, q, hi, s16))
                lv = builder.add(lv, _scaled_dot(builder, lo, q, s16))
        hs.append(hv)
        ls.append(lv)
    return _split_total(builder, hs, ls, parts, sp, b, kind)


def _rows_of(context, builder, aty, arr, t0, nc, ty):
    """Pointers (as ty*) to rows t0..t0+nc of a 2-D array (rows contiguous, any row stride)."""
    a = context.make_array(aty)(context, builder, arr)
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    base = builder.bitcast(a.data, _i8.as_pointer())
    return [builder.bitcast(builder.gep(base, [builder.mul(builder.add(t0, ir.Constant(_i64, t)), stride)]),
                            ty.as_pointer()) for t in range(nc)]


def _krow(kind, nc):
    """intrinsic (r, Xq, Xd, Xs, t0, nb, res): res[t] = weight row r (nb 256-blocks of kind Q4_K, Q5_K or Q6_K) . the
    int16 activations of row t0 + t of Xq (T, >= 2n) i8, scales Xd (T, ...) f32, 16-sums Xs (T, n/16) i32, for t < nc:
    per block I = sum over the sub-blocks of scale * (values . x) exact (i64), then acc + I * (d * xd)
    [- M * (dmin * xd), M = sum_j min_j * x_j's sum] (blocks_ir.k_update), acc from 0 over the blocks."""
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[kind]

    def impl(typingctx, r, Xq, Xd, Xs, t0, nb, res):
        sig = types.void(r, Xq, Xd, Xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            a = signature.args
            idx = ir.IntType(64)
            rp = _arr_ptr(context, builder, a[0], args[0], _i8)
            xps = _rows_of(context, builder, a[1], args[1], args[4], nc, _i16)
            dps = _rows_of(context, builder, a[2], args[2], args[4], nc, _f32)
            sps = _rows_of(context, builder, a[3], args[3], args[4], nc, _i32)
            out = _arr_ptr(context, builder, a[6], args[6], _f32)
            vec = nc == ROWS8           # the float steps of the 8 rows as the lanes of one vector (each lane row t's)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_f32, nc), None) if vec else ir.Constant(_f32, 0.0))
                    for _ in range(1 if vec else nc)]
            with cgutils.for_range(builder, args[5]) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(idx, size))
                parts = _kscales(builder, rp, o, kind)
                x0 = builder.mul(b, ir.Constant(idx, 256))
                ivecs = [ir.Constant(_V16, None)] * nc
                for h in range(2):          # a half's 4 sub-blocks decoded once for the nc rows (few registers live)
                    ws = _k_half(builder, rp, o, kind, h, parts)
                    for t in range(nc):
                        for w, off in ws:
                            ivecs[t] = _dot16(builder, ivecs[t], w, _x16(builder, xps[t], builder.add(x0, ir.Constant(idx, off))))
                if kind == Q6_K:
                    d, dmin = _f16_at(builder, rp, builder.add(o, ir.Constant(idx, 208))), None
                else:
                    d, dmin = _f16_at(builder, rp, o), _f16_at(builder, rp, builder.add(o, ir.Constant(idx, 2)))
                if vec:
                    _k_update_lanes(builder, accs[0], _sums64_lanes(builder, ivecs), d, dmin, dps, sps, b, parts)
                else:
                    _k_update_rows(builder, accs, _sums64(builder, ivecs), d, dmin, dps, sps, b, parts)
            if vec:
                builder.store(builder.load(accs[0]), builder.bitcast(out, accs[0].type), align=4)
            else:
                for t in range(nc):
                    builder.store(builder.load(accs[t]), builder.gep(out, [ir.Constant(idx, t)]))
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _k_update_rows(builder, accs, isums, d, dmin, dps, sps, b, parts):
    """_krow's float step of block b, one activation row after another: accs[t] (an f32 slot) + isums[t] * (d * xd_t)
    [- M_t * (dmin * xd_t), M_t = sum_j min_j * row t's 32-sum j] (blocks_ir.k_update)."""
    idx = ir.IntType(64)
    v8 = ir.VectorType(_i32, 8)
    for t, acc in enumerate(accs):
        xdb = builder.load(builder.gep(dps[t], [b]))
        if dmin is None:
            upd = k_update(builder, builder.load(acc), isums[t], d, xdb)
        else:
            msum = _reduce(builder, builder.mul(builder.zext(parts[1], v8), sums32(builder, sps[t], builder.mul(b, ir.Constant(idx, 16)))), 8)
            upd = k_update(builder, builder.load(acc), isums[t], d, xdb, msum, dmin)
        builder.store(upd, acc)


def _k_update_lanes(builder, acc, isum, d, dmin, dps, sps, b, parts):
    """_krow's float step of block b for 8 activation rows at once: acc (a <8 x f32> slot, lane t row t's accumulator)
    + isum (<8 x i64>, lane t row t's block integer I) * (d * xd_t) [- M_t * (dmin * xd_t), M_t = sum_j min_j * row
    t's 32-sum j, the 8 rows' products folded into one vector]: lane t does row t's scalar operations (k_update), the
    same bits as one row at a time."""
    idx = ir.IntType(64)
    vf, v8 = ir.VectorType(_f32, ROWS8), ir.VectorType(_i32, ROWS8)

    def splat(x):
        return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), x, ir.Constant(_i32, 0)),
                                      ir.Constant(vf, None), ir.Constant(v8, [0] * ROWS8))
    xdv = lanes(builder, [builder.load(builder.gep(dp, [b])) for dp in dps])
    if dmin is None:
        builder.store(k_update(builder, builder.load(acc), isum, splat(d), xdv), acc)
        return
    mins = builder.zext(parts[1], v8)
    prods = []
    for sp in sps:
        prods.append(builder.mul(mins, sums32(builder, sp, builder.mul(b, ir.Constant(idx, 16)))))
    builder.store(k_update(builder, builder.load(acc), isum, splat(d), xdv, fold_blocks(builder, prods), splat(dmin)),
                  acc)


def _split_ints(builder, rps, parts, o, xb, sp, b, kind):
    """AVX-512 VBMI: the exact block integers of 8 weight rows (rps, their _kscales parts) . one int16 activation row
    (xb its i8 pointer, sp its 16-sums), with int8 instructions: each value X = 256 H + L (H its high byte, signed;
    L its low byte, 0..255), so q . X = 256 (q . H) + L . q, each a `vpmaddubsw` (values 0..63 as the unsigned
    operand against H, as the signed one against L: pairs at most 2 * 255 * 63, no saturation) and a `vpmaddwd` by
    the scales, as the int8 row dots (blocks_rows8). -> <8 x i64>, lane r row r's I (Q6_K's values - 32 through
    32 * sum_g scale_g * (group g's 16-sum)), exactly _krows8's integers, so the same bits. The activations' bytes
    are parted into H and L once a block (8 `vpermt2b`) for the 8 rows."""
    idx = ir.IntType(64)
    m64 = ir.VectorType(_i32, 64)
    x0 = builder.mul(b, ir.Constant(idx, 512))
    loads = {k: _load(builder, builder.gep(xb, [builder.add(x0, ir.Constant(idx, 64 * k))]), 64) for k in range(8)}

    def parted(ka, kb):         # the even (L) and odd (H) bytes of loads ka, kb: 64 values in order
        return tuple(builder.shuffle_vector(loads[ka], loads[kb], ir.Constant(m64, list(range(e, 128, 2))))
                     for e in (0, 1))
    hs, ls = [ir.Constant(_V16, None)] * ROWS8, [ir.Constant(_V16, None)] * ROWS8
    for h in range(2):
        # the 64 values each of _k_bytes' two vectors stands for: Q6_K 128h..+63, +64..+127; Q4_K / Q5_K sub-blocks
        # 4h | 4h+2 and 4h+1 | 4h+3 (values 128h + 0..31 | 64..95 and 32..63 | 96..127)
        xs = [parted(4 * h, 4 * h + 1), parted(4 * h + 2, 4 * h + 3)] if kind == Q6_K else \
            [parted(4 * h, 4 * h + 2), parted(4 * h + 1, 4 * h + 3)]
        for r, rp in enumerate(rps):
            sc = parts[r][0]
            for v, q in enumerate(_k_bytes(builder, rp, o, kind, h, parts[r])):
                lanes_ = ([8 * h + 4 * v + k // 8 for k in range(32)] if kind == Q6_K else
                          [4 * h + v] * 16 + [4 * h + v + 2] * 16)
                s32 = builder.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(_i32, 32), lanes_))
                lo, hi = xs[v]
                hs[r] = builder.add(hs[r], _scaled_dot64(builder, q, hi, s32))
                ls[r] = builder.add(ls[r], _scaled_dot64(builder, lo, q, s32))
    return _split_total(builder, hs, ls, parts, sp, b, kind)


def _split_total(builder, hs, ls, parts, sp, b, kind):
    """The byte split's block integers of 8 weight rows from their per-row vectors of q . H (hs) and L . q (ls) sums:
    <8 x i64>, lane r = 256 (hs[r]'s sum) + ls[r]'s sum, for Q6_K less 32 * sum_g scale_g * (group g's 16-sum)
    (its values' -32)."""
    idx = ir.IntType(64)
    v8l = ir.VectorType(_i64, 8)
    isum = builder.add(builder.mul(builder.sext(fold_blocks(builder, hs), v8l), ir.Constant(v8l, [256] * 8)),
                       builder.sext(fold_blocks(builder, ls), v8l))
    if kind == Q6_K:
        xs16 = _vload(builder, sp, builder.mul(b, ir.Constant(idx, 16)), _V16)
        corr = fold_blocks(builder, [builder.mul(builder.sext(p[0], _V16), xs16) for p in parts])
        isum = builder.sub(isum, builder.mul(builder.sext(corr, v8l), ir.Constant(v8l, [32] * 8)))
    return isum


# how far ahead _krows8 asks for its rows (whole groups of 8 rows, at least the next group): bench-mixtral's 32000 x
# 1024 Q6_K head (840-byte rows) on the int16 activations, five copies cycled so that each comes from DRAM, the
# variants compiled side by side and timed in turns in one process (one thread, 2-vCPU AMD EPYC Zen 3, four runs):
# the next group (8 rows, 6.7 KB) 3.55 / 3.27 / 3.26 / 3.28 ms, 32 rows 3.31 / 3.04 / 3.04 / 3.06, 64 rows 3.18 / 2.95
# / 2.88 / 3.07, 96 rows 3.04, 128 rows 3.09 / 3.11, 256 rows 3.28 / 3.48, none 4.79 / 4.54. The int8 row dots
# (kernels/blocks_rows8: the same head's int8 rows, a Q4_K embedding's) showed no distance better than the next group.
HEAD_AHEAD = 49152          # bytes: that head 7 groups (56 rows) ahead; a 4096-wide Q6_K head (26.9 KB a group)
                            # the next group only, as before


def _krows8(kind):
    """intrinsic (raw, i0, Xq, Xd, Xs, t, nb, res): res[r] = weight row i0 + r of raw (d, row bytes) . activation row t
    (as _krow's), r < 8: a decode token's head, 8 weight rows at a time. Each row's block integers are _krow's (the
    activations' int16 values loaded once for the 8 rows), the 8 rows' i64 sums and mins' sums folded into vectors
    and the float step (blocks_ir.k_update) run on the 8 rows as lanes: each lane row r's operations, the same bits."""
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[kind]

    def impl(typingctx, raw, i0, Xq, Xd, Xs, t, nb, res):
        sig = types.void(raw, i0, Xq, Xd, Xs, t, nb, res)

        def codegen(context, builder, signature, args):
            a = signature.args
            idx = ir.IntType(64)
            rps = _rows_of(context, builder, a[0], args[0], args[1], ROWS8, _i8)
            xp = _rows_of(context, builder, a[2], args[2], args[5], 1, _i16)[0]
            dp = _rows_of(context, builder, a[3], args[3], args[5], 1, _f32)[0]
            sp = _rows_of(context, builder, a[4], args[4], args[5], 1, _i32)[0]
            vf, v8 = ir.VectorType(_f32, ROWS8), ir.VectorType(_i32, 8)
            acc = cgutils.alloca_once_value(builder, ir.Constant(vf, None))
            stride = cgutils.unpack_tuple(builder, context.make_array(a[0])(context, builder, args[0]).strides, 2)[0]
            group = builder.mul(stride, ir.Constant(idx, ROWS8))          # bytes of 8 rows
            groups = builder.sdiv(ir.Constant(idx, HEAD_AHEAD), group)
            dist = builder.mul(group, builder.select(builder.icmp_signed("<", groups, ir.Constant(idx, 1)),
                                                     ir.Constant(idx, 1), groups))
            with cgutils.for_range(builder, args[6]) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(idx, size))
                x0 = builder.mul(b, ir.Constant(idx, 256))
                for line in range(0, size, 64):          # the same block of the next 8 rows (blocks_rows8)
                    prefetch_ahead(builder, rps, builder.add(o, dist), ahead=line)
                parts = [_kscales(builder, rp, o, kind, ahead=False) for rp in rps]
                if HAVE_VBMI:
                    isum = _split_ints(builder, rps, parts, o, builder.bitcast(xp, _i8.as_pointer()), sp, b, kind)
                elif HAVE_AVX2 and not HAVE_VNNI512:
                    isum = _split_ints_avx2(builder, rps, parts, o, xp, sp, b, kind)
                else:
                    ivecs = [ir.Constant(_V16, None)] * ROWS8
                    for h in range(2):      # a half's activations loaded once for the 8 rows (few registers live)
                        xs = {}
                        for r, rp in enumerate(rps):
                            for w, off in _k_half(builder, rp, o, kind, h, parts[r]):
                                if off not in xs:
                                    xs[off] = _x16(builder, xp, builder.add(x0, ir.Constant(idx, off)))
                                ivecs[r] = _dot16(builder, ivecs[r], w, xs[off])
                    isum = lanes(builder, _sums64(builder, ivecs))
                xd = builder.load(builder.gep(dp, [b]))
                xdv = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), xd, ir.Constant(_i32, 0)),
                                             ir.Constant(vf, None), ir.Constant(v8, [0] * ROWS8))
                if kind == Q6_K:
                    ds = f16_lanes(builder, lanes(builder, [word(builder, rp, builder.add(o, ir.Constant(idx, 208)), _i16)
                                                          for rp in rps]))
                    upd = k_update(builder, builder.load(acc), isum, ds, xdv)
                else:
                    sums = sums32(builder, sp, builder.mul(b, ir.Constant(idx, 16)))
                    msum = fold_blocks(builder, [builder.mul(builder.zext(p[1], v8), sums) for p in parts])
                    dd = lanes(builder, [word(builder, rp, o, _i32) for rp in rps])          # d | dmin << 16
                    upd = k_update(builder, builder.load(acc), isum, f16_lanes(builder, dd), xdv, msum,
                                   f16_lanes(builder, builder.lshr(dd, ir.Constant(v8, [16] * ROWS8))))
                builder.store(upd, acc)
            out = _arr_ptr(context, builder, a[7], args[7], _f32)
            builder.store(builder.load(acc), builder.bitcast(out, vf.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


_q4k_8, _q5k_8, _q6k_8 = _krows8(Q4_K), _krows8(Q5_K), _krows8(Q6_K)
C16 = 8                     # activation rows a k-quant weight row is dotted with at once; the rest 4, then 1 at a time
_q4k_c, _q4k_4, _q4k_1 = _krow(Q4_K, C16), _krow(Q4_K, 4), _krow(Q4_K, 1)
_q5k_c, _q5k_4, _q5k_1 = _krow(Q5_K, C16), _krow(Q5_K, 4), _krow(Q5_K, 1)
_q6k_c, _q6k_4, _q6k_1 = _krow(Q6_K, C16), _krow(Q6_K, 4), _krow(Q6_K, 1)


# ---------------------------------------------------------------------------- row loops

@njit(cache=True, inline="always")
def _dot16_q8_0(r, X, xq, xd, xs):
    return row16_q8_0(r, xq, xd, X.shape[0] // 32)


@njit(cache=True, inline="always")
def _dot16_q4_0(r, X, xq, xd, xs):
    return row16_q4_0(r, xq, xd, X.shape[0] // 32)


# one loop per kind, so that its dot is inlined (as kernels/blocks' int8 loops)
@njit(cache=True)
def _rows16_q8_0(raw, X, Xq, Xd, Xs, out, i0, i1, alpha, accumulate):
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot16_q8_0(raw[i], X[t], Xq[t], Xd[t], Xs[t]), alpha, accumulate)


@njit(cache=True)
def _rows16_q4_0(raw, X, Xq, Xd, Xs, out, i0, i1, alpha, accumulate):
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot16_q4_0(raw[i], X[t], Xq[t], Xd[t], Xs[t]), alpha, accumulate)


@njit(cache=True, inline="always")
def _krow_n(kind, n, r, Xq, Xd, Xs, t0, nb, res):
    # weight row r of a k-quant kind . activation rows t0..t0+n-1 -> res[:n], n = C16, 4 (a serving step of 4-7
    # sequences reads each row once, not 4 times) or 1
    if n == C16:
        if kind == Q4_K:
            _q4k_c(r, Xq, Xd, Xs, t0, nb, res)
        elif kind == Q5_K:
            _q5k_c(r, Xq, Xd, Xs, t0, nb, res)
        else:
            _q6k_c(r, Xq, Xd, Xs, t0, nb, res)
    elif n == 4:
        if kind == Q4_K:
            _q4k_4(r, Xq, Xd, Xs, t0, nb, res)
        elif kind == Q5_K:
            _q5k_4(r, Xq, Xd, Xs, t0, nb, res)
        else:
            _q6k_4(r, Xq, Xd, Xs, t0, nb, res)
    elif kind == Q4_K:
        _q4k_1(r, Xq, Xd, Xs, t0, nb, res)
    elif kind == Q5_K:
        _q5k_1(r, Xq, Xd, Xs, t0, nb, res)
    else:
        _q6k_1(r, Xq, Xd, Xs, t0, nb, res)


@njit(cache=True)
def _rows16_k(raw, kind, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate):
    # the k-quants: each weight row dotted with C16 activation rows at once, then 4, then the rest one by one (_krow_n;
    # the same bits)
    T, nb = X.shape[0], X.shape[1] // 256
    if T == 1:                  # a decode token: 8 weight rows at a time, the rest one by one
        while i0 + ROWS8 <= i1:
            if kind == Q4_K:
                _q4k_8(raw, i0, Xq, Xd, Xs, 0, nb, res)
            elif kind == Q5_K:
                _q5k_8(raw, i0, Xq, Xd, Xs, 0, nb, res)
            else:
                _q6k_8(raw, i0, Xq, Xd, Xs, 0, nb, res)
            for r in range(ROWS8):
                _put2(out, 0, i0 + r, res[r], alpha, accumulate)
            i0 += ROWS8
    for i in range(i0, i1):
        t0 = 0
        while t0 < T:
            n = C16 if T - t0 >= C16 else 4 if T - t0 >= 4 else 1
            _krow_n(kind, n, raw[i], Xq, Xd, Xs, t0, nb, res)
            for t in range(n):
                _put2(out, t0 + t, i, res[t], alpha, accumulate)
            t0 += n


@njit(cache=True)
def rows16(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # out[t, i] (=|+=) alpha * raw[i] . X[t] for rows i0..i1 and every t, kind + ACTS16 (X rounded by round_rows16):
    # each weight row read once for all t; the kinds without integer dots on the f32 activations (kernels/blocks)
    k = kind & (ACTS16 - 1)
    if k == Q8_0:
        _rows16_q8_0(raw, X, Xq, Xd, Xs, out, i0, i1, alpha, accumulate)
    elif k == Q4_0:
        _rows16_q4_0(raw, X, Xq, Xd, Xs, out, i0, i1, alpha, accumulate)
    elif k == Q4_K or k == Q5_K or k == Q6_K:
        _rows16_k(raw, k, X, Xq, Xd, Xs, out, tmp[:C16], i0, i1, alpha, accumulate)
    else:
        _rows(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
