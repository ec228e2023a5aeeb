"""Serving overhead and throughput, measured against the in-process Model in the same run.

    python bench/serve.py [--data DIR] [--requests 200] [--seconds 20] [--json OUT]

1. Round-trip overhead of a 1-token request through client -> router -> worker -> router ->
   client, against the same request made in-process (Model.complete): p50 / p99 of each
   and of the difference. Model: a tiny Mixtral (bench-mixtral shape with 2 layers, f16).
2. Aggregate decode throughput (tokens/s) on bench-mixtral (f16, 933 MiB) with 1 and 2
   workers, 4 concurrent clients each asking for 64 tokens, for --seconds each; beside the
   in-process single-stream decode rate.
Prints a table and writes JSON. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from server_harness import Server  # noqa: E402
from synth_model import write_model  # noqa: E402

from colibri_server.model import Model  # noqa: E402


def pct(a, q):
    return float(np.percentile(np.asarray(a) * 1e3, q))


def timed(call, n, warmup=5):
    """Seconds taken by each of n calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def overhead(model_path, tmp, n):
    m = Model.open(model_path)
    prompt = [5, 6, 7, 8]
    local = timed(lambda: m.complete(prompt, max_tokens=1), n)
    s = Server(model_path, tmp, workers=1, name="ovh")
    try:
        s.wait_ready(1)
        with s.client() as c:
            remote = timed(lambda: c.generate(prompt, max_tokens=1), n)
    finally:
        s.stop()
    return {"in_process_ms": {"p50": pct(local, 50), "p99": pct(local, 99)},
            "served_ms": {"p50": pct(remote, 50), "p99": pct(remote, 99)},
            "overhead_ms": {"p50": pct(remote, 50) - pct(local, 50), "p99": pct(remote, 99) - pct(local, 99)}}


def throughput(model_path, tmp, workers, seconds, clients=4, max_tokens=64):
    s = Server(model_path, tmp, workers=workers, name=f"tp{workers}")
    tokens, stop = [0], threading.Event()
    lock = threading.Lock()

    def client(i):
        with s.client(300) as c:
            while not stop.is_set():
                r = c.generate([5 + i, 6, 7, 8], max_tokens=max_tokens, ignore_eos=True)
                with lock:
                    tokens[0] += len(r.token_ids)
    try:
        s.wait_ready(workers, timeout=180)
        with s.client(300) as c:
            c.generate([5, 6, 7], max_tokens=4)       # warm
        ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        s.stop()
    return tokens[0] / dt


def local_decode(model_path, n=64):
    m = Model.open(model_path)
    m.complete([5, 6, 7, 8], max_tokens=4, ignore_eos=True)
    c = m.complete([5, 6, 7, 8], max_tokens=n, ignore_eos=True)
    return (n - 1) / c.timings["decode_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/.cache/colibri-bench"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    data = pathlib.Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    small, big = data / "synth-small-f16.colibri", data / "synth-bench-mixtral-f16.colibri"
    if not small.exists():
        write_model(small, num_layers=2)
    if not big.exists():
        write_model(big)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="colibri-bench-serve-"))
    res = {"overhead": overhead(small, tmp, a.requests)}
    res["decode_in_process_tok_s"] = local_decode(big)
    res["aggregate_tok_s"] = {w: throughput(big, tmp, w, a.seconds) for w in (1, 2)}
    o = res["overhead"]
    print(f"1-token request, {a.requests} times (ms)      p50      p99")
    for k in ("in_process_ms", "served_ms", "overhead_ms"):
        print(f"  {k:34} {o[k]['p50']:8.3f} {o[k]['p99']:8.3f}")
    print(f"bench-mixtral f16: in-process decode {res['decode_in_process_tok_s']:.1f} tok/s (1 stream)")
    for w, v in res["aggregate_tok_s"].items():
        print(f"  served, {w} worker(s), 4 clients x 64 tokens: {v:.1f} tok/s aggregate")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
