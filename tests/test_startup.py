"""The start: every listening address is taken before the model is loaded (a busy one fails in a
second, even when the kernels would compile for minutes), and while the model loads and the
kernels compile the server is answerable: "starting" from the router, 503 with Retry-After from
the gateway, EXTEND_TIMEOUT_USEC to systemd, READY=1 only once it serves (issue 33 item 3, issue 38
item 8).

Each server here runs with an empty Numba cache of its own (NUMBA_CACHE_DIR): the load truly
compiles, as on a fresh install.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from server_harness import READY_TIMEOUT, Server, child_env, wait_started
from test_http import free_port
from test_systemd import FakeSystemd

from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.client import Client, ColibriError
from colibri_server.master.loading import HaltServer
from colibri_server.master.startup import Loading

FAST_S = 10.0       # a loose bound for "at once" on a loaded machine (about 1 s on a quiet one)


def _run_until_exit(args, env, limit):
    """(returncode, output, seconds): the command's exit, or None when it still runs after
    `limit` (then its process group is killed: it holds a router, a gateway...)."""
    t0 = time.monotonic()
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=limit)
        return p.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out, time.monotonic() - t0


def _serve(tmp_path, *extra):
    env = {**child_env(), "NUMBA_CACHE_DIR": str(tmp_path / "cold-numba-cache")}
    args = [sys.executable, "-m", "colibri_server.cli", "serve", "--model", BUNDLED_MODEL, "--workers", "1",
            "--runtime-dir", str(tmp_path / "rt"), "--pin", "none", *extra]
    return args, env


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _fails_at_once_naming(code, out, took, address):
    assert code is not None, f"still running after {took:.0f}s (the address {address} is busy):\n{out[-3000:]}"
    assert code == 5 and took < FAST_S, (code, took, out[-3000:])
    assert "Traceback" not in out and "compiling" not in out, out
    halting = [line for line in out.splitlines() if "halting:" in line]
    assert len(halting) == 1 and address in halting[0], out


def test_a_busy_client_address_fails_the_start_before_the_model_loads(tmp_path, busy_port):
    address = f"tcp://127.0.0.1:{busy_port}"
    args, env = _serve(tmp_path, "--bind", address)
    code, out, took = _run_until_exit(args, env, 120)
    _fails_at_once_naming(code, out, took, address)
    assert "in use" in out


def test_a_busy_http_port_fails_the_start_before_the_model_loads(tmp_path, busy_port):
    address = f"127.0.0.1:{busy_port}"
    args, env = _serve(tmp_path, "--bind", f"ipc://{tmp_path}/c.sock", "--http", address)
    code, out, took = _run_until_exit(args, env, 60)
    _fails_at_once_naming(code, out, took, address)
    assert "in use" in out and "OpenAI API at" not in out      # no gateway announced on a port it lacks


def test_a_stop_inside_a_c_callback_is_not_swallowed(capfd):
    """The compile runs Python inside C callbacks (llvmlite's object cache): a TERM whose handler
    runs there must still stop the load, at once and without an "Exception ignored" traceback."""
    def inside_the_callback():
        os.kill(os.getpid(), signal.SIGTERM)        # the handler runs here, inside the callback
    callback = ctypes.CFUNCTYPE(None)(inside_the_callback)
    t0 = time.monotonic()
    with pytest.raises(HaltServer, match="SIGTERM while loading"):
        with Loading(lambda message: None):
            callback()
            while time.monotonic() - t0 < 10:       # the rest of a long compile
                time.sleep(0.001)
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in capfd.readouterr().err


def test_term_while_loading_stops_at_once_and_leaves_nothing(tmp_path):
    s = Server(BUNDLED_MODEL, tmp_path, workers=1, extra=["--http", f"127.0.0.1:{free_port()}"],
               env={"NUMBA_CACHE_DIR": str(tmp_path / "cold-numba-cache")})
    try:
        wait_started(lambda: "compiling" in s.logs(), "the compile", [s.proc], s.logs)
        s.signal(signal.SIGTERM)
        assert s.proc.wait(FAST_S) == 0, s.logs()
        assert "SIGTERM while loading" in s.logs() and "Traceback" not in s.logs()
        assert not os.path.exists(s.addr[len("ipc://"):]) and os.listdir(s.runtime) == []
    finally:
        s.stop()


def test_while_loading_the_server_answers_starting_and_systemd_waits(tmp_path):
    """From the first notification to systemd (sent as the load begins), the gateway answers 503
    "starting" with Retry-After on /health and the API, the router says "starting" and refuses
    requests with it; READY=1 comes once the workers serve, and then so does the gateway. The
    master is held (SIGSTOP) in its load from that first notification until the probes are done:
    a load as long as a cold compile, without paying for one."""
    sd = FakeSystemd(tmp_path / "notify.sock")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Server(BUNDLED_MODEL, tmp_path, workers=1, extra=["--http", f"127.0.0.1:{port}"],
               env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    held = False
    try:
        sd.collect(lambda m: any("EXTEND_TIMEOUT_USEC=" in x for x in m), READY_TIMEOUT, s.proc)
        s.signal(signal.SIGSTOP)
        held = True
        assert "ready:" not in s.logs()
        h = requests.get(url + "/health", timeout=60)
        assert h.status_code == 503 and h.json()["status"] == "starting", h.text
        assert int(h.headers["Retry-After"]) >= 1
        for r in (requests.get(url + "/v1/models", timeout=60),
                  requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)):
            assert r.status_code == 503 and r.json()["error"]["code"] == "starting", r.text
            assert int(r.headers["Retry-After"]) >= 1
        with Client(s.addr, timeout=30) as c:
            assert c.health()["status"] == "starting"
            with pytest.raises(ColibriError) as e:
                c.generate([5, 6, 7], max_tokens=2)
            assert e.value.code == "starting" and type(e.value).__name__ == "Starting"
        assert "ready:" not in s.logs(), "the load ended before the probes: they proved nothing"
        assert not any("READY=1" in m for m in sd.messages), sd.messages
        s.signal(signal.SIGCONT)
        held = False
        sd.collect(lambda m: any("READY=1" in x for x in m), READY_TIMEOUT, s.proc)  # reading: its queue is short
        s.wait_ready(1)
        s.wait_http(url)
        assert requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             timeout=60).status_code == 200
        first_ready = next(i for i, m in enumerate(sd.messages) if "READY=1" in m)
        assert first_ready > 0 and all("EXTEND_TIMEOUT_USEC=" in m for m in sd.messages[:first_ready])
    finally:
        if held:
            s.signal(signal.SIGCONT)
        s.stop()
