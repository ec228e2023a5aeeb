"""Issue 39 item 12: what client libraries get from `serve --http`, through the official `openai`
package: logprobs `bytes` that rebuild the text, a function without `parameters` called with no
arguments, a tool call cut off by max_tokens returned as a partial tool call, and a streaming
request with tools that streams."""
from __future__ import annotations

import json
import time

import hf_models as H
import pytest
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


def _stream(st, **kw):
    """The chunks of a streamed chat, each with the time it arrived."""
    out, t0 = [], time.monotonic()
    for c in st.oa.chat.completions.create(model=st.name, messages=ASK, stream=True, **kw):
        out.append((time.monotonic() - t0, c))
    return out


def test_a_streaming_chat_with_tools_streams_its_content(st):
    """tool_choice auto, an answer that is not a call: content deltas one by one as the tokens come (not one
    delta at the end), the same text as unstreamed."""
    kw = dict(tools=[WEATHER, PING], max_tokens=24, temperature=0.0)
    whole = st.oa.chat.completions.create(model=st.name, messages=ASK, **kw)
    assert whole.choices[0].message.tool_calls is None and whole.usage.completion_tokens == 24
    chunks = _stream(st, **kw)
    pieces = [c.choices[0].delta.content for _, c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) >= 12, pieces
    assert [c.choices[0].finish_reason for _, c in chunks if c.choices][-1] == "length"


def test_a_forced_tool_call_streams_as_openai_streams_it(st):
    """A named tool call: a first delta with the call's id, type and name, then its arguments in pieces as
    they are written; they add up to the unstreamed call's arguments; finish_reason tool_calls."""
    kw = dict(tools=[WEATHER, PING], max_tokens=96, temperature=0.0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = st.oa.chat.completions.create(model=st.name, messages=ASK, **kw)
    want = whole.choices[0].message.tool_calls[0].function
    chunks = _stream(st, **kw)
    calls = [t for _, c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert all(t.id is None and t.function.name is None and t.index == 0 for t in calls[1:])
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == json.loads(want.arguments)
    assert len(calls) >= 4, calls
    assert not any(c.choices[0].delta.content for _, c in chunks if c.choices)
    assert [c.choices[0].finish_reason for _, c in chunks if c.choices][-1] == "tool_calls"


def test_auto_holds_back_only_what_can_be_a_call():
    """Auto: text that cannot begin a call streams at once; the start of a listed tool's envelope is held
    to the end and comes out as one call; a held start that turns out to be text comes out as content."""
    from colibri_server.http.structured import Tools
    from colibri_server.http.toolstream import ToolStream
    tools = Tools.from_body({"tools": [WEATHER, PING]})
    ts = ToolStream(tools)
    assert ts.feed("  ") == [] and ts.feed("Hel") == [({"content": "  Hel"}, [])]
    assert ts.feed("lo") == [({"content": "lo"}, [])]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ts = ToolStream(tools)
    assert all(ts.feed(call[i:i + 5]) == [] for i in range(0, len(call), 5))
    out, fr = ts.finish(call, "stop")
    assert fr == "tool_calls" and out[0][0]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    ts = ToolStream(tools)
    assert ts.feed('{"name": "get_') == [] and ts.feed('time"') == [({"content": '{"name": "get_time"'}, [])]


def test_auto_recognises_a_call_written_arguments_first():
    """Auto: {"arguments": ..., "name": ...} is held until its object closes and comes out as the call;
    an object with another key, or an arguments-first object naming no listed tool, streams as content."""
    from colibri_server.http.structured import Tools
    from colibri_server.http.toolstream import ToolStream
    tools = Tools.from_body({"tools": [WEATHER, PING]})
    call = '{"arguments": {"city": "Paris"}, "name": "get_weather"}'
    ts = ToolStream(tools)
    assert all(ts.feed(call[i:i + 3]) == [] for i in range(0, len(call), 3))
    out, fr = ts.finish(call, "stop")
    assert fr == "tool_calls" and out[0][0]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    ts = ToolStream(tools)
    assert ts.feed('{"ar') == [] and ts.feed('tist": 1') == [({"content": '{"artist": 1'}, [])]
    ts = ToolStream(tools)
    other = '{"arguments": {}, "name": "nope"}'
    assert ts.feed(other[:-1]) == [] and ts.feed(other[-1]) == [({"content": other}, [])]

