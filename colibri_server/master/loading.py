"""What the master opens and checks before it forks, each failure a one-line HaltServer (exit
EXIT_LOAD, 4): the model (its path, the mapping, every tensor's CRC-32 on forked processes
beside the compile, mlock, the kernels compiled once: Model.warm_up and the batched step's),
the runtime directory and the pidfile. Nothing here starts a thread that outlives its call or
keeps a process: the master forks after it.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import msgpack

log = logging.getLogger("colibri.master")

EXIT_LOAD = 4
EXIT_BIND = 5           # a listening address (the router's, the gateway's) cannot be bound at start


class HaltServer(Exception):
    def __init__(self, reason, code):
        super().__init__(reason)
        self.reason, self.code = reason, code


def describe_exit(code):
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def open_model(path, s):
    """Open, validate, map (and pre-fault / lock) a model with settings s; verify its
    checksums (verify_checksums); compile the kernels on it (the batched step's too)."""
    from ..model import Model
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
    from ..host.memory import anonymous
    from ..host.trim import trim
    from .residency import attach, budget_for, lock
    budget = budget_for(path, s)
    if budget < size:
        populate = False            # the budget decides what comes in (residency.py)
    anon0 = anonymous(os.getpid())
    t0 = time.perf_counter()
    m = Model.open(path, context=s.context, populate=populate, routing_noise=s.routing_noise,
                   seed=None if s.seed < 0 else s.seed, hugepages=s.hugepages)
    verify = getattr(s, "verify_checksums", True)
    finish = None
    try:
        t_map = time.perf_counter() - t0
        t_crc = 0.0
        if verify:      # the pages were just faulted in: read from memory, beside the compile
            tc = time.perf_counter()
            finish = _start_checksums(m.file)
            t_crc = time.perf_counter() - tc
        if budget < size:
            try:
                attach(m, s, budget)
            except ValueError as e:
                raise HaltServer(f"model {path}: {e}", EXIT_LOAD) from None
        elif s.mlock:
            _mlock(m.file, path)
        t1 = time.perf_counter()
        try:
            _compile(m, s)
            given = trim()          # LLVM's library pages and the heap's free pages: the workers fork without them
            if budget < size:       # locked once the compile is done: it takes what the page cache gives up
                try:
                    lock(m, s, anonymous(os.getpid()) - anon0)
                except (ValueError, OSError) as e:
                    raise HaltServer(f"model {path}: {e}", EXIT_LOAD) from None
        finally:
            if finish is not None:          # a mismatch explains a failing warm-up best
                tc = time.perf_counter()
                finish, f = None, finish
                f()
                t_crc += time.perf_counter() - tc
    except BaseException:
        m.close()
        raise
    huge = m.file.huge_bytes
    log.info("model %s: %s, %d layers, %d experts, %s, %.1f MiB mapped in %.2fs (%s), checksums %s, "
             "kernels ready in %.2fs (%d compiled; %.0f MiB of the compiler's memory given back)",
             path, m.config.arch, m.config.num_layers, m.config.num_experts, m.config.dtype,
             size / 2**20, t_map, "2 MiB pages: unknown" if huge is None else
             f"{huge / 2**20:.0f} MiB on 2 MiB pages",
             f"verified (+{t_crc:.2f}s beside the compile)" if verify else "not verified",
             time.perf_counter() - t1, getattr(m, "compiled", 0), given / 2**20)
    return m


def _compile(m, s):
    # compile every kernel specialisation the workers will use, here, once: the batched engine's
    # (workers run nothing else); says so on stderr when the kernels compile (first start)
    from ..model import serving
    m.set_prefill_bf16(s.prefill_bf16)
    m.warm_up(announce=log.info, run=lambda: serving.warm_up(m, s.kv_dtype, s.threads_per_worker))
    if s.threads_per_worker > 1:
        serving.compile_threaded(m, s.kv_dtype)     # compiled here, launched only in the forked workers


def model_path_of(path):
    from ..bundled import BUNDLED_MODEL, model_file_problem
    if not path:
        path = BUNDLED_MODEL
    problem = model_file_problem(path)
    if problem:
        raise HaltServer(problem, EXIT_LOAD)
    return os.path.abspath(path)


def make_runtime_dir(settings):
    from ..settings.load import resolve_runtime_dir
    d = resolve_runtime_dir(settings)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError as e:
        raise HaltServer(f"runtime directory {d}: {e.strerror}", EXIT_LOAD) from None
    return d


def write_pidfile(path, pid):
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


def verify_checksums(cf, procs=None, min_bytes=64 << 20):
    """Every tensor's CRC-32 (see _start_checksums); raises the first ChecksumMismatch."""
    _start_checksums(cf, procs, min_bytes)()


def _start_checksums(cf, procs=None, min_bytes=64 << 20):
    """Start checking every tensor's CRC-32 on up to `procs` forked processes (default: the CPUs
    this process may use, at most 8) and return finish(), which waits for them and raises the
    first ChecksumMismatch (naming the tensor). zlib's CRC runs at about 1 GB/s on one core and
    the master starts no thread (fork safety), so the file is split by bytes between children
    that share the mapping, and they run while the master compiles the kernels."""
    from ..model import format as fmt
    n = procs or min(8, len(os.sched_getaffinity(0)))
    records = sorted(cf.record_list, key=lambda r: -r.size)
    if n <= 1 or cf.header["file_size"] < min_bytes:
        cf.verify_checksums()
        return lambda: None
    parts, loads = [[] for _ in range(n)], [0] * n
    for r in records:                                   # largest first onto the least loaded
        i = loads.index(min(loads))
        parts[i].append(r)
        loads[i] += r.size
    children = []
    for part in parts:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            code = 0
            try:
                cf.verify_checksums(records=part)
            except fmt.ChecksumMismatch as e:
                os.write(wfd, msgpack.packb([e.field, str(e)]))
                code = 1
            except BaseException as e:      # noqa: BLE001 - reported to the parent
                os.write(wfd, msgpack.packb(["", f"{e.__class__.__name__}: {e}"]))
                code = 2
            finally:
                os._exit(code)
        os.close(wfd)
        children.append((pid, rfd))
    return lambda: _finish_checksums(cf, children)


def _finish_checksums(cf, children):
    from ..model import format as fmt
    failure = None
    for pid, rfd in children:
        data = b""
        while True:
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            data += chunk
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 and failure is None:
            field, msg = msgpack.unpackb(data) if data else ("", f"checksum process {describe_exit(os.waitstatus_to_exitcode(status))}")
            failure = (field, msg)
    if failure is not None:
        field, msg = failure
        if field:
            raise fmt.ChecksumMismatch(cf.path, field, msg.split(f"{field}: ", 1)[-1])
        raise RuntimeError(f"checksum verification failed: {msg}")
