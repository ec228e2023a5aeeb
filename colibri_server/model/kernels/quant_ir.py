"""Integer dot products for the quantized decode kernels, written as LLVM IR (AVX2, or
AVX-512 VNNI where the CPU has it: HAVE_VNNI512).

LLVM does not find `vpmaddubsw` / `vpmaddwd` in Numba loops on its own (it widens to 32-bit
lanes and runs 4-8 weights per instruction), so the two inner loops are emitted here as
explicit vector IR through Numba intrinsics, and the rest stays plain Numba:

* q4: 4-bit weights (0..15, packed split-halves, quant.py) times int8 activations:
  `vpand` / `vpsrlw` unpack 64 weights from 32 bytes, two `vpmaddubsw` (u8 x s8 -> i16
  pairs, |pair| <= 2*15*127, never saturates) and one `vpmaddwd` by ones -> i32 lanes.
* q8: int8 weights sign-extended to i16 (`vpmovsxbw`) times int16 activations, `vpmaddwd`.
* With AVX-512 VNNI the same loops run on zmm registers, 64 bytes of weights at a time, and
  each multiply-add pair is one instruction: `vpdpbusd` (q4) and `vpdpwssd` (q8). Measured on
  Zen 4: the AVX2 forms read q8 weights at ~17 GB/s in decode, below the ~28 GB/s one core
  can stream.

One row at a time (measured here: a single sequential stream reads faster than 4 interleaved
row streams, 8.0 vs 6.0 GB/s for q4; a 4-row variant sharing the activation loads lost).

Activations are quantized per chunk of columns (Q4_CHUNK packed bytes = 2*Q4_CHUNK weights;
Q8_CHUNK columns) with their own scale, so one outlier costs precision only in its chunk:
q4 int8 (step max/127, below the 4-bit weight error), q8 int16 in +-16383 (step max/16383,
negligible; the bound keeps an i32 chunk sum exact: 127 * 16383 * 1024 < 2^31).

HAVE_AVX2 is False on other CPUs (arm64, old x86): kernels/quant then uses its float path.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..numba_link import by_reference
from .base import to_f32
from .cpu import FEATURES as _FEATURES  # noqa: F401
from .cpu import HAVE_VNNI512

Q4_CHUNK = 1024     # packed bytes (2048 weights) per int8 activation scale
Q8_CHUNK = 1024     # columns per int16 activation scale (127 * 16383 * 1024 < 2^31)
X16_MAX = 16383


Q4_STEP = 128 if HAVE_VNNI512 else 64      # packed q4 bytes per iteration of _dot_u4_i8
Q8_STEP = 64 if HAVE_VNNI512 else 32       # q8 columns per iteration of _dot_i8_i16
# Rows the AVX2 integer dots stream at once, far apart (split_rows; kernels/float_ir has its own
# STREAMS8). Measured on a Zen 3 VM, bench-mixtral's expert matrices from DRAM, whole matvec, one
# thread, alternating processes: q4 8.0-9.7 GB/s one row at a time, 10.2-13.2 with 2, 12.7-14.5 with 4 (one run 8.2);
# q8 9.2-11.3, 10.4-14.1, 14.0-16.4 (docs/performance.md). AVX-512 VNNI machines keep one stream (measured
# on Zen 4: one sequential stream read fastest there; far-apart streams were not tried).
STREAMS = 1 if HAVE_VNNI512 else 4


def split_rows(builder, nrows, body, streams=STREAMS):
    """Emit body(rows) over rows 0..nrows-1 (i64): `streams` rows at once, Q = nrows // streams apart
    (rows r, r + Q, r + 2Q, ... for r < Q), then the rows past streams * Q one at a time."""
    idx = ir.IntType(64)
    Q = builder.sdiv(nrows, ir.Constant(idx, streams))
    with cgutils.for_range(builder, Q) as r:
        body([builder.add(r.index, builder.mul(Q, ir.Constant(idx, k))) for k in range(streams)])
    with cgutils.for_range_slice(builder, builder.mul(Q, ir.Constant(idx, streams)), nrows, ir.Constant(idx, 1)) as (r, _):
        body([r])


def _vec(t, n, v):
    return ir.Constant(ir.VectorType(t, n), [ir.Constant(t, v)] * n)


def _rows_by_chunk(context, builder, signature, args, ncols, chunk, step, nacc, width, iteration):
    """The loops shared by the decode dots (args: q, x, i0, nrows, ncols, G, jr, sums; x 2D, one row
    of activations per group of G rows: row i0+r uses x[(jr + r) // G]). Each row is read once, in
    order, front to back: for row r's chunk b of `chunk` columns (k0 = b*chunk .. min(ncols,
    k0+chunk)), `nacc` i32 vector accumulators of `width` lanes start at zero,
    `iteration(off, row, x, accs)` runs for the whole steps of `step` columns (off: the step's
    first column; row, x: i8 pointers to q's row and its x row), and the lane sum goes to
    sums[r*nch + b]. STREAMS rows far apart run at once, step by step (split_rows): on AVX2 one row
    stream reads far below what a core can fetch. Reading one row chunk by chunk in two passes
    measured half the DRAM bandwidth on Zen 4, and so did two interleaved adjacent rows."""
    qa = context.make_array(signature.args[0])(context, builder, args[0])
    xa = context.make_array(signature.args[1])(context, builder, args[1])
    sa = context.make_array(signature.args[-1])(context, builder, args[-1])
    i0v, nrows_v, Gv, jr = args[2], args[3], args[5], args[6]
    i8, i32, idx = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vd = ir.VectorType(i32, width)
    reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [vd]),
                                            f"llvm.vector.reduce.add.v{width}i32")
    stride = cgutils.unpack_tuple(builder, qa.strides, 2)[0]
    xstride = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
    qbase = builder.bitcast(qa.data, i8.as_pointer())
    xbase = builder.bitcast(xa.data, i8.as_pointer())
    sums_p = builder.bitcast(sa.data, i32.as_pointer())
    C = ir.Constant(idx, chunk)
    nch = builder.sdiv(builder.add(ncols, ir.Constant(idx, chunk - 1)), C)
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vd, None)) for _ in range(nacc)] for _ in range(STREAMS)]

    def body(rs):                                  # the rows rs (relative to i0), interleaved step by step
        rows = [builder.gep(qbase, [builder.mul(builder.add(i0v, r), stride)]) for r in rs]
        xrows = [builder.gep(xbase, [builder.mul(builder.sdiv(builder.add(jr, r), Gv), xstride)]) for r in rs]
        with cgutils.for_range(builder, nch) as ch:
            k0 = builder.mul(ch.index, C)
            k1 = builder.add(k0, C)
            k1 = builder.select(builder.icmp_signed("<", ncols, k1), ncols, k1)
            nv = builder.sdiv(builder.sub(k1, k0), ir.Constant(idx, step))
            for a in accs[:len(rs)]:
                for acc in a:
                    builder.store(ir.Constant(vd, None), acc)
            with cgutils.for_range(builder, nv) as it:
                off = builder.add(k0, builder.mul(it.index, ir.Constant(idx, step)))
                for row, xrow, a in zip(rows, xrows, accs):
                    iteration(off, row, xrow, a)
            for r, a in zip(rs, accs):
                tot = builder.load(a[0])
                for acc in a[1:]:
                    tot = builder.add(tot, builder.load(acc))
                builder.store(builder.call(reduce, [tot]), builder.gep(sums_p, [builder.add(builder.mul(r, nch), ch.index)]))
    split_rows(builder, nrows_v, body)
    return context.get_dummy_value()


@intrinsic
def _dot_u4_i8(typingctx, q, x8, i0, nrows, h, G, jr, sums):
    # q (d,h) u8 packed q4 rows, x8 (groups, >=2h) i8 -> sums[r*nch + b] (i32) = sum over the whole Q4_STEP steps
    # of chunk b (packed bytes k in b*Q4_CHUNK..) of lo(q[i0+r,k])*xg[k] + hi(q[i0+r,k])*xg[k+h], xg = x8[(jr+r) // G]
    sig = types.void(q, x8, i0, nrows, h, G, jr, sums)

    def codegen(context, builder, signature, args):
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        B = Q4_STEP // 2                                   # bytes per vector: 64 (zmm) or 32 (ymm)
        vb, vw, vd = ir.VectorType(i8, B), ir.VectorType(i16, B // 2), ir.VectorType(i32, B // 4)
        mod = builder.module
        if HAVE_VNNI512:
            dpbusd = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vd, vd, vd]),
                                                    "llvm.x86.avx512.vpdpbusd.512")

            def mac2(acc, u1, s1, u2, s2):             # acc + sums of 4 adjacent u8*s8 per i32 lane
                acc = builder.call(dpbusd, [acc, builder.bitcast(u1, vd), builder.bitcast(s1, vd)])
                return builder.call(dpbusd, [acc, builder.bitcast(u2, vd), builder.bitcast(s2, vd)])
        else:
            maddubs = cgutils.get_or_insert_function(mod, ir.FunctionType(vw, [vb, vb]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vw, vw]),
                                                    "llvm.x86.avx2.pmadd.wd")
            ones = _vec(i16, B // 2, 1)

            def mac2(acc, u1, s1, u2, s2):             # |pair| <= 2*15*127, two pairs <= 7620: no saturation
                p = builder.add(builder.call(maddubs, [u1, s1]), builder.call(maddubs, [u2, s2]))
                return builder.add(acc, builder.call(maddwd, [p, ones]))
        low, four = _vec(i8, B, 15), _vec(i8, B, 4)
        hh = args[4]

        def iteration(off, row, x, accs):              # Q4_STEP packed bytes, 2 accumulators
            for half in range(2):
                o = builder.add(off, ir.Constant(off.type, B * half))

                def load(base, at):
                    return builder.load(builder.bitcast(builder.gep(base, [at]), vb.as_pointer()), align=1)
                v = load(row, o)
                builder.store(mac2(builder.load(accs[half]), builder.and_(v, low), load(x, o),
                                   builder.lshr(v, four), load(x, builder.add(o, hh))), accs[half])
        return _rows_by_chunk(context, builder, signature, args, hh, Q4_CHUNK, Q4_STEP, 2, B // 4, iteration)
    return sig, codegen


@intrinsic
def _dot_i8_i16(typingctx, q, x16, i0, nrows, n, G, jr, sums):
    # q (d,n) i8 rows, x16 (groups, >=n) i16 -> sums[r*nch + b] (i32) = sum over the whole Q8_STEP steps of
    # chunk b (columns j in b*Q8_CHUNK..) of q[i0+r,j]*x16[(jr+r) // G, j], r < nrows
    sig = types.void(q, x16, i0, nrows, n, G, jr, sums)

    def codegen(context, builder, signature, args):
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        C = Q8_STEP // 2                                   # columns per vector: 32 (zmm) or 16 (ymm)
        vb, vw, vd = ir.VectorType(i8, C), ir.VectorType(i16, C), ir.VectorType(i32, C // 2)
        mod = builder.module
        if HAVE_VNNI512:
            dpwssd = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vd, vd, vd]),
                                                    "llvm.x86.avx512.vpdpwssd.512")

            def mac(acc, w, xv):                       # acc + sum of 2 adjacent s16*s16 per i32 lane
                return builder.call(dpwssd, [acc, builder.bitcast(w, vd), builder.bitcast(xv, vd)])
        else:
            maddwd = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vw, vw]),
                                                    "llvm.x86.avx2.pmadd.wd")

            def mac(acc, w, xv):
                return builder.add(acc, builder.call(maddwd, [w, xv]))

        def iteration(off, row, x, accs):              # Q8_STEP columns, 2 accumulators
            for half in range(2):
                o = builder.add(off, ir.Constant(off.type, C * half))
                w = builder.load(builder.bitcast(builder.gep(row, [o]), vb.as_pointer()), align=1)
                xv = builder.load(builder.bitcast(builder.gep(x, [builder.mul(o, ir.Constant(o.type, 2))]),
                                                  vw.as_pointer()), align=2)
                builder.store(mac(builder.load(accs[half]), builder.sext(w, vw), xv), accs[half])
        return _rows_by_chunk(context, builder, signature, args, args[4], Q8_CHUNK, Q8_STEP, 2, C // 2, iteration)
    return sig, codegen


SUMS_MAX = 1024     # i32 sums (rows x chunks) per call of a dot intrinsic, at the end of aux


@njit(cache=True, inline="always")
def _sums_scratch(aux):
    # the last SUMS_MAX floats of the aux scratch, as i32
    return aux[aux.shape[0] - SUMS_MAX:].view(np.int32)


_MAGIC = np.float32(12582912.0)     # 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 to nearest even


@njit(cache=True, inline="always")
def _round(v):
    # float32 -> nearest integer (ties to even) as int32, |v| < 2^22; vectorises (no libm call)
    return np.int32((v + _MAGIC) - _MAGIC)


@njit(cache=True, inline="always")
def _put(out, i, a, alpha, accumulate):
    if accumulate:
        out[i] += alpha * a
    else:
        out[i] = alpha * a


@intrinsic
def _f32_bits(typingctx, v):
    """float32 -> its int32 bit pattern (bitcast)."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, v):
    """int32 bit pattern -> float32 (bitcast)."""
    if v != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, inline="always", fastmath={"reassoc", "contract"})
