"""GPT-OSS beyond the parity in test_families: an MXFP4 checkpoint (the released form: experts as 4-bit
blocks with e8m0 scales) converts to transformers' logits on the dequantized weights; each of its own
parts changes the logits (so the parity checks all of them); threads give the same tokens; the kernels
with sinks and the clamped SwiGLU against their twins; the format's new flag and config keys get named
errors."""
from __future__ import annotations

import json

import hf_models as H
import numpy as np
import pytest
import torch

from colibri_server.model import Model
from colibri_server.model import kernels as K
from colibri_server.model.convert import convert
from colibri_server.model.kernels import paged as KP
from colibri_server.model.kernels import tiled as KT
from colibri_server.model.mxfp4 import E2M1, dequantize

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    hf = H.build_hf_model("gpt_oss", d / "hf")
    convert(str(d / "hf"), str(d / "f32.colibri"), "f32", progress=False)
    return hf, d


def mxfp4_quantize(w: np.ndarray):
    """A parameter (cols, rows) -> GPT-OSS's MXFP4 blocks (rows, cols/32, 16) and scales (rows, cols/32): each
    block of 32 scaled by the power of two that puts its largest magnitude at or under 6, each value the
    nearest e2m1."""
    t = np.ascontiguousarray(w.T, np.float32)
    rows, cols = t.shape
    g = t.reshape(rows, cols // 32, 32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = g / np.exp2(e)[..., None]
    mag = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(-1)
    code = (mag + np.where(scaled < 0, 8, 0)).astype(np.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8), (e + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """The experts written as MXFP4 blocks and scales (as gpt-oss-20b ships them), transformers' model given
    the dequantized values."""
    from safetensors.numpy import load_file, save_file
    d = tmp_path_factory.mktemp("mxfp4")
    hf = H.build_hf_model("gpt_oss", d / "hf")
    st = d / "hf" / "model.safetensors"
    tensors = load_file(str(st))
    state = dict(hf.named_parameters())
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)                                        # (E, cols, rows) as x @ W
        blocks, scales = zip(*(mxfp4_quantize(w[e]) for e in range(w.shape[0])))
        tensors[name + "_blocks"], tensors[name + "_scales"] = np.stack(blocks), np.stack(scales)
        deq = np.stack([dequantize(b, s).T for b, s in zip(blocks, scales)])
        assert 0 < np.abs(deq - w).max() < 0.3 * np.abs(w).max()    # rounded, onto a coarse grid
        with torch.no_grad():
            state[name].copy_(torch.from_numpy(deq))
    save_file(tensors, str(st), metadata={"format": "pt"})
    return hf, d


def test_an_mxfp4_checkpoint_matches_transformers_on_its_values(mx):
    """The experts are kept as MXFP4 (llama.cpp's block kind, the checkpoint's bytes reordered), so the file
    holds 17 bytes per 32 expert weights; the converted file's logits are within 1e-4 of transformers' on the
    dequantized values, 32 greedy tokens identical."""
    hf, d = mx
    errors = {}
    cfg = convert(str(d / "hf"), str(d / "m.colibri"), "f32", progress=False, errors=errors)
    assert cfg.block_types and set(cfg.block_types) == {n for n in cfg.block_types if n.endswith(
        ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))} and set(cfg.block_types.values()) == {"mxfp4"}
    assert len(cfg.block_types) == 3 * cfg.num_layers
    from colibri_server.model import format as fmt
    cf = fmt.ColibriFile.open(d / "m.colibri")
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert len(bytes(cf.tensor_bytes("blk.0.ffn_gate_exps"))) == E * I * D // 32 * 17
    cf.close()
    assert max(errors.values()) == 0                   # the other tensors: f32 holds them exactly
    m = Model.open(str(d / "m.colibri"))
    ref = H.hf_logits(hf, PROMPT)
    assert np.abs(m.logits(PROMPT) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    assert m.generate(PROMPT[:8], max_tokens=32, ignore_eos=True) == H.hf_greedy(hf, PROMPT[:8], 32)


def test_mxfp4_re_encoding_states_its_error(mx):
    """`colibri convert` of an MXFP4 checkpoint to q8 prints the experts' error against the MXFP4 values."""
    import subprocess
    import sys
    _, d = mx
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "convert", str(d / "hf"), str(d / "q8.colibri"),
                        "--dtype", "f32", "--quantize", "q8", "--quant-group", "32", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("MXFP4 experts re-encoded as q8")]
    assert line, r.stderr
    mean = float(line[0].split("mean ")[1].split(",")[0])
    assert 1e-4 < mean < 0.05, line


