"""Attention's two inner loops as LLVM IR on 8-lane vectors (AVX2 and FMA; AVX-512 machines run them
too): the scores of 8 keys for one query head, and a head's weighted sum of V rows kept in registers.

Numba's loops reduce each score's dot product across the lanes on its own (a serial tail per key) and
load and store the output row for every V row; here 8 keys' partial sums are reduced together by a
transpose-and-add tree, and up to 64 columns of the output stay in 8 registers while the V rows
stream. The kernels assume rows with contiguous elements (the cache's and the scores' rows are).
Figures: kernels/attn.

The tile kernels (kernels/tiled: a block of query vectors against a tile of keys) put the queries in
the lanes instead: tile_scores and tile_wsum keep a block of 4 rows x 2 vectors in registers and give
every element one fma chain of its own (over the head dims, over the keys), so an element's bits do not
depend on the block, the lane count (16 where AVX-512 runs them, else 8) or the other queries;
tile_max and tile_exp are the online softmax's per-lane max and kernels.expf with the sum in key order.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import FEATURES as _FEATURES

__all__ = ["HAVE_ATTN_IR", "TILE_LANES", "scores8", "tile_exp", "tile_max", "tile_scores", "tile_scores8", "tile_wsum", "wsum_rows"]

HAVE_ATTN_IR = {"avx2", "fma"} <= _FEATURES

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I64 = ir.IntType(64)


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8, _V8, _V8]), "llvm.fma.v8f32")


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))


def _hadd(builder, a, b):
    # vhaddps: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
    return builder.fadd(_shuffle(builder, a, b, [0, 2, 8, 10, 4, 6, 12, 14]),
                        _shuffle(builder, a, b, [1, 3, 9, 11, 5, 7, 13, 15]))


def _row(builder, arr, r):
    """float* to row r of a 2-D array struct (any row stride, contiguous rows)."""
    stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(base, [builder.mul(r, stride)]), _F32.as_pointer())


def _vload(builder, p, k):
    return builder.load(builder.bitcast(builder.gep(p, [k]), _V8.as_pointer()), align=4)


@intrinsic
def scores8(typingctx, K, j0, q, sc, out):
    # K (P,hd) f32 rows, q (hd,) f32, hd a multiple of 8 -> out[j0 + i] = sc * K[j0 + i] . q for i < 8
    sig = types.void(K, j0, q, sc, out)

    def codegen(context, builder, signature, args):
        ka, qa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 4))
        j = context.cast(builder, args[1], signature.args[1], types.int64)
        hd = cgutils.unpack_tuple(builder, qa.shape, 1)[0]
        qp = builder.bitcast(qa.data, _F32.as_pointer())
        rows = [_row(builder, ka, builder.add(j, ir.Constant(_I64, i))) for i in range(8)]
        fma = _fma(builder)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8, None)) for _ in range(8)]
        for a in accs:
            builder.store(ir.Constant(_V8, None), a)
        with cgutils.for_range(builder, builder.sdiv(hd, ir.Constant(_I64, 8))) as it:
            k = builder.mul(it.index, ir.Constant(_I64, 8))
            qv = _vload(builder, qp, k)
            for r, a in zip(rows, accs):
                builder.store(builder.call(fma, [_vload(builder, r, k), qv, builder.load(a)]), a)
        v = [builder.load(a) for a in accs]
        t = [_hadd(builder, v[i], v[i + 1]) for i in range(0, 8, 2)]
        u = [_hadd(builder, t[0], t[1]), _hadd(builder, t[2], t[3])]
        tot = builder.fadd(_shuffle(builder, u[0], u[1], [0, 1, 2, 3, 8, 9, 10, 11]),
                           _shuffle(builder, u[0], u[1], [4, 5, 6, 7, 12, 13, 14, 15]))
        sc = context.cast(builder, args[3], signature.args[3], types.float32)
        scv = builder.insert_element(ir.Constant(_V8, None), sc, ir.Constant(ir.IntType(32), 0))
        scv = _shuffle(builder, scv, scv, [0] * 8)
        op = builder.gep(builder.bitcast(oa.data, _F32.as_pointer()), [j])
        builder.store(builder.fmul(tot, scv), builder.bitcast(op, _V8.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def wsum_rows(typingctx, w, V, o):
    # w (P,) f32 weights, V (P,hd) f32 rows, hd a multiple of 8 -> o (hd,) += sum_j w[j] * V[j]
    sig = types.void(w, V, o)

    def codegen(context, builder, signature, args):
        wa, va, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(3))
        P = cgutils.unpack_tuple(builder, wa.shape, 1)[0]
        hd = cgutils.unpack_tuple(builder, oa.shape, 1)[0]
        wp = builder.bitcast(wa.data, _F32.as_pointer())
        op = builder.bitcast(oa.data, _F32.as_pointer())
        fma = _fma(builder)
        nvec = builder.sdiv(hd, ir.Constant(_I64, 8))

        def block(c0, width):                 # columns c0 .. c0 + 8*width in `width` registers over all rows
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8, None)) for _ in range(width)]
            for a in accs:
                builder.store(ir.Constant(_V8, None), a)
            with cgutils.for_range(builder, P) as it:
                e = builder.load(builder.gep(wp, [it.index]))
                ev = builder.insert_element(ir.Constant(_V8, None), e, ir.Constant(ir.IntType(32), 0))
                ev = _shuffle(builder, ev, ev, [0] * 8)
                rp = _row(builder, va, it.index)
                for i, a in enumerate(accs):
                    k = builder.add(c0, ir.Constant(_I64, 8 * i))
                    builder.store(builder.call(fma, [ev, _vload(builder, rp, k), builder.load(a)]), a)
            for i, a in enumerate(accs):
                dst = builder.bitcast(builder.gep(op, [builder.add(c0, ir.Constant(_I64, 8 * i))]), _V8.as_pointer())
                builder.store(builder.fadd(builder.load(dst, align=4), builder.load(a)), dst, align=4)

        nfull = builder.sdiv(nvec, ir.Constant(_I64, 8))
        with cgutils.for_range(builder, nfull) as b:
            block(builder.mul(b.index, ir.Constant(_I64, 64)), 8)
        with cgutils.for_range(builder, builder.sub(nvec, builder.mul(nfull, ir.Constant(_I64, 8)))) as r:
            block(builder.add(builder.mul(nfull, ir.Constant(_I64, 64)), builder.mul(r.index, ir.Constant(_I64, 8))), 1)
        return context.get_dummy_value()
    return sig, codegen


# the tile kernels' vector width: 16 lanes where AVX-512 runs them (twice the FMAs per instruction), else 8;
# every element is its own fma chain, so the width changes no bit
TILE_LANES = 16 if "avx512f" in _FEATURES else 8
_VT = ir.VectorType(_F32, TILE_LANES)


def _bcast(builder, p, k, W=TILE_LANES):
    """The float at p[k] in every lane of a W-lane vector."""
    VT = ir.VectorType(_F32, W)
    e = builder.load(builder.gep(p, [k]))
    v = builder.insert_element(ir.Constant(VT, None), e, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(VT, None), ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W))


def _tload(builder, p, k, W=TILE_LANES):
    return builder.load(builder.bitcast(builder.gep(p, [k]), ir.VectorType(_F32, W).as_pointer()), align=4)


def _tfma(builder, W=TILE_LANES):
    VT = ir.VectorType(_F32, W)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(VT, [VT, VT, VT]), f"llvm.fma.v{W}f32")


def _const(n):
    return ir.Constant(_I64, n)


def _tile_scores(W):
    def tile_scores(typingctx, Kt, n, Qt, St):
        # Kt (>= n, d) f32 key rows, Qt (d, NQ) f32 the queries' columns, NQ a multiple of W -> St[j, i] =
        # sum_c Kt[j, c] * Qt[c, i] for j < n, every element one fma chain over c = 0..d-1 from 0, whichever
        # block of 4 keys x 2 vectors of queries computes it (its bits do not depend on n, NQ, W or its place)
        sig = types.void(Kt, n, Qt, St)
        VT = ir.VectorType(_F32, W)

        def codegen(context, builder, signature, args):
            ka, qa, sa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
            nk = context.cast(builder, args[1], signature.args[1], types.int64)
            d = cgutils.unpack_tuple(builder, ka.shape, 2)[1]
            nq = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
            fma = _tfma(builder, W)

            def block(j, i, keys, vecs):      # keys x (W * vecs) scores at (j, i)
                krows = [_row(builder, ka, builder.add(j, _const(r))) for r in range(keys)]
                accs = [[cgutils.alloca_once_value(builder, ir.Constant(VT, None)) for _ in range(vecs)]
                        for _ in range(keys)]
                for row in accs:
                    for a in row:
                        builder.store(ir.Constant(VT, None), a)
                with cgutils.for_range(builder, d) as c:
                    qrow = _row(builder, qa, c.index)
                    qv = [_tload(builder, qrow, builder.add(i, _const(W * v)), W) for v in range(vecs)]
                    for r in range(keys):
                        kb = _bcast(builder, krows[r], c.index, W)
                        for v in range(vecs):
                            builder.store(builder.call(fma, [kb, qv[v], builder.load(accs[r][v])]), accs[r][v])
                for r in range(keys):
                    srow = _row(builder, sa, builder.add(j, _const(r)))
                    for v in range(vecs):
                        dst = builder.bitcast(builder.gep(srow, [builder.add(i, _const(W * v))]), VT.as_pointer())
                        builder.store(builder.load(accs[r][v]), dst, align=4)

            def keys_of(j, keys):
                n2 = builder.sdiv(nq, _const(2 * W))
                with cgutils.for_range(builder, n2) as b:
                    block(j, builder.mul(b.index, _const(2 * W)), keys, 2)
                with cgutils.if_unlikely(builder, builder.icmp_signed("!=", builder.srem(nq, _const(2 * W)), _const(0))):
                    block(j, builder.mul(n2, _const(2 * W)), keys, 1)

            n4 = builder.sdiv(nk, _const(4))
            with cgutils.for_range(builder, n4) as b:
                keys_of(builder.mul(b.index, _const(4)), 4)
            with cgutils.for_range(builder, builder.sub(nk, builder.mul(n4, _const(4)))) as r:
                keys_of(builder.add(builder.mul(n4, _const(4)), r.index), 1)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(tile_scores)


tile_scores = _tile_scores(TILE_LANES)     # queries in TILE_LANES-lane vectors
tile_scores8 = _tile_scores(8)             # the same chains on 8 lanes, for items of 8 query vectors or fewer


@intrinsic
def tile_wsum(typingctx, P, n, Vt, A):
    # P (>= n, NQ) f32 weights of n keys for NQ queries, Vt (>= n, DV) f32 value rows, A (NQ, DV) f32, NQ a
    # multiple of 4 and DV of TILE_LANES -> A[i, c] += sum_j P[j, i] * Vt[j, c], one fma chain over j = 0..n-1
    # from A[i, c] for every element, whichever block of 4 queries x 2 vectors of columns computes it
    sig = types.void(P, n, Vt, A)
    W = TILE_LANES

    def codegen(context, builder, signature, args):
        pa, va, aa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        nk = context.cast(builder, args[1], signature.args[1], types.int64)
        nq, dv = cgutils.unpack_tuple(builder, aa.shape, 2)
        fma = _tfma(builder)

        def block(i, c0, vecs):            # 4 queries x (W * vecs) columns at (i, c0)
            arows = [_row(builder, aa, builder.add(i, _const(r))) for r in range(4)]
            ptrs = [[builder.bitcast(builder.gep(arows[r], [builder.add(c0, _const(W * v))]), _VT.as_pointer())
                     for v in range(vecs)] for r in range(4)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VT, None)) for _ in range(vecs)]
                    for _ in range(4)]
            for r in range(4):
                for v in range(vecs):
                    builder.store(builder.load(ptrs[r][v], align=4), accs[r][v])
            with cgutils.for_range(builder, nk) as j:
                prow = _row(builder, pa, j.index)
                vrow = _row(builder, va, j.index)
                vv = [_tload(builder, vrow, builder.add(c0, _const(W * v))) for v in range(vecs)]
                for r in range(4):
                    pb = _bcast(builder, prow, builder.add(i, _const(r)))
                    for v in range(vecs):
                        builder.store(builder.call(fma, [pb, vv[v], builder.load(accs[r][v])]), accs[r][v])
            for r in range(4):
                for v in range(vecs):
                    builder.store(builder.load(accs[r][v]), ptrs[r][v], align=4)

        with cgutils.for_range(builder, builder.sdiv(nq, _const(4))) as ib:
            i = builder.mul(ib.index, _const(4))
            n2 = builder.sdiv(dv, _const(2 * W))
            with cgutils.for_range(builder, n2) as cb:
                block(i, builder.mul(cb.index, _const(2 * W)), 2)
            with cgutils.if_unlikely(builder, builder.icmp_signed("!=", builder.srem(dv, _const(2 * W)), _const(0))):
                block(i, builder.mul(n2, _const(2 * W)), 1)
        return context.get_dummy_value()
    return sig, codegen


def _fv(x, W=8):
    return ir.Constant(ir.VectorType(_F32, W), [ir.Constant(_F32, float(np.float32(x)))] * W)


def vexp(builder, x):
    """kernels.expf on every lane of x (a float vector of any width), operation for operation (Cephes: range
    reduction by ln2, degree-6 polynomial, the exponent assembled from bits; x > 88.72 -> inf, x < -86 -> 0),
    no fused operations: a lane's bits do not depend on the width."""
    W = x.type.count
    lo, hi = _fv(-86.0, W), _fv(88.72283, W)
    xc = builder.select(builder.fcmp_ordered(">", x, lo), x, lo)
    xc = builder.select(builder.fcmp_ordered("<", xc, hi), xc, hi)
    rnd = _fv(12582912.0, W)
    n = builder.fsub(builder.fadd(builder.fmul(xc, _fv(1.4426950408889634, W)), rnd), rnd)
    r = builder.fsub(builder.fsub(xc, builder.fmul(n, _fv(0.693359375, W))), builder.fmul(n, _fv(-2.12194440e-4, W)))
    p = _fv(1.9875691500e-4, W)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), _fv(c, W))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _fv(1.0, W))
    iv = ir.VectorType(ir.IntType(32), W)
    e = builder.mul(builder.add(builder.fptosi(n, iv), ir.Constant(iv, [ir.Constant(ir.IntType(32), 126)] * W)),
                    ir.Constant(iv, [ir.Constant(ir.IntType(32), 8388608)] * W))
    e = builder.fmul(builder.fmul(p, _fv(2.0, W)), builder.bitcast(e, x.type))
    e = builder.select(builder.fcmp_ordered(">", x, hi), _fv(np.inf, W), e)
    return builder.select(builder.fcmp_ordered("<", x, lo), _fv(0.0, W), e)


