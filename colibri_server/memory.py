"""Per-process memory figures for stats and reports: RSS, USS, PSS and private anonymous.

USS counts file pages only this process has touched; with the model pre-faulted in the
master (populate), every weight page is shared and a worker's USS is its own working
memory. `Anonymous` (smaps_rollup) is private memory that no file backs: KV caches,
activations, Python heaps.
"""
from __future__ import annotations

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


def process_memory(pid) -> dict:
    """{rss, uss, pss, anon} in bytes (zeros for a process that is gone)."""
    try:
        m = psutil.Process(pid).memory_full_info()
        rss, uss, pss = m.rss, m.uss, getattr(m, "pss", 0)
    except (psutil.Error, OSError):
        return {"rss": 0, "uss": 0, "pss": 0, "anon": 0}
    return {"rss": rss, "uss": uss, "pss": pss, "anon": _rollup(pid).get("Anonymous", 0)}


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB"
