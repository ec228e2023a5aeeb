"""Python client for the colibri wire protocol (see `colibri_server.protocol`).

    from colibri_server.client import Client
    with Client("tcp://127.0.0.1:5555", timeout=30) as c:
        print(c.generate("Once upon a time", max_tokens=32).text)
        for chunk in c.stream("Hello", max_tokens=8):
            print(chunk.text, end="", flush=True)

`Client` is synchronous and NOT thread-safe: use one Client per thread (each has its own
ZeroMQ context and DEALER socket).  It may nevertheless have several requests open at once
from the same thread (e.g. two `stream()`s iterated alternately): messages for a request other
than the one being waited for are buffered for it, and messages for ids that are no longer
awaited (finished, timed out, closed streams) are discarded.

`AsyncClient` has the same API with `async def` and may be shared by many tasks of ONE event
loop: a single background task receives every message and routes it by request id to a
per-request `asyncio.Queue`.

Timeouts are per message: `timeout` is the longest wait for the NEXT message of a request
(so a long generation that keeps streaming never times out).  On a timeout the client sends
a `cancel` for a generate and raises `ColibriTimeout`.  Closing a stream early, or cancelling
the task awaiting it, also sends a `cancel`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import secrets
import time
from collections import deque
from typing import Optional, Sequence, Union

import zmq
import zmq.asyncio

from . import protocol
from .protocol import MAGIC, MAX_BODY, ProtocolError

__all__ = [
    "Client", "AsyncClient", "Completion", "Chunk", "Stream", "AsyncStream",
    "ColibriError", "ColibriTimeout", "ERRORS", "error_for",
    "BadRequest", "UnsupportedVersion", "UnknownType", "TooLarge", "Overloaded",
    "DeadlineExceeded", "Cancelled", "WorkerLost", "ShuttingDown", "DuplicateId",
    "NotFound", "Unauthorized", "InternalError", "Unreachable",
]

Prompt = Union[str, Sequence[int]]
# answers may be larger than requests (a tokenize of a long text: more ids than a request may carry)
RESPONSE_MAX_BODY = 64 << 20
RESPONSE_MAX_ARRAY = 1 << 24

from .client_types import (  # noqa: F401  (re-exported: the public API lives here)
    ColibriError, BadRequest, UnsupportedVersion, UnknownType, TooLarge,
    Overloaded, DeadlineExceeded, Cancelled, WorkerLost, ShuttingDown, DuplicateId,
    NotFound, Unauthorized, InternalError, ColibriTimeout, Unreachable, ERRORS, error_for, _internal,
    Completion, Chunk,
)


class _Failure:
    """Queued in place of a body: the request must fail with `exc` (e.g. a malformed,
    unattributable server message, or the client being closed)."""
    __slots__ = ("exc",)

    def __init__(self, exc: ColibriError):
        self.exc = exc


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v):
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _opt(body, name, check, default, rid, what):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise _internal(f"malformed {body.get('type')!r} message: field {name!r} is not {what}", rid)
    return v


def _raise_if_error(item, rid):
    """A queued item -> a body dict; raise for failures and "error" bodies."""
    if isinstance(item, _Failure):
        exc = item.exc
        if exc.request_id is None:
            exc = type(exc)(exc.message, code=exc.code, request_id=rid)
        raise exc
    if item.get("type") == "error":
        code = item.get("code")
        message = item.get("message", "")
        if not isinstance(code, str):
            raise _internal(f"malformed error message (code {code!r})", rid)
        if not isinstance(message, str):
            message = repr(message)
        raise error_for(code, message, rid)
    return item


def _cut(streamed, full):
    """What `full` (the done message's text or ids) adds beyond what was streamed.

    The spec says done carries all text and ids; a server may also send only the tail or
    nothing in stream mode.  Full copy -> the unstreamed suffix; otherwise -> `full` itself."""
    n = len(streamed)
    if len(full) >= n and full[:n] == streamed:
        return full[n:]
    return full


class _GenState:
    """Turns the messages of one generate into Chunks and the final Completion."""

    def __init__(self, rid):
        self.rid = rid
        self.text = []
        self.ids = []
        self.n_chunks = 0
        self.ended = False          # the server ended the request (done or error)
        self.final: Optional[Chunk] = None

    def feed(self, item) -> Chunk:
        rid = self.rid
        try:
            body = _raise_if_error(item, rid)
        except ColibriError:
            if not isinstance(item, _Failure):
                self.ended = True   # an "error" message ends the request on the server
            raise
        t = body.get("type")
        if t == "token":
            text = body.get("text")
            ids = body.get("ids")
            if not isinstance(text, str) or not _int_list(ids):
                raise _internal("malformed token message (text must be a str, ids a list of ints)", rid)
            index = _opt(body, "index", _is_int, self.n_chunks, rid, "an int")
            self.text.append(text)
            self.ids.extend(ids)
            self.n_chunks += 1
            return Chunk(text, ids, index)
        if t == "done":
            fr = body.get("finish_reason")
            if not isinstance(fr, str) or not fr:
                raise _internal("malformed done message: finish_reason is missing", rid)
            text = _opt(body, "text", lambda v: isinstance(v, str), "", rid, "a str")
            ids = _opt(body, "ids", _int_list, [], rid, "a list of ints")
            usage = _opt(body, "usage", lambda v: isinstance(v, dict), {}, rid, "a map")
            timings = _opt(body, "timings", lambda v: isinstance(v, dict), {}, rid, "a map")
            generation = _opt(body, "generation", _is_int, None, rid, "an int")
            pid = _opt(body, "worker_pid", _is_int, None, rid, "an int")
            streamed_text = "".join(self.text)
            tail_text = _cut(streamed_text, text)
            tail_ids = _cut(self.ids, ids)
            self.text.append(tail_text)
            self.ids.extend(tail_ids)
            self.ended = True
            self.final = Chunk(tail_text, list(tail_ids), self.n_chunks, fr, usage, timings, generation, pid)
            return self.final
        raise _internal(f"unexpected message type {t!r} for a generate", rid)

    def completion(self) -> Completion:
        f = self.final
        return Completion("".join(self.text), list(self.ids), f.finish_reason, f.usage, f.timings,
                          f.generation, f.worker_pid, self.rid)


def _result_body(item, rid) -> dict:
    body = _raise_if_error(item, rid)
    if body.get("type") != "result":
        raise _internal(f"unexpected message type {body.get('type')!r} (expected 'result')", rid)
    return {k: v for k, v in body.items() if k not in ("type", "id")}


def _tokenize_result(r, rid):
    ids = r.get("ids")
    if not _int_list(ids):
        raise _internal("malformed tokenize result: 'ids' is not a list of ints", rid)
    return ids


def _detokenize_result(r, rid):
    text = r.get("text")
    if not isinstance(text, str):
        raise _internal("malformed detokenize result: 'text' is not a str", rid)
    return text


_GEN_PARAMS = (set(protocol.SAMPLING_FIELDS) | {"stop", "stop_token_ids", "deadline_ms"}) - {"max_tokens", "temperature"}


def _generate_body(rid, prompt, max_tokens, temperature, params) -> dict:
    unknown = sorted(set(params) - _GEN_PARAMS)
    if unknown:
        raise TypeError(f"generate() got an unexpected parameter {unknown[0]!r} "
                        f"(known: max_tokens, temperature, {', '.join(sorted(_GEN_PARAMS))})")
    if not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]   # tuples, numpy arrays, ...
    body = {"type": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True}
    for k, v in params.items():
        if v is not None:
            body[k] = list(v) if k in ("stop", "stop_token_ids") and not isinstance(v, str) else v
    return body


def _out_of_range(v, path="request"):
    """The path of the first integer msgpack cannot carry (outside -2^63..2^64-1), or None."""
    if isinstance(v, int) and not isinstance(v, bool):
        return path if not -(1 << 63) <= v < (1 << 64) else None
    if isinstance(v, dict):
        items = v.items()
    elif isinstance(v, (list, tuple)):
        items = ((f"[{i}]", x) for i, x in enumerate(v))
    else:
        return None
    for k, x in items:
        p = _out_of_range(x, f"{path}{k}" if str(k).startswith("[") else (k if path == "request" else f"{path}.{k}"))
        if p:
            return p
    return None


def _encode(body) -> list:
    try:
        data = protocol.pack(body)
    except (OverflowError, ValueError, TypeError) as e:
        where = _out_of_range(body)
        raise BadRequest(f"field {where!r} is outside the 64-bit integer range" if where else
                         f"the request cannot be encoded ({type(e).__name__}: {e})", code="bad_request",
                         request_id=body.get("id")) from None
    if len(data) > MAX_BODY:
        raise TooLarge(f"request body of {len(data)} bytes exceeds {MAX_BODY}", code="too_large",
                       request_id=body.get("id"))
    return [MAGIC, data]


def _decode(parts):
    """Received frames -> (rid, body) for a well-formed message, or (None, _Failure) for
    one that cannot be attributed to a request."""
    if len(parts) != 2 or parts[0] != MAGIC:
        head = bytes(parts[0][:16]) if parts else b""
        return None, _Failure(_internal(f"malformed server message ({len(parts)} frames, "
                                        f"first {head!r}; expected [{MAGIC!r}, body])"))
    try:
        body = protocol.unpack(parts[1], max_body=RESPONSE_MAX_BODY, max_array=RESPONSE_MAX_ARRAY)
    except ProtocolError as e:
        return None, _Failure(_internal(f"malformed server message: {e.message}"))
    rid = body.get("id")
    if rid is None:
        if body.get("type") == "error" and isinstance(body.get("code"), str):
            # the server could not read the id of one of our messages: it cannot be routed,
            # so every request in flight learns of it rather than waiting for its timeout
            return None, _Failure(error_for(body.get("code"), str(body.get("message", ""))))
        return None, _Failure(_internal(f"server message of type {body.get('type')!r} without an id"))
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        return False, body      # cannot be one of ours: discarded
    return rid, body


DEFAULT_CONNECT_TIMEOUT = 3.0   # seconds a send waits for a connection to the server


def _apply_options(sock, timeout, curve, connect_timeout=DEFAULT_CONNECT_TIMEOUT):
    sock.setsockopt(zmq.LINGER, 0)
    # never let our receive pipe fill up: a ROUTER drops messages for a peer at its HWM
    sock.setsockopt(zmq.RCVHWM, 0)
    # queue requests only on a completed connection (CURVE handshake included): with no server,
    # a send fails after connect_timeout (Unreachable, naming the cause) instead of the request
    # waiting in the socket for a whole `timeout` that no answer can end
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, _ms(min(timeout, connect_timeout)))
    if curve is not None:
        if isinstance(curve, (bytes, str)):
            server_key, (pub, sec) = curve, zmq.curve_keypair()
        else:
            server_key, pub, sec = curve
        enc = (lambda k: k.encode("ascii") if isinstance(k, str) else k)
        sock.curve_serverkey = enc(server_key)
        sock.curve_publickey = enc(pub)
        sock.curve_secretkey = enc(sec)


def _ms(seconds) -> int:
    return max(1, math.ceil(seconds * 1000))


class _Ids:
    def __init__(self):
        self._prefix = secrets.token_hex(4)
        self._n = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}-{next(self._n)}"


# ---------------------------------------------------------------------------- what Client and AsyncClient share


def _unreachable(addr, seconds, rid, curve) -> Unreachable:
    """The error of a send that found no connection: the address and the likely cause."""
    import socket
    cause = ""
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        if not os.path.exists(path):
            cause = f"the socket file {path} does not exist: is `colibri serve --bind {addr}` running?"
        else:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(path)
                cause = "the socket accepts connections but no ZeroMQ/CURVE handshake completed " \
                        "(not a colibri server, or a CURVE key mismatch)"
            except PermissionError:
                cause = f"permission denied on {path}: run as a member of the server's group"
            except OSError as e:
                cause = f"nothing accepts connections on {path} ({e.strerror}): a server that stopped?"
    elif addr.startswith("tcp://"):
        hostport = addr[len("tcp://"):]
        host, _, port = hostport.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                pass
            cause = ("the port accepts TCP connections but the ZeroMQ handshake did not complete: "
                     + ("this client's CURVE key is not allowed, or the server key is wrong"
                        if curve is not None else "the server wants CURVE (pass its public key), or it is "
                        "not a colibri server"))
        except ConnectionRefusedError:
            cause = f"connection refused: nothing listens on {hostport}; is `colibri serve` running?"
        except socket.timeout:
            cause = f"no answer from {host}: host down or a firewall drops the packets"
        except (OSError, ValueError) as e:
            cause = f"{getattr(e, 'strerror', None) or e}"
    msg = f"cannot reach the colibri server at {addr} within {seconds:g} s" + (f": {cause}" if cause else "")
    return Unreachable(msg, code="unreachable", request_id=rid)


def _timeout_error(what, seconds, rid) -> ColibriTimeout:
    return ColibriTimeout(f"{what} within {seconds:g} s", code="timeout", request_id=rid)


def _cancel_body(rid) -> dict:
    return {"type": "cancel", "id": rid}


class _Request:
    """A request answered by one "result" message: its body, and `finish(fields, rid)`, which
    turns the result's fields into the method's return value (None: the fields themselves)."""
    __slots__ = ("body", "id", "finish")

    def __init__(self, body: dict, finish=None):
        self.body, self.id, self.finish = body, body["id"], finish

    def result(self, item):
        r = _result_body(item, self.id)
        return r if self.finish is None else self.finish(r, self.id)


class _Deque(deque):
    """The sync client's per-request queue, with the one asyncio.Queue method `_dispatch` uses."""
    put_nowait = deque.append


class _ClientCore:
    """The sans-IO part of Client and AsyncClient: the socket's setup, request ids and bodies,
    the per-request queues and the routing of every received message to one (or, for an
    unattributable failure, to all) of them.  Subclasses send, receive and wait."""

    _context = zmq.Context      # the subclass's ZeroMQ context class
    _new_queue = _Deque         # and per-request queue class

    def __init__(self, addr: str, *, timeout: float = 60.0, curve=None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT):
        if not isinstance(addr, str) or not addr.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"server address {addr!r} must look like tcp://host:port or ipc:///path")
        self.addr = addr
        self.timeout = float(timeout)
        self.connect_timeout = min(float(connect_timeout), self.timeout)
        self._curve = curve
        self._ids = _Ids()
        self._queues: dict = {}
        self._closed = True
        self._ctx = self._context()
        try:
            self._sock = self._ctx.socket(zmq.DEALER)
            _apply_options(self._sock, self.timeout, curve, self.connect_timeout)
            try:
                self._sock.connect(addr)
            except zmq.ZMQError as e:
                raise ValueError(f"server address {addr!r}: {e} (expected tcp://host:port or ipc:///path)") from None
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._closed = False

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the client is closed")

    def _timeout_for(self, timeout) -> float:
        return self.timeout if timeout is None else timeout

    # -- per-request queues

    def _open(self, rid):
        self._queues[rid] = self._new_queue()

    def _forget(self, rid):
        """Stop awaiting rid: its later messages are discarded."""
        self._queues.pop(rid, None)

    @contextlib.contextmanager
    def _awaiting(self, rid):
        self._open(rid)
        try:
            yield
        finally:
            self._forget(rid)

    def _dispatch(self, parts):
        rid, item = _decode(parts)
        if rid is None:                       # unattributable: every waiter fails
            for q in self._queues.values():
                q.put_nowait(item)
            return
        q = self._queues.get(rid) if rid is not False else None
        if q is not None:
            q.put_nowait(item)
        # else: a message for an id nobody awaits (finished, timed out, closed): discarded

    def _fail_all(self, exc):
        for q in self._queues.values():
            q.put_nowait(_Failure(exc))

    def _mark_closed(self) -> bool:
        """Mark the client closed, failing whatever awaits an answer; False if it already was."""
        if self._closed:
            return False
        self._closed = True
        self._fail_all(_internal("the client was closed"))
        self._queues.clear()
        return True

    # -- request bodies

    def _generate(self, prompt, max_tokens, temperature, params) -> dict:
        self._check_open()
        return _generate_body(self._ids(), prompt, max_tokens, temperature, params)

    def _tokenize(self, text, add_special_tokens) -> _Request:
        body = {"type": "tokenize", "id": self._ids(), "add_special_tokens": add_special_tokens}
        if isinstance(text, str):
            body["text"] = text
        else:       # [(text, is_template_text), ...]: see protocol (tokenize segments)
            body["segments"] = [[str(t), bool(p)] for t, p in text]
        return _Request(body, _tokenize_result)

    def _detokenize(self, ids) -> _Request:
        return _Request({"type": "detokenize", "id": self._ids(), "ids": [int(t) for t in ids]}, _detokenize_result)

    def _query(self, kind) -> _Request:
        """health, stats: answered by the result's fields."""
        return _Request({"type": kind, "id": self._ids()})


