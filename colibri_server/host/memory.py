"""Per-process memory figures for stats and reports: RSS, USS, PSS and private anonymous.

USS counts file pages only this process has touched; with the model pre-faulted in the
master (populate), every weight page is shared and a worker's USS is its own working
memory. `Anonymous` (smaps_rollup) is private memory that no file backs: KV caches,
activations, Python heaps.
"""
from __future__ import annotations

import os

import psutil


def _rollup(pid) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key.strip()] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def anonymous(pid) -> int:
    """Bytes of anonymous memory the process maps (smaps_rollup's Anonymous: heaps, stacks, buffers)."""
    return _rollup(pid).get("Anonymous", 0)


def anon_private(pid) -> int:
    """Bytes of anonymous mappings (heap, stacks, numpy buffers) that only this process maps:
    Private_Clean + Private_Dirty summed over mappings with no backing file. Unlike
    smaps_rollup's Anonymous, copy-on-write pages still shared with the master don't count."""
    total, anon = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):          # a mapping header
                    fields = line.split()
                    path = fields[5] if len(fields) > 5 else ""
                    anon = path == "" or path in ("[heap]", "[stack]") or path.startswith("[anon")
                elif anon and first in ("Private_Clean:", "Private_Dirty:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def file_mapping(pid, path) -> dict:
    """{rss, pss} of this process's mappings of the file `path`: the weight pages it holds.
    Summed over every process mapping the model, pss adds up to the pages resident once."""
    rss = pss = 0
    mine = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    fields = line.split(None, 5)
                    mine = len(fields) > 5 and fields[5].strip() == path
                elif mine and first == "Rss:":
                    rss += int(line.split()[1]) * 1024
                elif mine and first == "Pss:":
                    pss += int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"rss": rss, "pss": pss}


def process_memory(pid) -> dict:
    """{rss, uss, pss, anon, anon_private} in bytes (zeros for a process that is gone).
    anon is smaps_rollup's Anonymous (includes copy-on-write pages shared with the master)."""
    try:
        m = psutil.Process(pid).memory_full_info()
        rss, uss, pss = m.rss, m.uss, getattr(m, "pss", 0)
    except (psutil.Error, OSError):
        return {"rss": 0, "uss": 0, "pss": 0, "anon": 0, "anon_private": 0}
    return {"rss": rss, "uss": uss, "pss": pss, "anon": _rollup(pid).get("Anonymous", 0),
            "anon_private": anon_private(pid)}


def rss(pid) -> int:
    """Resident bytes of a process from /proc/PID/statm: O(1), cheap enough for any loop
    (unlike USS/PSS, which walk every mapping's page tables). 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE")


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB"


class MemorySampler:
    """Memory figures of a set of processes, gathered on a thread of their own and cached.

    Reading /proc/PID/smaps walks the page tables of every mapping: ~130 ms per worker of a
    multi-GiB model. The router's event loop must never wait on it (300 pipelined `stats`
    once delayed a generate by 33 s), so `stats` answers from this cache, and a stale or
    incomplete cache only wakes the sampling thread. The thread is started lazily, after fork.
    """

    def __init__(self, max_age: float = 2.0):
        import threading
        self.max_age = max_age
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._targets: tuple = ((), "")
        self._figures: dict = {}          # pid -> {rss, uss, pss, anon, anon_private, model_rss, model_pss}
        self._at = None                   # time.monotonic() of the last completed sample

    def refresh(self, pids, path) -> None:
        """Ask for figures of `pids` (and their mappings of `path`); never blocks."""
        import threading
        import time
        targets = (tuple(sorted(p for p in pids if p)), path)
        with self._lock:
            changed = targets != self._targets
            self._targets = targets
            stale = self._at is None or time.monotonic() - self._at > self.max_age
        if changed or stale:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="colibri-memory", daemon=True)
                self._thread.start()
            self._wake.set()

    def get(self, pid) -> dict:
        """The cached figures of pid, with its RSS read now (cheap: statm). memory_sampled is
        False (and the other figures 0) until a sample has covered pid: a worker that just
        started, or a `stats` before the sampling thread's first pass."""
        with self._lock:
            f = self._figures.get(pid)
        out = dict(f) if f else {"rss": 0, "uss": 0, "pss": 0, "anon": 0, "anon_private": 0,
                                 "model_rss": 0, "model_pss": 0}
        out["rss"] = rss(pid)
        out["memory_sampled"] = f is not None
        return out

    def age(self):
        import time
        return None if self._at is None else round(time.monotonic() - self._at, 1)

    def _run(self):
        import time
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                pids, path = self._targets
            out = {}
            for pid in pids:
                fm = file_mapping(pid, path)
                out[pid] = {**process_memory(pid), "model_rss": fm["rss"], "model_pss": fm["pss"]}
            with self._lock:
                self._figures = out
                self._at = time.monotonic()
