"""The serving step in process: BatchEngine.step time at B decoding sequences, beside the fused one-token decode.

    python bench/step.py MODEL.colibri [--threads 2] [--batch 1 4 8 16 32] [--no-exact-head]

For each B: B requests of 32 random prompt tokens join one engine (kv f16, the server's defaults for
max_batch_tokens), their prompts are prefilled, then 8 decode steps of B rows each are timed. Prints ms
per step, tok/s and the ratio to the fused single-stream decode (Model.decode) of the same process.
No llama.cpp here: bench/serve.py is the end-to-end comparison; this isolates the engine (what
the batched kernels and the one-call MoE were measured with). The machine must be quiet.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri_server.model import Model
from colibri_server.model.serving import BatchEngine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-exact-head", action="store_true", help="a block-kind head on llama.cpp's int8 rounding")
    a = ap.parse_args()
    m = Model.open(a.model, populate=True, context=1024)
    m.set_exact_head(not a.no_exact_head)
    if a.threads > 1:
        m.set_threads(a.threads)
    rng = np.random.default_rng(0)
    V = m.config.vocab_size
    cache = m.new_cache(256)
    m.prefill(cache, rng.integers(3, V, 32))
    for _ in range(3):
        m.decode(cache, 5)
    t0 = time.perf_counter()
    for _ in range(16):
        m.decode(cache, 5)
    fused = (time.perf_counter() - t0) / 16
    print(f"fused decode, {a.threads} thread(s): {fused * 1e3:.1f} ms/token = {1 / fused:.1f} tok/s")
    for B in a.batch:
        eng = BatchEngine(m, max_seqs=B, max_batch_tokens=256, kv_dtype="f16")
        for i in range(B):
            eng.add(i, rng.integers(3, V, 32).tolist(), max_tokens=a.steps + 32, ignore_eos=True)
        while eng.sched.waiting or any(s.pending > 1 for s in eng.sched.running):
            eng.step()
        for _ in range(2):
            eng.step()
        t0, n = time.perf_counter(), 0
        for _ in range(a.steps):
            n += len(eng.step())
        dt = time.perf_counter() - t0
        print(f"B={B:2d}: {dt / a.steps * 1e3:6.1f} ms/step, {n / dt:6.1f} tok/s ({n / dt * fused:.2f}x the fused stream)")


if __name__ == "__main__":
    main()
