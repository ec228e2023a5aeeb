"""The control plane under a memory limit: start, HUP, HUP, TTIN and kill -9 of a worker, each answered.

Root only (a memory cgroup: bench/memory_limit.py's Cgroup, page cache charged to it). The model file
is dropped from the page cache, `colibri serve --model FILE --workers 1` (plus --weights-memory and any
--extra flags) starts inside a cgroup of --limit MiB, and after each step a greedy request of 8 fixed
token ids asks for 8 tokens. A step passes when the answer is the first one's, token for token. Printed
and written (--json): per step its seconds, the master's generation, the cgroup's usage, page cache and
unevictable (locked) memory, each server process's USS and RSS; then the cgroup's peak against its
limit and its OOM kills. A step's wait is bounded (--step-timeout); the run stops at the first failure.

    python bench/memory_limit_reload.py --model bench-mixtral-f16.colibri --limit 467 --weights-memory 300M
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import memory_limit as ML  # noqa: E402  (Cgroup, drop_cache)
import serve as S  # noqa: E402  (free_port)

MB = 1 << 20
PROMPT = [1, 5, 9, 30, 7, 100, 42, 3]


def _stat(cg) -> dict:
    f = cg.dir / "memory.stat"
    st = dict(line.split() for line in f.read_text().splitlines())
    usage = cg.dir / ("memory.current" if cg.v2 else "memory.usage_in_bytes")
    cache, locked = (("file", "unevictable") if cg.v2 else ("total_cache", "total_unevictable"))
    return {"usage_mib": int(usage.read_text()) // MB, "cache_mib": int(st.get(cache, 0)) // MB,
            "unevictable_mib": int(st.get(locked, 0)) // MB}


def _procs(cg) -> list:
    import psutil
    out = []
    for pid in (cg.dir / "cgroup.procs").read_text().split():
        try:
            p = psutil.Process(int(pid))
            mi = p.memory_full_info()
            out.append({"cmd": " ".join(p.cmdline())[:40], "uss_mib": mi.uss // MB, "rss_mib": mi.rss // MB})
        except (psutil.Error, OSError):
            pass
    return out


def _ask(addr, timeout):
    from colibri_server.client import Client
    with Client(addr, timeout=timeout) as c:
        r = c.generate(PROMPT, max_tokens=8, temperature=0)
        return list(r.token_ids), r.generation


def _wait_health(addr, p, timeout, ok) -> bool:
    """Poll the router's health until ok(health) (the server still alive), at most `timeout` seconds."""
    from colibri_server.client import Client
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with Client(addr, timeout=5) as c:
                if ok(c.health()):
                    return True
        except Exception:
            pass
        time.sleep(0.5)
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--limit", type=int, required=True, help="the cgroup's limit, MiB")
    ap.add_argument("--weights-memory", default="", help="colibri's weights_memory (empty: its default)")
    ap.add_argument("--extra", default="", help="more `colibri serve` flags, one string")
    ap.add_argument("--step-timeout", type=float, default=600.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("memory_limit_reload.py: root only (it makes a memory cgroup)")
    ML.drop_cache(a.model)
    cg = ML.Cgroup(f"colibri-reload-{os.getpid()}", a.limit * MB)
    run = tempfile.mkdtemp(prefix="bench-reload-")
    addr = f"tcp://127.0.0.1:{S.free_port()}"
    argv = [sys.executable, "-m", "colibri_server.cli", "serve", "--model", a.model, "--bind", addr, "--workers", "1",
            "--runtime-dir", run, *(["--weights-memory", a.weights_memory] if a.weights_memory else []),
            *a.extra.split()]
    log = open(os.path.join(run, "server.log"), "w")

    def enter():
        with open(cg.procs_file(), "w") as f:
            f.write(str(os.getpid()))
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=enter)
    steps, first, ok, victim = [], None, True, None
    try:
        for name, g in (("start", 1), ("HUP", 2), ("HUP", 3), ("TTIN", 3), ("kill -9 worker", 3)):
            t = time.monotonic()
            if name == "HUP":
                p.send_signal(signal.SIGHUP)
            elif name == "TTIN":
                p.send_signal(signal.SIGTTIN)
            elif name.startswith("kill"):
                victim = _procs_pids(p.pid)[0]
                os.kill(victim, signal.SIGKILL)
            workers = 1 if name in ("start", "HUP") else 2          # TTIN adds one; the killed one is replaced
            row = {"step": name}
            try:
                ready = _wait_health(addr, p, a.step_timeout, lambda h: h.get("generation") == g and
                                     h.get("workers_ready", 0) >= workers and victim not in _procs_pids(p.pid))
                if not ready:
                    raise TimeoutError(f"generation {g} with {workers} workers ready not serving after "
                                       f"{a.step_timeout:.0f}s")
                tokens, gen = _ask(addr, a.step_timeout)
                first = first or tokens
                row.update(seconds=round(time.monotonic() - t, 1), generation=gen, same=tokens == first)
                ok = tokens == first
            except Exception as e:
                row.update(seconds=round(time.monotonic() - t, 1), error=f"{type(e).__name__}: {e}")
                ok = False
            row.update(cgroup=_stat(cg), procs=_procs(cg))
            steps.append(row)
            print(json.dumps(row), flush=True)
            if not ok:
                break
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out = {"model": os.path.basename(a.model), "limit_mib": a.limit, "weights_memory": a.weights_memory,
               "extra": a.extra, "steps": steps, "all_answered": ok and len(steps) == 5,
               "peak_mib": cg.peak() // MB, "oom_kills": cg.ooms(), "server_log": os.path.join(run, "server.log")}
        cg.remove()
        print(json.dumps({k: v for k, v in out.items() if k != "steps"}))
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _procs_pids(master_pid) -> list:
    import psutil
    try:
        return [c.pid for c in psutil.Process(master_pid).children() if "worker" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


if __name__ == "__main__":
    main()
