"""Shared fixtures: tiny random Hugging Face models of every supported architecture,
built once per test run (nothing is downloaded) and converted to .colibri files."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# opt-in: every kernel signature compiled, with the test that compiled it (tests/kernel_sigs.py)
pytest_plugins = ["kernel_sigs"] if os.environ.get("KERNEL_SIGS") else []
# opt-in: each test's seconds and the worker that ran it (tests/worker_times.py)
pytest_plugins += ["worker_times"] if os.environ.get("TEST_TIMES") else []
# the suite's compiled kernels: one cache for both xdist workers and every server a test starts, kept between
# runs of this checkout, apart from the user's own (model/numba_cache keys it by build and CPU inside)
if not os.environ.get("NUMBA_CACHE_DIR"):
    os.environ.setdefault("COLIBRI_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                            ".pytest_cache", "colibri-kernels"))


class _Built:
    """One architecture: its HF directory, the f32 reference model, and converted files."""

    def __init__(self, arch, root):
        import hf_models as H
        self.arch = arch
        self.hf_dir = str(root / f"hf-{arch}")
        self.hf = H.build_hf_model(arch, self.hf_dir)
        self._files = {}
        self.root = root

    def colibri(self, dtype="f32"):
        if dtype not in self._files:
            from colibri_server.model.convert import convert
            path = str(self.root / f"{self.arch}-{dtype}.colibri")
            convert(self.hf_dir, path, dtype, progress=False)
            self._files[dtype] = path
        return self._files[dtype]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """built(arch) -> _Built, cached for the session."""
    cache = {}
    root = tmp_path_factory.mktemp("models")

    def get(arch):
        if arch not in cache:
            cache[arch] = _Built(arch, root)
        return cache[arch]
    return get


@pytest.fixture(scope="session")
def model_b(tmp_path_factory):
    """A second mixtral file with another tokenizer (vocabulary 384, other merges) and other
    weights: a reload between it and built("mixtral").colibri() changes how text tokenizes."""
    import hf_models as H

    from colibri_server.model.convert import convert
    root = tmp_path_factory.mktemp("model-b")
    H.build_hf_model("mixtral", root / "hf", seed=1, vocab_size=384)
    H.train_tokenizer(root / "hf", vocab_size=384)
    path = str(root / "b.colibri")
    convert(root / "hf", path, "f32", progress=False)
    return path
