"""The 20-second version of the soak (tests/soak/soak.py) in the default suite."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "soak"))
from soak import check, print_report, run_soak  # noqa: E402


def test_short_soak_under_faults(built, tmp_path):
    import hf_models as H

    from colibri_server.model.convert import convert
    H.build_hf_model("mixtral", tmp_path / "hf-b", seed=1)
    b = tmp_path / "b.colibri"
    convert(tmp_path / "hf-b", b, "f32", progress=False)
    r = run_soak(tmp_path, built("mixtral").colibri("f32"), b, 20.0, reload_every=8.0)
    print_report(r)
    check(r)
    assert r["chaos"]["kill"] >= 5 and r["chaos"]["reload"] >= 2 and r["generation"] >= 3
