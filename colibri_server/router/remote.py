"""The router's part for worker hosts: workers of other masters (`colibri serve --join`) that reach
this router's backend over tcp (`backend_bind`), beside or instead of its own.

A remote worker is a worker like the local ones (the same backend messages, credits and ledger),
with three differences:
- **Admission by model identity.** Generation numbers are each master's own; what a remote worker
  and this router share is the model file's identity (`ColibriFile.identity`, a hash of everything
  before the tensor data). A READY is accepted (ACCEPT) when its identity is that of one of this
  router's live generations; the worker then serves requests of every generation of that identity.
  Any other is refused (REFUSE, with the reason) and logged by name, once a minute per host.
- **Liveness by silence.** No master here reaps it, so a remote worker silent for `timeout` (its
  master killed, the link cut) is dropped by the router itself, and its requests follow the
  ledger's rule (retried when nothing streamed, `worker_lost` otherwise). A send that fails
  (the peer disconnected) drops it at once. When it comes back its next heartbeat is answered
  HELLO, it drops what it held and announces itself again.
- **Rollout.** While a generation of another identity is coming up here, the remote workers of
  other identities are sent ROLL {identity} every ROLL_EVERY_S: each host's workers check the
  file under their model path and, when it is that file, ask their master for a reload (SIGUSR2).
  The master here hears which hosts run which identity ("fleet") and commits once every host runs
  the new one (generations.py). When the old generation is retired here (its queue empty), its
  remote workers get RETIRE and drain, as a local master drains a retired generation's. That is a
  state, checked again whenever a worker announces itself and every ROLL_EVERY_S, not a message sent
  once: a worker of a retired (or forgotten) generation's file on a host that runs the serving file
  is told to drain, whenever it appears (it reconnected, or its master replaced a worker before
  committing its own reload). A host that runs only the old file is refused, not drained: its
  master would replace what drains.

The Router holds one RemoteHosts, built with the containers it keeps and the calls it makes back
(send a backend message, write to the master, remove a worker). The tcp socket has its own ZeroMQ
context, so its CURVE authenticator (worker_allowed_keys) is apart from the client socket's
(curve_allowed_keys).
"""
from __future__ import annotations

import logging

import zmq

from ..wire.zmtp import zmtp_heartbeats
from .records import BindFailed, W, bind_message

log = logging.getLogger("colibri.router")

ROLL_EVERY_S = 2.0        # ROLL to the hosts of another identity while a generation comes up
REFUSE_LOG_EVERY_S = 60.0


