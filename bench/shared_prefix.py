"""Issue 16's prefix target: 32 concurrent requests sharing a 512-token system prompt (16 tokens of their
own each, 4 generated), `colibri serve` with default settings: how many prompt tokens the workers
prefilled (engine stats prefill_tokens) and the prefix-cache hits. Prefilling the system prompt once
per worker means prefill_tokens = workers x 512 + 32 x 16.

    python bench/shared_prefix.py ~/.cache/colibri-speed/bench-mixtral-f16.colibri
"""
import json
import subprocess
import sys
import threading
import time

import numpy as np

from colibri_server.client import Client

MODEL = sys.argv[1]
import tempfile

ADDR = f"ipc://{tempfile.mkdtemp()}/pfx.sock"
p = subprocess.Popen([sys.executable, "-m", "colibri_server.cli", "serve", "--model", MODEL, "--bind", ADDR],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    with Client(ADDR, timeout=600) as c:
        for _ in range(300):
            try:
                if c.health(timeout=2).get("status") == "ok":
                    break
            except Exception:
                pass
            time.sleep(1)
        rng = np.random.default_rng(0)
        system = [int(t) for t in rng.integers(10, 32000, 512)]
        res = []
        def one(i):
            suffix = [int(t) for t in np.random.default_rng(i + 1).integers(10, 32000, 16)]
            with Client(ADDR, timeout=600) as c2:
                res.append(c2.generate(system + suffix, max_tokens=4, ignore_eos=True))
        t0 = time.time()
        th = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        [t.start() for t in th]; [t.join() for t in th]
        dt = time.time() - t0
        after = c.stats()
        eng = [w["engine"] for w in after["workers"]]
        print(json.dumps({"seconds": round(dt, 1), "answered": len(res), "workers": len(eng),
                          "prefill_tokens": sum(e["prefill_tokens"] for e in eng),
                          "if_never_reused": 32 * (512 + 16),
                          "prefix_hit_tokens": sum(e["prefix_hit_tokens"] for e in eng)}))
finally:
    p.terminate(); p.wait(60)
