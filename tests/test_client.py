"""Tests for colibri_server.client against a fake in-process server (a ROUTER thread that
speaks the protocol).  Fast: the whole file runs in a few seconds."""
from __future__ import annotations

import asyncio
import gc
import os
import pickle
import tempfile
import threading
import time

import msgpack
import pytest
import zmq

from colibri_server.client import (
    ERRORS,
    AsyncClient,
    Chunk,
    Client,
    ColibriError,
    ColibriTimeout,
    Completion,
    InternalError,
    Overloaded,
    error_for,
)
from colibri_server.wire import protocol

PID, GENERATION = 4242, 3


def _pieces(text, size=3):
    return [text[i:i + size] for i in range(0, len(text), size)]


class FakeServer(threading.Thread):
    """Speaks protocol v1 on a ROUTER socket.

    generate prompts:  normal text -> its upper-case, 3 characters per token message, then done
                       (done carries all text and ids, as the spec says);
                       "overload" -> error overloaded;  "error:<code>" -> error <code>;
                       "silent" -> never answered (until cancelled);  "slow..." -> 200 tokens;
                       "noise..." -> messages for unknown ids first;  "held..." -> the last
                       piece only in done;  "emptydone..." -> done with text "" and no ids;
                       "garbage:<kind>" -> a malformed message.
    Responses of concurrent generates are interleaved: one token per active request per round,
    newest request first.  With min_active = n, nothing is emitted until n are active
    (once).
    """

    def __init__(self, addr, curve_secret=None):
        super().__init__(daemon=True, name="fake-colibri")
        self.addr = addr
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_secret is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = curve_secret
        self.sock.bind(addr)
        self.stopping = threading.Event()
        self.received = []          # every body received
        self.cancels = []           # ids of the cancel requests
        self.emitted = []           # ids of token messages, in sending order
        self.active = {}            # (ident, id) -> state, insertion-ordered
        self.silent = {}            # (ident, id) -> body
        self.min_active = 1

    # -- plumbing

    def send(self, ident, body):
        self.sock.send_multipart([ident, protocol.MAGIC, protocol.pack(body)])

    def send_raw(self, ident, *frames):
        self.sock.send_multipart([ident, *frames])

    def done_body(self, rid, reason, text, ids, prompt_len):
        return {"type": "done", "id": rid, "finish_reason": reason, "text": text, "ids": ids,
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(ids)},
                "timings": {"queued_s": 0.0, "prefill_s": 0.001, "decode_s": 0.002, "total_s": 0.003},
                "worker_pid": PID, "generation": GENERATION}

    def run(self):
        try:
            while not self.stopping.is_set():
                if self.sock.poll(2 if self.active else 20):
                    while True:
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(parts[0], parts[1:])
                if len(self.active) >= self.min_active:
                    self.min_active = 1         # the gate opens once
                if self.active and len(self.active) >= self.min_active:
                    self.round()
        finally:
            self.sock.close(linger=0)
            self.ctx.term()

    def stop(self):
        self.stopping.set()
        self.join(timeout=5)

    # -- requests

    def handle(self, ident, frames):
        body = protocol.parse_frames(frames)
        self.received.append(body)
        t, rid = body["type"], body["id"]
        if t == "generate":
            self.generate(ident, body)
        elif t == "cancel":
            self.cancels.append(rid)
            st = self.active.pop((ident, rid), None)
            if st is not None:
                self.send(ident, self.done_body(rid, "cancelled", st["sent_text"], st["sent_ids"], 1))
            elif self.silent.pop((ident, rid), None) is not None:
                self.send(ident, self.done_body(rid, "cancelled", "", [], 1))
            else:
                self.send(ident, protocol.error_body(rid, "not_found", f"{rid!r} is not in flight"))
        elif t == "tokenize":
            ids = ([1] if body.get("add_special_tokens", True) else []) + [ord(c) for c in body["text"]]
            self.send(ident, {"type": "result", "id": rid, "ids": ids})
        elif t == "detokenize":
            self.send(ident, {"type": "result", "id": rid, "text": "".join(chr(i) for i in body["ids"])})
        elif t == "health":
            self.send(ident, {"type": "result", "id": rid, "status": "ok", "workers": 2,
                              "generation": GENERATION})
        elif t == "stats":
            self.send(ident, {"type": "result", "id": rid, "requests": len(self.received),
                              "queue_depth": len(self.active)})

    def generate(self, ident, body):
        rid = body["id"]
        req = protocol.validate_generate(body, protocol.Limits())
        prompt = req["prompt"]
        if not isinstance(prompt, str):
            prompt = "".join(chr(t) for t in prompt)
        if prompt == "overload":
            return self.send(ident, protocol.error_body(rid, "overloaded", "queue full"))
        if prompt.startswith("error:"):
            return self.send(ident, protocol.error_body(rid, prompt[6:], "as requested"))
        if prompt == "silent":
            self.silent[(ident, rid)] = body
            return
        if prompt.startswith("garbage:"):
            return self.garbage(ident, rid, prompt[8:])
        if prompt.startswith("noise"):
            self.send(ident, {"type": "token", "id": "nobody-1", "text": "X", "ids": [88], "index": 0})
            self.send(ident, self.done_body(999, "stop", "X", [88], 1))
            self.send(ident, protocol.error_body("nobody-2", "internal", "not yours"))
            self.send(ident, {"type": "token", "id": [1, 2], "text": "X", "ids": [88], "index": 0})
        text = "ab" * 200 if prompt.startswith("slow") else prompt.upper()
        pieces = _pieces(text)
        reason = "length" if len(pieces) > req["max_tokens"] else "stop"
        pieces = pieces[:req["max_tokens"]]
        self.active[(ident, rid)] = {"pieces": pieces, "next": 0, "reason": reason, "sent_text": "",
                                     "sent_ids": [], "prompt": prompt, "plen": len(prompt)}

    def garbage(self, ident, rid, kind):
        if kind == "magic":
            self.send_raw(ident, b"COLI/9", protocol.pack({"type": "done", "id": rid}))
        elif kind == "frames":
            self.send_raw(ident, protocol.MAGIC, protocol.pack({"type": "done", "id": rid}), b"extra")
        elif kind == "msgpack":
            self.send_raw(ident, protocol.MAGIC, b"\xc1\xc1\xc1")
        elif kind == "notmap":
            self.send_raw(ident, protocol.MAGIC, msgpack.packb([1, 2, 3]))
        elif kind == "token":
            self.send(ident, {"type": "token", "id": rid, "ids": [1], "index": 0})   # no text
        elif kind == "done":
            self.send(ident, {"type": "done", "id": rid, "text": ""})               # no finish_reason
        elif kind == "usage":
            self.send(ident, {**self.done_body(rid, "stop", "", [], 1), "usage": [1, 2]})
        elif kind == "type":
            self.send(ident, {"type": "surprise", "id": rid})
        elif kind == "errcode":
            self.send(ident, {"type": "error", "id": rid, "code": ["not", "a", "str"]})
        elif kind == "noid":
            self.send(ident, {"type": "error", "code": "overloaded", "message": "id-less"})

    def round(self):
        for key in reversed(list(self.active)):
            ident, rid = key
            st = self.active[key]
            held = st["prompt"].startswith("held")
            pieces = st["pieces"]
            if st["next"] < len(pieces) - (1 if held else 0):
                piece = pieces[st["next"]]
                ids = [ord(c) for c in piece]
                self.send(ident, {"type": "token", "id": rid, "text": piece, "ids": ids, "index": st["next"]})
                self.emitted.append(rid)
                st["next"] += 1
                st["sent_text"] += piece
                st["sent_ids"] += ids
            else:
                del self.active[key]
                text = "".join(pieces)
                ids = [ord(c) for c in text]
                if st["prompt"].startswith("emptydone"):
                    text, ids = "", []
                self.send(ident, self.done_body(rid, st["reason"], text, ids, st["plen"]))


