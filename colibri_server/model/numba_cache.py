"""Keep Numba's on-disk cache (`cache=True`) in step with the kernel sources.

Numba invalidates a cached function when *its own* source file changes, but the kernels inline
each other across files (kernels/dense.matvec compiles kernels/float_ir's IR into itself;
kernels/decode calls kernels/quant): after an edit of float_ir.py, the cached dense.matvec would
still run the old code. So the whole cache is tied to one digest of every kernel source (the
kernels/ package, and any kernels*.py beside it): when the digest in __pycache__/colibri-kernels.digest
differs from the sources', the cached `.nbi`/`.nbc` files (here and in kernels/__pycache__) are
removed before any is loaded, and Numba compiles afresh (and caches again).

Runs once, at import of colibri_server.model, before any kernel module is imported. A cache
directory that cannot be written (a read-only install) is left alone: Numba then does not cache
either. Owns only the files Numba writes here; never touches NUMBA_CACHE_DIR elsewhere.
"""
from __future__ import annotations

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
