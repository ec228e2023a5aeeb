"""Batch-1 decode of this tree against an older revision, on the same model file, in turns.

    python bench/decode_ab.py MODEL.colibri [MODEL2 ...] [--rev 96c098b] [--threads 1 2] [--rounds 3]
    python bench/decode_ab.py MODEL.colibri [MODEL2 ...] --head-ab [--threads 1 2] [--rounds 3]

Issue 16's "single-stream batch-1 decode >= 0.97x today's" asks whether continuous batching slowed
the one-stream path; `--rev` defaults to the commit before it (96c098b). The revision is checked out
into a temporary git worktree and both trees' `Model.decode` run on the SAME file (a file the older
reader opens: convert it with the older tree, `PYTHONPATH=WORKTREE python -m colibri_server.cli
convert ...`), each in its own subprocess, old then new, `--rounds` times, so machine drift falls on
both. Per run: a 128-token prefill, 8 warm-up tokens, then the median of 120 decode tokens (ms).
Prints each round and the median ratio old/new time (>= 1: this tree is as fast or faster).
Each tree compiles its kernels once, in a warm-up run not counted. The machine must be quiet.

`--head-ab` compares this tree with itself instead: `exact_head = false` (a block-kind output head on
llama.cpp's int8 rounding of its input) as "old" against the default (the int16 rounding, kernels/blocks_wide).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def inner(path: str, threads: int, head: str = "default") -> None:
    import time

    import numpy as np

    from colibri_server.model import Model
    m = Model.open(path, context=512)
    if head == "int8":
        m.set_exact_head(False)
    if threads > 1:
        m.set_threads(threads)
    rng = np.random.default_rng(0)
    cache = m.new_cache(512)
    m.prefill(cache, rng.integers(3, m.config.vocab_size, 128))
    for _ in range(8):
        m.decode(cache, 5)
    ts = []
    for _ in range(120):
        t = time.perf_counter()
        m.decode(cache, 5)
        ts.append(time.perf_counter() - t)
    print(f"{statistics.median(ts) * 1e3:.3f}")


def run(tree: pathlib.Path, path: str, threads: int, head: str = "default") -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, __file__, "--inner", path, str(threads), head], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    return float(out.strip().splitlines()[-1])


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--inner":
        return inner(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rev", default="96c098b", help="the older revision (default: before continuous batching)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-ab", action="store_true", help="this tree with exact_head false against its default")
    a = ap.parse_args()
    if a.head_ab:
        return ab(a, lambda model, t: run(ROOT, model, t, "int8"), lambda model, t: run(ROOT, model, t), "int8 head")
    with tempfile.TemporaryDirectory(prefix="colibri-ab-") as tmp:
        old = pathlib.Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
        try:
            ab(a, lambda model, t: run(old, model, t), lambda model, t: run(ROOT, model, t), a.rev)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


def ab(a, old, new, name: str) -> None:
    """Each model and thread count: old then new, a.rounds times (each side's kernels compiled in a run first)."""
    for model in a.models:
        for t in a.threads:                              # compile each side's kernels once
            old(model, t)
            new(model, t)
        for t in a.threads:
            ratios = []
            for r in range(a.rounds):
                o, n = old(model, t), new(model, t)
                ratios.append(o / n)
                print(f"{pathlib.Path(model).name} {t}T round {r + 1}: {name} {o:.2f} ms, "
                      f"this tree {n:.2f} ms, ratio {o / n:.3f}", flush=True)
            print(f"{pathlib.Path(model).name} {t}T: median ratio {statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
