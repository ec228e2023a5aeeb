"""The forward pass against Hugging Face transformers on the same weights.

Every architecture, seeded random weights (tests/hf_models.py), nothing downloaded:
- f32 file: logits at every position within 1e-4 max abs of transformers', and greedy
  generation of 32 tokens through the KV cache equal token for token.
- f16 / bf16 kernels are exact: a checkpoint saved in f16 (bf16) and converted to an
  f16 (bf16) file, a bit copy, matches transformers running those same values in f32
  within 2e-4 max abs.
- f16 / bf16 files rounded from the f32 weights stay within a stated tolerance of the f32
  reference. Rounding the weights, not the kernels, makes the difference, and on these
  random models it is amplified where rounding flips a top-k routing choice. Measured max
  |diff| / max |logit|: f16 0.08-0.8%, bf16 0.7-15%; argmax agreement >= 95%.
"""
from __future__ import annotations

import dataclasses
import os

import hf_models as H
import numpy as np
import pytest
import torch

from colibri_server.model import Model

ARCHS = H.ARCHS
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]
REL_TOL = {"f16": 0.02, "bf16": 0.25}      # max |diff| / max |logit| against the f32 reference
MEAN_TOL = {"f16": 0.01, "bf16": 0.15}     # mean |diff| (logits are O(10))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(built, arch):
    b = built(arch)
    ref = H.hf_logits(b.hf, PROMPT)
    got = Model.open(b.colibri("f32")).logits(PROMPT)
    assert got.shape == ref.shape == (len(PROMPT), 512)
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_greedy_generation_matches_transformers(built, arch):
    b = built(arch)
    prompt = PROMPT[:8]
    want = H.hf_greedy(b.hf, prompt, 32)
    got = Model.open(b.colibri("f32")).generate(prompt, max_tokens=32, temperature=0.0, ignore_eos=True)
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_files_within_tolerance(built, arch, dtype):
    b = built(arch)
    ref = H.hf_logits(b.hf, PROMPT)
    got = Model.open(b.colibri(dtype)).logits(PROMPT)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < REL_TOL[dtype], f"{arch} {dtype}: relative error {rel:.4g}"
    assert np.abs(got - ref).mean() < MEAN_TOL[dtype]
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


@pytest.mark.parametrize("arch,src,dtype", [("mixtral", "bf16", "bf16"), ("qwen3_moe", "bf16", "bf16"),
                                             ("qwen2_moe", "f16", "f16"), ("olmoe", "f16", "f16"),
                                             ("qwen2_moe", "bf16", "f32")])
def test_half_precision_kernels_are_exact(tmp_path, arch, src, dtype):
    from transformers import AutoModelForCausalLM

    from colibri_server.model.convert import convert
    d = tmp_path / "hf"
    H.build_hf_model(arch, d, dtype={"bf16": torch.bfloat16, "f16": torch.float16}[src])
    # the reference runs the checkpoint's half-precision values in f32
    ref_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = H.hf_logits(ref_model, PROMPT)
    if True:
        out = tmp_path / f"m-{dtype}.colibri"
        convert(d, out, dtype, progress=False)
        got = Model.open(out).logits(PROMPT)
        assert np.abs(got - ref).max() < 2e-4, dtype


def test_prefill_in_chunks_equals_one_pass(built):
    """Chunked prefill (workspace smaller than the prompt) changes nothing."""
    path = built("qwen2_moe").colibri("f32")
    whole = Model.open(path).logits(PROMPT)
    chunked = Model.open(path, prefill_chunk=7).logits(PROMPT)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)


