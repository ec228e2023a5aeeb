"""The master (arbiter): maps the model once, forks the router and the workers, reaps them.

No ZeroMQ context and no thread live in this process, so every fork is safe. It takes every
listening address first (startup.py: the gateway's HTTP socket here, the client address by the
router, forked before the model is opened and answering "starting" meanwhile), then opens and
validates the model (MAP_SHARED, read-only, optionally pre-faulted and locked), compiles the
kernels by running one tiny non-parallel generation and one batched step, calls gc.freeze(), hands
the first generation to the router and forks the workers. Signal handlers only queue the signal; the
main loop dispatches handle_<name>(). It talks to the router over a SOCK_SEQPACKET socketpair (worker
exited, generation switched, drain, exit) and hears back which workers announced READY and which went silent.

Generations: each one owns its Model (its own mapping of the file, as opened when the generation began), its
settings and its tokenizer (the router holds a copy); a mapping is closed only when no worker of its generation
is left and it is neither the serving nor the reloading generation. A reload (HUP: settings and model; USR1:
model) is a transaction: the new generation's model is opened and checked and its workers boot and announce
READY, and only then is it committed (the router sends new requests to it and retires the old one once the old
one's queue is empty). If any step fails, the new generation is rolled back, the old one keeps serving, and the
failure is logged, kept for `status` and sent as the systemd STATUS. Only the first start may halt the master.

The router is supervised like a worker: it says "alive" over the pipe every 0.5 s (also between the
messages of a long burst); one silent for `timeout`, at least 5 s (stopped, hung; one reading pages from
disk is not: host/paging.py), is killed; a dead router is restarted, with a growing delay while it keeps
dying young. Its requests end with an explicit error on the client side (the client sees its connection
drop); the workers re-announce to the new router at its first heartbeat ping.

Where the parts live: loading.py opens and checks what the master needs before it forks (the model, its
checksums, the compile, the runtime directory, the pidfile); the Arbiter holds a Reloads (generations.py: what
is served and the reload transaction) and a Fleet (fleet.py: what the role, head or worker host, changes), each
built in __init__ with what it reads and calls.

Exit codes: 0 clean stop (TERM while loading too); 3 a worker failed to boot at the first start (halt, do not
respawn forever); 4 the model or settings could not be loaded at start; 5 a listening address cannot be bound at
start (the router's client address or backend_bind, the gateway's http: busy port, missing ipc directory), found
before the model is opened. 3, 4 and 5 are in the unit's RestartPreventExitStatus: they do not get better by
retrying."""
from __future__ import annotations

import errno
import gc
import logging
import os
import random
import select
import signal
import socket
import time

import msgpack

from ..host.paging import FaultWatch
from ..router.loop import EXIT_ROUTER_BIND
from ..worker import EXIT_BOOT_FAILED, EXIT_RETIRED, HeartbeatTable, Worker, worker_main
from .faults import ModelFaults
from .fleet import Fleet
from .generations import Reloads
from .loading import EXIT_BIND, EXIT_LOAD, HaltServer, describe_exit, make_runtime_dir, model_path_of, write_pidfile
from .residency import next_turn as residency_turn
from .startup import Loading, bind_http, wait_router_up

log = logging.getLogger("colibri.master")

EXIT_WORKER_BOOT = EXIT_BOOT_FAILED
MAX_WORKER_SLOTS = 1024
SIGNALS = ("HUP", "TTIN", "TTOU", "USR1", "USR2", "TERM", "INT", "QUIT", "CHLD")
CRASH_WINDOW_S = 60.0
CRASH_LIMIT = 5          # crashes in the window before respawns back off
BACKOFF_MAX_S = 30.0
FLOOR_RESPAWN_S = 1.0    # during a crash backoff, an empty serving generation still gets a worker this often
ROUTER_TIMEOUT_MIN_S = 5.0   # a router silent this long (or `timeout` if longer) is killed and restarted
ROUTER_YOUNG_S = 10.0    # a router that dies younger than this is restarted after a growing delay
ROUTER_BACKOFF_MAX_S = 10.0
RELOAD_CRASH_LIMIT = 3   # deaths of a reloading generation's workers (beyond its size) before rollback


