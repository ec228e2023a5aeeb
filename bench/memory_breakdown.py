"""Where a colibri process's own memory goes (what a memory limit charges besides the weights).

Under a memory limit, every byte the process holds for itself is a byte the weights budget cannot use
(bench/memory_limit.py: the budget is 90% of what the cgroup leaves after the process). This script
runs the batch-1 decode of bench/memory_limit.py's child in phases, in a fresh process, and after each
phase reads /proc/self/smaps: resident bytes (Rss), unique to the process (Private = USS) and anonymous,
grouped by what is mapped:

- the model file (the weights: what residency manages, not the process's own);
- anonymous memory: the Python heap, malloc arenas, numpy buffers (the KV pool, the workspace), and
  the machine code and data structures of the kernels Numba loads or compiles (LLVM's JIT: in
  anonymous memory, there are no .so files for the kernel cache, whose .nbi/.nbc files are read, not mapped);
- llvmlite's libLLVM (file-backed: its touched pages), numpy's/OpenBLAS's .so files, Python's own, others.

Phases: python (the interpreter and numpy), import (colibri_server.model: Numba, llvmlite, the kernel
modules), open (the model mapped, not pre-faulted), first token (the kernels loaded from the cache and
linked), decode (--new tokens), paged out (libLLVM's pages advised MADV_PAGEOUT: what the compiler's
library holds once the kernels are linked), decode again (whether decoding faults it back). Also the phase's Python-allocator blocks (sys.getallocatedblocks) and the
count of Numba kernels (dispatchers) with a compiled signature.

    python bench/memory_breakdown.py [--model FILE] [--new 32] [--json OUT]
    python bench/memory_breakdown.py --serve [--model FILE] [--json OUT]

--serve: the same breakdown for each process of `colibri serve --model FILE` (its defaults: the master,
its router and workers), after one request of --new tokens: what a server's own processes hold.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
DATA = pathlib.Path(os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
PROMPT = [1, 5, 9, 200, 31, 77, 1000, 4, 2300, 17, 99, 512, 8, 4096, 250, 13]


def _group(path: str, model: str) -> str:
    if path == model:
        return "model file"
    if not path or path.startswith("[heap]") or path.startswith("[anon"):
        return "anonymous (heap, arenas, numpy, LLVM JIT)"
    if path.startswith("["):
        return "stack, vdso"
    base = os.path.basename(path)
    if "llvmlite" in path or "LLVM" in base:
        return "libLLVM (llvmlite)"
    if "numpy" in path or "openblas" in base.lower() or "scipy" in path:
        return "numpy/OpenBLAS .so"
    if "libpython" in base or "/lib/python" in path and "site-packages" not in path or base.startswith("python"):
        return "Python and its stdlib .so"
    if path.endswith((".nbi", ".nbc")):
        return "kernel cache files"
    return "other files (.so, locale)"


def smaps(model: str, pid="self") -> dict:
    """Per group: rss, private (USS), anonymous bytes."""
    out = collections.defaultdict(lambda: collections.Counter())
    group = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            k = line.split(None, 1)[0]
            if "-" in k and not k.endswith(":"):
                parts = line.split(None, 5)
                group = _group(parts[5].strip() if len(parts) > 5 else "", model)
            elif k in ("Rss:", "Private_Clean:", "Private_Dirty:", "Anonymous:"):
                v = int(line.split()[1]) * 1024
                key = {"Rss:": "rss", "Anonymous:": "anon"}.get(k, "private")
                out[group][key] += v
    return {g: dict(c) for g, c in sorted(out.items())}


def phase(name: str, model: str, rows: list) -> None:
    groups = smaps(model)
    own = {g: v for g, v in groups.items() if g != "model file"}
    row = {"phase": name, "own_rss": sum(v.get("rss", 0) for v in own.values()),
           "own_private": sum(v.get("private", 0) for v in own.values()),
           "model_file_rss": groups.get("model file", {}).get("rss", 0),
           "python_blocks": sys.getallocatedblocks(), "kernels": _kernels(), "groups": groups}
    rows.append(row)
    print(f"{name:12s} own RSS {row['own_rss'] / 2**20:6.1f} MiB, USS {row['own_private'] / 2**20:6.1f} MiB | "
          + ", ".join(f"{g} {v.get('rss', 0) / 2**20:.1f}" for g, v in groups.items()), flush=True)


def page_out(pattern: str) -> int:
    """madvise(MADV_PAGEOUT) every mapping of a file whose path holds `pattern`: bytes of the mappings."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and pattern in parts[5]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if libc.madvise(lo, hi - lo, 21) == 0:         # MADV_PAGEOUT (Linux 5.4)
                    n += hi - lo
    return n