def test_decode_path_equals_prefill_logits(built):
    """Token-by-token decode through the KV cache gives the prefill's logits at each position."""
    m = Model.open(built("mixtral").colibri("f32"))
    full = m.logits(PROMPT[:12])
    cache = m.new_cache()
    rows = [m.prefill(cache, np.array(PROMPT[:1]))[0].copy()]
    for t in PROMPT[1:12]:
        rows.append(m.decode(cache, t)[0].copy())
    np.testing.assert_allclose(np.stack(rows), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch,dtype", [("qwen2_moe", "f16"), ("qwen3_moe", "bf16"), ("olmoe", "f32")])
def test_fused_qkv_decode_equals_separate_projections(built, arch, dtype):
    """Decode streams q|k|v as one matrix when the file stores them back to back (the converter
    writes them so): the logits of three separate projections, bit for bit for half precision
    (the same kernel per row); f32 goes through BLAS, whose blocking depends on the shape."""
    m = Model.open(built(arch).colibri(dtype))
    fused_layers = m.weights.layers
    assert all(L.wqkv is not None and L.wqkv.shape[0] == L.wq.shape[0] + 2 * L.wk.shape[0]
               for L in fused_layers)

    def run(layers):
        object.__setattr__(m.weights, "layers", layers)
        cache = m.new_cache()
        m.prefill(cache, np.array(PROMPT[:5]))
        return np.stack([m.decode(cache, t)[0].copy() for t in PROMPT[5:12]])

    fused = run(fused_layers)
    separate = run(tuple(dataclasses.replace(L, wqkv=None) for L in fused_layers))
    if dtype == "f32":
        np.testing.assert_allclose(fused, separate, rtol=0, atol=1e-5)
    else:
        np.testing.assert_array_equal(fused, separate)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_bf16_opt_in_is_no_worse_than_transformers_bf16(built, arch):
    """prefill_bf16 (bf16 activations in the prefill GEMMs of a bf16 file) is in effect, its error
    against the f32 model is no worse than transformers' own bf16 run of the same weights (the
    arithmetic it matches), and decode keeps f32 activations."""
    import copy

    from colibri_server.model.kernels import gemm as GE
    if not GE.HAVE_BF16_GEMM:
        pytest.skip("CPU without avx512bf16")
    b = built(arch)
    ref = H.hf_logits(b.hf, PROMPT)
    hf_bf16 = H.hf_logits(copy.deepcopy(b.hf).to(torch.bfloat16), PROMPT).astype(np.float32)
    plain = Model.open(b.colibri("bf16")).logits(PROMPT)
    m = Model.open(b.colibri("bf16"), prefill_bf16=True)
    got = m.logits(PROMPT)
    assert not np.array_equal(got, plain)                  # the bf16 GEMM ran

    def err(a):
        return np.abs(a - ref).max() / np.abs(ref).max(), np.abs(a - ref).mean(), (a.argmax(1) == ref.argmax(1)).mean()
    (mx, mean, agree), (hmx, hmean, hagree) = err(got), err(hf_bf16)
    assert mx <= 1.1 * hmx and mean <= 1.1 * hmean and agree >= hagree - 0.05, (err(got), err(hf_bf16))
    cache = m.new_cache()
    m.prefill(cache, np.array(PROMPT[:1]))                 # one token: decode kernels, f32 activations
    np.testing.assert_allclose(m.decode(cache, PROMPT[1])[0], Model.open(b.colibri("bf16")).logits(PROMPT[:2])[1],
                               rtol=0, atol=1e-4)                  # f32 activations (bf16 moves it ~1e-2)
    assert Model.open(b.colibri("f16")).set_prefill_bf16(True) is False      # no bf16 matrices


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the process may run on one CPU: Numba starts one thread")
@pytest.mark.parametrize("arch,dtype", [("mixtral", "f16"), ("qwen2_moe", "bf16")])
def test_float_prefill_on_two_threads_keeps_the_bits(built, arch, dtype, monkeypatch):
    """threads_per_worker = 2: prefill's f16/bf16 tiles are converted and multiplied on two
    threads (kernels.matmul_par), each tile as on one thread: the same logits, bit for bit."""
    from colibri_server.model.transformer import Workspace
    monkeypatch.setattr(Workspace, "ROWGEMM_MAX_ROWS", 48)      # the tile path from 49 rows (the model's
    path = built(arch).colibri(dtype)                            # context is below the default, 256)
    one, two = Model.open(path), Model.open(path)
    two.set_threads(2)
    prompt = PROMPT * 2                  # more rows than Workspace.ROWGEMM_MAX_ROWS: the tile path
    np.testing.assert_array_equal(two.logits(prompt), one.logits(prompt))
    assert two.workspace._pool is not None                  # the second thread took part


def test_prefill_bf16_on_threads_is_compiled_before_fork_and_keeps_the_bits(built):
    """compile_threaded (the master, before fork) compiles the threaded bf16 GEMM for the file's
    bf16 matrices; on 2 threads the rows split and every row is computed as on one."""
    from colibri_server.model.kernels import gemm as GE
    if not GE.HAVE_BF16_GEMM:
        pytest.skip("CPU without avx512bf16")
    path = built("mixtral").colibri("bf16")
    one = Model.open(path, prefill_bf16=True)
    two = Model.open(path, prefill_bf16=True)
    import numba
    two.compile_threaded()
    W = two.weights.layers[0].wq                      # the types a 2-thread prefill will call with
    D = W.shape[1]
    want = tuple(numba.typeof(a) for a in (W, np.zeros((4, D), np.int16), 2, np.zeros((2, W.shape[0]), np.float32), 2))
    assert want in [tuple(sig) for sig in GE._bf16_rows_par.signatures]
    two.set_threads(2)
    np.testing.assert_array_equal(two.logits(PROMPT), one.logits(PROMPT))


@pytest.mark.parametrize("arch,dtype", [("mixtral", "f16"), ("qwen2_moe", "bf16"), ("qwen3_moe", "f32")])
def test_fused_decode_moe_is_the_general_path_bit_for_bit(built, arch, dtype):
    """Decode runs router, top-k and experts in one Numba call (kernels_decode.moe_float/_quant);
    a routing trace sends moe() down the general path. Same kernels, same order: same bits,
    and the same experts chosen. (The quantized files: test_quant.py, beside their compiles.)"""
    fused_decode_is_the_general_path(Model.open(built(arch).colibri(dtype)))


def fused_decode_is_the_general_path(m):
    """Six decode tokens of m after a 6-token prefill, fused and through a routing trace's general path: the same
    bits and the same experts."""
    from colibri_server.model.transformer import forward
    cfg, w, ws = m.config, m.weights, m.workspace

    def run(trace):
        cache = m.new_cache()
        forward(cfg, w, m.rope, ws, cache, tokens=np.array(PROMPT[:6]))
        rows, routes = [], []
        for t in PROMPT[6:12]:
            rows.append(forward(cfg, w, m.rope, ws, cache, tokens=np.array([t]), trace=trace)[0].copy())
            routes.append(_token_routes(ws, cfg, w, trace))
        return np.stack(rows), routes

    fused, fused_routes = run(None)
    trace = []
    general, general_routes = run(trace)
    assert trace and len(trace) == 6 * sum(L.gate is not None for L in w.layers)   # the general path ran
    np.testing.assert_array_equal(fused, general)
    for a, b in zip(fused_routes, general_routes):
        np.testing.assert_array_equal(a[-len(b):], b[-len(a):])     # the layers both paths keep


def test_sliding_window_matches_transformers(tmp_path):
    """Mixtral with a sliding window shorter than the prompt."""
    from colibri_server.model.convert import convert
    hf = H.build_hf_model("mixtral", tmp_path / "hf", sliding_window=8)
    convert(tmp_path / "hf", tmp_path / "m.colibri", "f32", progress=False)
    m = Model.open(tmp_path / "m.colibri")
    assert m.config.sliding_window == 8
    ref = H.hf_logits(hf, PROMPT[:24])
    assert np.abs(m.logits(PROMPT[:24]) - ref).max() < 1e-4
    assert m.generate(PROMPT[:16], max_tokens=16, ignore_eos=True) == H.hf_greedy(hf, PROMPT[:16], 16)


def test_tied_embeddings_mixtral(tmp_path):
    from colibri_server.model.convert import convert
    hf = H.build_hf_model("mixtral", tmp_path / "hf", tie_word_embeddings=True)
    convert(tmp_path / "hf", tmp_path / "m.colibri", "f32", progress=False)
    m = Model.open(tmp_path / "m.colibri")
    assert "output" not in m.file
    assert np.abs(m.logits(PROMPT[:16]) - H.hf_logits(hf, PROMPT[:16])).max() < 1e-4


# qwen2_moe / qwen3_moe / glm4_moe: the test configs' dense layers among MoE ones; glm4_moe: version-2 routing;
# phimoe: LayerNorms with biases, the head's bias, sparsemixer; deepseek_v2/v3: latent attention (v2 without a
# query rank, v3 with one), a dense first layer; gpt_oss: sinks, sliding and full layers, q|k|v|o biases, the
# router's bias, biased experts with the clamped SwiGLU. No entry is a repeat: each is here for the piece it names,
# and the q|k|v-attention MoE families of one weight type share one compiled token
# (test_families_that_lack_a_weight_share_one_compiled_fused_token), so such an entry costs its run, not a compile
STEP_COVERED = [("mixtral", "f16"), ("mixtral", "bf16"), ("qwen3_moe", "f16"), ("olmoe", "bf16"),
                ("mixtral", "q8"), ("olmoe", "q4"), ("qwen2_moe", "f16"), ("qwen2_moe", "q8"), ("glm4_moe", "f16"),
                ("phimoe", "f16"), ("deepseek_v2", "f16"), ("deepseek_v3", "bf16"), ("deepseek_v3", "q8"),
                ("gpt_oss", "f16"), ("gpt_oss", "q4"),
                ("llama", "f16"), ("qwen2", "bf16"), ("qwen3", "f16"), ("llama", "q8")]   # dense: every layer an MLP


def _token_routes(ws, cfg, w, trace):
    """The experts the last decode token chose: every MoE layer's (n_moe,A) from a routing trace or the fused
    token (DecodeStep.routes); else the last layer's (1,A), what the one-call MoE leaves in route_idx."""
    n = sum(L.gate is not None for L in w.layers)
    if trace:
        return np.concatenate([idx[:1] for idx, _ in trace[-n:]])
    step = ws.decode_step(cfg, w)
    return step.routes.copy() if step is not None else ws.route_idx[:1].copy()


@pytest.mark.parametrize("arch,dtype", STEP_COVERED)
def test_decode_step_is_the_general_path_bit_for_bit(built, tmp_path, arch, dtype):
    """A decode token of these models is one Numba call (decode_step.DecodeStep: Qwen3's per-head
    and OLMoE's whole-projection q/k norms and clip, dense layers among routed ones, GLM's version-2
    routing, panels, rows, quantized pairs); a routing trace keeps forward on its general path. Same
    kernels, same order: same bits, same experts."""
    from colibri_server.model.convert import convert
    from colibri_server.model.decode_step import DecodeStep
    from colibri_server.model.transformer import forward
    hf_dir = built(arch).hf_dir
    path = str(tmp_path / f"{dtype}.colibri")
    quant = dict(quantize=dtype, quant_group=32) if dtype in ("q8", "q4") else {}
    convert(hf_dir, path, "f16" if quant else dtype, progress=False, **quant)
    m = Model.open(path)
    cfg, w, ws = m.config, m.weights, m.workspace
    assert isinstance(ws.decode_step(cfg, w), DecodeStep)

    def run(trace):
        cache = m.new_cache(capacity=12)
        forward(cfg, w, m.rope, ws, cache, tokens=np.array(PROMPT[:6]))
        rows, routes = [], []
        for t in PROMPT[6:12]:
            rows.append(forward(cfg, w, m.rope, ws, cache, tokens=np.array([t]), trace=trace)[0].copy())
            if cfg.num_experts:
                routes.append(_token_routes(ws, cfg, w, trace))
        assert cache.length == 12
        with pytest.raises(ValueError, match="exceeds the context of 12"):
            forward(cfg, w, m.rope, ws, cache, tokens=np.array([PROMPT[0]]), trace=trace)
        assert cache.length == 12
        return np.stack(rows), routes

    fused, fused_routes = run(None)
    trace = []
    if not cfg.num_experts:                        # no router to trace: the general path is forward's own
        from unittest import mock
        with mock.patch.object(type(ws), "decode_step", lambda *a: None):
            general, general_routes = run(None)
    else:
        general, general_routes = run(trace)
        assert trace                                               # the general path ran
    np.testing.assert_array_equal(fused, general)
    if cfg.num_experts:
        n_moe = sum(L.gate is not None for L in w.layers)
        assert fused_routes[0].shape == (n_moe, cfg.top_k)            # every MoE layer's experts, both paths
        for a, b in zip(fused_routes, general_routes):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(IndexError, match="token id out of range"):
        m.decode(m.new_cache(), cfg.vocab_size)


@pytest.mark.parametrize("arch,dtype", [("mixtral", "f16"), ("olmoe", "q8"), ("qwen2_moe", "f16"), ("glm4_moe", "f16"),
                                        ("deepseek_v3", "f16"),
                                        pytest.param("gpt_oss", "q8", marks=pytest.mark.slow),   # 38 s cold
                                        pytest.param("mixtral", "q4", marks=pytest.mark.slow)])   # 63 s cold
def test_decode_step_on_two_threads_is_the_one_thread_token_bit_for_bit(built, tmp_path, arch, dtype):
    """threads_per_worker 2: the fused token splits every matrix's rows (q|k|v in one region, wo,
    the experts, the head) over Numba threads inside its one call. Each row is computed as on one
    thread, so the logits are the one-thread token's bit for bit, and the general path's on threads
    (a routing trace) too. q4 files keep k and v in q8: q|k|v mixes the two there. glm4_moe: a dense
    layer among routed ones and version-2 routing on threads; deepseek_v3: latent attention's per-head products on
    threads; gpt_oss: its biased experts, one matrix at a time split over the threads as forward's ws.mm does."""
    from colibri_server.model.convert import convert
    from colibri_server.model.decode_step import DecodeStep
    from colibri_server.model.transformer import forward
    path = built(arch).colibri(dtype) if dtype == "f16" else str(tmp_path / f"{dtype}.colibri")
    if arch == "qwen2_moe":                        # its shared expert and biases; no dense layer (not covered)
        path = str(tmp_path / "f16.colibri")
        H.build_hf_model(arch, tmp_path / "hf", mlp_only_layers=[], decoder_sparse_step=1)
        convert(str(tmp_path / "hf"), path, "f16", progress=False)
    elif dtype != "f16":
        convert(built(arch).hf_dir, path, "f16", progress=False, quantize=dtype, quant_group=32)
    one, two = Model.open(path), Model.open(path)
    two.compile_threaded()
    two.set_threads(2)
    assert isinstance(two.workspace.decode_step(two.config, two.weights), DecodeStep)

    def run(m, trace=None):
        cache = m.new_cache(capacity=12)
        forward(m.config, m.weights, m.rope, m.workspace, cache, tokens=np.array(PROMPT[:6]))
        return np.stack([forward(m.config, m.weights, m.rope, m.workspace, cache, tokens=np.array([t]),
                                 trace=trace)[0].copy() for t in PROMPT[6:12]])

    fused = run(one)
    np.testing.assert_array_equal(run(two), fused)
    trace = []
    np.testing.assert_array_equal(run(two, trace), fused)
    assert trace                                                   # the general path ran


def test_families_that_lack_a_weight_share_one_compiled_fused_token(built):
    """An absent weight (q/k norm, q|k|v bias, LayerNorm or head bias, shared expert's gate, routing rule and
    correction bias, sinks) is a read-only empty array, as a present one is a read-only view of the mapped file: the
    fused token's argument types then do not say which family it is, and one compiled decode_token per weight type
    and thread count serves Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5 and Phi-MoE (a writable placeholder made
    each its own signature: 10-45 s of compile apiece). The kernel tells them apart by the arrays' sizes and flags
    at run time; test_decode_step_is_the_general_path_bit_for_bit runs each one."""
    from colibri_server.model.decode_step import DecodeStep
    from colibri_server.model.transformer import Workspace
    for threads in (1, 2):
        sigs = {}
        for arch in ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "phimoe"):
            m = Model.open(built(arch).colibri("f16"))
            ws = Workspace(m.config, 1, threads=threads)
            cache = m.new_cache(1)
            step = DecodeStep.build(m.config, m.weights, ws)
            sigs[arch] = step.signature(m.rope, cache, ws.attention_scores(m.config, cache.capacity))
        assert len(set(sigs.values())) == 1, {a: [i for i, t in enumerate(s) if t != sigs["mixtral"][i]]
                                             for a, s in sigs.items()}


