"""Time to start: `colibri run` and `colibri serve` from an empty kernel cache, on a warm one, and after
`colibri compile`, each a fresh process timed from its start to its answer (run) or to ready (serve).

    python bench/startup.py [--model SMOL.colibri] [--gguf CONVERTED.colibri] [--out bench/recorded/startup-DATE-MACHINE.json]
    python bench/startup.py --rev REV [--rounds 2] [--cold-only]    # the cold run against an older revision

The 30-layer model is SmolLM2-135M's shape (llama, 576 wide, 9 heads, 3 kv heads) with random f16
weights, written here unless --model names a real file of it; "another shape" is a 16-layer, 768-wide
model of the same kind, "another family" the bundled model (4 layers, Mixtral-style). Each scenario
gets a cache directory of its own (COLIBRI_CACHE_DIR), so "cold" is truly cold. The machine should be
quiet: compiling is CPU-bound on every core.

Scenarios (each line prints seconds to the answer or to ready, and the kernels the process compiled, from
its own log; a run also its exit, which a first start delays to compile serve's kernels on another core):
  cold run       empty cache: `colibri run` on the 30-layer model
  other shape    that cache: `colibri run` on a 16-layer, 768-wide model of the same kind (llama f16)
  other family   that cache: `colibri run` on the bundled model (Mixtral-style MoE: its own kernels)
  warm run       that cache: `colibri run` on the 30-layer model again
  serve after    that cache: `colibri serve --workers 1 --threads-per-worker 2` on the 30-layer model, to ready
  compiled ...   a fresh cache after `colibri compile --family llama --family mixtral --kind f16 --kind blocks`:
                 the three runs and the serve again, then the 30-layer model in llama.cpp's Q4_K_M mix of block
                 kinds (what `colibri convert` keeps of a Q4_K_M GGUF) run and served, and --gguf's file (a
                 GGUF converted with the defaults, llama or Mixtral) run and served

--compiled-only times only the starts after `colibri compile` (its own fresh cache).

--rev REV checks REV out beside this tree (a detached git worktree) and times its cold run in turns with this
tree's (`--rounds` each, every one in an empty cache of its own), so that both meet the same load; the
ratio is REV's seconds over this tree's. --cold-only skips the other scenarios.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOL = dict(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
            head_dim=64, num_experts=0, top_k=0, moe_intermediate_size=0, intermediate_size=1536, rms_norm_eps=1e-5,
            max_position_embeddings=2048, rope_theta=1e4, dense_layers=tuple(range(30)), bos_token_id=1,
            eos_token_ids=(2,), dtype="f16")


def _env(cache, tree=None):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",)}
    env["COLIBRI_CACHE_DIR"] = str(cache)
    if tree is not None:                    # another revision's package first on the path
        env["PYTHONPATH"] = str(tree)
    return env


def _compiled(text):
    m = re.search(r"\((\d+) compiled\)", text)
    return int(m.group(1)) if m else None


def cli(cache, *args):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", *args], env=_env(cache), capture_output=True,
                       text=True, cwd=tempfile.gettempdir())
    dt = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"colibri {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return dt, r.stderr


def run(cache, model, tree=None):
    """(seconds to the answer, kernels compiled, seconds to the process's exit: a first start goes on compiling
    what `colibri serve` needs beside it, and waits for that before it exits). tree: another revision's."""
    args = ["run", "1,2,3", "--token-ids", "--max-tokens", "1"] + (["--model", model] if model else [])
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "colibri_server.cli", *args], env=_env(cache, tree),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    answered, err = None, []
    for line in p.stderr:
        err.append(line)
        if answered is None and "first token after" in line:
            answered = time.perf_counter() - t0
    if p.wait():
        raise SystemExit(f"colibri {' '.join(args)} failed ({p.returncode}):\n{''.join(err)[-2000:]}")
    return answered, _compiled("".join(err)), time.perf_counter() - t0


