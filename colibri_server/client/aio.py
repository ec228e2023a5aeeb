"""The asyncio client (`AsyncClient`, `AsyncStream`): the API of `colibri_server.client.Client` with
`async def`, shareable by the tasks of ONE event loop (a single background task receives every
message and routes it by request id to a per-request `asyncio.Queue`). Import it from
colibri_server.client."""
from __future__ import annotations

import asyncio
from typing import Optional, Sequence

import zmq
import zmq.asyncio

from .core import (
    MAX_TOKENS,
    TEMPERATURE,
    Prompt,
    _AsyncStreamEnds,
    _cancel_body,
    _ClientCore,
    _encode,
    _Request,
    _StreamCore,
    _timeout_error,
    _unreachable,
)
from .pool_async import _AsyncPoolClient
from .types import Chunk, Completion, _internal


class AsyncStream(_StreamCore, _AsyncStreamEnds):
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


class AsyncClient(_ClientCore):
    """asyncio client: one zmq.asyncio context and DEALER socket, shared by any number of
    tasks of one event loop.  A background task receives every message and routes it by
    request id to a per-request queue.  Same arguments as `Client` (a list of addresses, or a
    RouterSet, makes an AsyncPoolClient: see colibri_server.client.pool)."""

    def __new__(cls, addr=None, *args, **kwargs):
        if cls is AsyncClient and addr is not None and not isinstance(addr, str):
            return super().__new__(AsyncPoolClient)
        return super().__new__(cls)

    _context = zmq.asyncio.Context
    _new_queue = asyncio.Queue
    _reader: Optional[asyncio.Task] = None      # the receiving task, started by the first send

    _watcher: Optional[asyncio.Task] = None     # fails the requests in flight when the connection drops

    # -- I/O

    def _ensure_reader(self):
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_connection())

    _connected: Optional[asyncio.Event] = None  # set while a handshaken connection is up (mirrors _up)
    _unsent: set = frozenset()                  # ids waiting in _send for a connection: not in flight

    def _connection(self) -> asyncio.Event:
        if self._connected is None:
            self._connected = asyncio.Event()
            if self._up:
                self._connected.set()
        return self._connected

    async def _watch_connection(self):
        try:
            while True:
                lost = self._monitor_event(await self._mon.recv_multipart())
                (self._connection().set if self._up else self._connection().clear)()
                if lost:
                    in_flight = self._queues.keys() - self._unsent
                    await asyncio.sleep(0.05)   # answers that arrived before the drop are routed first
                    self._connection_lost(in_flight)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass

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
            if not self._up:
                # after a drop the dead connection's pipe may linger a moment and IMMEDIATE
                # discards what is queued in it: wait for the next handshake (see Client._wait_connected)
                self._unsent = set(self._unsent) | {rid}
                try:
                    await asyncio.wait_for(self._connection().wait(), min(self.timeout, self.connect_timeout))
                finally:
                    self._unsent = self._unsent - {rid}
                self._sock.get(zmq.EVENTS)      # process the socket's commands: only live pipes remain
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

    def stream(self, prompt: Prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *,
               timeout: Optional[float] = None, **params) -> AsyncStream:
        """`async for chunk in client.stream(...)`; see Client.stream."""
        return AsyncStream(self, self._generate(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    async def generate(self, prompt: Prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *,
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
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._reader = self._watcher = None
        self._close_monitor()
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class AsyncPoolClient(_AsyncPoolClient, AsyncClient):
    """`AsyncClient([addr1, addr2, ...])`: one AsyncClient per router, each request on one of them
    (see colibri_server.client.pool; arguments as PoolClient's)."""
    _member_class = AsyncClient
    _member_stream = AsyncStream