def _fold_absmax(sg, x, xs):
    # sg (m,) u16 f16 scales, x (m,) f32 -> xs (m,) = sg * x; returns max |xs| (an integer max of
    # the bit patterns: vectorises, and a NaN wins, so it propagates)
    mi = np.int32(0)
    for k in range(x.shape[0]):
        v = to_f32(sg[k]) * x[k]
        xs[k] = v
        mi = max(mi, np.int32(_f32_bits(v) & np.int32(0x7FFFFFFF)))
    return _bits_f32(mi)


@njit(cache=True, inline="always")
def _absmax(x):
    # max |x| (m,) f32, as _fold_absmax: an integer max of the bit patterns (vectorises; a NaN wins)
    mi = np.int32(0)
    for k in range(x.shape[0]):
        mi = max(mi, np.int32(_f32_bits(x[k]) & np.int32(0x7FFFFFFF)))
    return _bits_f32(mi)


@njit(cache=True, inline="always")
def _quant_i8(xs, inv, x8):
    # xs (m,) f32 -> x8 (m,) = round(xs * inv) as int8 (|.| <= 127); returns their sum
    tot = np.int32(0)
    for k in range(xs.shape[0]):
        a = _round(xs[k] * inv)
        x8[k] = np.int8(a)
        tot = np.int32(tot + a)
    return tot


