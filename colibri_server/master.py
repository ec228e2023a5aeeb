"""The master (arbiter): maps the model once, forks the router and the workers, reaps them.

No ZeroMQ context and no thread live in this process, so every fork is safe. It opens and
validates the model (MAP_SHARED, read-only, optionally pre-faulted and locked), compiles the
kernels by running one tiny non-parallel generation, calls gc.freeze(), then forks. Signal
handlers only queue the signal; the main loop dispatches handle_<name>(). It talks to the
router over a SOCK_SEQPACKET socketpair (worker exited, generation switched, drain, exit)
and hears back which workers announced READY and which went silent.

Exit codes: 0 clean stop; 3 a worker failed to boot (halt, do not respawn forever);
4 the model or settings could not be loaded at start.
"""
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

from .worker import EXIT_BOOT_FAILED, HeartbeatTable, Worker, worker_main

log = logging.getLogger("colibri.master")

EXIT_WORKER_BOOT = EXIT_BOOT_FAILED
EXIT_LOAD = 4
MAX_WORKER_SLOTS = 1024
SIGNALS = ("HUP", "TTIN", "TTOU", "USR1", "TERM", "INT", "QUIT", "CHLD")
CRASH_WINDOW_S = 60.0
CRASH_LIMIT = 5          # crashes in the window before respawns back off
BACKOFF_MAX_S = 30.0


class HaltServer(Exception):
    def __init__(self, reason, code):
        super().__init__(reason)
        self.reason, self.code = reason, code


class WorkerInfo:
    __slots__ = ("pid", "wid", "slot", "generation", "started", "ready", "cpus", "stopping", "killed")

    def __init__(self, pid, wid, slot, generation, cpus):
        self.pid, self.wid, self.slot, self.generation, self.cpus = pid, wid, slot, generation, cpus
        self.started = time.monotonic()
        self.ready = False
        self.stopping = False       # sent TERM (drain) or QUIT
        self.killed = False


