"""Issue 19, item 1: logprobs, n, presence/frequency penalties, logit_bias and echo, end to end: the
native client against a real `colibri serve` (f32 file and f32 KV cache: the exact path), and the
official `openai` package against the gateway in front of it.

Every number is checked against the model itself: logprobs against a log-softmax of `Model.logits`
on the same tokens (1e-5), penalties and biases against a greedy loop over `Model.logits` that
applies OpenAI's definitions by hand, and `n` against the worker's own prefill counter.
"""
from __future__ import annotations

import json
import os
import sys

import hf_models as H
import numpy as np
import openai
import pytest
import requests
from server_harness import Server
from test_http import KEY, ROOT, Gateway, free_port

from colibri_server.model import Model

TOL = 1e-5


def _stack(tmp, path, extra=()):
    class S:
        pass
    s = S()
    s.model = Model.open(path)
    s.server = Server(path, tmp, workers=1, name="s", extra=list(extra))
    port = free_port()
    s.url = f"http://127.0.0.1:{port}"
    s.gateway = Gateway([sys.executable, "-m", "gunicorn", "colibri_server.http:app_from_env()",
                         "-c", os.path.join(ROOT, "configs", "gunicorn.conf.py"),
                         "--bind", f"127.0.0.1:{port}", "--threads", "2"],
                        {"COLIBRI_HTTP_CONNECT": s.server.addr, "COLIBRI_HTTP_API_KEY": KEY}, tmp / "gateway.log")
    try:
        s.server.wait_ready(1)
        s.gateway.wait_listening(s.url)
        s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        s.name = s.oa.models.list().data[0].id
        yield s
    finally:
        s.gateway.stop()
        s.server.stop()


@pytest.fixture(scope="module")
def st(built, tmp_path_factory):
    """The random test Mixtral with a context of 1024 (the tools' JSON goes in the prompt: 300 tokens of its
    512-token vocabulary), f32 file and f32 KV cache: logprobs compare with Model.logits exactly."""
    from colibri_server.model.convert import convert
    tmp = tmp_path_factory.mktemp("oa-sampling")
    H.build_hf_model("mixtral", str(tmp / "hf"), max_position_embeddings=1024)
    convert(str(tmp / "hf"), str(tmp / "m.colibri"), "f32", progress=False)
    yield from _stack(tmp, str(tmp / "m.colibri"), ["--kv-dtype", "f32"])


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 64, 128, 200, 33, 90, 11, 21, 150]


def test_logprobs_of_sampled_and_prompt_tokens_are_the_models_log_softmax(st):
    """Native client: each sampled token's logprob and its 5 top alternatives (ids and values), and every
    prompt token's, equal a log-softmax of Model.logits over prompt + completion (1e-5)."""
    with st.server.client(60) as c:
        r = c.generate(PROMPT, max_tokens=8, temperature=0.9, seed=4, logprobs=5, prompt_logprobs=3,
                       ignore_eos=True)
    ids = PROMPT + r.token_ids
    ref = log_softmax(st.model.logits(ids))                                # row i predicts token i+1
    assert len(r.logprobs) == len(r.token_ids) == 8
    for k, (t, e) in enumerate(zip(r.token_ids, r.logprobs)):
        row = ref[len(PROMPT) - 1 + k]
        assert abs(e[1] - row[t]) < TOL
        top = [a[0] for a in e[2]]
        assert top == list(np.argsort(-row, kind="stable")[:5])
        assert max(abs(a[2] - row[a[0]]) for a in e[2]) < TOL
        assert e[0] == st.model.tokenizer.token_text(t)
    p = r.prompt_logprobs
    assert len(p) == len(PROMPT) and p[0][1] is None and p[0][2] == []
    assert max(abs(p[i][1] - ref[i - 1][PROMPT[i]]) for i in range(1, len(PROMPT))) < TOL
    assert all(len(e[2]) == 3 for e in p[1:])
    # streamed: the same entries, one per token, and the prompt's with the first token
    with st.server.client(60) as c:
        chunks = list(c.stream(PROMPT, max_tokens=8, temperature=0.9, seed=4, logprobs=5, prompt_logprobs=3,
                               ignore_eos=True))
    streamed = [e for ch in chunks if not ch.is_final for e in ch.logprobs]
    assert streamed == r.logprobs and chunks[0].prompt_logprobs == r.prompt_logprobs


