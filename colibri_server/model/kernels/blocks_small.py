"""The product of block-kind weights with a few activation rows (a serving step's 2-16 rows of an expert or a
projection): each weight block unpacked once and dotted with every row, without the tiled GEMM's panel.

The row dots (kernels/blocks) read a weight row once for all T rows but unpack each block again for
every row (nibbles, scales, mins, f16 scales); the tiles (kernels/blocks_gemm) lay 16 weight rows out in
a scratch panel per call, which costs more than it saves at a few rows (bench-mixtral Q4_K 2048x1024:
~0.15 ms of layout a call against ~0.017 ms a row). Here a micro-kernel takes one weight row and NC
activation rows (8, 4, 3 or 2; a last single row takes the row dot): per block the weight's values and
scales are unpacked once, each activation row's integer products are summed as the row dot sums them
(`vpmaddubsw`/`vpmaddwd` per 32 for the k-quants, `vpdpbusd` per 32-block for Q8_0/Q4_0), and the NC
rows' exact int32 sums are gathered into one vector whose lane t is row t, so the row dot's float step
(blocks_ir.k_update / blocks_row32.b32_update, one row's scalar accumulator) runs on NC rows as vector lanes: the same
operations on the same values, so every output equals the row dot's bits.
Where the tiles run (AVX-512 VNNI) the k-quants take them from 2 rows since their panels are laid out by register
transposes (kernels/blocks_panels, blocks_gemm.K_TILE_MIN_ROWS); these kernels serve Q8_0 / Q4_0 and the other CPUs.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks import Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, _dot_q4_0, _dot_q4_k, _dot_q5_k, _dot_q6_k, _dot_q8_0, _put2
from .blocks_ir import (
    BLOCK_AHEAD,
    HAVE_VBMI,
    HAVE_VNNI256,
    _arr_ptr,
    _dot8,
    _f16_at,
    _k_scales_mins,
    _load,
    _s16,
    _scaled_dot,
    _sum8,
    _vload,
    k_update,
    k_values32,
    sums32,
)
from .blocks_row32 import acts_q4_0_swizzle, b32_total, b32_update, q4_0_group8, row_q4_0_sw
from .prefetch import prefetch_ahead

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_idx = ir.IntType(64)
_v8, _vf = ir.VectorType(_i32, 8), ir.VectorType(_f32, 8)
# up to this many activation rows, gemm_rows takes these kernels over the tiles. Measured (Sapphire Rapids VM, one
# thread, the weights in cache), ms for 2 / 4 / 6 rows, these kernels vs the tiles: Q4_K 2048x1024 0.133 / 0.206 /
# 0.328 vs 0.186 / 0.200 / 0.264; Q6_K 1024x2048 0.200 / 0.282 / 0.473 vs 0.307 / 0.340 / 0.418 (the row dots:
# 0.073 and 0.146 a row). The products on zmm registers (two sub-blocks a `vpmaddubsw`) measured slower: 0.42 ms
# at 8 rows of Q4_K against 0.32. Two sub-blocks through `vpdpbusd` + `vpackssdw` + `vpmaddwd` (_pair_dot) instead
# of two `vpmaddubsw` + `vpmaddwd`: 3 / 4 rows Q4_K 0.159 / 0.184 -> 0.150 / 0.167 ms, Q6_K 0.277 / 0.283 -> 0.227 / 0.242
SMALL_MAX_ROWS = 4


def _c(v):
    return ir.Constant(_idx, v)


def _pair_scales(builder, a, b):
    """<16 x i16> for _pair_dot: a's and b's scales (each (of bytes 0-15, of bytes 16-31)) in packssdw's lane order."""
    vw = ir.VectorType(ir.IntType(16), 16)
    v = ir.Constant(vw, None)
    for k, sc in enumerate((a[0], b[0], a[1], b[1])):
        v = builder.insert_element(v, sc, ir.Constant(_i32, 4 * k))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, 16), [k // 4 * 4 for k in range(16)]))


def _pair_dot(builder, qa, xa, qb, xb, s16):
    """Two <32 x i8> values 0..63 . activations, each 16 bytes' products times their scale -> <8 x i32>, exact: one
    `vpdpbusd` a sub-block (lanes of 4 products, |sum| <= 4 * 63 * 127 < 2^15), the two packed to i16 (`vpackssdw`,
    never saturating) and multiplied by the scales (`vpmaddwd`): 3 multiplies where _scaled_dot takes 4."""
    vd, vw = _v8, ir.VectorType(ir.IntType(16), 16)
    dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), "llvm.x86.avx512.vpdpbusd.256")
    pk = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vw, [vd, vd]), "llvm.x86.avx2.packssdw")
    mwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vw, vw]), "llvm.x86.avx2.pmadd.wd")
    zero = ir.Constant(vd, None)
    da = builder.call(dp, [zero, builder.bitcast(qa, vd), builder.bitcast(xa, vd)])
    db = builder.call(dp, [zero, builder.bitcast(qb, vd), builder.bitcast(xb, vd)])
    return builder.call(mwd, [builder.call(pk, [da, db]), s16])


