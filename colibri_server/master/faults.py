"""A served model that fails its requests for a reason of the model.

MAP_SHARED shows every worker a change to the model file: bytes written in place turn answers
into numerical faults, a truncation kills each worker that reads past the new end (SIGBUS). The
master finds both (a stat of the file every 2 s; a worker reaped after SIGBUS) and marks the
generation faulty: the router's health says so with the reason, and it stops retrying that
generation's requests onto workers that would die the same way. A good file renamed over the
path and a HUP (or USR1) bring a new generation that replaces it.

Owns: the identity of the opened file, the faulty generations and their reasons. Never: reloads,
kills or answers a request (the arbiter and the router do).
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("colibri.master")

CHECK_EVERY_S = 2.0


class ModelFaults:
    def __init__(self, *, gens: dict, to_router):
        self.gens, self.to_router = gens, to_router       # generation -> Generation (the Reloads'); a pipe send
        self.identity = {}          # path -> (inode, size, mtime_ns) when it was opened
        self.faulty = {}            # generation -> why its model fails requests
        self.last_check = 0.0

    def watch(self, path) -> None:
        st = os.stat(path)
        self.identity = {path: (st.st_ino, st.st_size, st.st_mtime_ns)}

    def check_file(self) -> None:
        """A file changed in place (same inode, new size or mtime): said loudly, its generations faulty."""
        now = time.monotonic()
        if now - self.last_check < CHECK_EVERY_S:
            return
        self.last_check = now
        for path, ident in self.identity.items():
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_ino, st.st_size, st.st_mtime_ns) != ident and ident[0] == st.st_ino:
                log.critical("model file %s was modified IN PLACE (same inode, new size/mtime): every worker "
                             "sees the change through MAP_SHARED. Replace files with a rename, then send USR1.",
                             path)
                self.identity[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
                for g, gen in self.gens.items():
                    if os.path.realpath(gen.model.path) == os.path.realpath(path):
                        self.mark(g, f"its model file {path} was changed in place "
                                     f"({'truncated' if st.st_size < ident[1] else 'rewritten'})")

    def worker_died_of_sigbus(self, generation, pid) -> None:
        self.mark(generation, f"worker {pid} died of SIGBUS reading the model file (truncated or changed under "
                              "the map)")

    def mark(self, generation, reason) -> None:
        if generation in self.faulty or generation not in self.gens:
            return
        self.faulty[generation] = reason
        log.error("generation %d is faulty: %s; replace the file (a rename over it) and send HUP", generation,
                  reason)
        self.to_router({"op": "faulty", "generation": generation, "reason": reason})
