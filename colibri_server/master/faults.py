"""A served model that fails its requests for a reason of the model.

MAP_SHARED shows every worker a change to the model file: bytes written in place turn answers
into numerical faults, a truncation kills each worker that reads past the new end (SIGBUS). The
master finds both (a stat of the file every 2 s; a worker reaped after SIGBUS) and marks the
generation faulty: the router's health says so with the reason, and it stops retrying that
generation's requests onto workers that would die the same way. A good file renamed over the
path and a HUP (or USR1) bring a new generation that replaces it.

Owns: the faulty generations and their reasons. Reads each generation's file as it was mapped (format's
ColibriFile.mapped: device, inode, size, mtime of the descriptor mapped): the path's stat is that file only where
device and inode are the same, and a generation's inode cannot be another file's while the generation's mapping
holds it. A file renamed over the path (a deploy, a refused reload's file, one that reuses the inode of a file since
unmapped) is another file, not a change. Never: reloads, kills or answers a request (the arbiter and the router do).
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
        self.faulty = {}            # generation -> why its model fails requests
        self.last_check = 0.0

    def check_file(self) -> None:
        """A generation's file changed in place (the path's file is the one it mapped, with another size or mtime):
        said loudly, once a file, and every generation mapping it faulty."""
        now = time.monotonic()
        if now - self.last_check < CHECK_EVERY_S:
            return
        self.last_check = now
        said = set()
        for g, gen in list(self.gens.items()):
            mapped = gen.model.file.mapped
            if g in self.faulty or mapped is None:
                continue
            path = gen.model.path
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != mapped[:2] or (st.st_size, st.st_mtime_ns) == mapped[2:]:
                continue
            if mapped[:2] not in said:
                said.add(mapped[:2])
                log.critical("model file %s was modified IN PLACE (same inode, new size/mtime): every worker "
                             "sees the change through MAP_SHARED. Replace files with a rename, then send USR1.",
                             path)
            self.mark(g, f"its model file {path} was changed in place "
                         f"({'truncated' if st.st_size < mapped[2] else 'rewritten'})")

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
