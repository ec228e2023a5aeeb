"""Families beyond the first four (issue 17: the dense Llama/Qwen2/Qwen3, Granite-MoE, GLM-4.5), each
against transformers' own class on a tiny random config: f32 logits within 1e-4 at every position,
32 greedy tokens identical through the model's own decode and through the batched serving engine
(sequences joining at different steps)."""
from __future__ import annotations

import hf_models as H
import numpy as np
import pytest

from colibri_server.model import Model
from colibri_server.model.convert import ConvertError, convert

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            d = tmp_path_factory.mktemp(arch)
            hf = H.build_hf_model(arch, d / "hf")
            convert(str(d / "hf"), str(d / "f32.colibri"), "f32", progress=False)
            cache[arch] = (hf, str(d / "f32.colibri"), d)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", (*H.DENSE_CONFIGS, *H.FAMILY_CONFIGS))
def test_family_matches_transformers(family, arch):
    hf, path, _ = family(arch)
    m = Model.open(path)
    if arch in H.DENSE_CONFIGS:
        assert m.config.num_experts == 0 and m.config.dense_layers == tuple(range(m.config.num_layers))
    ref = H.hf_logits(hf, PROMPT)
    got = m.logits(PROMPT)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    want = H.hf_greedy(hf, PROMPT[:8], 32)
    assert m.generate(PROMPT[:8], max_tokens=32, ignore_eos=True) == want
    assert H.engine_tokens(m, [(PROMPT[:8], 32), (PROMPT[5:20], 12), (PROMPT[:3], 12)], max_seqs=4) == \
        [want, H.hf_greedy(hf, PROMPT[5:20], 12), H.hf_greedy(hf, PROMPT[:3], 12)]


def test_granite_multipliers_are_folded_and_each_one_matters(family, tmp_path):
    """Each multiplier changes the logits (so the parity above checks all four), and the f16 file
    (the folded scales rounded once) stays close."""
    hf, path, d = family("granitemoe")
    base = H.hf_logits(hf, PROMPT[:12])
    for key, value in (("embedding_multiplier", 1.0), ("attention_multiplier", 0.25), ("residual_multiplier", 1.0),
                       ("logits_scaling", 1.0)):
        m2 = H.build_hf_model("granitemoe", tmp_path / key, **{key: value})
        assert np.abs(H.hf_logits(m2, PROMPT[:12]) - base).max() > 1e-2, key
    convert(str(d / "hf"), str(d / "f16.colibri"), "f16", progress=False)
    got = Model.open(str(d / "f16.colibri")).logits(PROMPT[:12])
    assert np.linalg.norm(got - base) <= 1e-2 * np.linalg.norm(base)


def test_mlp_bias_is_refused_by_name(tmp_path):
    H.build_hf_model("llama", tmp_path / "hf", mlp_bias=True)
    with pytest.raises(ConvertError, match="mlp_bias"):
        convert(str(tmp_path / "hf"), str(tmp_path / "x.colibri"), "f32", progress=False)


def test_granite_shared_experts_are_refused_by_name(tmp_path):
    H.build_hf_model("granitemoe", tmp_path / "hf")
    import json
    cfgp = tmp_path / "hf" / "config.json"
    c = json.loads(cfgp.read_text())
    c["shared_intermediate_size"] = 64
    cfgp.write_text(json.dumps(c))
    with pytest.raises(ConvertError, match="shared_intermediate_size"):
        convert(str(tmp_path / "hf"), str(tmp_path / "x.colibri"), "f32", progress=False)


# ---------------------------------------------------------------------------- format version 2

def _patched(src, dst, layer, **fields):
    """A copy of the .colibri file `src` with routing record `layer` changed (version-2 fields)."""
    from colibri_server.model import format as fmt
    b = bytearray(open(src, "rb").read())
    cf = fmt.ColibriFile.open(src)
    off = cf.header["routing_offset"] + layer * fmt.ROUTING_RECORD_SIZE
    cf.close()
    names = ("gate", "bias", "top_k", "num_experts", "flags", "shared_gate", "n_group", "topk_group", "routed_scale")
    rec = dict(zip(names, fmt.ROUTING_V2.unpack_from(b, off)))
    rec.update(fields)
    fmt.ROUTING_V2.pack_into(b, off, *(rec[n] for n in names))
    open(dst, "wb").write(bytes(b))
    return dst


