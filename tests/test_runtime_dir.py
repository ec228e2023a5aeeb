"""Issue 38 item 7: files a master killed with -9 left in the runtime directory (its backend socket,
its generation files) are gone after the next start; those of a running process stay."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from server_harness import Server

from colibri_server.bundled import BUNDLED_MODEL


def test_the_next_start_removes_the_files_of_a_master_killed_with_sigkill(tmp_path):
    first = Server(BUNDLED_MODEL, tmp_path, workers=1, name="s")
    try:
        first.wait_ready(1)
        run = first.runtime
        left = sorted(n for n in os.listdir(run) if str(first.pid) in n)
        assert any(n.startswith("backend-") for n in left), left
        for ch in first.children():
            ch.kill()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    finally:
        first.stop()
    assert all(os.path.exists(run / n) for n in left)          # what kill -9 leaves
    left.append(f"generation-{first.pid}-3.msgpack")            # as a master killed after a reload leaves it
    (run / left[-1]).write_bytes(b"\x80")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kept = [f"backend-{alive.pid}.sock", f"generation-{alive.pid}-1.msgpack"]
    for n in kept:
        (run / n).write_bytes(b"")
    second = Server(BUNDLED_MODEL, tmp_path, workers=1, name="s")
    try:
        second.wait_ready(1)
        now = os.listdir(run)
        assert not [n for n in left if n in now], now
        assert all(n in now for n in kept), now
        assert "Traceback" not in second.logs()
    finally:
        second.stop()
        alive.kill()
        alive.wait()
