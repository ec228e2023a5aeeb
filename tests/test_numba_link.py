"""model/numba_link: a kernel marked by_reference is compiled into its own library only; its callers call its
symbol, from a fresh compile, from the cache, after the kernel was compiled again under another name, when a
caller is compiled against a cached one, and when the kernel's file changed under a cached caller."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# the kernel in a file of its own, as blocks_gemm's beside decode's callers: Numba judges each file's entries apart
_KERNEL = textwrap.dedent("""
    import numpy as np
    from numba import njit

    import colibri_server.model.kernels  # noqa: F401  (installs the linking)
    from colibri_server.model.numba_link import by_reference


    @by_reference
    @njit(cache=True)
    def big(x, out):
        for i in range(x.shape[0]):
            out[i] = x[i] * np.float32(2.0) + np.float32(1.0)
        RETURN
""")

_CALLERS = textwrap.dedent("""
    import numpy as np
    from numba import njit, prange

    from ref_kernel import big


    @njit(cache=True)
    def copied(x, out):                       # as big, linked by copy as Numba does
        for i in range(x.shape[0]):
            out[i] = x[i] * np.float32(2.0) + np.float32(1.0)


    @njit(cache=True)
    def mid(x, out):
        big(x, out)
        copied(x, out[::-1].copy())


    @njit(cache=True)
    def top(x, out):                          # big reached through mid's library only
        mid(x, out)
        out[0] += np.float32(1.0)


    @njit(cache=True, parallel=True)
    def par(x, out):                          # from a parallel region's own library
        n = x.shape[0] // 2
        for p in prange(2):
            big(x[p * n:(p + 1) * n], out[p * n:(p + 1) * n])
""")

_RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import ref_callers as k
    import ref_kernel

    x = np.arange(8, dtype=np.float32)
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    k.top(x, a)                                   # before big is used from Python: a cached top must load it itself
    k.par(x, b)

    one = lambda disp: next(iter(disp.overloads.values()))
    n = lambda counter: sum(counter.values())
    print(json.dumps({
        "top": a.tolist(), "par": b.tolist(), "hits": [n(k.top.stats.cache_hits), n(k.par.stats.cache_hits)],
        "big_misses": n(ref_kernel.big.stats.cache_misses), "big": one(ref_kernel.big).fndesc.mangled_name,
        # the symbols top's entry loads big under (from the cache: the names it was compiled against)
        "top_wants": sorted(f.symbol for f in one(k.top).reload_init if hasattr(f, "symbol")),
        # (only a library compiled in this process has its module to look at)
        "mid_declares": sorted(f.name for f in one(k.mid).library._final_module.functions if f.is_declaration)
                        if k.mid.overloads else None,
        "copied": one(k.copied).fndesc.mangled_name if k.copied.overloads else None}))
""")


def _run(tmp_path):
    env = {**os.environ, "COLIBRI_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _forget(tmp_path, name):
    entries = [f for f in (tmp_path / "cache").rglob(f"{name}-*") if f.suffix in (".nbi", ".nbc")]
    assert entries, name
    for f in entries:
        f.unlink()


def test_a_kernel_linked_by_reference_is_called_not_copied_and_its_callers_load_from_the_cache(tmp_path):
    (tmp_path / "ref_kernel.py").write_text(_KERNEL.replace("RETURN", ""))
    (tmp_path / "ref_callers.py").write_text(_CALLERS)
    want = [2 * i + 1 for i in range(8)]
    top = [want[0] + 1] + want[1:]
    first = _run(tmp_path)                      # compiled here
    assert first["top"] == top and first["par"] == want and first["hits"] == [0, 0]
    # mid calls big's symbol, declared, its code elsewhere; the kernel linked by copy is in mid's module (or inlined)
    assert first["big"] in first["mid_declares"] and first["copied"] not in first["mid_declares"]

    again = _run(tmp_path)                      # a fresh process: top and par load from the cache and load big first
    assert again["top"] == top and again["par"] == want and again["hits"] == [1, 1] and again["big_misses"] == 0

    _forget(tmp_path, "ref_kernel.big")
    rebuilt = _run(tmp_path)                    # big compiled again under another name: the callers still find it
    assert rebuilt["top"] == top and rebuilt["par"] == want and rebuilt["hits"] == [1, 1]
    assert rebuilt["big_misses"] == 1 and rebuilt["top_wants"] and rebuilt["big"] not in rebuilt["top_wants"]

    _forget(tmp_path, "ref_callers.top")
    _run(tmp_path)                              # top compiled against mid from the cache (no reload_init of its own)
    later = _run(tmp_path)                      # and loaded in a fresh process: it still loads big first
    assert later["top"] == top and later["hits"] == [1, 1]

    # big's file changes under the cached callers (their own file did not: Numba keeps their entries): big now
    # returns a value, another ABI; the callers' entries are cache misses, compiled again, not run against it
    (tmp_path / "ref_kernel.py").write_text(_KERNEL.replace("RETURN", "return np.float32(out[0])"))
    changed = _run(tmp_path)
    assert changed["top"] == top and changed["par"] == want and changed["hits"] == [0, 0]
    assert _run(tmp_path)["hits"] == [1, 1]
