"""A worker process: receives work from the router, runs sequences, streams tokens.

`Worker.__init__` runs in the master before fork and changes nothing process-wide.
`init_process()` runs in the child: signals, core pinning, thread limits, its own RNG
seed and its own ZeroMQ context. Then `run()`: a loop that answers the router, runs one
step of its BatchEngine (model/serving.py: the next token of every decoding sequence and
prefill chunks of new ones, in one forward), streams what it sampled, heartbeats, and exits when told (TERM: finish the sequences in hand; QUIT/INT: now), when its parent
changes, or after max_requests.

Backend messages (worker DEALER <-> router ROUTER), two frames: kind, msgpack body.
    worker -> router  READY {pid, wid, generation, slots, cores, identity, host, model}   HB {free}   BYE {}
                      (HB says the worker is alive; the router counts free slots itself, from
                      WORK and DONE/ERROR, and does not read HB's `free`)
                      TOKEN {rid, text, ids, index, [choice], [logprobs]}
                      DONE {rid, finish_reason, ids, usage, timings, [choices], [logprobs], [prompt_logprobs], ...}
                      ERROR {rid, code, message}      REJECT {rid}  (draining: the router requeues it)
    router -> worker  WORK {rid, request}   CANCEL {rid}   PING {}
                      HELLO {}  (a new router that does not know this worker: the old router died,
                                 nobody waits for the sequences in hand; drop them, send READY)
                      ACCEPT {generation}   (the READY was taken: the master sees this worker joined)
                      REFUSE {reason}       (a head whose model identity differs: not joined, logged)
                      ROLL {identity, model} (a head rolling to another model file: when the file under
                                 this worker's model path is now that one, ask the master to reload)
                      RETIRE {}             (the head retired this model's generation: drain and exit)

A worker of a worker host (`join`) connects over tcp to a head's router (CURVE when join_server_key
is set; ZMTP heartbeats so a cut link is noticed); its identity names its host (hostname:master pid).
"""
from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time

from ..host.logs import request as request_extra
from ..wire import protocol as P
from .heartbeat import HeartbeatTable

log = logging.getLogger("colibri.worker")

EXIT_BOOT_FAILED = 3     # the master halts instead of respawning (gunicorn's WORKER_BOOT_ERROR)
EXIT_RETIRED = 6         # drained because the head retired this model: not replaced while a reload comes up