def _rows(context, builder, aty, arr, t0, nc, ty):
    """Pointers (of element type ty) to rows t0..t0+nc of the 2-D array arr (rows strided, each contiguous)."""
    a = context.make_array(aty)(context, builder, arr)
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    base = builder.bitcast(a.data, _i8.as_pointer())
    return [builder.bitcast(builder.gep(base, [builder.mul(builder.add(t0, _c(t)), stride)]), ty.as_pointer())
            for t in range(nc)]


def _splat(builder, s, vt):
    v = builder.insert_element(ir.Constant(vt, None), s, ir.Constant(_i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, None), ir.Constant(ir.VectorType(_i32, vt.count), [0] * vt.count))


def _lanes(builder, vals, vt):
    """A vector of type vt whose lane t is vals[t] (the rest zero)."""
    v = ir.Constant(vt, None)
    for t, s in enumerate(vals):
        v = builder.insert_element(v, s, ir.Constant(_i32, t))
    return v


def _gather8(builder, vecs):
    """<8 x i32> vectors (at most 8) -> one, lane t the sum of vecs[t]'s lanes (exact: integers)."""
    return _sum8(builder, vecs + [ir.Constant(_v8, None)] * (8 - len(vecs)))


def _store_lanes(builder, res, v, nc):
    for t in range(nc):
        builder.store(builder.extract_element(v, ir.Constant(_i32, t)), builder.gep(res, [_c(t)]))


def _products(b, qv, xp, x0):
    """<8 x i32>: the sum over the entries (values, _s16 scales, activation offset, (scale of bytes 0-15, of 16-31))
    of qv of their scaled products with the activations at xp + x0 + offset (_pair_dot two entries at a time where
    the CPU has `vpdpbusd` on ymm registers, else blocks_ir._scaled_dot); exact, so either gives the same integers."""
    ivec = ir.Constant(_v8, None)
    if HAVE_VNNI256:
        for k in range(0, len(qv), 2):
            (qa, _, oa, sa), (qb, _, ob, sb) = qv[k], qv[k + 1]
            xa = _load(b, b.gep(xp, [b.add(x0, _c(oa))]), 32)
            xb = _load(b, b.gep(xp, [b.add(x0, _c(ob))]), 32)
            ivec = b.add(ivec, _pair_dot(b, qa, xa, qb, xb, _pair_scales(b, sa, sb)))
        return ivec
    for q, s16, off, _ in qv:
        ivec = b.add(ivec, _scaled_dot(b, q, _load(b, b.gep(xp, [b.add(x0, _c(off))]), 32), s16))
    return ivec