def serve(cache, model, tmp):
    sock = f"ipc://{tmp}/bench-startup.sock"
    log = pathlib.Path(tmp) / "serve.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "colibri_server.cli", "serve", "--model", model, "--workers", "1",
                              "--threads-per-worker", "2", "--bind", sock, "--runtime-dir", f"{tmp}/run",
                              "--pin", "none"], env=_env(cache), stdout=f, stderr=subprocess.STDOUT)
    try:
        while "ready:" not in log.read_text():
            if p.poll() is not None:
                raise SystemExit(f"colibri serve exited {p.returncode}:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        dt = time.perf_counter() - t0
    finally:
        p.terminate()
        p.wait(60)
    return dt, _compiled(log.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a 30-layer .colibri file (default: SmolLM2-135M's shape, random f16 weights)")
    ap.add_argument("--gguf", help="a GGUF converted with the defaults (llama or Mixtral family): its first run and "
                    "serve after `colibri compile` too")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--rev", help="time this older revision's cold run too, in turns with this tree's")
    ap.add_argument("--rounds", type=int, default=2, help="cold runs of each tree with --rev (default 2)")
    ap.add_argument("--cold-only", action="store_true", help="only the cold run (and --rev's)")
    ap.add_argument("--compiled-only", action="store_true", help="only the starts after `colibri compile`")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="colibri-startup-") as tmp:
        from colibri_server.model.config import ModelConfig
        from colibri_server.model.kquants import scheme_kinds
        from colibri_server.model.synthetic import write_synthetic
        model = a.model
        if not model:
            model = os.path.join(tmp, "smol-shape-f16.colibri")
            write_synthetic(model, ModelConfig(**SMOL))
        res = {}

        def show(name, r):
            res[name] = {"seconds": round(r[0], 2), "compiled": r[1]}
            extra = ""
            if len(r) > 2:
                res[name]["exit_seconds"] = round(r[2], 2)
                extra = f", exits after {r[2]:.2f} s"
            print(f"{name:21s} {r[0]:7.2f} s   {r[1]} kernels compiled{extra}", flush=True)
        other = os.path.join(tmp, "llama-16x768-f16.colibri")        # same kind, another shape
        write_synthetic(other, ModelConfig(**{**SMOL, "num_layers": 16, "hidden_size": 768, "num_heads": 12,
                                              "num_kv_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
                                              "dense_layers": tuple(range(16))}))
        blocks = os.path.join(tmp, "smol-shape-q4_k_m.colibri")     # llama.cpp's Q4_K_M mix of block kinds
        smol = ModelConfig(**SMOL)
        write_synthetic(blocks, replace(smol, block_types=scheme_kinds(smol, "q4_k_m")))
        if a.rev:
            compare(a.rev, a.rounds, model, tmp, res)
        c1 = pathlib.Path(tmp) / "cache-cold"
        if not a.compiled_only:
            show("cold run", run(c1, model))
            if a.cold_only:
                return _write(a.out, res)
            show("other shape", run(c1, other))
            show("other family", run(c1, None))
            show("warm run", run(c1, model))
            show("serve after", serve(c1, model, tmp))
        c2 = pathlib.Path(tmp) / "cache-compiled"
        dt, _ = cli(c2, "compile", "--family", "llama", "--family", "mixtral", "--kind", "f16", "--kind", "blocks")
        res["compile"] = {"seconds": round(dt, 2)}
        print(f"{'compile':21s} {dt:7.2f} s   (colibri compile --family llama --family mixtral --kind f16 "
              "--kind blocks)")
        show("compiled run", run(c2, model))
        show("compiled other", run(c2, other))
        show("compiled family", run(c2, None))
        show("compiled serve", serve(c2, model, tmp))
        show("compiled q4_k_m run", run(c2, blocks))
        show("compiled q4_k_m serve", serve(c2, blocks, tmp))
        if a.gguf:
            show("compiled gguf run", run(c2, a.gguf))
            show("compiled gguf serve", serve(c2, a.gguf, tmp))
    _write(a.out, res)


def compare(rev, rounds, model, tmp, res):
    """The cold run of `rev` and of this tree in turns, each in an empty cache: seconds to the answer."""
    old = pathlib.Path(tmp) / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), rev], check=True)
    try:
        pairs = []
        for r in range(rounds):
            o = run(pathlib.Path(tmp) / f"cache-old-{r}", model, old)
            n = run(pathlib.Path(tmp) / f"cache-new-{r}", model)
            pairs.append((o[0], n[0]))
            print(f"cold run, round {r + 1}: {rev} {o[0]:.2f} s ({o[1]} compiled, exits {o[2]:.2f} s), "
                  f"this tree {n[0]:.2f} s ({n[1]} compiled, exits {n[2]:.2f} s): ratio {o[0] / n[0]:.2f}",
                  flush=True)
        res["cold run against " + rev] = {"rounds": [{"rev_seconds": round(o, 2), "seconds": round(n, 2)}
                                                    for o, n in pairs]}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


def _write(out, res):
    if out:
        import platform
        pathlib.Path(out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                                 "cores": len(os.sched_getaffinity(0)), "results": res}, indent=1))


if __name__ == "__main__":
    main()
