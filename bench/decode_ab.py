"""Batch-1 decode of this tree against an older revision, on the same model file, in turns.

    python bench/decode_ab.py MODEL.colibri [MODEL2 ...] [--rev 96c098b] [--threads 1 2] [--rounds 3]
    python bench/decode_ab.py MODEL.colibri [MODEL2 ...] --head-ab [--threads 1 2] [--rounds 3]
    python bench/decode_ab.py MODEL.colibri [MODEL2 ...] --greedy-ab [--threads 1 2] [--rounds 3]

Issue 16's "single-stream batch-1 decode >= 0.97x today's" asks whether continuous batching slowed
the one-stream path; `--rev` defaults to the commit before it (96c098b). The revision is checked out
into a temporary git worktree and both trees' `Model.decode` run on the SAME file (a file the older
reader opens: convert it with the older tree, `PYTHONPATH=WORKTREE python -m colibri_server.cli
convert ...`), each in its own subprocess, old then new, `--rounds` times, so machine drift falls on
both. Per run: a 128-token prefill, 8 warm-up tokens, then the median of 120 decode tokens (ms) (a model
of a shorter context: half of it as the prompt, passes until 120 tokens are timed).
Prints each round and the median ratio old/new time (>= 1: this tree is as fast or faster).
Each tree compiles its kernels once, in a warm-up run not counted. The machine must be quiet.
`--avx2` compiles both for an AVX2-only CPU on an AVX-512 machine (as bench/blocks.py --avx2).

    python bench/decode_ab.py --families DIR [--rev REV] [--threads 1]

adds every family the test suite builds (tests/hf_models.py: the MoE ARCHS, the dense and the further
families, at the suite's small sizes, f16), built once into DIR and converted by the older tree, so both
read them. At those sizes a token is mostly the per-layer work around the kernels (dispatch, routing,
the attention variant), which is what a change to how kernels are called moves.

`--head-ab` compares this tree with itself instead: `exact_head = false` (a block-kind output head on
llama.cpp's int8 rounding of its input) as "old" against the default (the int16 rounding, kernels/blocks_wide).
`--greedy-ab` too: every logit of the token (`Model.decode`, the default) as "old" against a greedy sequence's
token (`argmax_only=True`: a block-kind head's int8 logits with those near the top recomputed at int16, model/head.py).
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
    kw = {"argmax_only": True} if head == "greedy" else {}      # (an older tree's decode takes no such argument)
    if threads > 1:
        m.set_threads(threads)
    rng = np.random.default_rng(0)
    cap = min(512, m.config.max_position_embeddings)
    plen = min(128, cap // 2)
    n = min(120, cap - plen - 8)
    ts = []
    while len(ts) < 120:                # a small model's context holds fewer tokens: several passes
        cache = m.new_cache(cap)
        m.prefill(cache, rng.integers(3, m.config.vocab_size, plen))
        for _ in range(8):
            m.decode(cache, 5, **kw)
        for _ in range(n):
            t = time.perf_counter()
            m.decode(cache, 5, **kw)
            ts.append(time.perf_counter() - t)
    print(f"{statistics.median(ts) * 1e3:.4f}")


def run(tree: pathlib.Path, path: str, threads: int, head: str = "default") -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, __file__, "--inner", path, str(threads), head], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    return float(out.strip().splitlines()[-1])


def family_files(data: pathlib.Path, old: pathlib.Path) -> list:
    """Each test-suite family as an f16 .colibri in data (built once; converted by the tree at old)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_models as H
    out = []
    for arch in (*H.ARCHS, *H.DENSE_CONFIGS, *H.FAMILY_CONFIGS):
        hf, col = data / f"hf-{arch}", data / f"{arch}-f16.colibri"
        if not (hf / "config.json").exists():
            H.build_hf_model(arch, hf)
        if not col.exists():
            subprocess.run([sys.executable, "-m", "colibri_server.cli", "convert", str(hf), str(col), "--dtype", "f16",
                            "--quiet"], env=dict(os.environ, PYTHONPATH=str(old)), check=True, cwd=tempfile.gettempdir())
        out.append(str(col))
    return out


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--inner":
        return inner(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--families", metavar="DIR", help="also every family of the test suite, built into DIR")
    ap.add_argument("--rev", default="96c098b", help="the older revision (default: before continuous batching)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-ab", action="store_true", help="this tree with exact_head false against its default")
    ap.add_argument("--greedy-ab", action="store_true", help="this tree's greedy token against its every-logit one")
    ap.add_argument("--avx2", action="store_true", help="both trees compiled for an AVX2-only CPU (as blocks.py --avx2)")
    a = ap.parse_args()
    if a.avx2:
        sys.path.insert(0, str(ROOT))
        from colibri_server.model.kernels.cpu import without_avx512
        os.environ.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=without_avx512())    # the subprocesses inherit it
    if a.head_ab:
        return ab(a, a.models, lambda model, t: run(ROOT, model, t, "int8"), lambda model, t: run(ROOT, model, t),
                  "int8 head")
    if a.greedy_ab:
        return ab(a, a.models, lambda model, t: run(ROOT, model, t), lambda model, t: run(ROOT, model, t, "greedy"),
                  "every logit")
    with tempfile.TemporaryDirectory(prefix="colibri-ab-") as tmp:
        old = pathlib.Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
        try:
            models = a.models + (family_files(pathlib.Path(a.families), old) if a.families else [])
            ab(a, models, lambda model, t: run(old, model, t), lambda model, t: run(ROOT, model, t), a.rev)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


def ab(a, models, old, new, name: str) -> None:
    """Each model and thread count: old then new, a.rounds times (each side's kernels compiled in a run first)."""
    for model in models:
        for t in a.threads:                              # compile each side's kernels once
            old(model, t)
            new(model, t)
        for t in a.threads:
            ratios = []
            for r in range(a.rounds):
                o, n = old(model, t), new(model, t)
                ratios.append(o / n)
                print(f"{pathlib.Path(model).name} {t}T round {r + 1}: {name} {o:.4f} ms, "
                      f"this tree {n:.4f} ms, ratio {o / n:.3f}", flush=True)
            print(f"{pathlib.Path(model).name} {t}T: median ratio {statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
