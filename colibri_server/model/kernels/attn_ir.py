"""Attention's two inner loops as LLVM IR on 8-lane vectors (AVX2 and FMA; AVX-512 machines run them
too): the scores of 8 keys for one query head, and a head's weighted sum of V rows kept in registers.

Numba's loops reduce each score's dot product across the lanes on its own (a serial tail per key) and
load and store the output row for every V row; here 8 keys' partial sums are reduced together by a
transpose-and-add tree, and up to 64 columns of the output stay in 8 registers while the V rows
stream. The kernels assume rows with contiguous elements (the cache's and the scores' rows are).
Figures: kernels/attn.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import FEATURES as _FEATURES

__all__ = ["HAVE_ATTN_IR", "scores8", "wsum_rows"]

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
