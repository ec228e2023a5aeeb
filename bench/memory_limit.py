"""Batch-1 decode under a memory limit: colibri's residency (weights_memory) against llama.cpp's mmap.

Root only. For each limit (a percentage of the model's .colibri file size) the script makes a memory
cgroup (v1 memory.limit_in_bytes, or v2 memory.max), drops the model files from the page cache, and
runs, in turns, inside it (so the page cache the run fills is charged to the limit):

- colibri: a process that opens the .colibri file without pre-faulting it, sets its weights budget to
  what the cgroup leaves it (residency.resolve_budget of residency.available_memory: 90% of the room
  left after the process's own memory, less room for the experts being read), loads its kernels and gives
  up what they took beyond the room a server leaves them (master/residency.start_after_compile), locks, decodes greedily with
  the server's batched step (one thread, one sequence) while a thread re-ranks the locked experts every
  RERANK_EVERY (0.25 s), as the server's master does from its own process;
- colibri without a budget (the kernel's LRU decides, as before issue 36);
- llama-bench on the GGUF of the same weights (mmap, its defaults; `--repack 0`: this VM's AMX flags
  crash llama.cpp's repacking).

It prints tok/s, the ratio colibri / llama-bench, whether colibri's greedy tokens equal the
unconstrained run's, the cgroup's peak usage against its limit and its OOM kills, and writes JSON.

    python bench/memory_limit.py --limits 100 75 50 25 \\
        --json bench/recorded/memory-limit-<date>-<machine>.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode import _cpu  # noqa: E402  (the CPU a run was on, in its JSON)

DATA = pathlib.Path(os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
LLAMA_BIN = pathlib.Path(os.environ.get("LLAMA_BIN", HERE / ".anchors" / "bin"))
PROMPT = [1, 5, 9, 200, 31, 77, 1000, 4, 2300, 17, 99, 512, 8, 4096, 250, 13]


# ------------------------------------------------------------------------------------ the cgroup

class Cgroup:
    """A memory cgroup (v1 or v2) with a limit; add(pid); peak(); ooms(); remove()."""

    def __init__(self, name: str, limit: int):
        v1 = pathlib.Path("/sys/fs/cgroup/memory")
        if v1.is_dir():
            self.dir, self.v2 = v1 / name, False
        else:
            self.dir, self.v2 = pathlib.Path("/sys/fs/cgroup") / name, True
        self.dir.mkdir(exist_ok=True)
        if self.v2:
            (self.dir / "memory.max").write_text(str(limit))
            (self.dir / "memory.swap.max").write_text("0")
        else:
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            try:
                (self.dir / "memory.max_usage_in_bytes").write_text("0")
            except OSError:
                pass
        self.limit = limit

    def procs_file(self) -> str:
        return str(self.dir / "cgroup.procs")

    def peak(self) -> int:
        f = self.dir / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return -1

    def ooms(self) -> int:
        f = self.dir / ("memory.events" if self.v2 else "memory.oom_control")
        for line in f.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def remove(self):
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_cache(path) -> None:
    """The file's pages out of the page cache (nobody maps it between runs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(path) -> int:
    """Bytes of the file in the page cache (fincore), -1 when unknown."""
    r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], capture_output=True, text=True)
    try:
        return int(r.stdout.split()[0])
    except (IndexError, ValueError):
        return -1


