"""Families beyond the first four (issue 17), each against transformers' own class on a tiny random
config: f32 logits within 1e-4 at every position, 32 greedy tokens identical through the model's
own decode and through the batched serving engine (sequences joining at different steps)."""
from __future__ import annotations

import numpy as np
import pytest

import hf_models as H
from colibri_server.model import Model
from colibri_server.model.convert import ConvertError, convert
from colibri_server.model.serving import BatchEngine

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


@pytest.mark.parametrize("arch", tuple(H.FAMILY_CONFIGS))
def test_family_matches_transformers(family, arch):
    hf, path, _ = family(arch)
    m = Model.open(path)
    ref = H.hf_logits(hf, PROMPT)
    got = m.logits(PROMPT)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
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


def test_granite_shared_experts_are_refused_by_name(tmp_path):
    H.build_hf_model("granitemoe", tmp_path / "hf")
    import json
    cfgp = tmp_path / "hf" / "config.json"
    c = json.loads(cfgp.read_text())
    c["shared_intermediate_size"] = 64
    cfgp.write_text(json.dumps(c))
    with pytest.raises(ConvertError, match="shared_intermediate_size"):
        convert(str(tmp_path / "hf"), str(tmp_path / "x.colibri"), "f32", progress=False)