def _q45_block(builder, rp, xq, xd, xs, blk, nc, five):
    """Q4_K / Q5_K block blk of the row rp times rows xq[t]: (I, M) <8 x i32> (lane t: row t's exact sums, as
    blocks_ir's kblock_q4_k sums them), (d, dmin) f32 and the rows' scales xd[t][blk] as <8 x f32>."""
    b = builder
    size = 176 if five else 144
    o = b.mul(blk, _c(size))

    def c32(v):
        return ir.Constant(_i32, v)
    sc8, mn8 = _k_scales_mins(b, rp, o)
    for line in range(0, size, 64):
        prefetch_ahead(b, [rp], b.add(o, _c(line)), ahead=BLOCK_AHEAD)
    qh = _load(b, b.gep(rp, [b.add(o, _c(16))]), 32) if five else None
    qv = []
    for h in range(2):
        for k, q in enumerate(k_values32(b, rp, o, h, False, qh)):
            j = 4 * h + k
            s = b.zext(b.extract_element(sc8, c32(j)), ir.IntType(16))
            qv.append((q, _s16(b, s, s), 32 * j, (s, s)))
    mnz = b.zext(mn8, _v8)
    x0 = b.mul(blk, _c(256))
    ivs, mvs = [], []
    for t in range(nc):
        ivs.append(_products(b, qv, xq[t], x0))
        mvs.append(b.mul(mnz, sums32(b, xs[t], b.mul(blk, _c(16)))))
    xdv = _lanes(b, [b.load(b.gep(xd[t], [blk])) for t in range(nc)], _vf)
    return _gather8(b, ivs), _gather8(b, mvs), _f16_at(b, rp, o), _f16_at(b, rp, b.add(o, _c(2))), xdv


def _q6_block(builder, rp, xq, xd, xs, blk, nc):
    """Q6_K block blk (as blocks_ir's kblock_q6_k): (I, d, xd) with I lane t = row t's exact sum."""
    b = builder
    o = b.mul(blk, _c(210))

    def at(off):
        return b.add(o, _c(off))
    i16 = ir.IntType(16)
    sc = _vload(b, rp, at(192), ir.VectorType(_i8, 16))
    for line in range(0, 210, 64):
        prefetch_ahead(b, [rp], at(line), ahead=BLOCK_AHEAD)
    qv = []
    for h in range(2):
        for c, q in enumerate(k_values32(b, rp, o, h, True)):
            g = 8 * h + 2 * c
            sa, sb = (b.sext(b.extract_element(sc, ir.Constant(_i32, g + k)), i16) for k in (0, 1))
            qv.append((q, _s16(b, sa, sb), 128 * h + 32 * c, (sa, sb)))
    sc32 = b.sext(sc, ir.VectorType(_i32, 16))
    x0 = b.mul(blk, _c(256))
    ivs, ofs = [], []
    for t in range(nc):
        ivec = _products(b, qv, xq[t], x0)
        p = b.mul(sc32, _vload(b, xs[t], b.mul(blk, _c(16)), ir.VectorType(_i32, 16)))
        lo = b.shuffle_vector(p, p, ir.Constant(_v8, list(range(8))))
        hi = b.shuffle_vector(p, p, ir.Constant(_v8, list(range(8, 16))))
        ivs.append(ivec)
        ofs.append(b.add(lo, hi))
    isum = b.sub(_gather8(b, ivs), b.mul(_gather8(b, ofs), ir.Constant(_v8, [32] * 8)))
    xdv = _lanes(b, [b.load(b.gep(xd[t], [blk])) for t in range(nc)], _vf)
    return isum, _f16_at(b, rp, at(208)), xdv


