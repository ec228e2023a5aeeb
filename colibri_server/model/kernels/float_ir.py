"""The f16 and bf16 decode matvec as LLVM IR: the whole row loop in one intrinsic, for
row-major matrices and for matrices stored in panels (panels.py).

Numba's own loop (dense._matvec_core) vectorises each row as 4 x 16 lanes, converts with
`vcvtph2ps` (f16) or a zero-extend and shift (bf16) and FMAs with x; here the same
arithmetic (the same 4 accumulators and the same order of sums, so the bits match) runs
with the row loop in IR and 4 steps of 64 columns unrolled. Measured on this Zen 4 VM, the
f16 expert matrices of bench-mixtral streamed from DRAM at 23.0-24.0 GB/s with Numba's loop
and 24.6-25.1 GB/s with this one (3 rounds, one process). It needs AVX-512 and rows of a
multiple of STEP columns; dense.matvec falls back to the Numba loop otherwise.

Panels (nb, d, PANEL): x's PANEL columns of one panel sit in 16 zmm registers while the d rows
of the panel stream by, 4 accumulators per row, one horizontal sum per row and panel added
into out. No x load in the row loop: the expert matrices of bench-mixtral streamed at 28.9-30.1
GB/s this way against 26.4-27.9 row-major (anonymous copies of both, one process, 4 rounds).

AVX2 without AVX-512 (Zen 3, Intel client cores; HAVE_FLOAT_IR8): the same loops on ymm registers,
8 lanes, NACC8 accumulators, steps of STEP8 = 32 columns, x read from L1. A single row stream reads far
below what one core can fetch there, so STREAMS8 rows 1/STREAMS8 of the matrix apart are interleaved step
by step (split_rows; panels: within each panel). Measured on a Zen 3 VM, bench-mixtral's expert
matrices from DRAM, one thread, kernels alternating matrix by matrix: with 4 streams x 4 accumulators,
bf16 rows 13.1-13.7 GB/s against 9.1-9.8 with Numba's loop, f16 panels 14.9-15.1 against 11.6-13.4
(6 x 2, the constants below, streams a few percent faster again). Each row's sum has one fixed order
(its own accumulators, a fixed lane tree), so a row gives the same bits in any slice of the matrix
and in a stack of matrices (q|k|v in one call, float_rows_stack).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..format import PANEL
from .cpu import FEATURES as _FEATURES
from .quant_ir import split_rows

__all__ = ["HAVE_FLOAT_IR", "HAVE_FLOAT_IR8", "STEP", "STEP8", "STREAMS8", "float_rows", "float_rows_stack"]

HAVE_FLOAT_IR = {"avx512f", "f16c"} <= _FEATURES
STEP = 64            # columns per step: 4 accumulators of 16 f32 lanes
# AVX2 without AVX-512 (Zen 3, Haswell..Alder Lake): the same loops on ymm registers
HAVE_FLOAT_IR8 = not HAVE_FLOAT_IR and {"avx2", "fma", "f16c"} <= _FEATURES
STEP8 = 32           # columns per step there (4 vectors of 8 f32 lanes)
# Rows streamed at once there (far apart: kernels/quant_ir.split_rows) and accumulators per row, measured
# on a Zen 3 VM: bench-mixtral's f16 expert matrices (panels) from DRAM, one thread, kernels alternating
# matrix by matrix, w1 and w2 in two runs: 4 rows x 4 accumulators 19.8-20.5 GB/s (3 of them spill),
# 4 x 2 19.9-20.4, 5 x 2 20.4-21.1, 6 x 2 20.5-21.2, 6 x 4 20.4-20.9, 8 x 2 18.9-20.4.
STREAMS8 = 6
NACC8 = 2


def _widen(builder, raw, bf16, lanes=32):
    """<lanes x i16> weights -> <lanes x float>: f16 by fpext (vcvtph2ps), bf16 by zext and shift."""
    f32 = ir.FloatType()
    if bf16:
        wide = builder.zext(raw, ir.VectorType(ir.IntType(32), lanes))
        wide = builder.shl(wide, ir.Constant(wide.type, [ir.Constant(ir.IntType(32), 16)] * lanes))
        return builder.bitcast(wide, ir.VectorType(f32, lanes))
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(f32, lanes))


def _unpack(context, builder, signature, args):
    """(W, x, out, alpha, accumulate) of a kernel: the three arrays' structs, alpha, the flag as
    an i1, and the llvm.fma / vector.reduce.fadd declarations for <16 x float>."""
    wa, xa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in range(3))
    acc_flag = context.cast(builder, args[4], signature.args[4], types.boolean)
    vf = ir.VectorType(ir.FloatType(), 16)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v16f32")
    fadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), vf]),
                                          "llvm.vector.reduce.fadd.v16f32")
    return wa, xa, oa, args[3], acc_flag, fma, fadd


def _make_rows(bf16):
    @intrinsic
    def rows(typingctx, W, x, out, alpha, accumulate):
        # W (d,n) 16-bit weights (n a multiple of STEP), x (n,) f32 -> out[i] = alpha * W[i] @ x (+= if accumulate)
        sig = types.void(W, x, out, alpha, accumulate)

        def codegen(context, builder, signature, args):
            wa, xa, oa, alpha_v, acc_flag, fma, fadd = _unpack(context, builder, signature, args)
            f32, i16, idx = ir.FloatType(), ir.IntType(16), ir.IntType(64)
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 32)
            d, n = cgutils.unpack_tuple(builder, wa.shape, 2)
            wstride = cgutils.unpack_tuple(builder, wa.strides, 2)[0]
            wbase = builder.bitcast(wa.data, ir.IntType(8).as_pointer())
            xbase = builder.bitcast(xa.data, f32.as_pointer())
            obase = builder.bitcast(oa.data, f32.as_pointer())
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(4)]
            halves = [ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(h * 16, h * 16 + 16))) for h in (0, 1)]
            nsteps = builder.sdiv(n, ir.Constant(idx, STEP))
            with cgutils.for_range(builder, d) as rows_:
                row = builder.bitcast(builder.gep(wbase, [builder.mul(rows_.index, wstride)]), i16.as_pointer())
                for a in accs:
                    builder.store(ir.Constant(vf, None), a)
                with cgutils.for_range(builder, nsteps) as it:
                    k = builder.mul(it.index, ir.Constant(idx, STEP))
                    for p in range(2):                       # 2 x 32 weights
                        kp = builder.add(k, ir.Constant(idx, 32 * p))
                        raw = builder.load(builder.bitcast(builder.gep(row, [kp]), vi.as_pointer()), align=2)
                        wide = _widen(builder, raw, bf16)
                        for h in range(2):
                            part = builder.shuffle_vector(wide, wide, halves[h])
                            xv = builder.load(builder.bitcast(builder.gep(xbase, [builder.add(kp, ir.Constant(idx, 16 * h))]),
                                                              vf.as_pointer()), align=4)
                            a = accs[2 * p + h]
                            builder.store(builder.call(fma, [part, xv, builder.load(a)]), a)
                tot = builder.load(accs[0])
                for a in accs[1:]:
                    tot = builder.fadd(tot, builder.load(a))
                dot = builder.fmul(alpha_v, builder.call(fadd, [ir.Constant(f32, 0.0), tot], fastmath=("reassoc",)))
                dst = builder.gep(obase, [rows_.index])
                with builder.if_then(acc_flag):
                    builder.store(builder.fadd(builder.load(dst), dot), dst)
                with builder.if_then(builder.not_(acc_flag)):
                    builder.store(dot, dst)
            return context.get_dummy_value()
        return sig, codegen
    return rows


_rows_f16 = _make_rows(False)
_rows_bf16 = _make_rows(True)


def _make_panels(bf16):
    @intrinsic
    def panels(typingctx, W, x, out, alpha, accumulate):
        # W (nb,d,PANEL) 16-bit weights (rows contiguous), x (nb*PANEL,) f32 -> out[i] = alpha * sum_b W[b,i] @ x_b
        # (+= if accumulate); panel by panel, out[i] collects one partial sum per panel
        sig = types.void(W, x, out, alpha, accumulate)

        def codegen(context, builder, signature, args):
            wa, xa, oa, alpha_v, acc_flag, fma, fadd = _unpack(context, builder, signature, args)
            f32, i16, i8, idx = ir.FloatType(), ir.IntType(16), ir.IntType(8), ir.IntType(64)
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 32)
            nb, d, _ = cgutils.unpack_tuple(builder, wa.shape, 3)
            pstride, rstride, _ = cgutils.unpack_tuple(builder, wa.strides, 3)
            wbase = builder.bitcast(wa.data, i8.as_pointer())
            xbase = builder.bitcast(xa.data, f32.as_pointer())
            obase = builder.bitcast(oa.data, f32.as_pointer())
            halves = [ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(h * 16, h * 16 + 16))) for h in (0, 1)]
            zero = ir.Constant(f32, 0.0)
            with cgutils.for_range(builder, nb) as pan:
                x0 = builder.mul(pan.index, ir.Constant(idx, PANEL))
                xs = [builder.load(builder.bitcast(builder.gep(xbase, [builder.add(x0, ir.Constant(idx, 16 * k))]),
                                                   vf.as_pointer()), align=4) for k in range(PANEL // 16)]
                fresh = builder.and_(builder.icmp_unsigned("==", pan.index, ir.Constant(idx, 0)), builder.not_(acc_flag))
                pbase = builder.gep(wbase, [builder.mul(pan.index, pstride)])
                with cgutils.for_range(builder, d) as rows_:
                    row = builder.bitcast(builder.gep(pbase, [builder.mul(rows_.index, rstride)]), i16.as_pointer())
                    accs = [ir.Constant(vf, None)] * 4
                    for s in range(PANEL // 32):
                        raw = builder.load(builder.bitcast(builder.gep(row, [ir.Constant(idx, 32 * s)]), vi.as_pointer()),
                                           align=2)
                        wide = _widen(builder, raw, bf16)
                        for h in range(2):
                            k = 2 * s + h
                            accs[k % 4] = builder.call(fma, [builder.shuffle_vector(wide, wide, halves[h]), xs[k],
                                                             accs[k % 4]])
                    tot = builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3]))
                    dot = builder.fmul(alpha_v, builder.call(fadd, [zero, tot], fastmath=("reassoc",)))
                    dst = builder.gep(obase, [rows_.index])
                    prev = builder.select(fresh, zero, builder.load(dst))
                    builder.store(builder.fadd(prev, dot), dst)
            return context.get_dummy_value()
        return sig, codegen
    return panels


_panels_f16 = _make_panels(False)
_panels_bf16 = _make_panels(True)


# ---------------------------------------------------------------------------- AVX2 (ymm)

# Numba's fastmath pass gives every float add/mul without flags its caller's flags (reassoc, contract),
# and then LLVM may regroup a sum differently in each caller, or fuse a product into an add. The AVX2
# kernels' adds and multiplies carry "nsz" (which changes no finite result) so that they keep their order
# and rounding wherever they are inlined: a row's result never depends on its neighbours or the caller.
_EXACT = ("nsz",)


def _lane_sum8(builder, v):
    """The 8 lanes of a <8 x float> summed in a fixed order: (l0+l4) + (l2+l6) ... as a halving tree."""
    i32 = ir.IntType(32)
    for width in (4, 2, 1):
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
        v = builder.fadd(lo, hi, flags=_EXACT)
    return builder.extract_element(v, ir.Constant(i32, 0))


def _dots8(builder, rows8, xp, nsteps, fma, bf16, accs):
    """Add the products of 16-bit rows (i8* each) with f32 x (float*) over nsteps steps of STEP8 columns
    into accs[row][j % nacc] (nacc = 2 or 4 <8 x float> accumulators per row: step s adds columns
    32s + 8j into the (j % nacc)-th), the rows interleaved step by step. Returns each row's sum of its
    accumulators, (a0 + a1) or (a0 + a1) + (a2 + a3)."""
    f32, i16, idx = ir.FloatType(), ir.IntType(16), ir.IntType(64)
    vf, vi = ir.VectorType(f32, 8), ir.VectorType(i16, 8)
    rows = [builder.bitcast(r, i16.as_pointer()) for r in rows8]
    for a in accs[:len(rows)]:
        for v in a:
            builder.store(ir.Constant(vf, None), v)
    with cgutils.for_range(builder, nsteps) as it:
        k = builder.mul(it.index, ir.Constant(idx, STEP8))
        for j in range(4):
            kj = builder.add(k, ir.Constant(idx, 8 * j))
            xv = builder.load(builder.bitcast(builder.gep(xp, [kj]), vf.as_pointer()), align=4)
            for row, a in zip(rows, accs):
                raw = builder.load(builder.bitcast(builder.gep(row, [kj]), vi.as_pointer()), align=2)
                t = a[j % len(a)]
                builder.store(builder.call(fma, [_widen(builder, raw, bf16, 8), xv, builder.load(t)]), t)
    out = []
    for a in accs[:len(rows)]:
        v = [builder.load(t) for t in a]
        while len(v) > 1:
            v = [builder.fadd(v[i], v[i + 1], flags=_EXACT) for i in range(0, len(v), 2)]
        out.append(v[0])
    return out


def _codegen8(context, builder, signature, args, panels, bf16, streams, nacc):
    """The AVX2 matvec of (W, x, out, alpha, accumulate): W (d,n) rows, or (nb,d,PANEL) panels taken
    panel by panel, or a tuple of such matrices of one n whose rows are stacked (out holds the first's
    rows, then the second's, ...: q|k|v in one call); `streams` rows at once (split_rows) over all the
    rows, each row's dot = alpha * lane sum of its partials, stored, or added to out (+= if accumulate;
    panels after the first always add)."""
    wty = signature.args[0]
    if isinstance(wty, types.BaseTuple):
        mats = [context.make_array(t)(context, builder, v)
                for t, v in zip(wty.types, cgutils.unpack_tuple(builder, args[0], len(wty.types)))]
    else:
        mats = [context.make_array(wty)(context, builder, args[0])]
    xa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (1, 2))
    acc_flag = context.cast(builder, args[4], signature.args[4], types.boolean)
    f32, i8, idx = ir.FloatType(), ir.IntType(8), ir.IntType(64)
    vf, zero = ir.VectorType(f32, 8), ir.Constant(f32, 0.0)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v8f32")
    xbase = builder.bitcast(xa.data, f32.as_pointer())
    obase = builder.bitcast(oa.data, f32.as_pointer())
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(nacc)] for _ in range(streams)]
    nd = 3 if panels else 2
    shapes = [cgutils.unpack_tuple(builder, m.shape, nd) for m in mats]
    strides = [cgutils.unpack_tuple(builder, m.strides, nd) for m in mats]
    d_axis = 1 if panels else 0
    starts = [ir.Constant(idx, 0)]                    # each matrix's first row in the stacked rows
    for sh in shapes:
        starts.append(builder.add(starts[-1], sh[d_axis]))

    def matrix(bases, xp, nsteps, add):               # out[i] (+)= alpha * row i @ x over the stacked rows
        def rowptr(r):                                 # the row's i8*: the matrix it falls in, by selects
            k = len(mats) - 1
            ptr = builder.gep(bases[k], [builder.mul(builder.sub(r, starts[k]), strides[k][d_axis])])
            for k in range(len(mats) - 2, -1, -1):
                mine = builder.gep(bases[k], [builder.mul(builder.sub(r, starts[k]), strides[k][d_axis])])
                ptr = builder.select(builder.icmp_signed("<", r, starts[k + 1]), mine, ptr)
            return ptr

        def body(rs):
            tots = _dots8(builder, [rowptr(r) for r in rs], xp, nsteps, fma, bf16, accs)
            for r, tot in zip(rs, tots):
                dot = builder.fmul(args[3], _lane_sum8(builder, tot), flags=_EXACT)
                dst = builder.gep(obase, [r])
                builder.store(builder.fadd(builder.select(add, builder.load(dst), zero), dot, flags=_EXACT), dst)
        split_rows(builder, starts[-1], body, streams)

    bases = [builder.bitcast(m.data, i8.as_pointer()) for m in mats]
    if panels:
        with cgutils.for_range(builder, shapes[0][0]) as pan:
            add = builder.or_(builder.icmp_unsigned("!=", pan.index, ir.Constant(idx, 0)), acc_flag)
            matrix([builder.gep(b, [builder.mul(pan.index, st[0])]) for b, st in zip(bases, strides)],
                   builder.gep(xbase, [builder.mul(pan.index, ir.Constant(idx, PANEL))]),
                   ir.Constant(idx, PANEL // STEP8), add)
    else:
        matrix(bases, xbase, builder.sdiv(shapes[0][1], ir.Constant(idx, STEP8)), acc_flag)
    return context.get_dummy_value()


def _make8(panels, bf16, streams=STREAMS8, nacc=NACC8):
    @intrinsic
    def kernel(typingctx, W, x, out, alpha, accumulate):
        # rows: W (d,n) 16-bit weights (rows contiguous, n a multiple of STEP8); panels: W (nb,d,PANEL);
        # or a tuple of either with one n (rows stacked); x (n,) f32 -> out[i] = alpha * W[i] @ x (+= if accumulate)
        return (types.void(W, x, out, alpha, accumulate),
                lambda c, b, s, a: _codegen8(c, b, s, a, panels, bf16, streams, nacc))
    return kernel


_rows8 = {bf: _make8(False, bf) for bf in (False, True)}
_panels8 = {bf: _make8(True, bf) for bf in (False, True)}


def float_rows(W, x, out, alpha, accumulate):
    """Python stand-in (never called): Numba picks the overload below by W's type."""
    raise NotImplementedError