class RemoteHosts:
    """The tcp backend for worker hosts (see the module's doc). `workers`, `gens`, `retired` (the
    generations retired here) and `counters` are the router's containers (never rebound there);
    `send(ident, kind, body, sock=None) -> bool` sends a backend message, `to_master(msg)` writes to
    the master, `remove_worker(ident, why)` ends a worker's requests by the ledger's rule and forgets it."""

    def __init__(self, *, settings, curve, workers: dict, gens: dict, retired: set, counters, send, to_master,
                 remove_worker):
        self.settings, self.curve = settings, curve
        self.workers, self.gens, self.retired, self.counters = workers, gens, retired, counters
        self.send, self.to_master, self.remove_worker = send, to_master, remove_worker
        self.sock = None                   # the tcp ROUTER socket, when backend_bind is set (after open())
        self.ctx = None
        self.last_roll = 0.0
        self.refused_logged = {}           # (host, identity) -> when it was last logged

    def open(self):
        """Bind backend_bind (in the router process, after fork); nothing when it is not set."""
        addr = getattr(self.settings, "backend_bind", "")
        if not addr:
            return
        self.ctx = zmq.Context(io_threads=1)
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)      # a host reconnecting after a cut takes its identity back
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        zmtp_heartbeats(s, self.settings)
        if self.curve is not None:
            self.curve.apply_server(self.ctx, s)
        try:
            s.bind(addr)
        except zmq.ZMQError as e:
            raise BindFailed(bind_message(addr, e)) from None
        self.sock = s
        log.info("router: worker hosts join on %s%s", addr, " (CURVE)" if self.curve is not None else "")

    def close(self):
        if self.sock is not None:
            self.sock.close(linger=0)
            if self.curve is not None:
                self.curve.stop()
            self.ctx.term()

    # -- which generation a worker serves -----------------------------------------------
    def serves(self, w, g) -> bool:
        """Worker w may run requests of generation g: a local worker of that generation, a remote
        one whose model file is g's."""
        if not w.remote:
            return w.generation == g
        gen = self.gens.get(g)
        return gen is not None and gen.identity == w.identity

    def generation_of(self, identity):
        """The newest live generation of this model identity (None: not one of ours)."""
        gs = [g for g, gen in self.gens.items() if identity and gen.identity == identity]
        return max(gs) if gs else None

    # -- messages -----------------------------------------------------------------------
    def ready(self, ident, body, now, serving: int):
        """A READY on the tcp backend: the new W, added to `workers`, or None when refused (REFUSE sent,
        logged) or told to drain at once (RETIRE). serving: the router's serving generation."""
        identity, host = body.get("identity"), str(body.get("host") or ident.decode("utf-8", "replace"))
        g = self.generation_of(identity)
        if g is None and self.rolled(host, serving):
            log.info("worker %s on host %s runs model %s, retired here; that host runs the serving one: "
                     "it drains", body.get("pid"), host, identity)
            self.send(ident, b"RETIRE", b"\x80", sock=self.sock)
            return None
        if g is None:
            gen = self.gens[serving]
            reason = (f"worker host {host} runs model identity {identity} ({body.get('model')}); this router serves "
                      f"{gen.identity} ({gen.model_path}, generation {serving})")
            self.counters["hosts_refused"] += 1
            key = (host, identity)
            if now - self.refused_logged.get(key, -REFUSE_LOG_EVERY_S) >= REFUSE_LOG_EVERY_S:
                self.refused_logged[key] = now
                log.error("refused %s: a different model file", reason)
            self.send(ident, b"REFUSE", {"reason": f"refused by the head: {reason}"}, sock=self.sock)
            return None
        w = W(ident, body, now)
        w.generation, w.remote, w.sock = g, True, self.sock
        log.info("worker %s on host %s (model %s, generation %d here) ready with %d slots", w.pid, host,
                 identity, g, w.slots)
        self.workers[ident] = w        # before the fleet is told: the master's rollout waits on this host
        self.drain_stale(serving)
        self.fleet_changed()
        return w

    def rolled(self, host, serving: int) -> bool:
        """Host `host` runs the serving generation's file (a worker of it is here and not draining)."""
        want = self.gens[serving].identity
        return any(w.remote and w.host == host and w.identity == want and w.state != "draining"
                   for w in self.workers.values())

    def drain_stale(self, serving: int) -> None:
        """RETIRE every remote worker of a retired or forgotten generation's file whose host runs the
        serving file (see the module's doc), once: it is marked draining here."""
        for w in [w for w in self.workers.values() if w.remote and w.state != "draining"]:
            g = self.generation_of(w.identity)
            if (g is None or (g < serving and g in self.retired)) and self.rolled(w.host, serving):
                log.info("worker %s on host %s runs generation %s's model, retired here: it drains", w.pid,
                         w.host, g)
                self.send(w.ident, b"RETIRE", b"\x80")
                w.state = "draining"

    # -- in the tick --------------------------------------------------------------------
    def check(self, now, serving: int):
        """Drop remote workers silent for `timeout`; ROLL the hosts of other identities while a
        generation newer than `serving` comes up."""
        for w in [w for w in self.workers.values() if w.remote]:
            silent = now - w.last_seen
            if silent > self.settings.timeout:
                self.lose(w.ident, f"silent for {silent:.1f}s (timeout {self.settings.timeout:g}s)")
        if self.sock is None or now - self.last_roll < ROLL_EVERY_S:
            return
        self.drain_stale(serving)
        coming = [g for g in self.gens if g > serving]
        if not coming:
            return
        self.last_roll = now
        target = self.gens[max(coming)].identity
        for w in [w for w in self.workers.values() if w.remote and w.identity != target]:
            self.send(w.ident, b"ROLL", {"identity": target, "model": self.gens[max(coming)].model_path})

    def retire(self, g, serving: int):
        """Generation g is retired (in `retired`): the remote workers of its model file drain, unless
        the serving generation runs the same file (drain_stale)."""
        self.drain_stale(serving)

    def lose(self, ident, why):
        w = self.workers.get(ident)
        if w is None:
            return
        log.error("worker %s on host %s lost: %s", w.pid, w.host, why)
        self.counters["hosts_lost"] += 1
        self.remove_worker(ident, f"worker {w.pid} on host {w.host} was lost ({why})")
        self.fleet_changed()

    def fleet_changed(self):
        """Tell the master which identities each host runs (its rollout waits for every host)."""
        hosts = {}
        for w in self.workers.values():
            if w.remote and w.state != "draining":
                hosts.setdefault(w.host, set()).add(w.identity)
        self.to_master({"op": "fleet", "hosts": {h: sorted(ids) for h, ids in hosts.items()}})