@njit(cache=True, inline="always")
def _quant_i16(xs, inv, x16):
    # xs (m,) f32 -> x16 (m,) = round(xs * inv) as int16
    for k in range(xs.shape[0]):
        x16[k] = np.int16(_round(xs[k] * inv))


@njit(cache=True, inline="always")
def act_chunk_q4(sg, x, xs, x8, h, k0, k1):
    # packed columns k0..k1 (and k0+h..k1+h) of one group's activations: xs = sg * x, x8 = round(xs / c)
    # with c = max|xs| / 127; returns (c, 8 * sum(x8)), the scale and the nibbles' offset. Decode and
    # prefill (kernels/gemm) both round with this, so their results are identical
    m = max(_fold_absmax(sg[k0:k1], x[k0:k1], xs[k0:k1]),
            _fold_absmax(sg[k0 + h:k1 + h], x[k0 + h:k1 + h], xs[k0 + h:k1 + h]))
    c = m / np.float32(127.0) if m > 0 else np.float32(1.0)
    inv = np.float32(1.0) / c
    tot = _quant_i8(xs[k0:k1], inv, x8[k0:k1]) + _quant_i8(xs[k0 + h:k1 + h], inv, x8[k0 + h:k1 + h])
    return c, np.float32(8 * tot)


@njit(cache=True, inline="always")
def act_chunk_q8(sg, x, xs, x16, k0, k1):
    # columns k0..k1 of one group's activations: x16 = round(sg * x / c), c = max|sg * x| / X16_MAX; returns c
    m = _fold_absmax(sg[k0:k1], x[k0:k1], xs[k0:k1])
    c = m / np.float32(X16_MAX) if m > 0 else np.float32(1.0)
    _quant_i16(xs[k0:k1], np.float32(1.0) / c, x16[k0:k1])
    return c