class Worker:
    def __init__(self, *, wid: int, slot: int, generation: int, model, settings, backend: str,
                 cpus, heartbeats: HeartbeatTable, host: str = "", curve=None, model_path=None):
        self.wid, self.slot, self.generation = wid, slot, generation
        self.host = host            # hostname:master pid, in the identity and READY
        self.model_path = model_path or model.path      # the file (the model may map a NUMA node's copy)
        self.curve = curve          # (server public, own public, own secret) for a tcp join with CURVE
        self.identity = model.file.identity
        self.refused = None         # the last REFUSE reason (logged once)
        self.rolled = {}            # identity -> when ROLL last made us look at the file
        self.t_boot = time.monotonic()
        self.last_join_warning = -60.0
        self.model, self.settings, self.backend = model, settings, backend
        self.cpus, self.heartbeats = cpus, heartbeats
        self.pid = None
        self.ppid = None
        self.draining = False
        self.retired = False        # RETIRE from a head: drained, it exits EXIT_RETIRED
        self.quit_now = False
        self.served = 0
        self.max_requests = 0
        self.seqs = {}          # rid -> _Active
        self.engine = None      # BatchEngine, built after fork (its KV pool is this process's own)

    # -- after fork ---------------------------------------------------------------
    def init_process(self) -> None:
        self.pid, self.ppid = os.getpid(), os.getppid()
        from ..host.logs import set_role
        set_role(f"worker {self.wid} [gen {self.generation}]")
        for sig in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)     # those are the master's
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_quit)
        signal.signal(signal.SIGQUIT, self._on_quit)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # the master forked with these blocked: one sent before the handlers above waits for them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1,
                                                    signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT,
                                                    signal.SIGCHLD})
        from ..host.pinning import apply
        apply(self.cpus)
        from ..host.allocator import keep_freed_memory
        keep_freed_memory()         # a step's temporaries reused, not faulted in again at every layer
        self._limit_threads(self.settings.threads_per_worker)
        if self.settings.threads_per_worker > 1:
            self.model.set_threads(self.settings.threads_per_worker)   # decode matvecs split over threads
            import numba
            log.info("worker %d: decode on %d threads (numba %s layer)", self.wid, self.model.threads,
                     numba.threading_layer())
        self.model.set_exact_head(self.settings.exact_head)
        if not self.settings.exact_head:
            log.info("worker %d: a block-kind output head on llama.cpp's int8 rounding of its input (exact_head "
                     "false)", self.wid)
        if self.model.set_prefill_bf16(self.settings.prefill_bf16):
            log.info("worker %d: prefill of bf16 weights with bf16 activations (prefill_bf16)", self.wid)
        elif self.settings.prefill_bf16:
            log.warning("worker %d: prefill_bf16 has no effect: %s", self.wid,
                        "this CPU has no avx512bf16" if self.model.has_bf16_weights()
                        else "the model has no bf16 matrices")
        self.engine = self._engine()
        seed = self.settings.seed if self.settings.seed >= 0 else None
        random.seed(seed if seed is not None else os.urandom(16))
        if self.model.noise is not None:
            import numpy as np
            self.model.noise.rng = np.random.default_rng(None if seed is None else seed + self.wid)
        mr = self.settings.max_requests
        self.max_requests = mr + random.randint(0, self.settings.max_requests_jitter) if mr else 0
        import zmq
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{self.host}/w{self.wid}.{self.pid}".encode()[-255:])
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 0)      # a connected router gets everything; see send()
        if self.backend.startswith("tcp://"):
            from ..wire.zmtp import zmtp_heartbeats
            zmtp_heartbeats(self.sock, self.settings)
            if self.curve is not None:
                self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = self.curve
        self.sock.connect(self.backend)
        self.heartbeats.beat(self.slot)

    def _engine(self):
        """The batch engine: `slots` sequences at once, a KV pool of `kv_cache_memory` (0: every slot at
        full context, at most a quarter of the memory available now, a cgroup's limit counted, shared by the workers)."""
        from ..model.serving import BatchEngine
        st = self.settings
        mem = st.kv_cache_memory
        if not mem:                     # the engine caps it at every slot at full context
            from ..model.residency import available_memory  # a cgroup's limit counted
            mem = available_memory() // (4 * max(1, st.workers or 1))
        eng = BatchEngine(self.model, max_seqs=st.slots, max_batch_tokens=st.max_batch_tokens, kv_cache_memory=mem,
                          kv_dtype=st.kv_dtype, prefix_cache=st.prefix_cache,
                          predict_experts=st.expert_readahead == "predicted")
        self._check_memory_budget(eng)
        return eng

    def _check_memory_budget(self, eng) -> None:
        """memory_limit: refuse to boot (exit 3, the master halts) rather than be OOM-killed later."""
        limit = self.settings.memory_limit
        if not limit:
            return
        from ..host.memory import mib, process_memory
        kv = eng.pool.num_blocks * eng.pool.bytes_per_block
        ws = sum(a.nbytes for w in (self.model.workspace, eng.ws) for a in vars(w).values() if hasattr(a, "nbytes"))
        need = kv + ws + process_memory(os.getpid())["uss"]
        if need > limit:
            raise MemoryError(f"worker needs about {mib(need)} of private memory (a KV pool of {mib(kv)} for "
                              f"{self.settings.slots} slots, activations {mib(ws)}) but memory_limit "
                              f"is {mib(limit)}: lower kv_cache_memory, slots or max_batch_tokens, or raise memory_limit")

    @staticmethod
    def _limit_threads(n: int) -> None:
        try:
            from threadpoolctl import threadpool_limits
            # BLAS (prefill GEMMs) stays on the calling thread: OpenBLAS's pool, spinning beside
            # the Numba threads, made small GEMMs many times slower on a VM (see Model.open)
            threadpool_limits(1, user_api="blas")
        except Exception as e:  # a missing BLAS info is not fatal
            log.debug("threadpool_limits failed: %s", e)
        try:
            import numba
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        except Exception as e:
            log.debug("numba.set_num_threads failed: %s", e)

    def _on_term(self, *_):
        self.draining = True

    def _on_quit(self, *_):
        self.quit_now = True

    # -- messaging ------------------------------------------------------------------
    def send(self, kind: bytes, body: dict) -> None:
        """Never blocks: with no connection to the router at all (a head not up yet, a cut link, a
        CURVE key refused) the message is dropped, as the router drops what it held for this worker
        once it is lost; a blocked worker would stop its heartbeat and be killed in a loop."""
        import zmq
        try:
            self.sock.send_multipart([kind, P.pack(body)], zmq.NOBLOCK)
        except zmq.Again:
            pass

    def ready(self) -> None:
        self.send(b"READY", {"pid": self.pid, "wid": self.wid, "generation": self.generation,
                             "slots": self.settings.slots, "cores": list(self.cpus or []),
                             "draining": self.draining, "identity": self.identity, "host": self.host,
                             "model": self.model_path})

    # -- main loop ------------------------------------------------------------------
    def run(self) -> int:
        import zmq
        self.ready()
        hb_every = self.settings.heartbeat_interval
        last_hb = 0.0
        last_router = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.quit_now:
            now = time.monotonic()
            if now - last_hb >= hb_every:
                self.heartbeats.beat(self.slot)
                self.send(b"HB", {"free": self.settings.slots - self.busy(), "engine": self.engine.stats()})
                last_hb = now
                if os.getppid() != self.ppid:
                    log.warning("worker %d: parent changed, exiting%s", self.pid,
                                f" (abandoning {len(self.seqs)} sequences)" if self.seqs else "")
                    # a head's router learns it now, not after `timeout`: it retries what streamed nothing
                    self.send(b"BYE", {"served": self.served, "master_gone": True, "abandoned": len(self.seqs)})
                    return 0
                if now - last_router > max(3 * hb_every, self.settings.timeout):
                    self.ready()            # the router restarted (or lost us): announce again
                    last_router = now
                self._check_joined(now)
            timeout = 0 if self.seqs else int(hb_every * 1000)
            for sock, _ in poller.poll(timeout):
                while True:
                    try:
                        kind, body = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue
                    last_router = time.monotonic()
                    self.handle(kind, body)
            if self.seqs:
                self.step()
            if not self.seqs and (self.draining or (self.max_requests and self.served >= self.max_requests)):
                self.send(b"BYE", {"served": self.served})
                return EXIT_RETIRED if self.retired else 0
        self._cut_by_stop()
        return 0

    def _cut_by_stop(self) -> None:
        """A fast stop (SIGINT, SIGQUIT) leaves sequences unfinished. Each that has streamed tokens
        ends with shutting_down, naming the stop: the router would otherwise see a worker exit
        mid-stream and report worker_lost, which reads as a crash. One that streamed nothing is
        left to the router, which retries it elsewhere unless the whole server is stopping."""
        for rid, a in self.seqs.items():
            n = sum(len(c.ids) for c in a.choices)
            if a.stream and n:
                self.send(b"ERROR", {"rid": rid, "code": "shutting_down", "message":
                                     f"the server is stopping (fast stop): worker {self.pid} ended this request "
                                     f"after {n} tokens (a requested stop, not a crash)"})

    def handle(self, kind: bytes, raw: bytes) -> None:
        try:
            body = P.unpack(raw, max_body=64 << 20)
        except P.ProtocolError as e:
            log.error("worker %d: malformed message from the router dropped: %s", self.pid, e)
            return
        if kind == b"WORK":
            self.start(body)
        elif kind == b"CANCEL":
            a = self.seqs.pop(body.get("rid"), None)
            if a is not None:
                self.engine.cancel(a.rid)
                self.finish(a)
        elif kind == b"PING":
            pass
        elif kind == b"ACCEPT":
            if self.refused is not None:
                log.info("worker %d: the head accepts this host's model now", self.pid)
            self.refused = None
            self.heartbeats.set_joined(self.slot, True)
        elif kind == b"REFUSE":
            self.heartbeats.set_joined(self.slot, False)
            reason = str(body.get("reason", ""))
            if reason != self.refused:      # once per reason; it asks again at each HELLO
                log.error("worker %d: %s", self.pid, reason)
            self.refused = reason
        elif kind == b"ROLL":
            self.roll(body)
        elif kind == b"RETIRE":     # a head retired this model file's generation: finish what is in hand
            log.info("worker %d: the head retired this model; draining", self.pid)
            self.draining = self.retired = True
        elif kind == b"HELLO":
            if self.seqs:
                log.warning("worker %d: a new router; dropping %d sequences of the old one's requests",
                            self.pid, len(self.seqs))
            for rid in self.seqs:
                self.engine.cancel(rid)
            self.seqs.clear()
            self.ready()
        else:
            log.error("worker %d: unknown message kind %r dropped", self.pid, kind[:16])

    def _check_joined(self, now) -> None:
        """A worker host's worker not ACCEPTed after `timeout` says so (once a minute): its
        connection or CURVE handshake is failing, and nothing else would tell."""
        if not self.backend.startswith("tcp://") or self.refused is not None or self.heartbeats.joined(self.slot):
            return
        if now - self.t_boot > self.settings.timeout and now - self.last_join_warning >= 60.0:
            self.last_join_warning = now
            log.warning("worker %d: not accepted by the head at %s after %.0fs: is it up, listening there "
                        "(backend_bind), and is this host's public key in its worker_allowed_keys?", self.pid,
                        self.backend, now - self.t_boot)

    def roll(self, body: dict) -> None:
        """A head rolls to model identity body['identity']: when the file under our model path is
        that model now, ask the master for a reload (SIGUSR2: reload if the file changed; every
        worker of the host may ask, the master reloads once). Looked at (and a mismatch logged) every 30 s at most."""
        want = body.get("identity")
        now = time.monotonic()
        if not want or want == self.identity or now - self.rolled.get(want, -30.0) < 30.0:
            return
        self.rolled[want] = now
        from ..wire.identity import file_identity
        try:
            have = file_identity(self.model_path)
        except Exception as e:
            have = f"unreadable ({e})"
        if have == want:
            log.info("worker %d: the head rolls to %s, which %s now holds: asking the master to reload",
                     self.pid, want, self.model_path)
            os.kill(self.ppid, signal.SIGUSR2)
        else:
            log.error("worker %d: the head rolls to model %s (%s), but %s here is %s: put the head's file at that "
                      "path (write it beside and rename it over), and this host follows", self.pid, want,
                      body.get("model"), self.model_path, have)

    def busy(self) -> int:
        """Slots in use: a request of n completions holds n."""
        return sum(a.n for a in self.seqs.values())

    def start(self, body: dict) -> None:
        rid, req = body.get("rid"), body.get("request") or {}
        n = req.get("n") or 1
        if self.draining or self.busy() + n > self.settings.slots:
            self.send(b"REJECT", {"rid": rid})
            return
        params = {k: req[k] for k in P.SAMPLING_FIELDS if k in req}
        params.update(stop=tuple(req.get("stop") or ()), stop_token_ids=tuple(req.get("stop_token_ids") or ()),
                      logit_bias=tuple(tuple(e) for e in req.get("logit_bias") or ()))
        g = req.get("grammar")
        if g:
            params["grammar"] = (g["type"], g["value"])
        from ..model.serving import RequestTooLarge
        try:
            emb = req.get("prompt_embeds")
            if emb is not None:
                import numpy as np
                emb = np.frombuffer(emb, "<f4").reshape(-1, self.model.config.hidden_size)
            st = self.engine.add(rid, req.get("prompt"), n=n, embeddings=emb, **params)
        except RequestTooLarge as e:
            self.send(b"ERROR", {"rid": rid, "code": "too_large", "message": str(e)})
            return
        except ValueError as e:
            self.send(b"ERROR", {"rid": rid, "code": "bad_request", "message": str(e)})
            return
        self.seqs[rid] = a = _Active(rid, st.seq, bool(req.get("stream", True)), n, req.get("request_id") or str(rid))
        log.info("worker %d: request %s started: %d prompt tokens, max_tokens %d%s", self.pid, a.request_id,
                 len(st.seq.prompt_ids), st.seq.params.max_tokens, f", n {n}" if n > 1 else "",
                 extra=request_extra(a.request_id))

    def step(self) -> None:
        """One batched step over every active sequence; stream each sampled token, finish the done."""
        try:
            events = self.engine.step()
        except Exception as e:  # a bug: answer every request of the step, keep serving
            log.exception("worker %d: a batched step failed", self.pid)
            for rid in list(self.seqs):
                self.engine.cancel(rid)
                del self.seqs[rid]
                self.send(b"ERROR", {"rid": rid, "code": "internal", "message": f"{e.__class__.__name__}: {e}"})
            return
        for rid, e in self.engine.faults:   # non-finite logits (corrupted weights, an overflow), or a grammar's dead end
            a = self.seqs.get(rid)
            rq = a.request_id if a is not None else rid
            numerical = isinstance(e, ArithmeticError)
            log.log(logging.ERROR if numerical else logging.INFO, "worker %d: request %s: %s", self.pid, rq, e,
                    extra=request_extra(rq))
            from ..model.serving import RequestTooLarge
            code = "numerical_fault" if numerical else "too_large" if isinstance(e, RequestTooLarge) else "bad_request"
            if self.seqs.pop(rid, None) is not None:
                self.send(b"ERROR", {"rid": rid, "code": code, "message": str(e)})
        for rid, ev in events:
            a = self.seqs.get(rid)
            if a is None:
                continue
            c = a.choices[ev.choice]
            c.ids.append(ev.token_id)
            c.text.append(ev.text)
            lp = self._logprob_entry(ev.token_id, ev.logprobs) if ev.logprobs is not None else None
            if lp is not None:
                c.logprobs.append(lp)
            if ev.finish_reason is not None:
                c.finish_reason = ev.finish_reason
            if a.stream:
                msg = {"rid": rid, "text": ev.text, "ids": [ev.token_id], "index": len(c.ids) - 1}
                if a.n > 1:
                    msg["choice"] = ev.choice
                if lp is not None:
                    msg["logprobs"] = [lp]
                if not a.sent_prompt and a.seq.prompt_logprobs is not None:
                    msg["prompt_logprobs"] = self._prompt_logprobs(a.seq)    # with the request's first token
                a.sent_prompt = True
                self.send(b"TOKEN", msg)
            if all(c.finish_reason is not None for c in a.choices):
                del self.seqs[rid]
                self.finish(a)

    def _logprob_entry(self, token_id, logprobs) -> list:
        """[token text, log p, [[id, text, log p], ...]]: one position's logprobs on the wire; a token
        holding part of a UTF-8 character (text U+FFFD) gets its own bytes after (..., bytes])."""
        tok = self.model.tokenizer if self.model.file.tokenizer_json else None

        def named(i) -> list:
            if tok is None:
                return [""]
            t, b = tok.token_text(int(i)), tok.token_bytes(int(i))
            return [t] if "\ufffd" not in t or b == t.encode() else [t, b]
        lp, ids, lps = logprobs
        first = named(token_id)
        tops = []
        for i, v in zip(ids, lps):
            n = named(i)
            tops.append([int(i), n[0], float(v), *n[1:]])
        return [first[0], None if lp is None else float(lp), tops, *first[1:]]

    def _prompt_logprobs(self, s) -> list:
        """The prompt's entries: the first token with logprob None, then one per scored position."""
        first = self._logprob_entry(int(s.prompt_ids[0]), (None, (), ()))
        return [first] + [self._logprob_entry(int(t), e) for t, e in zip(s.prompt_ids[1:], s.prompt_logprobs[1:])]

    def finish(self, a) -> None:
        s = a.seq
        self.served += 1
        c0 = a.choices[0]
        body = {"rid": a.rid, "finish_reason": c0.finish_reason or s.finish_reason, "ids": c0.ids,
                "text": "".join(c0.text),
                "usage": {"prompt_tokens": len(s.prompt_ids), "completion_tokens": sum(len(c.ids) for c in a.choices)},
                "timings": {"prefill_s": s.timings["prefill_s"], "decode_s": s.timings["decode_s"]},
                "worker_pid": self.pid, "generation": self.generation}
        lp = s.params.logprobs is not None
        if lp:
            body["logprobs"] = c0.logprobs
        if s.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(s)
        if a.n > 1:
            body["choices"] = [{"index": i, "text": "".join(c.text), "ids": c.ids,
                                "finish_reason": c.finish_reason or s.finish_reason,
                                **({"logprobs": c.logprobs} if lp else {})} for i, c in enumerate(a.choices)]
        self.send(b"DONE", body)


class _Choice:
    __slots__ = ("ids", "text", "logprobs", "finish_reason")

    def __init__(self):
        self.ids, self.text, self.logprobs, self.finish_reason = [], [], [], None


class _Active:
    __slots__ = ("rid", "seq", "stream", "n", "choices", "sent_prompt", "request_id")

    def __init__(self, rid, seq, stream, n=1, request_id=None):
        self.rid, self.seq, self.stream, self.n, self.request_id = rid, seq, stream, n, request_id
        self.sent_prompt = False
        self.choices = [_Choice() for _ in range(n)]


def worker_main(worker: Worker) -> None:
    """Entry point in the forked child; never returns."""
    code = 0
    try:
        try:
            worker.init_process()
        except Exception as e:
            log.error("worker %d failed to boot: %s: %s", os.getpid(), e.__class__.__name__, e,
                      exc_info=not isinstance(e, (MemoryError, OSError)))
            os._exit(EXIT_BOOT_FAILED)
        code = worker.run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        log.exception("worker %s crashed", os.getpid())
        code = 1
    finally:
        try:
            worker.sock.close(linger=1000)
            worker.ctx.term()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