class Arbiter:
    def __init__(self, settings, reload_settings=None, notify=None):
        """settings: a Settings object; reload_settings(): re-read them (HUP);
        notify: an sd_notify-like callable(str) or None."""
        self.settings = settings
        self.reload_settings = reload_settings
        self.notify = notify or (lambda msg: None)
        self.sig_queue = []
        self.workers = {}               # pid -> WorkerInfo
        self.models = {}                # generation -> Model
        self.generation = 0
        self.router_pid = None
        self.next_wid = 0
        self.crashes = []
        self.backoff_until = 0.0
        self.backoff = 1.0
        self.stopping = None            # None | "graceful" | "fast"
        self.stop_deadline = None
        self.reloading = None           # generation being brought up
        self.announced = False
        self.exit_code = 0
        from .systemd import watchdog_interval
        self.watchdog = watchdog_interval()
        self.last_watchdog = 0.0

    # ------------------------------------------------------------------------ start
    def start(self):
        s = self.settings
        self.pid = os.getpid()
        self.runtime_dir = _runtime_dir(s)
        self.backend = f"ipc://{self.runtime_dir}/backend-{self.pid}.sock"
        if s.pidfile:
            _write_pidfile(s.pidfile, self.pid)
        self.model_path = _model_path(s.model)
        from .security import CurveServer, SecurityError, check_bind_security
        self.curve = None
        if s.bind.startswith("tcp://") and s.curve_secret_key:
            try:
                self.curve = CurveServer(s.curve_secret_key, s.curve_allowed_keys)   # reads files only
            except SecurityError as e:
                raise HaltServer(str(e), EXIT_LOAD)
        for w in check_bind_security(s.bind, self.curve is not None):
            log.warning("%s", w)
        try:
            model = self._open_model(self.model_path)
        except HaltServer:
            raise
        except (OSError, ValueError) as e:      # ColibriFormatError is a ValueError
            raise HaltServer(f"model {self.model_path}: {e}", EXIT_LOAD) from None
        self.generation = 1
        self.models[1] = model
        self.heartbeats = HeartbeatTable(MAX_WORKER_SLOTS)
        self.num_workers = s.workers or _default_workers()
        self._init_signals()
        self.pipe, router_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._router_end = router_end
        self.pipe.setblocking(False)
        gc.collect()
        gc.freeze()       # objects made so far stay out of the children's collector (copy-on-write)
        self.spawn_router()
        log.info("master %d: model %s (generation 1), %d workers, bind %s", self.pid, self.model_path,
                 self.num_workers, s.bind)
        self.manage_workers()

    def _open_model(self, path):
        """Open, validate, map (and pre-fault / lock) a model; compile the kernels on it."""
        from .model import Model
        s = self.settings
        size = os.path.getsize(path)
        populate = s.populate
        try:
            import psutil
            avail = psutil.virtual_memory().available
            if size > avail:
                log.warning("model %s (%.1f GiB) is larger than available memory (%.1f GiB): it will page "
                            "from disk; not pre-faulting it", path, size / 2**30, avail / 2**30)
                populate = False
        except Exception:
            pass
        t0 = time.perf_counter()
        m = Model.open(path, context=s.context, populate=populate, routing_noise=s.routing_noise,
                       seed=None if s.seed < 0 else s.seed, hugepages=s.hugepages)
        if s.mlock:
            _mlock(m.file, path)
        t1 = time.perf_counter()
        # compile every kernel specialisation the workers will use, here, once (non-parallel kernels)
        m.set_prefill_bf16(s.prefill_bf16)
        m.warm_up(announce=log.info)       # says so on stderr when the kernels compile (first start)
        if s.threads_per_worker > 1:
            m.compile_threaded()           # compiled here, launched only in the forked workers
        st = os.stat(path)
        self.model_identity = {path: (st.st_ino, st.st_size, st.st_mtime_ns)}
        huge = m.file.huge_bytes
        log.info("model %s: %s, %d layers, %d experts, %s, %.1f MiB mapped in %.2fs (%s), kernels ready in %.2fs",
                 path, m.config.arch, m.config.num_layers, m.config.num_experts, m.config.dtype,
                 size / 2**20, t1 - t0, "2 MiB pages: unknown" if huge is None else
                 f"{huge / 2**20:.0f} MiB on 2 MiB pages", time.perf_counter() - t1)
        return m

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
        from .router import Router, router_main
        router = Router(frontend=self.settings.bind, backend=self.backend, pipe_fd=self._router_end.fileno(),
                        settings=self.settings, generation=self.generation, model_path=self.model_path,
                        curve=self.curve)
        pid = os.fork()
        if pid == 0:
            self._in_child()
            router_main(router)
        self.router_pid = pid
        log.info("router %d started on %s", pid, self.settings.bind)

    def spawn_worker(self, generation):
        from .pinning import plan_free
        wid = self.next_wid
        self.next_wid += 1
        used = {w.slot for w in self.workers.values()}
        slot = next(i for i in range(MAX_WORKER_SLOTS) if i not in used)
        # the CPUs the workers that stay do not hold (draining workers and older generations
        # are leaving: their CPUs go to their replacements)
        taken = [w.cpus for w in self.workers.values()
                 if w.generation == generation and not w.stopping and w.cpus]
        cpus, plan = plan_free(self.settings, self.num_workers, taken)
        if plan is not None and plan.warnings and getattr(self, "_pin_warned", None) != plan.warnings:
            self._pin_warned = plan.warnings
            for msg in plan.warnings:
                log.warning("pinning: %s", msg)
        self.heartbeats.beat(slot)
        w = Worker(wid=wid, slot=slot, generation=generation, model=self.models[generation],
                   settings=self.settings, backend=self.backend, cpus=cpus, heartbeats=self.heartbeats)
        pid = os.fork()
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
        random.seed()

    # ------------------------------------------------------------------------ main loop
    def run(self) -> int:
        try:
            self.start()
        except HaltServer as h:
            log.error("halting: %s", h.reason)
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
                self.check_model_file()
                if self.stopping:
                    if self.stop_step():
                        break
                else:
                    self.manage_workers()
                    self.check_reload()
                    self.check_router()
        except HaltServer as h:
            log.error("halting: %s", h.reason)
            self.exit_code = h.code
            self.kill_all(signal.SIGKILL)
        finally:
            self.cleanup()
        return self.exit_code

    def sleep(self):
        try:
            r, _, _ = select.select([self._wake_r, self.pipe], [], [], min(0.5, self.watchdog or 0.5))
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
            op = msg.get("op")
            w = self.workers.get(msg.get("pid"))
            if op == "ready" and w is not None:
                w.ready = True
            elif op == "unresponsive" and w is not None and not w.killed:
                log.error("worker %d unresponsive to the router: killing it", w.pid)
                self._kill(w.pid, signal.SIGKILL)

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
            if pid == self.router_pid:
                self.router_pid = None
                if not self.stopping:
                    log.error("router %d exited (%s): restarting it", pid, _describe(code))
                continue
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            self.heartbeats.clear(w.slot)
            self.to_router({"op": "exited", "pid": pid})
            if code == EXIT_BOOT_FAILED and not w.ready:
                raise HaltServer(f"worker {pid} failed to boot (exit {code}); see its traceback above",
                                 EXIT_WORKER_BOOT)
            if w.stopping or self.stopping:
                log.info("worker %d exited (%s)", pid, _describe(code))
            elif code == 0:
                log.info("worker %d exited after serving its max_requests: replacing it", pid)
            else:
                log.error("worker %d died (%s): replacing it", pid, _describe(code))
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
            if age > timeout:
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
        """Keep num_workers live workers of the current generation (not counting draining ones)."""
        current = [w for w in self.workers.values() if w.generation == self.generation and not w.stopping]
        if len(current) < self.num_workers:
            if time.monotonic() < self.backoff_until:
                return
            for _ in range(self.num_workers - len(current)):
                self.spawn_worker(self.generation)
        elif len(current) > self.num_workers:
            for w in sorted(current, key=lambda w: w.started)[: len(current) - self.num_workers]:
                log.info("worker %d: stopping (TTOU)", w.pid)
                self._kill(w.pid, signal.SIGTERM)
        if not self.announced and current and all(w.ready for w in current) and len(current) >= self.num_workers:
            self.announced = True
            self._ready_line()

    def _ready_line(self):
        from .memory import mib, process_memory
        ws = [w for w in self.workers.values() if w.generation == self.generation]
        uss = [process_memory(w.pid)["uss"] for w in ws]
        size = os.path.getsize(self.model_path)
        log.info("ready: %s on %s, %d workers (pids %s), model %s mapped once (%s), worker USS %s",
                 os.path.basename(self.model_path), self.settings.bind, len(ws),
                 ",".join(str(w.pid) for w in ws), self.model_path, mib(size), "/".join(mib(u) for u in uss))
        self.notify(f"READY=1\nSTATUS=serving generation {self.generation} with {len(ws)} workers")

    def check_router(self):
        if self.router_pid is None and not self.stopping:
            self.spawn_router()

    # ------------------------------------------------------------------------ generations
    def check_reload(self):
        """A new generation is up when all its workers are READY: then drain the old ones."""
        if self.reloading is None:
            return
        new = [w for w in self.workers.values() if w.generation == self.reloading and not w.stopping]
        if len(new) < self.num_workers or not all(w.ready for w in new):
            return
        old = [w for w in self.workers.values() if w.generation < self.reloading and not w.stopping]
        for w in old:
            self._kill(w.pid, signal.SIGTERM)
        log.info("generation %d serving; draining %d workers of older generations", self.reloading, len(old))
        self.reloading = None
        self.notify(f"READY=1\nSTATUS=serving generation {self.generation} with {len(new)} workers")
        self._close_unused_models()

    def _close_unused_models(self):
        live = {w.generation for w in self.workers.values()} | {self.generation}
        for g in [g for g in self.models if g not in live]:
            m = self.models.pop(g)
            log.info("generation %d: no workers left, unmapping %s", g, m.path)
            m.close()

    def new_generation(self, model=None):
        g = self.generation + 1
        self.models[g] = model or self.models[self.generation]
        self.generation = g
        self.reloading = g
        self.to_router({"op": "generation", "generation": g, "model": self.models[g].path})
        for _ in range(self.num_workers):
            self.spawn_worker(g)

    # ------------------------------------------------------------------------ signal handlers
    def handle_chld(self):
        self.reap()

    def handle_ttin(self):
        self.num_workers += 1
        log.info("TTIN: %d workers", self.num_workers)

    def handle_ttou(self):
        if self.num_workers > 1:
            self.num_workers -= 1
        log.info("TTOU: %d workers", self.num_workers)

    def handle_hup(self):
        """Re-read the settings and start a new generation of workers on them; drain the old."""
        self.notify("RELOADING=1")
        if self.reload_settings is not None:
            try:
                new = self.reload_settings()
            except Exception as e:
                log.error("HUP: settings not reloaded, keeping the current ones: %s", e)
                self.notify("READY=1")
                return
            self.settings = new
            self.num_workers = new.workers or _default_workers()
            self.to_router({"op": "settings", "settings": _settings_dict(new)})
        log.info("HUP: new generation %d with %d workers", self.generation + 1, self.num_workers)
        self.new_generation()

    def handle_usr1(self):
        """Hot model reload: re-open the model path, validate, map; a bad file is refused."""
        self.notify("RELOADING=1")
        path = self.model_path
        try:
            model = self._open_model(path)
        except Exception as e:
            log.error("USR1: model %s refused, generation %d keeps serving: %s", path, self.generation, e)
            self.notify(f"READY=1\nSTATUS=model reload refused: {e}")
            return
        log.info("USR1: model %s validated: starting generation %d", path, self.generation + 1)
        self.new_generation(model)

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

    def handle_int(self):
        self.stopping = "fast"
        self.stop_deadline = time.monotonic() + 5.0
        self.notify("STOPPING=1")
        log.info("fast stop")
        self.to_router({"op": "drain"})
        self.kill_all(signal.SIGQUIT)

    handle_quit = handle_int

    def stop_step(self) -> bool:
        """One step of stopping; True when everything is gone."""
        if self.workers and time.monotonic() > self.stop_deadline:
            log.warning("stop: %d workers still running after the timeout: killing them", len(self.workers))
            self.kill_all(signal.SIGKILL)
            self.stop_deadline = time.monotonic() + 5.0
        if self.workers:
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

    def check_model_file(self):
        """MAP_SHARED shows an in-place write to every worker: say so loudly."""
        now = time.monotonic()
        if now - getattr(self, "_last_file_check", 0.0) < 2.0:
            return
        self._last_file_check = now
        for path, ident in self.model_identity.items():
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_ino, st.st_size, st.st_mtime_ns) != ident and ident[0] == st.st_ino:
                log.critical("model file %s was modified IN PLACE (same inode, new size/mtime): every worker "
                             "sees the change through MAP_SHARED. Replace files with a rename, then send USR1.",
                             path)
                self.model_identity[path] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def cleanup(self):
        if self.router_pid is not None:
            self._kill_router()
            try:
                os.waitpid(self.router_pid, 0)
            except ChildProcessError:
                pass
        for path in (self.backend[len("ipc://"):] if getattr(self, "backend", None) else None,
                     self.settings.bind[len("ipc://"):] if self.settings.bind.startswith("ipc://") else None):
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
        log.info("master %d: stopped", os.getpid())


