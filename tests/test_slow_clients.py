"""Slow and malformed HTTP clients against the gateway (gunicorn, HeadFirstWorker) in front of a
real `colibri serve` (issue 38 items 1 and 5).

The promises: whatever a connection's framing (a head and nothing more, a chunked body trickled
in, a Content-Length over the limit, Expect: 100-continue), it holds no gateway thread; a request
is bounded in time from its first byte to its last; an over-limit Content-Length is refused
before its body is read; /health and /metrics answer while every thread is busy; malformed
chunked framing is a 400 without a traceback; well-formed chunked and Expect requests are served.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from server_harness import Server
from test_http import Gateway, Throttle, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "def main(args):"


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    s = Server(built("mixtral").colibri("f32"), tmp, workers=2, name="s")
    try:
        s.wait_ready(2)
        yield s
    finally:
        s.stop()


def start_gateway(server, tmp_path, threads=4, env=None):
    port = free_port()
    g = Gateway([sys.executable, "-m", "gunicorn", "colibri_server.http:app_from_env()",
                 "-c", os.path.join(ROOT, "configs", "gunicorn.conf.py"),
                 "--bind", f"127.0.0.1:{port}", "--threads", str(threads)],
                {"COLIBRI_HTTP_CONNECT": server.addr, **(env or {})}, tmp_path / "gateway.log")
    g.url = f"http://127.0.0.1:{port}"
    g.port = port
    r = g.wait_listening(g.url)
    assert r.status_code == 200, r.text
    return g


def head(extra: str, path="/v1/completions") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


SLOW = {   # kind -> the bytes such a client sends at once (the chunked kind then trickles more)
    "head": head("Content-Length: 100\r\n"),
    "chunked": head("Transfer-Encoding: chunked\r\n") + b"1\r\n{\r\n",
    "large": head("Content-Length: 3000000\r\n") + b"{",
    "expect": head("Content-Length: 100\r\nExpect: 100-continue\r\n"),
}


def read_answer(sock, timeout=5.0) -> bytes:
    """What the gateway sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def probe_while(url, seconds, interval=0.2, limit=3.0):
    """GET /health and /metrics every `interval` s for `seconds` s, each given `limit` s: [(path, status, latency)]."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for path in ("/health", "/metrics"):
            t0 = time.monotonic()
            try:
                status = requests.get(url + path, timeout=limit).status_code
            except requests.RequestException as e:
                status = type(e).__name__
            out.append((path, status, time.monotonic() - t0))
        time.sleep(interval)
    return out


def completion(url, max_tokens=2):
    r = requests.post(url + "/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    return r.status_code, r.json()


def test_slow_clients_of_every_framing_hold_no_thread(server, tmp_path):
    """40 connections of each kind (head only, trickled chunked body, Content-Length 3,000,000,
    Expect: 100-continue) held open for 4 s on a gateway of 4 threads: every /health and /metrics
    probe answers 200 within 3 s (a thread held by a slow client would hold it for the whole 4 s) and
    their median within 1 s (a loaded machine's stray probe can take a second), 8 normal clients get
    their completions, the over-limit
    Content-Length is refused with 413 before its body is sent, and the Expect clients are
    told to continue."""
    g = start_gateway(server, tmp_path, threads=4)
    conns = {k: [] for k in SLOW}
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for c in conns["chunked"]:
                try:
                    c.sendall(b"1\r\n \r\n")
                except OSError:
                    pass
    try:
        for _ in range(40):
            for kind, data in SLOW.items():
                c = socket.create_connection(("127.0.0.1", g.port), timeout=10)
                c.sendall(data)
                conns[kind].append(c)
        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        with ThreadPoolExecutor(8) as ex:
            normal = [ex.submit(completion, g.url) for _ in range(8)]
            probes = probe_while(g.url, 4.0)
            answers = [f.result() for f in normal]
        slow = [p for p in probes if p[1] != 200]
        assert not slow, f"{len(slow)} of {len(probes)} probes failed or took over 3 s: {slow[:5]}"
        assert sorted(p[2] for p in probes)[len(probes) // 2] < 1.0, probes
        assert all(st == 200 and a["choices"][0]["finish_reason"] == "length" for st, a in answers), answers
        for c in conns["large"]:
            ans = read_answer(c, 2.0)
            assert ans.startswith(b"HTTP/1.1 413 "), ans[:200]
            assert b"3000000" in ans
        for c in conns["expect"]:
            c.settimeout(2.0)
            assert c.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        for c in conns["head"] + conns["chunked"]:          # still open, waiting for their bodies
            c.setblocking(False)
            with pytest.raises(BlockingIOError):
                c.recv(1)
    finally:
        stop.set()
        for cs in conns.values():
            for c in cs:
                c.close()
        g.stop()
    assert "Traceback" not in g.logs()


def test_a_request_is_bounded_from_its_first_byte_to_its_last(server, tmp_path):
    """With COLIBRI_HTTP_HEADER_TIMEOUT=2: a chunked body that keeps trickling in (a chunk every
    0.3 s: never idle) and a Content-Length body that stops half way are both answered 408 and
    closed 2-4 s after their first byte; a request sent in time is served."""
    g = start_gateway(server, tmp_path, threads=2, env={"COLIBRI_HTTP_HEADER_TIMEOUT": "2"})
    try:
        trickled = socket.create_connection(("127.0.0.1", g.port), timeout=10)
        halted = socket.create_connection(("127.0.0.1", g.port), timeout=10)
        t0 = time.monotonic()
        trickled.sendall(SLOW["chunked"])
        halted.sendall(head("Content-Length: 100\r\n") + b'{"prompt": ')
        result = {}

        def read_halted():
            result["halted"] = (read_answer(halted, 8.0), time.monotonic() - t0)
        reader = threading.Thread(target=read_halted)
        reader.start()
        trickled.setblocking(False)
        ans = b""
        while time.monotonic() - t0 < 8.0:
            try:
                trickled.send(b"1\r\n \r\n")
            except OSError:
                pass
            try:
                data = trickled.recv(65536)
                if not data:
                    break
                ans += data
            except BlockingIOError:
                pass
            time.sleep(0.3)
        waited = time.monotonic() - t0
        reader.join(10)
        assert ans.startswith(b"HTTP/1.1 408 "), ans[:200]
        assert 1.8 < waited < 4.5, waited
        ans, waited = result["halted"]
        assert ans.startswith(b"HTTP/1.1 408 ") and 1.8 < waited < 4.5, (ans[:200], waited)
        assert completion(g.url)[0] == 200
    finally:
        g.stop()


def test_health_and_metrics_answer_while_every_thread_generates(server, tmp_path):
    """A gateway of 2 threads, both streaming long (throttled) generations: /health and
    /metrics are served by threads of their own and answer within 1 s."""
    g = start_gateway(server, tmp_path, threads=2)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
    socks = []
    try:
        with Throttle(server.worker_pids()) as throttle:
            throttle.start()
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", g.port), timeout=10)
                s.sendall(head(f"Content-Length: {len(body)}\r\n") + body)
                socks.append(s)
            for s in socks:                      # each has its thread: the stream has begun
                assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
            probes = probe_while(g.url, 2.0)
            for s in socks:                      # still generating while we probed
                s.setblocking(False)
                assert s.recv(65536)
        slow = [p for p in probes if p[1] not in (200, 503)]
        assert not slow, f"{len(slow)} of {len(probes)} probes failed or took over 3 s: {slow[:5]}"
        assert sorted(p[2] for p in probes)[len(probes) // 2] < 1.0, probes
    finally:
        for s in socks:
            s.close()
        g.stop()


def test_chunked_and_expect_requests_are_served_and_malformed_chunks_are_400(server, tmp_path):
    """Issue 38 item 5: `zz` as a chunk size is a 400 naming the chunked body, no 500 and no
    traceback in the log.  A chunked body split over several chunks (with a trailer) and a body
    sent after "100 Continue" are answered like any other."""
    g = start_gateway(server, tmp_path, threads=2)
    try:
        c = socket.create_connection(("127.0.0.1", g.port), timeout=10)
        c.sendall(head("Transfer-Encoding: chunked\r\n", "/tokenize") + b"zz\r\nabc\r\n0\r\n\r\n")
        ans = read_answer(c)
        assert ans.startswith(b"HTTP/1.1 400 "), ans[:300]
        assert b"chunk" in ans
        c.close()
        payload = json.dumps({"prompt": PROMPT}).encode()
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 5]), payload[i:i + 5])
                          for i in range(0, len(payload), 5))
        c = socket.create_connection(("127.0.0.1", g.port), timeout=10)
        c.sendall(head("Transfer-Encoding: chunked\r\nConnection: close\r\n", "/tokenize") + chunks[:7])
        time.sleep(0.2)
        c.sendall(chunks[7:] + b"0\r\nX-Trailer: 1\r\n\r\n")
        ans = read_answer(c)
        expected = requests.post(g.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()
        assert ans.startswith(b"HTTP/1.1 200 "), ans[:300]
        assert json.loads(ans.split(b"\r\n\r\n", 1)[1]) == expected
        c.close()
        c = socket.create_connection(("127.0.0.1", g.port), timeout=10)
        c.sendall(head(f"Content-Length: {len(payload)}\r\nExpect: 100-continue\r\nConnection: close\r\n",
                       "/tokenize"))
        assert c.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        c.sendall(payload)
        ans = read_answer(c)
        assert ans.startswith(b"HTTP/1.1 200 ") and b"100 Continue" not in ans, ans[:300]
        assert json.loads(ans.split(b"\r\n\r\n", 1)[1]) == expected
        c.close()
    finally:
        g.stop()
    assert "Traceback" not in g.logs()



def test_the_app_answers_a_body_whose_framing_fails_with_400():
    """The same fault under a worker class that leaves the chunked framing to the app (plain
    gthread): gunicorn's InvalidChunkSize from wsgi.input, or a body cut short, is a 400."""
    import io

    from gunicorn.http.errors import InvalidChunkSize, NoMoreData

    from colibri_server.http import create_app
    app = create_app("ipc:///nonexistent/colibri.sock")
    for fault in (InvalidChunkSize(b"zz"), NoMoreData(b"")):
        class Input(io.RawIOBase):
            def read(self, n=-1):
                raise fault
        seen = []
        env = {"REQUEST_METHOD": "POST", "PATH_INFO": "/tokenize", "wsgi.input": Input(),
               "HTTP_TRANSFER_ENCODING": "chunked"}
        body = b"".join(app(env, lambda status, headers: seen.append(status)))
        assert seen[0].startswith("400 "), (seen, body)
        assert json.loads(body)["error"]["code"] == "invalid_body", body


def _disconnected(g) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(g.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "colibri_http_requests"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("outcome") == "disconnected")


@pytest.mark.parametrize("stream", [False, True])
def test_a_hang_up_is_noticed_within_a_second_while_no_token_flows(server, tmp_path, stream):
    """Issue 38 item 9: the workers stopped (SIGSTOP), a completion dispatched to one of them sends
    nothing. Its HTTP client hangs up: within 1.5 s the gateway has counted it disconnected and sent
    the cancel; once the workers run again the request is cancelled, not completed."""
    import signal as _signal
    g = start_gateway(server, tmp_path, threads=2)
    pids = server.worker_pids()
    before = server.stats()["counters"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": stream}).encode()
    try:
        gone_before = _disconnected(g)
        for pid in pids:
            os.kill(pid, _signal.SIGSTOP)
        try:
            sock = socket.create_connection(("127.0.0.1", g.port), timeout=10)
            sock.sendall(head(f"Content-Length: {len(body)}\r\n") + body)
            server.wait_for(lambda: server.stats()["in_flight"] == 1, timeout=10, what="dispatch")
            time.sleep(0.5)
            sock.close()
            t0 = time.monotonic()
            while _disconnected(g) == gone_before and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            noticed = time.monotonic() - t0
        finally:
            for pid in pids:
                os.kill(pid, _signal.SIGCONT)
        assert noticed < 1.5, f"the hang-up was noticed after {noticed:.1f} s"
        server.wait_for(lambda: server.stats()["in_flight"] == 0, timeout=20, what="the request leaving")
        after = server.stats()["counters"]
        assert after.get("done", 0) == before.get("done", 0), (before, after)
    finally:
        g.stop()
    assert "Traceback" not in g.logs()


def test_clients_that_keep_their_end_open_after_an_error_answer_do_not_stall_health(server, tmp_path):
    """A request line gunicorn refuses (400) on a connection the client keeps open: gunicorn's own close
    drains it for up to 2 s on its main loop, serving nobody meanwhile (every /health probe after such a
    client waited ~2 s). The drain is the poller's here: probes answer at once, the client gets its 400."""
    g = start_gateway(server, tmp_path, threads=2)
    socks = []
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", g.port), timeout=10)
            s.sendall(b"zz\r\n\x00\xff not a request line\r\n\r\n")       # and never closes its end
            socks.append(s)
            t0 = time.monotonic()
            assert requests.get(g.url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 1.0, f"/health took {time.monotonic() - t0:.2f}s"
        for s in socks:
            assert s.recv(64).startswith(b"HTTP/1.1 400 ")
    finally:
        for s in socks:
            s.close()
        g.stop()