def _wait(pred, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


@pytest.fixture
def server(tmp_path):
    path = f"{tmp_path}/s.sock"
    tmpdir = None
    if len(path) > 90:        # ipc paths are limited to ~107 bytes
        tmpdir = tempfile.mkdtemp(prefix="coli")
        path = f"{tmpdir}/s.sock"
    srv = FakeServer(f"ipc://{path}")
    srv.start()
    yield srv
    srv.stop()
    assert not srv.is_alive(), "fake server thread did not stop"
    if tmpdir:
        for f in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, f))
        os.rmdir(tmpdir)


@pytest.fixture
def client(server):
    with Client(server.addr, timeout=3.0) as c:
        yield c


def _arun(coro, timeout=8.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---------------------------------------------------------------------------- sync: results


def test_generate_accumulates_text_and_fields(client, server):
    r = client.generate("hello colibri", max_tokens=16, temperature=0.0, seed=7, stop=["zz"])
    assert isinstance(r, Completion)
    assert r.text == "HELLO COLIBRI"
    assert r.token_ids == [ord(c) for c in "HELLO COLIBRI"]
    assert r.finish_reason == "stop"
    assert r.usage == {"prompt_tokens": 13, "completion_tokens": 13}
    assert set(r.timings) == {"queued_s", "prefill_s", "decode_s", "total_s"}
    assert (r.generation, r.worker_pid) == (GENERATION, PID)
    sent = server.received[-1]
    assert r.id == sent["id"] and isinstance(r.id, str) and 0 < len(r.id) <= protocol.MAX_ID_LEN
    assert sent["stream"] is True and sent["seed"] == 7 and sent["stop"] == ["zz"]
    assert "top_k" not in sent              # unset params are left to the server's defaults


def test_generate_token_prompt_and_length(client):
    r = client.generate([ord(c) for c in "abcdefghij"], max_tokens=2)
    assert r.text == "ABCDEF" and r.finish_reason == "length"


def test_generate_rejects_unknown_params(client):
    with pytest.raises(TypeError, match="bogus"):
        client.generate("hi", bogus=1)


def test_request_ids_unique_per_client(client, server):
    client.generate("a")
    client.generate("b")
    c2 = Client(server.addr, timeout=3.0)
    try:
        c2.generate("c")
    finally:
        c2.close()
    ids = [b["id"] for b in server.received]
    assert len(set(ids)) == 3
    assert ids[0].split("-")[0] == ids[1].split("-")[0] != ids[2].split("-")[0]


def test_stream_chunks_and_final_chunk(client):
    chunks = list(client.stream("hello world", max_tokens=16))
    assert all(isinstance(c, Chunk) for c in chunks)
    *tokens, final = chunks
    assert [c.text for c in tokens] == ["HEL", "LO ", "WOR", "LD"]
    assert [c.index for c in tokens] == [0, 1, 2, 3]
    assert all(c.finish_reason is None and c.usage is None and not c.is_final for c in tokens)
    assert tokens[0].token_ids == [ord(c) for c in "HEL"]
    # done repeats all text and ids (spec): the final chunk carries nothing new
    assert final.is_final and final.finish_reason == "stop"
    assert final.text == "" and final.token_ids == []
    assert final.usage["completion_tokens"] == 11 and final.generation == GENERATION
    assert final.worker_pid == PID


def test_text_held_back_until_done(client):
    s = client.stream("held back")                 # last piece only in done
    chunks = list(s)
    assert chunks[-1].text == "ACK" and chunks[-1].token_ids == [ord(c) for c in "ACK"]
    assert client.generate("held back").text == "HELD BACK"


def test_done_without_text(client):
    r = client.generate("emptydone x")
    assert r.text == "EMPTYDONE X" and r.token_ids == [ord(c) for c in "EMPTYDONE X"]


def test_two_streams_interleaved_on_one_client(client):
    a = client.stream("first stream")
    b = client.stream("second stream")
    ta, tb = [], []
    for ca, cb in zip(a, b):                  # alternate: each one's messages are buffered
        ta.append(ca.text)
        tb.append(cb.text)
    ta += [c.text for c in a]
    tb += [c.text for c in b]
    assert "".join(ta) == "FIRST STREAM" and "".join(tb) == "SECOND STREAM"


def test_tokenize_detokenize_health_stats(client):
    assert client.tokenize("hi") == [1, ord("h"), ord("i")]
    assert client.tokenize("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    assert client.detokenize([104, 105]) == "hi"
    assert client.health() == {"status": "ok", "workers": 2, "generation": GENERATION}
    st = client.stats()
    assert st["requests"] >= 4 and "type" not in st and "id" not in st


# ---------------------------------------------------------------------------- sync: errors


ALL_CODES = sorted(protocol.ERROR_CODES)


def test_errors_cover_protocol_codes():
    assert set(ERRORS) == set(protocol.ERROR_CODES)
    for code, cls in ERRORS.items():
        assert issubclass(cls, ColibriError) and cls.code == code
    e = error_for("overloaded", "full", "r-1")
    assert type(e) is Overloaded and (e.code, e.message, e.request_id) == ("overloaded", "full", "r-1")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is Overloaded and (e2.code, e2.message, e2.request_id) == ("overloaded", "full", "r-1")
    assert issubclass(ColibriTimeout, ColibriError) and ColibriTimeout.code == "timeout"


@pytest.mark.parametrize("code", ALL_CODES)
def test_error_code_maps_to_class(client, code):
    with pytest.raises(ColibriError) as ei:
        client.generate(f"error:{code}")
    e = ei.value
    assert type(e) is ERRORS[code]
    assert e.code == code and e.message == "as requested" and isinstance(e.request_id, str)


def test_overloaded(client):
    with pytest.raises(Overloaded):
        client.generate("overload")
    with pytest.raises(Overloaded):
        next(iter(client.stream("overload")))
    assert client.generate("still fine").text == "STILL FINE"


def test_unknown_code_maps_to_base_class(client):
    with pytest.raises(ColibriError) as ei:
        client.generate("error:from_a_newer_server")
    assert type(ei.value) is ColibriError and ei.value.code == "from_a_newer_server"


@pytest.mark.parametrize("kind", ["magic", "frames", "msgpack", "notmap", "token", "done", "usage",
                                  "type", "errcode"])
def test_malformed_server_message_is_internal_error(client, kind):
    with pytest.raises(ColibriError) as ei:
        client.generate(f"garbage:{kind}")
    assert type(ei.value) is InternalError and ei.value.code == "internal"
    assert client.generate("after garbage").text == "AFTER GARBAGE"


def test_error_without_id_fails_the_waiting_request(client):
    with pytest.raises(Overloaded):
        client.generate("garbage:noid")


def test_too_large_is_caught_client_side(client, server):
    with pytest.raises(ColibriError) as ei:
        client.generate("x" * (protocol.MAX_BODY + 10))
    assert ei.value.code == "too_large"
    assert not server.received


# ---------------------------------------------------------------------------- sync: timeout / cancel


def test_timeout_raises_and_sends_cancel(server):
    with Client(server.addr, timeout=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(ColibriTimeout) as ei:
            c.generate("silent")
        assert 0.15 < time.monotonic() - t0 < 2.0
        rid = ei.value.request_id
        assert ei.value.code == "timeout" and rid == server.received[0]["id"]
        assert _wait(lambda: rid in server.cancels)
        # the server's late "done cancelled" for rid is discarded; the client still works
        assert c.generate("next one").text == "NEXT ONE"
        assert c.health()["status"] == "ok"


def test_per_call_timeout(client, server):
    with pytest.raises(ColibriTimeout):
        client.generate("silent", timeout=0.1)
    assert _wait(lambda: len(server.cancels) == 1)


def test_closing_stream_early_sends_cancel(client, server):
    s = client.stream("slow", max_tokens=200)
    first = next(s)
    assert first.text == "aba"
    s.close()
    assert _wait(lambda: s.id in server.cancels)
    assert list(s) == []
    assert client.generate("after cancel").text == "AFTER CANCEL"


def test_abandoned_stream_is_cancelled_on_gc(client, server):
    for chunk in client.stream("slow", max_tokens=200):
        break
    gc.collect()
    rid = server.received[0]["id"]
    assert _wait(lambda: rid in server.cancels)
    assert client.generate("then this").text == "THEN THIS"


def test_explicit_cancel_ends_stream_with_cancelled(client, server):
    s = client.stream("slow", max_tokens=200)
    next(s)
    client.cancel(s.id)
    final = list(s)[-1]
    assert final.finish_reason == "cancelled"
    assert server.cancels == [s.id]


def test_finished_stream_sends_no_cancel(client, server):
    list(client.stream("abc"))
    client.generate("def")
    time.sleep(0.05)
    assert server.cancels == []


def test_messages_for_unknown_ids_are_ignored(client):
    r = client.generate("noise and more")
    assert r.text == "NOISE AND MORE"
    assert r.token_ids == [ord(c) for c in "NOISE AND MORE"]


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve():
    server_public, server_secret = zmq.curve_keypair()
    srv = FakeServer(f"ipc://{tempfile.mkdtemp(prefix='coli')}/c.sock", curve_secret=server_secret)
    srv.start()
    try:
        with Client(srv.addr, timeout=3.0, curve=server_public.decode()) as c:
            assert c.generate("secret").text == "SECRET"
        with Client(srv.addr, timeout=3.0, curve=(server_public, *zmq.curve_keypair())) as c:
            assert c.tokenize("a") == [1, 97]
        with Client(srv.addr, timeout=0.3, curve=zmq.curve_keypair()[0]) as c:   # wrong server key
            with pytest.raises(ColibriTimeout):
                c.health()
    finally:
        srv.stop()
        path = srv.addr[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(os.path.dirname(path))
    assert not srv.is_alive()


def test_closed_client_refuses(server):
    c = Client(server.addr, timeout=1.0)
    c.close()
    c.close()
    with pytest.raises(RuntimeError):
        c.generate("x")


# ---------------------------------------------------------------------------- async


def test_async_concurrent_generates(server):
    server.min_active = 8         # hold until all 8 are in flight, then interleave
    prompts = [f"prompt number {i} " + "x" * i for i in range(8)]

    async def main():
        async with AsyncClient(server.addr, timeout=3.0) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=64) for p in prompts))

    results = _arun(main())
    for p, r in zip(prompts, results):
        assert r.text == p.upper() and r.token_ids == [ord(ch) for ch in p.upper()]
        assert r.finish_reason == "stop" and r.usage["prompt_tokens"] == len(p)
    assert len({r.id for r in results}) == 8
    switches = sum(a != b for a, b in zip(server.emitted, server.emitted[1:]))
    assert switches > 8 * 4        # the responses really were interleaved


def test_async_stream(server):
    async def main():
        async with AsyncClient(server.addr, timeout=3.0) as c:
            chunks = [ch async for ch in c.stream("async world", max_tokens=16)]
            toks = await c.tokenize("ab")
            text = await c.detokenize([104, 105])
            h, st = await c.health(), await c.stats()
            return chunks, toks, text, h, st

    chunks, toks, text, h, st = _arun(main())
    assert "".join(ch.text for ch in chunks) == "ASYNC WORLD"
    assert [ch.index for ch in chunks[:-1]] == [0, 1, 2, 3]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].generation == GENERATION
    assert all(ch.finish_reason is None for ch in chunks[:-1])
    assert toks == [1, 97, 98] and text == "hi" and h["status"] == "ok" and "requests" in st


