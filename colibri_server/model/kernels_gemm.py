"""Integer GEMM for prefill of q4 and q8 weights on AVX-512 VNNI (Zen 4, Ice Lake and later).

Prefill multiplies T tokens (X (T, n) f32) by a q4 matrix. The float path (kernels.matmul)
dequantizes 256-row tiles to f32 and calls sgemm; on bench-mixtral those GEMMs were 80% of a
128-token prefill, at ~66 GFLOP/s. Here the weights stay 4-bit and the products are integer:

* per row group g (G rows sharing one scale per column, quant.py) the scales are folded into
  each token's activations and these are rounded to int8 per chunk of Q4_CHUNK packed bytes,
  exactly as the q4 decode kernel does (kernels_simd.q4_groups_i8), so a token's logits do not
  depend on whether it was prefilled or decoded;
* `_gemm_u4_i8` multiplies 2 rows by 4 tokens per pass, 64 packed bytes (128 weights) at a
  time: two weight loads, their low and high nibbles, and 16 `vpdpbusd` (u8 x s8 sums of four
  products into i32 lanes, no saturation) into 8 zmm accumulators; each weight load serves 4
  tokens and each activation load 2 rows.

* q8 likewise, with the decode kernel's int16 activations (kernels_simd.q8_groups_i16): the
  weights sign-extended to i16 and `vpdpwssd`, 2 rows x 4 tokens, 32 columns at a time.

Token counts are padded to a multiple of 4 with zero activations (their sums are 0 and are
not written out). Needs HAVE_VNNI512; elsewhere kernels.matmul keeps the float path.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels_simd import HAVE_VNNI512, Q4_CHUNK, Q8_CHUNK, _vec, act_chunk_q4, act_chunk_q8

__all__ = ["HAVE_GEMM", "matmul_q4_i8", "matmul_q8_i16", "matmul_q4_i8_par", "matmul_q8_i16_par"]

HAVE_GEMM = HAVE_VNNI512
STEP = 64            # packed bytes per iteration of the q4 micro-kernel
STEP8 = 32           # columns per iteration of the q8 micro-kernel


def _gemm_2x4(context, builder, signature, args, xbytes, step, iteration):
    """The loops shared by the micro-kernels (args: q, x, i0, nrows, k0, nvec, ..., sums): for each
    pair of rows i0+2p, i0+2p+1 and each block of 4 tokens, 8 zmm i32 accumulators start at zero,
    `iteration(off, rows, xs, accs)` runs nvec times (off: the iteration's first column, relative to
    column k0; rows: the two rows' i8 pointers at k0; xs: the 4 tokens' i8 pointers at k0, x having
    `xbytes` per column), and each accumulator's lane sum goes to sums[r*T4 + t]."""
    qa = context.make_array(signature.args[0])(context, builder, args[0])
    xa = context.make_array(signature.args[1])(context, builder, args[1])
    sa = context.make_array(signature.args[-1])(context, builder, args[-1])
    i0v, nrows_v, k0v, nv = args[2], args[3], args[4], args[5]
    i8, i32, idx = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vd = ir.VectorType(i32, 16)
    reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [vd]), "llvm.vector.reduce.add.v16i32")
    qstride = cgutils.unpack_tuple(builder, qa.strides, 2)[0]
    xstride = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
    T4 = cgutils.unpack_tuple(builder, xa.shape, 2)[0]
    qbase = builder.bitcast(qa.data, i8.as_pointer())
    xbase = builder.bitcast(xa.data, i8.as_pointer())
    sums_p = builder.bitcast(sa.data, i32.as_pointer())
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vd, None)) for _ in range(4)] for _ in range(2)]
    two, four = ir.Constant(idx, 2), ir.Constant(idx, 4)
    k0x = builder.mul(k0v, ir.Constant(idx, xbytes))
    with cgutils.for_range(builder, builder.sdiv(nrows_v, two)) as rp:
        row0 = builder.gep(qbase, [builder.add(builder.mul(builder.add(i0v, builder.mul(rp.index, two)), qstride), k0v)])
        rows = (row0, builder.gep(row0, [qstride]))
        with cgutils.for_range(builder, builder.sdiv(T4, four)) as tb:
            t0 = builder.mul(tb.index, four)
            xs = [builder.gep(xbase, [builder.add(builder.mul(builder.add(t0, ir.Constant(idx, t)), xstride), k0x)])
                  for t in range(4)]
            for row in accs:
                for a in row:
                    builder.store(ir.Constant(vd, None), a)
            with cgutils.for_range(builder, nv) as it:
                iteration(builder.mul(it.index, ir.Constant(idx, step)), rows, xs, accs)
            for rr in range(2):
                base = builder.mul(builder.add(builder.mul(rp.index, two), ir.Constant(idx, rr)), T4)
                for t in range(4):
                    tot = builder.call(reduce, [builder.load(accs[rr][t])])
                    builder.store(tot, builder.gep(sums_p, [builder.add(base, builder.add(t0, ir.Constant(idx, t)))]))
    return context.get_dummy_value()


