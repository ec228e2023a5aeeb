"""GGUF import of the families llama.cpp writes beyond test_gguf_import's: deepseek2 (DeepSeek-V2/V3's latent
attention: its k_b / v_b split, or the older attn_kv_b; interleaved rotary rows), gpt-oss (sinks, biases,
post_attention_norm, its fixed sliding pattern and SwiGLU constants) and phimoe (Phi-3.5-MoE: the norms' and
the head's biases, longrope as rope_factors_short / _long with one attention factor, sparsemixer's eps fixed).
GGUFs written here with the `gguf` package the way llama.cpp's converter (conversion/deepseek.py,
conversion/gpt_oss.py, conversion/phi.py) writes them, imported
against the direct conversion of the same checkpoint: F32 within 1e-6, F16 to the f16 direct conversion,
Q8_0 within a stated bound. Where llama.cpp's source is on the machine (tools/hf_to_gguf.py), its own
converter's GGUFs are imported too and held to transformers' logits."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import gguf
import hf_models as H
import numpy as np
import pytest
from blocks_data import int8_rounded_products
from test_gguf_import import PROMPT, _import

from colibri_server.model import Model
from colibri_server.model.convert import convert
from colibri_server.model.gguf_import import convert_gguf

T = gguf.MODEL_TENSOR
Q = gguf.GGMLQuantizationType
LLAMA_CPP = os.environ.get("LLAMA_CPP_SRC", os.path.join(os.path.dirname(__file__), "..", "bench", ".anchors", "llama.cpp"))
HF_TO_GGUF = os.path.join(os.path.dirname(__file__), "..", "tools", "hf_to_gguf.py")
# Phi-MoE: a context of twice the original length (the long factors at the default context), the attention
# factor llama.cpp's converter writes for that ratio (sqrt(1 + ln 2 / ln 64): the checkpoint's mscales do not
# reach the file) as both mscales, and router_jitter_noise 0.01 (not in the file either: Phi-3.5-MoE's).
PHI_ATT = math.sqrt(1 + math.log(128 / 64) / math.log(64))
OVERRIDES = {"gpt_oss": dict(swiglu_limit=7.0),      # llama.cpp's gpt-oss fixes the clamp at 7 (not in the file)
             "phimoe": dict(router_jitter_noise=0.01, max_position_embeddings=128,
                            rope_parameters={**H.FAMILY_CONFIGS["phimoe"]["rope_parameters"],
                                             "short_mscale": PHI_ATT, "long_mscale": PHI_ATT})}
# what llama.cpp's converter needs in a copy of the checkpoint: V3's scoring function as the released V3 has it;
# Phi-3.5-MoE's class as its released config.json spells it (the one llama.cpp registers), and a tokenizer class
# its Phi-3 vocabulary reader takes as byte-level BPE (else it wants a sentencepiece tokenizer.model)
LLAMA_CPP_EDITS = {"deepseek_v3": {"config.json": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}},
                   "phimoe": {"config.json": {"architectures": ["PhiMoEForCausalLM"]},
                              "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer"}}}
# the context the llama.cpp test runs: transformers 5 takes Phi-MoE's short factors (its rotary forward
# recomputes them), which colibri takes within the original length
LLAMA_CPP_CONTEXT = {"phimoe": 64}


def _name(t, i=None, suffix="weight"):
    return gguf.TENSOR_NAMES[t].format(bid=i) + "." + suffix


def _load(hf_dir):
    from safetensors.numpy import load_file
    st = {}
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        st.update(load_file(f))
    return st


def _writer(path, arch, c, qtype, kv_b=False):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rp = c["rope_parameters"]
    w.add_rope_freq_base(rp["rope_theta"])
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])

    def mat(name, a):
        a = np.ascontiguousarray(a, np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16 or a.shape[-1] % 32:        # rows Q8_0 cannot block: F16, as llama.cpp falls back
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def f32(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    return w, mat, f32


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_deepseek2(hf_dir, path, arch, qtype=Q.F32, kv_b=False):
    """llama.cpp's deepseek2: HF's rows as they are (its NORM rope takes the interleaved pairs), kv_b_proj split
    into attn_k_b (H, r, nope), transposed, and attn_v_b (H, v, r) (kv_b: the older single attn_kv_b)."""
    c = H.FAMILY_CONFIGS[arch]
    st = _load(hf_dir)
    w, mat, f32 = _writer(path, "deepseek2", c, qtype)
    Hh, r, rope, nope, v = (c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"],
                            c["v_head_dim"])
    w.add_head_count_kv(1)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_key_length(r + rope)
    w.add_value_length(r)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(r)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    w.add_rope_scaling_yarn_log_mul(0.1 * c["rope_parameters"]["mscale_all_dim"])
    if arch == "deepseek_v3":          # what llama.cpp writes from V3's config.json scoring_func "sigmoid"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    mat(_name(T.TOKEN_EMBD), st["model.embed_tokens.weight"])
    for i in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        f32(_name(T.ATTN_NORM, i), st[p + "input_layernorm.weight"])
        if c.get("q_lora_rank"):
            mat(_name(T.ATTN_Q_A, i), st[a + "q_a_proj.weight"])
            f32(_name(T.ATTN_Q_A_NORM, i), st[a + "q_a_layernorm.weight"])
            mat(_name(T.ATTN_Q_B, i), st[a + "q_b_proj.weight"])
        else:
            mat(_name(T.ATTN_Q, i), st[a + "q_proj.weight"])
        mat(_name(T.ATTN_KV_A_MQA, i), st[a + "kv_a_proj_with_mqa.weight"])
        f32(_name(T.ATTN_KV_A_NORM, i), st[a + "kv_a_layernorm.weight"])
        kvb = st[a + "kv_b_proj.weight"]
        if kv_b:
            mat(_name(T.ATTN_KV_B, i), kvb)
        else:
            kvb3 = kvb.reshape(Hh, nope + v, r)
            mat(_name(T.ATTN_K_B, i), kvb3[:, :nope].transpose(0, 2, 1))
            mat(_name(T.ATTN_V_B, i), kvb3[:, nope:])
        mat(_name(T.ATTN_OUT, i), st[a + "o_proj.weight"])
        f32(_name(T.FFN_NORM, i), st[p + "post_attention_layernorm.weight"])
        if p + "mlp.gate.weight" not in st:
            for t, hf in ((T.FFN_GATE, "gate_proj"), (T.FFN_UP, "up_proj"), (T.FFN_DOWN, "down_proj")):
                mat(_name(t, i), st[p + f"mlp.{hf}.weight"])
            continue
        f32(_name(T.FFN_GATE_INP, i), st[p + "mlp.gate.weight"])
        if p + "mlp.gate.e_score_correction_bias" in st:
            f32(_name(T.FFN_EXP_PROBS_B, i, "bias"), st[p + "mlp.gate.e_score_correction_bias"])
        for t, hf in ((T.FFN_GATE_EXP, "gate_proj"), (T.FFN_UP_EXP, "up_proj"), (T.FFN_DOWN_EXP, "down_proj")):
            mat(_name(t, i), np.stack([st[f"{p}mlp.experts.{e}.{hf}.weight"] for e in range(c["n_routed_experts"])]))
        for t, hf in ((T.FFN_GATE_SHEXP, "gate_proj"), (T.FFN_UP_SHEXP, "up_proj"), (T.FFN_DOWN_SHEXP, "down_proj")):
            mat(_name(t, i), st[p + f"mlp.shared_experts.{hf}.weight"])
    f32(_name(T.OUTPUT_NORM), st["model.norm.weight"])
    mat(_name(T.OUTPUT), st["lm_head.weight"])
    _finish(w)


def write_gpt_oss(hf_dir, path, qtype=Q.F32):
    """llama.cpp's gpt-oss: gate_up (E, D, 2I) split into its even (gate) and odd (up) columns and transposed,
    down_proj transposed, their biases split alike; sinks as attn_sinks.weight; post_attention_layernorm as
    post_attention_norm; sliding_window and expert_feed_forward_length in the metadata."""
    c = {**H.FAMILY_CONFIGS["gpt_oss"], **OVERRIDES["gpt_oss"]}
    st = _load(hf_dir)
    w, mat, f32 = _writer(path, "gpt-oss", c, qtype)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    mat(_name(T.TOKEN_EMBD), st["model.embed_tokens.weight"])
    for i in range(c["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        f32(_name(T.ATTN_NORM, i), st[p + "input_layernorm.weight"])
        for t, hf in ((T.ATTN_Q, "q_proj"), (T.ATTN_K, "k_proj"), (T.ATTN_V, "v_proj"), (T.ATTN_OUT, "o_proj")):
            mat(_name(t, i), st[a + hf + ".weight"])
            f32(_name(t, i, "bias"), st[a + hf + ".bias"])
        f32(_name(T.ATTN_SINKS, i), st[a + "sinks"])
        f32(_name(T.ATTN_POST_NORM, i), st[p + "post_attention_layernorm.weight"])
        f32(_name(T.FFN_GATE_INP, i), st[m + "router.weight"])
        f32(_name(T.FFN_GATE_INP, i, "bias"), st[m + "router.bias"])
        gu, gub = st[m + "experts.gate_up_proj"].transpose(0, 2, 1), st[m + "experts.gate_up_proj_bias"]
        mat(_name(T.FFN_GATE_EXP, i), gu[:, 0::2])
        mat(_name(T.FFN_UP_EXP, i), gu[:, 1::2])
        mat(_name(T.FFN_DOWN_EXP, i), st[m + "experts.down_proj"].transpose(0, 2, 1))
        f32(_name(T.FFN_GATE_EXP, i, "bias"), gub[:, 0::2])
        f32(_name(T.FFN_UP_EXP, i, "bias"), gub[:, 1::2])
        f32(_name(T.FFN_DOWN_EXP, i, "bias"), st[m + "experts.down_proj_bias"])
    f32(_name(T.OUTPUT_NORM), st["model.norm.weight"])
    mat(_name(T.OUTPUT), st["lm_head.weight"])
    _finish(w)


def write_phimoe(hf_dir, path, qtype=Q.F32, expert_used=None, drop=()):
    """llama.cpp's phimoe (Phi3MiniModel's metadata plus the expert counts): q/k rows as they are (NEOX rope),
    the experts stacked (w1 gate, w3 up, w2 down), LayerNorm and head biases as *.bias, longrope as
    rope_factors_long / rope_factors_short with rope.scaling.original_context_length and one attn_factor
    (sqrt(1 + ln(context / original) / ln(original))); no key for router_jitter_noise or the mscales.
    `expert_used` overrides expert_used_count, `drop` leaves tensors out (the named-error tests)."""
    c = {**H.FAMILY_CONFIGS["phimoe"], **OVERRIDES["phimoe"]}
    st = _load(hf_dir)
    w, mat, f32 = _writer(path, "phimoe", c, qtype)
    rp, hd = c["rope_parameters"], c["hidden_size"] // c["num_attention_heads"]
    orig, ctx = rp["original_max_position_embeddings"], c["max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(hd)
    w.add_sliding_window(c.get("sliding_window") or 0)
    w.add_expert_used_count(expert_used or c["num_experts_per_tok"])
    w.add_expert_count(c["num_local_experts"])
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0)
    out = {}
    out[_name(T.ROPE_FACTORS_LONG)] = (f32, rp["long_factor"])
    out[_name(T.ROPE_FACTORS_SHORT)] = (f32, rp["short_factor"])
    out[_name(T.TOKEN_EMBD)] = (mat, st["model.embed_tokens.weight"])
    for i in range(c["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.block_sparse_moe."
        out[_name(T.ATTN_NORM, i)] = (f32, st[p + "input_layernorm.weight"])
        out[_name(T.ATTN_NORM, i, "bias")] = (f32, st[p + "input_layernorm.bias"])
        for t, hf in ((T.ATTN_Q, "q_proj"), (T.ATTN_K, "k_proj"), (T.ATTN_V, "v_proj"), (T.ATTN_OUT, "o_proj")):
            out[_name(t, i)] = (mat, st[a + hf + ".weight"])
            out[_name(t, i, "bias")] = (f32, st[a + hf + ".bias"])
        out[_name(T.FFN_NORM, i)] = (f32, st[p + "post_attention_layernorm.weight"])
        out[_name(T.FFN_NORM, i, "bias")] = (f32, st[p + "post_attention_layernorm.bias"])
        out[_name(T.FFN_GATE_INP, i)] = (f32, st[m + "gate.weight"])
        for t, hf in ((T.FFN_GATE_EXP, "w1"), (T.FFN_UP_EXP, "w3"), (T.FFN_DOWN_EXP, "w2")):
            out[_name(t, i)] = (mat, np.stack([st[f"{m}experts.{e}.{hf}.weight"] for e in range(c["num_local_experts"])]))
    out[_name(T.OUTPUT_NORM)] = (f32, st["model.norm.weight"])
    out[_name(T.OUTPUT_NORM, None, "bias")] = (f32, st["model.norm.bias"])
    out[_name(T.OUTPUT)] = (mat, st["lm_head.weight"])
    out[_name(T.OUTPUT, None, "bias")] = (f32, st["lm_head.bias"])
    assert set(drop) <= set(out)
    for n, (put, a) in out.items():
        if n not in drop:
            put(n, a)
    _finish(w)


def _write(arch, hf_dir, path, qtype, **kw):
    if arch == "gpt_oss":
        write_gpt_oss(hf_dir, path, qtype)
    elif arch == "phimoe":
        write_phimoe(hf_dir, path, qtype, **kw)
    else:
        write_deepseek2(hf_dir, path, arch, qtype, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            d = tmp_path_factory.mktemp(arch)
            hf = H.build_hf_model(arch, d / "hf", **OVERRIDES.get(arch, {}))
            direct = {}
            for dt in ("f32", "f16"):
                convert(str(d / "hf"), str(d / f"direct-{dt}.colibri"), dt, progress=False)
                direct[dt] = Model.open(str(d / f"direct-{dt}.colibri")).logits(PROMPT)
            cache[arch] = (d, hf, direct)
        return cache[arch]
    return get


ARCHS = ["deepseek_v2", "deepseek_v3", "gpt_oss", "phimoe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_and_f16_ggufs_import_to_the_direct_conversion(ckpt, arch):
    d, _, direct = ckpt(arch)
    _write(arch, d / "hf", d / "F32.gguf", Q.F32)
    cfg, _, got = _import(d, "F32", dtype="f32")
    ref = direct["f32"]
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
    _write(arch, d / "hf", d / "F16.gguf", Q.F16)
    _, _, got16 = _import(d, "F16", dtype="f16")
    np.testing.assert_allclose(got16, direct["f16"], rtol=0, atol=1e-5 * np.abs(direct["f16"]).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_imports_within_its_stated_error(ckpt, arch, monkeypatch):
    d, _, direct = ckpt(arch)
    _write(arch, d / "hf", d / "Q8_0.gguf", Q.Q8_0)
    cfg, report, _ = _import(d, "Q8_0", dtype="f32", quantize="none")
    assert report.source_types.get("Q8_0", 0) > 0 and max(report.errors.values()) == 0   # f32 holds Q8_0 exactly
    assert cfg.arch == {"gpt_oss": "gpt_oss", "phimoe": "phimoe"}.get(arch, "deepseek2")
    ref = Model.open(str(d / "Q8_0.colibri")).weights
    exact = Model.open(str(d / "direct-f32.colibri")).weights
    for name in ("wo", "w1"):       # Q8_0's own rounding of the checkpoint: under 1% relative RMS
        a, b = getattr(ref.layers[1], name), getattr(exact.layers[1], name)
        assert 0 < np.linalg.norm(a - b) / np.linalg.norm(b) < 0.01
    # by default (--quantize auto) the Q8_0 blocks are kept and multiplied as they are (kernels/blocks): the
    # logits of the gguf package's dequantized values with the activations rounded to int8 per 32, as the
    # kernels round them (blocks_data.int8_rounded_products), up to f32 sums
    (d / "Q8_0-auto.gguf").unlink(missing_ok=True)
    (d / "Q8_0-auto.gguf").symlink_to(d / "Q8_0.gguf")
    cfg, _, got = _import(d, "Q8_0-auto", dtype="f32")
    assert "q8_0" in cfg.block_types.values()
    int8_rounded_products(monkeypatch)
    want = Model.open(str(d / "Q8_0-auto.colibri")).logits(PROMPT)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 5e-3, err


def test_an_older_deepseek_gguf_with_one_kv_b_imports_the_same(ckpt):
    d, _, direct = ckpt("deepseek_v2")
    write_deepseek2(d / "hf", d / "kvb.gguf", "deepseek_v2", Q.F32, kv_b=True)
    assert "blk.0.attn_kv_b.weight" in {t.name for t in gguf.GGUFReader(str(d / "kvb.gguf")).tensors}
    _, _, got = _import(d, "kvb", dtype="f32")
    assert np.abs(got - direct["f32"]).max() <= 1e-6 * np.abs(direct["f32"]).max()


def test_a_deepseek_gguf_with_an_unknown_gating_function_is_named(ckpt, tmp_path):
    from colibri_server.model.convert import ConvertError
    d, _, _ = ckpt("deepseek_v3")
    write_deepseek2(d / "hf", tmp_path / "v3.gguf", "deepseek_v3", Q.F32)
    # rewrite the one key: a gating function llama.cpp does not define for deepseek2
    b = bytearray(open(tmp_path / "v3.gguf", "rb").read())
    key = b"deepseek2.expert_gating_func"
    at = b.index(key) + len(key)
    assert int.from_bytes(b[at:at + 4], "little") == 4                  # GGUF type UINT32
    b[at + 4:at + 8] = (7).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(b))
    with pytest.raises(ConvertError, match="expert_gating_func = 7"):
        convert_gguf(str(tmp_path / "bad.gguf"), str(tmp_path / "bad.colibri"), progress=False, require_tokenizer=False)
    assert not (tmp_path / "bad.colibri").exists()


def test_a_phimoe_gguf_reads_both_longrope_sets_and_the_model_llama_cpp_does_not_write(ckpt):
    """Both factor sets from the file: the short ones within the original length, the long ones past it (each
    context against the direct conversion at that context, and the two apart); one attention factor from
    rope.scaling.attn_factor; LayerNorm, the biases and sparsemixer's eps (0.01) as the model defines them."""
    d, _, _ = ckpt("phimoe")
    write_phimoe(d / "hf", d / "rope.gguf", Q.F32)
    cfg, _ = convert_gguf(str(d / "rope.gguf"), str(d / "rope.colibri"), "f32", progress=False, require_tokenizer=False)
    rp = OVERRIDES["phimoe"]["rope_parameters"]
    assert (cfg.norm, cfg.output_bias, cfg.qkv_bias, cfg.o_bias, cfg.sparsemixer_eps, cfg.top_k) == \
        ("layer", True, True, True, 0.01, 2)
    rs = cfg.rope_scaling
    assert rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == 64
    np.testing.assert_array_equal(rs["short_factor"], np.float32(rp["short_factor"]))
    np.testing.assert_array_equal(rs["long_factor"], np.float32(rp["long_factor"]))
    assert rs["attention_factor"] == float(np.float32(PHI_ATT))
    got = {n: Model.open(str(d / "rope.colibri"), context=n).logits(PROMPT) for n in (64, 128)}
    for n in (64, 128):
        ref = Model.open(str(d / "direct-f32.colibri"), context=n).logits(PROMPT)
        assert np.abs(got[n] - ref).max() <= 1e-6 * np.abs(ref).max(), n
    assert np.abs(got[64] - got[128]).max() > 0.05 * np.abs(got[64]).max()


