"""One decoding row's attention over the f16 paged pool as LLVM IR: the query heads of a kv head share every
key and value load, the f16 rows are widened in registers, and all 16 lanes of a vector do work.

kernels/tiled's tile kernels put an item's query vectors in the lanes and broadcast each key element: a
decoding row of bench-mixtral has 4 query heads per kv head, so 4 lanes of 8 (or 16) work, and the tile is
widened from f16 into a scratch first. Here a vector holds 4 heads x 4 keys: row_scores widens 4 key rows
16 dims at a time, transposes them 4 x 4 within each 128-bit lane (KT: per dim, the 4 keys' elements side
by side), and multiplies, dim by dim, the 4 keys broadcast to every 128-bit lane (one load) by the 4 heads'
query element, each in its own 128-bit lane; 8 groups of 4 keys run at once so 8 fma chains are in flight.
row_wsum streams each value row once, widened in registers, into 4 heads x up to 64 columns of sums.

Every element is the same chain of operations as in the tile kernels (attn_ir): a score is one fma chain
over the head dims from 0, a weighted sum one fma chain over the keys from the corrected sum, the exponent
attn_ir.vexp lane by lane and the tile's sum added in key order from 0, so a row's bits are those of the
same row inside a prefill block (tests/test_tiled_attention.py checks it).

Layouts (C-contiguous f32 unless said): a head group is 4 query heads (the last padded with zero queries);
pool: the f16 pool (uint16 bits), offs (>= 4 * ceil(n / 4),) i64: each key's row as an element offset in
the pool (padding entries: any row of it); KT (>= ceil(n / 4), hd, 4) scratch; Q4 (HG, hd, 16): Q4[h, c,
4r + t] = query element c of head 4h + r (scaled), every t; S (HG, >= 4 * ceil(n / 4), 4): S[h, j, r] the
score (then the weight) of key j for head 4h + r, keys from n on -inf.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attn_ir import _fv, vexp
from .cpu import FEATURES as _FEATURES

__all__ = ["HAVE_ROW_IR", "row_exp", "row_max", "row_prefetch", "row_scores", "row_wsum"]

HAVE_ROW_IR = {"avx512f", "f16c", "fma"} <= _FEATURES

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_V16 = ir.VectorType(_F32, 16)
_V4 = ir.VectorType(_F32, 4)
_GROUPS = 8          # groups of 4 keys scored at once: 8 fma chains in flight


def _c(n):
    return ir.Constant(_I64, n)


def _shuf(b, x, y, lanes):
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _fp(context, b, ty, val):
    """float* to the data of an array argument."""
    return b.bitcast(context.make_array(ty)(context, b, val).data, _F32.as_pointer())


def _shape(context, b, ty, val):
    return cgutils.unpack_tuple(b, context.make_array(ty)(context, b, val).shape, ty.ndim)


def _load(b, p, k, vt=_V16):
    return b.load(b.bitcast(b.gep(p, [k]), vt.as_pointer()), align=4)


def _store(b, v, p, k):
    b.store(v, b.bitcast(b.gep(p, [k]), v.type.as_pointer()), align=4)


def _half16(b, hp, k):
    """16 f16 at hp[k..k+15] widened to f32 (vcvtph2ps)."""
    raw = b.load(b.bitcast(b.gep(hp, [k]), ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
    return b.fpext(b.bitcast(raw, ir.VectorType(ir.HalfType(), 16)), _V16)


def _bcast1(b, p, k):
    v = b.insert_element(ir.Constant(_V16, None), b.load(b.gep(p, [k])), ir.Constant(_I32, 0))
    return _shuf(b, v, ir.Constant(_V16, None), [0] * 16)


def _bcast4(b, p, k):
    """p[k..k+3] in every 128-bit lane (vbroadcastf32x4)."""
    v = _load(b, p, k, _V4)
    return _shuf(b, v, v, [0, 1, 2, 3] * 4)


def _fma16(b):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16, [_V16] * 3), "llvm.fma.v16f32")


def _ngroups(b, n):
    return b.sdiv(b.add(n, _c(3)), _c(4))


# lane 4r + t (head r, key t) -> lane 4t + r (S's rows: key t, head r)
_TO_ROWS = [4 * (p % 4) + p // 4 for p in range(16)]


@intrinsic
def row_scores(typingctx, pool, offs, n, KT, Q4, S):
    # S[h, j, r] = sum_c K[j, c] * Q4[h, c, 4r] for j < n (one fma chain over c from 0), -inf for j from n to
    # the end of its group of 4; K[j] the f16 row at offs[j] (hd = Q4.shape[1] dims, a multiple of 16)
    sig = types.void(pool, offs, n, KT, Q4, S)

    def codegen(context, b, signature, args):
        hp = b.bitcast(context.make_array(signature.args[0])(context, b, args[0]).data, ir.IntType(16).as_pointer())
        op = b.bitcast(context.make_array(signature.args[1])(context, b, args[1]).data, _I64.as_pointer())
        nk = context.cast(b, args[2], signature.args[2], types.int64)
        ktp, qp, sp = (_fp(context, b, signature.args[k], args[k]) for k in (3, 4, 5))
        HG, hd = _shape(context, b, signature.args[4], args[4])[:2]
        srows = _shape(context, b, signature.args[5], args[5])[1]
        ng = _ngroups(b, nk)
        nb = b.sdiv(hd, _c(16))
        fma = _fma16(b)
        # KT[g, 16b + 4k + L, t] = K[4g + t, 16b + 4L + k]: rows widened 16 dims at a time, 4 x 4 transposes
        with cgutils.for_range(b, ng) as g:
            rows = [b.load(b.gep(op, [b.add(b.mul(g.index, _c(4)), _c(t))])) for t in range(4)]
            gbase = b.mul(b.mul(g.index, hd), _c(4))
            with cgutils.for_range(b, nb) as blk:
                c0 = b.mul(blk.index, _c(16))
                R = [_half16(b, hp, b.add(r, c0)) for r in rows]
                lo = [0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29]        # unpcklps
                hi = [x + 2 for x in lo]                                                # unpckhps
                T = [_shuf(b, R[0], R[1], lo), _shuf(b, R[0], R[1], hi), _shuf(b, R[2], R[3], lo), _shuf(b, R[2], R[3], hi)]
                plo = [0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29]       # unpcklpd
                phi = [x + 2 for x in plo]                                              # unpckhpd
                O = [_shuf(b, T[0], T[2], plo), _shuf(b, T[0], T[2], phi), _shuf(b, T[1], T[3], plo), _shuf(b, T[1], T[3], phi)]
                for k in range(4):
                    _store(b, O[k], ktp, b.add(gbase, b.mul(b.add(c0, _c(4 * k)), _c(4))))
        tlane = ir.Constant(ir.VectorType(_I32, 16), [t for r in range(4) for t in range(4)])
        ninf = _fv(float("-inf"), 16)

        def batch(h, g0, B):
            accs = [cgutils.alloca_once_value(b, ir.Constant(_V16, None)) for _ in range(B)]
            for a in accs:
                b.store(ir.Constant(_V16, None), a)
            with cgutils.for_range(b, nb) as blk:
                c0 = b.mul(blk.index, _c(16))
                for cc in range(16):
                    q = _load(b, qp, b.mul(b.add(b.mul(h, hd), b.add(c0, _c(cc))), _c(16)))
                    krow = b.add(c0, _c(4 * (cc % 4) + cc // 4))
                    for i, a in enumerate(accs):
                        kt = _bcast4(b, ktp, b.mul(b.add(b.mul(b.add(g0, _c(i)), hd), krow), _c(4)))
                        b.store(b.call(fma, [kt, q, b.load(a)]), a)
            for i, a in enumerate(accs):
                g = b.add(g0, _c(i))
                rem = b.trunc(b.sub(nk, b.mul(g, _c(4))), _I32)
                remv = _shuf(b, b.insert_element(ir.Constant(ir.VectorType(_I32, 16), None), rem, ir.Constant(_I32, 0)),
                             ir.Constant(ir.VectorType(_I32, 16), None), [0] * 16)
                v = b.select(b.icmp_signed("<", tlane, remv), b.load(a), ninf)
                _store(b, _shuf(b, v, v, _TO_ROWS), sp, b.mul(b.add(b.mul(h, srows), b.mul(g, _c(4))), _c(4)))

        with cgutils.for_range(b, HG) as h:
            nfull = b.sdiv(ng, _c(_GROUPS))
            with cgutils.for_range(b, nfull) as gb:
                batch(h.index, b.mul(gb.index, _c(_GROUPS)), _GROUPS)
            with cgutils.for_range(b, b.sub(ng, b.mul(nfull, _c(_GROUPS)))) as gr:
                batch(h.index, b.add(b.mul(nfull, _c(_GROUPS)), gr.index), 1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def row_max(typingctx, S, n, tmax):
    # tmax[4h + r] = max_j S[h, j, r] over the groups of 4 keys covering j < n (n >= 1)
    sig = types.void(S, n, tmax)

    def codegen(context, b, signature, args):
        sp, tp = _fp(context, b, signature.args[0], args[0]), _fp(context, b, signature.args[2], args[2])
        HG, srows = _shape(context, b, signature.args[0], args[0])[:2]
        ng = _ngroups(b, context.cast(b, args[1], signature.args[1], types.int64))
        with cgutils.for_range(b, HG) as h:
            acc = cgutils.alloca_once_value(b, _fv(float("-inf"), 16))
            b.store(_fv(float("-inf"), 16), acc)
            with cgutils.for_range(b, ng) as g:
                v = _load(b, sp, b.mul(b.add(b.mul(h.index, srows), b.mul(g.index, _c(4))), _c(4)))
                a = b.load(acc)
                b.store(b.select(b.fcmp_ordered(">", v, a), v, a), acc)
            m = b.load(acc)
            for lanes in ([8 + x for x in range(8)] + list(range(8)), [4, 5, 6, 7, 0, 1, 2, 3] * 2):
                o = _shuf(b, m, m, lanes)
                m = b.select(b.fcmp_ordered(">", o, m), o, m)
            _store(b, _shuf(b, m, m, [0, 1, 2, 3]), tp, b.mul(h.index, _c(4)))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def row_exp(typingctx, S, n, ms):
    # S[h, j, r] = expf(S[h, j, r] - ms[4h + r]) over the groups of 4 keys covering j < n
    sig = types.void(S, n, ms)

    def codegen(context, b, signature, args):
        sp, mp = _fp(context, b, signature.args[0], args[0]), _fp(context, b, signature.args[2], args[2])
        HG, srows = _shape(context, b, signature.args[0], args[0])[:2]
        ng = _ngroups(b, context.cast(b, args[1], signature.args[1], types.int64))
        with cgutils.for_range(b, HG) as h:
            msv = _bcast4(b, mp, b.mul(h.index, _c(4)))
            with cgutils.for_range(b, ng) as g:
                k = b.mul(b.add(b.mul(h.index, srows), b.mul(g.index, _c(4))), _c(4))
                _store(b, vexp(b, b.fsub(_load(b, sp, k), msv)), sp, k)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def row_wsum(typingctx, S, n, pool, offs, A, corr, tsum):
    # A[4h + r, c] = A[4h + r, c] * corr[4h + r], then += S[h, j, r] * V[j, c] for j < n (one fma chain over j),
    # V[j] the first dv = A.shape[1] (a multiple of 16) dims of the f16 row at offs[j]; tsum[4h + r] = the
    # sum of S[h, j, r] over j < n in key order from 0
    sig = types.void(S, n, pool, offs, A, corr, tsum)

    def codegen(context, b, signature, args):
        sp = _fp(context, b, signature.args[0], args[0])
        nk = context.cast(b, args[1], signature.args[1], types.int64)
        hp = b.bitcast(context.make_array(signature.args[2])(context, b, args[2]).data, ir.IntType(16).as_pointer())
        op = b.bitcast(context.make_array(signature.args[3])(context, b, args[3]).data, _I64.as_pointer())
        ap, cp, tp = (_fp(context, b, signature.args[k], args[k]) for k in (4, 5, 6))
        HG, srows = _shape(context, b, signature.args[0], args[0])[:2]
        dv = _shape(context, b, signature.args[4], args[4])[1]
        fma = _fma16(b)

        def block(h, c0, vecs):             # 4 heads x 16 * vecs columns from c0, and the heads' tile sums
            heads = [b.add(b.mul(h, _c(4)), _c(r)) for r in range(4)]
            accs = []
            for r in range(4):
                cr = _bcast1(b, cp, heads[r])
                for v in range(vecs):
                    a = cgutils.alloca_once_value(b, ir.Constant(_V16, None))
                    b.store(b.fmul(_load(b, ap, b.add(b.mul(heads[r], dv), b.add(c0, _c(16 * v)))), cr), a)
                    accs.append(a)
            ts = cgutils.alloca_once_value(b, ir.Constant(_V4, None))
            b.store(ir.Constant(_V4, None), ts)
            with cgutils.for_range(b, nk) as j:
                o = b.load(b.gep(op, [j.index]))
                vv = [_half16(b, hp, b.add(o, b.add(c0, _c(16 * v)))) for v in range(vecs)]
                prow = b.mul(b.add(b.mul(h, srows), j.index), _c(4))
                for r in range(4):
                    p = _bcast1(b, sp, b.add(prow, _c(r)))
                    for v in range(vecs):
                        a = accs[r * vecs + v]
                        b.store(b.call(fma, [p, vv[v], b.load(a)]), a)
                b.store(b.fadd(b.load(ts), _load(b, sp, prow, _V4)), ts)
            for r in range(4):
                for v in range(vecs):
                    _store(b, b.load(accs[r * vecs + v]), ap, b.add(b.mul(heads[r], dv), b.add(c0, _c(16 * v))))
            _store(b, b.load(ts), tp, b.mul(h, _c(4)))

        with cgutils.for_range(b, HG) as h:
            nfull = b.sdiv(dv, _c(64))
            with cgutils.for_range(b, nfull) as cb:
                block(h.index, b.mul(cb.index, _c(64)), 4)
            with cgutils.for_range(b, b.sdiv(b.sub(dv, b.mul(nfull, _c(64))), _c(16))) as cr:
                block(h.index, b.add(b.mul(nfull, _c(64)), b.mul(cr.index, _c(16))), 1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def row_prefetch(typingctx, pool, offs, n, nbytes):
    # prefetch into L1 the first nbytes of each of the n rows at offs (f16 elements into pool): the next tile's
    # keys and values while this one is computed (a prefetch never faults)
    sig = types.void(pool, offs, n, nbytes)

    def codegen(context, b, signature, args):
        i8 = ir.IntType(8)
        hp = b.bitcast(context.make_array(signature.args[0])(context, b, args[0]).data, i8.as_pointer())
        op = b.bitcast(context.make_array(signature.args[1])(context, b, args[1]).data, _I64.as_pointer())
        nk = context.cast(b, args[2], signature.args[2], types.int64)
        nl = b.sdiv(b.add(context.cast(b, args[3], signature.args[3], types.int64), _c(63)), _c(64))
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer()] + [_I32] * 3),
                                            "llvm.prefetch.p0i8")
        with cgutils.for_range(b, nk) as j:
            base = b.mul(b.load(b.gep(op, [j.index])), _c(2))
            with cgutils.for_range(b, nl) as line:
                p = b.gep(hp, [b.add(base, b.mul(line.index, _c(64)))])
                b.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return sig, codegen
