"""Dense families (issue 17, the degenerate case: every layer a dense MLP): LlamaForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM convert and run against transformers' own classes on tiny random
configs: f32 logits within 1e-4 at every position, 32 greedy tokens identical, through the model's own
decode and through the batched serving engine."""
from __future__ import annotations

import numpy as np
import pytest

import hf_models as H
from colibri_server.model import Model
from colibri_server.model.convert import ConvertError, convert
from colibri_server.model.serving import BatchEngine

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, size=40)]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            d = tmp_path_factory.mktemp(arch)
            hf = H.build_hf_model(arch, d / "hf")
            convert(str(d / "hf"), str(d / "f32.colibri"), "f32", progress=False)
            cache[arch] = (hf, str(d / "f32.colibri"))
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", tuple(H.DENSE_CONFIGS))
def test_dense_family_matches_transformers(dense, arch):
    hf, path = dense(arch)
    m = Model.open(path)
    assert m.config.num_experts == 0 and m.config.dense_layers == tuple(range(m.config.num_layers))
    ref = H.hf_logits(hf, PROMPT)
    got = m.logits(PROMPT)
    assert np.abs(got - ref).max() < 1e-4
    want = H.hf_greedy(hf, PROMPT[:8], 32)
    assert m.generate(PROMPT[:8], max_tokens=32, ignore_eos=True) == want
    eng = BatchEngine(m, max_seqs=4, max_batch_tokens=16, kv_dtype="f32")
    out = {}
    for i, p in enumerate((PROMPT[:8], PROMPT[5:20], PROMPT[:3])):
        eng.add(i, p, max_tokens=32 if i == 0 else 12, ignore_eos=True)
    while eng.has_work():
        for rid, ev in eng.step():
            out.setdefault(rid, []).append(ev.token_id)
    assert out[0] == want
    assert out[1] == H.hf_greedy(hf, PROMPT[5:20], 12) and out[2] == H.hf_greedy(hf, PROMPT[:3], 12)


def test_mlp_bias_is_refused_by_name(tmp_path):
    H.build_hf_model("llama", tmp_path / "hf", mlp_bias=True)
    with pytest.raises(ConvertError, match="mlp_bias"):
        convert(str(tmp_path / "hf"), str(tmp_path / "x.colibri"), "f32", progress=False)
