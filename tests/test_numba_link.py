"""model/numba_link: a kernel marked by_reference is compiled into its own library only; its callers call its
symbol, from a fresh compile, from the cache, and from the cache after the kernel itself was compiled again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_KERNELS = textwrap.dedent("""
    import numpy as np
    from numba import njit, prange

    import colibri_server.model.kernels  # noqa: F401  (installs the linking)
    from colibri_server.model.numba_link import by_reference


    @by_reference
    @njit(cache=True)
    def big(x, out):
        for i in range(x.shape[0]):
            out[i] = x[i] * np.float32(2.0) + np.float32(1.0)


    @njit(cache=True)
    def copied(x, out):                       # the same, linked by copy as Numba does
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
    import linked_kernels as k

    x = np.arange(8, dtype=np.float32)
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    k.top(x, a)                                   # before big is used from Python: a cached top must load it itself
    k.par(x, b)

    def declared(disp):
        lib = next(iter(disp.overloads.values())).library
        return {f.name for f in lib._final_module.functions if f.is_declaration}

    sym = lambda disp: next(iter(disp.overloads.values())).fndesc.mangled_name
    print(json.dumps({"top": a.tolist(), "par": b.tolist(), "hits": [sum(k.top.stats.cache_hits.values()), sum(k.par.stats.cache_hits.values())],
                      "big_misses": sum(k.big.stats.cache_misses.values()),
                      "mid_calls_big": k.mid.overloads and sym(k.big) in declared(k.mid),
                      "mid_calls_copied": k.mid.overloads and sym(k.copied) in declared(k.mid)}))
""")


def _run(tmp_path):
    env = {**os.environ, "COLIBRI_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_kernel_linked_by_reference_is_called_not_copied_and_its_callers_load_from_the_cache(tmp_path):
    (tmp_path / "linked_kernels.py").write_text(_KERNELS)
    want = [2 * i + 1 for i in range(8)]
    first = _run(tmp_path)                      # compiled here
    assert first["top"] == [want[0] + 1] + want[1:] and first["par"] == want
    assert first["hits"] == [0, 0]
    # (only a library compiled in this process has its module to look at) mid calls big's symbol, declared, its
    # code elsewhere; the kernel linked by copy is in mid's module (or inlined there)
    assert first["mid_calls_big"] and not first["mid_calls_copied"]

    again = _run(tmp_path)                      # a fresh process: top and par load from the cache and load big first
    assert again["top"] == first["top"] and again["par"] == want and again["hits"] == [1, 1]
    assert again["big_misses"] == 0

    big = [f for f in (tmp_path / "cache").rglob("linked_kernels.big-*") if f.suffix in (".nbi", ".nbc")]
    assert big
    for f in big:
        f.unlink()
    rebuilt = _run(tmp_path)                    # big compiled again under another name: the callers still find it
    assert rebuilt["top"] == first["top"] and rebuilt["par"] == want and rebuilt["hits"] == [1, 1]
    assert rebuilt["big_misses"] == 1