@overload(float_rows)
def _float_rows_overload(W, x, out, alpha, accumulate):
    # returns True when an IR kernel did the work: 16-bit weights with contiguous rows of whole steps
    # (a row slice W[r0:r1] too); or 16-bit panels (nb,d,PANEL) whose rows are contiguous (W[:, r0:r1] too).
    # AVX-512: the zmm kernels above; AVX2 (HAVE_FLOAT_IR8): the ymm kernels, STREAMS8 rows at once
    ok = ((HAVE_FLOAT_IR or HAVE_FLOAT_IR8) and isinstance(W, types.Array)
          and isinstance(x, types.Array) and x.layout == "C" and x.dtype == types.float32
          and isinstance(out, types.Array) and out.dtype == types.float32
          and W.dtype in (types.uint16, types.int16))
    bf16 = ok and W.dtype == types.int16
    if ok and W.ndim == 3:
        pkernel = (_panels_bf16 if bf16 else _panels_f16) if HAVE_FLOAT_IR else _panels8[bf16]

        def pimpl(W, x, out, alpha, accumulate):
            if (W.shape[2] != PANEL or W.strides[2] != 2
                    or x.shape[0] < W.shape[0] * PANEL or out.shape[0] < W.shape[1]):
                return False
            pkernel(W, x, out, np.float32(alpha), accumulate)
            return True
        return pimpl
    if not (ok and W.ndim == 2):
        return lambda W, x, out, alpha, accumulate: False
    kernel = (_rows_bf16 if bf16 else _rows_f16) if HAVE_FLOAT_IR else _rows8[bf16]
    step = STEP if HAVE_FLOAT_IR else STEP8

    def impl(W, x, out, alpha, accumulate):
        if (W.shape[1] % step != 0 or W.shape[1] == 0 or W.strides[1] != 2
                or x.shape[0] < W.shape[1] or out.shape[0] < W.shape[0]):
            return False
        kernel(W, x, out, np.float32(alpha), accumulate)
        return True
    return impl


