"""llama.cpp's speed, measured with its own C binaries: the anchor every bench here divides by.

The binding (llama-cpp-python) pays a Python call per token and is slower than the library, so
speed is never taken from it. `run` calls `llama-bench` (built from the pinned source with
-DGGML_NATIVE=ON: bench/build_anchors.sh) at flash attention auto (its default) and
off, and keeps, for prefill and for decode, the faster of the two; `quantize` calls `llama-quantize`.
LLAMA_BIN names the directory of the binaries (default bench/.anchors/bin, which bench/build_anchors.sh builds).
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess

LLAMA_BIN = pathlib.Path(os.environ.get("LLAMA_BIN", pathlib.Path(__file__).resolve().parent / ".anchors" / "bin"))


def _env(bin_dir=None):
    return dict(os.environ, LD_LIBRARY_PATH=str(bin_dir or LLAMA_BIN))


def run(path, threads: int, reps: int, prompt_len: int, new_tokens: int, no_repack: bool = False,
        bin_dir=None) -> dict:
    """llama-bench -p prompt_len -n new_tokens on `path` -> {"prefill_tok_s", "decode_tok_s"} (medians), the
    samples as seconds ("prefill_s", "decode_s": what bench/decode.py merges over rounds) and each flash
    attention setting's own figures under "fa". no_repack: --repack 0 (the AMX Xeon VM needs it: llama.cpp's
    CPU extra buffers fail GGML_ASSERT(*cur_backend_id != -1) there, and its Q4_0 repack crashes). bin_dir: the
    binaries' directory (default LLAMA_BIN)."""
    bin_dir = pathlib.Path(bin_dir or LLAMA_BIN)
    exe = bin_dir / "llama-bench"
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: run bench/build_anchors.sh or set LLAMA_BIN")
    out = {"fa": {}}
    for fa in ("auto", "off"):
        r = subprocess.run([str(exe), "-m", str(path), "-p", str(prompt_len), "-n", str(new_tokens), "-t",
                            str(threads), "-r", str(reps), "-o", "json", "-fa", fa,
                            *(("--repack", "0") if no_repack else ())],
                           capture_output=True, text=True, timeout=3600, env=_env(bin_dir))
        if r.returncode:
            raise RuntimeError(f"llama-bench failed on {path} (on a CPU with AMX, try --llama-no-repack):\n"
                             f"{r.stderr[-3000:]}")
        got = {}
        for row in json.loads(r.stdout):
            kind, n = ("prefill", prompt_len) if row["n_prompt"] else ("decode", new_tokens)
            got[kind + "_s"] = [n / ts for ts in row["samples_ts"]]
            got[kind + "_tok_s"] = n / statistics.median(got[kind + "_s"])
        out["fa"][fa] = {k: v for k, v in got.items() if k.endswith("tok_s")}
        for kind in ("prefill", "decode"):
            if got[kind + "_tok_s"] > out.get(kind + "_tok_s", 0.0):
                out[kind + "_tok_s"], out[kind + "_s"] = got[kind + "_tok_s"], got[kind + "_s"]
    return out


def run_best(path, threads: int, reps: int, prompt_len: int, new_tokens: int) -> dict:
    """run() with llama.cpp at its best where it runs: the native build with repacking on; where that dies (a
    #GP in its AMX matmul on a VM whose CPU runs AMX), the build without AMX (`NOAMX=1 bench/build_anchors.sh`:
    LLAMA_BIN's sibling bin-noamx) with repacking on; else repacking off. The result says which: "repack" and
    "build" ("native" or "noamx")."""
    tries = [(LLAMA_BIN, "native", False)]
    if (LLAMA_BIN.parent / "bin-noamx" / "llama-bench").exists():
        tries.append((LLAMA_BIN.parent / "bin-noamx", "noamx", False))
    tries.append((LLAMA_BIN, "native", True))
    err = None
    for bin_dir, build, no_repack in tries:
        try:
            return {**run(path, threads, reps, prompt_len, new_tokens, no_repack=no_repack, bin_dir=bin_dir),
                    "repack": not no_repack, "build": build}
        except RuntimeError as e:
            err = e
    raise err


def quantize(src, dst, ftype: str, pure: bool = False) -> None:
    """llama-quantize [--pure] src dst ftype (Q8_0, Q4_0, ...): llama.cpp's own mix unless pure."""
    exe = LLAMA_BIN / "llama-quantize"
    r = subprocess.run([str(exe), *(("--pure",) if pure else ()), str(src), str(dst), ftype], capture_output=True,
                       text=True, env=_env())
    if r.returncode:
        raise RuntimeError(f"llama-quantize {ftype} failed:\n{r.stderr[-2000:]}")