def test_broken_mxfp4_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from colibri_server.model.convert import ConvertError
    H.build_hf_model("gpt_oss", tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(st))
    name = "model.layers.1.mlp.experts.down_proj"
    w = tensors.pop(name)
    b, s = mxfp4_quantize(w[0])
    tensors[name + "_blocks"] = np.stack([b] * w.shape[0])
    tensors[name + "_scales"] = np.stack([s[:, :-1] if s.shape[1] > 1 else s[:-1]] * w.shape[0])
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=f"MXFP4 tensor '{name}'"):
        convert(str(tmp_path / "hf"), str(tmp_path / "m.colibri"), "f32", progress=False)
    assert not (tmp_path / "m.colibri").exists()


@pytest.mark.parametrize("change", ["sinks", "sliding", "router_bias", "expert_bias", "limit"])
def test_each_part_changes_the_logits(oss, change):
    """Switching one GPT-OSS part off in transformers' model moves its logits well beyond the parity
    tolerance, so test_families' parity covers that part."""
    hf, _ = oss
    base = H.hf_logits(hf, PROMPT)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    saved = {}
    with torch.no_grad():
        if change == "sinks":
            saved["p"] = attn.sinks.clone()
            attn.sinks.fill_(-1e4)
        elif change == "router_bias":
            saved["p"] = mlp.router.bias.clone()
            mlp.router.bias.zero_()
        elif change == "expert_bias":
            saved["p"] = mlp.experts.gate_up_proj_bias.clone()
            mlp.experts.gate_up_proj_bias.zero_()
    if change == "sliding":
        saved["w"] = attn.sliding_window
        hf.config.layer_types = ["full_attention"] * 3
    if change == "limit":
        saved["l"] = mlp.experts.limit
        mlp.experts.limit = 1e9
    try:
        moved = np.abs(H.hf_logits(hf, PROMPT) - base).max()
    finally:
        with torch.no_grad():
            if change == "sinks":
                attn.sinks.copy_(saved["p"])
            elif change == "router_bias":
                mlp.router.bias.copy_(saved["p"])
            elif change == "expert_bias":
                mlp.experts.gate_up_proj_bias.copy_(saved["p"])
        if change == "sliding":
            hf.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        if change == "limit":
            mlp.experts.limit = saved["l"]
    assert np.abs(H.hf_logits(hf, PROMPT) - base).max() == 0
    assert moved > 100 * 1e-4 * np.abs(base).max(), (change, moved)


def test_threads_give_the_same_tokens(oss):
    hf, d = oss
    two = Model.open(str(d / "f32.colibri"))
    two.set_threads(2)
    want = H.hf_greedy(hf, PROMPT[:8], 24)
    assert two.generate(PROMPT[:8], max_tokens=24, ignore_eos=True) == want
    assert H.engine_tokens(two, [(PROMPT[:8], 24), (PROMPT[3:30], 8)]) == [want, H.hf_greedy(hf, PROMPT[3:30], 8)]


