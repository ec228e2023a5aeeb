"""Generations and the reload transaction of the master (`Reloads`, an object the Arbiter holds).

A Generation owns its Model (its own mapping of the file, as opened when it began), its settings
and the router's view of it (tokenizer JSON, vocabulary, context). A reload (HUP: settings and
model; USR1: model) opens and checks the model, brings up the new generation's workers and only
when all are READY commits it (the router then serves new requests with it and retires the old
one once the old one's queue is empty); if a step fails, or the workers do not come up in time,
it is rolled back and the serving generation never stopped. One transaction at a time: a
reload arriving during one follows it. A mapping is closed once nothing can use it.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import time

import msgpack

from .residency import tend as tend_residency

log = logging.getLogger("colibri.master")
_LEFT_BEHIND = re.compile(r"(?:backend-(\d+)\.sock|generation-(\d+)-\d+\.msgpack)")


def sweep_runtime_dir(runtime_dir: str) -> list:
    """Remove what masters that died without cleaning up (kill -9) left in the runtime directory:
    their backend socket and generation files, named by their pid, when no process has that pid
    now. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(runtime_dir)
    except OSError:
        return removed
    for name in names:
        m = _LEFT_BEHIND.fullmatch(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1) or m.group(2)), 0)
            continue                    # alive (or another user's): not ours to judge
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(os.path.join(runtime_dir, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("runtime directory %s: removed %d files of masters no longer running (%s)", runtime_dir,
                 len(removed), ", ".join(sorted(removed)[:4]) + (", ..." if len(removed) > 4 else ""))
    return removed


class Generation:
    """One generation: its own Model (mapping), settings and worker count, and the router's
    view of it (tokenizer JSON, vocabulary, context) written for the router to read."""
    __slots__ = ("number", "model", "settings", "info", "info_path", "started", "deaths", "kind", "node_models")

    def __init__(self, number, model, settings, kind="start", node_models=None):
        """node_models: {NUMA node: (Model, NodeCopy)} when numa_memory places a copy per node (host/numa.py)."""
        self.number, self.model, self.settings, self.kind = number, model, settings, kind
        self.node_models = node_models or {}
        cfg = model.config
        self.info = {"generation": number, "model": model.path, "vocab_size": cfg.vocab_size,
                     "hidden_size": cfg.hidden_size,
                     "context": min(settings.context, cfg.max_position_embeddings),
                     "tokenizer_json": model.file.tokenizer_json or "", "identity": model.file.identity}
        self.info_path = None
        self.started = time.monotonic()
        self.deaths = 0

    def model_for(self, node):
        """The mapping a worker on NUMA node `node` computes on: its node's copy, else the file's."""
        m = self.node_models.get(node)
        return m[0] if m is not None else self.model

    def close(self):
        self.model.close()
        for m, copy in self.node_models.values():
            m.close()
            copy.close()


class Reloads:
    """What the master serves (its settings, model path, worker count, the generations and which one
    serves) and the transaction that replaces it. The Arbiter holds one, built with what it calls:
    `workers` is the Arbiter's {pid: WorkerInfo} (never rebound), `fleet` its Fleet, `to_router(msg)`
    and `notify(text)` send, `spawn_worker(g)` forks a worker of generation g, `kill(pid, sig)` signals
    one, `open_model(path, settings)` opens a model (-> (Model, node models)), `reload_settings()`
    re-reads the settings (HUP; None: keep them)."""

    def __init__(self, settings, *, workers: dict, fleet, to_router, notify, spawn_worker, kill, open_model,
                 reload_settings=None):
        self.settings, self.model_path, self.num_workers = settings, None, 0
        self.workers, self.fleet = workers, fleet
        self.to_router, self.notify, self.spawn_worker, self.kill = to_router, notify, spawn_worker, kill
        self.open_model, self.reload_settings = open_model, reload_settings
        self.gens = {}                  # generation number -> Generation (owns its Model)
        self.generation = 0             # the serving (committed) generation
        self.reloading = None           # generation number being brought up (uncommitted)
        self.head_retired = set()       # generations whose file a worker host's head retired (EXIT_RETIRED)
        self.pending_reload = None      # "hup" | "usr1" arriving while a reload is under way
        self.reload_prev = None         # num_workers to restore on rollback (settings change at commit)
        self.reload_deadline = None
        self.last_reload = None         # {"generation", "ok", "error", "time"} for status
        self.runtime_dir, self.pid = None, None    # where hand_over writes (use_runtime_dir)

    def use_runtime_dir(self, runtime_dir: str, pid: int):
        self.runtime_dir, self.pid = runtime_dir, pid

    def serve_first(self, model, node_models=None):
        """The first generation, on the model the start opened: serving at once (no transaction)."""
        self.generation = 1
        self.gens[1] = Generation(1, model, self.settings, node_models=node_models)

    def check(self, stopping):
        """Commit the generation being brought up once all its workers are READY (and the router
        has its tokenizer); roll it back when it does not come up in time. Each turn also re-ranks the
        locked experts of the models that have a weights budget (residency.py)."""
        tend_residency(self.gens, workers=len(self.workers))
        if self.reloading is None:
            if self.pending_reload and not stopping:
                kind, self.pending_reload = self.pending_reload, None
                self.reload(kind, stopping)
            return
        g = self.reloading
        new = [w for w in self.workers.values() if w.generation == g and not w.stopping]
        late = time.monotonic() > self.reload_deadline
        if len(new) < self.num_workers or not all(w.ready for w in new):
            if late:
                ready = sum(1 for w in new if w.ready)
                self.rollback(f"generation {g}: {ready} of {self.num_workers} workers ready after "
                              f"{time.monotonic() - self.gens[g].started:.0f}s")
            return
        fleet = self.fleet.ready_to_commit(g, self.gens[g], self.settings, late)   # worker hosts run the new file
        if fleet is None:
            self.rollback(f"generation {g}: no worker host runs {self.gens[g].info.get('identity')} "
                          f"({self.gens[g].model.path}) after {time.monotonic() - self.gens[g].started:.0f}s")
            return
        if not fleet:
            return
        old = self.generation
        self.generation, self.reloading, self.reload_prev = g, None, None
        self.settings = self.gens[g].settings
        self.model_path = self.gens[g].model.path
        self.to_router({"op": "commit", "generation": g, "settings": _settings_dict(self.settings)})
        log.info("generation %d serving (%d workers); generation %d drains once its queue is empty",
                 g, len(new), old)
        self.last_reload = {"generation": g, "ok": True, "error": None, "time": time.time()}
        self.notify(f"READY=1\nSTATUS=serving generation {g} with {len(new)} workers")
        if old in self.gens and self.fleet.drains_at_commit(self.gens[old].info.get("identity"),
                                                            self.gens[g].info.get("identity")):
            self.retire(old)

    def staffed(self) -> list:
        """The generations kept at num_workers workers: the one being brought up, and the serving one
        unless, while that one comes up, the head retired the serving one's file (a worker host whose
        workers drained on RETIRE before its own reload committed: a replacement would run a file the
        head no longer serves)."""
        if self.reloading is None:
            return [self.generation]
        return ([] if self.generation in self.head_retired else [self.generation]) + [self.reloading]

    def retired_by_head(self, g, pid):
        """A worker of generation g drained and exited because the head retired its file."""
        self.head_retired.add(g)
        log.info("worker %d of generation %d exited: the head retired its model", pid, g)

    def retire(self, g):
        """The router has no queued request of generation g left: its workers may drain."""
        if g is None or g in (self.generation, self.reloading):
            return
        old = [w for w in self.workers.values() if w.generation == g and not w.stopping]
        for w in old:
            self.kill(w.pid, signal.SIGTERM)
        if old:
            log.info("generation %d retired: draining its %d workers", g, len(old))

    def rollback(self, reason):
        """The generation being brought up failed: stop its workers, restore the settings; the
        serving generation never stopped."""
        g = self.reloading
        if g is None:
            return
        for w in list(self.workers.values()):
            if w.generation == g:
                w.stopping = True
                self.kill(w.pid, signal.SIGKILL)
        self.reloading = None
        if self.reload_prev is not None:
            self.num_workers = self.reload_prev
            self.reload_prev = None
        self.to_router({"op": "abort", "generation": g})
        self._fail(g, f"reload rolled back, generation {self.generation} keeps serving: {reason}")

    def abandon(self):
        """Stopping: the generation being brought up is no longer waited for."""
        self.reloading = None

    def _fail(self, g, message):
        log.error("%s", message)
        self.last_reload = {"generation": g, "ok": False, "error": message, "time": time.time()}
        self.to_router({"op": "reload_status", "last_reload": self.last_reload})
        self.notify(f"READY=1\nSTATUS={message[:400]}")

    def close_unused_models(self):
        """Unmap a generation's model once nothing can use it: not serving, not being brought up,
        and no worker of it alive (a live worker holds its own inherited copy of the mapping, but
        a replacement would be forked from this one)."""
        live = {w.generation for w in self.workers.values()} | {self.generation, self.reloading}
        for g in [g for g in self.gens if g not in live]:
            gen = self.gens.pop(g)
            self.head_retired.discard(g)
            log.info("generation %d: no workers left, unmapping %s", g, gen.model.path)
            gen.close()
            if gen.info_path:
                try:
                    os.unlink(gen.info_path)
                except OSError:
                    pass
            self.to_router({"op": "forget", "generation": g})

    def begin_generation(self, model, settings, kind, node_models=None):
        """Start bringing up a new generation on `model` (which it owns from now on)."""
        g = max(self.gens) + 1
        self.gens[g] = Generation(g, model, settings, kind, node_models)
        self.reloading = g
        self.reload_deadline = time.monotonic() + max(60.0, 2 * settings.timeout)
        self.hand_over(g)
        for _ in range(self.num_workers):
            self.spawn_worker(g)

    def hand_over(self, g):
        """Generation g's view (tokenizer, vocabulary, context) to the running router, in a file it
        reads: a reload's new generation, or the first one to a router forked before the load."""
        gen = self.gens[g]
        gen.info_path = os.path.join(self.runtime_dir, f"generation-{self.pid}-{g}.msgpack")
        tmp = gen.info_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(gen.info))
        os.replace(tmp, gen.info_path)
        self.to_router({"op": "generation", "generation": g, "info": gen.info_path})

    def reload(self, kind, stopping):
        """HUP ("hup": settings and model) or USR1 ("usr1": the model): open and check, then bring up
        a new generation; one transaction at a time."""
        if stopping:
            return
        if self.reloading is not None:
            # one transaction at a time: this one runs when the current one commits or rolls back
            if self.pending_reload != "hup":
                self.pending_reload = kind
            log.info("%s: generation %d is still coming up; this reload follows it", kind.upper(), self.reloading)
            return
        self.notify("RELOADING=1")
        settings = self.settings
        if kind == "hup" and self.reload_settings is not None:
            try:
                settings = self.reload_settings()
            except Exception as e:
                self._fail(self.generation + 1, f"HUP: settings not reloaded, generation "
                                                f"{self.generation} keeps serving: {e}")
                return
        path = self.model_path
        try:
            model, nodes = self.open_model(path, settings)
        except Exception as e:
            self._fail(max(self.gens) + 1, f"{kind.upper()}: model {path} refused, generation "
                                           f"{self.generation} keeps serving: {e}")
            return
        self.reload_prev = self.num_workers       # the settings change only at the commit
        if kind == "hup":
            self.num_workers = self.fleet.workers_for_role(settings)
        log.info("%s: model %s validated: bringing up generation %d with %d workers", kind.upper(), path,
                 max(self.gens) + 1, self.num_workers)
        self.begin_generation(model, settings, kind, nodes)


def _settings_dict(s):
    return s.to_dict() if hasattr(s, "to_dict") else dict(vars(s))
