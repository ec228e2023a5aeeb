"""The master's roles beyond one machine: the head and the worker host (a `Fleet` the Arbiter holds).

    serve   a router and workers (the default); with `backend_bind` its router also takes worker hosts
    head    `colibri router`: a router and no workers; it reads of the model file only what a router
            needs (config, tokenizer, identity: `ModelHead`), and serves through worker hosts
    host    `colibri serve --join tcp://HEAD:PORT`: workers and no router; they connect to the head's
            backend_bind (CURVE with join_server_key / join_secret_key)

What changes with the role, and only that, lives here:
- A worker host has no router to say which workers are READY: a worker marks itself joined in the
  heartbeat table when the head ACCEPTs it, and a worker the head refuses (another model file) never
  is, so a host whose file the head does not serve never announces READY=1 and a reload to such a
  file rolls back. A host's old generation of another file drains when the head retires it (RETIRE
  to its workers, once the head has no queued request of it), as a local router retires one; of the
  same file (the host's own HUP), at once.
- SIGUSR2 (a head's rollout reaches a host through its workers, worker.roll): reload only when the
  file under the model path is another model than the one served or coming up.
- A head commits a new generation once every worker host it knows runs the new file (the router's
  "fleet" reports), or at the reload deadline if some do (those that do not are named); it rolls
  back if none does.
"""
from __future__ import annotations

import logging
import os
import socket

from ..wire.identity import file_identity

log = logging.getLogger("colibri.master")


class ModelHead:
    """What a router-only master keeps of a model: its config, tokenizer and identity, from the
    file's header and blobs (no tensor page is read, no kernel compiled). Stands where generations.py
    expects a Model."""

    def __init__(self, path):
        from ..model.config import file_config
        from ..model.format import ColibriFile
        self.path = path
        self.file = ColibriFile.open(path, populate=False, hugepages=False)
        try:
            self.config = file_config(self.file)
        except BaseException:
            self.file.close()
            raise

    def close(self):
        self.file.close()


class Fleet:
    """What the master's role changes (see the module's doc). The Arbiter holds one and asks it; every
    figure of the running master it needs is an argument. `notify` is the sd_notify-like callable."""

    def __init__(self, role: str, notify):
        self.role = role                # "serve" | "head" | "host"
        self.notify = notify
        self.hosts = {}                 # host -> identities its workers run (the router's "fleet" reports)
        self.host_tag = f"{socket.gethostname()}:{os.getpid()}"
        self.join_curve = None
        self.worker_curve = None

    def check_role(self, s):
        """Before anything is opened: the role's settings and its CURVE files (HaltServer naming them)."""
        from ..wire.security import CurveServer, SecurityError, client_curve
        from .loading import EXIT_LOAD, HaltServer
        if self.role == "head" and not s.backend_bind:
            raise HaltServer("colibri router serves through worker hosts: give --backend-bind tcp://HOST:PORT", EXIT_LOAD)
        if self.role == "head" and s.join:
            raise HaltServer("colibri router is a head: join is for worker hosts (`colibri serve --join`)", EXIT_LOAD)
        if s.join:
            self.role = "host"
        try:
            if self.role == "host" and s.join_server_key:
                self.join_curve = client_curve(s.join_server_key, s.join_secret_key)
            if self.role != "host" and s.backend_bind and s.curve_secret_key:
                self.worker_curve = CurveServer(s.curve_secret_key, s.worker_allowed_keys or None)
        except (SecurityError, OSError) as e:
            raise HaltServer(str(e), EXIT_LOAD) from None

    def open_for_role(self, path, s):
        """The head maps only the header (ModelHead); the others open the whole model."""
        if self.role == "head":
            return ModelHead(path)
        from .loading import open_model
        return open_model(path, s)

    # -- worker hosts -------------------------------------------------------------------
    def poll_joined(self, workers, heartbeats):
        """A host's workers (WorkerInfo by pid) are ready once the head has ACCEPTed them."""
        if self.role != "host":
            return
        for w in workers.values():
            w.ready = heartbeats.joined(w.slot)

    def drains_at_commit(self, old_identity, new_identity) -> bool:
        """A worker host's reload of the same file (HUP, TTIN's settings): the head sees no new model, so
        it never retires the old generation; its workers drain at the commit (the new ones serve the same
        requests at the head). Of another file, the head retires it (RETIRE) once its queue is empty."""
        return self.role == "host" and old_identity == new_identity

    def wants_reload(self, model_path, known) -> bool:
        """USR2, a head's rollout: reload when the file under the model path is another model than the
        ones served or coming up (`known`: their identities; several workers may ask: one reload)."""
        try:
            have = file_identity(model_path)
        except Exception as e:
            log.error("USR2: model %s cannot be read (%s): no reload", model_path, e)
            return False
        if have in known:
            log.info("USR2: %s is the model served or coming up: no reload", model_path)
            return False
        log.info("USR2: %s holds model %s now: reloading", model_path, have)
        return True

    # -- the head -------------------------------------------------------------------------
    def ready_to_commit(self, g, gen, settings, deadline_passed: bool):
        """True: commit generation g (a Generation `gen`); False: wait; None: roll back. A generation of
        the head (or of a serve with backend_bind) waits for every worker host the router knows to run
        its file."""
        if not getattr(settings, "backend_bind", ""):
            return True
        want = gen.info.get("identity")
        behind = sorted(h for h, ids in self.hosts.items() if want not in ids)
        if not behind:
            return True
        if not deadline_passed:
            return False
        rolled = [h for h, ids in self.hosts.items() if want in ids]
        if self.role == "head" and not rolled:
            return None
        log.error("generation %d: worker hosts %s do not run %s (%s) after the rollout's time: committing "
                  "without them; they are refused until they run it", g, ", ".join(behind), want, gen.model.path)
        return True

    def announce_head(self, settings, model_path, generation, identity) -> None:
        """A head is ready once its router listens (worker hosts join when they will)."""
        log.info("ready: %s on %s, worker hosts join on %s (model %s, identity %s)",
                 os.path.basename(model_path), settings.bind, settings.backend_bind, model_path, identity)
        self.notify(f"READY=1\nSTATUS=head serving generation {generation}")

    def workers_for_role(self, s):
        if self.role == "head":
            return 0
        from ..host.pinning import Topology, default_workers
        return s.workers or default_workers(Topology.detect(), s.threads_per_worker)

    def scale_refused(self, what) -> bool:
        if self.role == "head":
            log.warning("%s: a head has no workers of its own (its worker hosts scale with theirs)", what)
            return True
        return False
