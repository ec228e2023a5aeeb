"""8-client serving under a memory limit: `colibri serve` (its defaults) against llama-server (mmap), in turns.

Root only. The serving half of bench/memory_limit.py (whose Cgroup and drop_cache it reuses). For each
limit (a percentage of the .colibri file's size), in turns, the model files are dropped from the page
cache, a memory cgroup is made with that limit, and the server is started inside it (so the page cache
it fills is charged to the limit):

- colibri: `colibri serve --model FILE` and nothing else, so its weights budget is what the server
  computes by default from the memory the cgroup leaves it (master/residency.budget_for);
- llama-server on the GGUF of the same weights: its defaults (mmap) with serve.py's flags (-np CLIENTS,
  a context for them, -t/-tb the machine's cores) and `--no-repack` (llama.cpp's repacking dies of
  SIGILL on this VM's AMX flags).

Once the server answers its health check (start-up, and colibri's compile, are not timed), --clients
concurrent clients each stream --reqs greedy requests one after another (a --prompt-token prompt of
fixed random ids, a different one per request, --tokens new tokens, EOS ignored). A run stops by
itself: no client starts a request after --deadline seconds, and a request still streaming at
1.5 x --deadline is cut there. Figures: aggregate tokens / wall seconds, the cgroup's peak usage
against its limit, its OOM kills, the bytes the model's block device read while the clients ran (per
token: what decides the speed when the disk is the bottleneck; memory_limit.device_read), and whether
every finished request's greedy tokens equal the same server's unconstrained run (no cgroup, the file
cached), which runs first. --cold-kernels starts colibri
under a limit with an empty kernel cache, so that its cold compile runs inside the limit too.

    python bench/memory_limit_serve.py --limits 50 \\
        --json bench/recorded/memory-limit-serve-<date>-<machine>.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import memory_limit as ML  # noqa: E402  (Cgroup, drop_cache)
import serve as S  # noqa: E402  (free_port, prompts, wait_until)
from decode import _cpu  # noqa: E402


class Run:
    """One run's streamed tokens: per request (client, index) its token ids and stamps."""

    def __init__(self, deadline: float):
        self.lock = threading.Lock()
        self.answers, self.tokens, self.errors = {}, 0, []
        self.deadline = deadline

    def clients(self, n: int, reqs: int, one, P) -> float:
        def client(i):
            for j in range(reqs):
                if time.perf_counter() > self.soft:
                    return
                ids, done = [], False
                try:
                    for tok in one(P[(i * reqs + j) % len(P)]):
                        ids.append(tok)
                        with self.lock:
                            self.tokens += 1
                        if time.perf_counter() > self.hard:
                            break
                    else:
                        done = True
                except Exception as e:  # noqa: BLE001  (counted, printed; the run goes on)
                    with self.lock:
                        self.errors.append(repr(e)[:200])
                if done:
                    self.answers[(i, j)] = ids
        ts = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        self.t0 = time.perf_counter()
        self.soft, self.hard = self.t0 + self.deadline, self.t0 + 1.5 * self.deadline
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - self.t0


def _start(cg, argv, log, env=None):
    procs = cg.procs_file() if cg is not None else None

    def enter():
        if procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=enter, env=env)


