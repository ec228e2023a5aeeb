"""The asyncio pool: `AsyncClient([addr1, addr2])`, the API of AsyncClient over several routers, as
the synchronous pool (colibri_server.client.pool, which says how a router is chosen, when a request
goes to the next one and when it never does). Its concrete class is aio.AsyncPoolClient."""
from __future__ import annotations

from .core import MAX_TOKENS, TEMPERATURE, _AsyncStreamEnds, _encode
from .pool import _REFUSALS, _PoolBase, _PoolStreamBase, failure_cause, merge_health
from .types import ColibriError, ColibriTimeout, ConnectionLost, Unreachable


class _AsyncPoolStream(_PoolStreamBase, _AsyncStreamEnds):
    """AsyncPoolClient.stream's async iterator of Chunks: sent on the first __anext__ to the first
    router that takes it."""

    def __init__(self, pool, body, timeout):
        super().__init__(pool, body, timeout)
        _encode(body)                   # too large -> TooLarge now, from stream() (as AsyncStream)

    async def _place(self):
        """The member stream of the next router to try (nothing is sent until it is iterated)."""
        pool = self._pool
        a = await pool._pick(self._tried, self.id)
        if a is None:
            self._finished = True
            raise pool.routers.exhausted(self._tried, self.id)
        self._hold(a, pool._member_stream(pool._members[a], self._body, self._timeout))

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            if self._finished:
                raise StopAsyncIteration
            try:
                if self._stream is None:
                    await self._place()
                return self._got(await self._stream.__anext__())
            except ColibriError as e:
                if self._stream is None or not self._passed_on(e):
                    self._end()
                    raise
            except BaseException:               # asyncio.CancelledError included: the member cancels
                self.close()
                raise


class _AsyncPoolClient(_PoolBase):
    """The asyncio pool's API (see AsyncClient and colibri_server.client.pool)."""

    _member_stream = None       # aio.AsyncStream (set by the concrete class)

    @staticmethod
    def _member_up(m) -> bool:
        m._ensure_reader()          # its watcher follows the connection from now on
        return m._up

    async def _pick(self, tried, rid=None):
        """As the synchronous pool's (pool._PoolClient._pick)."""
        import asyncio
        a, order = self._choice(tried)
        if a is not None or not order:
            return a
        waits = [asyncio.ensure_future(self._members[x]._connection().wait()) for x in order]
        try:
            done, pending = await asyncio.wait(waits, timeout=self.connect_timeout,
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self._none_came(order, tried, rid)
                return None
            if pending:
                await asyncio.wait(pending, timeout=self.grace)
        finally:
            for w in waits:
                w.cancel()
        return self._choice(tried)[0] or order[waits.index(next(iter(done)))]

    def _close_members(self):
        for m in self._members.values():
            m._mark_closed()
            m._close_monitor()
            m._sock.close(linger=0)
            m._ctx.term()

    def stream(self, prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *, timeout=None, **params):
        return _AsyncPoolStream(self, self._body(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    async def generate(self, prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *,
                       timeout=None, **params):
        async with self.stream(prompt, max_tokens, temperature, timeout=timeout, **params) as s:
            return await s.completion()

    async def _any(self, call):
        """await call(member) on the first router that answers (read-only requests: a dropped
        connection is tried on the next router too)."""
        self._check_open()
        tried = []
        while (a := await self._pick(tried)) is not None:
            try:
                out = await call(self._members[a])
            except (Unreachable, ConnectionLost) + _REFUSALS as e:
                self._note(a, e)
                tried.append((a, e))
                continue
            except ColibriTimeout as e:
                self._note(a, e)
                raise
            self.routers.succeeded(a)
            return a, out
        raise self.routers.exhausted(tried)

    async def tokenize(self, text, add_special_tokens: bool = True, *, timeout=None) -> list:
        return (await self._any(lambda m: m.tokenize(text, add_special_tokens, timeout=timeout)))[1]

    async def detokenize(self, ids, *, timeout=None) -> str:
        return (await self._any(lambda m: m.detokenize(ids, timeout=timeout)))[1]

    async def stats(self, *, timeout=None) -> dict:
        a, st = await self._any(lambda m: m.stats(timeout=timeout))
        return {**st, "addr": a}

    async def health(self, *, timeout=None) -> dict:
        """Every router's health, asked at once, merged (see pool.merge_health)."""
        import asyncio
        self._check_open()
        ups = self._ups()

        async def one(a, m):
            row = self._state_row(a, ups[a])
            if row is not None:
                return row
            try:
                row = {"addr": a, **await m.health(timeout=timeout)}
                self.routers.succeeded(a)
                return row
            except ColibriError as e:
                self._note(a, e)
                return {"addr": a, "status": "unreachable" if isinstance(e, Unreachable) else "error",
                        "error": failure_cause(e)}
        return merge_health(list(await asyncio.gather(*(one(a, m) for a, m in self._members.items()))))

    async def cancel(self, request_id):
        self._check_open()
        holder = self._holders.get(request_id)
        if holder is not None:
            await self._members[holder.addr].cancel(request_id)

    async def close(self):
        if not self._closed:
            self._closed = True
            self._release_all()
            for m in self._members.values():
                await m.close()
