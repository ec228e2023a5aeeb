"""Chat from the command line (issue 39 item 5): `colibri run --chat`, `colibri chat` and
`colibri generate --chat` send an instruct model its chat template's rendering of the messages,
and the answer ends at the model's end of turn."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from server_harness import Server

MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"}]


def _cli(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "colibri_server.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def _hf_template_ids(hf_dir, messages):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _answer(m, ids, n):
    """The greedy answer's text and ids, as the model streams them."""
    evs = list(m.stream(ids, max_tokens=n, temperature=0.0))
    return "".join(e.text for e in evs), [e.token_id for e in evs]


def test_chat_prompt_is_the_templates_rendering(built):
    from colibri_server.commands import chat
    from colibri_server.model import Model
    b = built("mixtral")
    path = b.colibri("f32")
    m = Model.open(path)
    want = _hf_template_ids(b.hf_dir, MESSAGES)
    assert chat.prompt_ids(m, chat.model_info(path), MESSAGES) == want


def test_run_chat_answers_the_templated_prompt(built):
    from colibri_server.model import Model
    b = built("mixtral")
    path = b.colibri("f32")
    text, _ = _answer(Model.open(path), _hf_template_ids(b.hf_dir, MESSAGES), 8)
    r = _cli("run", "--model", path, "--chat", MESSAGES[1]["content"], "--system", MESSAGES[0]["content"],
             "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"
    raw = _cli("run", "--model", path, MESSAGES[1]["content"], "--max-tokens", "8")
    assert raw.returncode == 0 and raw.stdout != r.stdout      # without --chat: a raw continuation


@pytest.fixture(scope="module")
def eot_model(built, tmp_path_factory):
    """The mixtral test model with its end-of-sequence token moved to the 4th token of its greedy answer
    to MESSAGES (a token it does emit there): (path, hf_dir, the answer's first 3 tokens' text)."""
    from colibri_server.model import Model
    from colibri_server.model.convert import convert
    b = built("mixtral")
    _, ids = _answer(Model.open(b.colibri("f32")), _hf_template_ids(b.hf_dir, MESSAGES), 8)
    k = next(i for i in range(3, 8) if ids[i] not in ids[:i])
    root = tmp_path_factory.mktemp("eot")
    hf = root / "hf"
    shutil.copytree(b.hf_dir, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["eos_token_id"] = ids[k]
    (hf / "config.json").write_text(json.dumps(cfg))
    path = str(root / "eot.colibri")
    convert(str(hf), path, "f32", progress=False)
    m = Model.open(path)
    return path, str(hf), m.tokenizer.decode(ids[:k]), k


def test_run_chat_stops_at_the_end_of_turn(eot_model):
    path, _, text, k = eot_model
    r = _cli("run", "--model", path, "--chat", MESSAGES[1]["content"], "--system", MESSAGES[0]["content"],
             "--max-tokens", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"
    assert f"[{k + 1} tokens;" in r.stderr          # the end-of-turn token ends it, and is not printed


def test_chat_converses_with_every_turn_in_the_prompt(built):
    from colibri_server.model import Model
    b = built("mixtral")
    path = b.colibri("f32")
    m = Model.open(path)
    turns = [{"role": "user", "content": "Hello there."}]
    first, _ = _answer(m, _hf_template_ids(b.hf_dir, turns), 6)
    turns += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second, _ = _answer(m, _hf_template_ids(b.hf_dir, turns), 6)
    r = _cli("chat", "--model", path, "--max-tokens", "6", stdin="Hello there.\n\nAnd then?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == first + "\n" + second + "\n"


def test_chat_needs_a_template(built, tmp_path):
    from colibri_server.model.convert import convert
    hf = tmp_path / "hf"
    shutil.copytree(built("mixtral").hf_dir, hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = str(tmp_path / "base.colibri")
    convert(str(hf), path, "f32", progress=False)
    for args in (("run", "--model", path, "--chat", "hi"), ("chat", "--model", path)):
        r = _cli(*args, stdin="hi\n")
        assert r.returncode == 1
        assert r.stderr.strip().splitlines() == [
            f"colibri: error: {path} has no chat template (a base model): chat needs one; "
            "give the prompt without --chat to continue raw text"], r.stderr


def test_generate_chat_through_a_server(built, tmp_path):
    from colibri_server.model import Model
    b = built("mixtral")
    path = b.colibri("f32")
    text, _ = _answer(Model.open(path), _hf_template_ids(b.hf_dir, MESSAGES), 8)
    s = Server(path, tmp_path, workers=1)
    try:
        s.wait_ready()
        r = _cli("generate", "--connect", s.addr, "--chat", MESSAGES[1]["content"], "--system",
                 MESSAGES[0]["content"], "--max-tokens", "8", timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout == text + "\n"
    finally:
        s.stop()