def test_decode_step_declines_what_it_does_not_compute(built):
    """f32 weights (forward multiplies them with BLAS, the fused kernels do not) keep the general path, whatever the
    family: build() gives None, forward still decodes."""
    from colibri_server.model.decode_step import DecodeStep
    for path in (built("mixtral").colibri("f32"), built("deepseek_v2").colibri("f32"), built("gpt_oss").colibri("f32")):
        m = Model.open(path)
        assert DecodeStep.build(m.config, m.weights, m.workspace) is None
        cache = m.new_cache()
        m.prefill(cache, np.array(PROMPT[:3]))
        assert np.isfinite(m.decode(cache, PROMPT[3])).all()

    # a mixture the kernel has no one type for, or a bias it does not add, keeps the general path too: GPT-OSS with
    # the router's bias on some MoE layers only, or expert biases without the router's (config allows both),
    # DeepSeek with a query rank on some layers only
    import dataclasses as dc

    def edit(Ls, which, **kw):                     # the layers, `which` of them (indices) changed (frozen: copies)
        return [dc.replace(L, **kw) if i in which else L for i, L in enumerate(Ls)]
    for arch, change in (("gpt_oss", lambda Ls: edit(Ls, {0}, gate_b=None)),
                         ("gpt_oss", lambda Ls: edit(Ls, set(range(len(Ls))), gate_b=None)),
                         ("deepseek_v3", lambda Ls: edit(Ls, {1}, q_a=None))):
        m = Model.open(built(arch).colibri("f16"))
        assert DecodeStep.build(m.config, m.weights, m.workspace) is not None
        w = dc.replace(m.weights, layers=change(list(m.weights.layers)))
        assert DecodeStep.build(m.config, w, m.workspace) is None