"""The bad-input corpus (tests/bad_requests/*.json) against ONE real `colibri serve`.

Every case is sent on its own raw ZeroMQ DEALER (not `Client`, which refuses to send most
of these) and must be answered, on that connection, by exactly one `error` with the stable
code the case names -- or, for "expect": "dropped" (a message over 4 x max_body, see
wire/protocol.py), by nothing at all while the server keeps serving. After each case a `health`
probe on the same connection must be the very next reply (no duplicate or stray answers).
At the end the same server must still answer a good request with the in-process answer,
with the same router and worker processes as at the start and error counters that match
the errors the cases received. Two last tests send large but VALID inputs (a tokenize
answer of more than 131072 ids; ~600 KB texts, on a server of its own with timeout 2 s).

The server runs with default settings: max_body 1 MiB (so messages over 16 MiB are
dropped), max_prompt_tokens 8192, max_tokens 4096, max_stop 16 (and 64 stop token ids),
stop strings of at most 256 characters; the test model has vocab 512 and a context of
256 tokens (its max_position_embeddings).

Case file format (one JSON object per file, NNN-short-name.json):

    description  what is wrong with the message, and why that code
    frames       the message under test: a list of frame specs (below)
    expect       an ERROR_CODES code, or "dropped"
    expect_id    optional: the id the error must carry (null: the id could not be read)
    before       optional: [{"frames": [...], "expect": "done" | code, "id": ...}] sent first on
                 the same connection (e.g. the request a duplicate id collides with); each
                 must end in its own "done" (or error with that code) carrying "id"

Frame specs (bytes of one ZeroMQ frame):
    "COLI/1"                              a JSON string: its UTF-8 bytes
    {"hex": "c1"} | {"b64": "wQ=="}       raw bytes
    {"msgpack": VALUE}                    VALUE packed with msgpack (use_bin_type)
    {"repeat": SPEC, "count": N}          SPEC's bytes N times ("generate N bytes")
    {"concat": [SPEC, ...]}               the bytes of each SPEC, joined
    {"nest": {"body": MAP, "field": "prompt", "depth": D, "kind": "array"|"map"}}
        MAP packed with one more field whose value is D levels of nested one-element
        arrays (or one-key maps) around 0: deeper than msgpack's packer allows

VALUE is JSON, except that a one-key object whose key starts with "$" is generated:
    {"$bytes": "hex"}                     a msgpack bin
    {"$float": "nan"|"inf"|"-inf"|x}      a float (JSON has no NaN/inf)
    {"$str": {"repeat": "ab", "count": N}}  a long string
    {"$list": {"repeat": VALUE, "count": N}}  a long array
    {"$range": [start, stop]}             [start, start+1, ..., stop-1]
    {"$nest": {"depth": D, "kind": "array"|"map", "leaf": VALUE}}
    {"$map": [[KEY, VALUE], ...]}         a map whose keys need not be strings
"""
from __future__ import annotations

import base64
import collections
import itertools
import json
import pathlib
import time

import msgpack
import pytest
import zmq
from server_harness import Server

from colibri_server.model import Model
from colibri_server.wire import protocol as P

CORPUS = pathlib.Path(__file__).parent / "bad_requests"
CASE_FILES = sorted(CORPUS.glob("*.json"))
REPLY_TIMEOUT = 5.0       # seconds for the answer of one case (the server answers errors at once)
DROP_WAIT = 1.5           # seconds during which a dropped message must stay unanswered
TERMINAL = ("error", "done", "result")


# ---------------------------------------------------------------------------- building frames

