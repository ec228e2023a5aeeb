"""Soak under faults: concurrent clients while a chaos loop kills workers, scales the pool and
hot-reloads the model. A ledger records every request; one silent or lost request fails.

Used by tests/soak/test_soak.py (120 s, marker `soak`) and tests/test_soak_short.py (20 s,
default suite). Run the long one with:  python -m pytest -m soak -s tests/soak
"""
from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import threading
import time

import numpy as np
from server_harness import Server

from colibri_server.client import ColibriError
from colibri_server.host.memory import process_memory

ALLOWED_ERRORS = {"worker_lost"}     # a worker killed after streaming: explicit, expected under chaos


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.entries = []                 # (kind, detail, latency_s)

    def add(self, kind, detail, latency):
        with self.lock:
            self.entries.append((kind, detail, latency))


def _client_loop(server, ledger, stop, seed):
    rng = random.Random(seed)
    with server.client(timeout=60.0) as c:
        while not stop.is_set():
            n = rng.randint(4, 16)
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(2, 12))]
            t0 = time.monotonic()
            try:
                if rng.random() < 0.5:
                    chunks = list(c.stream(prompt, max_tokens=n, ignore_eos=True))
                    ids = [t for ch in chunks for t in ch.token_ids]
                    reason = chunks[-1].finish_reason
                else:
                    r = c.generate(prompt, max_tokens=n, ignore_eos=True)
                    ids, reason = r.token_ids, r.finish_reason
                ok = reason == "length" and len(ids) == n
                ledger.add("done" if ok else "wrong", (n, len(ids), reason), time.monotonic() - t0)
            except ColibriError as e:
                ledger.add("silent" if e.code == "timeout" else "error:" + e.code, e.message, time.monotonic() - t0)


def _chaos(server, models, live, stop, events, kill_every=3.0, scale_every=7.0, reload_every=20.0):
    rng = random.Random(1)
    t0 = time.monotonic()
    next_kill, next_scale, next_reload = t0 + kill_every, t0 + scale_every, t0 + reload_every
    flip, grow = 1, True
    while not stop.wait(0.1):
        now = time.monotonic()
        if now >= next_kill:
            next_kill += kill_every
            try:
                pids = [p.pid for p in server.children() if p.pid != _router_pid(server)]
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    events["kill"] += 1
            except (ProcessLookupError, ColibriError):
                pass
        if now >= next_scale:
            next_scale += scale_every
            server.signal(signal.SIGTTIN if grow else signal.SIGTTOU)
            events["ttin" if grow else "ttou"] += 1
            grow = not grow
        if now >= next_reload:
            next_reload += reload_every
            tmp = str(live) + ".new"
            shutil.copy(models[flip % 2], tmp)
            os.replace(tmp, live)
            server.signal(signal.SIGUSR1)
            events["reload"] += 1
            flip += 1


def _router_pid(server):
    return server._router_pid


def run_soak(tmp_path, model_a, model_b, seconds, clients=32, workers=2, reload_every=20.0):
    live = tmp_path / "live.colibri"
    shutil.copy(model_a, live)
    server = Server(live, tmp_path, workers=workers, extra=("--timeout", "10"), name="soak")
    events = collections.Counter()
    try:
        server.wait_ready(workers)
        st = server.stats()
        server._router_pid = st["router"]["pid"]
        mem0 = {"master": process_memory(server.pid)["rss"], "router": st["router"]["rss"]}
        ledger, stop, stop_chaos = Ledger(), threading.Event(), threading.Event()
        threads = [threading.Thread(target=_client_loop, args=(server, ledger, stop, i), daemon=True)
                   for i in range(clients)]
        chaos = threading.Thread(target=_chaos, args=(server, (model_a, model_b), live, stop_chaos, events),
                                 kwargs={"reload_every": reload_every},
                                 daemon=True)
        for t in threads:
            t.start()
        chaos.start()
        time.sleep(seconds)
        stop_chaos.set()
        chaos.join()
        stop.set()
        for t in threads:
            t.join(120)
        hung = sum(t.is_alive() for t in threads)
        server.wait_for(lambda: server.stats()["queue"] == 0, what="queue drained")
        st = server.stats()
        mem1 = {"master": process_memory(server.pid)["rss"], "router": st["router"]["rss"]}
        restarts = server.logs().count("booting") - workers
    finally:
        server.stop()
    kinds = collections.Counter(k for k, _, _ in ledger.entries)
    lat = np.array([l for k, _, l in ledger.entries if k == "done"]) * 1e3
    report = {
        "seconds": seconds, "clients": clients, "requests": len(ledger.entries), "served": kinds["done"],
        "errors": {k[6:]: v for k, v in kinds.items() if k.startswith("error:")},
        "silent": kinds["silent"], "wrong": kinds["wrong"], "hung_clients": hung,
        "retries": st["counters"].get("retries", 0), "worker_restarts": restarts, "chaos": dict(events),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "rss_mib": {k: (round(mem0[k] / 2**20, 1), round(mem1[k] / 2**20, 1)) for k in mem0},
        "generation": st["generation"],
    }
    return report


def check(report):
    assert report["silent"] == 0 and report["hung_clients"] == 0, report
    assert report["wrong"] == 0, report
    assert set(report["errors"]) <= ALLOWED_ERRORS, report
    assert report["served"] > 0
    for who, (a, b) in report["rss_mib"].items():
        assert b - a < 64, f"{who} RSS grew from {a} to {b} MiB"


def print_report(r):
    print(f"\nsoak {r['seconds']}s, {r['clients']} clients: {r['requests']} requests, {r['served']} served, "
          f"errors {r['errors'] or 'none'}, silent {r['silent']}, wrong {r['wrong']}, retries {r['retries']}, "
          f"worker restarts {r['worker_restarts']} (chaos {r['chaos']}), latency p50 {r['p50_ms']:.0f} ms "
          f"p99 {r['p99_ms']:.0f} ms, final generation {r['generation']}, RSS MiB (start, end) {r['rss_mib']}")
