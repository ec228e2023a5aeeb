"""Several routers behind one client, for users who run one router per machine:
`Client([addr1, addr2])`, `AsyncClient([...])` and `colibri http --connect a --connect b`.

What the synchronous and the asyncio pools share lives here: the addresses (checked; a duplicate is
refused), a RouterSet (what the clients learnt of each router: down and skipped until when, the
requests it holds from them, whose turn it is; thread-safe, so the HTTP gateway's threads share one),
the error of a request no router took, the merged health, and the synchronous pool itself
(`_PoolClient`, whose concrete class is sync.PoolClient). pool_async.py has the asyncio one.

Choice: a new request goes to the usable router holding the fewest requests from this RouterSet
(least in flight: generations differ a hundredfold in length, and round-robin alone would keep
feeding a router that is still busy with long ones); ties go round-robin from a random first turn,
so one caller sending one request at a time alternates, and callers started together do not move in
step. Usable: not skipped, and either never found down or connected again. The request goes to the
first connected router in that order (the usable ones, then the skipped ones, soonest due first);
when none is connected it waits for the first to connect (all of them at once, within one
connect_timeout) and `grace` (0.1 s) more for the others, so that a burst at start is spread.

Failover: a router that cannot be reached (Unreachable: nothing was delivered) or that refuses the
request before starting it (shutting_down, starting, overloaded) leaves it to the next; a request a
router may have started (delivered, then the connection dropped: ConnectionLost; or a timeout) is never sent
again: the caller gets that error. A router found down (those, or its connection dropped while idle)
is skipped for a backoff (1 s, doubled per failure in a row, at most 30 s) and comes back once that
has passed and its connection is up again (ZeroMQ reconnects every 100 ms by itself: that is the
probe, and it costs no request anything); one answer ends the run. When no router takes a request,
the caller gets one error naming every address tried and why.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from typing import Optional

from .core import (
    DEFAULT_CONNECT_TIMEOUT,
    MAX_TOKENS,
    TEMPERATURE,
    _ClientCore,
    _generate_body,
    _Ids,
    _ms,
    _StreamEnds,
    _unreachable,
)
from .types import (
    ColibriError,
    ColibriTimeout,
    ConnectionLost,
    Overloaded,
    ShuttingDown,
    Starting,
    Unreachable,
)

log = logging.getLogger("colibri.client")

BACKOFF = 1.0           # seconds a router found down is first skipped
BACKOFF_MAX = 30.0      # the most it is skipped (the backoff doubles per failure in a row)
GRACE = 0.1             # seconds the others get to connect once the first did, when none was connected
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_REFUSALS = (ShuttingDown, Starting, Overloaded)  # answered before anything started: another router may take it


def _check_address(a) -> str:
    if not isinstance(a, str):
        raise ValueError(f"server address {a!r} is not a string (tcp://host:port or ipc:///path)")
    a = a.strip()
    if not a:
        raise ValueError("an empty server address in the list (two commas in a row, or one at the end?)")
    if not a.startswith(_SCHEMES):
        raise ValueError(f"server address {a!r} must look like tcp://host:port or ipc:///path")
    rest = a.split("://", 1)[1]
    if not rest:
        raise ValueError(f"server address {a!r} names no host or path")
    if a.startswith("tcp://"):
        host, _, port = rest.rpartition(";")[2].rpartition(":")
        if not host or not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"server address {a!r} must look like tcp://host:port (a port in 1..65535)")
    return a


def parse_addresses(addrs) -> tuple:
    """One or several router addresses -> a tuple of checked addresses. A string may hold several,
    comma-separated (COLIBRI_HTTP_CONNECT="a,b"); so may each string of a list. ValueError naming
    the address for a malformed one, an empty list, or an address given twice (exact text: a
    duplicate would double one router's share and is most likely a typo for another machine)."""
    items = [addrs] if isinstance(addrs, str) else addrs
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"server addresses {addrs!r}: expected an address or a list of addresses") from None
    out = []
    for item in items:
        for a in (item.split(",") if isinstance(item, str) else [item]):
            a = _check_address(a)
            if a in out:
                raise ValueError(f"server address {a!r} is given twice")
            out.append(a)
    if not out:
        raise ValueError("no server address given (tcp://host:port or ipc:///path)")
    return tuple(out)