class _StreamCore:
    """What Stream and AsyncStream share: the request's queue on its client, turning its
    messages into Chunks (closing the stream when it ends or fails), and the cancel sent when
    it is closed after being sent and before the server ended the request."""

    def __init__(self, client: _ClientCore, body: dict, timeout: float):
        self._client = client
        self.id = body["id"]
        self._timeout = timeout
        self._state = _GenState(self.id)
        self._sent = False
        self._finished = False
        client._open(self.id)

    def _chunk(self, item) -> Chunk:
        try:
            chunk = self._state.feed(item)
        except BaseException:
            self.close()
            raise
        if self._state.final is not None:
            self.close()
        return chunk

    def _completion(self) -> Completion:
        if self._state.final is None:
            raise RuntimeError("the stream was closed before it ended")
        return self._state.completion()

    def close(self):
        if self._finished:
            return
        self._finished = True
        self._client._forget(self.id)
        if self._sent and not self._state.ended:
            self._client._cancel_nowait(self.id)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------- sync client


class Stream(_StreamCore):
    """Iterator of Chunks for one generate (returned by `Client.stream`).  The request is
    sent when the Stream is created.  Closing it (close(), `with`, garbage collection) before
    the final chunk sends a cancel; the request's remaining messages are discarded."""

    def __init__(self, client: "Client", body: dict, timeout: float):
        super().__init__(client, body, timeout)
        try:
            client._send(body)
        except BaseException:
            self.close()            # not sent: nothing to cancel
            raise
        self._sent = True

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self._finished:
            raise StopIteration
        try:
            item = self._client._next(self.id, self._timeout)
        except BaseException:
            self.close()
            raise
        return self._chunk(item)

    def completion(self) -> Completion:
        """Consume the rest of the stream and return the whole answer."""
        for _ in self:
            pass
        return self._completion()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client(_ClientCore):
    """Synchronous client: one ZeroMQ context and DEALER socket.  NOT thread-safe.

    addr: "tcp://host:port" or "ipc:///path" (anything else: ValueError).  timeout: seconds
    to wait for the next message of a request.  connect_timeout (3 s): seconds a send waits
    for a connection; with no server listening it raises `Unreachable` naming the address and
    the likely cause, instead of waiting out `timeout`.  curve: None, the server's
    public key (an ephemeral client key pair is made), or (server_public, client_public,
    client_secret), Z85 text or bytes.
    """

    # -- I/O

    def _send(self, body):
        self._check_open()
        frames = _encode(body)
        try:
            self._sock.send_multipart(frames)
        except zmq.Again:
            raise _unreachable(self.addr, self.connect_timeout, body.get("id"), self._curve) from None

    def _cancel_nowait(self, rid):
        if self._closed:
            return
        try:
            self._sock.send_multipart(_encode(_cancel_body(rid)), flags=zmq.NOBLOCK)
        except (zmq.ZMQError, ColibriError):
            pass

    def _next(self, rid, timeout):
        """The next queued item for rid, receiving (and routing) until one is there."""
        self._check_open()
        q = self._queues[rid]
        timeout = self._timeout_for(timeout)
        deadline = time.monotonic() + timeout
        while not q:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timeout_error("no message", timeout, rid)
            if self._sock.poll(_ms(remaining), zmq.POLLIN):
                for _ in range(10_000):
                    try:
                        parts = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(parts)
        return q.popleft()

    def _call(self, req: _Request, timeout):
        with self._awaiting(req.id):
            self._send(req.body)
            return req.result(self._next(req.id, timeout))

    # -- API

    def stream(self, prompt: Prompt, max_tokens: int = 16, temperature: float = 0.0, *,
               timeout: Optional[float] = None, **params) -> Stream:
        """Send a generate and return an iterator of Chunks (the last one has finish_reason).

        params: top_k, top_p, min_p, repetition_penalty, seed, stop, stop_token_ids,
        ignore_eos, deadline_ms (see protocol).  Raises the ColibriError subclass of an
        error answer; ColibriTimeout (after sending a cancel) if no message arrives in time.
        """
        return Stream(self, self._generate(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    def generate(self, prompt: Prompt, max_tokens: int = 16, temperature: float = 0.0, *,
                 timeout: Optional[float] = None, **params) -> Completion:
        """Generate and return the whole Completion (streamed under the hood)."""
        with self.stream(prompt, max_tokens, temperature, timeout=timeout, **params) as s:
            return s.completion()

    def tokenize(self, text, add_special_tokens: bool = True, *, timeout=None) -> list:
        """Token ids of `text` (special-token text in it stays text), or of a list of
        (text, is_template_text) segments, where template text's special tokens are parsed."""
        return self._call(self._tokenize(text, add_special_tokens), timeout)

    def detokenize(self, ids: Sequence[int], *, timeout=None) -> str:
        return self._call(self._detokenize(ids), timeout)

    def health(self, *, timeout=None) -> dict:
        return self._call(self._query("health"), timeout)

    def stats(self, *, timeout=None) -> dict:
        return self._call(self._query("stats"), timeout)

    def cancel(self, request_id):
        """Ask the server to cancel a request of this client (e.g. `stream.id`).  Does not
        wait: the request itself ends (done with finish_reason "cancelled", or an error)."""
        self._send(_cancel_body(request_id))

    def close(self):
        if self._mark_closed():
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------- async client


class AsyncStream(_StreamCore):
    """Async iterator of Chunks for one generate (returned by `AsyncClient.stream`).  The
    request is sent on the first `__anext__`.  Closing it early (aclose(), `async with`,
    garbage collection after a `break`) or cancelling the task that awaits it sends a cancel."""

    def __init__(self, client: "AsyncClient", body: dict, timeout: float):
        self._frames = _encode(body)    # too large -> TooLarge now, from stream()
        super().__init__(client, body, timeout)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            if not self._sent:
                self._sent = True
                await self._client._send_frames(self._frames, self.id)
            item = await self._client._next(self.id, self._timeout)
        except BaseException:       # including asyncio.CancelledError: cancel on the server
            self.close()
            raise
        return self._chunk(item)

    async def completion(self) -> Completion:
        async for _ in self:
            pass
        return self._completion()

    async def aclose(self):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()


class AsyncClient(_ClientCore):
    """asyncio client: one zmq.asyncio context and DEALER socket, shared by any number of
    tasks of one event loop.  A background task receives every message and routes it by
    request id to a per-request queue.  Same arguments as `Client`."""

    _context = zmq.asyncio.Context
    _new_queue = asyncio.Queue
    _reader: Optional[asyncio.Task] = None      # the receiving task, started by the first send

    # -- I/O

    def _ensure_reader(self):
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self):
        try:
            while True:
                parts = await self._sock.recv_multipart()
                self._dispatch(parts)
        except asyncio.CancelledError:
            raise
        except Exception as e:      # socket closed or broken: nobody will be answered
            self._fail_all(_internal(f"receive failed: {e!r}"))

    async def _send(self, body):
        await self._send_frames(_encode(body), body.get("id"))

    async def _send_frames(self, frames, rid):
        self._check_open()
        self._ensure_reader()
        try:
            await asyncio.wait_for(self._sock.send_multipart(frames), self.connect_timeout)
        except (zmq.Again, asyncio.TimeoutError):
            raise _unreachable(self.addr, self.connect_timeout, rid, self._curve) from None

    def _cancel_nowait(self, rid):
        """Best-effort cancel that never blocks or awaits (usable while being cancelled and
        from __del__); needs a running loop."""
        if self._closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        try:
            f = self._sock.send_multipart(_encode(_cancel_body(rid)), flags=zmq.DONTWAIT)
            f.add_done_callback(lambda f: f.cancelled() or f.exception())   # never "unretrieved"
        except Exception:
            pass

    async def _next(self, rid, timeout):
        self._check_open()
        q = self._queues[rid]
        timeout = self._timeout_for(timeout)
        if not q.empty():
            return q.get_nowait()
        try:
            return await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise _timeout_error("no message", timeout, rid) from None

    async def _call(self, req: _Request, timeout):
        with self._awaiting(req.id):
            await self._send(req.body)
            return req.result(await self._next(req.id, timeout))

    # -- API

    def stream(self, prompt: Prompt, max_tokens: int = 16, temperature: float = 0.0, *,
               timeout: Optional[float] = None, **params) -> AsyncStream:
        """`async for chunk in client.stream(...)`; see Client.stream."""
        return AsyncStream(self, self._generate(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    async def generate(self, prompt: Prompt, max_tokens: int = 16, temperature: float = 0.0, *,
                       timeout: Optional[float] = None, **params) -> Completion:
        async with self.stream(prompt, max_tokens, temperature, timeout=timeout, **params) as s:
            return await s.completion()

    async def tokenize(self, text: str, add_special_tokens: bool = True, *, timeout=None) -> list:
        return await self._call(self._tokenize(text, add_special_tokens), timeout)

    async def detokenize(self, ids: Sequence[int], *, timeout=None) -> str:
        return await self._call(self._detokenize(ids), timeout)

    async def health(self, *, timeout=None) -> dict:
        return await self._call(self._query("health"), timeout)

    async def stats(self, *, timeout=None) -> dict:
        return await self._call(self._query("stats"), timeout)

    async def cancel(self, request_id):
        await self._send(_cancel_body(request_id))

    async def close(self):
        if not self._mark_closed():
            return
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
