"""The router's end of the master's socketpair: msgpack messages both ways, and what each of the
master's does to the router.

The master sends: exited (a worker it reaped), generation (one coming up: the file holding its
tokenizer and limits), commit (it serves now, with its settings), abort, forget, reload_status,
settings, drain (a graceful stop begins), faulty (the generation's model fails requests, and why),
exit. The router sends: up, alive, ready, unresponsive, retire, fleet, drained, bind_failed,
generation_failed.

Owns: the socket, the decoding, and the meaning of each master op. Never: scheduling, clients or
workers (the router's loop; each op goes through the router's own methods and records).
"""
from __future__ import annotations

import logging
import socket
import time

import msgpack

from .records import Gen

log = logging.getLogger("colibri.router")


class MasterPipe:
    def __init__(self, router, fd: int):
        self.router = router
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg) -> None:
        try:
            self.sock.send(msgpack.packb(msg))
        except (BlockingIOError, OSError) as e:
            log.error("router: cannot reach the master (%s)", e)

    def load(self, g, info) -> bool:
        """Generation g's tokenizer and limits into the router; a failure is told to the master."""
        r = self.router
        try:
            r.gens[g] = Gen(info, r.settings)
        except Exception as e:
            log.error("router: generation %d's tokenizer cannot be loaded: %s", g, e)
            self.send({"op": "generation_failed", "generation": g, "error": str(e)})
            return False
        return True

    def read(self) -> None:
        """Every message the master sent since the last read, applied in order."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except ConnectionResetError:        # the master was killed (SIGKILL, an OOM kill) with
                data = b""                      # messages unread: its end is gone all the same
                log.error("router: the master is gone (its end of the pipe was reset): stopping")
            if not data:
                self.router.stopping = True      # the master closed its end
                return
            try:
                msg = msgpack.unpackb(data, raw=False)
            except Exception:
                log.error("router: malformed message from the master dropped")
                continue
            self.apply(msg)

    def apply(self, msg) -> None:
        r, op = self.router, msg.get("op")
        if op == "exited":
            r.worker_exited(msg["pid"])
        elif op == "generation":       # a generation coming up: its tokenizer, not serving yet
            g = msg["generation"]
            try:
                with open(msg["info"], "rb") as f:
                    info = msgpack.unpackb(f.read(), raw=False)
            except Exception as e:
                log.error("router: generation %d's tokenizer cannot be loaded: %s", g, e)
                self.send({"op": "generation_failed", "generation": g, "error": str(e)})
                return
            if self.load(g, info):
                log.info("router: generation %d loaded (%s)", g, r.gens[g].model_path)
                if r.generation not in r.gens:     # the first one, at start: serve it at once
                    r.select(g)
        elif op == "commit":           # generation g is READY: new requests go to it
            g = msg["generation"]
            if g not in r.gens:
                log.error("router: commit of unknown generation %d", g)
                return
            if msg.get("settings") is not None:
                r.apply_settings(msg["settings"])
            r.select(g)
            r.last_reload = {"generation": g, "ok": True, "error": None, "time": time.time()}
            log.info("router: generation %d serving (%s)", g, r.model_path)
        elif op == "abort":            # it did not come up: forget it
            if msg["generation"] != r.generation:
                r.gens.pop(msg["generation"], None)
        elif op == "forget":           # the master unmapped it: gone once none of its requests is left
            if msg["generation"] != r.generation:
                r.forgotten.add(msg["generation"])
        elif op == "reload_status":
            r.last_reload = msg.get("last_reload")
        elif op == "settings":
            r.apply_settings(msg["settings"])
        elif op == "drain":
            r.draining = True
        elif op == "faulty" and msg.get("generation") in r.gens:
            r.gens[msg["generation"]].faulty = str(msg.get("reason"))
            log.error("generation %d is faulty: %s", msg["generation"], msg.get("reason"))
        elif op == "exit":
            r.stopping = True
