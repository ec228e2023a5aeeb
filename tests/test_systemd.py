"""systemd integration: the units verify cleanly; the master's sd_notify sequence."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from server_harness import READY_TIMEOUT, Server

UNITS = pathlib.Path(__file__).resolve().parent.parent / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (Debian: apt-get install systemd)")
def test_units_verify_cleanly(tmp_path):
    colibri = pathlib.Path(sys.executable).parent / "colibri"
    for unit in ("colibri.service", "colibri-http.service"):
        text = (UNITS / unit).read_text().replace("/opt/colibri/.venv/bin/colibri", str(colibri))
        (tmp_path / unit).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", "colibri.service", "colibri-http.service"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    # verify exits 0 even for ignored lines: any output is a problem
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_unit_contract():
    text = (UNITS / "colibri.service").read_text()
    for line in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "KillMode=mixed", "Restart=on-failure",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RuntimeDirectory=colibri", "CacheDirectory=colibri",
                 "ReadOnlyPaths=-/var/lib/colibri/models", "#CPUAffinity=", "#NUMAPolicy="):
        assert line in text, line
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    from colibri_server.settings import SETTINGS
    assert stop > SETTINGS["graceful_timeout"].value


class FakeSystemd:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages = []

    def collect(self, until, timeout=60.0, proc=None):
        """Messages until until(messages); a start (READY_TIMEOUT, with its `proc`) waits on the
        server's own readiness while it lives, not a fixed short time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; sd_notify messages: {self.messages}")
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                pass
            if until(self.messages):
                return self.messages
        raise TimeoutError(f"sd_notify messages so far: {self.messages}")

    def kinds(self):
        out = []
        for m in self.messages:
            for k in ("READY=1", "RELOADING=1", "STOPPING=1", "WATCHDOG=1"):
                if k in m.split("\n"):
                    out.append(k)
        return out


def test_sd_notify_sequence(built, tmp_path):
    sd = FakeSystemd(tmp_path / "notify.sock")
    s = Server(built("mixtral").colibri("f32"), tmp_path, workers=1,
               env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    try:
        sd.collect(lambda m: "READY=1" in sd.kinds(), READY_TIMEOUT, s.proc)
        ready = next(m for m in sd.messages if "READY=1" in m)
        assert "STATUS=serving generation 1 with 1 workers" in ready
        sd.collect(lambda m: sd.kinds().count("WATCHDOG=1") >= 2)
        s.signal(signal.SIGHUP)
        sd.collect(lambda m: sd.kinds().count("READY=1") >= 2)
        s.signal(signal.SIGUSR1)
        sd.collect(lambda m: sd.kinds().count("READY=1") >= 3)
        s.signal(signal.SIGTERM)
        sd.collect(lambda m: "STOPPING=1" in sd.kinds())
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
    k = [x for x in sd.kinds() if x != "WATCHDOG=1"]
    assert k == ["READY=1", "RELOADING=1", "READY=1", "RELOADING=1", "READY=1", "STOPPING=1"], k
    reload_msg = next(m for m in sd.messages if "RELOADING=1" in m)
    assert "MONOTONIC_USEC=" in reload_msg
    assert any("STATUS=serving generation 3" in m for m in sd.messages)


def test_failed_reload_is_rolled_back_and_shown_in_status(built, tmp_path):
    """A USR1 to a file that is gone: RELOADING=1, then READY=1 with a STATUS that says the
    reload was refused and which generation keeps serving; exit 5 (bind) is not restarted."""
    import shutil
    assert "RestartPreventExitStatus=3 4 5" in (UNITS / "colibri.service").read_text()
    live = tmp_path / "live.colibri"
    shutil.copy(built("mixtral").colibri("f32"), live)
    sd = FakeSystemd(tmp_path / "notify.sock")
    s = Server(live, tmp_path, workers=1, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    try:
        sd.collect(lambda m: "READY=1" in sd.kinds(), READY_TIMEOUT, s.proc)
        os.unlink(live)
        s.signal(signal.SIGUSR1)
        sd.collect(lambda m: sd.kinds().count("READY=1") >= 2)
        status = [m for m in sd.messages if "STATUS=" in m][-1]
        assert "refused" in status and "generation 1 keeps serving" in status, status
        assert s.proc.poll() is None
    finally:
        s.stop()


def test_a_notify_socket_nobody_reads_never_stops_the_master(tmp_path):
    """sd_notify to a receiver whose queue is full (10 datagrams by default) gives up after a
    moment instead of blocking: the loading master notifies from a signal handler every few
    seconds, and a blocked send there once stopped a start for good."""
    import threading

    from colibri_server.host.systemd import Notifier
    deaf = FakeSystemd(tmp_path / "deaf.sock")     # bound, never read
    notify = Notifier(str(tmp_path / "deaf.sock"))
    t = threading.Thread(target=lambda: [notify(f"EXTEND_TIMEOUT_USEC=90000000\nSTATUS={i}") for i in range(14)],
                         daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "sd_notify blocked on a full queue"
    assert deaf.sock.fileno() >= 0