def _kernels() -> int:
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("colibri_server.model")]
    seen = 0
    for m in mods:
        for v in list(vars(m).values()):
            if getattr(v, "signatures", None):
                seen += 1
    return seen


def serve(a) -> None:
    import subprocess
    import tempfile
    import time
    sys.path.insert(0, str(HERE.parent))
    from colibri_server.client import Client
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="memory-breakdown-"))
    link = tmp / a.model.name            # the popular set the server saves lands in the scratch directory
    link.symlink_to(a.model.resolve())
    sock = tmp / "s.sock"
    exe = pathlib.Path(sys.executable).parent / "colibri"
    p = subprocess.Popen([str(exe), "serve", "--model", str(link), "--bind", f"ipc://{sock}", "--runtime-dir",
                          str(tmp / "run")], stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT)
    try:
        with Client(f"ipc://{sock}", timeout=600) as c:
            t_end = time.time() + 600
            while time.time() < t_end:
                try:
                    h = c.health()
                    if h["status"] == "ok" and h["workers_ready"] >= 1:
                        break
                except Exception:  # noqa: BLE001  (not up yet)
                    pass
                time.sleep(0.5)
            c.generate(PROMPT, max_tokens=a.new, temperature=0.0, ignore_eos=True)
        pids = [p.pid] + [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                                          text=True).stdout.split()]
        rows = []
        model = str(a.model.resolve())
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            groups = smaps(model, pid)
            own = {g: v for g, v in groups.items() if g != "model file"}
            rows.append({"pid_role": comm, "cmd": cmd.split(" --")[0].rsplit("/", 1)[-1],
                         "own_rss": sum(v.get("rss", 0) for v in own.values()),
                         "own_private": sum(v.get("private", 0) for v in own.values()), "groups": groups})
            print(f"{comm:16s} own RSS {rows[-1]['own_rss'] / 2**20:6.1f} MiB, USS "
                  f"{rows[-1]['own_private'] / 2**20:6.1f} MiB | "
                  + ", ".join(f"{g} {v.get('rss', 0) / 2**20:.1f}/{v.get('private', 0) / 2**20:.1f}"
                              for g, v in groups.items()), flush=True)
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps({"model": a.model.name, "serve": rows}, indent=1))
    finally:
        p.terminate()
        p.wait(60)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=DATA / "bench-mixtral-f16.colibri")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default="")
    ap.add_argument("--serve", action="store_true", help="each process of `colibri serve` instead")
    a = ap.parse_args(argv)
    if a.serve:
        return serve(a)
    model = str(a.model.resolve())
    rows = []
    import numpy  # noqa: F401
    phase("python", model, rows)
    sys.path.insert(0, str(HERE.parent))
    from colibri_server.model import Model
    from colibri_server.model.serving import BatchEngine
    phase("import", model, rows)
    m = Model.open(str(a.model), context=len(PROMPT) + a.new + 8, populate=False)
    eng = BatchEngine(m, max_seqs=1, max_batch_tokens=len(PROMPT) + 1, prefix_cache=False)
    phase("open", model, rows)
    eng.add(0, PROMPT, max_tokens=a.new, ignore_eos=True, temperature=0.0)
    n = 0
    while eng.has_work():
        for _ in eng.step():
            n += 1
            if n == 1:
                phase("first token", model, rows)
    phase("decode", model, rows)
    # what the compiler's library costs once the kernels are linked: its pages paged out, then decoding on
    print(f"libLLVM mappings advised MADV_PAGEOUT: {page_out('llvmlite') / 2**20:.0f} MiB mapped", flush=True)
    phase("paged out", model, rows)
    eng.add(1, PROMPT, max_tokens=a.new, ignore_eos=True, temperature=0.0)
    while eng.has_work():
        eng.step()
    phase("decode again", model, rows)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"model": a.model.name, "new_tokens": a.new, "phases": rows},
                                                   indent=1))


if __name__ == "__main__":
    main()
