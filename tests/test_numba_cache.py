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