def float_rows_stack(Ws, x, out, alpha, accumulate):
    """Python stand-in (never called): Numba picks the overload below by the tuple's type."""
    raise NotImplementedError


@overload(float_rows_stack)
def _float_rows_stack_overload(Ws, x, out, alpha, accumulate):
    # returns True when the AVX2 kernel did the work on the stacked rows of a tuple of 16-bit matrices of
    # one type and one n (all row-major, or all panels): q|k|v in one call, their rows streamed together
    ok = (HAVE_FLOAT_IR8 and isinstance(Ws, types.UniTuple) and isinstance(Ws.dtype, types.Array)
          and Ws.dtype.dtype in (types.uint16, types.int16) and Ws.dtype.ndim in (2, 3)
          and isinstance(x, types.Array) and x.layout == "C" and x.dtype == types.float32
          and isinstance(out, types.Array) and out.dtype == types.float32)
    if not ok:
        return lambda Ws, x, out, alpha, accumulate: False
    panels = Ws.dtype.ndim == 3
    kernel = (_panels8 if panels else _rows8)[Ws.dtype.dtype == types.int16]

    def impl(Ws, x, out, alpha, accumulate):
        rows = 0
        for W in Ws:
            if panels:
                if W.shape[0] != Ws[0].shape[0] or W.shape[2] != PANEL or W.strides[2] != 2:
                    return False
                rows += W.shape[1]
            else:
                if W.shape[1] != Ws[0].shape[1] or W.shape[1] % STEP8 != 0 or W.shape[1] == 0 or W.strides[1] != 2:
                    return False
                rows += W.shape[0]
        n = Ws[0].shape[0] * PANEL if panels else Ws[0].shape[1]
        if x.shape[0] < n or out.shape[0] < rows:
            return False
        kernel(Ws, x, out, np.float32(alpha), accumulate)
        return True
    return impl
