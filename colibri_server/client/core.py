"""What the synchronous and the asyncio clients share: request bodies and their checks, the
frames on the wire, the per-request state of a generation, and the socket-independent cores of a
client and a stream. The public API is colibri_server.client's.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import struct
from collections import deque
from typing import Optional, Sequence, Union

import zmq
import zmq.asyncio

from ..wire import protocol
from ..wire.protocol import MAGIC, MAX_BODY, ProtocolError

Prompt = Union[str, Sequence[int]]
# answers may be larger than requests (a tokenize of a long text: more ids than a request may carry)
RESPONSE_MAX_BODY = 64 << 20
RESPONSE_MAX_ARRAY = 1 << 24

from .types import (
    BadRequest,
    Choice,
    Chunk,
    ColibriError,
    ColibriTimeout,
    Completion,
    ConnectionLost,
    TooLarge,
    Unreachable,
    _internal,
    error_for,
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
        self.logprobs = None
        self.request_id = None
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
            choice = _opt(body, "choice", _is_int, 0, rid, "an int")
            lp = _opt(body, "logprobs", lambda v: isinstance(v, list), None, rid, "a list")
            plp = _opt(body, "prompt_logprobs", lambda v: isinstance(v, list), None, rid, "a list")
            if choice == 0:                 # the first completion's pieces: what done's text/ids repeat
                self.text.append(text)
                self.ids.extend(ids)
            self.n_chunks += 1
            return Chunk(text, ids, index, choice=choice, logprobs=lp, prompt_logprobs=plp)
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
            is_list = lambda v: isinstance(v, list)     # noqa: E731
            self.logprobs = _opt(body, "logprobs", is_list, None, rid, "a list")
            prompt_lp = _opt(body, "prompt_logprobs", is_list, None, rid, "a list")
            self.request_id = _opt(body, "request_id", lambda v: isinstance(v, str), None, rid, "a str")
            choices = _opt(body, "choices", lambda v: isinstance(v, list) and all(isinstance(c, dict) for c in v),
                           None, rid, "a list of maps")
            streamed_text = "".join(self.text)
            tail_text = _cut(streamed_text, text)
            tail_ids = _cut(self.ids, ids)
            self.text.append(tail_text)
            self.ids.extend(tail_ids)
            self.ended = True
            if choices is None:
                choices = [Choice(0, "".join(self.text), list(self.ids), fr, self.logprobs)]
            else:
                try:
                    choices = [Choice(int(c["index"]), str(c["text"]), [int(t) for t in c["ids"]],
                                      str(c["finish_reason"]), c.get("logprobs")) for c in choices]
                except (KeyError, TypeError, ValueError):
                    raise _internal("malformed done message: a choice lacks index, text, ids or finish_reason",
                                    rid) from None
            self.final = Chunk(tail_text, list(tail_ids), self.n_chunks, fr, usage, timings, generation, pid,
                               choices=choices, prompt_logprobs=prompt_lp, request_id=self.request_id)
            return self.final
        raise _internal(f"unexpected message type {t!r} for a generate", rid)

    def completion(self) -> Completion:
        f = self.final
        return Completion("".join(self.text), list(self.ids), f.finish_reason, f.usage, f.timings,
                          f.generation, f.worker_pid, self.rid, self.logprobs, f.prompt_logprobs, f.choices,
                          self.request_id)


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


# the defaults of stream() and generate(): the protocol's field table (a field not sent takes its default there)
MAX_TOKENS = protocol.SAMPLING_FIELDS["max_tokens"].default
TEMPERATURE = protocol.SAMPLING_FIELDS["temperature"].default

_GEN_PARAMS = (set(protocol.SAMPLING_FIELDS) | {"stop", "stop_token_ids", "deadline_ms", "n", "logit_bias",
                                                 "grammar", "prompt_embeds", "request_id"}) - \
    {"max_tokens", "temperature"}


def _embeds_bytes(v) -> bytes:
    """Rows of embeddings as little-endian float32 bytes, row after row: an array by its own methods
    (the client itself needs no numpy), rows of numbers by struct."""
    if hasattr(v, "astype") and hasattr(v, "tobytes"):
        return v.astype("<f4").tobytes(order="C")
    flat = [float(x) for row in v for x in row]
    return struct.pack(f"<{len(flat)}f", *flat)


def _generate_body(rid, prompt, max_tokens, temperature, params) -> dict:
    unknown = sorted(set(params) - _GEN_PARAMS)
    if unknown:
        raise TypeError(f"generate() got an unexpected parameter {unknown[0]!r} "
                        f"(known: max_tokens, temperature, {', '.join(sorted(_GEN_PARAMS))})")
    if prompt is not None and not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]   # tuples, numpy arrays, ...
    body = {"type": "generate", "id": rid, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    if prompt is not None:
        body["prompt"] = prompt
    for k, v in params.items():
        if v is not None:
            if k == "prompt_embeds" and not isinstance(v, bytes):     # an array (T, hidden) -> float32 bytes
                v = _embeds_bytes(v)
            if k == "grammar" and isinstance(v, (tuple, list)):     # (type, value) -> {type, value}
                v = {"type": v[0], "value": v[1] if isinstance(v[1], str) else json.dumps(v[1])}
            if k == "logit_bias":           # {id: bias} or pairs -> [[id, bias], ...] on the wire
                v = [[int(t), float(b)] for t, b in (v.items() if isinstance(v, dict) else v)]
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
            # a dropped connection (the router died) fails the requests in flight: their answers
            # would never come (ZeroMQ reconnects by itself; later requests go to the new router)
            # (only a connection that completed its handshake counts: a refused CURVE key is not a drop)
            self._mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._up = False
            self._drops = 0         # established connections that dropped (pool.py reads it)
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

    def _fail_all(self, exc, rids=None):
        for rid, q in self._queues.items():
            if rids is None or rid in rids:
                q.put_nowait(_Failure(exc))

    def _connection_lost(self, rids=None):
        """Fail the requests in flight (rids: those of them, default all) when the connection dropped."""
        if self._queues:
            self._fail_all(ConnectionLost(f"the connection to {self.addr} dropped with the request in flight "
                                          "(the server's router restarted or stopped): no answer will come; "
                                          "retry", code="connection_lost"), rids)

    def _monitor_event(self, parts) -> bool:
        """Track the connection from one monitor message; True when an established one dropped."""
        from zmq.utils.monitor import parse_monitor_message
        try:
            ev = parse_monitor_message(parts)["event"]
        except Exception:
            return False
        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up = True
        elif ev == zmq.EVENT_DISCONNECTED:
            lost, self._up = self._up, False
            self._drops += lost
            return lost
        return False

    def _drain_monitor(self) -> bool:
        lost = False
        while True:
            try:
                lost |= self._monitor_event(self._mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return lost

    def _close_monitor(self):
        try:
            self._sock.disable_monitor()
        except Exception:
            pass
        self._mon.close(linger=0)

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


class _StreamEnds:
    """How a synchronous stream (Stream, the pool's stream) ends: iterated to its end by
    completion(), or closed by its `with` block. A stream class puts its core first among its
    bases (Stream(_StreamCore, _StreamEnds)): the core gives __iter__, _completion and close."""

    def _completion(self) -> Completion:
        raise NotImplementedError

    def close(self):
        raise NotImplementedError

    def completion(self) -> Completion:
        """Consume the rest of the stream and return the whole answer."""
        for _ in self:
            pass
        return self._completion()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _AsyncStreamEnds:
    """The same for an asyncio stream (AsyncStream, the async pool's stream)."""

    def _completion(self) -> Completion:
        raise NotImplementedError

    def close(self):
        raise NotImplementedError

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