def _stop(p):
    p.terminate()
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def llama_server(a, cg, P, tag):
    port = S.free_port()
    ctx = a.clients * (a.prompt + a.tokens + 16)
    argv = [str(a.llama_bin / "llama-server"), "-m", str(a.gguf), "-t", str(a.threads), "-tb", str(a.threads),
            "-np", str(a.clients), "-c", str(ctx), "--port", str(port), "--host", "127.0.0.1", "--no-warmup",
            "--no-repack"]
    log = open(os.path.join(a.tmp, f"llama-{tag}.log"), "w")
    p = _start(cg, argv, log, env=dict(os.environ, LD_LIBRARY_PATH=str(a.llama_bin)))
    try:
        def health():
            if p.poll() is not None:
                raise SystemExit(f"llama-server exited {p.returncode}: see {log.name}")
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        S.wait_until(health, "llama-server", timeout=600)
        ready = time.perf_counter()

        def one(prompt):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=a.deadline * 2)
            body = json.dumps({"prompt": prompt, "n_predict": a.tokens, "temperature": 0, "top_k": 1,
                               "ignore_eos": True, "cache_prompt": False, "stream": True, "return_tokens": True})
            c.request("POST", "/completion", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            try:
                for line in r:
                    if not line.startswith(b"data: "):
                        continue
                    d = json.loads(line[6:])
                    yield from d.get("tokens", [])
                    if d.get("stop"):
                        break
            finally:
                c.close()
        return _measure(a, one, P, ready, p, cg)
    finally:
        _stop(p)
        log.close()


def colibri_server(a, cg, P, tag):
    from colibri_server.client import Client
    sock = os.path.join(a.tmp, f"{tag}.sock")
    argv = [a.colibri_bin, "serve", "--model", str(a.model_link), "--bind", f"ipc://{sock}",
            "--runtime-dir", os.path.join(a.tmp, f"run-{tag}")]
    log = open(os.path.join(a.tmp, f"colibri-{tag}.log"), "w")
    env = None
    if a.cold_kernels and cg is not None:   # an empty kernel cache: the cold compile runs inside the limit
        env = dict(os.environ, COLIBRI_CACHE_DIR=tempfile.mkdtemp(dir=a.tmp, prefix="kernels-"))
    p = _start(cg, argv, log, env)
    try:
        with Client(f"ipc://{sock}", timeout=2.0) as c:
            def ready():
                if p.poll() is not None:
                    raise SystemExit(f"colibri exited {p.returncode}: see {log.name}")
                h = c.health()
                return "starting" if h["status"] == "starting" else h["status"] == "ok" and h["workers_ready"] >= 1
            S.wait_until(ready, "colibri", timeout=600)
        ready_t = time.perf_counter()
        local = threading.local()

        def one(prompt):
            if not hasattr(local, "c"):
                local.c = Client(f"ipc://{sock}", timeout=a.deadline * 2)
            with local.c.stream(prompt, max_tokens=a.tokens, temperature=0.0, ignore_eos=True) as s:
                for chunk in s:
                    yield from chunk.token_ids
        got = _measure(a, one, P, ready_t, p, cg)
        got["weights"] = _colibri_weights(log.name)
        try:
            with Client(f"ipc://{sock}", timeout=5.0) as c:
                w = next((w["engine"]["weights"] for w in c.stats().get("workers", [])
                          if isinstance((w.get("engine") or {}).get("weights"), dict)), None)
            if w:
                got["weights_figures"] = w
        except Exception as e:  # noqa: BLE001  (a figure lost, the run's result kept)
            got["weights_figures"] = {"error": repr(e)[:200]}
        return got
    finally:
        _stop(p)
        log.close()


def _colibri_weights(log_path: str) -> str:
    with open(log_path) as f:
        for line in f:
            if "weights_memory" in line:
                return line[line.index("weights_memory"):].strip()[:200]
    return "the whole file (no budget)"


def processes(cg) -> dict:
    """The cgroup's processes' own memory (smaps_rollup: Rss, Pss, private, anonymous) and its memory.stat's
    split of the charge (anonymous against page cache)."""
    if cg is None:
        return {}
    out = {"procs": []}
    with open(cg.procs_file()) as f:
        pids = [int(x) for x in f.read().split()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").split()
            with open(f"/proc/{pid}/smaps_rollup") as f:
                roll = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[-1] == "kB"}
        except OSError:
            continue
        name = " ".join(os.path.basename(c) for c in cmd[:3])
        out["procs"].append({"cmd": name, "rss": roll.get("Rss", 0), "pss": roll.get("Pss", 0),
                             "private": roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0),
                             "anon": roll.get("Anonymous", 0)})
    try:
        with open(cg.dir / "memory.stat") as f:
            st = dict(ln.split() for ln in f if ln.strip())
        keys = ("total_rss", "total_cache", "total_mapped_file", "total_unevictable") if not cg.v2 else \
            ("anon", "file", "file_mapped", "unevictable")
        out["stat"] = {k: int(st[k]) for k in keys if k in st}
    except OSError:
        pass
    return out


def _measure(a, one, P, ready_t, p, cg=None) -> dict:
    run = Run(a.deadline)
    read0 = ML.device_read(a.model)
    wall = run.clients(a.clients, a.reqs, one, P)
    read = ML.device_read(a.model) - read0 if read0 >= 0 else -1
    mem = processes(cg)
    return {"memory": mem, "tokens": run.tokens, "wall_s": round(wall, 2), "tok_s": round(run.tokens / wall, 2),
            "requests_done": len(run.answers), "requests": a.clients * a.reqs, "errors": run.errors[:3],
            "disk_read_bytes": read, "disk_read_per_token": round(read / run.tokens) if read >= 0 and run.tokens else None,
            "start_s": round(ready_t - a.t_launch, 1), "alive": p.poll() is None,
            "answers": {f"{i}.{j}": v for (i, j), v in sorted(run.answers.items())}}


def same(got: dict, ref: dict) -> dict:
    """How many finished requests' tokens equal the unconstrained run's (only requests both finished)."""
    both = [k for k in got.get("answers", {}) if k in ref.get("answers", {})]
    eq = sum(got["answers"][k] == ref["answers"][k] for k in both)
    return {"compared": len(both), "equal": eq, "all_equal": bool(both) and eq == len(both)}


