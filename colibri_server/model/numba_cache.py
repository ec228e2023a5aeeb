"""Keep Numba's on-disk cache (`cache=True`) in step with the kernel sources.

Numba invalidates a cached function when *its own* source file changes, but the kernels inline
each other across files (kernels/dense.matvec compiles kernels/float_ir's IR into itself;
kernels/decode calls kernels/quant): after an edit of float_ir.py, the cached dense.matvec would
still run the old code. So the whole cache is tied to one digest of every kernel source (the
kernels/ package, and any kernels*.py beside it): when the digest in __pycache__/colibri-kernels.digest
differs from the sources', the cached `.nbi`/`.nbc` files (here and in kernels/__pycache__) are
removed before any is loaded, and Numba compiles afresh (and caches again).

Numba's own save is not safe between processes: it reads the index, picks the first free data
file number, writes the index and the data, with nothing held in between. Two processes compiling
new signatures of one kernel at once (the suite's two xdist workers, two worker hosts' masters on
one machine) pick the same number; the index written last names the other's data file, and the
next load of that signature runs another signature's machine code (a segfault, seen in session
12). `lock_saves()` holds an flock on the index's lock file around each save, so the second save
reads the first one's index and picks another number.

Runs once, at import of colibri_server.model, before any kernel module is imported. A cache
directory that cannot be written (a read-only install) is left alone: Numba then does not cache
either. Owns only the files Numba writes here; never touches NUMBA_CACHE_DIR elsewhere.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
STAMP = "colibri-kernels.digest"


def sources_digest(folder: pathlib.Path = HERE) -> str:
    """sha256 over the names and bytes of the kernel sources (kernels*.py and kernels/*.py)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("kernels*.py")) + sorted(folder.glob("kernels/*.py")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def refresh(folder: pathlib.Path = HERE) -> bool:
    """Drop the cached kernels of `folder` when its sources changed since they were cached.
    Returns True when cache files were removed."""
    if os.environ.get("NUMBA_CACHE_DIR"):          # the user's own cache location: Numba's rules
        return False
    cache = folder / "__pycache__"
    digest = sources_digest(folder)
    stamp = cache / STAMP
    try:
        if stamp.read_text().strip() == digest:
            return False
    except OSError:
        pass
    removed = False
    try:
        for f in [*cache.glob("*.nb[ic]"), *(folder / "kernels" / "__pycache__").glob("*.nb[ic]")]:
            try:
                f.unlink()
                removed = True
            except FileNotFoundError:              # another process got there first
                pass
        cache.mkdir(exist_ok=True)
        tmp = cache / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest + "\n")
        os.replace(tmp, stamp)
    except OSError:                                 # read-only install: Numba will not cache either
        return removed
    return removed


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
        with _flock(str(self._index_path) + ".lock"):
            return save(self, key, data)
    locked_save._colibri_locked = True
    cls.save = locked_save
    return True


@contextlib.contextmanager
def _flock(path):
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:                 # an unwritable cache: Numba does not save there either
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
