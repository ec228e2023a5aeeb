"""The synchronous client of the colibri wire protocol (see `colibri_server.wire.protocol`).

    from colibri_server.client import Client
    with Client("tcp://127.0.0.1:5555", timeout=30) as c:
        print(c.generate("Once upon a time", max_tokens=32).text)
        for chunk in c.stream("Hello", max_tokens=8):
            print(chunk.text, end="", flush=True)

Several routers (one per machine): `Client([addr1, addr2])` spreads requests over them and fails over
when one is down (see `colibri_server.client.pool`); `Client(RouterSet([...]))` in several threads
shares what they learn of the routers.

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

import time
from typing import Optional, Sequence

import zmq

from .core import (
    MAX_TOKENS,
    TEMPERATURE,
    Prompt,
    _cancel_body,
    _ClientCore,
    _encode,
    _ms,
    _Request,
    _StreamCore,
    _StreamEnds,
    _timeout_error,
    _unreachable,
)
from .pool import _PoolClient
from .types import Chunk, ColibriError, Completion


class Stream(_StreamCore, _StreamEnds):
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

    def wait(self, timeout: float) -> bool:
        """Whether the next message has arrived, waiting for it at most `timeout` seconds (no
        timeout error, no cancel: a caller that wants to look elsewhere meanwhile, as the gateway
        checks whether its HTTP client hung up)."""
        return self._finished or self._client._wait(self.id, timeout)

class Client(_ClientCore):
    """Synchronous client: one ZeroMQ context and DEALER socket.  NOT thread-safe.

    addr: "tcp://host:port" or "ipc:///path" (anything else: ValueError).  timeout: seconds
    to wait for the next message of a request.  connect_timeout (3 s): seconds a send waits
    for a connection; with no server listening it raises `Unreachable` naming the address and
    the likely cause, instead of waiting out `timeout`.  curve: None, the server's
    public key (an ephemeral client key pair is made), or (server_public, client_public,
    client_secret), Z85 text or bytes.

    A list of addresses (or a RouterSet) instead of one makes a PoolClient: same API, each request
    on one of the routers, failing over when one is down (colibri_server.client.pool).
    """

    def __new__(cls, addr=None, *args, **kwargs):
        if cls is Client and addr is not None and not isinstance(addr, str):
            return super().__new__(PoolClient)
        return super().__new__(cls)

    # -- I/O

    def _send(self, body):
        self._check_open()
        frames, rid = _encode(body), body.get("id")
        if self._drain_monitor():       # a drop already seen fails what was sent before it, not this one
            self._connection_lost(self._queues.keys() - {rid})
        if not self._up:
            self._wait_connected(rid)
        try:
            self._sock.send_multipart(frames)
        except zmq.Again:
            raise _unreachable(self.addr, self.connect_timeout, rid, self._curve) from None

    def _wait_connected(self, rid):
        """Block until a connection completed its handshake (at most connect_timeout).

        After a drop, the socket may still hold the dead connection's pipe for a moment (the
        IO thread's 'pipe ended' command is not yet processed) and IMMEDIATE discards whatever
        was queued in it: a request sent then would vanish without an error.  The handshake of
        the next connection comes after that command; processing the socket's commands
        (reading EVENTS) then leaves only live pipes to send on."""
        deadline = time.monotonic() + min(self.timeout, self.connect_timeout)
        while not self._up:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _unreachable(self.addr, self.connect_timeout, rid, self._curve)
            if self._mon.poll(_ms(remaining)) and self._drain_monitor():
                self._connection_lost(self._queues.keys() - {rid})
        self._sock.get(zmq.EVENTS)

    def _cancel_nowait(self, rid):
        if self._closed:
            return
        try:
            self._sock.send_multipart(_encode(_cancel_body(rid)), flags=zmq.NOBLOCK)
        except (zmq.ZMQError, ColibriError):
            pass

    def _next(self, rid, timeout):
        """The next queued item for rid, receiving (and routing) until one is there."""
        timeout = self._timeout_for(timeout)
        if not self._wait(rid, timeout):
            raise _timeout_error("no message", timeout, rid)
        return self._queues[rid].popleft()

    def _wait(self, rid, timeout) -> bool:
        """Receive (and route) until an item for rid is queued or `timeout` seconds pass: whether one is."""
        self._check_open()
        q = self._queues[rid]
        deadline = time.monotonic() + timeout
        while not q:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._mon, zmq.POLLIN)
            events = dict(poller.poll(_ms(remaining)))
            if events:
                for _ in range(10_000):         # answers that arrived before a disconnect count
                    try:
                        parts = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(parts)
            if self._mon in events and self._drain_monitor():
                self._connection_lost()
        return True

    def _call(self, req: _Request, timeout):
        with self._awaiting(req.id):
            self._send(req.body)
            return req.result(self._next(req.id, timeout))

    # -- API

    def stream(self, prompt: Prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *,
               timeout: Optional[float] = None, **params) -> Stream:
        """Send a generate and return an iterator of Chunks (the last one has finish_reason).

        params: top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias ({id: bias}), n, logprobs, prompt_logprobs, prompt_embeds (an array (T, hidden) given
        instead of the prompt: pass prompt=None), grammar ((type, value): "json_schema"
        with a schema dict or JSON text, "regex", "lark"), seed, stop, stop_token_ids,
        ignore_eos, deadline_ms, request_id (see protocol).  Raises the ColibriError subclass of an
        error answer; ColibriTimeout (after sending a cancel) if no message arrives in time.
        """
        return Stream(self, self._generate(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    def generate(self, prompt: Prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *,
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
            self._close_monitor()
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

class PoolClient(_PoolClient, Client):
    """`Client([addr1, addr2, ...])` or `Client(router_set)`: one Client per router, each request on
    one of them (see colibri_server.client.pool). Extra arguments: backoff, backoff_max (seconds a
    router found down is skipped: first, and at most; a RouterSet given has its own). Attributes:
    addrs, routers (the RouterSet). health() merges every router's; stats() is one router's, with
    "addr" naming it."""
    _member_class = Client
    _member_stream = Stream