def turn(a, who, limit, P, tag):
    for path in (a.model, a.gguf):
        if limit:
            ML.drop_cache(path)
        else:                       # the unconstrained run: the file read into the page cache first
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
    cg = ML.Cgroup(f"colibri-serve-bench-{os.getpid()}", limit) if limit else None
    a.t_launch = time.perf_counter()
    try:
        got = (colibri_server if who == "colibri" else llama_server)(a, cg, P, tag)
        if cg is not None:
            got["peak_bytes"], got["oom_kills"] = cg.peak(), cg.ooms()
    except (SystemExit, RuntimeError) as e:
        got = {"error": str(e)}
        if cg is not None:
            got["peak_bytes"], got["oom_kills"] = cg.peak(), cg.ooms()
    finally:
        if cg is not None:
            time.sleep(0.5)
            cg.remove()
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=ML.DATA / "bench-mixtral-f16.colibri")
    ap.add_argument("--gguf", type=pathlib.Path, default=ML.DATA / "bench-mixtral-F16.gguf")
    ap.add_argument("--limits", type=float, nargs="+", default=[50], help="limits in %% of the .colibri file's size")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--reqs", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--deadline", type=float, default=240.0,
                    help="seconds after which no request starts (one streaming is cut at 1.5x)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t/-tb")
    ap.add_argument("--llama-bin", type=pathlib.Path, default=ML.LLAMA_BIN)
    ap.add_argument("--colibri-bin", default=shutil.which("colibri") or str(pathlib.Path(sys.executable).parent / "colibri"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--cold-kernels", action="store_true",
                    help="colibri under a limit starts with an empty kernel cache (compiles inside the limit)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench/memory_limit_serve.py makes memory cgroups: run it as root")
    a.tmp = tempfile.mkdtemp(prefix="bench-memlimit-serve-")
    # the model through a link in a scratch directory: the popular set colibri saves beside the model
    # lands there, so no run starts from one an earlier run saved
    size = a.model.stat().st_size
    P = S.prompts(a.clients * a.reqs, a.prompt)
    systems = ["colibri"] + ([] if a.no_llama else ["llama-server"])
    print(f"{a.model.name}: {size / 2**20:.0f} MiB; {a.gguf.name}: {a.gguf.stat().st_size / 2**20:.0f} MiB; "
          f"{a.clients} clients x {a.reqs} requests, {a.prompt}-token prompts, {a.tokens} greedy tokens", flush=True)
    refs = {}
    for who in systems:
        a.model_link = pathlib.Path(tempfile.mkdtemp(dir=a.tmp)) / a.model.name
        a.model_link.symlink_to(a.model.resolve())
        refs[who] = turn(a, who, 0, P, f"{who}-ref")
        print(f"no limit: {who} {refs[who].get('tok_s')} tok/s ({refs[who].get('requests_done')} requests)", flush=True)
    rows = []
    for pct in a.limits:
        limit = int(size * pct / 100)
        row = {"limit_pct": pct, "limit_bytes": limit}
        for who in systems:
            a.model_link = pathlib.Path(tempfile.mkdtemp(dir=a.tmp)) / a.model.name
            a.model_link.symlink_to(a.model.resolve())
            got = turn(a, who, limit, P, f"{who}-{pct:g}")
            got["same_as_unconstrained"] = same(got, refs[who])
            got["peak_under_limit"] = 0 <= got.get("peak_bytes", -1) <= limit
            row[who] = got
            print(f"{pct:g}% ({limit / 2**20:.0f} MiB): {who} {got.get('tok_s')} tok/s, "
                  f"{got.get('requests_done')}/{got.get('requests')} requests, peak "
                  f"{got.get('peak_bytes', 0) / 2**20:.0f} MiB, oom {got.get('oom_kills')}, disk read "
                  f"{(got.get('disk_read_per_token') or 0) / 2**20:.1f} MiB/token, same "
                  f"{got['same_as_unconstrained']}, {got.get('weights', '')} {got.get('error', '')}", flush=True)
        if row["colibri"].get("weights_figures"):
            print(f"{pct:g}%: colibri weights {row['colibri']['weights_figures']}", flush=True)
        c, lb = row["colibri"].get("tok_s") or 0, row.get("llama-server", {}).get("tok_s") or 0
        row["colibri_vs_llama_server"] = round(c / lb, 2) if lb else None
        print(f"{pct:g}%: colibri / llama-server = {row['colibri_vs_llama_server']}", flush=True)
        rows.append(row)
    strip = lambda d: {k: v for k, v in d.items() if k != "answers"}  # noqa: E731
    out = {"model": a.model.name, "gguf": a.gguf.name, "file_size": size, "clients": a.clients, "reqs": a.reqs,
           "prompt_tokens": a.prompt, "new_tokens": a.tokens, "deadline_s": a.deadline,
           "llama_server_flags": f"-np {a.clients} -c {a.clients * (a.prompt + a.tokens + 16)} -t {a.threads} "
                                 f"-tb {a.threads} --no-warmup --no-repack",
           "colibri_flags": "serve --model FILE (defaults)" + (
               "; under a limit with an empty kernel cache (COLIBRI_CACHE_DIR: compiled inside the limit)"
               if a.cold_kernels else ""),
           "reference": {k: strip(v) for k, v in refs.items()},
           "rows": [{k: strip(v) if isinstance(v, dict) else v for k, v in r.items()} for r in rows],
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "uname": os.uname().release, "cpu": _cpu()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