def test_version_2_only_when_needed_and_its_fields_get_named_errors(family, tmp_path):
    from colibri_server.model import format as fmt
    _, path, d = family("glm4_moe")
    cf = fmt.ColibriFile.open(path)
    assert cf.header["version"] == 2
    r = cf.routing[1]
    assert r.flags & fmt.ROUTE_SIGMOID and r.flags & fmt.ROUTE_GROUP_LIMITED and r.bias != fmt.NO_TENSOR
    assert (r.n_group, r.topk_group, r.routed_scale) == (4, 2, 2.5) and r.shared_gate == fmt.NO_TENSOR
    cf.close()
    _, gpath, _ = family("granitemoe")       # first-generation routing: still a version-1 file
    assert fmt.ColibriFile.open(gpath).header["version"] == 1
    S, G = fmt.ROUTE_SOFTMAX, fmt.ROUTE_GROUP_LIMITED
    sig = fmt.ROUTE_SIGMOID | fmt.ROUTE_RENORM | fmt.ROUTE_SHARED_EXPERT | G
    cases = [
        (dict(flags=sig | S), "exactly one of the SOFTMAX and SIGMOID"),
        (dict(n_group=3), "do not fit"),
        (dict(topk_group=5), "do not fit"),
        (dict(flags=sig & ~G), "without the group-limited flag"),
        (dict(routed_scale=float("nan")), "routed_scale"),
        (dict(flags=sig | 1 << 12), "unknown flag bits"),
        (dict(routed_scale=1.0), "routed_scale disagrees with the config"),
        (dict(bias=fmt.NO_TENSOR), "correction bias / router bias disagrees"),
        (dict(flags=sig | fmt.ROUTE_BIAS_IN_LOGITS), "correction bias / router bias disagrees"),
    ]
    for i, (fields, msg) in enumerate(cases):
        bad = _patched(path, tmp_path / f"bad{i}.colibri", 1, **fields)
        with pytest.raises(fmt.BadRouting, match=msg) as e:
            Model.open(str(bad))
        assert "routing[1]" in str(e.value), fields


def test_routing_noise_is_refused_for_version_2_routing(family):
    _, path, _ = family("glm4_moe")
    with pytest.raises(ValueError, match="routing_noise: .* version-2 rules"):
        Model.open(path, routing_noise=0.5)


def test_group_fields_get_named_config_errors(family):
    from colibri_server.model.config import ConfigError, ModelConfig
    _, path, _ = family("glm4_moe")
    cfg = Model.open(path).config.to_dict()
    for bad, msg in ((dict(n_group=0, topk_group=1), "needs >= 2 groups"),
                     (dict(n_group=8, topk_group=2), "groups need >= 2 experts"),   # sigmoid: top-2 sums per group
                     (dict(n_group=3, topk_group=1), "does not divide"),
                     (dict(n_group=4, topk_group=5), "topk_group")):
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_dict({**cfg, **bad})


def test_granite_with_attention_biases_folds_them_too(tmp_path):
    """q's bias is scaled with W_q (attention_multiplier * sqrt(hd)) and o's with W_o (residual_multiplier)."""
    hf = H.build_hf_model("granitemoe", tmp_path / "hf", attention_bias=True)
    convert(str(tmp_path / "hf"), str(tmp_path / "f32.colibri"), "f32", progress=False)
    m = Model.open(str(tmp_path / "f32.colibri"))
    assert m.config.qkv_bias and m.config.o_bias
    ref = H.hf_logits(hf, PROMPT)
    assert np.abs(m.logits(PROMPT) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("family_router, cfg_kw", [
    ("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
     dict(model_type="deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    ("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
     dict(model_type="deepseek_v2", topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0)),
    ("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
     dict(model_type="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ("glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
     dict(model_type="glm4_moe", n_group=4, topk_group=3, routed_scaling_factor=1.0, norm_topk_prob=False)),
])
def test_route_rule_is_transformers_routers(family_router, cfg_kw):
    """kernels.route_rule against the routers of DeepSeek-V2 (softmax, group-limited greedy by each
    group's best, routed scale, no renormalisation in transformers 5), DeepSeek-V3 and GLM-4.5 (sigmoid,
    correction bias, top-2 group sums), run as transformers' own modules: the same experts and weights."""
    import importlib

    import torch
    from transformers import AutoConfig

    from colibri_server.model import kernels as K
    from colibri_server.model.kernels.moe import RULE_GROUPS, RULE_RENORM, RULE_SIGMOID
    mod, cls = family_router.rsplit(".", 1)
    Router = getattr(importlib.import_module(f"transformers.models.{mod}"), cls)
    kw = dict(cfg_kw)
    E, k, D = 16, 4, 32
    config = AutoConfig.for_model(kw.pop("model_type"), hidden_size=D, num_experts_per_tok=k,
                                  n_routed_experts=E, num_experts=E, num_local_experts=E, **kw)
    router = Router(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    x = torch.randn(64, D, generator=g)
    with torch.no_grad():
        logits, w_ref, i_ref = router(x)
    sig = hasattr(router, "e_score_correction_bias")
    groups = config.n_group > 1 and (sig or config.topk_method == "group_limited_greedy")
    renorm = sig and config.norm_topk_prob
    rule = np.array([(RULE_RENORM if renorm else 0) | (RULE_SIGMOID if sig else 0) | (RULE_GROUPS if groups else 0),
                     config.n_group if groups else 0, config.topk_group if groups else 0,
                     config.routed_scaling_factor], np.float32)
    bias = router.e_score_correction_bias.numpy().astype(np.float32) if sig else np.zeros(0, np.float32)
    idx, w = np.empty((64, k), np.int32), np.empty((64, k), np.float32)
    K.route_rule(logits.numpy().astype(np.float32), k, rule, bias, idx, w)
    order_ref, order = np.argsort(i_ref.numpy(), 1), np.argsort(idx, 1)      # transformers' top-k is unsorted
    np.testing.assert_array_equal(np.take_along_axis(idx, order, 1), np.take_along_axis(i_ref.numpy(), order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(w, order, 1), np.take_along_axis(w_ref.numpy(), order_ref, 1),
                               rtol=2e-6, atol=1e-7)
