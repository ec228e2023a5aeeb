"""Start a real `colibri serve` (master, router, workers) in a subprocess for tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from colibri_server.client import Client, ColibriError


def wait_until(predicate, timeout=30.0, what="condition", context=lambda: ""):
    """predicate()'s first truthy value, polled every 0.1 s; TimeoutError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(0.1)
    raise TimeoutError(f"{what} not met in {timeout}s:\n{context()}")


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
        e = dict(os.environ)
        e.pop("NOTIFY_SOCKET", None)
        e.update(env or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*prefix, *args], stdout=self.log, stderr=subprocess.STDOUT, env=e)
        self.pid = self.proc.pid

    def wait_ready(self, workers=None, timeout=60.0):
        deadline = time.monotonic() + timeout
        with Client(self.addr, timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
                try:
                    h = c.health()
                    if h["status"] == "ok" and (workers is None or h["workers_ready"] >= workers):
                        return h
                except ColibriError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.logs()}")

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