def _vnni(builder, name):
    vd = ir.VectorType(ir.IntType(32), 16)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), name)


@intrinsic
def _gemm_u4_i8(typingctx, q, x8, i0, nrows, k0, nvec, h, sums):
    # q (d,h) u8 packed q4, x8 (T4,2h) i8 (T4 a multiple of 4) -> sums[r*T4 + t] (i32) = sum over packed
    # bytes k in k0..k0+STEP*nvec of lo(q[i0+r,k])*x8[t,k] + hi(q[i0+r,k])*x8[t,k+h], r < nrows (even)
    sig = types.void(q, x8, i0, nrows, k0, nvec, h, sums)

    def codegen(context, builder, signature, args):
        i8, vb = ir.IntType(8), ir.VectorType(ir.IntType(8), 64)
        vd = ir.VectorType(ir.IntType(32), 16)
        dpbusd = _vnni(builder, "llvm.x86.avx512.vpdpbusd.512")
        low, four = _vec(i8, 64, 15), _vec(i8, 64, 4)

        def load(ptr, off):
            return builder.load(builder.bitcast(builder.gep(ptr, [off]), vb.as_pointer()), align=1)

        def iteration(off, rows, xs, accs):          # 64 packed bytes = 128 weights per row
            w = [load(r, off) for r in rows]
            lo = [builder.bitcast(builder.and_(v, low), vd) for v in w]
            hi = [builder.bitcast(builder.lshr(v, four), vd) for v in w]
            for t in range(4):
                xl = builder.bitcast(load(xs[t], off), vd)
                xh = builder.bitcast(load(builder.gep(xs[t], [args[6]]), off), vd)
                for rr in range(2):
                    a = builder.call(dpbusd, [builder.load(accs[rr][t]), lo[rr], xl])
                    builder.store(builder.call(dpbusd, [a, hi[rr], xh]), accs[rr][t])
        return _gemm_2x4(context, builder, signature, args, 1, STEP, iteration)
    return sig, codegen


@intrinsic
def _gemm_i8_i16(typingctx, q, x16, i0, nrows, k0, nvec, sums):
    # q (d,n) i8, x16 (T4,n) i16 (T4 a multiple of 4) -> sums[r*T4 + t] (i32) = sum over columns j in
    # k0..k0+STEP8*nvec of q[i0+r,j]*x16[t,j], r < nrows (even)
    sig = types.void(q, x16, i0, nrows, k0, nvec, sums)

    def codegen(context, builder, signature, args):
        vb, vw = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)
        vd = ir.VectorType(ir.IntType(32), 16)
        dpwssd = _vnni(builder, "llvm.x86.avx512.vpdpwssd.512")

        def iteration(off, rows, xs, accs):          # 32 columns per row
            w = [builder.bitcast(builder.sext(builder.load(builder.bitcast(builder.gep(r, [off]), vb.as_pointer()),
                                                           align=1), vw), vd) for r in rows]
            offb = builder.mul(off, ir.Constant(off.type, 2))
            for t in range(4):
                xv = builder.load(builder.bitcast(builder.gep(xs[t], [offb]), vd.as_pointer()), align=2)
                for rr in range(2):
                    builder.store(builder.call(dpwssd, [builder.load(accs[rr][t]), w[rr], xv]), accs[rr][t])
        return _gemm_2x4(context, builder, signature, args, 2, STEP8, iteration)
    return sig, codegen