# ---------------------------------------------------------------------------- helpers

def _describe(code):
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def _default_workers():
    from .pinning import Topology, default_workers
    return default_workers(Topology.detect())


def _model_path(path):
    from .cli import BUNDLED_MODEL, model_file_problem
    if not path:
        path = BUNDLED_MODEL
    problem = model_file_problem(path)
    if problem:
        raise HaltServer(problem, EXIT_LOAD)
    return os.path.abspath(path)


def _runtime_dir(settings):
    from .settings import resolve_runtime_dir
    d = resolve_runtime_dir(settings)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError as e:
        raise HaltServer(f"runtime directory {d}: {e.strerror}", EXIT_LOAD) from None
    return d


def _write_pidfile(path, pid):
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = int(f.read().strip() or 0)
            if old and old != pid:
                os.kill(old, 0)
                raise HaltServer(f"pidfile {path} names a running process {old}: another master?", EXIT_LOAD)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    tmp = f"{path}.{pid}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{pid}\n")
        os.replace(tmp, path)
    except OSError as e:
        what = "its directory does not exist" if isinstance(e, FileNotFoundError) else e.strerror
        raise HaltServer(f"pidfile {path}: {what}", EXIT_LOAD) from None


def _mlock(cf, path):
    import ctypes
    import resource
    size = cf.header["file_size"]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < size:
        raise HaltServer(f"mlock: the model needs {size / 2**20:.0f} MiB locked but RLIMIT_MEMLOCK is "
                         f"{soft / 2**20:.0f} MiB (raise LimitMEMLOCK= in the unit, or ulimit -l, or turn "
                         "mlock off)", EXIT_LOAD)
    libc = ctypes.CDLL(None, use_errno=True)
    addr = cf._buf.ctypes.data
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
        e = ctypes.get_errno()
        raise HaltServer(f"mlock of {path} ({size / 2**20:.0f} MiB) failed: {os.strerror(e)}", EXIT_LOAD)
    log.info("model %s locked in memory (%.0f MiB)", path, size / 2**20)


def _settings_dict(s):
    return s.to_dict() if hasattr(s, "to_dict") else dict(vars(s))