def test_n_completions_come_from_one_prefill(st):
    """n = 4 sampled completions: four different texts, each of max_tokens, usage counting all four, the
    same four again for the same seed, and the worker's prefill counter grows by the prompt once."""
    prompt = list(range(40, 40 + 37))
    before = settled_prefill(st.server)
    with st.server.client(60) as c:
        r = c.generate(prompt, max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True)
        again = c.generate(prompt, max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert all(len(ch.token_ids) == 6 and ch.finish_reason == "length" for ch in r.choices)
    assert len({tuple(ch.token_ids) for ch in r.choices}) > 1
    assert r.token_ids == r.choices[0].token_ids and r.usage["completion_tokens"] == 24
    assert [ch.token_ids for ch in again.choices] == [ch.token_ids for ch in r.choices]
    grown = settled_prefill(st.server) - before
    # the second request found the prompt's two full blocks in the prefix cache: only its tail is computed
    assert grown == len(prompt) + (len(prompt) - 32), grown


def settled_prefill(server, quiet=2.5):
    """The worker's prefill counter once heartbeats (every second) have stopped changing it."""
    import time
    last, since = None, time.monotonic()
    while True:
        v = server.stats()["workers"][0]["engine"].get("prefill_tokens", 0)
        if v != last:
            last, since = v, time.monotonic()
        elif time.monotonic() - since > quiet:
            return v
        time.sleep(0.2)


def greedy_reference(model, prompt, steps, presence=0.0, frequency=0.0, bias=None):
    """OpenAI's penalties by hand: logit -= count * frequency + (count > 0) * presence; plus the bias."""
    out, counts = [], {}
    for _ in range(steps):
        x = model.logits(prompt + out)[-1].astype(np.float64)
        for t, b in (bias or {}).items():
            x[t] += b
        for t, n in counts.items():
            x[t] -= n * frequency + presence
        t = int(np.argmax(x))
        out.append(t)
        counts[t] = counts.get(t, 0) + 1
    return out


# greedy on the random test model never repeats a token by itself: the positive penalties are checked
# where a bias makes token 129 come back (the precondition below: the penalty changes the output)
@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.0, logit_bias={129: 4.0}),
                                dict(presence_penalty=2.0, logit_bias={129: 4.0}),
                                dict(frequency_penalty=-2.0), dict(presence_penalty=-2.0),
                                dict(presence_penalty=-1.0, frequency_penalty=0.5)])
def test_presence_and_frequency_penalties_follow_openai(st, kw):
    bias = kw.get("logit_bias")
    with st.server.client(60) as c:
        got = c.generate(PROMPT, max_tokens=16, ignore_eos=True, **kw).token_ids
    want = greedy_reference(st.model, PROMPT, 16, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0),
                            bias)
    assert want != greedy_reference(st.model, PROMPT, 16, bias=bias)      # the penalty matters here
    assert got == want


def test_logit_bias_moves_the_choice_and_is_checked_against_the_vocabulary(st):
    with st.server.client(60) as c:
        plain = c.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids
        banned = c.generate(PROMPT, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100}).token_ids
        forced = c.generate(PROMPT, max_tokens=4, ignore_eos=True, logit_bias={77: 100}).token_ids
        with pytest.raises(Exception) as e:
            c.generate(PROMPT, max_tokens=2, logit_bias={st.model.config.vocab_size: 1})
    assert banned == greedy_reference(st.model, PROMPT, 6, bias={plain[0]: -100}) and banned[0] != plain[0]
    assert forced == [77] * 4
    assert e.value.code == "bad_request" and "outside the vocabulary" in e.value.message


# ---------------------------------------------------------------------------- through the gateway