def _mk_k(kind, nc):
    """The micro-kernel of a k-quant (Q4_K, Q5_K, Q6_K) for nc rows: (r, xq, xd, xs, t0, nb, res):
    res[t] = row r . activation row t0 + t (rounded per 256: quant_acts_k), the row dot's bits."""
    def impl(typingctx, r, xq, xd, xs, t0, nb, res):
        sig = types.void(r, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            a = signature.args
            b = builder
            rp = _arr_ptr(context, b, a[0], args[0], _i8)
            xq = _rows(context, b, a[1], args[1], args[4], nc, _i8)
            xd = _rows(context, b, a[2], args[2], args[4], nc, _f32)
            xs = _rows(context, b, a[3], args[3], args[4], nc, _i32)
            res = _arr_ptr(context, b, a[6], args[6], _f32)
            acc = cgutils.alloca_once_value(b, ir.Constant(_vf, None))
            with cgutils.for_range(b, args[5]) as loop:
                if kind == Q6_K:
                    isum, d, xdv = _q6_block(b, rp, xq, xd, xs, loop.index, nc)
                    b.store(k_update(b, b.load(acc), isum, _splat(b, d, _vf), xdv), acc)
                else:
                    isum, msum, d, dmin, xdv = _q45_block(b, rp, xq, xd, xs, loop.index, nc, kind == Q5_K)
                    b.store(k_update(b, b.load(acc), isum, _splat(b, d, _vf), xdv, msum, _splat(b, dmin, _vf)), acc)
            _store_lanes(b, res, b.load(acc), nc)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_b32(nibbles, nc, swizzled=False):
    """The micro-kernel of Q8_0 (Q4_0: nibbles) for nc rows, as blocks_row32's row dot (_row32) for each: block b's
    exact sum times d_b * xd_b into partial sum b mod 8 (8 blocks a vector), the partials summed by b32_total.
    swizzled (Q4_0, AVX-512 VBMI): one more argument after xq, the rows' activations as blocks_row32.acts_q4_0_swizzle
    lays them out, and whole groups of 8 blocks gathered once for the nc rows (blocks_row32.q4_0_group8)."""
    size = 18 if nibbles else 34
    k = 1 if swizzled else 0        # the arguments after xq move by one
    gather = swizzled and HAVE_VBMI  # without VBMI (an AVX2 build) xw is not read

    def typed(*args):
        sig = types.void(*args)

        def codegen(context, builder, signature, args):
            a = signature.args
            b = builder
            rp = _arr_ptr(context, b, a[0], args[0], _i8)
            t0 = args[4 + k]
            xq = _rows(context, b, a[1], args[1], t0, nc, _i8)
            xw = _rows(context, b, a[2], args[2], t0, nc, _i8) if swizzled else None
            xd = _rows(context, b, a[2 + k], args[2 + k], t0, nc, _f32)
            xs = _rows(context, b, a[3 + k], args[3 + k], t0, nc, _i32)
            res = _arr_ptr(context, b, a[6 + k], args[6 + k], _f32)
            nb = args[5 + k]
            accs = [cgutils.alloca_once_value(b, ir.Constant(_vf, None)) for _ in range(nc)]

            def weights(blk):
                """(block blk's values as <32 x i8>, its f16 scale as f32)."""
                o = b.mul(blk, _c(size))
                prefetch_ahead(b, [rp], o, ahead=BLOCK_AHEAD)
                wp = b.gep(rp, [b.add(o, _c(2))])
                if nibbles:
                    vt = ir.VectorType(_i8, 16)
                    bb = _load(b, wp, 16)
                    q = b.shuffle_vector(b.and_(bb, ir.Constant(vt, [15] * 16)), b.lshr(bb, ir.Constant(vt, [4] * 16)),
                                         ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
                else:
                    q = _load(b, wp, 32)
                return q, _f16_at(b, rp, o)

            def xsum(t, blk):
                s2 = b.gep(xs[t], [b.mul(blk, _c(2))])
                return b.add(b.load(s2), b.load(b.gep(s2, [_c(1)])))

            eight = _c(8)
            with cgutils.for_range(b, b.sdiv(nb, eight)) as loop:
                b0 = b.mul(loop.index, eight)
                if gather:
                    sums, ds = q4_0_group8(b, rp, b0, [b.gep(xw[t], [b.mul(b0, _c(32))]) for t in range(nc)])
                else:
                    ps, ds = [[] for _ in range(nc)], ir.Constant(_vf, None)
                    for i in range(8):
                        blk = b.add(b0, _c(i))
                        q, d = weights(blk)
                        ds = b.insert_element(ds, d, ir.Constant(_i32, i))
                        for t in range(nc):
                            ps[t].append(_dot8(b, q, _load(b, b.gep(xq[t], [b.mul(blk, _c(32))]), 32), not nibbles))
                for t in range(nc):
                    isum = sums[t] if gather else _sum8(b, ps[t])
                    if nibbles:     # the nibbles' 8 out through the activations' 32-sums (row32's correction)
                        isum = b.sub(isum, b.mul(sums32(b, xs[t], b.mul(b0, _c(2))), ir.Constant(_v8, [8] * 8)))
                    b.store(b32_update(b, b.load(accs[t]), isum, ds, _vload(b, xd[t], b0, _vf)), accs[t])
            with cgutils.for_range_slice(b, b.mul(b.sdiv(nb, eight), eight), nb, _c(1)) as (blk, _):
                q, d = weights(blk)
                lane = b.trunc(b.srem(blk, eight), _i32)
                for t in range(nc):
                    p8 = _dot8(b, q, _load(b, b.gep(xq[t], [b.mul(blk, _c(32))]), 32), not nibbles)
                    f = cgutils.get_or_insert_function(b.module, ir.FunctionType(_i32, [_v8]),
                                                       "llvm.vector.reduce.add.v8i32")
                    isum = b.call(f, [p8])
                    if nibbles:
                        isum = b.sub(isum, b.mul(xsum(t, blk), ir.Constant(_i32, 8)))
                    v = b.load(accs[t])
                    upd = b32_update(b, b.extract_element(v, lane), isum, d, b.load(b.gep(xd[t], [blk])))
                    b.store(b.insert_element(v, upd, lane), accs[t])
            for t in range(nc):
                v = b.load(accs[t])
                tot = b32_total(b, [b.extract_element(v, ir.Constant(_i32, i)) for i in range(8)])
                b.store(tot, b.gep(res, [_c(t)]))
            return context.get_dummy_value()
        return sig, codegen

    if swizzled:
        def impl(typingctx, r, xq, xw, xd, xs, t0, nb, res):
            return typed(r, xq, xw, xd, xs, t0, nb, res)
    else:
        def impl(typingctx, r, xq, xd, xs, t0, nb, res):
            return typed(r, xq, xd, xs, t0, nb, res)
    return intrinsic(impl)


_q4k_8, _q4k_4, _q4k_3, _q4k_2 = _mk_k(Q4_K, 8), _mk_k(Q4_K, 4), _mk_k(Q4_K, 3), _mk_k(Q4_K, 2)
_q5k_8, _q5k_4, _q5k_3, _q5k_2 = _mk_k(Q5_K, 8), _mk_k(Q5_K, 4), _mk_k(Q5_K, 3), _mk_k(Q5_K, 2)
_q6k_8, _q6k_4, _q6k_3, _q6k_2 = _mk_k(Q6_K, 8), _mk_k(Q6_K, 4), _mk_k(Q6_K, 3), _mk_k(Q6_K, 2)
_q8_8, _q8_4, _q8_3, _q8_2 = _mk_b32(False, 8), _mk_b32(False, 4), _mk_b32(False, 3), _mk_b32(False, 2)
_q40_8, _q40_4, _q40_3, _q40_2 = _mk_b32(True, 8), _mk_b32(True, 4), _mk_b32(True, 3), _mk_b32(True, 2)
_q40s_8, _q40s_4, _q40s_3, _q40s_2 = (_mk_b32(True, 8, True), _mk_b32(True, 4, True), _mk_b32(True, 3, True),
                                      _mk_b32(True, 2, True))


# ---------------------------------------------------------------------------- rows of a matrix, one kind each
# out[t, i] (=|+=) alpha * raw[i] . X[t] for rows i0..i1 and every t: passes of 8 activation rows, the rest in
# passes of 4, 3 and 2 (5 = 3 + 2), a last single row through the row dot. One function per kind (its kernels inlined), as kernels/blocks' _rows_*.

@njit(cache=True, inline="always")
def _put(out, res, t0, nc, i, alpha, accumulate):
    for t in range(nc):
        _put2(out, t0 + t, i, res[t], alpha, accumulate)


@njit(cache=True)
def _small_q4_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate):
    T, nb = Xq.shape[0], Xq.shape[1] // 256
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q4k_8(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q4k_4(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q4k_3(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q4k_2(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, _dot_q4_k(r, X[t0], Xq[t0], Xd[t0], Xs[t0], res), alpha, accumulate)


@njit(cache=True)
def _small_q5_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate):
    T, nb = Xq.shape[0], Xq.shape[1] // 256
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q5k_8(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q5k_4(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q5k_3(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q5k_2(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, _dot_q5_k(r, X[t0], Xq[t0], Xd[t0], Xs[t0], res), alpha, accumulate)


@njit(cache=True)
def _small_q6_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate):
    T, nb = Xq.shape[0], Xq.shape[1] // 256
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q6k_8(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q6k_4(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q6k_3(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q6k_2(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, _dot_q6_k(r, X[t0], Xq[t0], Xd[t0], Xs[t0], res), alpha, accumulate)


@njit(cache=True)
def _small_q8_0(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate):
    T, nb = Xq.shape[0], Xq.shape[1] // 32
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q8_8(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q8_4(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q8_3(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q8_2(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, _dot_q8_0(r, X[t0], Xq[t0], Xd[t0], Xs[t0], res), alpha, accumulate)


@njit(cache=True)
def _small_q4_0_swizzled(raw, X, Xq, Xd, Xs, out, res, Xw, i0, i1, alpha, accumulate):
    T, nb = Xq.shape[0], Xq.shape[1] // 32
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q40s_8(r, Xq, Xw, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q40s_4(r, Xq, Xw, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q40s_3(r, Xq, Xw, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q40s_2(r, Xq, Xw, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, row_q4_0_sw(r, Xq[t0], Xw[t0], Xd[t0], Xs[t0], nb), alpha, accumulate)


@njit(cache=True)
def _small_q4_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # on AVX-512 VBMI with room in tmp for the rows' swizzled activations: _small_q4_0_swizzled, the same bits
    T, n = Xq.shape[0], Xq.shape[1]
    res = tmp[:16]
    w = n // 4
    if HAVE_VBMI and n >= 256 and tmp.shape[0] >= 16 + T * w:
        Xw = tmp[16:16 + T * w].reshape((T, w))
        for t in range(T):
            acts_q4_0_swizzle(Xq[t], Xw[t], n // 256)
        _small_q4_0_swizzled(raw, X, Xq, Xd, Xs, out, res, Xw, i0, i1, alpha, accumulate)
        return
    nb = n // 32
    for i in range(i0, i1):
        r, t0 = raw[i], 0
        while T - t0 >= 8:
            _q40_8(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 8, i, alpha, accumulate)
            t0 += 8
        if T - t0 >= 4 and T - t0 != 5:
            _q40_4(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 4, i, alpha, accumulate)
            t0 += 4
        if T - t0 >= 3:
            _q40_3(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 3, i, alpha, accumulate)
            t0 += 3
        if T - t0 >= 2:
            _q40_2(r, Xq, Xd, Xs, t0, nb, res)
            _put(out, res, t0, 2, i, alpha, accumulate)
            t0 += 2
        if t0 < T:
            _put2(out, t0, i, _dot_q4_0(r, X[t0], Xq[t0], Xd[t0], Xs[t0], res), alpha, accumulate)


@njit(cache=True)
def small_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # out[t, i] (=|+=) alpha * raw[i] . X[t] for rows i0..i1 and every t of X (rounded for kind: round_rows), a FAST
    # kind (kernels/blocks): each block unpacked once for all rows, every output the row dot's bits. tmp >= 16 f32
    res = tmp[:16]
    if kind == Q4_K:
        _small_q4_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate)
    elif kind == Q5_K:
        _small_q5_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate)
    elif kind == Q6_K:
        _small_q6_k(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate)
    elif kind == Q8_0:
        _small_q8_0(raw, X, Xq, Xd, Xs, out, res, i0, i1, alpha, accumulate)
    elif kind == Q4_0:
        _small_q4_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)


def small_kind(kind: int) -> bool:
    """Whether small_rows takes kind (the FAST kinds, activations rounded)."""
    return kind in (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)


__all__ = ["SMALL_MAX_ROWS", "small_kind", "small_rows"]
