"""Phi-3.5-MoE beyond the parity in test_families: sparsemixer routing against transformers' own function
(the masks matter), LayerNorm and longrope against their references, each part shown to matter, named
errors for the new fields."""
from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
import torch

from colibri_server.model import Model
from colibri_server.model import kernels as K
from colibri_server.model.convert import convert

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    d = tmp_path_factory.mktemp("phimoe")
    hf = H.build_hf_model("phimoe", d / "hf")
    convert(str(d / "hf"), str(d / "f32.colibri"), "f32", progress=False)
    return hf, d


@pytest.mark.parametrize("eps", [0.01, 0.3, 2.0])
def test_sparsemixer_is_transformers(eps):
    """The experts and weights of transformers' sparsemixer (inference), on logits with near ties, negative
    maxima and zeros: the band of 2*eps around each choice changes the weights (checked: a band of 0 differs)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 8, generator=g) * 1.5
    z[:20] -= 5.0                                       # every logit negative
    z[20:30, 3] = z[20:30, 5]                           # ties
    z[30:40] = 0.0
    w_ref, i_ref = sparsemixer(z, jitter_eps=eps, training=False)
    idx, w = np.empty((200, 2), np.int32), np.empty((200, 2), np.float32)
    K.route_sparsemixer(z.numpy(), eps, idx, w)
    np.testing.assert_array_equal(idx, i_ref.numpy())
    np.testing.assert_allclose(w, w_ref.numpy(), rtol=2e-6, atol=1e-7)
    w0 = np.empty_like(w)
    K.route_sparsemixer(z.numpy(), 1e-9, idx, w0)
    assert not np.allclose(w0, w, atol=1e-3)


def test_layernorm_is_its_twin():
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((5, 48)) + 1).astype(np.float32)
    w, b = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    out = np.empty_like(x)
    K.layernorm(x, w, b, 1e-5, out)
    np.testing.assert_allclose(out, K.layernorm_ref(x, w, b, 1e-5), rtol=1e-5, atol=1e-5)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (48,), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=1e-5)
    K.layernorm(x, w, b, 1e-5, x)                       # in place
    np.testing.assert_allclose(x, out, rtol=0, atol=0)


def test_longrope_tables_choose_by_the_context(phi):
    """Within the original length the short factors and short_mscale (transformers' tables); a longer context
    takes the long factors and long_mscale for every position."""
    from colibri_server.model.rope import rope_tables
    hf, d = phi
    cfg = Model.open(str(d / "f32.colibri")).config
    rs = cfg.rope_scaling
    cos, sin = rope_tables(cfg, 64)
    inv_s = 1.0 / (np.asarray(rs["short_factor"]) * 10000.0 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(cos[40], np.cos(40 * inv_s) * 1.1, rtol=1e-5, atol=1e-6)
    emb = hf.model.rotary_emb(torch.zeros(1), torch.arange(64)[None])
    np.testing.assert_allclose(cos, emb[0][0, :, :8].numpy(), rtol=1e-5, atol=1e-6)
    cos_l, _ = rope_tables(cfg, 128)
    inv_l = 1.0 / (np.asarray(rs["long_factor"]) * 10000.0 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(cos_l[40], np.cos(40 * inv_l) * 1.3, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["jitter", "layernorm_bias", "head_bias"])
def test_each_part_changes_the_logits(phi, change):
    hf, _ = phi
    base = H.hf_logits(hf, PROMPT)
    with torch.no_grad():
        if change == "jitter":
            r = hf.model.layers[0].mlp.router
            saved, r.router_jitter_noise = r.router_jitter_noise, 1e-9
        elif change == "layernorm_bias":
            p = hf.model.layers[0].input_layernorm.bias
            saved = p.clone()
            p.zero_()
        else:
            p = hf.lm_head.bias
            saved = p.clone()
            p.zero_()
        moved = np.abs(H.hf_logits(hf, PROMPT) - base).max()
        if change == "jitter":
            r.router_jitter_noise = saved
        else:
            p.copy_(saved)
    assert np.abs(H.hf_logits(hf, PROMPT) - base).max() == 0
    assert moved > 100 * 1e-4 * np.abs(base).max(), (change, moved)


def test_new_fields_get_named_errors(phi, tmp_path):
    from test_families import _patched

    from colibri_server.model import format as fmt
    from colibri_server.model.config import ConfigError, ModelConfig
    _, d = phi
    path = str(d / "f32.colibri")
    cfg = Model.open(path).config.to_dict()
    assert cfg["norm"] == "layer" and cfg["output_bias"] and cfg["sparsemixer_eps"] == 0.3
    for bad, key, msg in ((dict(norm="group"), "norm", "is not one of"),
                          (dict(top_k=3), "sparsemixer_eps", "top_k must be 2"),
                          (dict(norm_topk_prob=True), "sparsemixer_eps", "no other routing rule"),
                          (dict(sparsemixer_eps=float("nan")), "sparsemixer_eps", "finite"),
                          (dict(rope_scaling={**cfg["rope_scaling"], "long_factor": [1.0]}), "rope_scaling",
                           "long_factor must be a list of 8")):
        with pytest.raises(ConfigError, match=msg) as e:
            ModelConfig.from_dict({**cfg, **bad})
        assert e.value.key == key
    for i, (fields, msg) in enumerate(((dict(flags=fmt.ROUTE_SOFTMAX), "sparsemixer flag disagrees"),
                                       (dict(flags=fmt.ROUTE_SOFTMAX | fmt.ROUTE_SPARSEMIXER | fmt.ROUTE_RENORM),
                                        "sparsemixer routing needs top_k 2"))):
        bad = _patched(path, tmp_path / f"bad{i}.colibri", 1, **fields)
        with pytest.raises(fmt.BadRouting, match=msg):
            Model.open(str(bad))


def test_the_released_class_name_converts_the_same(phi, tmp_path):
    """Phi-3.5-MoE's own config.json names PhiMoEForCausalLM (its remote code), not transformers' Phimoe...:
    a checkpoint so named converts to the same model."""
    import json
    import shutil
    _, d = phi
    shutil.copytree(d / "hf", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = ["PhiMoEForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    convert(str(tmp_path / "hf"), str(tmp_path / "f32.colibri"), "f32", progress=False)
    got = Model.open(str(tmp_path / "f32.colibri")).logits(PROMPT)
    assert np.array_equal(got, Model.open(str(d / "f32.colibri")).logits(PROMPT))
