"""The gateway's two generation endpoints, POST /v1/completions and /v1/chat/completions: the OpenAI
request turned into a colibri generate (sampling fields, logprobs, n, echo, prompt_embeds, grammar,
tools), and the answer shaped as OpenAI's, whole or as server-sent events. `Generations` is held by
app.Gateway, whose generation core (start, generate, events, streaming) talks to the server.

Owns: the mapping of these two endpoints. Never: opens sockets or reads HTTP bodies (the Gateway does).
"""
from __future__ import annotations

import time

from ..wire.protocol import SAMPLING_FIELDS
from .openai import (
    _CHAT_FIELDS,
    _COMPLETION_FIELDS,
    _bad,
    _chat_messages,
    _chat_unsupported,
    _check_known,
    _completion_prompt,
    _Fields,
    _json,
    _Resp,
    _sampling,
    _stream_options,
    chat_logprobs,
    chat_logprobs_obj,
    completion_embeds,
    completion_logprobs,
    legacy_logprobs_obj,
)
from .structured import Tools, messages_for_template, response_grammar
from .template import render_chat_segments
from .toolstream import ToolStream

DEFAULT_MAX_TOKENS = SAMPLING_FIELDS["max_tokens"].default   # /v1/completions: the protocol's (16, as in OpenAI)


class Generations:
    """The two generating endpoints, /v1/completions and /v1/chat/completions, on the gateway's
    plumbing (`gw`: reads and checks a body, checks the model, starts a generation on the router,
    answers it whole or as a stream)."""

    def __init__(self, gw):
        self.gw = gw

    def completions(self, environ) -> _Resp:
        body = self.gw.read_json(environ)
        _check_known(body, _COMPLETION_FIELDS)
        f = _Fields(body)
        embeds = completion_embeds(body)
        prompt = _completion_prompt(body) if embeds is None else None
        echo = f.bool("echo", False)
        if echo and embeds is not None:
            raise _bad("'echo' needs a prompt of tokens, not prompt_embeds", "echo")
        score_only = echo and body.get("max_tokens") == 0       # echo of a scored prompt, nothing generated
        params = _sampling(_Fields({**body, "max_tokens": 1}) if score_only else f, DEFAULT_MAX_TOKENS, chat=False)
        stream_mode = f.bool("stream", False)
        include_usage = _stream_options(f, stream_mode)
        lp = completion_logprobs(f)
        if lp is not None:
            params["logprobs"] = lp
            if echo:
                params["prompt_logprobs"] = lp
        f.neutral("suffix", [], "suffix must be null")
        if embeds is not None:
            params["prompt_embeds"] = embeds
        grammar = response_grammar(body)
        if grammar is not None:
            params["grammar"] = grammar
        info = self.gw.check_model(f)
        # a raw prompt's special-token text is its control tokens (ChatML's <|im_start|> one id), as
        # llama.cpp's server and vLLM read it; a chat message's content never is (chat_completions)
        ids = prompt
        if isinstance(prompt, str):
            ids = self.gw.call(lambda c: c.tokenize([(prompt, True)]), "prompt")
            if not ids:
                raise _bad("'prompt' encodes to no tokens", "prompt")
        params["request_id"] = environ["colibri.request_id"]
        rid, created = "cmpl-" + params["request_id"], int(time.time())
        n = params.get("n", 1)

        def obj(choices, usage=None):
            o = {"id": rid, "object": "text_completion", "created": created, "model": info.name,
                 "system_fingerprint": None, "choices": choices}
            if usage is not None or include_usage:
                o["usage"] = usage
            return o

        def choice(i, text, fr, entries=None, offset=0):
            return {"text": text, "index": i, "finish_reason": fr,
                    "logprobs": legacy_logprobs_obj(entries, offset) if lp is not None else None}

        def echoed(prompt_entries):
            """The prompt's text (as given, or its tokens' text) and its logprob entries."""
            if isinstance(prompt, str):
                return prompt, prompt_entries
            return "".join(e[0] for e in prompt_entries or ()) if prompt_entries else \
                self.gw.call(lambda c: c.detokenize(prompt), "prompt"), prompt_entries

        if not stream_mode:
            _, final = self.gw.generate(ids, params, "prompt", environ)
            head, head_lp = echoed(final.prompt_logprobs) if echo else ("", [])
            choices = [choice(c.index, head + ("" if score_only else c.text), "length" if score_only else
                              c.finish_reason, (head_lp or []) + ([] if score_only else c.logprobs or []))
                       for c in final.choices]
            usage = self.gw.usage(final)
            if score_only:
                usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
            return _json(obj(choices, usage))
        stream, first = self.gw.start(ids, params, "prompt")
        opening = []
        if echo:
            head, head_lp = echoed(first.prompt_logprobs)
            opening = [obj([choice(i, head, None, head_lp)]) for i in range(n)]
        offsets = [len(opening[0]["choices"][0]["text"]) if opening else 0] * n

        def piece(ch):
            if score_only:
                return None
            o = obj([choice(ch.choice, ch.text, None, ch.logprobs, offsets[ch.choice])])
            offsets[ch.choice] += sum(len(e[0]) for e in ch.logprobs or ())
            return o

        def finish(final):
            return [obj([choice(c.index, "", "length" if score_only else c.finish_reason, [])])
                    for c in final.choices]
        return self.gw.streaming(lambda state: self.gw.events(
            stream, first, piece, finish, (lambda u: obj([], u)) if include_usage else None, state, "prompt",
            opening=opening), stream)

    def chat_completions(self, environ) -> _Resp:
        body = self.gw.read_json(environ)
        _check_known(body, _CHAT_FIELDS)
        f = _Fields(body)
        messages = _chat_messages(body)
        params = _sampling(f, self.gw.default_max_tokens, chat=True)
        stream_mode = f.bool("stream", False)
        include_usage = _stream_options(f, stream_mode)
        _chat_unsupported(f)
        lp = chat_logprobs(f)
        if lp is not None:
            params["logprobs"] = lp
        tools = Tools.from_body(body)
        calling = tools is not None and tools.choice != "none"
        grammar = response_grammar(body)
        call_grammar = tools.grammar() if calling else None
        if call_grammar is not None:
            if grammar is not None:
                raise _bad("a required tool call and response_format cannot both constrain the output", "tool_choice")
            grammar = call_grammar
        if grammar is not None:
            params["grammar"] = grammar
        add_gen = f.bool("add_generation_prompt", True)
        info = self.gw.check_model(f)
        template = info.chat_template or ""
        if calling:
            messages = tools.prompt_messages(messages, "tools" in template)
        segments, special = render_chat_segments(info, messages_for_template(messages, "tool_calls" in template),
                                                 add_gen, **({"tools": tools.tools} if calling else {}))
        ids = self.gw.call(lambda c: c.tokenize(segments, add_special_tokens=special), "messages")
        if not ids:
            raise _bad("the messages render to an empty prompt", "messages")
        params["request_id"] = environ["colibri.request_id"]
        rid, created = "chatcmpl-" + params["request_id"], int(time.time())
        fingerprint = f"colibri-g{info.generation}" if info.generation is not None else None
        n = params.get("n", 1)

        def obj(kind, choices, usage=None):
            o = {"id": rid, "object": kind, "created": created, "model": info.name,
                 "system_fingerprint": fingerprint, "choices": choices}
            if kind == "chat.completion" or include_usage:
                o["usage"] = usage
            return o

        def delta(i, d, fr=None, entries=None):
            return obj("chat.completion.chunk", [{"index": i, "delta": d, "finish_reason": fr,
                                                  "logprobs": chat_logprobs_obj(entries) if entries else None}])

        def answer(c):
            """(message, finish_reason) of a finished choice: a tool call when the output is one."""
            calls = tools.parse(c.text) if calling else None
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            calls = tools.partial(c.text) if calling and c.finish_reason == "length" else None
            if calls:                           # cut off by max_tokens: the partial call, as OpenAI
                return {"role": "assistant", "content": None, "tool_calls": calls}, "length"
            return {"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason

        if not stream_mode:
            _, final = self.gw.generate(ids, params, "messages", environ)
            usage = self.gw.usage(final, len(ids))
            answers = [(c, *answer(c)) for c in final.choices]
            return _json(obj("chat.completion", [{
                "index": c.index, "message": msg, "finish_reason": fr,
                "logprobs": chat_logprobs_obj(c.logprobs) if lp is not None else None}
                for c, msg, fr in answers], usage))
        stream, first = self.gw.start(ids, params, "messages")
        if calling:                 # content as it comes while it cannot be a call; a call as it is written
            per = [ToolStream(tools) for _ in range(n)]

            def piece(ch):
                out = per[ch.choice].feed(ch.text, ch.logprobs)
                return delta(ch.choice, *_merged(out)) if out else None

            def finish(final):
                events = []
                for c in final.choices:
                    out, fr = per[c.index].finish(c.text, c.finish_reason)
                    if out:
                        events.append(delta(c.index, *_merged(out)))
                    events.append(delta(c.index, {}, fr))
                return events
        else:
            def piece(ch):
                return delta(ch.choice, {"content": ch.text}, None, ch.logprobs)

            def finish(final):
                return [delta(c.index, {}, c.finish_reason) for c in final.choices]
        return self.gw.streaming(lambda state: self.gw.events(
            stream, first, piece, finish,
            (lambda u: obj("chat.completion.chunk", [], u)) if include_usage else None, state, "messages",
            opening=[delta(i, {"role": "assistant", "content": ""}) for i in range(n)]), stream)


def _merged(out: list) -> tuple:
    """One delta of a choice's (delta, logprob entries) pieces: (delta, None, entries)."""
    d: dict = {}
    entries: list = []
    for piece, lp in out:
        if "content" in piece:
            d["content"] = d.get("content", "") + piece["content"]
        else:
            calls = d.setdefault("tool_calls", [])
            for c in piece["tool_calls"]:
                if calls and "id" not in c:
                    calls[-1]["function"]["arguments"] = calls[-1]["function"].get("arguments", "") + \
                        c["function"].get("arguments", "")
                else:
                    calls.append(c)
        entries += lp or []
    return d, None, entries or None
