"""Software prefetch of weight rows for the kernels that read them slowly (LLVM IR helper).

A kernel that multiplies each weight row into several rows of activations (kernels/rowgemm's
tile, kernels/gemm's micro-kernels) consumes its weights at a few bytes a cycle, and the
hardware prefetchers do not run far enough ahead of so slow a reader: on a 2-vCPU Zen 4
VM, one thread, 64 f16 expert matrices (2048 x 1024 panels) from DRAM, the 4 x 4 tile took
0.59 / 0.63 / 0.78 / 1.10 ms a matrix at 1 / 4 / 8 / 16 rows of X, where the one-row matvec
(27 GB/s) takes 0.16. Asking for the bytes AHEAD beyond the ones being read, into L2
(prefetcht1), gave 0.19 / 0.19 / 0.36 / 0.72. Distances tried: 2 KB 0.21 / 0.20 / 0.37 / 0.86,
8 KB 0.37 / 0.23 / 0.43 / 0.83; into L1 (prefetcht0) ~0.55 at 4 rows. The matvecs stream fast
enough on their own and take none: the q4 decode matvec with it (4 KB ahead) made the fused q4
token on one thread slower, ~8.5 ms against ~6.0 in three alternations.

A prefetch never faults, so running past the end of an array is harmless.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

__all__ = ["AHEAD", "prefetch_ahead"]

AHEAD = 4096        # bytes


def prefetch_ahead(builder, rows, offset, ahead=AHEAD):
    """Prefetch, into L2, each of `rows` (pointers to the weight rows being read) at byte `offset`
    (an i64 value) + `ahead`."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer()] + [i32] * 3),
                                        "llvm.prefetch.p0i8")
    at = builder.add(offset, ir.Constant(offset.type, ahead))
    for r in rows:
        p = builder.gep(builder.bitcast(r, i8.as_pointer()), [at])
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])   # read, L2, data
