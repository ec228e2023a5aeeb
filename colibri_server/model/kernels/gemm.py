"""Integer GEMM for prefill of q4 and q8 weights: AVX-512 VNNI (Zen 4, Ice Lake and later), or AVX2.

Prefill multiplies T tokens (X (T, n) f32) by a q4 matrix. The float path (kernels.matmul)
dequantizes 256-row tiles to f32 and calls sgemm; on bench-mixtral those GEMMs were 80% of a
128-token prefill, at ~66 GFLOP/s. Here the weights stay 4-bit and the products are integer:

* per row group g (G rows sharing one scale per column, quant.py) the scales are folded into
  each token's activations and these are rounded to int8 per chunk of Q4_CHUNK packed bytes,
  exactly as the q4 decode kernel does (kernels/quant_ir.q4_groups_i8), so a token's logits do not
  depend on whether it was prefilled or decoded;
* `_gemm_u4_i8` multiplies 2 rows by 4 tokens per pass, 64 packed bytes (128 weights) at a
  time: two weight loads, their low and high nibbles, and 16 `vpdpbusd` (u8 x s8 sums of four
  products into i32 lanes, no saturation) into 8 zmm accumulators; each weight load serves 4
  tokens and each activation load 2 rows. One or two tokens (a serving step's expert with few rows)
  take `_gemm_u4_i8_2`, 4 rows by 2 tokens, instead of multiplying zero tokens: a 2048 x 1024 matrix
  in cache 42 / 53 us at 1 / 2 tokens against 75 with the 4-token kernel (q8 likewise); from DRAM both
  are bound by the weights' reading.

* q8 likewise, with the decode kernel's int16 activations (kernels/quant_ir.q8_groups_i16): the
  weights sign-extended to i16 and `vpdpwssd`, 2 rows x 4 tokens, 32 columns at a time.

* bf16 weights, opt-in (`Workspace(prefill_bf16=True)`): the activations rounded to bf16 (to
  nearest even) and `vdpbf16ps` (two bf16 products summed into each f32 lane), 4 rows x 4
  tokens (16 accumulators), 32 columns at a time, its sums written straight into the output. This is the arithmetic of transformers' bf16 CPU path; it is
  not the default because it rounds the activations (the default f32 path keeps a bf16 file
  within 2e-4 of the same weights run in f32).

* AVX2 without VNNI (Zen 3, Haswell and later): the same loops and sums on ymm registers, 8 i32
  lanes: q4 by two `vpmaddubsw` (u8 nibbles x s8, pairs summed in i16 without saturation) and a
  `vpmaddwd` by ones per 32 bytes, q8 by `vpmovsxbw` and `vpmaddwd`. Integer sums are exact, so
  the results are the VNNI kernels' bit for bit. Measured on a Zen 3 VM, bench-mixtral's 128-token
  prefill, one thread, alternating with the float path: q4 408-428 tok/s against 219-232, q8
  255-303 against 195-221.

Token counts are padded to a multiple of 4 (one token to two, for the 2-token kernel) with zero
activations (their sums are 0 and are
not written out). Needs HAVE_AVX2 (bf16: HAVE_BF16_GEMM, avx512bf16); elsewhere kernels.matmul
keeps the float path.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..format import PANEL
from ..numba_link import by_reference
from .base import nrows, to_f32
from .cpu import FEATURES as _FEATURES
from .cpu import HAVE_AVX2
from .prefetch import prefetch_ahead
from .quant_ir import HAVE_VNNI512, Q4_CHUNK, Q8_CHUNK, _f32_bits, _vec, act_chunk_q4, act_chunk_q8

__all__ = ["HAVE_GEMM", "HAVE_BF16_GEMM", "matmul_q4_i8", "matmul_q8_i16", "matmul_q4_i8_par", "matmul_q8_i16_par",
           "matmul_bf16", "matmul_bf16_par", "round_bf16"]

HAVE_GEMM = HAVE_AVX2      # zmm VNNI micro-kernels where the CPU has them, else ymm AVX2 ones
# Zen 4, Sapphire Rapids: vdpbf16ps (pairs of bf16 products summed into f32 lanes)
HAVE_BF16_GEMM = HAVE_VNNI512 and "avx512bf16" in _FEATURES
STEP = 64            # packed bytes per iteration of the q4 micro-kernel
STEP8 = 32           # columns per iteration of the q8 and bf16 micro-kernels
BF16_ROWS = 64       # weight rows per call of the bf16 micro-kernel (their sums: BF16_ROWS x tokens)
BF16_R = 4           # rows per pass of the bf16 micro-kernel: 4 x 4 tokens, 16 zmm accumulators
# bytes the micro-kernels prefetch ahead of the rows they read (kernels/prefetch): a row group's rows are
# read after its activations are rounded, a pause the hardware prefetchers do not cover. A 2-vCPU Zen 4
# VM, one thread, bench-mixtral's q4 expert matrices from DRAM, ms a matrix at 1 / 2 / 4 / 8 tokens:
# 4 KB 0.10-0.12 / 0.11-0.13 / 0.12-0.17 / 0.20-0.30, 8 KB 0.08 / 0.09 / 0.12 / 0.17-0.20, 16 KB about
# 8 KB's; none 0.20 / 0.21 / 0.23 / 0.24
GEMM_AHEAD = 8192


def _gemm_2x4(context, builder, signature, args, xbytes, step, iteration, wbytes=1, fp=False, R=2, panel=0, lanes=16, C=4):
    """The loops shared by the micro-kernels (args: q, x, i0, nrows, k0, nvec, ..., sums): for each
    R rows i0+Rp.. (R = 2, or 4) and each block of C tokens (4, or 2), C*R accumulators of `lanes` lanes (zmm: 16,
    ymm: 8; i32, or f32 when `fp`) start at zero, `iteration(off, rows, xs, accs)` runs nvec times
    (off: the iteration's first column, relative to column k0; rows: the R rows' i8 pointers at k0,
    q having `wbytes` per column; xs: the C tokens' i8 pointers at k0, x having `xbytes` per column), and each
    accumulator's lane sum goes to sums[r*T4 + t]. With `panel` (columns per panel), q is a panel
    array (nb, d, panel), k0 is 0 and the nvec iterations run through the panels in order: each
    panel's rows and x's columns of that panel, the accumulators carried across."""
    qa = context.make_array(signature.args[0])(context, builder, args[0])
    xa = context.make_array(signature.args[1])(context, builder, args[1])
    sa = context.make_array(signature.args[-1])(context, builder, args[-1])
    i0v, nrows_v, k0v, nv = args[2], args[3], args[4], args[5]
    i8, idx = ir.IntType(8), ir.IntType(64)
    el = ir.FloatType() if fp else ir.IntType(32)
    vd = ir.VectorType(el, lanes)
    if fp:       # the lane sum in any order (reassoc): a tree, not 15 dependent adds
        fadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(el, [el, vd]),
                                              f"llvm.vector.reduce.fadd.v{lanes}f32")

        def reduce(v):
            return builder.call(fadd, [ir.Constant(el, 0.0), v], fastmath=("reassoc",))
    else:
        iadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(el, [vd]),
                                              f"llvm.vector.reduce.add.v{lanes}i32")

        def reduce(v):
            return builder.call(iadd, [v])
    qstrides = cgutils.unpack_tuple(builder, qa.strides, 3 if panel else 2)
    qstride = qstrides[1] if panel else qstrides[0]
    xstride = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
    T4 = cgutils.unpack_tuple(builder, xa.shape, 2)[0]
    qbase = builder.bitcast(qa.data, i8.as_pointer())
    xbase = builder.bitcast(xa.data, i8.as_pointer())
    sums_p = builder.bitcast(sa.data, el.as_pointer())
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vd, None)) for _ in range(C)] for _ in range(R)]
    rstep, cstep = ir.Constant(idx, R), ir.Constant(idx, C)
    k0x = builder.mul(k0v, ir.Constant(idx, xbytes))
    k0w = builder.mul(k0v, ir.Constant(idx, wbytes))
    with cgutils.for_range(builder, builder.sdiv(nrows_v, rstep)) as rp:
        row0 = builder.gep(qbase, [builder.add(builder.mul(builder.add(i0v, builder.mul(rp.index, rstep)), qstride), k0w)])
        rows = [row0] + [builder.gep(row0, [builder.mul(qstride, ir.Constant(idx, r))]) for r in range(1, R)]
        with cgutils.for_range(builder, builder.sdiv(T4, cstep)) as tb:
            t0 = builder.mul(tb.index, cstep)
            xs = [builder.gep(xbase, [builder.add(builder.mul(builder.add(t0, ir.Constant(idx, t)), xstride), k0x)])
                  for t in range(C)]
            for row in accs:
                for a in row:
                    builder.store(ir.Constant(vd, None), a)
            if panel:                                  # panel by panel: its rows, x's columns of the panel
                per = ir.Constant(idx, panel // step)
                with cgutils.for_range(builder, builder.udiv(nv, per)) as pan:
                    prow = [builder.gep(r, [builder.mul(pan.index, qstrides[0])]) for r in rows]
                    xshift = builder.mul(pan.index, ir.Constant(idx, panel * xbytes))
                    pxs = [builder.gep(x, [xshift]) for x in xs]
                    with cgutils.for_range(builder, per) as it:
                        off = builder.mul(it.index, ir.Constant(idx, step))
                        prefetch_ahead(builder, prow, builder.mul(off, ir.Constant(idx, wbytes)), ahead=GEMM_AHEAD)
                        iteration(off, prow, pxs, accs)
            else:
                with cgutils.for_range(builder, nv) as it:
                    off = builder.mul(it.index, ir.Constant(idx, step))
                    prefetch_ahead(builder, rows, builder.mul(off, ir.Constant(idx, wbytes)), ahead=GEMM_AHEAD)
                    iteration(off, rows, xs, accs)
            for rr in range(R):
                base = builder.mul(builder.add(builder.mul(rp.index, rstep), ir.Constant(idx, rr)), T4)
                for t in range(C):
                    tot = reduce(builder.load(accs[rr][t]))
                    builder.store(tot, builder.gep(sums_p, [builder.add(base, builder.add(t0, ir.Constant(idx, t)))]))
    return context.get_dummy_value()


def _vnni(builder, name):
    vd = ir.VectorType(ir.IntType(32), 16)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vd, [vd, vd, vd]), name)


def _avx2(builder):
    """vpmaddubsw (u8 x s8 -> i16 pair sums) and vpmaddwd (i16 x i16 -> i32 pair sums) on ymm."""
    vb, vw, vd = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
    mod = builder.module
    return (cgutils.get_or_insert_function(mod, ir.FunctionType(vw, [vb, vb]), "llvm.x86.avx2.pmadd.ub.sw"),
            cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vw, vw]), "llvm.x86.avx2.pmadd.wd"))


def _q4_iteration_avx2(builder, h):
    """AVX2 q4 iteration: STEP packed bytes (2 x 32) of 2 rows times 4 tokens. Per 32 bytes and (row,
    token): two vpmaddubsw (nibble u8 x activation s8, |pair| <= 2*15*127, two summed <= 7620: no i16
    saturation) and a vpmaddwd by ones into the i32 accumulator."""
    i8, i16 = ir.IntType(8), ir.IntType(16)
    vb = ir.VectorType(i8, 32)
    maddubs, maddwd = _avx2(builder)
    low, four, ones = _vec(i8, 32, 15), _vec(i8, 32, 4), _vec(i16, 16, 1)

    def load(ptr, off):
        return builder.load(builder.bitcast(builder.gep(ptr, [off]), vb.as_pointer()), align=1)

    def iteration(off, rows, xs, accs):
        for half in range(STEP // 32):
            o = builder.add(off, ir.Constant(off.type, 32 * half))
            w = [load(r, o) for r in rows]
            lo = [builder.and_(v, low) for v in w]
            hi = [builder.lshr(v, four) for v in w]
            for t in range(len(xs)):
                xl, xh = load(xs[t], o), load(builder.gep(xs[t], [h]), o)
                for rr in range(len(rows)):
                    p = builder.add(builder.call(maddubs, [lo[rr], xl]), builder.call(maddubs, [hi[rr], xh]))
                    builder.store(builder.add(builder.load(accs[rr][t]), builder.call(maddwd, [p, ones])), accs[rr][t])
    return iteration


def _u4_codegen(R, C):
    def codegen(context, builder, signature, args):
        if not HAVE_VNNI512:
            return _gemm_2x4(context, builder, signature, args, 1, STEP, _q4_iteration_avx2(builder, args[6]), lanes=8,
                             R=R, C=C)
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
            for t in range(len(xs)):
                xl = builder.bitcast(load(xs[t], off), vd)
                xh = builder.bitcast(load(builder.gep(xs[t], [args[6]]), off), vd)
                for rr in range(len(rows)):
                    a = builder.call(dpbusd, [builder.load(accs[rr][t]), lo[rr], xl])
                    builder.store(builder.call(dpbusd, [a, hi[rr], xh]), accs[rr][t])
        return _gemm_2x4(context, builder, signature, args, 1, STEP, iteration, R=R, C=C)
    return codegen


@intrinsic
def _gemm_u4_i8(typingctx, q, x8, i0, nrows, k0, nvec, h, sums):
    # q (d,h) u8 packed q4, x8 (T4,2h) i8 (T4 a multiple of 4) -> sums[r*T4 + t] (i32) = sum over packed
    # bytes k in k0..k0+STEP*nvec of lo(q[i0+r,k])*x8[t,k] + hi(q[i0+r,k])*x8[t,k+h], r < nrows (even)
    return types.void(q, x8, i0, nrows, k0, nvec, h, sums), _u4_codegen(2, 4)


@intrinsic
def _gemm_u4_i8_2(typingctx, q, x8, i0, nrows, k0, nvec, h, sums):
    # _gemm_u4_i8 for two tokens (x8 (2,2h)): 4 rows x 2 tokens a pass, nrows a multiple of 4
    return types.void(q, x8, i0, nrows, k0, nvec, h, sums), _u4_codegen(4, 2)


def _q8_iteration_avx2(builder):
    """AVX2 q8 iteration: STEP8 columns (2 x 16) of 2 rows times 4 tokens: the int8 weights sign-extended
    to i16 (vpmovsxbw), vpmaddwd with the int16 activations into the i32 accumulators."""
    vb, vw = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.IntType(16), 16)
    _, maddwd = _avx2(builder)

    def iteration(off, rows, xs, accs):
        for half in range(STEP8 // 16):
            o = builder.add(off, ir.Constant(off.type, 16 * half))
            w = [builder.sext(builder.load(builder.bitcast(builder.gep(r, [o]), vb.as_pointer()), align=1), vw)
                 for r in rows]
            ob = builder.mul(o, ir.Constant(o.type, 2))
            for t in range(len(xs)):
                xv = builder.load(builder.bitcast(builder.gep(xs[t], [ob]), vw.as_pointer()), align=2)
                for rr in range(len(rows)):
                    builder.store(builder.add(builder.load(accs[rr][t]), builder.call(maddwd, [w[rr], xv])), accs[rr][t])
    return iteration


def _i8_codegen(R, C):
    def codegen(context, builder, signature, args):
        if not HAVE_VNNI512:
            return _gemm_2x4(context, builder, signature, args, 2, STEP8, _q8_iteration_avx2(builder), lanes=8,
                             R=R, C=C)
        vb, vw = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)
        vd = ir.VectorType(ir.IntType(32), 16)
        dpwssd = _vnni(builder, "llvm.x86.avx512.vpdpwssd.512")

        def iteration(off, rows, xs, accs):          # 32 columns per row
            w = [builder.bitcast(builder.sext(builder.load(builder.bitcast(builder.gep(r, [off]), vb.as_pointer()),
                                                           align=1), vw), vd) for r in rows]
            offb = builder.mul(off, ir.Constant(off.type, 2))
            for t in range(len(xs)):
                xv = builder.load(builder.bitcast(builder.gep(xs[t], [offb]), vd.as_pointer()), align=2)
                for rr in range(len(rows)):
                    builder.store(builder.call(dpwssd, [builder.load(accs[rr][t]), w[rr], xv]), accs[rr][t])
        return _gemm_2x4(context, builder, signature, args, 2, STEP8, iteration, R=R, C=C)
    return codegen


@intrinsic
def _gemm_i8_i16(typingctx, q, x16, i0, nrows, k0, nvec, sums):
    # q (d,n) i8, x16 (T4,n) i16 (T4 a multiple of 4) -> sums[r*T4 + t] (i32) = sum over columns j in
    # k0..k0+STEP8*nvec of q[i0+r,j]*x16[t,j], r < nrows (even)
    return types.void(q, x16, i0, nrows, k0, nvec, sums), _i8_codegen(2, 4)


@intrinsic
def _gemm_i8_i16_2(typingctx, q, x16, i0, nrows, k0, nvec, sums):
    # _gemm_i8_i16 for two tokens (x16 (2,n)): 4 rows x 2 tokens a pass, nrows a multiple of 4
    return types.void(q, x16, i0, nrows, k0, nvec, sums), _i8_codegen(4, 2)


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite.ir has no such type; its IR is text, so the name is all it needs)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _make_gemm_bf16(panel):
    @intrinsic
    def gemm(typingctx, w, xb, i0, nrows, k0, nvec, sums):
        return _gemm_bf16_typed(w, xb, i0, nrows, k0, nvec, sums, panel)
    return gemm


def _gemm_bf16_typed(w, xb, i0, nrows, k0, nvec, sums, panel):
    # w (d,n) i16 bf16 bits, xb (T4,n) i16 bf16 bits (T4 a multiple of 4) -> sums[r*T4 + t] (f32) = sum
    # over columns j in k0..k0+STEP8*nvec of w[i0+r,j]*xb[t,j], r < nrows (a multiple of BF16_R);
    # with `panel`, w is the panel array (nb,d,panel) of the matrix and k0 is 0
    sig = types.void(w, xb, i0, nrows, k0, nvec, sums)

    def codegen(context, builder, signature, args):
        vf, vb = ir.VectorType(ir.FloatType(), 16), ir.VectorType(_BFloat(), 32)
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vb, vb]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")

        def load(ptr, offb):
            return builder.load(builder.bitcast(builder.gep(ptr, [offb]), vb.as_pointer()), align=2)

        def iteration(off, rows, xs, accs):          # 32 columns per row
            offb = builder.mul(off, ir.Constant(off.type, 2))
            wv = [load(r, offb) for r in rows]
            for t in range(4):
                xv = load(xs[t], offb)
                for rr in range(BF16_R):
                    builder.store(builder.call(dp, [builder.load(accs[rr][t]), wv[rr], xv]), accs[rr][t])
        return _gemm_2x4(context, builder, signature, args, 2, STEP8, iteration, wbytes=2, fp=True, R=BF16_R,
                         panel=panel)
    return sig, codegen


_gemm_bf16 = _make_gemm_bf16(0)
_gemm_bf16_panels = _make_gemm_bf16(PANEL)


@njit(cache=True)
def round_bf16(X, xb):
    # X (T,n) f32 -> xb[:T] i16 bf16 bits, rounded to nearest even (inf and NaN stay so)
    T, n = X.shape
    for t in range(T):
        x = X[t]
        b = xb[t]
        for k in range(n):
            u = np.uint32(_f32_bits(x[k]))
            b[k] = np.int16(np.int32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)))


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot_bf16(a, b, k0, k1):
    acc = np.float32(0.0)
    for k in range(k0, k1):
        acc += to_f32(a[k]) * to_f32(b[k])
    return acc


@njit(cache=True, inline="always")
def _put_sums(s4, out, t0, T, b0, nr):
    # the micro-kernel's sums s4[r*4 + t] of tokens t0.. -> out[t0 + t, b0 + r]: no staging copy
    for t in range(min(4, T - t0)):
        o = out[t0 + t]
        for r in range(nr):
            o[b0 + r] = s4[r * 4 + t]


@njit(cache=True, error_model="numpy")
def _bf16_rows(W, xb, T, out, r0, r1):
    # out[:T, r0:r1] = xb @ W[r0:r1].T in bf16 x bf16 -> f32 (W (d,n) i16 bf16, xb (T4,n) i16 bf16)
    n = W.shape[1]
    T4 = xb.shape[0]
    nv = n // STEP8
    tail = nv * STEP8
    s4 = np.empty(BF16_ROWS * 4, np.float32)
    for b0 in range(r0, r1, BF16_ROWS):
        b1 = min(r1, b0 + BF16_ROWS)
        nr = (b1 - b0) // BF16_R * BF16_R
        # 4 tokens at a time: their activations stay in L1 while the block's rows stream from L2
        for t0 in range(0, T4, 4):
            _gemm_bf16(W, xb[t0:t0 + 4], b0, nr, 0, nv, s4)
            _put_sums(s4, out, t0, T, b0, nr)
        for r in range(nr, b1 - b0):                  # the last rows short of BF16_R
            for t in range(T):
                out[t, b0 + r] = _dot_bf16(W[b0 + r], xb[t], 0, tail)
        if tail < n:                                   # columns short of one step
            for r in range(b1 - b0):
                for t in range(T):
                    out[t, b0 + r] += _dot_bf16(W[b0 + r], xb[t], tail, n)


def _bf16_tokens(X):
    T, n = X.shape
    xb = np.zeros(((T + 3) // 4 * 4, n), np.int16)    # tokens T..T4 stay zero
    round_bf16(X, xb)
    return xb


@njit(cache=True, error_model="numpy")
def _bf16_panel_rows(P, xb, T, out, r0, r1):
    # _bf16_rows for a matrix in panels P (nb,d,PW) i16 bf16: the micro-kernel walks the panels in
    # turn, its accumulators carried from one to the next (the same sums as the rows layout)
    nb, _, PW = P.shape
    T4 = xb.shape[0]
    nv = nb * PW // STEP8
    s4 = np.empty(BF16_ROWS * 4, np.float32)
    for b0 in range(r0, r1, BF16_ROWS):
        b1 = min(r1, b0 + BF16_ROWS)
        nr = (b1 - b0) // BF16_R * BF16_R
        for t0 in range(0, T4, 4):
            _gemm_bf16_panels(P, xb[t0:t0 + 4], b0, nr, 0, nv, s4)
            _put_sums(s4, out, t0, T, b0, nr)
        for r in range(nr, b1 - b0):                  # the last rows short of BF16_R
            for t in range(T):
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += _dot_bf16(P[b, b0 + r], xb[t, b * PW:(b + 1) * PW], 0, PW)
                out[t, b0 + r] = acc


def _bf16_block(W, xb, T, out, r0, r1):
    raise NotImplementedError           # Numba only: rows r0:r1 of a row-major or a panel bf16 matrix


@overload(_bf16_block)
def _bf16_block_overload(W, xb, T, out, r0, r1):
    if isinstance(W, types.Array) and W.ndim == 3:
        return lambda W, xb, T, out, r0, r1: _bf16_panel_rows(W, xb, T, out, r0, r1)
    return lambda W, xb, T, out, r0, r1: _bf16_rows(W, xb, T, out, r0, r1)


@njit(cache=True)
def _bf16_all(W, xb, T, out):
    _bf16_block(W, xb, T, out, 0, nrows(W))


def matmul_bf16(W, X, out):
    """W (d,n) i16 bf16 or a panels.Panels of it, X (T,n) f32 -> out (T,d) f32 = bf16(X) @ W.T,
    f32 sums (see the module doc)."""
    _bf16_all(getattr(W, "p", W), _bf16_tokens(X), X.shape[0], out)
    return out


@njit(cache=True, parallel=True)
def _bf16_rows_par(W, xb, T, out, nchunks):
    d = nrows(W)
    for c in prange(nchunks):
        r0 = (c * d // nchunks) // BF16_ROWS * BF16_ROWS
        r1 = d if c == nchunks - 1 else ((c + 1) * d // nchunks) // BF16_ROWS * BF16_ROWS
        if r1 > r0:
            _bf16_block(W, xb, T, out, r0, r1)


def matmul_bf16_par(W, X, out, nchunks):
    """matmul_bf16 with the rows split in nchunks run by Numba threads (a worker with threads > 1)."""
    _bf16_rows_par(getattr(W, "p", W), _bf16_tokens(X), X.shape[0], out, nchunks)
    return out


@by_reference          # the q4 GEMM's row groups, under prefill and the serving step: compiled once (model/numba_link)
@njit(cache=True, error_model="numpy")
def _q4_groups(q, s, X, out, g0, g1):
    # q (d,n/2) u8 packed q4, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out[:, rows of groups g0..g1] of X @ W.T
    T, n = X.shape
    h = n // 2
    d = q.shape[0]
    G = d // s.shape[0]
    two = T <= 2 and G % 4 == 0                 # the 4-row x 2-token kernel: no zero tokens multiplied
    T4 = 2 if two else (T + 3) // 4 * 4
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
            if two:
                _gemm_u4_i8_2(q, x8, g * G, G, k0, nv, h, sums)
            else:
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


@by_reference          # as _q4_groups, for q8
@njit(cache=True, error_model="numpy")
def _q8_groups(q, s, X, out, g0, g1):
    # q (d,n) i8, s (d/G,n) u16 f16 scales, X (T,n) f32 -> out[:, rows of groups g0..g1] of X @ W.T
    T, n = X.shape
    d = q.shape[0]
    G = d // s.shape[0]
    two = T <= 2 and G % 4 == 0
    T4 = 2 if two else (T + 3) // 4 * 4
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
            if two:
                _gemm_i8_i16_2(q, x16, g * G, G, k0, nv, sums)
            else:
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


def q_groups(q, s, X, out, g0, g1):
    """Python stand-in (never called): _q4_groups or _q8_groups by q's dtype (uint8 packed q4, int8 q8)."""
    raise NotImplementedError


@overload(q_groups, inline="always")
def _q_groups_overload(q, s, X, out, g0, g1):
    if q.dtype == types.int8:
        return lambda q, s, X, out, g0, g1: _q8_groups(q, s, X, out, g0, g1)
    if q.dtype == types.uint8:
        return lambda q, s, X, out, g0, g1: _q4_groups(q, s, X, out, g0, g1)
    return None


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