def test_openai_chat_logprobs_and_n_sync_and_streaming(st):
    msgs = [{"role": "user", "content": "def f():"}]
    r = st.oa.chat.completions.create(model=st.name, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    c0 = r.choices[0]
    content = c0.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content).strip() != "" or c0.message.content == ""
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=TOL)    # greedy: the top one
        # a whole character's token: its text's UTF-8; part of one (U+FFFD): its own byte(s), never U+FFFD's
        assert e.bytes == list(e.token.encode("utf-8")) if "\ufffd" not in e.token else \
            e.bytes != list("\ufffd".encode())
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == c0.message.content
    chunks = list(st.oa.chat.completions.create(model=st.name, messages=msgs, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for ch in chunks for cc in ch.choices if cc.logprobs for e in cc.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOL
    # n = 3 sampled: three choices, streamed pieces joined per index equal the non-streamed texts
    kw = dict(model=st.name, messages=msgs, max_tokens=8, temperature=1.0, seed=3, n=3)
    full = st.oa.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = {0: "", 1: "", 2: ""}
    finals = {}
    for ch in st.oa.chat.completions.create(stream=True, **kw):
        for cc in ch.choices:
            texts[cc.index] += cc.delta.content or ""
            if cc.finish_reason:
                finals[cc.index] = cc.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert finals == {c.index: c.finish_reason for c in full.choices}


def test_openai_completions_echo_scores_a_text_like_an_evaluation_harness(st):
    """echo + logprobs + max_tokens 0: the prompt's tokens and logprobs (the first null), nothing generated;
    the values are the model's log-softmax."""
    ids = PROMPT[:10]
    r = st.oa.completions.create(model=st.name, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    ref = log_softmax(st.model.logits(ids))
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert max(abs(lp.token_logprobs[i] - ref[i - 1][ids[i]]) for i in range(1, len(ids))) < TOL
    assert r.choices[0].text == "".join(lp.tokens) and r.usage.completion_tokens == 0
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    # echo with a completion: the prompt text, then the completion's tokens and logprobs
    r2 = st.oa.completions.create(model=st.name, prompt="def main(args):", max_tokens=4, echo=True, logprobs=1,
                                  temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"50": -100})
    c2 = r2.choices[0]
    assert c2.text.startswith("def main(args):") and len(c2.logprobs.tokens) == r2.usage.prompt_tokens + 4
    # streamed echo: the prompt first, then the same completion
    chunks = list(st.oa.completions.create(model=st.name, prompt="def main(args):", max_tokens=4, echo=True,
                                           logprobs=1, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                                           logit_bias={"50": -100}, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c2.text


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"), ({"echo": "yes"}, "echo")])
def test_bad_sampling_fields_name_the_field(st, body, param):
    r = requests.post(st.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------- structured output and tools

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "units": {"enum": ["C", "F"]}},
          "required": ["city", "days", "units"], "additionalProperties": False}
# small: the tools go in the prompt, about 300 tokens of the test model's 512-token vocabulary
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a"]}}}]


def test_openai_response_format_json_schema_and_json_object_validate(st):
    import jsonschema
    msgs = [{"role": "user", "content": "weather?"}]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    r = st.oa.chat.completions.create(model=st.name, messages=msgs, max_tokens=100, temperature=0, response_format=rf)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    text = "".join(ch.choices[0].delta.content or "" for ch in st.oa.chat.completions.create(
        model=st.name, messages=msgs, max_tokens=100, temperature=0, response_format=rf, stream=True) if ch.choices)
    assert text == r.choices[0].message.content
    r = st.oa.chat.completions.create(model=st.name, messages=msgs, max_tokens=100, temperature=0.7, seed=1,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = st.oa.completions.create(model=st.name, prompt="x", max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_openai_tool_calls_parse_and_name_a_listed_tool(st, tool_choice):
    import jsonschema
    msgs = [{"role": "user", "content": "2+3?"}]
    for stream in (False, True):
        kw = dict(model=st.name, messages=msgs, max_tokens=40, temperature=0, tools=TOOLS, tool_choice=tool_choice)
        if not stream:
            r = st.oa.chat.completions.create(**kw)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None
            call = c.message.tool_calls[0]
            name, args = call.function.name, call.function.arguments
        else:
            chunks = list(st.oa.chat.completions.create(stream=True, **kw))
            deltas = [cc.delta.tool_calls[0] for ch in chunks for cc in ch.choices if cc.delta.tool_calls]
            assert [cc.finish_reason for ch in chunks for cc in ch.choices if cc.finish_reason] == ["tool_calls"]
            call = deltas[0]                  # the call's id, type and name, then its arguments in pieces
            name, args = call.function.name, "".join(d.function.arguments or "" for d in deltas)
        assert call.id.startswith("call_") and call.type == "function"
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        assert name in params and (tool_choice == "required" or name == "add")
        jsonschema.validate(json.loads(args), params[name])
    # the call and its result go back in the conversation: the next turn is accepted
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = st.oa.chat.completions.create(model=st.name, messages=follow, max_tokens=8, temperature=0, tools=TOOLS,
                                      tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


# parameters as Pydantic writes them: the nested model under $defs, reached by $ref; the older
# "definitions" spelling; and a reference to the parameters' own root
TOOLS_REFS = [{"type": "function", "function": {"name": "weather", "parameters": {
                  "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                                    "required": ["city"], "additionalProperties": False}},
                  "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
                  "additionalProperties": False}}},
              {"type": "function", "function": {"name": "add", "parameters": {
                  "definitions": {"Digit": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "type": "object", "properties": {"a": {"$ref": "#/definitions/Digit"},
                                                   "more": {"$ref": "#"}},
                  "required": ["a"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}},
                                         {"type": "function", "function": {"name": "add"}}])
def test_tool_parameters_with_refs_compile_and_the_call_validates(st, tool_choice):
    """Issue 38 item 2: parameters with $defs/$ref/definitions (Pydantic's output) nested under the
    call's "arguments" kept their references working: the call validates against the parameters."""
    import jsonschema
    r = st.oa.chat.completions.create(model=st.name, messages=[{"role": "user", "content": "go"}], max_tokens=60,
                                      temperature=0, tools=TOOLS_REFS, tool_choice=tool_choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0].function
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS_REFS}
    assert tool_choice == "required" or call.name == tool_choice["function"]["name"]
    jsonschema.validate(json.loads(call.arguments), params[call.name])


def test_auto_tool_choice_returns_a_call_only_when_the_output_is_one(st):
    from colibri_server.http.structured import Tools
    t = Tools.from_body({"tools": TOOLS})
    assert t.choice == "auto" and t.grammar() is None
    call = t.parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert call[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert t.parse('```json\n{"name": "weather", "arguments": {}}\n```')[0]["function"]["name"] == "weather"
    assert t.parse('{"name": "rm", "arguments": {}}') is None and t.parse("just text") is None
    r = st.oa.chat.completions.create(model=st.name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                      temperature=0, tools=TOOLS)
    c = r.choices[0]
    assert (c.message.tool_calls is None) == (c.finish_reason != "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice")])
def test_bad_structured_fields_name_the_field(st, body, param):
    r = requests.post(st.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------- embeddings input


def test_prompt_embeds_answer_as_the_tokens_they_embed(st):
    """A prompt given as its token embeddings (the f32 file's rows) answers as the token ids do, over the
    native client (an array) and the gateway (base64 and lists); a wrong width is refused by name."""
    import base64
    ids = PROMPT[:12]
    E = np.asarray(st.model.weights.token_embd[ids], np.float32)
    with st.server.client(60) as c:
        want = c.generate(ids, max_tokens=8, ignore_eos=True)
        got = c.generate(None, max_tokens=8, ignore_eos=True, prompt_embeds=E)
        two = c.generate(None, max_tokens=8, ignore_eos=True, prompt_embeds=E, n=2, temperature=0)
        with pytest.raises(Exception) as e:
            c.generate(None, max_tokens=2, prompt_embeds=E[:, :-1])
    assert got.token_ids == want.token_ids and got.usage["prompt_tokens"] == len(ids)
    assert [ch.token_ids for ch in two.choices] == [want.token_ids] * 2
    assert e.value.code == "bad_request" and "prompt_embeds" in e.value.message
    b64 = base64.b64encode(E.astype("<f4").tobytes()).decode()
    for pe in (b64, E.tolist()):
        r = st.oa.completions.create(model=st.name, prompt=None, max_tokens=8, temperature=0,
                                     extra_body={"prompt_embeds": pe, "ignore_eos": True})
        assert r.choices[0].text == want.text
    r = requests.post(st.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"prompt_embeds": base64.b64encode(E[:, :-1].tobytes()).decode(), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text


def test_an_unsatisfiable_schema_is_an_error_naming_the_grammar(st):
    """Issue 38 item 3 over HTTP: never "content": "{" with finish_reason stop."""
    schema = {"$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}},
              "$ref": "#/$defs/n"}
    r = requests.post(st.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 20,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("grammar: "), r.text
