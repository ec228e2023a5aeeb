"""Issue 20's control-plane guards: the router's loop stays fast whatever one client sends,
the gateway outlives idle connections, removed CURVE keys stop working, user text never
becomes control tokens, clients and the CLI fail fast with one line naming the thing."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from colibri_server import protocol as P
from colibri_server.client import Client, ColibriError
from server_harness import Server


@pytest.fixture(scope="module")
def model_path(built):
    return built("mixtral").colibri("f32")


@pytest.fixture(scope="module")
def live(model_path, tmp_path_factory):
    s = Server(model_path, tmp_path_factory.mktemp("guards"), workers=1, extra=("--control-rate", "20"))
    try:
        s.wait_ready(1, timeout=120)
        yield s
    finally:
        s.stop()


def _dealer(addr):
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(addr)
    return d


# ---------------------------------------------------------------------------- item 7: the router's loop


def test_stats_never_reads_smaps_in_the_router_loop(monkeypatch, model_path):
    """stats answers from a cache filled by a thread: a slow smaps read costs the loop nothing."""
    from colibri_server import memory
    from colibri_server.router import Router, W
    from colibri_server.settings import defaults

    def slow(*a, **k):
        time.sleep(0.5)
        return {"rss": 1, "pss": 1}
    monkeypatch.setattr(memory, "file_mapping", slow)
    r = Router(frontend="inproc://x", backend="inproc://y", pipe_fd=-1, settings=defaults(), generation=1,
               model_path=str(model_path))
    r.ppid = os.getppid()
    r.workers[b"w"] = W(b"w", {"pid": os.getpid(), "wid": 1}, time.monotonic())
    t0 = time.monotonic()
    for _ in range(3):
        st = r.stats()
    assert time.monotonic() - t0 < 0.2, "stats waited for smaps"
    assert st["workers"][0]["pid"] == os.getpid()
    deadline = time.monotonic() + 5
    while r.memory.get(os.getpid())["model_rss"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.stats()["workers"][0]["model_rss"] == 1     # the figures arrive, from the thread


def test_tokenize_has_a_size_guard_and_control_requests_are_rate_limited(live):
    with live.client(10) as c:
        t0 = time.monotonic()
        with pytest.raises(ColibriError) as e:
            c.tokenize("a" * (1 << 20))
        assert e.value.code == "too_large" and time.monotonic() - t0 < 1.0
    # one client pipelines 300 stats; another's generate is not held up behind them
    d = _dealer(live.addr)
    try:
        for i in range(300):
            d.send_multipart(P.frames({"type": "stats", "id": i}))
        with live.client(10) as c:
            t0 = time.monotonic()
            c.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
            took = time.monotonic() - t0
        codes = []
        while len(codes) < 300 and d.poll(5000):
            body = P.unpack(d.recv_multipart()[1], max_body=64 << 20)
            codes.append(body.get("code", body["type"]))
        assert len(codes) == 300
        assert codes.count("overloaded") >= 200, codes[:60]     # burst 2 x control_rate, then refused
        assert took < 2.0
    finally:
        d.close()
