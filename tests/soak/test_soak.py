"""The long soak: 32 clients for 120 s (COLIBRI_SOAK_SECONDS to change) under chaos.
    python -m pytest -m soak -s tests/soak"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from soak import check, print_report, run_soak  # noqa: E402


@pytest.mark.soak
def test_soak_under_faults(built, tmp_path):
    import hf_models as H

    from colibri_server.model.convert import convert
    H.build_hf_model("mixtral", tmp_path / "hf-b", seed=1)
    b = tmp_path / "b.colibri"
    convert(tmp_path / "hf-b", b, "f32", progress=False)
    r = run_soak(tmp_path, built("mixtral").colibri("f32"), b, float(os.environ.get("COLIBRI_SOAK_SECONDS", 120)))
    print_report(r)
    check(r)
