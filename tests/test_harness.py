"""The test harness's waits for a server to start are on the server's own readiness while its
process lives (issue 33 item 4): a cold kernel compile on a loaded machine outran a fixed 60 s once
and took 206 tests down with it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_harness import READY_TIMEOUT


class _Clock:
    """time for server_harness: every sleep advances it by `step` seconds (a slow machine in a blink)."""

    def __init__(self, step):
        self.now, self.step = 1000.0, step

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += self.step


def test_the_harness_waits_for_a_slow_start_while_the_server_lives(monkeypatch):
    """Server.wait_ready waits on the server's own health while its process lives: a start that
    takes 10 minutes (a cold compile on one loaded core) is waited for; a process that exits fails
    the wait at once; one never ready fails at READY_TIMEOUT."""
    import server_harness as H
    polls = {"n": 0}

    class SlowClient:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def health(self):
            polls["n"] += 1
            ok = polls["n"] > 120
            return {"status": "ok" if ok else "starting", "workers_ready": 1 if ok else 0}

    clock = _Clock(step=5.0)
    monkeypatch.setattr(H, "Client", SlowClient)
    monkeypatch.setattr(H, "time", clock)
    s = H.Server.__new__(H.Server)
    s.addr, s.logs = "ipc:///nowhere", lambda: "(log)"
    s.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert s.wait_ready(1)["status"] == "ok" and clock.now - 1000.0 >= 600
        polls["n"] = -10 ** 9                    # never ready: the limit, not a hang
        with pytest.raises(TimeoutError):
            s.wait_ready(1)
        assert READY_TIMEOUT >= 900 or os.environ.get("COLIBRI_TEST_READY_TIMEOUT")
    finally:
        s.proc.kill()
        s.proc.wait()
    polls["n"] = -10 ** 9
    t0 = clock.now
    with pytest.raises(RuntimeError, match="exited"):
        s.wait_ready(1)
    assert clock.now - t0 <= 5.0
