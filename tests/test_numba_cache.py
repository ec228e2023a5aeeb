"""numba_cache: the package's cached kernels are dropped when any kernel source changes (Numba alone
would keep kernels.matvec's cached code after an edit of kernels_float.py, which it inlines)."""
from __future__ import annotations

from colibri_server.model import numba_cache


def _tree(tmp_path):
    (tmp_path / "kernels.py").write_text("a = 1\n")
    (tmp_path / "kernels_float.py").write_text("b = 2\n")
    (tmp_path / "other.py").write_text("c = 3\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    return cache


def _cached(cache):
    for name in ("kernels.matvec-353.py311.nbi", "kernels.matvec-353.py311.1.nbc"):
        (cache / name).write_bytes(b"x")
    (cache / "kernels.cpython-311.pyc").write_bytes(b"y")


def test_cache_kept_while_sources_unchanged_and_dropped_after_any_kernel_edit(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    cache = _tree(tmp_path)
    _cached(cache)
    assert numba_cache.refresh(tmp_path)                    # no digest yet: nothing cached can be trusted
    assert not list(cache.glob("*.nb?")) and (cache / "kernels.cpython-311.pyc").exists()
    _cached(cache)
    assert not numba_cache.refresh(tmp_path)                # same sources: the cache stays
    assert len(list(cache.glob("*.nb?"))) == 2
    (tmp_path / "other.py").write_text("c = 4\n")           # not a kernel source
    assert not numba_cache.refresh(tmp_path)
    (tmp_path / "kernels_float.py").write_text("b = 3\n")   # a kernel another one inlines
    assert numba_cache.refresh(tmp_path)
    assert not list(cache.glob("*.nb?"))
    assert (cache / numba_cache.STAMP).read_text().strip() == numba_cache.sources_digest(tmp_path)


def test_a_user_cache_dir_is_left_to_numba(tmp_path, monkeypatch):
    cache = _tree(tmp_path)
    _cached(cache)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert not numba_cache.refresh(tmp_path)
    assert len(list(cache.glob("*.nb?"))) == 2


def test_the_package_digest_matches_its_sources():
    import os

    import pytest
    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("NUMBA_CACHE_DIR is set: Numba's own rules apply")
    stamp = numba_cache.HERE / "__pycache__" / numba_cache.STAMP
    assert stamp.read_text().strip() == numba_cache.sources_digest()   # written at import


def _save_many(cache_dir, who, n, locked, barrier):
    from numba.core import caching
    if locked:
        numba_cache.lock_saves()
    else:       # Numba's own save (importing colibri_server.model installed the lock in this process)
        caching.IndexDataCacheFile.save = getattr(caching.IndexDataCacheFile.save, "__wrapped__",
                                                  caching.IndexDataCacheFile.save)
    f = caching.IndexDataCacheFile(str(cache_dir), "kernel-1", ("stamp", 1))
    barrier.wait()
    for i in range(n):
        f.save((who, i), f"{who}:{i}".encode() * 4096)


def _crossed_entries(tmp_path, locked, procs=4, n=60):
    """Several processes save distinct signatures of one kernel at once; how many keys then load
    another key's data (what made a cached kernel run another signature's code), and how many
    keys the index kept."""
    import multiprocessing as mp
    from numba.core import caching
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    ps = [ctx.Process(target=_save_many, args=(tmp_path, w, n, locked, barrier)) for w in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    f = caching.IndexDataCacheFile(str(tmp_path), "kernel-1", ("stamp", 1))
    index = f._load_index()
    crossed = sum(1 for key in index if f.load(key) != f"{key[0]}:{key[1]}".encode() * 4096)
    return crossed, len(index)


def test_concurrent_saves_never_cross_entries(tmp_path):
    crossed, kept = _crossed_entries(tmp_path, locked=True)
    assert (crossed, kept) == (0, 4 * 60)       # every signature kept, each with its own code
