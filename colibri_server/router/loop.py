"""The router: one process, one poll loop, three inputs.

    frontend  ROUTER  clients (wire/protocol.py, COLI/1)
    backend   ROUTER  workers (worker/process.py's backend messages)
    pipe      the master's socketpair (msgpack datagrams: worker exits, generations, drain)

Work goes only to workers that announced free slots (credits); the rest waits in a bounded
queue and beyond it the client gets "overloaded" at once. A ledger holds every request in
flight: when a worker dies, each of its requests that streamed no token yet is retried on
another worker, and each that did gets "worker_lost". Every request ends in exactly one
"done" or "error". Malformed frames are answered or logged, and never fatal.

Generations: the router holds each live generation's tokenizer, vocabulary and context (the
master hands them over: in memory at fork, or in a file it wrote for a new generation). A
request is tokenized and checked with the serving generation's, is bound to that generation
from arrival to end, and goes only to workers of it (a retry too). Once no queued request of
an older generation is left, the router tells the master to retire it.

Starting: the master forks the router before it loads the model (generation 0, no tokenizer yet), so
that a busy client address fails the start at once and clients meanwhile get `health` "starting" and
every other request refused with "starting"; the first generation arrives like a reload's, and the
router serves it as soon as its tokenizer is loaded.

Its records (Gen, Req, W, the prefix key, the control_rate bucket) are records.py's; it holds a
ControlRequests (control.py: tokenize, detokenize, health, stats) and a RemoteHosts (remote.py: the
tcp backend for worker hosts), each built here with what it reads and the calls it makes back.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import signal
import time

import zmq

from ..host.logs import request as request_extra
from ..host.logs import set_role
from ..host.paging import FaultWatch
from ..wire import protocol as P
from .control import ControlRequests
from .master_pipe import MasterPipe
from .records import (
    AttrDict,
    BindFailed,
    ExpertCounts,
    Req,
    W,
    bind_message,
    check_text,
    chmod_ipc,
    prefix_key,
    salvage_id,
)
from .remote import RemoteHosts

log = logging.getLogger("colibri.router")

MAX_ATTEMPTS = 3          # dispatches of one request (retries after a worker died before any token)
PREFIX_OWNERS = 4096      # prompt prefixes whose worker the router remembers (LRU)
EXIT_ROUTER_BIND = 5      # the client address cannot be bound (the master's EXIT_BIND at start)
ALIVE_EVERY_S = 0.5       # "alive" to the master (it kills a router silent for `timeout`)
CONTROL_TYPES = ("tokenize", "detokenize", "stats")   # rate-limited per client (control_rate); health is
                                                      # O(workers) and what probes poll: never refused


class Router:
    def __init__(self, *, frontend: str, backend: str, pipe_fd: int, settings, generation: int, model_path: str,
                 curve=None, generations=None, last_reload=None, worker_curve=None):
        self.frontend_addr, self.backend_addr, self.pipe_fd = frontend, backend, pipe_fd
        self.settings, self.generation, self.model_path = settings, generation, model_path
        self.gen_infos = generations or {}  # generation -> info dict (parsed after fork)
        self.gens = {}                     # generation -> Gen
        self.retired = set()               # older generations the master was told to retire
        self.forgotten = set()             # generations the master unmapped: dropped once no request is of them
        self.last_reload, self.last_alive = last_reload, 0.0
        self.curve = curve
        self.reqs = {}                     # rid -> Req
        self.by_client = {}                # (client, cid) -> rid
        self.queue = collections.deque()   # rids
        self.prefix_owner = collections.OrderedDict()   # first KV block's key -> worker ident
        self.workers = {}                  # ident -> W
        self.paging = FaultWatch()         # a silent worker reading pages from disk is not hung
        self.by_pid = {}                   # pid -> ident
        self.next_rid = 1
        self.draining = False
        self.told_drained = False
        self.stopping = False
        self.counters = collections.Counter()
        self.tokenizer = None
        self.t_start = time.monotonic()
        self.experts = ExpertCounts()      # routing choices per layer and expert, per generation
        self.remote = RemoteHosts(settings=settings, curve=worker_curve, workers=self.workers, gens=self.gens,
                                  counters=self.counters, retired=self.retired, send=self.send_worker, to_master=self.to_master,
                                  remove_worker=self.remove_worker)
        self.serves = self.remote.serves   # serves(w, g): worker w runs generation g's requests
        self.control_requests = ControlRequests(workers=self.workers, gens=self.gens, queue=self.queue,
                                                counters=self.counters, experts=self.experts,
                                                serves=self.serves, t_start=self.t_start)

    # -- setup -------------------------------------------------------------------------
    def init_process(self):
        set_role("router")
        for sig in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT,
                    signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # the master forked with these blocked: one sent before the handlers above waits for them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1,
                                                    signal.SIGUSR2, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                                                    signal.SIGCHLD})
        self.ppid = os.getppid()
        self.master = MasterPipe(self, self.pipe_fd)
        for g, info in sorted(self.gen_infos.items()):
            self.master.load(g, info)
        if self.generation and self.generation not in self.gens:
            raise RuntimeError(f"the serving generation {self.generation} has no usable tokenizer")
        self.gen_infos = None
        if self.generation:             # else starting: the model is still loading
            self.select(self.generation)
        self.ctx = zmq.Context(io_threads=1)
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.MAXMSGSIZE, max(4 * self.settings.max_body, 16 << 20))
        self.front.setsockopt(zmq.SNDHWM, 100000)
        if self.curve is not None:
            self.curve.apply_server(self.ctx, self.front)
        try:
            self.front.bind(self.frontend_addr)
        except zmq.ZMQError as e:
            raise BindFailed(bind_message(self.frontend_addr, e)) from None
        chmod_ipc(self.frontend_addr, 0o660)
        self.back = self.ctx.socket(zmq.ROUTER)
        self.back.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.bind(self.backend_addr)
        chmod_ipc(self.backend_addr, 0o600)
        self.remote.open()
        self.to_master({"op": "up", "pid": os.getpid()})

    def select(self, g):
        """Serve new requests with generation g's tokenizer, vocabulary and context."""
        gen = self.gens[g]
        self.generation, self.model_path = g, gen.model_path
        self.tokenizer, self.context, self.limits = gen.tokenizer, gen.context, gen.limits

    # -- loop ----------------------------------------------------------------------------
    def run(self):
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        poller.register(self.master.fileno(), zmq.POLLIN)
        if self.remote.sock is not None:
            poller.register(self.remote.sock, zmq.POLLIN)
        hb = self.settings.heartbeat_interval
        last_tick = 0.0
        while not self.stopping:
            events = dict(poller.poll(int(min(hb, 0.1) * 1000)))
            if self.back in events:
                self._drain(self.back, self.on_backend)
            if self.remote.sock is not None and self.remote.sock in events:
                self._drain(self.remote.sock, self.on_remote)
            if self.front in events:
                self._drain(self.front, self.on_frontend, copy=self.curve is None)
            if self.master.fileno() in events:
                self.master.read()
            now = time.monotonic()
            if now - last_tick >= min(hb, 0.1):
                last_tick = now
                self.tick(now)
            self.dispatch()
        self.shutdown()

    def _drain(self, sock, handler, budget=1000, copy=True):
        for _ in range(budget):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            handler(parts)
            self.alive()        # a loop busy with slow requests is alive: the master judges progress

    def alive(self, now=None):
        now = time.monotonic() if now is None else now
        if now - self.last_alive >= min(ALIVE_EVERY_S, self.settings.heartbeat_interval):
            self.last_alive = now
            self.to_master({"op": "alive"})

    # -- frontend ------------------------------------------------------------------------
    def reply(self, client, body) -> bool:
        """Send to a client; False if it is gone (its requests are then cancelled)."""
        try:
            self.front.send_multipart([client] + P.frames(body), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, errno.EHOSTUNREACH, zmq.EAGAIN):
                self.client_gone(client)
                return False
            raise

    def error(self, client, cid, code, message):
        self.counters["error:" + code] += 1
        self.reply(client, P.error_body(cid, code, message))

    def on_frontend(self, parts):
        key = None
        if not isinstance(parts[0], bytes):        # zmq.Frames (CURVE on): each carries its ZAP User-Id
            try:
                key = parts[-1].get("User-Id")
            except zmq.ZMQError:
                key = None
            parts = [f.bytes for f in parts]
            if not self.curve.is_allowed(key):
                # the handshake let this connection in, but its key has been removed since (HUP)
                self.counters["unauthorized"] += 1
                self._unauthorized(parts[0], salvage_id(parts[1:]), key)
                return
        client, rest = parts[0], parts[1:]
        self._key = key
        try:
            body = P.parse_frames(rest, self.settings.max_body)
        except P.ProtocolError as e:
            cid = salvage_id(rest)
            log.info("bad frame from client %s: %s", client.hex()[:12], e)
            self.error(client, cid, e.code, e.message)
            return
        cid, t = body["id"], body["type"]
        try:
            if self.generation not in self.gens and t not in ("health", "stats", "cancel"):
                raise P.ProtocolError("starting", "the server is loading its model and compiling its kernels: "
                                                  "retry shortly")
            if t in CONTROL_TYPES:
                self.control_requests.admit(client, t, float(getattr(self.settings, "control_rate", 0) or 0))
            if t in CONTROL_TYPES or t == "health":
                self.on_control(client, cid, t, body)
            else:
                getattr(self, "on_" + t)(client, cid, body)
        except P.ProtocolError as e:
            self.error(client, cid, e.code, e.message)
        except Exception as e:      # a bug must cost one answer, never the router
            log.exception("router: request %r (%s) failed", cid, t)
            self.error(client, cid, "internal", f"{e.__class__.__name__}: {e}")

    def on_control(self, client, cid, t, body):
        """tokenize, detokenize, health, stats: answered by control.py from what this loop holds."""
        c, gen = self.control_requests, self.gens.get(self.generation)
        answer = (c.tokenize(body, gen) if t == "tokenize" else c.detokenize(body, gen) if t == "detokenize"
                  else c.health(self.generation, self.draining) if t == "health" else self.stats())
        self.reply(client, {"type": "result", "id": cid, **answer})

    def stats(self) -> dict:
        return self.control_requests.stats(generation=self.generation, model_path=self.model_path,
                                           draining=self.draining, last_reload=self.last_reload, master_pid=self.ppid)

    def on_generate(self, client, cid, body):
        if self.draining:
            raise P.ProtocolError("shutting_down", "the server is stopping")
        req = self._checked_for_serving(body)
        if (client, cid) in self.by_client:
            raise P.ProtocolError("duplicate_id", f"request id {cid!r} is already in flight")
        if len(self.queue) >= self.settings.max_queue and not any(w.free for w in self.workers.values()):
            self.counters["overloaded"] += 1
            raise P.ProtocolError("overloaded", f"{len(self.queue)} requests queued (max_queue "
                                                f"{self.settings.max_queue})")
        now = time.monotonic()
        r = Req(self.next_rid, client, cid, req, now, self.generation)
        r.key, r.body = getattr(self, "_key", None), body
        self.next_rid += 1
        self.reqs[r.rid] = r
        self.by_client[(client, cid)] = r.rid
        self.queue.append(r.rid)
        self.counters["requests"] += 1

    def _checked_for_serving(self, body) -> dict:
        """A generate request checked, its text prompt tokenized, for the serving generation (its
        tokenizer, vocabulary, context); ProtocolError when it does not fit it."""
        req = P.validate_generate(body, self.limits)
        text = req["prompt"] if isinstance(req["prompt"], str) else None
        if text is not None:
            check_text(text, "prompt text", self.limits)
            if self.tokenizer is None:
                raise P.ProtocolError("bad_request", "this model has no tokenizer: send token ids")
            ids = self.tokenizer.encode(text)
            if not ids:
                raise P.ProtocolError("bad_request", "the prompt encodes to no tokens")
            if len(ids) > self.limits.max_prompt_tokens:
                raise P.ProtocolError("too_large", f"prompt of {len(ids)} tokens exceeds "
                                                   f"{self.limits.max_prompt_tokens}")
            req["prompt"] = ids
        if req["n"] > self.settings.slots:
            raise P.ProtocolError("bad_request", f"field 'n' ({req['n']}) exceeds a worker's slots ({self.settings.slots})")
        plen = len(req["prompt"]) if req["prompt"] is not None else req["prompt_len"]
        if plen >= self.context:
            raise P.ProtocolError("too_large", f"prompt of {plen} tokens leaves no room in the "
                                               f"context of {self.context}")
        return req

    def on_cancel(self, client, cid, body):
        rid = self.by_client.get((client, cid))
        if rid is None:
            raise P.ProtocolError("not_found", f"no request {cid!r} in flight")
        self.cancel(self.reqs[rid], "cancelled", "cancelled by the client")

    # -- scheduling ----------------------------------------------------------------------
    def dispatch(self):
        """Queued requests, in order, each to a worker of its own generation with a free slot (the
        one holding its prompt's first KV block when it is of that generation and has one)."""
        if not self.queue:
            return
        free = {g: sum(w.free for w in self.workers.values() if w.free > 0 and self.serves(w, g)) for g in self.gens}
        if not any(free.values()):
            return
        for rid in list(self.queue):
            r = self.reqs[rid]
            n = r.request.get("n", 1)
            w = None
            if free.get(r.generation, 0) >= n:
                key = prefix_key(r.request.get("prompt"))
                w = self._pick_worker(r.generation, self.prefix_owner.get(key), n)
            if w is None:               # no worker has n free slots: the generation's later requests wait
                free[r.generation] = 0  # behind it (first come, first served), so a request of n > 1 runs
                continue
            self.queue.remove(rid)
            free[r.generation] -= n
            if key is not None:
                self.prefix_owner[key] = w.ident        # the worker that now holds this prompt's first block
                self.prefix_owner.move_to_end(key)
                if len(self.prefix_owner) > PREFIX_OWNERS:
                    self.prefix_owner.popitem(last=False)
            r.state, r.worker, r.t_dispatch = "running", w.ident, time.monotonic()
            r.attempts += 1
            if not self.send_worker(w.ident, b"WORK", {"rid": r.rid, "request": r.request}):
                w.state = "unresponsive"        # a remote one is dropped already (send_worker)
                self._requeue(r, front=True)
                return
            w.running[r.rid] = n
            if not any(free.values()):
                return

    def _pick_worker(self, generation, preferred=None, need=1):
        """A worker of `generation` with `need` free slots: `preferred` (the one holding the request's
        prompt prefix in its KV cache) when it is of that generation and has them, else the most free
        slots, the longest idle."""
        best = None
        for w in self.workers.values():
            if w.free < need or not self.serves(w, generation):
                continue
            # the most free slots, then the longest idle
            key = (w.free, -w.last_dispatch)
            if best is None or key > (best.free, -best.last_dispatch):
                best = w
        p = self.workers.get(preferred) if preferred is not None else None
        if p is not None and p.free >= need and self.serves(p, generation):
            best = p
        if best is not None:
            best.last_dispatch = time.monotonic()
        return best

    def _requeue(self, r, front=False):
        if r.worker is not None and r.worker in self.workers:
            self.workers[r.worker].running.pop(r.rid, None)
        r.state, r.worker = "queued", None
        (self.queue.appendleft if front else self.queue.append)(r.rid)

    def _end(self, r, outcome="ended"):
        """r leaves the router; one line says how (with its request id, as every line about it)."""
        w = self.workers.get(r.worker)
        log.info("request %s %s after %.3fs%s", r.request_id, outcome, time.monotonic() - r.t_arrive,
                 f" on worker {w.pid}" if w is not None else "", extra=request_extra(r.request_id))
        self.reqs.pop(r.rid, None)
        self.by_client.pop((r.client, r.cid), None)
        if r.worker is not None and r.worker in self.workers:
            self.workers[r.worker].running.pop(r.rid, None)
        try:
            self.queue.remove(r.rid)
        except ValueError:
            pass

    def _stop_on_worker(self, r):
        if r.state == "running" and r.worker in self.workers:
            self.send_worker(r.worker, b"CANCEL", {"rid": r.rid})

    def cancel(self, r, code, message):
        """End a request now with an error; a running one is cancelled on its worker too."""
        self._stop_on_worker(r)
        self._end(r, f"ended: {code}")
        self.error(r.client, r.cid, code, message)

    def _unauthorized(self, client, cid, key):
        self.client_gone(client)
        self.error(client, cid, "unauthorized", "this client's CURVE key is no longer allowed")
        log.warning("refused a message from client %s: its CURVE key %s was removed from curve_allowed_keys",
                    client.hex()[:12], key)

    def revoke_removed_keys(self):
        """After the allowed keys were re-read: end every request of a client whose key is gone."""
        for r in list(self.reqs.values()):
            if r.key is not None and not self.curve.is_allowed(r.key):
                self._stop_on_worker(r)
                self._end(r, "ended: unauthorized")
                self.counters["unauthorized"] += 1
                self.error(r.client, r.cid, "unauthorized", "this client's CURVE key was removed from "
                                                            "curve_allowed_keys")

    def client_gone(self, client):
        for (c, cid), rid in list(self.by_client.items()):
            if c == client:
                r = self.reqs[rid]
                self.counters["client_gone"] += 1
                self._stop_on_worker(r)
                self._end(r, "ended: the client is gone")

    def tick(self, now):
        self._drain(self.back, self.on_backend)     # fresh heartbeats before judging silence
        if self.remote.sock is not None:
            self._drain(self.remote.sock, self.on_remote)
        now = time.monotonic()
        self.remote.check(now, self.generation)
        for r in list(self.reqs.values()):
            if r.deadline is not None and now > r.deadline:
                self.cancel(r, "deadline_exceeded", f"deadline of {r.request['deadline_ms']} ms passed "
                                                     f"({'running' if r.state == 'running' else 'queued'})")
        for w in list(self.workers.values()):
            silent = now - w.last_seen      # another machine's (remote) is remote.py's to judge
            if not w.remote and w.state == "ready" and self.paging.hung(w.pid, silent, self.settings.timeout,
                                                                        f"worker {w.pid}"):
                w.state = "unresponsive"
                log.warning("worker %s silent for %.1fs: no more work for it", w.pid, silent)
                self.to_master({"op": "unresponsive", "pid": w.pid})
            self.send_worker(w.ident, b"PING", b"\x80")
        self.control_requests.tick(now)
        if self.draining and not self.told_drained and self.drained():
            self.told_drained = True
            self.to_master({"op": "drained"})      # a graceful stop goes on: nothing of a client's still runs
        self.check_generations()
        self.alive(now)
        if os.getppid() != self.ppid:
            log.error("router: the master is gone, exiting")
            self.stopping = True

    def faulty(self, generation) -> str | None:
        """Why a generation's model fails its requests, when the master found it (None: not known to)."""
        gen = self.gens.get(generation)
        return gen.faulty if gen is not None else None

    def drained(self) -> bool:
        """Nothing runs, and nothing queued can still start (no worker takes work)."""
        if any(r.state == "running" for r in self.reqs.values()):
            return False
        return not self.queue or not any(w.state == "ready" for w in self.workers.values())

    def check_generations(self):
        """Older generations: retire each once none of its requests is queued; a queued request of
        one with no worker left ends with an error (it cannot run on another generation's)."""
        queued = collections.Counter(self.reqs[rid].generation for rid in self.queue)
        for g in sorted(self.gens):
            if g >= self.generation:
                continue
            if queued[g] and not any(self.serves(w, g) and w.state == "ready" for w in self.workers.values()):
                for rid in list(self.queue):
                    if self.reqs[rid].generation == g:
                        self._readmit(self.reqs[rid], g)
                queued[g] = 0
            if not queued[g] and g not in self.retired:
                self.retired.add(g)
                self.to_master({"op": "retire", "generation": g})
                self.remote.retire(g, self.generation)
        if self.forgotten:          # unmapped by the master: dropped once retired and none of its requests is left
            left = {r.generation for r in self.reqs.values()}
            for g in [g for g in self.forgotten if g not in left and g in self.retired]:
                self.gens.pop(g, None)
                self.retired.discard(g)
                self.forgotten.discard(g)

    def _readmit(self, r, g):
        """Generation g has no worker left to take r, queued for it (a retired generation's worker
        rejected or lost it after the queue emptied). Having streamed nothing, it is checked and
        tokenized again for the serving generation from the client's message, as if it came now (as
        it would have a moment later); one that does not fit it ends with worker_lost."""
        why = f"generation {g}, which this request was tokenized and checked for, has no worker left"
        if not r.streamed:
            try:
                req = self._checked_for_serving(r.body)
            except P.ProtocolError as e:
                why += f", and the serving generation refuses it: {e.message}"
            else:
                log.info("request %s: %s; now generation %d's", r.request_id, why, self.generation,
                         extra=request_extra(r.request_id))
                req["request_id"] = r.request_id
                r.request, r.generation = req, self.generation
                self.counters["readmitted"] += 1
                return
        self.counters["worker_lost"] += 1
        self.cancel(r, "worker_lost", why)

    # -- backend -------------------------------------------------------------------------
    def send_worker(self, ident, kind, body, sock=None) -> bool:
        """One backend message to a worker on its own socket; False when it cannot be delivered (a
        remote worker is then dropped: it reconnects and announces itself again)."""
        w = self.workers.get(ident)
        if sock is None:
            sock = w.sock if w is not None and w.sock is not None else self.back
        try:
            sock.send_multipart([ident, kind, body if isinstance(body, bytes) else P.pack(body)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            if w is not None and w.remote:
                self.remote.lose(ident, "its connection is gone")
            return False

    def on_remote(self, parts):
        self.on_backend(parts, sock=self.remote.sock)

    def on_backend(self, parts, sock=None):
        if len(parts) != 3:
            log.error("malformed backend message (%d frames) dropped", len(parts))
            return
        ident, kind, raw = parts
        try:
            body = P.unpack(raw, max_body=64 << 20)
        except P.ProtocolError as e:
            log.error("malformed backend message from %r dropped: %s", ident, e)
            return
        now = time.monotonic()
        w = self.workers.get(ident)
        if w is not None:
            w.last_seen = now
            if w.state == "unresponsive" and kind in (b"HB", b"READY"):
                pass    # the master decides; a late heartbeat does not bring it back
        if kind == b"READY":
            if w is None:
                if sock is not None:
                    w = self.remote.ready(ident, body, now, self.generation)
                    if w is None:
                        return
                else:
                    w = self.workers[ident] = W(ident, body, now)
                    self.by_pid[w.pid] = ident
                    log.info("worker %s (generation %s) ready with %d slots", w.pid, w.generation, w.slots)
                    self.control_requests.sample_memory(self.model_path, self.ppid)
                    self.to_master({"op": "ready", "pid": w.pid, "generation": w.generation})
                if body.get("draining"):
                    w.state = "draining"
            self.send_worker(ident, b"ACCEPT", {"generation": w.generation}, sock=sock)
            return
        if w is None:
            if kind == b"HB":
                # a worker this router does not know: this router is new (the last one died), or it
                # dropped this remote worker as lost. Ask it to announce itself, dropping the work it
                # holds for requests that have ended here
                self.send_worker(ident, b"HELLO", b"\x80", sock=sock)
            return      # a worker we consider gone; its messages are stale
        if kind == b"HB":
            # liveness (last_seen, above) and the batch engine's figures for status; free slots are
            # counted here from WORK and DONE/ERROR, HB's `free` is not read
            eng = body.get("engine")
            if isinstance(eng, dict):
                w.engine = eng
            return
        if kind == b"BYE":
            w.state = "draining"
            if w.remote:    # nobody reaps it here: it leaves now. Drained, it holds no request; its master
                            # gone, what it abandoned follows the ledger (retried if nothing streamed)
                if body.get("master_gone"):
                    self.remote.lose(ident, f"its master is gone ({body.get('abandoned', 0)} sequences abandoned)")
                else:
                    self.remove_worker(ident, f"worker {w.pid} on host {w.host} left (drained)")
                    self.remote.fleet_changed()
            return
        rid = body.get("rid")
        r = self.reqs.get(rid)
        if kind == b"REJECT":
            w.state = "draining"
            if r is not None and r.worker == ident:
                r.attempts -= 1
                self._requeue(r, front=True)
            return
        if r is None or r.worker != ident:
            if kind in (b"DONE", b"ERROR"):
                w.running.pop(rid, None)
            return      # cancelled or timed out meanwhile: dropped by design
        if kind == b"TOKEN":
            r.streamed = True
            if r.stream:
                self.reply(r.client, {"type": "token", "id": r.cid, "text": body.get("text", ""),
                                      "ids": body.get("ids", []), "index": body.get("index", 0),
                                      **{k: body[k] for k in ("choice", "logprobs", "prompt_logprobs") if k in body}})
        elif kind == b"DONE":
            w.served += 1
            u = body.get("usage") or {}
            self._end(r, f"done ({body.get('finish_reason')}, {u.get('prompt_tokens')} prompt + "
                         f"{u.get('completion_tokens')} completion tokens)")
            t = body.get("timings", {})
            self.counters["done"] += 1
            self.reply(r.client, {"type": "done", "id": r.cid, "finish_reason": body.get("finish_reason"),
                                  "text": body.get("text", ""), "ids": body.get("ids", []),
                                  "usage": body.get("usage", {}),
                                  "timings": {"queued_s": round(r.t_dispatch - r.t_arrive, 6),
                                              "prefill_s": t.get("prefill_s", 0.0),
                                              "decode_s": t.get("decode_s", 0.0),
                                              "total_s": round(now - r.t_arrive, 6)},
                                  "worker_pid": w.pid, "generation": w.generation,
                                  "attempts": r.attempts, "request_id": r.request_id,
                                  **{k: body[k] for k in ("logprobs", "prompt_logprobs", "choices") if k in body}})
        elif kind == b"ERROR":
            code = body.get("code", "internal")
            self._end(r, f"failed: {code}")
            self.error(r.client, r.cid, code if code in P.ERROR_CODES else "internal", str(body.get("message", "")))

    def worker_exited(self, pid):
        ident = self.by_pid.pop(pid, None)
        if ident is not None:
            self.remove_worker(ident, f"worker {pid} died")

    def remove_worker(self, ident, why):
        """The worker is gone: each of its requests that streamed nothing is retried elsewhere, each
        that did ends with worker_lost; while the server stops, each ends with shutting_down."""
        w = self.workers.pop(ident, None)
        if w is None:
            return
        self.paging.forget(w.pid)
        self.experts.retire(w)
        if w.state != "draining":
            self.counters["worker_restarts"] += 1       # died or was killed, not a drained exit
        for rid in list(w.running):
            r = self.reqs.get(rid)
            if r is None:
                continue
            if self.draining:       # the server is stopping (a fast stop, or graceful_timeout ran out)
                self._end(r, "failed: shutting_down")
                r.worker = None
                self.counters["cut_by_stop"] += 1
                self.error(r.client, r.cid, "shutting_down", f"the server is stopping: worker {w.pid} ended with it "
                           f"after streaming {'tokens' if r.streamed else 'nothing'} (a requested stop, not a crash)")
            elif not r.streamed and r.attempts < MAX_ATTEMPTS and not self.faulty(r.generation):
                self.counters["retries"] += 1
                log.warning("%s: retrying request %s (attempt %d)", why, r.request_id, r.attempts + 1,
                            extra=request_extra(r.request_id))
                r.worker = None
                self._requeue(r, front=True)
            else:
                self._end(r, "failed: worker_lost")
                r.worker = None
                self.counters["worker_lost"] += 1
                fault = self.faulty(r.generation)
                self.error(r.client, r.cid, "worker_lost", f"{why} after streaming "
                           f"{'tokens' if r.streamed else 'nothing'} ({r.attempts} attempts)"
                           + (f"; not retried: the model is faulty ({fault})" if fault else ""))

    # -- master pipe ---------------------------------------------------------------------
    def to_master(self, msg):
        self.master.send(msg)

    def apply_settings(self, settings):
        self.settings = settings if not isinstance(settings, dict) else AttrDict(settings)
        for gen in self.gens.values():
            gen.set_limits(self.settings)
        if self.generation in self.gens:
            self.limits = self.gens[self.generation].limits
        self.remote.settings = self.settings
        if self.curve is not None:
            from ..wire.security import SecurityError
            try:
                self.curve.reload()
            except SecurityError as e:
                log.error("HUP: CURVE allowed keys not reloaded, the current ones stay: %s", e)
            else:
                self.revoke_removed_keys()

    def shutdown(self):
        for r in list(self.reqs.values()):
            self._end(r, "ended: shutting_down")
            self.error(r.client, r.cid, "shutting_down", "the server stopped before this request finished")
        # the last answers (these, and the workers' own shutting_down just forwarded) must leave before the
        # exit, also when a loaded machine is slow to schedule the I/O thread; the master kills at 5 s
        self.front.close(linger=3000)
        if self.curve is not None:
            self.curve.stop()
        self.back.close(linger=0)
        self.remote.close()
        self.ctx.term()


def router_main(router: Router) -> None:
    code = 0
    try:
        router.init_process()
        router.run()
    except BindFailed as e:         # the master says it: halting at start, or restarting the router
        router.to_master({"op": "bind_failed", "error": str(e)})
        code = EXIT_ROUTER_BIND
    except BaseException:
        log.exception("router crashed")
        code = 1
    finally:
        os._exit(code)
