"""Latent attention (DeepSeek-V2/V3, model/mla.py) beyond the parity in test_families: the cache holds the
latent and nothing else, a 4096-token sequence still matches transformers, the stored dtypes and the
threaded kernels give the same tokens, and the per-head kernel and the narrower-value paged attention
against their twins."""
from __future__ import annotations

import hf_models as H
import numpy as np
import pytest

from colibri_server.model import Model
from colibri_server.model.convert import convert
from colibri_server.model.kernels import heads as KH
from colibri_server.model.kernels import paged as KP
from colibri_server.model.kernels import tiled as KT
from colibri_server.model.kv import block_bytes
from colibri_server.model.serving import BatchEngine

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]
NO_SINKS = np.zeros(0, np.float32)
NO_SINKS.setflags(write=False)   # read-only as a model's absent sinks (model/weights): the kernels' one signature


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    d = tmp_path_factory.mktemp("v3")
    hf = H.build_hf_model("deepseek_v3", d / "hf", max_position_embeddings=4200)
    convert(str(d / "hf"), str(d / "f32.colibri"), "f32", progress=False)
    return hf, d


def test_the_cache_holds_the_latent_for_4096_tokens(v3):
    """One row of kv_lora_rank + rope dims per position and layer, keys and values both (the values are its
    first kv_lora_rank dims): a 4096-token sequence takes that many bytes per token, not the expanded
    heads' 2 x H x (nope + rope | v); and its next token and last logits are transformers' still."""
    hf, d = v3
    m = Model.open(str(d / "f32.colibri"), context=4112)
    cfg = m.config
    L, Hh, r, dr = cfg.num_layers, cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
    latent = L * (r + dr) * 2                                              # f16 bytes per token
    expanded = L * Hh * (cfg.qk_nope_head_dim + dr + cfg.v_head_dim) * 2
    assert block_bytes(cfg) == 16 * latent and 4 * latent <= expanded
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 512, size=4096)]
    eng = BatchEngine(m, max_seqs=1, max_batch_tokens=256)
    assert eng.pool.v is eng.pool.k and eng.pool.k.shape[-2:] == (16, r + dr)
    assert eng.pool.k.nbytes == eng.pool.num_blocks * 16 * latent
    eng.add("a", prompt, max_tokens=2, ignore_eos=True)
    got, used = [], None
    while eng.has_work():
        got += [ev.token_id for _, ev in eng.step() if ev.token_id is not None]
        if got and used is None:                                           # the prompt in, its first token out
            used = eng.pool.used()
    assert used * eng.pool.bytes_per_block == 4096 * latent                # 256 blocks of 16 positions
    ref = H.hf_logits(hf, prompt)[-1]
    assert got[0] == int(np.argmax(ref))
    cache = m.new_cache(4096)
    assert cache.v is cache.k and cache.k.shape == (L, 1, 4096, r + dr)
    last = m.prefill(cache, np.asarray(prompt, np.int64))[0]
    assert np.abs(last - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("dtype, quantize", [("f16", "none"), ("bf16", "none"), ("f32", "q8")])
def test_stored_dtypes(v3, dtype, quantize):
    """The latent projections quantize (attn_q_a, attn_kv_a), the per-head expansions stay in the float
    dtype. f16 and bf16 logits stay near transformers' f32 ones (relative to their range: 0.4% and 2.2%
    measured); q8 moves these random chaotic models far more (a max error of 36% of the range, as
    Mixtral's 43%), so it is held to its top-1 agreement (85% measured) and to its dequantized weights."""
    from colibri_server.model.kernels import weights_to_f32
    from colibri_server.model.kernels.packing import dequantize_q8
    hf, d = v3
    out = str(d / f"{dtype}-{quantize}.colibri")
    convert(str(d / "hf"), out, dtype, quantize=quantize, quant_group=8, progress=False)   # the tiny ranks fit 8
    m = Model.open(out)
    L = m.weights.layers[1]
    assert L.k_up.dtype == L.v_up.dtype == {"f16": np.uint16, "bf16": np.int16, "f32": np.float32}[dtype]
    ref = H.hf_logits(hf, PROMPT)
    got = m.logits(PROMPT)
    if quantize == "none":
        assert np.abs(got - ref).max() < {"f16": 0.01, "bf16": 0.05}[dtype] * np.abs(ref).max()
        return
    f32 = Model.open(str(d / "f32.colibri")).weights.layers[1]
    for name in ("q_a", "kv_a", "wq"):
        W, W32 = getattr(L, name), weights_to_f32(getattr(f32, name))
        assert hasattr(W, "q")
        err = np.linalg.norm(dequantize_q8(W.q, W.s) - W32) / np.linalg.norm(W32)
        assert err < 0.01, (name, err)
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.7


def test_threads_give_the_same_tokens(v3):
    hf, d = v3
    path = str(d / "f32.colibri")
    one = Model.open(path)
    two = Model.open(path)
    two.set_threads(2)
    want = H.hf_greedy(hf, PROMPT[:8], 24)
    assert one.generate(PROMPT[:8], max_tokens=24, ignore_eos=True) == want
    assert two.generate(PROMPT[:8], max_tokens=24, ignore_eos=True) == want
    assert H.engine_tokens(two, [(PROMPT[:8], 24), (PROMPT[3:30], 8)]) == [want, H.hf_greedy(hf, PROMPT[3:30], 8)]


@pytest.mark.parametrize("wdtype", [np.float32, np.uint16,
                                    pytest.param(np.int16, marks=pytest.mark.slow)])   # bf16: 24 s cold
def test_heads_matmul_is_its_twin(wdtype):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3, 5, 24)).astype(np.float32)
    W32 = rng.standard_normal((5, 7, 24)).astype(np.float32)
    W = {np.float32: W32, np.uint16: W32.astype(np.float16).view(np.uint16),
         np.int16: (W32.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)}[wdtype]
    W.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
    ref = KH.heads_matmul_ref(X, W)
    for kernel in (KH.heads_matmul, KH.heads_matmul_par):
        out = np.zeros((3, 5, 7), np.float32)
        kernel(X, W, out)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    Xs = np.zeros((3, 5, 40), np.float32)                 # strided views, as mla.project passes them
    Xs[:, :, 8:32] = X
    outs = np.zeros((3, 5, 20), np.float32)
    KH.heads_matmul(Xs[:, :, 8:32], W, outs[:, :, 2:9])
    np.testing.assert_allclose(outs[:, :, 2:9], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        KH.heads_matmul(X, W, np.zeros((3, 5, 6), np.float32))


def test_paged_attention_with_values_narrower_than_keys():
    """The latent's pool passed as both: each row's values are the first dv dims of its key row."""
    rng = np.random.default_rng(0)
    NB, BS, hd, dv, H = 6, 4, 40, 32, 3
    pool = rng.standard_normal((NB, 1, BS, hd)).astype(np.float32)
    tables = np.array([[4, 1, 3], [0, 2, 5]], np.int32)
    seq, pos = np.array([0, 0, 1]), np.array([5, 9, 7])
    q = rng.standard_normal((3, H, hd)).astype(np.float32)
    ref = KP.paged_attention_ref(q, pool, pool, tables, seq, pos, 0, 0.3, dv=dv)
    for kernel in (KT.tiled_attention, lambda *a: KT.tiled_attention_par(*a, 2)):
        out = np.zeros((3, H, dv), np.float32)
        kernel(q, pool, pool, tables, seq, pos, 0, 0.3, out, NO_SINKS)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        KT.tiled_attention(q, pool, pool, tables, seq, pos, 0, 0.3, np.zeros((3, H, hd + 8), np.float32),
                           NO_SINKS)


def test_latent_fields_get_named_config_errors(v3):
    from colibri_server.model.config import ConfigError, ModelConfig
    _, d = v3
    cfg = Model.open(str(d / "f32.colibri")).config.to_dict()
    assert {cfg[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")} == {32, 24, 16}
    for bad, key, msg in ((dict(num_kv_heads=2, num_heads=4), "num_kv_heads", "must be 1 with latent attention"),
                          (dict(v_head_dim=0), "v_head_dim", "is not in 1"),
                          (dict(qk_nope_head_dim=-1), "qk_nope_head_dim", "is not in 1"),
                          (dict(q_lora_rank=-2), "q_lora_rank", "is not in 0"),
                          (dict(qk_norm="head"), "kv_lora_rank", "takes no q/k norm"),
                          (dict(kv_lora_rank=0), "q_lora_rank", "only with latent attention")):
        with pytest.raises(ConfigError, match=msg) as e:
            ModelConfig.from_dict({**cfg, **bad})
        assert e.value.key == key
    plain = {k: v for k, v in cfg.items() if k not in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    assert not ModelConfig.from_dict(plain).mla          # the other families' files: no latent keys, none implied


def test_converter_refuses_what_it_cannot_run(tmp_path):
    import json

    from colibri_server.model.convert import ConvertError
    H.build_hf_model("deepseek_v2", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, msg in ((dict(attention_bias=True), "attention_bias=true is not supported"),
                        (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConvertError, match=msg):
            convert(str(tmp_path / "hf"), str(tmp_path / "x.colibri"), "f32", progress=False)
        assert not (tmp_path / "x.colibri").exists()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_group_limit_decides_experts(arch, tmp_path):
    """Every group allowed (topk_group = n_group) moves transformers' logits well beyond the parity tolerance:
    the test configs' group limit changes which experts run, so test_families' parity covers it."""
    hf = H.build_hf_model(arch, tmp_path / "hf")
    base = H.hf_logits(hf, PROMPT)
    mods = [m for m in hf.modules() if hasattr(m, "topk_group")]
    assert mods
    for m in mods:
        m.topk_group = H.FAMILY_CONFIGS[arch]["n_group"]
    moved = np.abs(H.hf_logits(hf, PROMPT) - base).max()
    assert moved > 100 * 1e-4 * np.abs(base).max(), moved


def test_paged_attention_on_threads_splits_one_rows_heads_bit_for_bit():
    """One decoding sequence on two threads: its row's heads split over them (latent attention: all 16 on
    one kv head; GQA 8 on 2), each head as on one thread."""
    import numba
    rng = np.random.default_rng(3)
    for Hkv, Hq, hd, dv in ((1, 16, 40, 32), (2, 8, 16, 16)):
        NB, BS = 10, 4
        kp = KP.to_f16_bits(rng.standard_normal((NB, Hkv, BS, hd)).astype(np.float32))
        vp = kp if dv < hd else KP.to_f16_bits(rng.standard_normal((NB, Hkv, BS, hd)).astype(np.float32))
        tables = rng.permutation(NB).astype(np.int32)[None]
        q = rng.standard_normal((1, Hq, hd)).astype(np.float32)
        sinks = rng.standard_normal(Hq).astype(np.float32)
        sinks.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
        args = (tables, np.zeros(1, np.int64), np.array([33]), 0, 0.3)
        one, two = np.zeros((1, Hq, dv), np.float32), np.full((1, Hq, dv), np.nan, np.float32)
        KT.tiled_attention(q, kp, vp, *args, one, sinks)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        try:
            KT.tiled_attention_par(q, kp, vp, *args, two, sinks, 2)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        np.testing.assert_array_equal(two, one)
        ref = KP.paged_attention_ref(q, kp, vp, *args, dv=dv, sinks=sinks)
        np.testing.assert_allclose(one, ref, rtol=1e-5, atol=1e-5)

