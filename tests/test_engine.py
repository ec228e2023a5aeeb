"""Model API behaviour: sampling, stopping, limits, routing noise, the `colibri run` CLI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from colibri_server.model import Model

PROMPT = [5, 9, 17, 33, 71, 60, 41, 300]


@pytest.fixture(scope="module")
def model(built):
    return Model.open(built("mixtral").colibri("f32"))


def test_greedy_is_deterministic_and_length_bounded(model):
    a = model.complete(PROMPT, max_tokens=12, ignore_eos=True)
    b = model.complete(PROMPT, max_tokens=12, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.finish_reason == "length" and a.prompt_tokens == len(PROMPT)
    assert a.text == model.tokenizer.decode(a.token_ids)
    assert a.timings["prefill_s"] > 0 and a.timings["decode_s"] > 0


def test_seeded_sampling_reproduces(model):
    kw = dict(max_tokens=16, temperature=1.5, top_p=0.95, ignore_eos=True)
    s1 = model.generate(PROMPT, seed=7, **kw)
    assert s1 == model.generate(PROMPT, seed=7, **kw)
    others = [model.generate(PROMPT, seed=s, **kw) for s in (8, 9, 10)]
    assert any(o != s1 for o in others)
    np.random.seed(0)          # the global numpy RNG plays no part
    assert model.generate(PROMPT, seed=7, **kw) == s1


def test_stop_token_ends_generation(model):
    free = model.generate(PROMPT, max_tokens=16, ignore_eos=True)
    stop_tok = free[5]
    first = free.index(stop_tok)
    c = model.complete(PROMPT, max_tokens=16, stop_token_ids=[stop_tok], ignore_eos=True)
    assert c.token_ids == free[:first + 1] and c.finish_reason == "stop"


def test_stop_string_cuts_text(model):
    full = model.complete(PROMPT, max_tokens=24, ignore_eos=True)
    text = full.text
    assert len(text) > 6
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = model.complete(PROMPT, max_tokens=24, stop=[stop], ignore_eos=True)
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]
    assert stop not in cut.text


def test_streamed_text_equals_decoded_text(model):
    events = list(model.stream(PROMPT, max_tokens=20, ignore_eos=True))
    assert [e.finish_reason for e in events[:-1]] == [None] * 19 and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == model.tokenizer.decode([e.token_id for e in events])


def test_text_prompt_round_trip(model):
    ids = model.tokenizer.encode("def add(a, b):\n    return a + b\n")
    assert model.tokenizer.decode(ids) == "def add(a, b):\n    return a + b\n"
    assert model.generate("def add(a, b):", max_tokens=4, ignore_eos=True) == \
        model.generate(model.tokenizer.encode("def add(a, b):"), max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("prompt,needle", [([], "empty"), ([5, 512], "512 at position 1"), ([-1], "-1")])
def test_bad_prompts_are_named(model, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        model.generate(prompt, max_tokens=2)


@pytest.mark.parametrize("param,value", [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0),
                                         ("top_k", -3), ("repetition_penalty", float("nan"))])
def test_bad_sampling_parameters_are_named(model, param, value):
    with pytest.raises(ValueError, match=param):
        model.generate(PROMPT, **{param: value})


def test_context_full_ends_with_length(built):
    m = Model.open(built("mixtral").colibri("f32"), context=12)
    c = m.complete(PROMPT, max_tokens=50, ignore_eos=True)
    assert c.finish_reason == "length" and len(PROMPT) + len(c.token_ids) == 13   # last token sampled, not fed
    with pytest.raises(ValueError, match="exceed the context of 12"):
        m.logits(list(range(3, 16)))


def test_routing_noise_off_by_default_and_seeded(built):
    path = built("qwen3_moe").colibri("f32")
    clean = Model.open(path)
    assert clean.noise is None
    ids = list(range(3, 40))
    base = clean.logits(ids)
    n1 = Model.open(path, routing_noise=2.0, seed=3).logits(ids)
    n2 = Model.open(path, routing_noise=2.0, seed=3).logits(ids)
    n3 = Model.open(path, routing_noise=2.0, seed=4).logits(ids)
    np.testing.assert_array_equal(n1, n2)
    assert np.abs(n1 - base).max() > 1e-3 and np.abs(n1 - n3).max() > 1e-3
    with pytest.raises(ValueError, match="routing noise"):
        Model.open(path, routing_noise=-1.0)


def test_cli_run_streams_text_and_reports_speed(built):
    path = built("mixtral").colibri("f32")
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "run", "--model", path, "--max-tokens", "8",
                        "--ignore-eos", "def f(x):"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = Model.open(path)
    assert r.stdout.rstrip("\n") == m.complete("def f(x):", max_tokens=8, ignore_eos=True).text.rstrip("\n")
    assert "tok/s" in r.stderr and "8 tokens" in r.stderr


def test_cli_run_embedding_bypasses_tokenizer(built, tmp_path):
    path = built("mixtral").colibri("f32")
    m = Model.open(path)
    emb = m.file.view("token_embd")[PROMPT].astype(np.float32)
    np.save(tmp_path / "e.npy", emb)
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "run", "--model", path, "--max-tokens", "5",
                        "--embedding", str(tmp_path / "e.npy")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = m.tokenizer.decode(m.generate(PROMPT, max_tokens=5, ignore_eos=True))
    assert r.stdout.rstrip("\n") == want.rstrip("\n")
    np.save(tmp_path / "bad.npy", np.zeros((3, 7), np.float32))
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "run", "--model", path,
                        "--embedding", str(tmp_path / "bad.npy")], capture_output=True, text=True)
    assert r.returncode == 1 and "expected (T, 64)" in r.stderr


def test_cli_missing_model_is_named(tmp_path):
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "run", "--model", str(tmp_path / "none.colibri"),
                        "hi"], capture_output=True, text=True)
    assert r.returncode == 1 and "model file not found" in r.stderr and "none.colibri" in r.stderr