class _Health:
    __slots__ = ("fails", "until", "in_flight", "error", "served")

    def __init__(self):
        self.fails, self.until, self.in_flight, self.error, self.served = 0, 0.0, 0, None, 0

    def usable(self, now, up) -> bool:
        return now >= self.until and (self.fails == 0 or up)


class RouterSet:
    """The routers of a pool and what its clients learnt of each (see the module docstring).
    Thread-safe: `Client(router_set)` in each of several threads shares the health, the turn and
    the in-flight counts (the HTTP gateway does), while each client keeps its own sockets."""

    def __init__(self, addrs, *, backoff: float = BACKOFF, backoff_max: float = BACKOFF_MAX):
        self.addrs = parse_addresses(addrs)
        for name, v in (("backoff", backoff), ("backoff_max", backoff_max)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds (got {v!r})")
        self.backoff, self.backoff_max = float(backoff), max(float(backoff), float(backoff_max))
        self._h = {a: _Health() for a in self.addrs}
        # a random first turn: independent clients (processes, threads with their own RouterSet) that
        # start together would otherwise all send their first request to the first router, and then
        # keep moving from router to router in step
        self._turn = random.randrange(len(self.addrs))
        self._lock = threading.Lock()

    def order(self, up: dict, tried=()) -> list:
        """The addresses a new request tries, in turn: the usable ones (fewest in flight first,
        ties round-robin), then the skipped ones, the soonest due first. up: address -> whether
        the asking client's connection to it is up now."""
        now = time.monotonic()
        with self._lock:
            n = len(self.addrs)
            start, self._turn = self._turn, (self._turn + 1) % n
            ring = [a for a in (self.addrs[(start + i) % n] for i in range(n)) if a not in tried]
            ready = [a for a in ring if self._h[a].usable(now, up.get(a, False))]
            ready.sort(key=lambda a: self._h[a].in_flight)
            rest = sorted((a for a in ring if a not in ready), key=lambda a: self._h[a].until)
        return ready + rest

    def failed(self, addr, reason: str):
        """addr could not be reached, or dropped its connection: skip it for a while. Failures seen
        while it is already skipped (other clients finding the same outage) do not lengthen it."""
        now = time.monotonic()
        with self._lock:
            h = self._h[addr]
            h.error = reason
            if now < h.until:
                return
            h.fails += 1
            wait = min(self.backoff_max, self.backoff * 2 ** (h.fails - 1))
            h.until = now + wait
            first = h.fails == 1
        (log.warning if first else log.info)("colibri router %s is down (%s): skipped for %g s, then used again "
                                             "once its connection is up", addr, reason, wait)

    def succeeded(self, addr, served: bool = False):
        """addr answered (served: it ended a generate): it is up."""
        with self._lock:
            h = self._h[addr]
            back, h.fails, h.until, h.error = h.fails, 0, 0.0, None
            h.served += served
        if back:
            log.info("colibri router %s answers again", addr)

    def started(self, addr):
        with self._lock:
            self._h[addr].in_flight += 1

    def ended(self, addr):
        with self._lock:
            self._h[addr].in_flight -= 1

    def state(self, addr) -> dict:
        """What the clients believe of addr: failures in a row, seconds it is still skipped,
        requests in flight, requests answered, the last failure."""
        now = time.monotonic()
        with self._lock:
            h = self._h[addr]
            return {"failures": h.fails, "skipped_for_s": round(max(0.0, h.until - now), 3),
                    "in_flight": h.in_flight, "served": h.served, "last_error": h.error}

    def usable(self, addr, up) -> bool:
        with self._lock:
            return self._h[addr].usable(time.monotonic(), up)

    def exhausted(self, tried, rid=None) -> ColibriError:
        """The one error of a request that no router took. tried: [(address, error)], each router's
        reason. Overloaded if one was only busy, Starting if one was loading, ShuttingDown if one was stopping,
        else Unreachable."""
        kinds = [type(e) for _, e in tried]
        parts = "; ".join(f"{a}: {failure_cause(e)}" for a, e in tried)
        for cls in (Overloaded, Starting, ShuttingDown):
            if cls in kinds:
                return cls(f"no colibri router took the request ({parts})", code=cls.code, request_id=rid)
        return Unreachable(f"cannot reach any of the {len(tried)} colibri routers ({parts})", code="unreachable",
                           request_id=rid)


def failure_cause(e) -> str:
    """An error as the cause it names ("cannot reach the colibri server at A within 3 s: X" -> X)."""
    msg = getattr(e, "message", None) or str(e)
    if isinstance(e, Unreachable):
        head, sep, cause = msg.partition(" s: ")
        msg = cause if sep else msg
    return msg


def merge_health(rows: list) -> dict:
    """One health answer from each router's (rows: [{"addr", "status", ...}]): "ok" while at least
    one router is ok; workers_ready and queue summed over the routers that answered; generation
    when they all agree (each server counts its own), else None; every row under "routers"."""
    answered = [r for r in rows if r.get("status") not in ("unreachable", "error")]
    ok = [r for r in answered if r.get("status") == "ok"]
    gens = {r.get("generation") for r in answered}
    return {"status": "ok" if ok else (answered[0]["status"] if answered else "unreachable"),
            "workers_ready": sum(int(r.get("workers_ready") or 0) for r in answered),
            "generation": gens.pop() if len(gens) == 1 else None,
            "queue": sum(int(r.get("queue") or 0) for r in answered), "routers": rows}


# ---------------------------------------------------------------------------- what both pools share


class _PoolBase(_ClientCore):
    """The pool's own part of PoolClient and AsyncPoolClient (before Client/AsyncClient among their
    bases, whose public API it replaces; their shared core, _ClientCore, is this class's base): one
    member client per router, sharing this pool's request ids."""

    _member_class = None        # Client or AsyncClient (set by the concrete class)
    grace = GRACE

    @staticmethod
    def _member_up(m) -> bool:
        """Whether member client m is connected (the sync and async pools look differently)."""
        raise NotImplementedError

    def __init__(self, addrs, *, timeout: float = 60.0, curve=None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 backoff: float = BACKOFF, backoff_max: float = BACKOFF_MAX):
        self._closed = True
        self.routers = addrs if isinstance(addrs, RouterSet) else RouterSet(addrs, backoff=backoff,
                                                                             backoff_max=backoff_max)
        self.addrs = self.routers.addrs
        self.addr = ",".join(self.addrs)            # for messages
        self.timeout = float(timeout)
        self.connect_timeout = min(float(connect_timeout), self.timeout)
        self._curve = curve
        self._ids = _Ids()
        self._members: dict = {}
        self._drops = dict.fromkeys(self.addrs, 0)     # each member's dropped connections already noted
        # request id -> the pool stream that holds it (weakly: an abandoned stream is collected, and cancelled)
        self._holders = weakref.WeakValueDictionary()
        try:
            for a in self.addrs:
                m = self._member_class(a, timeout=self.timeout, curve=curve, connect_timeout=self.connect_timeout)
                m._ids = self._ids                  # ids unique across the pool, so a request keeps its id
                self._members[a] = m
        except BaseException:
            self._close_members()
            raise
        self._closed = False

    def _close_members(self):
        raise NotImplementedError

    def _release_all(self):
        """The client is closing: its streams no longer count as in flight on their routers."""
        for s in list(self._holders.values()):
            s._end()

    def _ups(self) -> dict:
        """address -> whether this client's connection to it is up; a connection that dropped since
        the last look marks its router down, even if it is up again (its requests in flight learn
        it from their member)."""
        ups = {}
        for a, m in self._members.items():
            ups[a] = self._member_up(m)
            if m._drops != self._drops[a]:
                self._drops[a] = m._drops
                self.routers.failed(a, "the connection dropped")
        return ups

    def _choice(self, tried):
        """(address, []) of a router to try now, its connection up; else (None, the order): no
        router is connected, the caller waits for the first of them (see _pick)."""
        ups = self._ups()
        order = self.routers.order(ups, [a for a, _ in tried])
        for a in order:
            if ups[a]:
                return a, []
        return None, order

    def _none_came(self, order, tried, rid):
        """None of `order` connected within connect_timeout: each one's cause, into tried."""
        for a in order:
            e = _unreachable(a, self.connect_timeout, rid, self._curve)
            self._note(a, e)
            tried.append((a, e))

    def _body(self, prompt, max_tokens, temperature, params) -> dict:
        self._check_open()
        return _generate_body(self._ids(), prompt, max_tokens, temperature, params)

    def _note(self, addr, e):
        """Learn from a member's error: a router that is unreachable, dropped the request or kept
        silent past the timeout is down; one that is stopping too."""
        if isinstance(e, (ColibriTimeout, ConnectionLost, ShuttingDown)):      # Unreachable is a ColibriTimeout
            self.routers.failed(addr, failure_cause(e))

    def _state_row(self, addr, up) -> Optional[dict]:
        """A health row for a router skipped and not connected (no probe: it is known down), else None."""
        if up or self.routers.usable(addr, up):
            return None
        st = self.routers.state(addr)
        return {"addr": addr, "status": "unreachable", "error": st["last_error"], **st}


class _PoolStreamBase:
    """What the pools' streams share: the request's body, the routers tried and why, the router
    that holds it (`addr`), and the bookkeeping of its end."""

    def __init__(self, pool: _PoolBase, body: dict, timeout: float):
        self._pool, self._body, self._timeout = pool, body, timeout
        self.id = body["id"]
        self.addr: Optional[str] = None     # the router that took the request (the last one it went to)
        self._held = False                  # counted in addr's in-flight requests
        self._stream = None                 # its member stream
        self._tried: list = []              # [(address, error)] of the routers that did not take it
        self._started = False               # a message other than a refusal came: never sent again
        self._finished = False

    def _hold(self, addr, stream):
        self._stream, self.addr, self._held = stream, addr, True
        self._pool.routers.started(addr)
        self._pool._holders[self.id] = self

    def _release(self):
        if self._held:
            self._held = False
            self._pool.routers.ended(self.addr)
            self._pool._holders.pop(self.id, None)

    def _passed_on(self, e) -> bool:
        """The member stream failed with e: True when the request may go to the next router (it
        was not delivered, or refused before it started), after recording why; else False."""
        addr = self.addr
        self._pool._note(addr, e)
        if self._started or not isinstance(e, (Unreachable,) + _REFUSALS):
            return False
        self._release()
        self._stream = None
        self._tried.append((addr, e))
        return True

    def _got(self, chunk):
        self._started = True
        if chunk.is_final:
            self._pool.routers.succeeded(self.addr, served=True)
            self._end()
        return chunk

    def _end(self):
        self._finished = True
        self._release()

    def _completion(self):
        if self._stream is None:
            raise RuntimeError("the stream was closed before it ended")
        return self._stream._completion()

    def close(self):
        if not self._finished:
            self._finished = True
            if self._stream is not None:
                self._stream.close()        # sends the cancel if the router had it and did not end it
            self._release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------- the synchronous pool


class _PoolStream(_PoolStreamBase, _StreamEnds):
    """PoolClient.stream's iterator of Chunks: sent at once to the first router that takes it."""

    def __init__(self, pool, body, timeout):
        super().__init__(pool, body, timeout)
        self._place()

    def _place(self):
        pool = self._pool
        while True:
            a = pool._pick(self._tried, self.id)
            if a is None:
                self._finished = True
                raise pool.routers.exhausted(self._tried, self.id)
            try:
                s = pool._member_stream(pool._members[a], self._body, self._timeout)
            except Unreachable as e:            # nothing delivered
                pool._note(a, e)
                self._tried.append((a, e))
                continue
            self._hold(a, s)
            return

    def __iter__(self):
        return self

    def wait(self, timeout: float) -> bool:
        """Whether the next message has arrived (see client.Stream.wait); a failure is for __next__."""
        if self._finished:
            return True
        try:
            return self._stream.wait(timeout)
        except Exception:
            return True

    def __next__(self):
        while True:
            if self._finished:
                raise StopIteration
            try:
                return self._got(next(self._stream))
            except ColibriError as e:
                if not self._passed_on(e):
                    self._end()
                    raise
            except BaseException:
                self._end()
                raise
            self._place()


class _PoolClient(_PoolBase):
    """The synchronous pool's API (see Client): a request goes to one router; see the module docstring."""

    _member_stream = None       # client.Stream (set by the concrete class)

    @staticmethod
    def _member_up(m) -> bool:
        if m._drain_monitor():      # a drop seen here: the member's requests in flight must learn it
            m._connection_lost()
        return m._up

    def _close_members(self):
        for m in self._members.values():
            m.close()

    def _pick(self, tried, rid=None):
        """The next router to try (tried: [(address, error)] so far): the first connected one in
        the RouterSet's order, else, when none is, the RouterSet's choice among those connected
        once the first did and `grace` has passed; None when none connected within connect_timeout
        (their causes added to tried)."""
        a, order = self._choice(tried)
        if a is not None or not order:
            return a
        import zmq
        deadline = time.monotonic() + self.connect_timeout
        poller = zmq.Poller()
        for x in order:
            poller.register(self._members[x]._mon, zmq.POLLIN)
        first = None
        while True:
            ups = [self._member_up(self._members[x]) for x in order]
            if any(ups) and first is None:
                first, deadline = True, min(deadline, time.monotonic() + self.grace)
            left = deadline - time.monotonic()
            if all(ups) or left <= 0:
                break
            poller.poll(_ms(left))
        if first is None:
            self._none_came(order, tried, rid)
            return None
        return self._choice(tried)[0] or next(x for x, up in zip(order, ups) if up)

    def stream(self, prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *, timeout=None, **params):
        """As Client.stream; sent at once to one router (the stream's `addr`)."""
        return _PoolStream(self, self._body(prompt, max_tokens, temperature, params), self._timeout_for(timeout))

    def generate(self, prompt, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, *, timeout=None,
                 **params):
        with self.stream(prompt, max_tokens, temperature, timeout=timeout, **params) as s:
            return s.completion()

    def _any(self, call):
        """call(member) on the first router that answers. These are read-only: a dropped
        connection is tried on the next router too."""
        self._check_open()
        tried = []
        while (a := self._pick(tried)) is not None:
            try:
                out = call(self._members[a])
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

    def tokenize(self, text, add_special_tokens: bool = True, *, timeout=None) -> list:
        return self._any(lambda m: m.tokenize(text, add_special_tokens, timeout=timeout))[1]

    def detokenize(self, ids, *, timeout=None) -> str:
        return self._any(lambda m: m.detokenize(ids, timeout=timeout))[1]

    def stats(self, *, timeout=None) -> dict:
        """One router's stats (the first that answers), with "addr": its address."""
        a, st = self._any(lambda m: m.stats(timeout=timeout))
        return {**st, "addr": a}

    def health(self, *, timeout=None) -> dict:
        """Every router's health (a router known down and not connected is not asked), merged:
        see merge_health; "ok" while one router is."""
        self._check_open()
        ups, rows = self._ups(), []
        for a, m in self._members.items():
            row = self._state_row(a, ups[a])
            if row is None:
                try:
                    row = {"addr": a, **m.health(timeout=timeout)}
                    self.routers.succeeded(a)
                except ColibriError as e:
                    self._note(a, e)
                    row = {"addr": a, "status": "unreachable" if isinstance(e, Unreachable) else "error",
                           "error": failure_cause(e)}
            rows.append(row)
        return merge_health(rows)

    def cancel(self, request_id):
        """Cancel a request of this client on the router that holds it (nothing if none does)."""
        self._check_open()
        holder = self._holders.get(request_id)
        if holder is not None:
            self._members[holder.addr].cancel(request_id)

    def close(self):
        if not self._closed:
            self._closed = True
            self._release_all()
            self._close_members()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
