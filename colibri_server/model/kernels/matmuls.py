"""matmul: X (T,n) @ W.T for any weight kind (f32 to BLAS; f16/bf16/quantized converted tile by
tile to f32 for BLAS, or quantized through gemm's integer GEMM; T == 1 through the matvec kernels),
and matmul_par, its tiles split over a thread pool. Plain Python over the Numba kernels."""

from __future__ import annotations

from concurrent.futures import wait

import numpy as np

from . import gemm as _GEMM
from . import quant as _KQ
from .base import weights_to_f32
from .dense import matvec, panel_rows_to_f32, rows_to_f32


def matmul(X, W, out, scratch, tmp=None):
    """X (T,n) f32, W (d,n) any, a quant.QTensor or a panels.Panels -> out (T,d) f32 = X @ W.T.

    Plain Python. f32 weights go straight to BLAS; f16/bf16/quantized weights are
    converted tile by tile (``scratch`` (tile_rows, n) f32, e.g. 256 rows) and each
    tile is multiplied with BLAS into ``tmp`` (T, tile_rows) (allocated when not
    given), then copied into ``out[:, r0:r1]``. Quantized weights on AVX2 or AVX-512 VNNI take the
    integer GEMM of kernels/gemm instead (the same arithmetic as the matvec kernels). T == 1
    uses the matvec kernels (no
    conversion pass, streams the weights once; the quantized ones take their xs/xi scratch
    from the two ends of ``scratch``)."""
    T, n = X.shape
    q = getattr(W, "q", None)
    d = _check_shapes(X, W, out)
    if q is None and W.dtype == np.float32:
        np.matmul(X, W.T, out=out)
        return out
    pan = W.p if hasattr(W, "p") else None             # a matrix stored in panels
    if T == 1:
        if q is None:
            matvec(W if pan is None else pan, X[0], out[0])
        else:
            flat = scratch.reshape(-1)
            ni, nf = _KQ.xi_len(n), _KQ.scratch_len(n)
            if flat.size >= nf + ni // 2 + 1:
                xs, xi = flat[:nf], flat[-(ni // 2 + 1):].view(np.int16)[:ni]
            else:                                       # a scratch too small for both (tiny n)
                xs, xi = _KQ.scratch(n)
            _KQ.matvec_q(q, W.s, X[0], out[0], xs, xi)
        return out
    if q is not None and _GEMM.HAVE_GEMM:              # integer GEMM, no float tiles (kernels/gemm)
        (_GEMM.matmul_q4_i8 if q.dtype == np.uint8 else _GEMM.matmul_q8_i16)(q, W.s, X, out)
        return out
    _check_tile(scratch, n)
    return _tiles(X, W, out, scratch, tmp, 0, d)


def _check_shapes(X, W, out):
    """W's row count, after checking X (T,n) @ W (d,n).T -> out (T,d)."""
    q = getattr(W, "q", None)
    d = W.shape[0] if q is None else q.shape[0]
    if (W.shape[1] if q is None else W.s.shape[1]) != X.shape[1] or out.shape != (X.shape[0], d):
        raise ValueError(f"matmul shapes: X {X.shape}, W {W.shape}, out {out.shape}")
    return d


def _check_tile(scratch, n):
    if scratch.shape[0] < 1 or scratch.shape[1] != n:
        raise ValueError(f"matmul scratch shape {scratch.shape} for n={n}")


def _tiles(X, W, out, scratch, tmp, r_lo, r_hi):
    """out[:, r_lo:r_hi] = X @ W[r_lo:r_hi].T, W's rows converted to f32 scratch.shape[0] at a
    time from r_lo (f16/bf16 rows or panels, or a quantized matrix) and multiplied with BLAS."""
    T = X.shape[0]
    tile = scratch.shape[0]
    q = getattr(W, "q", None)
    pan = W.p if hasattr(W, "p") else None
    # numpy does not hand a column slice out[:, r0:r1] to sgemm (measured 2.4x
    # slower), so each tile goes through one contiguous (T, tile) temporary.
    if tmp is None or tmp.shape[1] < tile or tmp.shape[0] < T:
        tmp = np.empty((T, tile), np.float32)
    else:
        tmp = tmp.reshape(-1)[:T * tile].reshape(T, tile)
    for r0 in range(r_lo, r_hi, tile):
        r1 = min(r_hi, r0 + tile)
        rows = r1 - r0
        buf = scratch[:rows]
        if pan is not None:
            panel_rows_to_f32(pan, r0, r1, buf)
        elif q is None:
            rows_to_f32(W, r0, r1, buf)
        else:
            _KQ.rows_to_f32_q(q, W.s, r0, r1, buf)
        if rows == tile:
            np.matmul(X, buf.T, out=tmp)
            out[:, r0:r1] = tmp
        else:
            out[:, r0:r1] = np.matmul(X, buf.T)
    return out


def matmul_par(X, W, out, scratches, tmps, pool):
    """matmul of T > 1 rows X with a converted (non-f32) W, its tiles split in len(scratches)
    contiguous runs: the first on this thread, the others on `pool` (a concurrent.futures
    executor), each with its own tile scratch and temporary. Every tile is converted and
    multiplied exactly as matmul does it, so out has the same bits."""
    d = _check_shapes(X, W, out)
    n = X.shape[1]
    for sc in scratches:
        _check_tile(sc, n)
    tile = scratches[0].shape[0]
    ntiles = -(-d // tile)
    k = min(len(scratches), ntiles)
    bounds = [min(d, (ntiles * i // k) * tile) for i in range(k + 1)]
    futs = [pool.submit(_tiles, X, W, out, scratches[i], tmps[i], bounds[i], bounds[i + 1]) for i in range(1, k)]
    try:
        _tiles(X, W, out, scratches[0], tmps[0], bounds[0], bounds[1])
    finally:
        wait(futs)                       # every run done before anything returns or raises: none
    for f in futs:                       # may still write into the workspace afterwards
        f.result()
    return out


def matmul_ref(X, W, out=None):
    Wf = _KQ._dequant(W.q, W.s) if hasattr(W, "q") else weights_to_f32(W)
    r = (np.asarray(X, np.float64) @ Wf.astype(np.float64).T).astype(np.float32)
    if out is not None:
        out[...] = r
    return r