def fork_with_signals_blocked() -> int:
    """os.fork with the master's signals blocked across it: one meant for the child before its role's
    handlers are in waits for them (each role unblocks after installing), instead of running the
    master's inherited handler, which queues it where nothing reads; the parent unblocks at once."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {getattr(signal, "SIG" + n) for n in SIGNALS})
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return pid


class WorkerInfo:
    __slots__ = ("pid", "wid", "slot", "generation", "started", "ready", "cpus", "stopping", "killed")

    def __init__(self, pid, wid, slot, generation, cpus):
        self.pid, self.wid, self.slot, self.generation, self.cpus = pid, wid, slot, generation, cpus
        self.started = time.monotonic()
        self.ready = False
        self.stopping = False       # sent TERM (drain) or QUIT
        self.killed = False


class Arbiter:
    def __init__(self, settings, reload_settings=None, notify=None, role="serve"):
        """settings: a Settings object; reload_settings(): re-read them (HUP);
        notify: an sd_notify-like callable(str) or None; role: "serve", or "head" (`colibri router`:
        no workers); `join` in the settings makes it a worker host (fleet.py)."""
        self.notify = notify or (lambda msg: None)
        self.sig_queue = []
        self.workers = {}               # pid -> WorkerInfo
        self.fleet = Fleet(role, self.notify)      # what the role (serve, head, worker host) changes
        # what is served (settings, model path, worker count, generations) and the reload transaction
        self.reloads = Reloads(settings, workers=self.workers, fleet=self.fleet, to_router=self.to_router,
                               notify=self.notify, spawn_worker=self.spawn_worker, kill=self._kill,
                               open_model=self._open_model, reload_settings=reload_settings)
        self.paging = FaultWatch()      # a silent router or worker that reads pages from disk is not hung
        self.faults = ModelFaults(gens=self.reloads.gens, to_router=self.to_router)  # the model file under the map
        self.router_pid = None
        self.router_started = 0.0
        self.router_seen = 0.0
        self.router_up = False          # the router bound its sockets at least once
        self.router_backoff = 0.0
        self.router_next_start = 0.0
        self.bind_error = None
        self.router_drained = False     # a graceful stop: the router has no request running any more
        self.next_wid = 0
        self.crashes = []
        self.backoff_until = 0.0
        self.last_floor_spawn = 0.0
        self.backoff = 1.0
        self.stopping = None            # None | "graceful" | "fast"
        self.stop_deadline = None
        self.http = None                # HttpChild when settings.http: the gateway under this master
        self.http_listener = None       # its socket, bound before the model is loaded (startup.py)
        self.announced = False
        self.exit_code = 0
        from ..host.systemd import watchdog_interval
        self.watchdog = watchdog_interval()
        self.last_watchdog = 0.0

    # what is served is the Reloads' (generations.py) and the role the Fleet's (fleet.py): read here
    settings = property(lambda self: self.reloads.settings)
    model_path = property(lambda self: self.reloads.model_path)
    num_workers = property(lambda self: self.reloads.num_workers)
    gens = property(lambda self: self.reloads.gens)
    generation = property(lambda self: self.reloads.generation)
    reloading = property(lambda self: self.reloads.reloading)
    role = property(lambda self: self.fleet.role)

    # ------------------------------------------------------------------------ start
    def start(self):
        s = self.settings
        self.pid = os.getpid()
        self.runtime_dir = make_runtime_dir(s)
        self.reloads.use_runtime_dir(self.runtime_dir, self.pid)
        from .generations import sweep_runtime_dir
        sweep_runtime_dir(self.runtime_dir)      # a master killed with -9 cleaned up nothing
        self.backend = f"ipc://{self.runtime_dir}/backend-{self.pid}.sock"
        if s.pidfile:
            write_pidfile(s.pidfile, self.pid)
        self.reloads.model_path = model_path_of(s.model)
        from ..host.logs import set_role
        set_role(f"master [{os.path.basename(self.model_path)}]")
        from ..wire.security import CurveServer, SecurityError, check_bind_security
        self.fleet.check_role(s)
        if self.role == "host":
            self.backend = s.join
        self.curve = None
        if s.bind.startswith("tcp://") and s.curve_secret_key and self.role != "host":
            try:
                self.curve = CurveServer(s.curve_secret_key, s.curve_allowed_keys)   # reads files only
            except SecurityError as e:
                raise HaltServer(str(e), EXIT_LOAD)
        for w in check_bind_security(s.bind, self.curve is not None) if self.role != "host" else ():
            log.warning("%s", w)
        if s.http and self.curve is not None:
            raise HaltServer("http: the gateway cannot join a CURVE-encrypted bind; bind ipc:// or a "
                             "loopback tcp:// address, or run `colibri http` with its CURVE keys", EXIT_LOAD)
        # every listening address before the model: a busy one fails in a second, not after the compile
        self.http_listener = listener = bind_http(s.http) if s.http else None
        self._init_signals()
        self.pipe, router_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._router_end = router_end
        self.pipe.setblocking(False)
        if self.role != "host":
            self.spawn_router()     # generation 0: it answers "starting" until the first generation is handed over
            wait_router_up(self)
        if listener is not None:
            from .gateway import HttpChild
            self.http = HttpChild(s, s.bind, listener)
            self.http.poll()
        with Loading(self.notify, self.read_router, f"model {os.path.basename(self.model_path)}"):
            try:
                model, nodes = self._open_model(self.model_path, s)
            except HaltServer:
                raise
            except Exception as e:  # ColibriFormatError and ChecksumMismatch are ValueErrors; a failing warm-up too
                raise HaltServer(f"model {self.model_path} refused: {e}", EXIT_LOAD) from None
        self.router_seen = time.monotonic()
        self.reloads.serve_first(model, nodes)
        self.heartbeats = HeartbeatTable(MAX_WORKER_SLOTS)
        self.reloads.num_workers = self.fleet.workers_for_role(s)
        gc.collect()
        gc.freeze()       # objects made so far stay out of the children's collector (copy-on-write)
        if self.router_pid is not None:
            self.reloads.hand_over(1)       # a router that died meanwhile is restarted with it in memory
        log.info("master %d (%s): model %s (generation 1), %d workers, %s", self.pid, self.role, self.model_path,
                 self.num_workers, f"joining {s.join}" if self.role == "host" else f"bind {s.bind}")
        self.manage_workers()

    def _open_model(self, path, s):
        """loading.open_model (and with pin = numa on several nodes, its pages placed by host/numa.py: the
        file interleaved, or a copy per node).
        Returns (Model, {node: (Model, NodeCopy)})."""
        from ..host import numa
        from ..host.pinning import Topology
        self.topology = Topology.detect()
        with numa.interleaved(s, self.topology):
            m = self.fleet.open_for_role(path, s)
        try:
            nodes = numa.place(path, s, self.topology, lambda p: self.fleet.open_for_role(p, s)) \
                if self.role != "head" else {}
        except BaseException:
            m.close()
            raise
        return m, nodes

    def _init_signals(self):
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w)
        for name in SIGNALS:
            signal.signal(getattr(signal, "SIG" + name), self._queue_signal)

    def _queue_signal(self, signum, frame):
        if len(self.sig_queue) < 16:
            self.sig_queue.append(signum)

    # ------------------------------------------------------------------------ forking
    def spawn_router(self):
        from ..router.loop import Router, router_main
        # the router is forked with every live generation's tokenizer in memory: nothing to re-read
        gens = {g: dict(gen.info) for g, gen in self.gens.items()}
        router = Router(frontend=self.settings.bind, backend=self.backend, pipe_fd=self._router_end.fileno(),
                        settings=self.settings, generation=self.generation, model_path=self.model_path,
                        curve=self.curve, generations=gens, last_reload=self.reloads.last_reload,
                        worker_curve=self.fleet.worker_curve)
        self._drain_pipe()          # whatever the dead router left unread is stale
        pid = fork_with_signals_blocked()
        if pid == 0:
            self._in_child()
            router_main(router)
        self.router_pid = pid
        self.router_started = self.router_seen = time.monotonic()
        log.info("router %d started on %s", pid, self.settings.bind)

    def _drain_pipe(self):
        try:
            self._router_end.setblocking(False)
            while self._router_end.recv(65536):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def spawn_worker(self, generation):
        from ..host.pinning import plan_free
        wid = self.next_wid
        self.next_wid += 1
        used = {w.slot for w in self.workers.values()}
        slot = next(i for i in range(MAX_WORKER_SLOTS) if i not in used)
        gen = self.gens[generation]
        # the CPUs the workers that stay do not hold (draining workers and older generations
        # are leaving: their CPUs go to their replacements)
        taken = [w.cpus for w in self.workers.values()
                 if w.generation == generation and not w.stopping and w.cpus]
        cpus, plan = plan_free(gen.settings, self.num_workers, taken)
        if plan is not None and plan.warnings and getattr(self, "_pin_warned", None) != plan.warnings:
            self._pin_warned = plan.warnings
            for msg in plan.warnings:
                log.warning("pinning: %s", msg)
        self.heartbeats.beat(slot)
        from ..host.numa import node_of
        w = Worker(wid=wid, slot=slot, generation=generation, model=gen.model_for(node_of(cpus, self.topology)),
                   settings=gen.settings, backend=self.backend, cpus=cpus, heartbeats=self.heartbeats,
                   host=self.fleet.host_tag, curve=self.fleet.join_curve, model_path=gen.model.path)
        pid = fork_with_signals_blocked()
        if pid == 0:
            self._in_child()
            self._router_end.close()
            worker_main(w)
        self.workers[pid] = WorkerInfo(pid, wid, slot, generation, cpus)
        log.info("worker %d booting (id %d, generation %d, cpus %s)", pid, wid, generation, cpus)
        return pid

    def _in_child(self):
        signal.set_wakeup_fd(-1)
        for name in SIGNALS:
            signal.signal(getattr(signal, "SIG" + name), signal.SIG_DFL)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipe.close()
        if self.http_listener is not None:     # the gateway's alone: no other child holds its port
            self.http_listener.close()
        random.seed()

    # ------------------------------------------------------------------------ main loop
    def run(self) -> int:
        try:
            self.start()
        except HaltServer as h:
            log.log(logging.INFO if h.code == 0 else logging.ERROR, "halting: %s", h.reason)
            self.cleanup(quiet=True)    # the router and the gateway may be up already; the halt is the one line
            return h.code
        try:
            while True:
                self.sleep()
                while self.sig_queue:
                    name = signal.Signals(self.sig_queue.pop(0)).name[3:].lower()
                    log.log(logging.DEBUG if name == "chld" else logging.INFO, "signal %s", name.upper())
                    getattr(self, "handle_" + name)()
                self.read_router()
                self.ping_watchdog()
                self.reap()
                self.murder_hung()
                self.faults.check_file()
                if self.stopping:
                    if self.stop_step():
                        break
                else:
                    self.manage_workers()
                    self.reloads.check(self.stopping)
                    if self.role != "host":
                        self.check_router()
                    if self.http is not None:
                        self.http.poll()
                    self.reloads.close_unused_models()
        except HaltServer as h:
            log.error("halting: %s", h.reason)
            self.exit_code = h.code
            self.kill_all(signal.SIGKILL)
        finally:
            self.cleanup()
        return self.exit_code

    def sleep(self):
        try:
            timeout = min(0.5, self.watchdog or 0.5, 0.5 if self.stopping else residency_turn(self.gens, time.monotonic()))
            if self.router_pid is None and not self.stopping and self.role != "host":   # restart the router on time
                timeout = min(timeout, max(0.0, self.router_next_start - time.monotonic()))
            r, _, _ = select.select([self._wake_r, self.pipe], [], [], timeout)
            if self._wake_r in r:
                while os.read(self._wake_r, 512):
                    pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EINTR):
                raise

    def ping_watchdog(self):
        """WATCHDOG=1 every half WatchdogSec while this loop runs (a hung master gets restarted)."""
        if self.watchdog and time.monotonic() - self.last_watchdog >= self.watchdog:
            self.last_watchdog = time.monotonic()
            self.notify("WATCHDOG=1")

    def read_router(self):
        while True:
            try:
                data = self.pipe.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                return
            try:
                msg = msgpack.unpackb(data, raw=False)
            except Exception:
                continue
            self.router_seen = time.monotonic()
            op = msg.get("op")
            w = self.workers.get(msg.get("pid"))
            if op == "ready" and w is not None:
                w.ready = True
            elif op == "unresponsive" and w is not None and not w.killed:
                log.error("worker %d unresponsive to the router: killing it", w.pid)
                self._kill(w.pid, signal.SIGKILL)
            elif op == "up":
                if not self.router_up:
                    log.info("router %s: listening on %s", msg.get("pid"), self.settings.bind)
                self.router_up = True
            elif op == "bind_failed":
                self.bind_error = str(msg.get("error"))
            elif op == "drained":
                self.router_drained = True
            elif op == "retire":
                self.reloads.retire(msg.get("generation"))
            elif op == "fleet":
                self.fleet.hosts = {h: set(ids) for h, ids in (msg.get("hosts") or {}).items()}
            elif op == "generation_failed" and msg.get("generation") == self.reloading:
                self.reloads.rollback(f"the router could not load its tokenizer: {msg.get('error')}")
            elif op == "generation_failed" and msg.get("generation") == self.generation and not self.announced:
                raise HaltServer(f"the router could not load the model's tokenizer: {msg.get('error')}", EXIT_LOAD)

    def to_router(self, msg):
        try:
            self.pipe.send(msgpack.packb(msg))
        except OSError as e:
            log.error("cannot reach the router: %s", e)

    # ------------------------------------------------------------------------ children
    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if self.http is not None and self.http.reaped(pid, code, describe_exit):
                continue
            if pid == self.router_pid:
                self.router_pid = None
                self.read_router()          # its last words (bind_failed) are in the pipe
                if not self.stopping:
                    self._router_died(pid, code)
                continue
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            self.paging.forget(pid)
            self.heartbeats.clear(w.slot)
            self.to_router({"op": "exited", "pid": pid})
            if w.stopping or self.stopping:
                log.info("worker %d exited (%s)", pid, describe_exit(code))
                continue
            if code == EXIT_BOOT_FAILED and not w.ready:
                if w.generation == self.reloading:
                    self.reloads.rollback(f"worker {pid} of generation {w.generation} failed to boot (exit {code}); "
                                  "see its log line above")
                    continue
                if not self.announced:      # only the first start may halt
                    raise HaltServer(f"worker {pid} failed to boot (exit {code}); see its traceback above",
                                     EXIT_WORKER_BOOT)
                log.error("worker %d failed to boot (exit %d): replacing it after a delay", pid, code)
                self._note_crash()
                continue
            if w.generation == self.reloading:
                gen = self.gens.get(w.generation)
                if gen is not None:
                    gen.deaths += 1
                    if gen.deaths > RELOAD_CRASH_LIMIT:
                        self.reloads.rollback(f"{gen.deaths} workers of generation {w.generation} died before it "
                                      f"was ready (last: {describe_exit(code)})")
                        continue
            if code == EXIT_RETIRED:
                self.reloads.retired_by_head(w.generation, pid)
            elif code == 0 and w.generation not in (self.generation, self.reloading):
                log.info("worker %d of retired generation %d exited", pid, w.generation)
            elif code == 0:
                log.info("worker %d exited after serving its max_requests: replacing it", pid)
            else:
                log.error("worker %d died (%s): replacing it", pid, describe_exit(code))
                if code == -signal.SIGBUS:
                    self.faults.worker_died_of_sigbus(w.generation, pid)
                self._note_crash()

    def _note_crash(self):
        now = time.monotonic()
        self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW_S] + [now]
        if len(self.crashes) >= CRASH_LIMIT:
            self.backoff_until = now + self.backoff
            log.error("%d worker crashes in %.0fs: waiting %.1fs before respawning", len(self.crashes),
                      CRASH_WINDOW_S, self.backoff)
            self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
        elif len(self.crashes) <= 1:
            self.backoff = 1.0

    def murder_hung(self):
        timeout = self.settings.timeout
        for w in list(self.workers.values()):
            if w.killed:
                continue
            age = self.heartbeats.age(w.slot)
            if self.paging.hung(w.pid, age, timeout, f"worker {w.pid}"):      # no heartbeat, no page read
                log.error("worker %d silent for %.1fs (timeout %.1fs): killing it", w.pid, age, timeout)
                self._kill(w.pid, signal.SIGKILL)

    def _kill(self, pid, sig):
        w = self.workers.get(pid)
        if w is not None:
            if sig == signal.SIGKILL:
                w.killed = True
            elif sig in (signal.SIGTERM, signal.SIGQUIT):
                w.stopping = True
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self, sig):
        for pid in list(self.workers):
            self._kill(pid, sig)

    def manage_workers(self):
        """Keep num_workers live workers of each generation Reloads.staffed() names (not counting
        draining ones)."""
        self.fleet.poll_joined(self.workers, self.heartbeats)
        for g in self.reloads.staffed():
            live = [w for w in self.workers.values() if w.generation == g and not w.stopping]
            if len(live) < self.num_workers:
                now = time.monotonic()
                if now < self.backoff_until:
                    # backing off after repeated crashes, but never with the serving generation
                    # empty: one worker at a time, at most one a second (a crash loop stays slow)
                    if g == self.generation and not live and now - self.last_floor_spawn >= FLOOR_RESPAWN_S:
                        self.last_floor_spawn = now
                        log.warning("backing off after crashes, but generation %d has no worker: starting one", g)
                        self.spawn_worker(g)
                    continue
                for _ in range(self.num_workers - len(live)):
                    self.spawn_worker(g)
            elif len(live) > self.num_workers:
                for w in sorted(live, key=lambda w: w.started)[: len(live) - self.num_workers]:
                    log.info("worker %d: stopping (TTOU)", w.pid)
                    self._kill(w.pid, signal.SIGTERM)
        if self.role == "head" and not self.announced and self.router_up:
            self.announced = True
            self.fleet.announce_head(self.settings, self.model_path, self.generation,
                                     self.gens[self.generation].info.get("identity"))
        current = [w for w in self.workers.values() if w.generation == self.generation and not w.stopping]
        if not self.announced and current and all(w.ready for w in current) and len(current) >= self.num_workers:
            self.announced = True
            self._ready_line()

    def _ready_line(self):
        from ..host.memory import mib, process_memory
        ws = [w for w in self.workers.values() if w.generation == self.generation]
        uss = [process_memory(w.pid)["uss"] for w in ws]
        size = self.gens[self.generation].model.file.header["file_size"]
        # a worker host listens on nothing: it names the head it joined, not the bind it never uses
        where = f"joined to {self.settings.join}" if self.role == "host" else f"on {self.settings.bind}"
        log.info("ready: %s %s, %d workers (pids %s), model %s mapped once (%s), worker USS %s",
                 os.path.basename(self.model_path), where, len(ws),
                 ",".join(str(w.pid) for w in ws), self.model_path, mib(size), "/".join(mib(u) for u in uss))
        self.notify(f"READY=1\nSTATUS=serving generation {self.generation} with {len(ws)} workers")

    def check_router(self):
        now = time.monotonic()
        if self.router_pid is None:
            if not self.stopping and now >= self.router_next_start:
                self.spawn_router()
            return
        silent, limit = now - self.router_seen, max(self.settings.timeout, ROUTER_TIMEOUT_MIN_S)
        if self.paging.hung(self.router_pid, silent, limit, f"router {self.router_pid}"):
            log.error("router %d silent for %.1fs (limit %.1fs: timeout, at least %.0fs): killing it",
                      self.router_pid, silent, limit, ROUTER_TIMEOUT_MIN_S)
            self._kill_router()
            self.router_seen = now          # once; the reap restarts it

    def _router_died(self, pid, code):
        if code == EXIT_ROUTER_BIND and self.bind_error and not self.router_up:
            raise HaltServer(self.bind_error, EXIT_BIND)
        now = time.monotonic()
        if now - self.router_started < ROUTER_YOUNG_S:
            self.router_backoff = min(max(0.1, self.router_backoff * 2), ROUTER_BACKOFF_MAX_S)
        else:
            self.router_backoff = 0.0
        self.router_next_start = now + self.router_backoff
        why = f": {self.bind_error}" if code == EXIT_ROUTER_BIND and self.bind_error else ""
        log.error("router %d exited (%s%s): restarting it%s", pid, describe_exit(code), why,
                  f" in {self.router_backoff:.1f}s" if self.router_backoff else "")
        self.bind_error = None

    # ------------------------------------------------------------------------ signal handlers
    def handle_chld(self):
        self.reap()

    def handle_ttin(self):
        if self.fleet.scale_refused("TTIN"):
            return
        self.reloads.num_workers += 1
        log.info("TTIN: %d workers", self.num_workers)

    def handle_ttou(self):
        if self.fleet.scale_refused("TTOU"):
            return
        if self.num_workers > 1:
            self.reloads.num_workers -= 1
        log.info("TTOU: %d workers", self.num_workers)

    def handle_hup(self):
        """Re-read the settings, open the model again (the new generation owns its own mapping) and
        bring up a new generation on them; the old one drains only once the new one is READY."""
        self.reloads.reload("hup", self.stopping)

    def handle_usr1(self):
        """Hot model reload: re-open the model path, validate, map; a bad file is refused."""
        self.reloads.reload("usr1", self.stopping)

    def handle_usr2(self):
        """A head's rollout (through a worker): reload when the file under the model path is another
        model than the ones served or coming up."""
        known = {self.gens[g].info.get("identity") for g in (self.generation, self.reloading) if g in self.gens}
        if self.fleet.wants_reload(self.model_path, known):
            self.reloads.reload("usr1", self.stopping)

    def handle_term(self):
        if self.stopping:
            return
        self.stopping = "graceful"
        self.stop_deadline = time.monotonic() + self.settings.graceful_timeout
        self.notify("STOPPING=1")
        log.info("TERM: graceful stop, finishing requests in flight (graceful_timeout %.0fs)",
                 self.settings.graceful_timeout)
        self.to_router({"op": "drain"})
        self.kill_all(signal.SIGTERM)
        if self.http is not None:
            self.http.stop(signal.SIGTERM)
        self.reloads.abandon()

    def handle_int(self):
        self.stopping = "fast"
        self.stop_deadline = time.monotonic() + 5.0
        self.notify("STOPPING=1")
        log.info("fast stop")
        self.to_router({"op": "drain"})
        self.kill_all(signal.SIGQUIT)
        if self.http is not None:
            self.http.stop(signal.SIGQUIT)

    handle_quit = handle_int

    def stop_step(self) -> bool:
        """One step of stopping; True when everything is gone."""
        if self.workers and time.monotonic() > self.stop_deadline:
            log.warning("stop: %d workers still running after the timeout: killing them", len(self.workers))
            self.kill_all(signal.SIGKILL)
            self.stop_deadline = time.monotonic() + 5.0
        if self.workers:
            return False
        if (self.stopping == "graceful" and self.router_pid is not None and not self.router_drained
                and time.monotonic() <= self.stop_deadline):
            return False        # requests still run on workers the router reaches (a head's hosts'): they finish
        if self.http is not None and self.http.pid is not None:     # the gateway's requests end with the workers'
            if time.monotonic() > self.stop_deadline:
                self.http.stop(signal.SIGKILL)
                self.stop_deadline = time.monotonic() + 5.0
            return False
        if self.router_pid is not None:
            if not getattr(self, "_router_told", False):
                self.to_router({"op": "exit"})
                self._router_told = True
                self._router_deadline = time.monotonic() + 5.0
            elif time.monotonic() > self._router_deadline:
                self._kill_router()
            return False
        return True

    def _kill_router(self):
        if self.router_pid:
            try:
                os.kill(self.router_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cleanup(self, quiet=False):
        if self.http is not None and self.http.pid is not None:
            self.http.stop(signal.SIGTERM)
        if self.router_pid is not None:
            self._kill_router()
            try:
                os.waitpid(self.router_pid, 0)
            except ChildProcessError:
                pass
        for gen in self.gens.values():
            if gen.info_path and os.path.exists(gen.info_path):
                try:
                    os.unlink(gen.info_path)
                except OSError:
                    pass
        backend = getattr(self, "backend", None) or ""
        # the client address only when this server's router bound it (not another server's, found busy)
        for path in (backend[len("ipc://"):] if backend.startswith("ipc://") and self.role != "host" else None,
                     self.settings.bind[len("ipc://"):] if self.settings.bind.startswith("ipc://")
                     and self.role != "host" and self.router_up else None):
            if path and os.path.exists(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.settings.pidfile and os.path.exists(self.settings.pidfile):
            try:
                with open(self.settings.pidfile) as f:
                    if f.read().strip() == str(os.getpid()):
                        os.unlink(self.settings.pidfile)
            except OSError:
                pass
        if not quiet:
            log.info("master %d: stopped", os.getpid())

