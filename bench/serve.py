"""Serving under load: colibri (its DEFAULT settings) against llama.cpp's llama-server, taking turns.

    python bench/serve.py [--llama-bin DIR] [--precisions f16 q4 q4_k_m] [--conc 1 4 8 16 32] [--json OUT]

DIR holds llama-server and llama-quantize, built from the pinned llama.cpp source with
-DGGML_NATIVE=ON (default bench/.anchors/bin, which bench/build_anchors.sh builds). The model is bench-mixtral (bench/decode.py builds
it, the .colibri files and the GGUFs, once, under --data; q4_k_m, q4_0: llama-quantize's Q4_K_M / Q4_0 and, for
colibri, that GGUF converted with the defaults, its block kinds kept; q4: colibri's own q4 against Q4_0). For each precision and each number of
concurrent clients C, llama-server (continuous batching, -np C, -t/-tb = the machine's cores) and
`colibri serve --model FILE` (nothing else: what a user gets) take turns, --rounds times. Each
client streams --reqs requests one after another: a --prompt-token prompt of random ids (a different
one per request), --tokens greedy new tokens, EOS ignored. Figures per system and C: aggregate
completion tokens / wall seconds, time to first token (p50, p99) and inter-token latency (the gaps
between a request's streamed tokens; p50, p99), and colibri / llama-server. Prints a table, writes JSON;
each JSON row also has cpu_pct: the CPU time over the run of the clients (this process) and of each of the
server's processes, as % of one core (the clients, and colibri's router, run on the cores its worker uses).
The machine must be quiet (nothing else running): the two systems share its cores in turns.

    python bench/serve.py --no-llama --against-bin REV/.venv/bin/colibri [...] --precisions f16 q4

An A/B of this tree against earlier revisions (each checked out in its own directory REV with its own
venv, `pip install -e .`): they take turns with this tree's colibri on the same files, and the table
gives colibri / REV per precision and number of clients (a revision must read the file: one from
before the block kinds cannot read q4_k_m's).

    python bench/serve.py --fleet [--precisions f16] [--conc 16] [--cores 0 1]

Several machines, on this one (issue 21; root, network namespaces): a head (`colibri router`) in one
namespace and worker hosts (`colibri serve --join`, CURVE on) in others, each host held to one core of
--cores by taskset (one worker, one thread: a host stands for a machine with that core). Taking turns:
`local` (`colibri serve` with that same one worker on the first core, clients on ipc: no tcp hop),
`2 local` (two such serves, one per core, the clients split between them: what this machine gives two
servers with no head), `1 host` (the head + one host) and `2 hosts` (+ a second host on the second
core). Prints tok/s, 2 hosts / 1 host, 2 hosts / 2 local, and what the tcp hop adds to time to first
token and inter-token latency (1 host against local). The head, the clients and the router share the
cores with the hosts, and the two cores share one memory bus: on separate machines neither holds.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import decode as D  # noqa: E402  (bench-mixtral, its .colibri files and GGUFs)

GGUF = {"f16": "F16", "q8": "Q8_0", "q4": "Q4_0", "q4_k_m": "Q4_K_M", "q4_0": "Q4_0"}
FROM_GGUF = {"q4_k_m", "q4_0"}     # colibri's file is the GGUF converted with its defaults (the block kinds kept)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def prompts(n, length, seed=7):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, D.VOCAB, length)] for _ in range(n)]


def build(data: pathlib.Path, precisions, llama_bin: pathlib.Path):
    hf = D.build_hf(data)
    col = D.build_colibri(data, hf, [p for p in precisions if p not in FROM_GGUF])
    ggufs = {}
    for p in precisions:
        name = GGUF[p]
        path = data / f"bench-mixtral-{name}.gguf"
        if not path.exists():
            if name in ("F16", "F32"):
                D.write_gguf(hf, path, name)
            else:
                f32 = data / "bench-mixtral-F32.gguf"
                if not f32.exists():
                    D.write_gguf(hf, f32, "F32")
                subprocess.run([str(llama_bin / "llama-quantize"), str(f32), str(path), name, "2"], check=True,
                               stdout=subprocess.DEVNULL)
        ggufs[p] = path
        if p in FROM_GGUF:
            from colibri_server.model.gguf_import import CONVERTER_VERSION, convert_gguf
            col[p] = data / f"bench-mixtral-{name}-auto.colibri"
            if not col[p].exists() or D.converter_of(col[p]) != CONVERTER_VERSION:     # older converters: other kinds
                convert_gguf(str(path), str(col[p]), progress=False, require_tokenizer=False)
    return col, ggufs


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.tokens, self.ttft, self.itl, self.errors = 0, [], [], []
        self.cpu = {}           # process name -> CPU seconds over the clients' run (cpu_seconds)

    def add(self, stamps, t0):
        with self.lock:
            self.tokens += len(stamps)
            if stamps:
                self.ttft.append(stamps[0] - t0)
                self.itl.extend(np.diff(stamps).tolist())

    def error(self, e):
        with self.lock:
            self.errors.append(repr(e)[:200])


def cpu_seconds(server):
    """CPU seconds (user + system) so far of this process (the clients: "clients") and of the server's process tree
    (psutil.Process or None), summed by process name (colibri's master, router and workers are named apart)."""
    me = psutil.Process()
    t = me.cpu_times()
    out = {"clients": t.user + t.system}
    for p in ([server] + server.children(recursive=True)) if server is not None else []:
        try:
            name, t = p.name(), p.cpu_times()
        except psutil.Error:        # exited meanwhile
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def run_clients(conc, reqs, one, P, server=None):
    """conc client threads, each running reqs requests (one(i, prompt)) -> (Stats, wall seconds). server: the
    psutil.Process of the server, whose processes' CPU time over the run goes into Stats.cpu beside the clients'
    (the machine's cores serve both: what the clients and the server's other processes take, its workers lack)."""
    st = Stats()

    def client(i):
        for j in range(reqs):
            t0 = time.perf_counter()
            try:
                st.add(one(i, P[(i * reqs + j) % len(P)]), t0)
            except Exception as e:  # noqa: BLE001  (counted and printed, the run goes on)
                st.error(e)
    ts = [threading.Thread(target=client, args=(i,)) for i in range(conc)]
    c0, t0 = cpu_seconds(server), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall, c1 = time.perf_counter() - t0, cpu_seconds(server)
    st.cpu = {k: v - c0.get(k, 0.0) for k, v in c1.items()}
    return st, wall


def wait_until(check, what, timeout=180):
    """Until check() is true; check() may answer "starting" (alive, loading or compiling: a cold compile on a
    loaded machine takes minutes), which restarts the `timeout` s a silent server is given."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        try:
            got = check()
            if got == "starting":
                t_end = time.time() + timeout
            elif got:
                return
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start in {timeout}s")


def llama_round(a, gguf, conc, P):
    port = free_port()
    ctx = conc * (a.prompt + a.tokens + 16)
    cmd = [str(a.llama_bin / "llama-server"), "-m", str(gguf), "-t", str(a.threads), "-tb", str(a.threads),
           "-np", str(conc), "-c", str(ctx), "--port", str(port), "--host", "127.0.0.1", "-b", "512", "-ub", "512",
           "--no-warmup"] + (["--no-repack"] if a.llama_no_repack else [])
    log = open(os.path.join(a.tmp, f"llama-{conc}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        def health():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        wait_until(health, "llama-server")

        def one(i, prompt):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            body = json.dumps({"prompt": prompt, "n_predict": a.tokens, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": False, "stream": True})
            c.request("POST", "/completion", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            stamps = []
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                d = json.loads(line[6:])
                if d.get("stop"):
                    break
                stamps.append(time.perf_counter())
            c.close()
            return stamps
        one(0, P[-1])                                   # warm-up
        return run_clients(conc, a.reqs, one, P, psutil.Process(p.pid))
    finally:
        p.terminate()
        p.wait(30)
        log.close()


def colibri_clients(a, conc, P, socks, server=None):
    """conc streaming clients, client i on socks[i % len(socks)], after one warm-up request to each (server: as
    run_clients')."""
    from colibri_server.client import Client
    local = threading.local()

    def one(i, prompt):
        if not hasattr(local, "c"):
            local.c = Client(f"ipc://{socks[i % len(socks)]}", timeout=600)
        stamps = []
        with local.c.stream(prompt, max_tokens=a.tokens, temperature=0.0, ignore_eos=True) as s:
            for chunk in s:
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        return stamps
    for k in range(len(socks)):
        one(k, P[-1])
    local.__dict__.clear()      # each client thread its own connection (the warm-up ran on this one)
    return run_clients(conc, a.reqs, one, P, server)


def colibri_round(a, path, conc, P, binary=None):
    from colibri_server.client import Client
    sock = os.path.join(a.tmp, f"c{conc}.sock")
    cmd = [binary or a.colibri_bin, "serve", "--model", str(path), "--bind", f"ipc://{sock}",
           "--runtime-dir", os.path.join(a.tmp, f"run{conc}")] + a.colibri_args
    log = open(os.path.join(a.tmp, f"colibri-{conc}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        with Client(f"ipc://{sock}", timeout=2.0) as c:
            def ready():
                if p.poll() is not None:
                    raise SystemExit(f"colibri exited: see {log.name}")
                h = c.health()
                return "starting" if h["status"] == "starting" else h["status"] == "ok" and h["workers_ready"] >= 1
            wait_until(ready, "colibri")
        return colibri_clients(a, conc, P, [sock], psutil.Process(p.pid))
    finally:
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def fleet_round(a, path, conc, P, hosts, separate=False):
    """One turn of --fleet: hosts = 0 (local serve), 1 or 2 worker hosts behind a head; separate: two
    local serves instead (one per core, the clients split between them: what this machine's cores and
    memory give two servers with no head at all)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from netns_hosts import Hosts

    from colibri_server.client import Client
    from colibri_server.wire.security import generate_keys
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"fleet{hosts}-", dir=a.tmp))
    sock = tmp / "c.sock"
    socks = [sock, tmp / "c2.sock"] if separate else [sock]
    host_args = ["--workers", "1", "--threads-per-worker", "1", "--pin", "none", "--model", str(path)]
    procs, logs = [], []

    def start(argv, name, core=None):
        log = open(tmp / f"{name}.log", "w")
        logs.append(log)
        pre = ["taskset", "-c", str(core)] if core is not None else []
        procs.append(subprocess.Popen(pre + argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    names = ["a", "b"][:hosts]
    with Hosts("cfbn", names, subnet=79) if hosts else _Nothing() as net:
        try:
            if hosts == 0:
                for k, sk in enumerate(socks):
                    start([a.colibri_bin, "serve", "--bind", f"ipc://{sk}", "--runtime-dir", str(tmp / f"run{k}"),
                           *host_args], f"local{k}", a.cores[k])
            else:
                hp, hs = generate_keys(tmp / "keys", "server")
                allowed = tmp / "allowed"
                allowed.mkdir()
                start([*net.run("head"), a.colibri_bin, "router", "--model", str(path), "--bind", f"ipc://{sock}",
                       "--runtime-dir", str(tmp / "run-head"), "--backend-bind", "tcp://0.0.0.0:5556",
                       "--curve-secret-key", str(hs), "--worker-allowed-keys", str(allowed)], "head")
                for k, name in enumerate(names):
                    pub, sec = generate_keys(tmp / "keys", f"client-{name}")
                    shutil.copy(pub, allowed / os.path.basename(pub))
                    start([*net.run(name), a.colibri_bin, "serve", "--join", f"tcp://{net.head_address(name)}:5556",
                           "--join-server-key", str(hp), "--join-secret-key", str(sec),
                           "--runtime-dir", str(tmp / f"run-{name}"), *host_args], name, a.cores[k])
            for sk in socks:
                with Client(f"ipc://{sk}", timeout=2.0) as c:
                    def ready():
                        if any(p.poll() is not None for p in procs):
                            raise SystemExit(f"a colibri process exited: see {tmp}")
                        h = c.health()
                        return h["status"] == "ok" and h["workers_ready"] >= max(1, hosts)
                    wait_until(ready, "colibri", timeout=600)
            return colibri_clients(a, conc, P, socks)
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in reversed(procs):
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            for log in logs:
                log.close()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


FLEET_SYSTEMS = {"local": (0, False), "2 local": (0, True), "1 host": (1, False), "2 hosts": (2, False)}


def fleet_main(a):
    col = D.build_colibri(a.data, D.build_hf(a.data), a.precisions)
    P = prompts(512, a.prompt)

    def clients(system, conc):      # --per-host: the two-server systems get conc clients for each server
        return conc * 2 if a.per_host and system in ("2 local", "2 hosts") else conc
    rows = measure(a, [(system, lambda prec, conc, system=system:
                        fleet_round(a, col[prec], clients(system, conc), P, *FLEET_SYSTEMS[system]))
                       for system in a.systems])
    for r in rows:
        r["clients"] = clients(r["system"], r["conc"])
    load = "the same clients per server (2 servers: twice the clients)" if a.per_host else "the same clients in all"
    print(f"\nbench-mixtral, {a.prompt}-token prompts, {a.tokens} new tokens, {a.reqs} requests per client; each "
          f"host one worker on one core ({a.cores}); head, router and clients unpinned; {load}\n")
    print("| precision | clients (per server) | " + " | ".join(f"{s} tok/s" for s in a.systems) +
          " | 2 / 1 hosts | 2 hosts / 2 local | TTFT p50 ms local / 1 host | ITL p50 ms local / 1 host |")
    print("|---|---|" + "---|" * (len(a.systems) + 4))
    for prec in a.precisions:
        for conc in a.conc:
            sel = {s: [r for r in rows if r["precision"] == prec and r["conc"] == conc and r["system"] == s]
                   for s in a.systems}
            med = {s: statistics.median(r["tok_s"] for r in v) for s, v in sel.items() if v}

            def ratio(x, y):
                return f"{med[x] / med[y]:.2f}x" if x in med and y in med else "-"

            def last(s, k):
                return sel[s][-1][k] if sel.get(s) else "-"
            print(f"| {prec} | {conc} | " + " | ".join(str(med.get(s, "-")) for s in a.systems) +
                  f" | {ratio('2 hosts', '1 host')} | {ratio('2 hosts', '2 local')} | "
                  f"{last('local', 'ttft_p50_ms')} / {last('1 host', 'ttft_p50_ms')} | "
                  f"{last('local', 'itl_p50_ms')} / {last('1 host', 'itl_p50_ms')} |")
    if a.json:
        cpu = D._cpu()
        pathlib.Path(a.json).write_text(json.dumps([dict(r, cpu=cpu) for r in rows], indent=1))


def measure(a, systems):
    """Every precision, number of clients and round, the systems taking turns; one printed row each."""
    rows = []
    for prec in a.precisions:
        for conc in a.conc:
            for rnd in range(a.rounds):
                for system, fn in systems:
                    st, wall = fn(prec, conc)
                    row = dict(precision=prec, conc=conc, round=rnd, system=system, tokens=st.tokens,
                               wall_s=round(wall, 2), tok_s=round(st.tokens / wall, 1),
                               ttft_p50_ms=pct(st.ttft, 50), ttft_p99_ms=pct(st.ttft, 99),
                               itl_p50_ms=pct(st.itl, 50), itl_p99_ms=pct(st.itl, 99), errors=st.errors[:3],
                               cpu_pct={k: round(v / wall * 100, 1) for k, v in st.cpu.items()})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def pct(v, q):
    return round(float(np.percentile(v, q)) * 1e3, 1) if v else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=pathlib.Path,
                    default=os.environ.get("LLAMA_BIN", pathlib.Path(__file__).resolve().parent / ".anchors" / "bin"),
                    help="directory with llama-server and llama-quantize ($LLAMA_BIN; default bench/.anchors/bin)")
    ap.add_argument("--data", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("COLIBRI_BENCH_DATA", "~/.cache/colibri-speed")).expanduser())
    ap.add_argument("--precisions", nargs="+", default=["f16", "q4"], choices=sorted(GGUF))
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--reqs", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t/-tb")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama-server --no-repack (on an AVX-512 Xeon VM listing AMX it hangs or dies at load repacking Q4_0)")
    ap.add_argument("--colibri-bin", default=shutil.which("colibri") or str(pathlib.Path(sys.executable).parent / "colibri"))
    ap.add_argument("--against-bin", nargs="+", default=[],
                    help="other colibri installs' `colibri` (earlier revisions, each pip-installed in a venv in a "
                         "checkout: DIR/.venv/bin/colibri, named DIR): they take turns too, on the same file, and "
                         "the table gives colibri / each")
    ap.add_argument("--no-llama", action="store_true", help="leave llama-server out (with --against-bin: an A/B)")
    ap.add_argument("--colibri-args", nargs=argparse.REMAINDER, default=[],
                    help="extra `colibri serve` options (default none: the user's defaults)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--fleet", action="store_true", help="worker hosts in network namespaces instead (see above)")
    ap.add_argument("--cores", type=int, nargs=2, default=[0, 1], help="--fleet: the core of each worker host")
    ap.add_argument("--systems", nargs="+", default=list(FLEET_SYSTEMS), choices=list(FLEET_SYSTEMS),
                    help="--fleet: which layouts take turns")
    ap.add_argument("--per-host", action="store_true",
                    help="--fleet: the two-server layouts get --conc clients per server (capacity: each host as "
                         "loaded as the one host), else --conc in all")
    a = ap.parse_args()
    if a.fleet:
        a.data.mkdir(parents=True, exist_ok=True)
        a.tmp = tempfile.mkdtemp(prefix="bench-fleet-")
        return fleet_main(a)
    if not a.no_llama and (a.llama_bin is None or not (a.llama_bin / "llama-server").exists()):
        ap.error("--llama-bin DIR with llama-server (bench/build_anchors.sh builds it into bench/.anchors/bin)")
    a.data.mkdir(parents=True, exist_ok=True)
    a.tmp = tempfile.mkdtemp(prefix="bench-serve-")
    col, ggufs = build(a.data, a.precisions, a.llama_bin)
    P = prompts(512, a.prompt)
    systems = [] if a.no_llama else [("llama-server", lambda prec, conc: llama_round(a, ggufs[prec], conc, P))]
    systems.append(("colibri", lambda prec, conc: colibri_round(a, col[prec], conc, P)))
    for b in a.against_bin:
        systems.append((pathlib.Path(b).resolve().parents[2].name,
                        lambda prec, conc, b=b: colibri_round(a, col[prec], conc, P, b)))
    rows = measure(a, systems)
    print(f"\nbench-mixtral, {a.prompt}-token prompts, {a.tokens} new tokens, {a.reqs} requests per client; "
          f"colibri defaults{' + ' + ' '.join(a.colibri_args) if a.colibri_args else ''}"
          f"{'; against: ' + ' '.join(a.against_bin) if a.against_bin else ''}\n")
    names = [name for name, _ in systems]
    refs = [n for n in names if n != "colibri"]
    print("| precision | clients | " + " | ".join(f"{n} tok/s" for n in names) + " | " +
          " | ".join(f"colibri / {n}" for n in refs) + " | colibri TTFT p50/p99 ms | colibri ITL p50/p99 ms |")
    print("|---|---|" + "---|" * (len(names) + len(refs) + 2))
    for prec in a.precisions:
        for conc in a.conc:
            sel = {n: [r for r in rows if r["precision"] == prec and r["conc"] == conc and r["system"] == n]
                   for n in names}
            med = {n: statistics.median(r["tok_s"] for r in sel[n]) for n in names}
            c0 = sel["colibri"][-1]
            print(f"| {prec} | {conc} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | " +
                  " | ".join(f"{med['colibri'] / med[n]:.3f}x" for n in refs) +
                  f" | {c0['ttft_p50_ms']}/{c0['ttft_p99_ms']} | {c0['itl_p50_ms']}/{c0['itl_p99_ms']} |")
    if a.json:
        cpu = D._cpu()
        pathlib.Path(a.json).write_text(json.dumps([dict(r, cpu=cpu) for r in rows], indent=1))


if __name__ == "__main__":
    main()
