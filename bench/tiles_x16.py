"""Q4_K or Q6_K matrices as the GGUF's rows against the same blocks stored as 16-row tiles (q4_k_x16, q6_k_x16), in
process, one thread.

    python bench/tiles_x16.py [--kind q4_k|q6_k] [--matrices 64] [--rows 1 4 8 16 32 48 100] [--shape 2048 1024]

Each matrix is random blocks of the kind (finite d and dmin) of the given shape; --matrices of them are cycled through, so 1
keeps one in L2 and 64 (75 MB at 2048 x 1024) reads them from memory, as a serving step's experts are read. For each
count of activation rows, ms a matrix through blocks_gemm.gemm_rows for the rows (panels laid out per call, or
the row dots at one row) and for the tiles (kernels/blocks_x16, or their panels from X16_PANEL_MIN_ROWS), best of
three alternations, and the ratio. The machine must be quiet; take the ratios, not the times.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri_server.model.kernels import blocks_gemm as G
from colibri_server.model.kernels.blocks import BLOCK, Q4_K, Q6_K, X16, round_rows, to_x16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["q4_k", "q6_k"], default="q4_k")
    ap.add_argument("--matrices", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 100])
    ap.add_argument("--shape", type=int, nargs=2, default=[2048, 1024])
    a = ap.parse_args()
    d, n = a.shape
    M = a.matrices
    rng = np.random.default_rng(0)
    base = Q4_K if a.kind == "q4_k" else Q6_K
    size = BLOCK[base][1]
    rows = rng.integers(0, 256, (M, d, n // 256 * size), dtype=np.uint8)
    blocks = rows.reshape(M, d, n // 256, size)
    if base == Q4_K:
        blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)       # d
        blocks[..., 2:4] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)      # dmin
    else:
        blocks[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)   # d
    tiles = np.stack([to_x16(rows[i], size) for i in range(M)])
    tmp = np.zeros(G.scratch_words(n), np.float32)
    reps = max(M, 8)
    print(f"{M} matrices {d} x {n} {a.kind.upper()} ({rows.nbytes / 1e6:.0f} MB), one thread, ms a matrix")
    for T in a.rows:
        X = rng.standard_normal((T, n)).astype(np.float32)
        Xq, Xd, Xs = np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
        round_rows(base, X, Xq, Xd, Xs)
        out = np.zeros((T, d), np.float32)
        best = {}
        for name, W, kind in [("rows", rows, base), ("tiles", tiles, base + X16)] * 3:
            t0 = time.perf_counter()
            for i in range(reps):
                G.gemm_rows(W[i % M], kind, X, Xq, Xd, Xs, out, tmp, np.int64(0), d, np.float32(1.0), np.bool_(False))
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / reps * 1e3)
        print(f"{T:4d} rows: {a.kind.upper()} rows {best['rows']:.4f}  tiles {best['tiles']:.4f}  "
              f"({best['rows'] / best['tiles']:.2f}x)")


if __name__ == "__main__":
    main()