@njit(cache=True, error_model="numpy")
def _q4_groups(q, s, X, out, g0, g1):
    # q (d,n/2) u8 packed q4, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out[:, rows of groups g0..g1] of X @ W.T
    T, n = X.shape
    h = n // 2
    d = q.shape[0]
    G = d // s.shape[0]
    T4 = (T + 3) // 4 * 4
    nch = (h + Q4_CHUNK - 1) // Q4_CHUNK
    x8 = np.zeros((T4, n), np.int8)            # tokens T..T4 stay zero
    xs = np.empty(n, np.float32)
    cs = np.empty((T, nch), np.float32)        # activation scale per token and chunk
    offs = np.empty((T, nch), np.float32)      # 8 * sum(x8) per token and chunk (the nibbles' offset)
    sums = np.empty(G * T4, np.int32)
    facc = np.empty((G, T), np.float32)
    for g in range(g0, g1):
        sg = s[g]
        for t in range(T):
            x = X[t]
            xt = x8[t]
            for b in range(nch):
                k0 = b * Q4_CHUNK
                k1 = min(h, k0 + Q4_CHUNK)
                cs[t, b], offs[t, b] = act_chunk_q4(sg, x, xs, xt, h, k0, k1)
        facc[:, :] = 0.0
        for b in range(nch):
            k0 = b * Q4_CHUNK
            k1 = min(h, k0 + Q4_CHUNK)
            nv = (k1 - k0) // STEP
            _gemm_u4_i8(q, x8, g * G, G, k0, nv, h, sums)
            if k0 + STEP * nv < k1:                            # a tail shorter than one step
                for r in range(G):
                    row = q[g * G + r]
                    for t in range(T):
                        xt = x8[t]
                        acc = np.int32(0)
                        for k in range(k0 + STEP * nv, k1):
                            u = np.int32(row[k])
                            acc += np.int32(u & 15) * np.int32(xt[k]) + np.int32(u >> 4) * np.int32(xt[k + h])
                        sums[r * T4 + t] += acc
            for r in range(G):
                for t in range(T):
                    facc[r, t] += cs[t, b] * (np.float32(sums[r * T4 + t]) - offs[t, b])
        for t in range(T):
            for r in range(G):
                out[t, g * G + r] = facc[r, t]


@njit(cache=True, error_model="numpy")
def _q8_groups(q, s, X, out, g0, g1):
    # q (d,n) i8, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out[:, rows of groups g0..g1] of X @ W.T
    T, n = X.shape
    d = q.shape[0]
    G = d // s.shape[0]
    T4 = (T + 3) // 4 * 4
    nch = (n + Q8_CHUNK - 1) // Q8_CHUNK
    x16 = np.zeros((T4, n), np.int16)          # tokens T..T4 stay zero
    xs = np.empty(n, np.float32)
    cs = np.empty((T, nch), np.float32)
    sums = np.empty(G * T4, np.int32)
    facc = np.empty((G, T), np.float32)
    for g in range(g0, g1):
        sg = s[g]
        for t in range(T):
            x = X[t]
            xt = x16[t]
            for b in range(nch):
                k0 = b * Q8_CHUNK
                k1 = min(n, k0 + Q8_CHUNK)
                cs[t, b] = act_chunk_q8(sg, x, xs, xt, k0, k1)
        facc[:, :] = 0.0
        for b in range(nch):
            k0 = b * Q8_CHUNK
            k1 = min(n, k0 + Q8_CHUNK)
            nv = (k1 - k0) // STEP8
            _gemm_i8_i16(q, x16, g * G, G, k0, nv, sums)
            if k0 + STEP8 * nv < k1:                           # a tail shorter than one step
                for r in range(G):
                    row = q[g * G + r]
                    for t in range(T):
                        xt = x16[t]
                        acc = np.int32(0)
                        for k in range(k0 + STEP8 * nv, k1):
                            acc += np.int32(row[k]) * np.int32(xt[k])
                        sums[r * T4 + t] += acc
            for r in range(G):
                for t in range(T):
                    facc[r, t] += cs[t, b] * np.float32(sums[r * T4 + t])
        for t in range(T):
            for r in range(G):
                out[t, g * G + r] = facc[r, t]


@njit(cache=True)
def matmul_q4_i8(q, s, X, out):
    # q (d,n/2) u8 packed q4, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out (T,d) f32 = X @ W.T
    _q4_groups(q, s, X, out, 0, s.shape[0])


@njit(cache=True)
def matmul_q8_i16(q, s, X, out):
    # q (d,n) i8, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out (T,d) f32 = X @ W.T
    _q8_groups(q, s, X, out, 0, s.shape[0])


@njit(cache=True, parallel=True)
def matmul_q4_i8_par(q, s, X, out, nchunks):
    # matmul_q4_i8 with the row groups split in nchunks run by Numba threads (a worker with threads > 1)
    ng = s.shape[0]
    for c in prange(nchunks):
        _q4_groups(q, s, X, out, c * ng // nchunks, (c + 1) * ng // nchunks)


@njit(cache=True, parallel=True)
def matmul_q8_i16_par(q, s, X, out, nchunks):
    # matmul_q8_i16 with the row groups split in nchunks run by Numba threads
    ng = s.shape[0]
    for c in prange(nchunks):
        _q8_groups(q, s, X, out, c * ng // nchunks, (c + 1) * ng // nchunks)