assert Q4_CHUNK % Q4_STEP == 0 and Q8_CHUNK % Q8_STEP == 0   # chunks hold whole steps
ACT_GROUPS = 32     # row groups whose activations are rounded before their rows stream as one


@njit(cache=True, inline="always")
def _block_scratch(xi, aux, n):
    # xi (>= ACT_GROUPS*n,) i16 -> (ACT_GROUPS, n) i16, one activation row per group; aux's tail as i32 sums
    return xi[:ACT_GROUPS * n].reshape((ACT_GROUPS, n)), _sums_scratch(aux)


@by_reference          # the q4 matvec's row groups, under ~20 kernels: compiled once, not into each (model/numba_link)
@njit(cache=True, error_model="numpy")
def q4_groups_i8(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
    # q (d,n/2) u8 packed, s (d/G,n) u16 scales, x (n,) f32 -> out rows of groups g0..g1 = alpha * (q-8).(s[g]*x) (+=);
    # xs (n,) f32, xi (ACT_GROUPS*n,) i16, aux (>= 2*ACT_GROUPS*chunks + SUMS_MAX,) f32 scratch.
    # ACT_GROUPS groups at a time: their activations first, then their rows as one stream
    h = q.shape[1]
    n = 2 * h
    G = q.shape[0] // s.shape[0]
    x2, sums = _block_scratch(xi, aux, n)
    x8 = x2.view(np.int8)                                  # (ACT_GROUPS, 2n) i8: a group's x8 in [:n]
    nch = (h + Q4_CHUNK - 1) // Q4_CHUNK
    tail = h % Q4_CHUNK % Q4_STEP != 0                    # only the last chunk can end mid-step
    rows = max(1, SUMS_MAX // nch)
    for gb in range(g0, g1, ACT_GROUPS):
        ge = min(g1, gb + ACT_GROUPS)
        for g in range(gb, ge):
            j = g - gb
            for b in range(nch):
                k0 = b * Q4_CHUNK
                aux[2 * (j * nch + b)], aux[2 * (j * nch + b) + 1] = act_chunk_q4(
                    s[g], x, xs, x8[j], h, k0, min(h, k0 + Q4_CHUNK))
        end = ge * G
        for r0 in range(gb * G, end, rows):
            nr = min(rows, end - r0)
            jr0 = r0 - gb * G                              # row index within the block (x8[0] = group gb)
            _dot_u4_i8(q, x8, r0, nr, h, G, jr0, sums)
            for i in range(nr):
                ja = (jr0 + i) // G                        # group within the block
                acc = np.float32(0.0)
                for b in range(nch):
                    sm = sums[i * nch + b]
                    if tail:                               # a chunk's columns beyond its whole steps
                        k0 = b * Q4_CHUNK
                        k1 = min(h, k0 + Q4_CHUNK)
                        r = q[r0 + i]
                        xg = x8[ja]
                        for k in range(k0 + (k1 - k0) // Q4_STEP * Q4_STEP, k1):
                            u = np.int32(r[k])
                            sm += np.int32(u & 15) * np.int32(xg[k]) + np.int32(u >> 4) * np.int32(xg[k + h])
                    acc += aux[2 * (ja * nch + b)] * (np.float32(sm) - aux[2 * (ja * nch + b) + 1])
                _put(out, r0 + i, acc, alpha, accumulate)


@by_reference          # as q4_groups_i8, for q8
@njit(cache=True, error_model="numpy")
def q8_groups_i16(q, s, x, xs, xi, aux, out, g0, g1, alpha, accumulate):
    # q (d,n) i8, s (d/G,n) u16 scales, x (n,) f32 -> out rows of groups g0..g1 = alpha * q.(s[g]*x) (+=);
    # xs (n,) f32, xi (ACT_GROUPS*n,) i16, aux (>= ACT_GROUPS*chunks + SUMS_MAX,) f32 scratch; as q4_groups_i8
    n = q.shape[1]
    G = q.shape[0] // s.shape[0]
    x16, sums = _block_scratch(xi, aux, n)
    nch = (n + Q8_CHUNK - 1) // Q8_CHUNK
    tail = n % Q8_CHUNK % Q8_STEP != 0                    # only the last chunk can end mid-step
    rows = max(1, SUMS_MAX // nch)
    for gb in range(g0, g1, ACT_GROUPS):
        ge = min(g1, gb + ACT_GROUPS)
        for g in range(gb, ge):
            j = g - gb
            for b in range(nch):
                k0 = b * Q8_CHUNK
                aux[j * nch + b] = act_chunk_q8(s[g], x, xs, x16[j], k0, min(n, k0 + Q8_CHUNK))
        end = ge * G
        for r0 in range(gb * G, end, rows):
            nr = min(rows, end - r0)
            jr0 = r0 - gb * G
            _dot_i8_i16(q, x16, r0, nr, n, G, jr0, sums)
            for i in range(nr):
                ja = (jr0 + i) // G
                acc = np.float32(0.0)
                for b in range(nch):
                    sm = sums[i * nch + b]
                    if tail:
                        k0 = b * Q8_CHUNK
                        k1 = min(n, k0 + Q8_CHUNK)
                        r = q[r0 + i]
                        xg = x16[ja]
                        for k in range(k0 + (k1 - k0) // Q8_STEP * Q8_STEP, k1):
                            sm += np.int32(r[k]) * np.int32(xg[k])
                    acc += aux[ja * nch + b] * np.float32(sm)
                _put(out, r0 + i, acc, alpha, accumulate)


def act_error_bound(kind, q, s, x):
    """numpy: a bound on |integer kernel - exact dequantized matvec| per row, from the
    activation rounding (half a step of each chunk's scale times |value| summed)."""
    from .packing import unpack_q4
    d = q.shape[0]
    G = d // s.shape[0]
    sf = s.view(np.float16).astype(np.float64)
    xs = sf * np.asarray(x, np.float64)[None, :]                     # (d/G, n)
    v = np.abs(unpack_q4(q) if kind == "q4" else q).astype(np.float64)   # (d, n)
    n = xs.shape[1]
    step = np.zeros_like(xs)
    if kind == "q4":
        h = n // 2
        for k0 in range(0, h, Q4_CHUNK):
            k1 = min(h, k0 + Q4_CHUNK)
            cols = np.r_[k0:k1, k0 + h:k1 + h]
            step[:, cols] = np.abs(xs[:, cols]).max(axis=1, keepdims=True) / 127
    else:
        for k0 in range(0, n, Q8_CHUNK):
            cols = slice(k0, min(n, k0 + Q8_CHUNK))
            step[:, cols] = np.abs(xs[:, cols]).max(axis=1, keepdims=True) / X16_MAX
    return (v * np.repeat(step, G, axis=0)).sum(axis=1) * 0.5 * (1 + 1e-3)