@intrinsic
def tile_max(typingctx, St, n, tmax):
    # St (>= n, NQ) f32, NQ a multiple of 8, n >= 1 -> tmax[i] = max_j St[j, i], j < n
    sig = types.void(St, n, tmax)

    def codegen(context, builder, signature, args):
        sa, ta = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2))
        nk = context.cast(builder, args[1], signature.args[1], types.int64)
        nq = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
        tp = builder.bitcast(ta.data, _F32.as_pointer())
        with cgutils.for_range(builder, builder.sdiv(nq, _const(8))) as g:
            i = builder.mul(g.index, _const(8))
            acc = cgutils.alloca_once_value(builder, _fv(-np.inf))
            builder.store(_fv(-np.inf), acc)
            with cgutils.for_range(builder, nk) as j:
                v = _vload(builder, _row(builder, sa, j.index), i)
                a = builder.load(acc)
                builder.store(builder.select(builder.fcmp_ordered(">", v, a), v, a), acc)
            builder.store(builder.load(acc), builder.bitcast(builder.gep(tp, [i]), _V8.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def tile_exp(typingctx, St, n, ms, tsum):
    # St (>= n, NQ) f32, ms (NQ,), NQ a multiple of 8 -> St[j, i] = expf(St[j, i] - ms[i]) for j < n, and
    # tsum[i] = their sum, added in key order from 0
    sig = types.void(St, n, ms, tsum)

    def codegen(context, builder, signature, args):
        sa, ma, ta = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        nk = context.cast(builder, args[1], signature.args[1], types.int64)
        nq = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
        mp = builder.bitcast(ma.data, _F32.as_pointer())
        tp = builder.bitcast(ta.data, _F32.as_pointer())
        with cgutils.for_range(builder, builder.sdiv(nq, _const(8))) as g:
            i = builder.mul(g.index, _const(8))
            mv = _vload(builder, mp, i)
            acc = cgutils.alloca_once_value(builder, _fv(0.0))
            builder.store(_fv(0.0), acc)
            with cgutils.for_range(builder, nk) as j:
                ptr = builder.bitcast(builder.gep(_row(builder, sa, j.index), [i]), _V8.as_pointer())
                e = vexp(builder, builder.fsub(builder.load(ptr, align=4), mv))
                builder.store(e, ptr, align=4)
                builder.store(builder.fadd(builder.load(acc), e), acc)
            builder.store(builder.load(acc), builder.bitcast(builder.gep(tp, [i]), _V8.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen
