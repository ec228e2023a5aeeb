"""The f16 and bf16 decode matvec as LLVM IR: the whole row loop in one intrinsic, for
row-major matrices and for matrices stored in panels (panels.py).

Numba's own loop (kernels._matvec_core) vectorises each row as 4 x 16 lanes, converts with
`vcvtph2ps` (f16) or a zero-extend and shift (bf16) and FMAs with x; here the same
arithmetic (the same 4 accumulators and the same order of sums, so the bits match) runs
with the row loop in IR and 4 steps of 64 columns unrolled. Measured on this Zen 4 VM, the
f16 expert matrices of bench-mixtral streamed from DRAM at 23.0-24.0 GB/s with Numba's loop
and 24.6-25.1 GB/s with this one (3 rounds, one process). It needs AVX-512 and rows of a
multiple of STEP columns; kernels.matvec falls back to the Numba loop otherwise.

Panels (nb, d, PANEL): x's PANEL columns of one panel sit in 16 zmm registers while the d rows
of the panel stream by, 4 accumulators per row, one horizontal sum per row and panel added
into out. No x load in the row loop: the expert matrices of bench-mixtral streamed at 28.9-30.1
GB/s this way against 26.4-27.9 row-major (anonymous copies of both, one process, 4 rounds).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .kernels_simd import _FEATURES

from .format import PANEL

__all__ = ["HAVE_FLOAT_IR", "STEP", "float_rows"]

HAVE_FLOAT_IR = {"avx512f", "f16c"} <= _FEATURES
STEP = 64            # columns per step: 4 accumulators of 16 f32 lanes


def _widen(builder, raw, bf16):
    """<32 x i16> weights -> <32 x float>: f16 by fpext (vcvtph2ps), bf16 by zext and shift."""
    f32 = ir.FloatType()
    if bf16:
        wide = builder.zext(raw, ir.VectorType(ir.IntType(32), 32))
        wide = builder.shl(wide, ir.Constant(wide.type, [ir.Constant(ir.IntType(32), 16)] * 32))
        return builder.bitcast(wide, ir.VectorType(f32, 32))
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 32)), ir.VectorType(f32, 32))


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


def float_rows(W, x, out, alpha, accumulate):
    """Python stand-in (never called): Numba picks the overload below by W's type."""
    raise NotImplementedError


@overload(float_rows)
def _float_rows_overload(W, x, out, alpha, accumulate):
    # returns True when the IR kernel did the work: 16-bit C-contiguous weights, rows of whole
    # steps; or 16-bit panels (nb,d,PANEL) whose rows are contiguous (a row slice W[:, r0:r1] too)
    ok = (HAVE_FLOAT_IR and isinstance(W, types.Array)
          and isinstance(x, types.Array) and x.layout == "C" and x.dtype == types.float32
          and isinstance(out, types.Array) and out.dtype == types.float32)
    if ok and W.ndim == 3 and W.dtype in (types.uint16, types.int16):
        pkernel = _panels_f16 if W.dtype == types.uint16 else _panels_bf16

        def pimpl(W, x, out, alpha, accumulate):
            if (W.shape[2] != PANEL or W.strides[2] != 2
                    or x.shape[0] < W.shape[0] * PANEL or out.shape[0] < W.shape[1]):
                return False
            pkernel(W, x, out, np.float32(alpha), accumulate)
            return True
        return pimpl
    ok = ok and W.ndim == 2 and W.layout == "C"
    if ok and W.dtype == types.uint16:
        kernel = _rows_f16
    elif ok and W.dtype == types.int16:
        kernel = _rows_bf16
    else:
        return lambda W, x, out, alpha, accumulate: False

    def impl(W, x, out, alpha, accumulate):
        if W.shape[1] % STEP != 0 or W.shape[1] == 0 or x.shape[0] < W.shape[1] or out.shape[0] < W.shape[0]:
            return False
        kernel(W, x, out, np.float32(alpha), accumulate)
        return True
    return impl
