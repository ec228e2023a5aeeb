"""The fused decode token's compiled type depends on the kinds of a model's arrays (kernels/stacks), never on
its shape: models of one family and kind with other layer counts and sizes give one signature, so one compile
(`colibri compile`, precompile.py) serves them all; and every family x kind that precompile lists builds."""
from __future__ import annotations

import dataclasses

import numba
import pytest

from colibri_server.model import Model
from colibri_server.model import precompile as P
from colibri_server.model.config import ModelConfig
from colibri_server.model.decode_step import DecodeStep
from colibri_server.model.synthetic import write_synthetic
from colibri_server.model.transformer import Workspace


def _types(path, threads=1):
    m = Model.open(path, context=32)
    try:
        step = DecodeStep.build(m.config, m.weights, Workspace(m.config, 1, threads=threads))
        assert step is not None, "the fused token declined a model precompile lists"
        return numba.typeof(step.args)
    finally:
        m.close()


def _cfg(family, kind, **change):
    base = P._config(P.Job(family, kind))
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("family, kind", [("mixtral", "f16-panels"), ("deepseek2", "q8"), ("gpt_oss", "q4"),
                                          ("qwen2_moe", "bf16"), ("llama", "f16")])
def test_the_fused_token_has_one_type_for_any_layer_count_and_size(tmp_path, family, kind):
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    write_synthetic(a, _cfg(family, kind))
    dense = (0, 1, 2, 3, 4) if family == "llama" else (0,) if P.FAMILIES[family].get("dense_layers") else ()
    write_synthetic(b, _cfg(family, kind, num_layers=5, vocab_size=768, moe_intermediate_size=768
                            if family != "llama" else 0, dense_layers=dense))
    assert _types(a) == _types(b)
    assert _types(a, threads=2) == _types(b, threads=2)


def test_every_listed_family_and_kind_is_a_valid_config():
    for job in P.jobs():
        for wide in (False, True):
            cfg = P._config(job, wide)
            assert isinstance(cfg, ModelConfig)
            cfg.check()
    assert len(P.jobs()) == len(P.FAMILIES) * len(P.KINDS)


def test_compile_builds_the_converters_default_kinds_unless_told(monkeypatch):
    """`colibri compile` alone: every family in the kinds `colibri convert` writes unless told otherwise (f16 in
    panels, bf16 in rows, q8, q4); `--kind all` adds f16 rows and bf16 panels (the whole set took 40 minutes on 2 shared cores, bf16 panels the longest jobs)."""
    from colibri_server import cli
    from colibri_server.model.convert import default_layout
    assert default_layout("f16", None) == "panels" and default_layout("bf16", None) == "rows"
    assert {"f16-panels", "bf16", "q8", "q4", "blocks"} == set(P.DEFAULT_KINDS)
    seen = {}
    monkeypatch.setattr(P, "compile_jobs", lambda todo, procs, progress: seen.setdefault("todo", todo) and [])
    for args, kinds in ((["compile"], set(P.DEFAULT_KINDS)), (["compile", "--kind", "all"], set(P.KINDS)),
                        (["compile", "--kind", "f16"], {"f16"})):
        seen.clear()
        cli.main(args + ["--cache-dir", ""])          # the suite's cache, as this process has it
        assert {j.kind for j in seen["todo"]} == kinds and {j.family for j in seen["todo"]} == set(P.FAMILIES)


@pytest.mark.parametrize("family, kind", [("mixtral", "f16-panels"),
                                          pytest.param("gpt_oss", "bf16-panels", marks=pytest.mark.slow)])  # ~40 s cold
def test_the_fused_token_on_panels_is_the_general_path_bit_for_bit(tmp_path, family, kind):
    """Experts in panels are 4-D (E, nb, d, P): the fused token takes them from their stacks as forward's general
    path takes them from the weights (the test models of test_parity are too narrow for panels)."""
    import numpy as np

    from colibri_server.model.panels import Panels
    from colibri_server.model.transformer import forward
    path = tmp_path / "m.colibri"
    write_synthetic(path, P._config(P.Job(family, kind)))
    m = Model.open(path, context=16)
    cfg, w, ws = m.config, m.weights, m.workspace
    assert isinstance(ws.decode_step(cfg, w), DecodeStep)
    assert all(isinstance(L.w1, Panels) and L.w1.p.ndim == 4 for L in w.layers)

    def run(trace):
        cache = m.new_cache(capacity=16)
        forward(cfg, w, m.rope, ws, cache, tokens=np.array([1, 5, 9, 13]))
        return np.stack([forward(cfg, w, m.rope, ws, cache, tokens=np.array([t]), trace=trace)[0].copy()
                         for t in (3, 7, 11, 2)])
    fused = run(None)
    trace = []
    general = run(trace)
    assert trace and np.isfinite(fused).all()
    np.testing.assert_array_equal(fused, general)


def _warm_counting(path, layouts):
    from colibri_server.model.numba_cache import Compiles
    m = Model.open(path, context=512)
    try:
        with Compiles() as compiled:
            for layout in layouts:
                P._warm(m, layout, "f16")
        return compiled.count
    finally:
        m.close()


def _blocks_model(tmp_path, name, scheme, **change):
    """A model of llama.cpp's block kinds in `scheme`'s mix, as `colibri convert --quantize SCHEME` writes it."""
    from colibri_server.model.kquants import scheme_kinds
    cfg = dataclasses.replace(P._config(P.Job("mixtral", "f16-panels")), **change)
    path = tmp_path / name
    write_synthetic(path, dataclasses.replace(cfg, block_types=scheme_kinds(cfg, scheme)))
    return path


@pytest.mark.slow          # a block model's kernels compile in 2-6 minutes cold (45 s more after test_blocks*)
@pytest.mark.parametrize("layouts", [("run",), P.LAYOUTS])
def test_a_block_model_of_any_mix_and_shape_needs_no_kernel_the_blocks_job_did_not_compile(tmp_path, layouts):
    """`colibri compile`'s one "blocks" job stands for every GGUF: a matrix's block kind is data to the kernels, so
    after the job (Q4_K_M's mix: q4_k, q6_k) a Q8_0, Q4_0 or Q4_K_M file of another shape compiles nothing more."""
    assert {"q4_k", "q6_k"} <= set(P._config(P.Job("mixtral", "blocks")).block_types.values())
    job, _, _, error = P.run_job(P.Job("mixtral", "blocks", layouts))
    assert not error
    for scheme in ("q8_0", "q4_0", "q4_k_m"):
        other = _blocks_model(tmp_path, f"{scheme}.colibri", scheme, num_layers=4, hidden_size=768, num_heads=12,
                              num_kv_heads=4, moe_intermediate_size=1024, vocab_size=1000)
        assert _warm_counting(other, layouts) == 0, scheme