def test_attention_with_sinks_is_its_twin():
    rng = np.random.default_rng(0)
    T, H_, Hkv, S, hd, start, window = 3, 4, 2, 24, 16, 9, 6
    q = rng.standard_normal((T, H_, hd)).astype(np.float32)
    k = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    v = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    sinks = (2 * rng.standard_normal(H_)).astype(np.float32)
    sinks.setflags(write=False)     # read-only as a model's sinks: the kernels' signature a served model compiles
    ref = K.attention_ref(q, k, v, start, window, 0.3, sinks=sinks)
    assert not np.allclose(ref, K.attention_ref(q, k, v, start, window, 0.3), atol=1e-3)
    out = np.zeros_like(q)
    K.attention(q, k, v, start, window, 0.3, out, np.empty(H_ // Hkv * S, np.float32), sinks)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    par = np.zeros_like(q)
    K.attention_par(q, k, v, start, window, 0.3, par, np.empty((Hkv, H_ // Hkv * S), np.float32), sinks)
    np.testing.assert_array_equal(par, out)
    # the paged pool: the same keys in blocks of 4
    BS = 4
    kp = k.reshape(Hkv, S // BS, BS, hd).transpose(1, 0, 2, 3).copy()
    vp = v.reshape(Hkv, S // BS, BS, hd).transpose(1, 0, 2, 3).copy()
    tables = np.arange(S // BS, dtype=np.int32)[None]
    pos = np.arange(start, start + T)
    pref = KP.paged_attention_ref(q, kp, vp, tables, np.zeros(T, np.int64), pos, window, 0.3, sinks=sinks)
    np.testing.assert_allclose(pref, ref, rtol=1e-5, atol=2e-6)
    for kernel in (KT.tiled_attention, lambda *a: KT.tiled_attention_par(*a, 2)):
        o = np.zeros_like(q)
        kernel(q, kp, vp, tables, np.zeros(T, np.int64), pos, window, 0.3, o, sinks)
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=2e-6)


def test_clamped_swiglu_is_its_twin():
    rng = np.random.default_rng(0)
    g, u = (3 * rng.standard_normal((5, 40))).astype(np.float32), (3 * rng.standard_normal((5, 40))).astype(np.float32)
    b1, b3 = rng.standard_normal(40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    ref = K.swiglu_clamped_ref(g, u, b1, b3, 1.702, 2.0)
    out = np.zeros_like(g)
    K.swiglu_clamped(g, u, b1, b3, 1.702, 2.0, out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    K.swiglu_clamped(g, u, b1, b3, 1.702, 2.0, g)                  # in place
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)


def test_new_fields_get_named_errors(oss, tmp_path):
    from colibri_server.model import format as fmt
    from colibri_server.model.config import ConfigError, ModelConfig
    _, d = oss
    path = str(d / "f32.colibri")
    cfg = Model.open(path).config.to_dict()
    assert cfg["sliding_layers"] == [0, 2] and cfg["attn_sinks"] and cfg["router_bias"] and cfg["expert_bias"]
    for bad, key, msg in ((dict(sliding_layers=[5]), "sliding_layers", "outside"),
                          (dict(sliding_window=0), "sliding_layers", "without a sliding_window"),
                          (dict(swiglu_limit=0.0), "expert_bias", "clamped SwiGLU"),
                          (dict(swiglu_alpha=-1.0), "swiglu_alpha", "> 0"),
                          (dict(correction_bias=True), "router_bias", "one bias")):
        with pytest.raises(ConfigError, match=msg) as e:
            ModelConfig.from_dict({**cfg, **bad})
        assert e.value.key == key
    new = ("sliding_layers", "attn_sinks", "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha")
    plain = ModelConfig.from_dict({k: v for k, v in cfg.items() if k not in new})
    assert not set(new) & set(plain.to_dict())          # left out at their defaults: older files read the same
    cf = fmt.ColibriFile.open(path)
    assert cf.header["version"] == 2 and cf.routing[0].flags & fmt.ROUTE_BIAS_IN_LOGITS
    cf.close()
    from test_families import _patched
    for i, (fields, err, msg) in enumerate((
            (dict(bias=fmt.NO_TENSOR), fmt.BadRouting, "bias-in-logits flag without a bias"),
            (dict(flags=fmt.ROUTE_SOFTMAX | fmt.ROUTE_RENORM), fmt.BadRouting, "router bias disagrees"))):
        bad = _patched(path, tmp_path / f"bad{i}.colibri", 0, **fields)
        with pytest.raises(err, match=msg):
            Model.open(str(bad))


def test_converter_reads_the_layer_types(tmp_path):
    """A layer_types list of the wrong length or with an unknown type is refused by name; all full layers
    mean no sliding window at all."""
    from colibri_server.model.convert import ConvertError
    H.build_hf_model("gpt_oss", tmp_path / "hf")
    p = tmp_path / "hf" / "config.json"
    cfg = json.loads(p.read_text())
    p.write_text(json.dumps({**cfg, "layer_types": ["full_attention"]}))
    with pytest.raises(ConvertError, match="layer_types"):
        convert(str(tmp_path / "hf"), str(tmp_path / "m.colibri"), "f32", progress=False)
    p.write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 3}))
    c = convert(str(tmp_path / "hf"), str(tmp_path / "m.colibri"), "f32", progress=False)
    assert c.sliding_window == 0 and c.sliding_layers == ()
