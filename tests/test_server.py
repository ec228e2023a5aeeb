"""The pre-fork server, as real processes: master, router, workers on ipc:// in a temp dir.

Each test states its promise: every request ends in done or an explicit error, greedy
answers equal the in-process Model, workers are replaced, generations switch cleanly.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from server_harness import Server

from colibri_server.client import ColibriError
from colibri_server.model import Model

PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, 512, size=6 + i % 5)] for i in range(16)]


@pytest.fixture(scope="module")
def model_path(built):
    return built("mixtral").colibri("f32")


@pytest.fixture
def server(model_path, tmp_path):
    servers = []

    def start(workers=2, model=model_path, extra=(), ready=True):
        s = Server(model, tmp_path, workers=workers, extra=extra, name=f"s{len(servers)}")
        servers.append(s)
        if ready:
            s.wait_ready(workers)
        return s
    yield start
    for s in servers:
        s.stop()


class Load:
    """n client threads, each sending `per_client` requests; records every outcome."""

    def __init__(self, server, n=16, per_client=4, max_tokens=8, stream=False, until=None, prompts=PROMPTS):
        self.server, self.n, self.per_client, self.max_tokens = server, n, per_client, max_tokens
        self.until, self.prompts, self.stream = until, prompts, stream
        self.results, self.errors, self.silent = [], [], []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def _run(self, i):
        with self.server.client(timeout=30.0) as c:
            k = 0
            while (self.until is None and k < self.per_client) or (self.until is not None and not self.until.is_set()):
                prompt = self.prompts[(i + k) % len(self.prompts)]
                k += 1
                try:
                    if self.stream:
                        chunks = list(c.stream(prompt, max_tokens=self.max_tokens, ignore_eos=True))
                        final = chunks[-1]
                        ids = [t for ch in chunks[:-1] for t in ch.token_ids] + list(final.token_ids)
                        res = (prompt, ids, final.finish_reason, final.generation)
                    else:
                        r = c.generate(prompt, max_tokens=self.max_tokens, ignore_eos=True)
                        res = (prompt, r.token_ids, r.finish_reason, r.generation)
                    with self.lock:
                        self.results.append(res)
                except ColibriError as e:
                    with self.lock:
                        (self.silent if e.code == "timeout" else self.errors).append((prompt, e.code, e.message))

    def join(self, timeout=120):
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "client threads hung"
        return self


def test_concurrent_clients_get_the_in_process_answers(server, model_path):
    s = server(workers=2)
    load = Load(s, n=16, per_client=4).start().join()
    assert not load.errors and not load.silent
    assert len(load.results) == 64
    m = Model.open(model_path)
    want = {tuple(p): m.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS}
    for prompt, ids, reason, gen in load.results:
        assert ids == want[tuple(prompt)] and reason == "length" and gen == 1
    st = s.stats()
    assert st["counters"]["done"] == 64
    assert sorted(w["served"] for w in st["workers"]) != [0, 64]     # both workers served


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the process may run on one CPU: a worker gets one thread")
def test_threads_per_worker_splits_decode_and_keeps_the_answers(server, model_path):
    # the parallel kernels are compiled in the master and launched only in the forked worker,
    # on a fork-safe layer (tbb where installed, else workqueue; never omp)
    s = server(workers=1, extra=("--threads-per-worker", "2"))
    s.wait_for(lambda: "decode on 2 threads" in s.logs(), what="the worker's thread log line")
    layer = s.logs().split("decode on 2 threads (numba ")[1].split(" ")[0]
    assert layer in ("tbb", "workqueue")
    load = Load(s, n=4, per_client=2).start().join()
    assert not load.errors and not load.silent and len(load.results) == 8
    m = Model.open(model_path)
    want = {tuple(p): m.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS}
    for prompt, ids, reason, gen in load.results:
        assert ids == want[tuple(prompt)]


@pytest.mark.slow   # 56 s cold (threaded panel kernels); test_panels checks them in-process, threads included
def test_panel_file_served_on_two_threads_keeps_the_answers(server, tmp_path):
    """A file in panels (f16p; hidden 256 so the matrices are whole panels): the threaded panel
    kernels compiled before fork split each panel's rows, and the answers equal one thread's."""
    import hf_models as H

    from colibri_server.model.convert import convert
    H.build_hf_model("mixtral", tmp_path / "hf", hidden_size=256, intermediate_size=256)
    path = str(tmp_path / "panels.colibri")
    convert(tmp_path / "hf", path, "f16", progress=False)
    m = Model.open(path)
    assert m.file.records["blk.0.ffn_down_exps"].dtype == "f16p"
    s = server(workers=1, model=path, extra=("--threads-per-worker", "2"))
    s.wait_for(lambda: "decode on 2 threads" in s.logs(), what="the worker's thread log line")
    load = Load(s, n=2, per_client=2).start().join()
    assert not load.errors and not load.silent and len(load.results) == 4
    for prompt, ids, reason, gen in load.results:
        assert ids == m.generate(prompt, max_tokens=8, ignore_eos=True)


def test_prefill_bf16_setting_reaches_the_workers(server, built, model_path):
    """prefill_bf16 is applied in each worker: in effect on a bf16 file (where the CPU has
    avx512bf16), and on a file without bf16 matrices the worker says why it has no effect;
    the server answers either way."""
    from colibri_server.model.kernels import gemm as GE
    s = server(workers=1, extra=("--prefill-bf16",))
    s.wait_for(lambda: "prefill_bf16 has no effect: the model has no bf16 matrices" in s.logs(), timeout=180,
               what="the worker's prefill_bf16 warning")
    bf16 = built("mixtral").colibri("bf16")
    s2 = server(workers=1, model=bf16, extra=("--prefill-bf16",))
    want = "prefill of bf16 weights with bf16 activations" if GE.HAVE_BF16_GEMM else "this CPU has no avx512bf16"
    # (a cold master compiles the bf16 kernels before its worker says this: over 30 s on a loaded VM)
    s2.wait_for(lambda: want in s2.logs(), timeout=180, what="the worker's prefill_bf16 log line")
    load = Load(s2, n=2, per_client=2).start().join()
    assert not load.errors and not load.silent and len(load.results) == 4
    m = Model.open(bf16, prefill_bf16=True)
    for prompt, ids, reason, gen in load.results:
        assert ids == m.generate(prompt, max_tokens=8, ignore_eos=True)


def test_kill_9_under_load_loses_nothing(server):
    s = server(workers=2)
    load = Load(s, n=16, per_client=4, max_tokens=32, stream=True).start()
    time.sleep(1.0)
    victim = s.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    load.join()
    assert not load.silent, load.silent
    assert len(load.results) + len(load.errors) == 64
    assert all(code == "worker_lost" for _, code, _ in load.errors), load.errors
    assert all(reason == "length" and len(ids) == 32 for _, ids, reason, _ in load.results)
    s.wait_for(lambda: len(s.worker_pids()) == 2 and victim not in s.worker_pids(), what="replacement")


def test_request_with_no_token_yet_is_retried_on_another_worker(server):
    s = server(workers=2)
    a, b = s.worker_pids()
    os.kill(a, signal.SIGSTOP)               # a takes work but cannot stream it
    try:
        out = {}

        def one(i):
            with s.client(30) as c:
                out[i] = c.generate(PROMPTS[i], max_tokens=4, ignore_eos=True)
        ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        time.sleep(1.0)
        os.kill(a, signal.SIGKILL)
        for t in ts:
            t.join(30)
    finally:
        try:
            os.kill(a, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert len(out) == 2 and all(r.finish_reason == "length" for r in out.values())
    assert all(r.worker_pid == b or r.worker_pid not in (a,) for r in out.values())
    assert s.stats()["counters"].get("retries", 0) >= 1


def test_ttin_ttou_change_worker_count(server):
    s = server(workers=1)
    s.signal(signal.SIGTTIN)
    s.wait_for(lambda: len(s.worker_pids()) == 2, what="TTIN -> 2 workers")
    s.signal(signal.SIGTTOU)
    s.wait_for(lambda: len(s.worker_pids()) == 1 and len(s.children()) == 2, what="TTOU -> 1 worker")
    s.signal(signal.SIGTTOU)            # never below 1
    time.sleep(1.0)
    assert len(s.worker_pids()) == 1
    with s.client() as c:
        assert c.generate(PROMPTS[0], max_tokens=3).finish_reason in ("length", "stop")


def test_hup_replaces_every_worker_without_failures(server):
    s = server(workers=2)
    before = set(s.worker_pids())
    stop = threading.Event()
    load = Load(s, n=4, until=stop).start()
    time.sleep(0.5)
    s.signal(signal.SIGHUP)
    s.wait_for(lambda: (lambda p: len(p) == 2 and not p & before)(set(s.worker_pids(generation=2))),
               what="generation 2 workers")
    s.wait_for(lambda: not set(s.worker_pids()) & before, what="old workers gone")
    time.sleep(0.5)
    stop.set()
    load.join()
    assert not load.errors and not load.silent and len(load.results) > 8


def test_usr1_hot_reload_under_load(server, tmp_path, built):
    path = tmp_path / "live.colibri"
    shutil.copy(built("mixtral").colibri("f32"), path)
    s = server(workers=2, model=path)
    other = tmp_path / "other.colibri"
    import hf_models as H

    from colibri_server.model.convert import convert
    H.build_hf_model("mixtral", tmp_path / "hf2", seed=1)
    convert(tmp_path / "hf2", other, "f32", progress=False)
    stop = threading.Event()
    load = Load(s, n=4, until=stop).start()
    time.sleep(0.5)
    os.replace(other, path)                   # a deploy: rename, never write in place
    s.signal(signal.SIGUSR1)
    s.wait_for(lambda: len(s.worker_pids(generation=2)) == 2, what="generation 2")
    time.sleep(1.0)
    stop.set()
    load.join()
    assert not load.errors and not load.silent
    new = Model.open(path)
    with s.client() as c:
        r = c.generate(PROMPTS[3], max_tokens=8, ignore_eos=True)
    assert r.generation == 2 and r.token_ids == new.generate(PROMPTS[3], max_tokens=8, ignore_eos=True)
    s.wait_for(lambda: all(w["generation"] == 2 for w in s.stats()["workers"]), what="old generation drained")


def test_usr1_with_a_corrupted_file_is_refused(server, tmp_path, model_path):
    path = tmp_path / "live.colibri"
    shutil.copy(model_path, path)
    s = server(workers=1, model=path)
    bad = tmp_path / "bad.colibri"
    data = bytearray(path.read_bytes())
    data[0:4] = b"XXXX"
    bad.write_bytes(data)
    os.replace(bad, path)
    s.signal(signal.SIGUSR1)
    s.wait_for(lambda: "refused" in s.logs(), what="refusal logged")
    assert "BadMagic" in s.logs() or "magic" in s.logs()
    with s.client() as c:
        r = c.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    assert r.generation == 1 and r.finish_reason == "length"


def test_term_while_streaming_finishes_requests(server):
    s = server(workers=2, extra=("--graceful-timeout", "20"))
    load = Load(s, n=4, per_client=1, max_tokens=48, stream=True).start()
    time.sleep(0.8)
    t0 = time.monotonic()
    s.signal(signal.SIGTERM)
    load.join()
    s.proc.wait(30)
    assert s.proc.returncode == 0
    assert time.monotonic() - t0 < 20
    done = [r for r in load.results if r[2] == "length" and len(r[1]) == 48]
    assert len(done) == 4, (load.results, load.errors)


@pytest.mark.parametrize("how", ["INT", "TERM past graceful_timeout", "QUIT to the worker alone"])
def test_a_stop_that_cuts_a_stream_says_so_not_worker_lost(server, how):
    """Ctrl-C (SIGINT: a fast stop) or a SIGTERM whose graceful_timeout runs out, with a stream in
    flight: the client is told the server is stopping (shutting_down), not worker_lost ("worker N
    died after streaming tokens", which reads as a crash). The router knows
    the server stops; a worker told to quit says so itself, for a router that does not (a worker
    host's fast stop SIGQUITs its workers while the head serves on). The worker is paused
    mid-stream (SIGSTOP) so the stop lands while the request still runs."""
    from test_http import Throttle
    s = server(workers=1, extra=("--graceful-timeout", "1"))
    (wpid,) = s.worker_pids()
    throttle = Throttle([wpid]).__enter__()      # no __exit__: the worker ends resumed (INT) or killed (TERM)
    with s.client(timeout=30) as c:
        stream = c.stream(PROMPTS[0], max_tokens=200, ignore_eos=True)
        throttle.start()
        first = next(stream)
        throttle.stop.set()
        throttle.thread.join(5)          # it leaves the worker stopped
        assert first.text is not None
        if how.startswith("QUIT"):
            os.kill(wpid, signal.SIGQUIT)
        else:
            s.signal(signal.SIGINT if how == "INT" else signal.SIGTERM)
        time.sleep(0.5)                  # the master has told the router and signalled the worker
        if not how.startswith("TERM"):
            os.kill(wpid, signal.SIGCONT)    # it takes its SIGQUIT (TERM: it stays stopped until killed)
        with pytest.raises(ColibriError) as e:
            for _ in stream:
                pass
    assert e.value.code == "shutting_down", (e.value.code, e.value.message)
    assert "stopping" in e.value.message and "not a crash" in e.value.message
    if not how.startswith("QUIT"):
        s.proc.wait(30)


def test_sigstopped_worker_is_replaced_within_timeout(server):
    s = server(workers=1, extra=("--timeout", "3", "--heartbeat-interval", "0.5"))
    (victim,) = s.worker_pids()
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    s.wait_for(lambda: (lambda p: len(p) == 1 and victim not in p)(s.worker_pids()), timeout=20,
               what="stopped worker replaced")
    assert time.monotonic() - t0 < 3 + 5
    assert "silent" in s.logs()
    with s.client() as c:
        assert c.generate(PROMPTS[1], max_tokens=2).usage["completion_tokens"] >= 1


def test_worker_boot_failure_halts_the_master(server):
    s = server(workers=1, extra=("--memory-limit", "1KiB"), ready=False)
    assert s.proc.wait(60) == 3
    log = s.logs()
    assert "failed to boot" in log and "memory_limit" in log
    assert log.count("booting") == 1            # no respawn loop


def test_bad_settings_fail_at_start_naming_them(model_path, tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "serve", "--model", model_path,
                        "--workers", "-2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "workers" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "serve", "--model",
                        str(tmp_path / "missing.colibri"), "--bind", f"ipc://{tmp_path}/x.sock",
                        "--runtime-dir", str(tmp_path / "rt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and "model file not found" in r.stderr


def test_memory_one_copy_of_the_weights(tmp_path):
    """4 workers on a 933 MiB model, after serving: each worker's private memory is small and
    the workers' summed PSS is about one copy of the file (the master pre-faults every page)."""
    from synth_model import write_model
    path = tmp_path / "big.colibri"
    size = write_model(path)
    # the kernels for this model's types into Numba's cache first, as after a service's first start
    # (systemd: NUMBA_CACHE_DIR): a master compiling them cold holds LLVM's memory, 50-100 MiB shared
    # copy-on-write with its workers, which the Anonymous bound below would count
    subprocess.run([sys.executable, "-c", "import sys; from colibri_server.model import Model; "
                    "Model.open(sys.argv[1]).generate([1, 1], max_tokens=2, ignore_eos=True)", str(path)],
                   check=True, timeout=600)
    s = Server(path, tmp_path, workers=4, name="mem")
    try:
        s.wait_ready(4)
        with s.client(120) as c:
            for i in range(8):
                c.generate(PROMPTS[i], max_tokens=4, ignore_eos=True)
        done = time.monotonic()
        # memory figures come from the router's sampling thread (never read in its loop): wait
        # for a sample taken after the generates
        st = s.wait_for(lambda: (lambda st: st if st["memory_age_s"] is not None and
                                 st["memory_age_s"] < time.monotonic() - done else None)(s.stats()),
                        timeout=30, what="a fresh memory sample")
        ws = st["workers"]
        router_maps = open(f"/proc/{st['router']['pid']}/maps").read()
    finally:
        s.stop()
    mib = 2 ** 20
    # the router: forked before the model is opened, it maps neither the file nor LLVM (it imports the tokenizer,
    # never the engine or Numba), so its memory does not grow with the model (SmolLM2 with its tokenizer: ~90 MiB)
    print(f"router RSS {st['router']['rss'] / mib:.1f} MiB")
    assert str(path) not in router_maps and "llvmlite" not in router_maps
    assert st["router"]["rss"] < 64 * mib
    print(f"\nmodel file {size / mib:.0f} MiB; per worker (MiB): " + "; ".join(
        f"pid {w['pid']} served {w['served']} RSS {w['rss'] / mib:.0f} USS {w['uss'] / mib:.1f} "
        f"PSS {w['pss'] / mib:.0f} Anonymous {w['anon'] / mib:.1f} private-anon {w['anon_private'] / mib:.1f}"
        for w in ws))
    pss = sum(w["pss"] for w in ws)
    uss = max(w["uss"] for w in ws)
    resident = st["master"]["model_pss"] + sum(w["model_pss"] for w in ws)
    print(f"model file pages resident, summed PSS over master and workers: {resident / mib:.0f} MiB "
          f"(file {size / mib:.0f} MiB)")
    assert abs(resident - size) < size * 0.02          # exactly one copy of the weights
    print(f"summed PSS {pss / mib:.0f} MiB <= file + 4 x USS + 10% = {(size + 4 * uss + size / 10) / mib:.0f} MiB")
    assert len(ws) == 4 and all(w["served"] >= 1 for w in ws)
    for w in ws:
        # no private copy of anything large; `anon` (printed) also counts the master's heap shared
        # copy-on-write (interpreter, numpy, LLVM: ~80 MiB, ~135 when the master compiled cold)
        assert w["anon_private"] < size / 10 and w["uss"] < size / 10
    assert pss < size + 4 * uss + size / 10


def test_model_file_changed_in_place_is_logged_loudly(server, tmp_path, model_path):
    path = tmp_path / "live.colibri"
    shutil.copy(model_path, path)
    s = server(workers=1, model=path)
    with open(path, "r+b") as f:            # what an operator must never do: write the mapped file
        f.seek(-16, os.SEEK_END)
        f.write(b"\0" * 16)
    os.utime(path, None)
    s.wait_for(lambda: "modified IN PLACE" in s.logs(), what="in-place change logged")
    assert "CRITICAL" in s.logs()


def test_a_truncated_model_is_faulty_in_health_not_retried_and_a_hup_to_a_good_file_replaces_it(
        server, tmp_path, model_path):
    """A model file truncated under the map: health says the generation is faulty and why (not ok);
    a request that meets the missing pages kills its worker with SIGBUS once, not once per retry;
    a good file renamed over the path and a HUP bring a generation that serves, and health is ok."""
    path = tmp_path / "live.colibri"
    shutil.copy(model_path, path)
    s = server(workers=1, model=path)
    with s.client() as c:
        assert c.health()["status"] == "ok"
        os.truncate(path, os.path.getsize(path) // 2)      # what an operator must never do
        s.wait_for(lambda: c.health()["status"] == "faulty", what="health saying faulty")
        h = c.health()
        assert "changed in place (truncated)" in h["reason"] and str(path) in h["reason"], h
        with pytest.raises(ColibriError) as e:
            c.generate(PROMPTS[0], max_tokens=4, timeout=60)
        assert e.value.code == "worker_lost" and "not retried: the model is faulty" in e.value.message, e.value
    assert s.logs().count("SIGBUS") <= 2, s.logs()[-3000:]      # its one death (logged, and named in the fault)
    good = tmp_path / "good.colibri"
    shutil.copy(model_path, good)
    os.replace(good, path)
    s.signal(signal.SIGHUP)
    with s.client() as c:
        s.wait_for(lambda: c.health()["status"] == "ok" and c.health()["generation"] == 2, timeout=120,
                   what="generation 2 serving")
        assert c.generate(PROMPTS[0], max_tokens=4).token_ids


def test_repeated_crashes_back_off(server):
    s = server(workers=1)
    for i in range(5):
        (pid,) = s.wait_for(lambda: s.worker_pids() or None, what=f"worker {i}")
        os.kill(pid, signal.SIGKILL)
        s.wait_for(lambda: pid not in s.worker_pids(), what="death noticed")
    s.wait_for(lambda: "before respawning" in s.logs(), what="backoff logged")
    s.wait_for(lambda: len(s.worker_pids()) == 1, timeout=30, what="respawn after the backoff")


def test_cli_generate_status_and_async_client(server):
    import asyncio
    import subprocess
    import sys

    from colibri_server.client import AsyncClient
    s = server(workers=2)
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "generate", "--connect", s.addr, "--max-tokens", "6",
                        "--ignore-eos", "def f(x):"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "[length; 6 tokens; worker" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "status", "--connect", s.addr],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generation 1" in r.stdout and "weights    one copy" in r.stdout
    assert all(str(pid) in r.stdout for pid in s.worker_pids())

    async def many():
        async with AsyncClient(s.addr, timeout=60) as c:
            return await asyncio.gather(*[c.generate(p, max_tokens=5, ignore_eos=True) for p in PROMPTS[:8]])
    results = asyncio.run(many())
    with s.client() as c:
        for p, res in zip(PROMPTS[:8], results):
            assert res.token_ids == c.generate(p, max_tokens=5, ignore_eos=True).token_ids


def test_mlock_beyond_rlimit_fails_at_start_naming_the_limit(model_path, tmp_path):
    import resource
    import subprocess
    import sys

    def low_limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "serve", "--model", model_path, "--mlock",
                        "--bind", f"ipc://{tmp_path}/m.sock", "--runtime-dir", str(tmp_path / "rt")],
                       capture_output=True, text=True, timeout=120, preexec_fn=low_limit)
    assert r.returncode == 4 and "RLIMIT_MEMLOCK" in r.stderr and "LimitMEMLOCK" in r.stderr


def test_mlock_and_populate_within_the_limit(server, model_path):
    import resource
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft != resource.RLIM_INFINITY and soft < os.path.getsize(model_path):
        pytest.skip("RLIMIT_MEMLOCK below the test model's size")
    s = server(workers=1, extra=("--mlock", "--populate"))
    assert "locked in memory" in s.logs()
    with s.client() as c:
        assert c.generate(PROMPTS[2], max_tokens=2).usage["completion_tokens"] >= 1
