"""Start a real `colibri serve` (master, router, workers) in a subprocess for tests.

Waits for a server (or a gateway) to start are on its own readiness, for as long as its process
lives, never a fixed short time: a cold kernel compile on a loaded machine takes minutes. The limit,
READY_TIMEOUT (COLIBRI_TEST_READY_TIMEOUT seconds, 15 minutes unless set), is for a start that hangs;
a process that exits fails the wait at once, with its log."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from colibri_server.client import Client, ColibriError

READY_TIMEOUT = float(os.environ.get("COLIBRI_TEST_READY_TIMEOUT") or 900.0)


def child_env():
    """os.environ for a server under test: without NOTIFY_SOCKET, nor the harness's own COLIBRI_TEST_*."""
    return {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET" and not k.startswith("COLIBRI_TEST_")}


def wait_started(predicate, what="the server", procs=(), context=lambda: "", timeout=None):
    """predicate()'s first truthy value, polled every 0.1 s while every process in `procs` (Popen)
    lives: RuntimeError at once when one has exited, TimeoutError after `timeout` (READY_TIMEOUT)."""
    timeout = READY_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode} before it was ready:\n{context()}")
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout:.0f}s (COLIBRI_TEST_READY_TIMEOUT):\n{context()}")
        time.sleep(0.1)


def wait_until(predicate, timeout=30.0, what="condition", context=lambda: ""):
    """predicate()'s first truthy value, polled every 0.1 s; TimeoutError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(0.1)
    raise TimeoutError(f"{what} not met in {timeout}s:\n{context()}")


def mapped_bytes(path, pid="self") -> int:
    """Bytes of process pid's address space that map the file at `path` (/proc/PID/maps)."""
    real, total = os.path.realpath(path), 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if line.rstrip().endswith(real):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


class Server:
    def __init__(self, model, tmp_path, workers=2, extra=(), env=None, name="s", cmd="serve", prefix=()):
        """cmd: "serve", or "router" (a head: no --workers); prefix: an argv to run it under (a
        network namespace's `ip netns exec NS`)."""
        self.addr = f"ipc://{tmp_path}/{name}.sock"
        self.log_path = tmp_path / f"{name}.log"
        self.runtime = tmp_path / f"{name}-run"
        args = [sys.executable, "-m", "colibri_server.cli", cmd, "--model", str(model),
                *(("--workers", str(workers)) if cmd == "serve" else ()),
                "--bind", self.addr, "--runtime-dir", str(self.runtime), "--pin", "none", *map(str, extra)]
        e = dict(env or {})         # the caller's variables first in the environment (as `VAR=x cmd` puts them)
        e.update((k, v) for k, v in child_env().items() if k not in e)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*prefix, *args], stdout=self.log, stderr=subprocess.STDOUT, env=e)
        self.pid = self.proc.pid

    def wait_ready(self, workers=None, timeout=None, watch=()):
        """The server's health once "ok" with `workers` ready, waited for while its process (and
        those of the Servers in `watch`, e.g. worker hosts it waits for) lives; see READY_TIMEOUT."""
        with Client(self.addr, timeout=2.0) as c:
            def ready():
                try:
                    h = c.health()
                except ColibriError:
                    return None
                return h if h["status"] == "ok" and (workers is None or h["workers_ready"] >= workers) else None
            return wait_started(ready, f"server {self.addr}", [self.proc, *(w.proc for w in watch)],
                                lambda: self.logs() + "".join(f"\n--- {w.addr}:\n{w.logs()}" for w in watch),
                                timeout)

    def wait_http(self, url, timeout=None):
        """Wait until the gateway under this server answers /health with 200 (see READY_TIMEOUT)."""
        import requests

        def ok():
            try:
                return requests.get(url + "/health", timeout=10).status_code == 200
            except requests.RequestException:
                return False
        return wait_started(ok, f"gateway {url}", [self.proc], self.logs, timeout)

    def client(self, timeout=60.0):
        return Client(self.addr, timeout=timeout)

    def stats(self):
        with self.client(10.0) as c:
            return c.stats()

    def worker_pids(self, generation=None):
        return [w["pid"] for w in self.stats()["workers"]
                if w["state"] == "ready" and (generation is None or w["generation"] == generation)]

    def children(self):
        try:
            return psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig):
        os.kill(self.pid, sig)

    def logs(self):
        self.log.flush()
        return self.log_path.read_text()

    def wait_for(self, predicate, timeout=30.0, what="condition"):
        return wait_until(predicate, timeout, what, lambda: self.logs()[-4000:])

    def stop(self, timeout=30.0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for ch in self.children():
                    ch.kill()
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode
