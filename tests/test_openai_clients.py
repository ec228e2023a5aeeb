"""Issue 39 item 12: what client libraries get from `serve --http`, through the official `openai`
package: logprobs `bytes` that rebuild the text, a function without `parameters` called with no
arguments, a tool call cut off by max_tokens returned as a partial tool call, and a streaming
request with tools that streams."""
from __future__ import annotations

import json
import time

import pytest

import hf_models as H
from test_openai_sampling import _stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "description": "check that the service is up"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def st(built, tmp_path_factory):
    """The random test Mixtral (context 1024: the tools' JSON goes in the prompt) behind the gateway."""
    from colibri_server.model.convert import convert
    tmp = tmp_path_factory.mktemp("oa-clients")
    H.build_hf_model("mixtral", str(tmp / "hf"), max_position_embeddings=1024)
    convert(str(tmp / "hf"), str(tmp / "m.colibri"), "f32", progress=False)
    yield from _stack(tmp, str(tmp / "m.colibri"))


def test_logprobs_bytes_are_each_tokens_own_bytes(st):
    """"ŷ" is two byte tokens of this vocabulary (0xC5, 0xB7), each decoding alone to U+FFFD: each
    entry's bytes are its own byte, and the entries' bytes concatenated are the answer's UTF-8."""
    r = st.oa.chat.completions.create(model=st.name, messages=ASK, max_tokens=8, logprobs=True, top_logprobs=3,
                                      extra_body={"structured_outputs": {"regex": "ŷ"}})
    c = r.choices[0]
    assert c.message.content == "ŷ"
    assert [e.token for e in c.logprobs.content] == ["\ufffd", "\ufffd"]
    assert [e.bytes for e in c.logprobs.content] == [[0xC5], [0xB7]]
    assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode() == c.message.content
    # the alternatives: each one's bytes are one token's, never the replacement character's UTF-8
    for e in c.logprobs.content:
        assert all(a.bytes != list("\ufffd".encode()) for a in e.top_logprobs)


def test_a_function_without_parameters_takes_no_arguments(st):
    """As OpenAI: no `parameters` is no arguments, so a call of it has the arguments {}."""
    for seed in range(3):
        r = st.oa.chat.completions.create(model=st.name, messages=ASK, tools=[PING, WEATHER], max_tokens=64,
                                          tool_choice={"type": "function", "function": {"name": "ping"}},
                                          temperature=1.0, seed=seed)
        call = r.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("ping", "{}")
        assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_tool_call_cut_off_by_max_tokens_is_a_partial_tool_call(st, choice):
    """As OpenAI: finish_reason length with tool_calls holding the call begun (its name, the arguments
    written so far), never the gateway's {"name": ...} envelope as content. Cut inside the name too."""
    whole = st.oa.chat.completions.create(model=st.name, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                          max_tokens=96, temperature=0.0)
    assert whole.choices[0].finish_reason == "tool_calls"
    args = whole.choices[0].message.tool_calls[0].function.arguments
    n = whole.usage.completion_tokens
    for cut in (2, n - 3):
        for stream in (False, True):
            kw = dict(model=st.name, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=cut,
                      temperature=0.0)
            if stream:
                chunks = list(st.oa.chat.completions.create(stream=True, **kw))
                deltas = [c.choices[0].delta for c in chunks if c.choices]
                assert not "".join(d.content or "" for d in deltas)
                calls = [t for d in deltas for t in d.tool_calls or ()]
                name = "".join(t.function.name or "" for t in calls if t.function)
                partial = "".join(t.function.arguments or "" for t in calls if t.function)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                r = st.oa.chat.completions.create(**kw)
                msg = r.choices[0].message
                assert msg.content is None and len(msg.tool_calls) == 1
                name, partial = msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments
                finish = [r.choices[0].finish_reason]
            assert finish == ["length"]
            assert name == "get_weather"
            if cut == 2:
                assert partial == ""
            else:
                assert partial and json.loads(args) != {} and args.replace(" ", "").startswith(
                    partial.replace(" ", "")), (partial, args)