def build_value(v):
    if isinstance(v, list):
        return [build_value(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (k, arg), = v.items()
            if k.startswith("$"):
                return _generated(k, arg)
        return {k: build_value(x) for k, x in v.items()}
    return v


def _generated(tag, arg):
    if tag == "$bytes":
        return bytes.fromhex(arg)
    if tag == "$float":
        return float(arg)
    if tag == "$str":
        return arg["repeat"] * arg["count"]
    if tag == "$list":
        return [build_value(arg["repeat"]) for _ in range(arg["count"])]
    if tag == "$range":
        return list(range(arg[0], arg[1]))
    if tag == "$nest":
        v = build_value(arg.get("leaf", 0))
        for _ in range(arg["depth"]):
            v = [v] if arg["kind"] == "array" else {"a": v}
        return v
    if tag == "$map":
        return {build_value(k): build_value(x) for k, x in arg}
    raise ValueError(f"unknown generator {tag!r}")


def build_frame(spec) -> bytes:
    if isinstance(spec, str):
        return spec.encode()
    if "hex" in spec:
        return bytes.fromhex(spec["hex"])
    if "b64" in spec:
        return base64.b64decode(spec["b64"])
    if "msgpack" in spec:
        return msgpack.packb(build_value(spec["msgpack"]), use_bin_type=True)
    if "repeat" in spec:
        return build_frame(spec["repeat"]) * spec["count"]
    if "concat" in spec:
        return b"".join(build_frame(s) for s in spec["concat"])
    if "nest" in spec:
        n = spec["nest"]
        body = build_value(n["body"])
        p = msgpack.Packer(use_bin_type=True)
        head = p.pack_map_header(len(body) + 1) + b"".join(p.pack(k) + p.pack(x) for k, x in body.items())
        level = b"\x91" if n["kind"] == "array" else b"\x81\xa1a"
        return head + p.pack(n["field"]) + level * n["depth"] + b"\x00"
    raise ValueError(f"unknown frame spec {sorted(spec)}")


def load_case(path) -> dict:
    case = json.loads(pathlib.Path(path).read_text())
    assert isinstance(case.get("description"), str) and case["description"], path
    assert case["expect"] in P.ERROR_CODES or case["expect"] == "dropped", path
    assert isinstance(case["frames"], list) and case["frames"], path
    assert set(case) <= {"description", "frames", "expect", "expect_id", "before"}, path
    return case


# ---------------------------------------------------------------------------- raw connection

class Raw:
    """A raw DEALER on the frontend: send any frames, read the decoded replies."""

    _probe_ids = itertools.count(1)

    def __init__(self, addr):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(addr)

    def close(self):
        self.sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, frames):
        self.sock.send_multipart(frames, copy=len(frames[-1]) < (1 << 16))

    def recv(self, timeout):
        """The next reply (decoded body), or None after `timeout` seconds."""
        if not self.sock.poll(max(0, int(timeout * 1000))):
            return None
        parts = self.sock.recv_multipart()
        assert len(parts) == 2 and parts[0] == P.MAGIC, f"malformed reply {[bytes(p[:32]) for p in parts]}"
        body = msgpack.unpackb(parts[1], raw=False)
        assert isinstance(body, dict) and body.get("type") in ("token",) + TERMINAL, body
        if body["type"] == "error":
            assert body["code"] in P.ERROR_CODES and isinstance(body.get("message"), str), body
            assert "id" in body, body
        return body

    def probe(self, timeout=REPLY_TIMEOUT):
        """Send a health request; return every reply that came before its answer, which must come."""
        pid = f"probe-{next(self._probe_ids)}"
        self.send(P.frames({"type": "health", "id": pid}))
        extra, deadline = [], time.monotonic() + timeout
        while True:
            r = self.recv(deadline - time.monotonic())
            assert r is not None, f"no answer to a health probe in {timeout}s (replies meanwhile: {extra})"
            if r.get("id") == pid:
                assert r["type"] == "result" and r["status"] in ("ok", "starting", "draining"), r
                return extra
            extra.append(r)


def snapshot(server) -> dict:
    st = server.stats()
    return {"router": st["router"]["pid"], "workers": sorted(w["pid"] for w in st["workers"]),
            "counters": collections.Counter(st["counters"]), "stats": st}


# ---------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def model_path(built):
    return built("mixtral").colibri("f32")


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    s = Server(model_path, tmp_path_factory.mktemp("badreq"), workers=2, name="b")
    try:
        s.wait_ready(2)
        s.start = snapshot(s)
        s.received = collections.Counter()     # error codes the cases received, for the counters check
        yield s
    finally:
        s.stop()


def count_error(server, reply):
    if reply["type"] == "error":
        server.received[reply["code"]] += 1


def error_counters_grew_as_received(server, end) -> None:
    delta = end["counters"] - server.start["counters"]
    counted = {k[len("error:"):]: n for k, n in delta.items() if k.startswith("error:")}
    assert counted == dict(server.received), \
        f"error counters grew by {counted} but the clients received {dict(server.received)}"


def _log_tail(server, n=3000):
    try:
        return server.logs()[-n:]
    except Exception as e:  # pragma: no cover
        return f"(no log: {e})"


# ---------------------------------------------------------------------------- the corpus

def test_corpus_is_big_and_well_formed():
    assert len(CASE_FILES) >= 60, f"only {len(CASE_FILES)} cases in {CORPUS}"
    names = [p.name for p in CASE_FILES]
    assert len({n.split("-", 1)[0] for n in names}) == len(names), "case numbers must be unique"
    for p in CASE_FILES:
        case = load_case(p)
        assert p.stat().st_size < 4096, f"{p.name}: generate large inputs, do not store them"
        for spec in case["frames"]:
            build_frame(spec)


@pytest.mark.parametrize("path", CASE_FILES, ids=[p.stem for p in CASE_FILES])
def test_bad_request(srv, path):
    case = load_case(path)
    frames = [build_frame(f) for f in case["frames"]]
    before = case.get("before", [])
    with Raw(srv.addr) as c:
        for m in before:
            c.send([build_frame(f) for f in m["frames"]])
        c.send(frames)
        if case["expect"] == "dropped":
            r = c.recv(DROP_WAIT)
            assert r is None, f"a message over 4 x max_body was answered: {r}"
            # the connection was dropped; the DEALER reconnects and the server still serves it
            extra = c.probe(timeout=10.0)
            assert not extra, extra
            return
        want_terminals = len(before) + 1
        replies, deadline = [], time.monotonic() + REPLY_TIMEOUT + 5.0 * len(before)
        while sum(r["type"] in TERMINAL for r in replies) < want_terminals:
            r = c.recv(deadline - time.monotonic())
            assert r is not None, (f"no answer (replies so far: {replies}); server log tail:\n"
                                   f"{_log_tail(srv)}")
            replies.append(r)
            count_error(srv, r)
        extra = c.probe()               # anything more than one answer shows up before the probe's
        for r in extra:
            count_error(srv, r)
        replies += extra

    # the answers of the `before` messages
    rest = [r for r in replies if r["type"] != "token"]
    tokens = [r for r in replies if r["type"] == "token"]
    for m in before:
        kind = "done" if m["expect"] == "done" else "error"
        match = [r for r in rest if r["type"] == kind and r["id"] == m["id"]
                 and (kind == "done" or r["code"] == m["expect"])]
        assert match, f"setup request {m['id']!r} did not end in {m['expect']}: {replies}"
        rest.remove(match[0])
    assert all(any(t["id"] == m["id"] for m in before) for t in tokens), f"stray tokens: {tokens}"

    # exactly one answer to the message under test: an error with the expected code
    assert len(rest) == 1, f"expected exactly one answer, got {rest}"
    (r,) = rest
    assert r["type"] == "error", f"expected error {case['expect']!r}, got {r}"
    assert r["code"] == case["expect"], f"expected {case['expect']!r}, got {r['code']!r}: {r['message']}"
    if "expect_id" in case:
        assert r["id"] == case["expect_id"] and type(r["id"]) is type(case["expect_id"]), \
            f"error id {r['id']!r}, expected {case['expect_id']!r}"


def test_server_survived_the_corpus(srv, model_path):
    """Same processes as at the start, counters that match, and a good request answered right."""
    end = snapshot(srv)
    assert end["router"] == srv.start["router"], \
        f"the router restarted ({srv.start['router']} -> {end['router']}): it crashed; log tail:\n{_log_tail(srv)}"
    assert end["workers"] == srv.start["workers"], \
        f"worker pids changed {srv.start['workers']} -> {end['workers']}; log tail:\n{_log_tail(srv)}"
    delta = end["counters"] - srv.start["counters"]
    assert not delta.get("retries") and not delta.get("worker_lost") and not delta.get("error:internal"), delta
    error_counters_grew_as_received(srv, end)
    prompt = [5, 17, 300, 42, 7, 99]
    want = Model.open(model_path).generate(prompt, max_tokens=8, ignore_eos=True)
    with Raw(srv.addr) as c:
        c.send(P.frames({"type": "generate", "id": "good-1", "prompt": prompt, "max_tokens": 8,
                         "ignore_eos": True, "stream": False}))
        r = c.recv(15.0)
        assert r is not None, f"a good request was not answered; log tail:\n{_log_tail(srv)}"
        assert r["type"] == "done" and r["id"] == "good-1", r
        assert r["ids"] == want and r["finish_reason"] == "length", (r, want)
        c.send(P.frames({"type": "detokenize", "id": 2, "ids": want}))
        d = c.recv(10.0)
        assert d is not None and d["type"] == "result" and d["text"] == r["text"], (d, r)
    assert "router crashed" not in srv.logs() and "Traceback" not in srv.logs(), _log_tail(srv)


# ---------------------------------------------------------------------------- large valid inputs

def test_a_long_tokenize_answer_reaches_the_client():
    """A tokenize answer of 140000 ids (a server with max_prompt_tokens large enough to take
    the text): the Client must be able to read it (it would decode answers with the request
    limits: max_array_len 131072)."""
    from colibri_server.client.core import _decode
    rid, body = _decode(P.frames({"type": "result", "id": "t", "ids": list(range(140_000))}))
    assert rid == "t" and len(body["ids"]) == 140_000


def test_big_texts_do_not_get_healthy_workers_killed(model_path, tmp_path):
    """The router tokenizes text prompts and tokenize requests on its single thread, and drains
    up to 1000 frontend messages before it reads the workers' heartbeats again: a few 600 KB
    texts (valid requests) keep it away from the backend for longer than `timeout`, so it
    declares its healthy workers unresponsive and the master kills them. (timeout 2 s here;
    with the default 30 s it takes a dozen such requests.)"""
    s = Server(model_path, tmp_path, workers=1, name="t", extra=["--timeout", "2", "--heartbeat-interval", "0.25"])
    try:
        s.wait_ready(1)
        before = snapshot(s)
        with Raw(s.addr) as c:
            # texts at the size guard (16 bytes x max_prompt_tokens) are tokenized; larger ones
            # (600 KB) are refused untokenized: they would hold the loop for a second each
            for i in range(3):
                c.send(P.frames({"type": "tokenize", "id": i, "text": "zq% " * 32_000}))
            for i in range(3, 6):
                c.send(P.frames({"type": "tokenize", "id": i, "text": "zq% " * 150_000}))
            for i in range(6):
                r = c.recv(60.0)
                assert r is not None and (r["type"] == "result" if r["id"] < 3 else r["code"] == "too_large"), r
        time.sleep(0.5)
        after = snapshot(s)
        assert after["workers"] == before["workers"], \
            f"workers {before['workers']} -> {after['workers']}:\n" + \
            "\n".join(ln for ln in s.logs().splitlines() if "unresponsive" in ln or "exited" in ln)
    finally:
        s.stop()