@pytest.mark.parametrize("bad, match", [
    (dict(expert_used=4), "phimoe.expert_used_count = 4 is not supported"),
    (dict(drop=("rope_factors_short.weight",)), "'rope_factors_short.weight' is missing"),
    (dict(drop=("blk.1.ffn_norm.bias",)), "'blk.1.ffn_norm.bias' .for blk.1.ffn_norm_b. is missing"),
])
def test_a_phimoe_gguf_colibri_cannot_represent_is_named(ckpt, tmp_path, bad, match):
    """Sparsemixer chooses exactly 2 experts; longrope needs both factor sets; LayerNorm needs its bias."""
    from colibri_server.model.convert import ConvertError
    d, _, _ = ckpt("phimoe")
    write_phimoe(d / "hf", tmp_path / "bad.gguf", Q.F32, **bad)
    with pytest.raises(ConvertError, match=match):
        convert_gguf(str(tmp_path / "bad.gguf"), str(tmp_path / "bad.colibri"), progress=False, require_tokenizer=False)
    assert not (tmp_path / "bad.colibri").exists()


@pytest.mark.skipif(not os.path.isfile(os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")),
                    reason="llama.cpp's source is not on this machine (bench/build_anchors.sh puts it in bench/.anchors; LLAMA_CPP_SRC)")
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpps_own_gguf_imports_to_transformers(ckpt, arch, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on the same checkpoint (the copy's json files given what the converter
    needs, LLAMA_CPP_EDITS), imported: transformers' logits within 1e-4, and the same tensors (and for the
    architecture's keys it writes, the same values) as the writer above."""
    d, hf, _ = ckpt(arch)
    src = tmp_path / "hf"
    src.mkdir()
    for f in os.listdir(d / "hf"):
        os.symlink(d / "hf" / f, src / f)
    for f, edit in LLAMA_CPP_EDITS.get(arch, {}).items():
        j = json.loads((d / "hf" / f).read_text())
        (src / f).unlink()
        (src / f).write_text(json.dumps({**j, **edit}))
    r = subprocess.run([sys.executable, HF_TO_GGUF, str(src), "--outfile", str(tmp_path / "llama.gguf"), "--outtype",
                        "f32"], capture_output=True, text=True, timeout=600, env={**os.environ, "LLAMA_CPP_SRC": LLAMA_CPP})
    assert r.returncode == 0, r.stderr[-3000:]
    convert_gguf(str(tmp_path / "llama.gguf"), str(tmp_path / "m.colibri"), "f32", progress=False)
    ref = H.hf_logits(hf, PROMPT)
    got = Model.open(str(tmp_path / "m.colibri"), context=LLAMA_CPP_CONTEXT.get(arch)).logits(PROMPT)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
    _write(arch, d / "hf", tmp_path / "ours.gguf", Q.F32)
    r_theirs, r_ours = gguf.GGUFReader(str(tmp_path / "llama.gguf")), gguf.GGUFReader(str(tmp_path / "ours.gguf"))
    theirs = {t.name: np.asarray(t.data) for t in r_theirs.tensors}
    ours = {t.name: np.asarray(t.data) for t in r_ours.tensors}
    assert set(ours) == set(theirs)
    for n in ours:
        np.testing.assert_array_equal(ours[n], theirs[n], err_msg=n)
    g = r_ours.fields["general.architecture"].contents()        # every key the writer above writes, as theirs
    their_keys = {k: f.contents() for k, f in r_theirs.fields.items() if k.startswith(g + ".")}
    assert {k: f.contents() for k, f in r_ours.fields.items() if k.startswith(g + ".")} == \
        {k: their_keys[k] for k in r_ours.fields if k in their_keys} and their_keys