@pytest.mark.parametrize("code", ["overloaded", "deadline_exceeded", "worker_lost", "internal"])
def test_async_errors(server, code):
    async def main():
        async with AsyncClient(server.addr, timeout=3.0) as c:
            with pytest.raises(ERRORS[code]):
                await c.generate(f"error:{code}")
            with pytest.raises(InternalError):
                await c.generate("garbage:token")
            with pytest.raises(InternalError):
                await c.generate("garbage:magic")
            return (await c.generate("noise then ok")).text

    assert _arun(main()) == "NOISE THEN OK"


def test_async_timeout_sends_cancel(server):
    async def main():
        async with AsyncClient(server.addr, timeout=0.2) as c:
            with pytest.raises(ColibriTimeout) as ei:
                await c.generate("silent")
            rid = ei.value.request_id
            for _ in range(200):
                if rid in server.cancels:
                    break
                await asyncio.sleep(0.01)
            return rid, (await c.generate("alive")).text

    rid, text = _arun(main())
    assert rid in server.cancels and text == "ALIVE"


def test_async_task_cancellation_sends_cancel(server):
    async def main():
        async with AsyncClient(server.addr, timeout=3.0) as c:
            task = asyncio.ensure_future(c.generate("silent"))
            while not server.silent:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            rid = server.received[0]["id"]
            for _ in range(200):
                if rid in server.cancels:
                    break
                await asyncio.sleep(0.01)
            return rid, (await c.generate("alive")).text

    rid, text = _arun(main())
    assert rid in server.cancels and text == "ALIVE"


def test_async_stream_break_sends_cancel(server):
    async def main():
        async with AsyncClient(server.addr, timeout=3.0) as c:
            async for ch in c.stream("slow", max_tokens=200):
                assert ch.text == "aba"
                break
            gc.collect()
            rid = server.received[0]["id"]
            for _ in range(200):
                if rid in server.cancels:
                    break
                await asyncio.sleep(0.01)
            return rid, (await c.generate("alive")).text

    rid, text = _arun(main())
    assert rid in server.cancels and text == "ALIVE"
