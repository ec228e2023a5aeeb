"""Where the compiled kernels live: a directory of their own per machine and kernel build, outside
the package, and Numba's saves into it made safe between processes.

Numba caches a `cache=True` kernel's machine code beside its source by default (__pycache__): a
read-only install (a system package, a container image, systemd's ProtectSystem=strict) caches
nothing there, and Numba's staleness check looks at a kernel's own source file only, while the
kernels inline each other across files (kernels/dense.matvec compiles kernels/float_ir's IR into
itself: after an edit of float_ir.py the cached matvec would run the old code). So the kernels go to

    <root>/kernels-<key>

root: the `cache_dir` setting (which the cli passes as COLIBRI_CACHE_DIR), else systemd's
$CACHE_DIRECTORY (the unit's CacheDirectory=colibri: /var/cache/colibri), else $XDG_CACHE_HOME/colibri,
else ~/.cache/colibri. key: a digest of every kernel source, of Numba's, llvmlite's and Python's
versions and of the CPU (its LLVM name and features, as Numba's own NUMBA_CPU_NAME/_FEATURES may set
them): an upgrade, an edit or another machine gets a directory of its own, never a stale kernel, and a
warm directory survives upgrades of anything else. A user's own NUMBA_CACHE_DIR is left to Numba's rules.
A root that cannot be written is said once in the log, and the kernels go to a directory of the same key
under the system's temporary directory instead.

Numba's own save is not safe between processes: it reads the index, picks the first free data
file number, writes the index and the data, with nothing held in between. Two processes compiling
new signatures of one kernel at once (the suite's two xdist workers, `colibri compile`'s pool, two
masters on one machine) pick the same number; the index written last names the other's data file,
and the next load of that signature runs another signature's machine code (a segfault).
`lock_saves()` holds an flock on the index's lock file around each save, so the second save reads
the first one's index and picks another number.

Nor does Numba keep a second process from compiling what a first one is compiling: both find the
cache empty, both compile (seconds to minutes of a core each), both save. `lock_compiles()` makes a
cache miss take a lock per kernel and signature (lockf on a `.compiling` file beside the kernel's index)
before it compiles: the process that gets it first compiles and saves; one that waited then finds the
signature in the cache and loads it. The suite's two xdist workers and the servers its tests start,
`colibri compile`'s pool and a first `colibri run` beside its helper process each compile a kernel once.

`configure()` runs once, at import of colibri_server.model.kernels, before any kernel module is imported
(a kernel's cache location is fixed when it is decorated). Owns only the directories it names.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ENV = "COLIBRI_CACHE_DIR"

log = logging.getLogger("colibri.kernels")


def sources_digest(folder: pathlib.Path = HERE) -> str:
    """sha256 over the names and bytes of the kernel sources (kernels*.py and kernels/*.py), of numba_link.py
    (how they link: a cached caller of a kernel linked by reference holds no copy of it) and of numba_wrappers.py
    (how their entry points compile)."""
    h = hashlib.sha256()
    sources = (sorted(folder.glob("kernels*.py")) + sorted(folder.glob("kernels/*.py"))
               + sorted(folder.glob("numba_link.py")) + sorted(folder.glob("numba_wrappers.py")))
    for f in sources:
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu() -> str:
    try:
        import llvmlite.binding as llvm
        name, feats = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    except Exception:           # pragma: no cover - no query: the versions and sources still key it
        name, feats = "unknown", ""
    return "|".join((os.environ.get("NUMBA_CPU_NAME", name), os.environ.get("NUMBA_CPU_FEATURES", feats)))


def build_key(folder: pathlib.Path = HERE) -> str:
    """The kernel build's key: sources, Numba, llvmlite, Python and the CPU (16 hex digits)."""
    import llvmlite
    import numba
    h = hashlib.sha256("\0".join((sources_digest(folder), numba.__version__, llvmlite.__version__,
                                  platform.python_version(), platform.machine(), _cpu())).encode())
    return h.hexdigest()[:16]


def cache_root(env=None) -> str:
    """The directory kernel builds are cached under (see the module's doc for the order)."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]
    if env.get("CACHE_DIRECTORY"):                  # systemd's CacheDirectory=, the first of a ':' list
        return env["CACHE_DIRECTORY"].split(":")[0]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "colibri")


def kernel_dir(env=None) -> str:
    """This machine's and build's kernel directory: a user's NUMBA_CACHE_DIR, else <root>/kernels-<key>."""
    env = os.environ if env is None else env
    if env.get("NUMBA_CACHE_DIR"):
        return env["NUMBA_CACHE_DIR"]
    return os.path.join(cache_root(env), f"kernels-{build_key()}")


def configure() -> str | None:
    """Point Numba's cache at kernel_dir() (created if missing) before the kernels are imported, and
    export it (NUMBA_CACHE_DIR) to the processes this one starts. Returns the directory, or None when no
    directory could be made (Numba's own default locations then apply)."""
    from numba.core import config
    if os.environ.get("NUMBA_CACHE_DIR"):           # the user's own (or a parent's export): Numba's rules
        return os.environ["NUMBA_CACHE_DIR"]
    d = kernel_dir()
    try:
        os.makedirs(d, exist_ok=True)
        probe = os.path.join(d, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        import tempfile
        fallback = os.path.join(tempfile.gettempdir(), f"colibri-{os.getuid()}", os.path.basename(d))
        log.warning("kernel cache %s cannot be written (%s): caching in %s instead; set cache_dir "
                    "(COLIBRI_CACHE_DIR) to a writable directory", d, e.strerror or e, fallback)
        try:
            os.makedirs(fallback, mode=0o700, exist_ok=True)
        except OSError:
            return None
        d = fallback
    config.CACHE_DIR = d
    os.environ["NUMBA_CACHE_DIR"] = d
    return d


def lock_saves() -> bool:
    """Make Numba's cache saves exclusive between processes (see the module's doc). Returns False
    when this Numba has no IndexDataCacheFile.save to wrap (its cache then works as it does)."""
    try:
        from numba.core import caching
        cls = caching.IndexDataCacheFile
        save = cls.save
    except (ImportError, AttributeError):
        return False
    if getattr(save, "_colibri_locked", False):
        return True

    @functools.wraps(save)
    def locked_save(self, key, data):
        with _file_lock(str(self._index_path) + ".lock"):
            return save(self, key, data)
    locked_save._colibri_locked = True
    cls.save = locked_save
    return True


COMPILE_WAIT = 1800.0       # seconds a compile waits for another process's compile of the same, then compiles itself
_held = set()               # the compile locks this process holds (a kernel compiling itself again, recursively)


def lock_compiles() -> bool:
    """Make a compile of a cached kernel's signature exclusive between processes (see the module's doc):
    a process that waited loads what the other compiled. Returns False when this Numba has no
    Dispatcher.compile of the expected form to wrap (its compiles then run as they do)."""
    try:
        from numba.core import caching, dispatcher, sigutils
        from numba.core.compiler_lock import global_compiler_lock
        cls = dispatcher.Dispatcher
        compile_ = cls.compile
    except (ImportError, AttributeError):
        return False
    if getattr(compile_, "_colibri_locked", False):
        return True

    @functools.wraps(compile_)
    def locked_compile(self, sig):
        cache_file = getattr(getattr(self, "_cache", None), "_cache_file", None)
        if not isinstance(cache_file, caching.IndexDataCacheFile) or not self._can_compile:
            return compile_(self, sig)
        # under Numba's own (reentrant) compiler lock, as the compile itself: a thread never holds the file
        # lock while it waits for a thread of its own process that waits for the file lock
        with global_compiler_lock:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in self.overloads:
                return compile_(self, sig)
            path = "%s.%s.compiling" % (cache_file._index_path, hashlib.sha256(repr(args).encode()).hexdigest()[:16])
            if path in _held:
                return compile_(self, sig)
            _held.add(path)
            try:
                with _file_lock(path, COMPILE_WAIT, fcntl.lockf):
                    return compile_(self, sig)      # Numba's own: loads the signature if it is cached by now
            finally:
                _held.discard(path)
    locked_compile._colibri_locked = True
    cls.compile = locked_compile
    return True


@contextlib.contextmanager
def _file_lock(path, wait=None, lock=fcntl.flock):
    """An exclusive lock on `path` while in the block: waited for as long as it takes, or `wait` seconds at
    most (then the block runs without it, said in the log). `lock`: flock, or lockf (a POSIX lock: not
    inherited by a process forked inside the block, as a server's workers are, which would hold it on)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:                 # an unwritable cache: Numba does not save there either
        yield
        return
    try:
        if wait is None:
            lock(fd, fcntl.LOCK_EX)
        else:
            deadline, pause = time.monotonic() + wait, 0.005
            while True:
                try:
                    lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except (BlockingIOError, PermissionError):     # flock's EWOULDBLOCK; lockf's EAGAIN or EACCES
                    if time.monotonic() > deadline:
                        log.warning("%s: held by another process for %.0fs: going on without it", path, wait)
                        break
                    time.sleep(pause)
                    pause = min(pause * 2, 0.1)
        yield
    finally:
        os.close(fd)


class Compiles:
    """Counts the kernels Numba compiles in this process while entered (any thread; a kernel's own inner
    compiles not counted), for the logs: how many, the last one's name, and `report(self)` every `every`
    seconds while compiling goes on (a first start's progress); `first()` once when the first one starts
    (the cache did not have everything)."""

    def __init__(self, report=None, every: float = 10.0, first=None):
        self.count, self.last, self.report, self.every, self.first = 0, "", report, every, first
        self._depth = threading.local()
        self._next = time.monotonic() + every
        self._listener = None

    def __enter__(self):
        from numba.core import event
        outer = self

        class _Listener(event.Listener):
            def on_start(self, ev):
                outer._depth.n = getattr(outer._depth, "n", 0) + 1
                if outer.first is not None:           # the first compile: `first()` once, before it runs
                    first, outer.first = outer.first, None
                    first()

            def on_end(self, ev):
                outer._depth.n -= 1
                if outer._depth.n == 0:
                    outer._ended(ev.data["dispatcher"].py_func.__name__)
        self._listener = _Listener()
        event.register("numba:compile", self._listener)
        return self

    def _ended(self, name):
        self.count += 1
        self.last = name
        now = time.monotonic()
        if self.report is not None and now >= self._next:
            self._next = now + self.every
            self.report(self)

    def __exit__(self, *exc):
        from numba.core import event
        event.unregister("numba:compile", self._listener)
        return False
