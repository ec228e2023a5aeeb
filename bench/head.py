"""The output head's product alone: a block-kind head on its input rounded to int8 (llama.cpp's, exact_head false)
against the int16 rounding (the default, kernels/blocks_wide), at 1, 4 and 16 activation rows, one thread.

    python bench/head.py [--kinds Q8_0 Q6_K] [--rows 1 4 16] [--shape 32000 1024]

Random weights of a real head's shape: Q8_0 49152 x 576 (SmolLM2-135M's tied head), the others 32000 x 1024
(bench-mixtral's Q6_K head). Prints the median time of each (ms), their ratio (>= 1: the int16 head as fast)
and the largest error of each against the float64 product of the dequantized weights. The machine must be quiet.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from blocks_data import quantized  # noqa: E402

from colibri_server.model.kernels import blocks as KB  # noqa: E402
from colibri_server.model.kernels import blocks_gemm as KG  # noqa: E402

SHAPES = {"Q8_0": (49152, 576)}


def timed(f, *args, reps=20) -> float:
    f(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["Q8_0", "Q6_K"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--shape", type=int, nargs=2, metavar=("D", "N"), help="every kind's head shape (d rows of n)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for name in a.kinds:
        kind = gguf.GGMLQuantizationType[name]
        d, n = a.shape or SHAPES.get(name, (32000, 1024))
        raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=1)
        for T in a.rows:
            X = rng.standard_normal((T, n)).astype(np.float32)
            Xq, Xd, Xs = np.zeros((T, 2 * n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
            tmp = np.zeros(KG.scratch_words(n), np.float32)
            o8, o16 = np.zeros((T, d), np.float32), np.zeros((T, d), np.float32)
            t8 = timed(KG.matmul_blocks, raw, int(kind), X, o8, Xq[:, :n], Xd, Xs, tmp, np.float32(1), False)
            t16 = timed(KG.matmul_blocks, raw, int(kind) + KB.ACTS16, X, o16, Xq, Xd, Xs, tmp, np.float32(1), False)
            ref = KB.matmul_blocks_ref(raw[:2000], int(kind), X)
            e8, e16 = np.abs(o8[:, :2000] - ref).max(), np.abs(o16[:, :2000] - ref).max()
            print(f"{name} {d}x{n}, {T} row(s): int8 {t8:.2f} ms, int16 {t16:.2f} ms, ratio {t8 / t16:.3f}; "
                  f"largest error int8 {e8:.2e}, int16 {e16:.2e}", flush=True)


if __name__ == "__main__":
    main()
