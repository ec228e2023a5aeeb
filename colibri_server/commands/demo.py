"""`colibri demo`: serve the bundled model with 2 workers, ask it one thing, show memory, stop.

The server runs as a child process whose log goes to a file in the demo's directory (removed after
a clean run, kept and named when something fails): on the terminal it would interleave with the streamed answer (`>>> def fibonacci(n):2026-... colibri.worker
INFO: ...`). Memory figures are shown once the router has sampled every worker after the
request; the router samples off its loop, so a `stats` right after the request can predate it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

READY_TIMEOUT = 300.0
SAMPLE_TIMEOUT = 10.0


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def _log_tail(path, lines=20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def sampled_after(st, t_age) -> bool:
    """Every local worker has memory figures, from a sample no older than t_age seconds."""
    local = [w for w in st["workers"] if not w.get("remote")]
    age = st.get("memory_age_s")
    return bool(local) and age is not None and age <= t_age and all(w.get("memory_sampled", True) for w in local)


def run(a, model, die):
    from ..client import Client, ColibriError
    from .status import format_status
    d = tempfile.mkdtemp(prefix="colibri-demo-")
    addr = f"ipc://{d}/colibri.sock"
    log_path = os.path.join(d, "server.log")
    _say(f"$ colibri serve --model {model} --workers {a.workers} --bind {addr}")
    _say(f"(server log: {log_path}; the first start compiles the kernels, up to a minute)")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "colibri_server.cli", "serve", "--model", model,
                                 "--workers", str(a.workers), "--bind", addr, "--runtime-dir", d],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def fail(msg, code=1):
        sys.stderr.write(_log_tail(log_path))
        die(f"{msg} (its log: {log_path})", code)
    try:
        with Client(addr, timeout=5.0) as c:
            deadline = time.monotonic() + READY_TIMEOUT
            while True:
                if proc.poll() is not None:
                    fail(f"the server exited with code {proc.returncode}", proc.returncode or 1)
                try:
                    h = c.health()
                    if h["status"] == "ok" and h["workers_ready"] >= a.workers:
                        break
                except ColibriError:
                    pass
                if time.monotonic() > deadline:
                    fail(f"the server did not become ready in {READY_TIMEOUT:.0f} s")
                time.sleep(0.2)
        with Client(addr, timeout=120.0) as c:
            print(f"\n>>> {a.prompt}", end="", flush=True)
            last = None
            for chunk in c.stream(a.prompt, max_tokens=a.max_tokens, temperature=a.temperature, seed=0):
                print(chunk.text, end="", flush=True)
                last = chunk
            done = time.monotonic()
            print(f"\n[{last.usage['completion_tokens']} tokens from worker {last.worker_pid} in "
                  f"{last.timings['total_s']:.2f}s]\n", flush=True)
            deadline = done + SAMPLE_TIMEOUT
            while True:
                st = c.stats()
                if sampled_after(st, time.monotonic() - done) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            print(format_status(st), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        _say(f"\nserver stopped (exit {proc.returncode})")
    # Reached only after a clean run (a failure leaves through die()): nothing in the directory is
    # worth keeping, and a demo run a day should not leave a directory a day in /tmp.
    if proc.returncode == 0:
        shutil.rmtree(d, ignore_errors=True)
