"""Clients and the gateway over several routers (issue 21 item 4): `Client([a, b])`, `AsyncClient([a, b])`
and `colibri http --connect a --connect b` spread requests over two real servers (the bundled model, one
router each on its own ipc:// address), fail over when one is SIGKILLed with its whole process tree
(requests in flight on it end with an explicit error, later ones all succeed on the other), and take it
back once it is started again on the same address. The rest against in-process fake routers: address
checks, refusals passed on, cancel and timeouts on the router holding the request, one error naming
every router when none answers, and the backoff."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
from server_harness import Server, wait_until
from test_client import FakeServer
from test_http import Gateway, free_port

from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.client import (
    AsyncClient,
    Cancelled,
    Client,
    ColibriError,
    ColibriTimeout,
    ConnectionLost,
    Overloaded,
    RouterSet,
    Unreachable,
)
from colibri_server.client import pool as client_pool
from colibri_server.wire import protocol

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]


# ---------------------------------------------------------------------------- two real servers


class Pair:
    """Two `colibri serve` of the bundled model (1 worker, 1 thread: a start in ~2 s), "a" and "b"."""

    def __init__(self, tmp):
        self.tmp, self.s = tmp, {}

    def start(self, *names):
        for n in names:
            self.s[n] = Server(BUNDLED_MODEL, self.tmp, workers=1, name=n, extra=["--threads-per-worker", "1"])
        for n in names:
            self.s[n].wait_ready(1)   # ~2 s with Numba's cache warm; a cold one compiles first

    def addr(self, n):
        return self.s[n].addr

    def pids(self, n):
        return set(self.s[n].worker_pids())

    def kill_now(self, n) -> list:
        """SIGKILL the master, router and workers of n at once (its process group's members: the
        harness starts the server in the test's own group, so the tree is killed, not the group). All are
        stopped first: killed one after another, the router outlived its master by long enough on a loaded
        machine to end its streams as a master's death asks (shutting_down), where a machine that dies
        leaves its clients with connection_lost."""
        procs = [psutil.Process(self.s[n].pid)] + psutil.Process(self.s[n].pid).children(recursive=True)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
        return procs

    def reap(self, n, procs):
        psutil.wait_procs(procs, timeout=10)
        self.s[n].stop()
        shutil.copy(self.s[n].log_path, f"{self.s[n].log_path}.killed")

    def kill(self, n):
        self.reap(n, self.kill_now(n))

    def stop(self):
        for s in self.s.values():
            s.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = Pair(tmp_path_factory.mktemp("pool"))
    try:
        p.start("a", "b")
        yield p
    finally:
        p.stop()


@pytest.fixture
def both(pair):
    """The pair with both servers up (a test that killed one started it again, or this does)."""
    dead = [n for n in "ab" if pair.s[n].proc.poll() is not None]
    if dead:
        pair.start(*dead)
    return pair


class Load:
    """Threads sending generate after generate, each through its own Client([a, b]); every request's
    start, end, router, worker pid and outcome (a Completion or the error) recorded."""

    def __init__(self, addrs, threads=4, max_tokens=160):
        self.addrs, self.max_tokens = addrs, max_tokens
        self.log, self.lock, self.stop = [], threading.Lock(), threading.Event()
        self.ts = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(threads)]
        for t in self.ts:
            t.start()

    def run(self, i):
        with Client(list(self.addrs), timeout=30) as c:
            k = 0
            while not self.stop.is_set():
                k += 1
                t0, s, out = time.monotonic(), None, None
                try:
                    s = c.stream(PROMPTS[(i + k) % len(PROMPTS)], max_tokens=self.max_tokens, ignore_eos=True)
                    out = s.completion()
                except ColibriError as e:
                    out = e
                with self.lock:
                    self.log.append({"t0": t0, "t1": time.monotonic(), "addr": s.addr if s else None, "out": out})

    def done(self, since=0.0):
        with self.lock:
            return [r for r in self.log if r["t0"] >= since and not isinstance(r["out"], Exception)]

    def wait(self, pred, timeout, what):
        return wait_until(pred, timeout, what, lambda: "\n".join(map(str, self.log[-20:])))

    def finish(self):
        self.stop.set()
        for t in self.ts:
            t.join(60)
        assert not any(t.is_alive() for t in self.ts), "a request never ended"
        return self.log


def test_sync_clients_spread_fail_over_on_kill_and_take_the_restarted_router_back(both):
    a, b = both.addr("a"), both.addr("b")
    pids = {a: both.pids("a"), b: both.pids("b")}
    with Client([a, b], timeout=30) as c:            # n > 1 and a cancel by id through the pool
        r = c.generate(PROMPTS[0], max_tokens=8, n=2, temperature=0.8, seed=1)
        assert len(r.choices) == 2 and all(ch.token_ids for ch in r.choices)
        st = c.stats()                              # one router's, its own fields kept, and which one
        assert st["addr"] in (a, b) and st["router"]["pid"] and st["generation"] == 1
        s = c.stream(PROMPTS[1], max_tokens=200, ignore_eos=True)
        next(s)
        c.cancel(s.id)                              # the router ends a cancelled request with error cancelled
        with pytest.raises(Cancelled):
            s.completion()
    load = Load([a, b])
    load.wait(lambda: {r["addr"] for r in load.done()} == {a, b}, 20, "both routers serving")
    for r in load.done():                           # the router the pool names is the one that served it
        assert r["out"].worker_pid in pids[r["addr"]], r
    held = Client([a, b], timeout=30)               # two streams of one pool client: one on each router,
    h = held.health()                               # once both of its connections are up (a fresh client waits
    assert [r["status"] for r in h["routers"]] == ["ok", "ok"], h   # only `grace` for the second one)
    streams = [held.stream(PROMPTS[2], max_tokens=240, ignore_eos=True) for _ in range(2)]
    for s in streams:                               # each running (a token back) when a is killed, so a
        next(s)                                     # request is surely in flight on a, whatever the load does
    assert sorted(s.addr for s in streams) == sorted([a, b]), [s.addr for s in streams]
    on_a, on_b = sorted(streams, key=lambda s: s.addr != a)
    t_kill = time.monotonic()
    both.kill("a")
    with pytest.raises(ConnectionLost, match=a):
        on_a.completion()
    assert time.monotonic() < t_kill + 15 and len(on_b.completion().token_ids) == 240
    held.close()
    load.wait(lambda: len(load.done(since=t_kill + 0.2)) >= 8, 20, "answers from b after a was killed")
    t_restart = time.monotonic()
    both.start("a")
    t_back = time.monotonic()
    pids[a] = both.pids("a")
    load.wait(lambda: any(r["addr"] == a for r in load.done(since=t_back)), 10, "a used again after its restart")
    log = load.finish()

    for r in [r for r in log if isinstance(r["out"], Exception)]:                                # in flight on a at the kill, ended at once, explicitly
        assert isinstance(r["out"], ConnectionLost) and a in str(r["out"]), r
        assert r["addr"] == a and r["t0"] < t_kill + 0.2 and r["t1"] < t_kill + 5, r
    after = [r for r in log if r["t0"] >= t_kill + 0.2]
    assert after and not [r for r in after if isinstance(r["out"], Exception)]
    assert not [r for r in after if r["t0"] < t_restart and r["addr"] != b]     # all on b while a is away
    for r in log:
        if not isinstance(r["out"], Exception) and r["t0"] >= t_back:
            assert r["out"].worker_pid in pids[r["addr"]], r


def test_async_client_spreads_and_fails_over_on_kill(both):
    a, b = both.addr("a"), both.addr("b")

    async def main():
        async with AsyncClient([a, b], timeout=30) as c:
            async def one(i, max_tokens=160, streaming=None):
                s = c.stream(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
                try:
                    async for _ in s:
                        if streaming is not None:
                            streaming.release()
                            streaming = None
                    return s.addr, None
                except ColibriError as e:
                    return s.addr, e
            h = await c.health()                    # both connections up: a fresh client waits only `grace`
            assert h["status"] == "ok" and [r["status"] for r in h["routers"]] == ["ok", "ok"], h   # for the second
            first = await asyncio.gather(*(one(i) for i in range(6)))
            assert {addr for addr, _ in first} == {a, b} and not any(e for _, e in first), first
            streaming = asyncio.Semaphore(0)
            tasks = [asyncio.ensure_future(one(i, 240, streaming)) for i in range(4)]
            for _ in tasks:                         # all four streaming, two on each router
                await streaming.acquire()
            t = time.monotonic()
            procs = both.kill_now("b")
            in_flight = await asyncio.gather(*tasks)
            ended = time.monotonic() - t
            await asyncio.get_running_loop().run_in_executor(None, both.reap, "b", procs)
            later = await asyncio.gather(*(one(i, 16) for i in range(6)))
            h = await c.health()
            return in_flight, ended, later, h
    in_flight, ended, later, h = asyncio.run(main())
    lost = [(addr, e) for addr, e in in_flight if e is not None]
    assert lost and all(addr == b and isinstance(e, ConnectionLost) for addr, e in lost), in_flight
    assert all(addr == a for addr, e in in_flight if e is None) and ended < 10, (in_flight, ended)
    assert all(addr == a and e is None for addr, e in later), later
    assert h["status"] == "ok" and {r["addr"]: r["status"] for r in h["routers"]} == {a: "ok", b: "unreachable"}, h


# ---------------------------------------------------------------------------- the gateway


def _completion(url, max_tokens=8):
    return requests.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": max_tokens}, timeout=30)


def _sse(url, max_tokens):
    """A streamed completion: ("ok", text) when it finished, ("error", body) for an error event, or
    for an error status (the gateway waits for the first token before it answers: a router lost
    before that is a 502)."""
    text = []
    body = {"prompt": PROMPTS[2], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        if r.status_code != 200:
            return "error", r.json()["error"]
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            o = json.loads(line[6:])
            if "error" in o:
                return "error", o["error"]
            text.append(o["choices"][0]["text"])
            if o["choices"][0]["finish_reason"]:
                return "ok", "".join(text)
    return "silent", "".join(text)


def _done(server):
    return server.stats()["counters"].get("done", 0)


def test_gateway_with_two_connects_spreads_fails_over_and_takes_the_router_back(both, tmp_path):
    a, b = both.addr("a"), both.addr("b")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    g = Gateway([sys.executable, "-m", "colibri_server.http", "--connect", a, "--connect", b,
                 "--bind", f"127.0.0.1:{port}", "--threads", "8", "--timeout", "30"], {}, tmp_path / "g.log")
    try:
        h = g.wait_listening(url)
        assert h.status_code == 200 and [r["status"] for r in h.json()["routers"]] == ["ok", "ok"], h.text
        before = {n: _done(both.s[n]) for n in "ab"}
        with ThreadPoolExecutor(4) as ex:
            rs = list(ex.map(lambda _: _completion(url), range(8)))
        assert all(r.status_code == 200 and r.json()["choices"][0]["text"] for r in rs), [r.text for r in rs]
        assert all(_done(both.s[n]) > before[n] for n in "ab")      # both routers served

        with ThreadPoolExecutor(4) as ex:           # four streams: the fewest-in-flight choice puts two on each
            streams = [ex.submit(_sse, url, 240) for _ in range(4)]
            wait_until(lambda: min(both.s[n].stats()["in_flight"] for n in "ab") >= 1, 10, "streams on a and b")
            t = time.monotonic()
            both.kill("a")
            ends = [f.result(timeout=20) for f in streams]
        assert time.monotonic() - t < 10
        errors = [body for kind, body in ends if kind == "error"]
        assert errors and all(e["code"] == "connection_lost" and a in e["message"] for e in errors), ends
        assert all(kind in ("ok", "error") for kind, _ in ends), ends              # none ends in silence
        rs = [_completion(url) for _ in range(6)]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        t = time.monotonic()
        h = requests.get(url + "/health", timeout=10)
        assert time.monotonic() - t < 1.5           # a router known down gets a short probe
        routers = {r["addr"]: r for r in h.json()["routers"]}
        assert h.status_code == 200 and routers[a]["status"] == "unreachable" and routers[b]["status"] == "ok", h.text
        assert routers[a]["failures"] >= 1 and routers[b]["served"] >= 6, h.text
        m = requests.get(url + "/metrics", timeout=10).text
        assert f'colibri_router_up{{router="{a}"}} 0.0' in m and f'colibri_router_up{{router="{b}"}} 1.0' in m
        assert f'colibri_queue_depth{{router="{b}"}}' in m and "\ncolibri_up 1.0" in m

        both.start("a")
        # an event, not a speed: a loaded machine's probes and answers are slow (15 s was outrun once)
        wait_until(lambda: _completion(url).status_code == 200 and _done(both.s["a"]) > 0, 120,
                   "the restarted router used again", g.logs)
        h = requests.get(url + "/health", timeout=10).json()
        assert [r["status"] for r in h["routers"]] == ["ok", "ok"], h
    finally:
        g.stop()
    assert "Traceback" not in g.logs()
    assert f"colibri router {a} is down" in g.logs()


# ---------------------------------------------------------------------------- fake routers (fast)


@pytest.fixture
def fakes(tmp_path):
    made = []

    def make(n=2, cls=FakeServer):
        for i in range(n):
            f = cls(f"ipc://{tmp_path}/f{len(made)}.sock")
            f.start()
            made.append(f)
        return made[-n:]
    yield make
    for f in made:
        f.stop()


class Refusing(FakeServer):
    """A router that is stopping: every generate is answered shutting_down."""

    def generate(self, ident, body):
        self.send(ident, protocol.error_body(body["id"], "shutting_down", "the server is stopping"))


def _generates(f):
    return [b["id"] for b in f.received if b["type"] == "generate"]


def test_one_address_is_todays_client_and_a_list_is_checked_by_name(tmp_path):
    with Client(f"ipc://{tmp_path}/x.sock") as c:
        assert type(c) is Client
    with Client([f"ipc://{tmp_path}/x.sock"]) as c:
        assert isinstance(c, Client) and c.addrs == (f"ipc://{tmp_path}/x.sock",)
    for bad, named in ((["ipc:///tmp/x.sock", "tcp://10.0.0.2"], "tcp://10.0.0.2"),
                       (["ipc:///tmp/x.sock", "http://10.0.0.2:80"], "http://10.0.0.2:80"),
                       (["tcp://10.0.0.1:5555", "tcp://10.0.0.1:5555"], "given twice"),
                       (["tcp://10.0.0.1:5555,tcp://10.0.0.1:99999"], "99999"), ([], "no server address")):
        with pytest.raises(ValueError, match=named.replace(".", r"\.")) as e:
            Client(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="given twice"):
        AsyncClient(("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"))


def test_gateway_addresses_from_flags_env_and_config_and_a_duplicate_exits_2(tmp_path):
    from colibri_server.http import app_from_env, create_app
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    assert create_app(a).routers is None and create_app(a).connect == a          # one: as before
    os.environ["COLIBRI_HTTP_CONNECT"] = f"{a},{b}"
    try:
        assert app_from_env().routers.addrs == (a, b)
    finally:
        del os.environ["COLIBRI_HTTP_CONNECT"]
    r = subprocess.run([sys.executable, "-m", "colibri_server.http", "--connect", a, "--connect", a],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and a in lines[0] and "twice" in lines[0], r.stderr


def test_a_refused_request_goes_to_the_next_router_and_all_refusing_is_one_error(fakes):
    stopping, serving = fakes(1, Refusing)[0], fakes(1)[0]
    with Client([stopping.addr, serving.addr], timeout=3) as c:
        for _ in range(3):
            assert c.generate("hello").text == "HELLO"
        assert len(_generates(serving)) == 3
        assert c.routers.state(stopping.addr)["failures"] == 1      # stopping: skipped after the first refusal
        assert len(_generates(stopping)) == 1
    busy = fakes(2)
    with Client([f.addr for f in busy], timeout=3) as c:
        with pytest.raises(Overloaded) as e:
            c.generate("overload")
        assert all(f.addr in str(e.value) for f in busy) and all(len(_generates(f)) == 1 for f in busy)


def test_cancel_and_timeout_reach_the_router_that_holds_the_request(fakes):
    f0, f1 = fakes(2)
    with Client([f0.addr, f1.addr], timeout=3) as c:
        assert c.health()["status"] == "ok"                     # both connected
        s0, s1 = c.stream("silent"), c.stream("silent")       # the fewest in flight: one on each router
        assert {s0.addr, s1.addr} == {f0.addr, f1.addr}
        for s in (s0, s1):
            c.cancel(s.id)
            assert s.completion().finish_reason == "cancelled"
        by_addr = {s0.addr: s0.id, s1.addr: s1.id}
        assert f0.cancels == [by_addr[f0.addr]] and f1.cancels == [by_addr[f1.addr]]
        with pytest.raises(ColibriTimeout):
            c.generate("silent", timeout=0.3)
        assert wait_until(lambda: len(f0.cancels) + len(f1.cancels) == 3, 3, "the timeout's cancel")
        s = c.stream("silent")
        s.close()                                   # closed before it ended: cancelled on its router
        closed, holder = s.id, (f0 if s.addr == f0.addr else f1)
        assert wait_until(lambda: closed in holder.cancels, 3, "the close's cancel")
        s = c.stream("silent")
        rid, holder = s.id, (f0 if s.addr == f0.addr else f1)
        del s                                       # abandoned: collected, and cancelled on its router
        gc.collect()
        assert wait_until(lambda: rid in holder.cancels, 3, "the abandoned stream's cancel")
        assert c.routers.state(f0.addr)["in_flight"] == c.routers.state(f1.addr)["in_flight"] == 0


def test_async_cancel_reaches_the_holder(fakes):
    f0, f1 = fakes(2)

    async def main():
        async with AsyncClient([f0.addr, f1.addr], timeout=3) as c:
            s = c.stream("silent")
            task = asyncio.ensure_future(s.completion())
            await asyncio.sleep(0.2)
            await c.cancel(s.id)
            return s.addr, s.id, (await task).finish_reason
    addr, rid, reason = asyncio.run(main())
    holder = f0 if addr == f0.addr else f1
    assert reason == "cancelled" and holder.cancels == [rid]


def test_every_router_down_is_one_error_naming_each_within_one_connect_timeout(tmp_path):
    addrs = [f"ipc://{tmp_path}/none{i}.sock" for i in range(3)]
    with Client(addrs, timeout=5, connect_timeout=0.5) as c:
        t = time.monotonic()
        with pytest.raises(Unreachable) as e:
            c.generate("x")
        assert time.monotonic() - t < 1.5           # waited for any of them at once, not for each in turn
    assert all(a in str(e.value) for a in addrs) and "does not exist" in str(e.value)
    assert "\n" not in str(e.value)


def test_backoff_grows_per_failure_in_a_row_is_capped_and_ends_on_an_answer(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(client_pool.time, "monotonic", lambda: now[0])
    rs = RouterSet(["ipc:///tmp/r0.sock", "ipc:///tmp/r1.sock"], backoff=1.0, backoff_max=4.0)
    r0, r1 = rs.addrs
    waits = []
    for _ in range(5):
        rs.failed(r0, "refused")
        rs.failed(r0, "refused")                    # the same outage seen by another client: not longer
        waits.append(rs.state(r0)["skipped_for_s"])
        assert rs.order({r0: True, r1: True}) == [r1, r0]       # skipped while its backoff runs
        now[0] += waits[-1]
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert rs.order({r0: False, r1: True}) == [r1, r0]          # due, but not connected again: still last
    assert set(rs.order({r0: True, r1: True})[:2]) == {r0, r1}  # due and connected: in the turn again
    rs.succeeded(r0)
    rs.failed(r0, "refused")
    assert rs.state(r0)["skipped_for_s"] == 1.0                 # an answer ended the run of failures
    rs.succeeded(r0)
    rs.started(r0)
    assert [rs.order({r0: True, r1: True})[0] for _ in range(4)] == [r1] * 4     # fewest in flight first
    rs.ended(r0)
    assert [rs.order({r0: True, r1: True})[0] for _ in range(4)] in ([r0, r1] * 2, [r1, r0] * 2)  # then turns
    firsts = {RouterSet([r0, r1]).order({})[0] for _ in range(40)}
    assert firsts == {r0, r1}                                   # a random first turn: clients do not herd


def test_a_router_that_is_not_running_is_passed_over_at_once(fakes, tmp_path):
    alive = fakes(1)[0]
    dead = f"ipc://{tmp_path}/dead.sock"
    with Client([dead, alive.addr], timeout=5, connect_timeout=2) as c:
        for _ in range(4):
            t = time.monotonic()
            assert c.generate("hello").text == "HELLO" and time.monotonic() - t < 1.0
        h = c.health()
        assert h["status"] == "ok" and [r["status"] for r in h["routers"]] == ["unreachable", "ok"], h

    async def main():
        async with AsyncClient([dead, alive.addr], timeout=5, connect_timeout=2) as c:
            t = time.monotonic()
            texts = [r.text for r in await asyncio.gather(*(c.generate("hi") for _ in range(4)))]
            return texts, time.monotonic() - t
    texts, took = asyncio.run(main())
    assert texts == ["HI"] * 4 and took < 1.0 and len(_generates(alive)) == 8


def test_a_router_that_dropped_is_skipped_for_its_backoff_then_used_again(fakes):
    f0, f1 = fakes(2)
    with Client([f0.addr, f1.addr], timeout=3, backoff=1.5) as c:
        c.generate("a")
        c.generate("b")                             # both connected and used
        f0.stop()
        back = FakeServer(f0.addr)                  # the same address answers again at once...
        back.start()
        try:
            t = time.monotonic()

            def sent():
                try:
                    return c.generate("c")
                except ConnectionLost:      # sent to f0 before the client saw it drop (a loaded core):
                    return True             # the documented outcome, and f0 is marked down all the same
            assert wait_until(lambda: sent() and c.routers.state(f0.addr)["failures"] == 1, 3, "the drop")
            while time.monotonic() - t < 1.2:       # ...but it is skipped while its backoff runs
                assert c.generate("d").text == "D"
            assert _generates(back) == []
            assert wait_until(lambda: c.generate("e") and _generates(back), 3, "the router used again")
            assert c.routers.state(f0.addr)["failures"] == 0
        finally:
            back.stop()


def test_a_burst_at_start_waits_a_moment_for_every_router_to_connect(fakes, tmp_path, monkeypatch):
    """No router connected yet: the first to connect is not given the whole burst; the others get
    `grace` (0.1 s; 0.5 s here: the late router's reconnect comes within ZeroMQ's 100 ms) to connect."""
    monkeypatch.setattr(client_pool._PoolBase, "grace", 0.5)
    early, late_addr, late = fakes(1)[0], f"ipc://{tmp_path}/late.sock", []

    async def main():
        async with AsyncClient([early.addr, late_addr], timeout=5) as c:
            burst = asyncio.gather(*(c.generate("hi") for _ in range(6)))
            await asyncio.sleep(0.02)               # the burst waits for a connection; early's comes first
            late.append(FakeServer(late_addr))      # (a FakeServer binds when it is made)
            late[0].start()
            return await burst
    try:
        assert [r.text for r in asyncio.run(main())] == ["HI"] * 6
        assert len(_generates(early)) == len(_generates(late[0])) == 3
    finally:
        for f in late:
            f.stop()
