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