def device_read(path) -> int:
    """Bytes the block device holding `path` has read since boot (its sectors read, /sys/dev/block/M:m/stat),
    -1 when unknown: the difference over a run is what the run read from disk, cache misses and re-reads included."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return int(f.read().split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return -1


def run_in(cg: Cgroup | None, argv, env=None, timeout=1800) -> subprocess.CompletedProcess:
    procs = cg.procs_file() if cg is not None else None

    def enter():
        if procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=enter, env=env, timeout=timeout)


# ------------------------------------------------------------------------------------ the runs

def child_colibri(a) -> None:
    """Inside the cgroup: open, budget, decode a.new tokens greedily; print one JSON line."""
    sys.path.insert(0, str(HERE.parent))
    import numpy as np

    from colibri_server.host.trim import trim
    from colibri_server.master.residency import MAX_SWAPS, RERANK_EVERY, UNCACHED_SWAPS, start_after_compile
    from colibri_server.model import Model
    from colibri_server.model.residency import Residency, available_memory, in_flight_bytes, resolve_budget
    from colibri_server.model.serving import BatchEngine, warm_up
    m = Model.open(a.model, context=len(PROMPT) + a.new + 8, populate=a.budget_mode == "none")
    size = m.file.header["file_size"]
    budget = size
    anon0 = _anon()
    if a.budget_mode == "auto":
        budget = resolve_budget(a.weights_memory, size, available_memory(), in_flight_bytes(m.file, m.config))
    res = None
    if budget < size:
        res = Residency(m.file, m.config, budget, partial=not a.weights_memory)
        m.residency = res
    # the server's order (master/loading): the kernels load (from a cold cache: compile) with the residency attached
    # and nothing locked, what they left behind is given back (host/trim: LLVM's library pages, the heap's free
    # pages), then the server's start_after_compile (a budget chosen here gives up what they took beyond
    # KERNELS_ROOM; the locks). A budget fixed before them left one 933 MiB run 77 MiB of page cache
    # (memory-limit-2026-12-05-epyc-zen4.json)
    warm_up(m)
    trim()
    if res is not None:
        start_after_compile(m, a.weights_memory, _anon() - anon0)
        budget = res.budget
    eng = BatchEngine(m, max_seqs=1, max_batch_tokens=len(PROMPT) + 1, prefix_cache=False,
                      predict_experts=a.expert_readahead == "predicted")
    if eng.fetch is not None:
        eng.fetch.spread = a.spread
    eng.add(0, PROMPT, max_tokens=a.new, ignore_eos=True, temperature=0.0)
    toks, times = [], []
    done = threading.Event()

    def master():          # the server's master re-ranks in its own process, beside the workers: here a thread
        while not done.wait(RERANK_EVERY):
            res.rerank(MAX_SWAPS, UNCACHED_SWAPS)
    tender = threading.Thread(target=master, daemon=True)
    if res is not None:
        tender.start()
    t0 = time.perf_counter()
    while eng.has_work():
        for _, ev in eng.step():
            toks.append(int(ev.token_id))
            times.append(time.perf_counter())
    done.set()
    dec = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    out = {"tokens": toks, "decode_tok_s": dec, "first_token_s": times[0] - t0, "budget": budget,
           "file_size": size, "residency": res.figures() if res is not None else None,
           "rss_anon": _anon(), "route_counts": res.shared.counts.tolist() if res is not None else None}
    print(json.dumps(out))
    np.asarray(0)


def _anon() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def colibri(a, cg, mode: str) -> dict:
    argv = [sys.executable, __file__, "--child", "--model", str(a.model), "--new", str(a.new),
            "--budget-mode", mode, "--weights-memory", str(a.weights_memory), "--spread", str(a.spread),
            "--expert-readahead", a.expert_readahead]
    r = run_in(cg, argv, env=dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1"))
    if r.returncode:
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama(a, cg) -> dict:
    exe = LLAMA_BIN / "llama-bench"
    argv = [str(exe), "-m", str(a.gguf), "-p", "0", "-n", str(a.new), "-t", "1", "-r", "1", "-o", "json",
            "--repack", "0"]
    r = run_in(cg, argv, env=dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_BIN)))
    if r.returncode:
        return {"error": f"exit {r.returncode}: {r.stderr.strip()[-300:]}"}
    rows = json.loads(r.stdout)
    return {"decode_tok_s": float(rows[0]["avg_ts"])}


def svg(out: dict, path: str) -> None:
    """The curve as a small SVG line chart (bench/memory_limit_plot.py's decode panel)."""
    import memory_limit_plot as MP
    MP.draw([(out, MP.DECODE, "batch-1 decode", f"{out['model']}, 1 thread")], path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=DATA / "bench-mixtral-f16.colibri")
    ap.add_argument("--gguf", type=pathlib.Path, default=DATA / "bench-mixtral-F16.gguf")
    ap.add_argument("--limits", type=float, nargs="+", default=[100, 75, 50, 25],
                    help="memory limits in %% of the .colibri file's size")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-lru", action="store_true", help="skip colibri without a budget (the kernel's LRU)")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget-mode", default="auto", choices=["auto", "none", "lru"], help=argparse.SUPPRESS)
    ap.add_argument("--expert-readahead", default="chosen", choices=["chosen", "predicted"],
                    help="the server's setting of that name (predicted: the next layer's probable experts read too)")
    ap.add_argument("--spread", type=int, default=0, help="predict top_k + SPREAD of the next layer (-1: none)")
    ap.add_argument("--weights-memory", type=int, default=0, help="colibri's budget in bytes (0: from the limit)")
    ap.add_argument("--svg", default="", help="draw the curve into this SVG file")
    ap.add_argument("--plot", default="", help="only draw --svg from this recorded JSON")
    a = ap.parse_args(argv)
    if a.plot:
        with open(a.plot) as f:
            return svg(json.load(f), a.svg)
    if a.child:
        return child_colibri(a)
    if os.geteuid() != 0:
        sys.exit("bench/memory_limit.py makes memory cgroups: run it as root")
    size = a.model.stat().st_size
    print(f"{a.model.name}: {size / 2**20:.0f} MiB; {a.gguf.name}: {a.gguf.stat().st_size / 2**20:.0f} MiB; "
          f"{a.new} tokens, batch 1, one thread")
    # the reference: no limit, the file in the page cache (a first run compiles what it must)
    colibri(a, None, "none")
    ref = colibri(a, None, "none")
    lref = llama(a, None) if not a.no_llama else {}
    print(f"no limit, cached: colibri {ref.get('decode_tok_s', 0):.1f} tok/s, llama-bench "
          f"{lref.get('decode_tok_s', 0):.1f}")
    rows = []
    for pct in a.limits:
        limit = int(size * pct / 100)
        row = {"limit_pct": pct, "limit_bytes": limit}
        for who in ("colibri",) + (() if a.no_lru else ("colibri_lru",)) + (() if a.no_llama else ("llama",)):
            for p in (a.model, a.gguf):
                drop_cache(p)
            cg = Cgroup(f"colibri-bench-{os.getpid()}", limit)
            try:
                got = colibri(a, cg, "auto") if who == "colibri" else colibri(a, cg, "lru") \
                    if who == "colibri_lru" else llama(a, cg)
                got["peak_bytes"], got["oom_kills"] = cg.peak(), cg.ooms()
            finally:
                cg.remove()
            if "tokens" in got:
                got["same_tokens"] = got.pop("tokens") == ref["tokens"]
            row[who] = got
        c, lb = row["colibri"].get("decode_tok_s", 0), row.get("llama", {}).get("decode_tok_s", 0)
        row["colibri_vs_llama"] = c / lb if lb else None
        row["colibri_vs_own_in_memory"] = c / ref["decode_tok_s"] if ref.get("decode_tok_s") else None
        rows.append(row)
        print(f"{pct:5.0f}% ({limit / 2**20:.0f} MiB): colibri {c:6.1f} tok/s "
              f"(budget {row['colibri'].get('budget', 0) / 2**20:.0f} MiB, same tokens "
              f"{row['colibri'].get('same_tokens')}, peak {row['colibri'].get('peak_bytes', 0) / 2**20:.0f} MiB, "
              f"oom {row['colibri'].get('oom_kills')}) | kernel LRU colibri "
              f"{row.get('colibri_lru', {}).get('decode_tok_s', 0):6.1f} | llama-bench {lb:6.1f} tok/s "
              f"(peak {row.get('llama', {}).get('peak_bytes', 0) / 2**20:.0f} MiB) | ratio "
              f"{row['colibri_vs_llama'] or 0:.2f}x | of own in-memory {row['colibri_vs_own_in_memory'] or 0:.2f}"
              + (f" | errors: {[(k, v['error']) for k, v in row.items() if isinstance(v, dict) and 'error' in v]}"
                 if any(isinstance(v, dict) and "error" in v for v in row.values()) else ""), flush=True)
    out = {"model": a.model.name, "gguf": a.gguf.name, "file_size": size, "new_tokens": a.new, "threads": 1,
           "llama_bench_flags": "--repack 0 (this VM's AMX flags crash llama.cpp's repacking)",
           "reference": {"colibri": {k: v for k, v in ref.items() if k != "tokens"}, "llama": lref}, "rows": rows,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "uname": os.uname().release, "cpu": _cpu()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.svg:
        svg(out, a.svg)


if __name__ == "__main__":
    main()
