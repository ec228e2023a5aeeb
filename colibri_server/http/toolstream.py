"""A streaming chat completion with tools, streamed as it is written (as OpenAI streams it).

`tool_choice` required or a named function (the grammar holds the output to the call envelope
{"name": ..., "arguments": ...}): the call is streamed as it is written, a first delta with the
call's id, type and name (as soon as the name is known: at once for a named or only tool), then
the arguments' text as it comes; the envelope's own characters are never sent.

`auto`: the output is held back only while it can still be a tool call (empty so far, or the
start of a listed tool's envelope, bare, in ```json fences or in <tool_call> tags); from the
first character that rules a call out, the text streams as content deltas. Output held to the end
is a tool call when it parses as one, else content. A call written with "arguments" before "name"
is held until its object closes (its name is not known before) and is a call when that object names
a listed tool.

Owns: what each choice has sent, and the deltas.  Never: talks to the server or renders HTTP.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

_OPENERS = ("<tool_call>", "```json", "```")
_NAME = re.compile(r'\s*(?:<tool_call>\s*|```(?:json)?\s*)?\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]*)(")?')
_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def _value_end(s: str) -> Optional[int]:
    """Where the JSON object or array at the start of s ends (None: not yet, or not one)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None
    return None


def could_be_call(text: str, names) -> bool:
    """Whether an output beginning with `text` can still be a call of one of `names`."""
    s = text.lstrip()
    for op in _OPENERS:
        if op.startswith(s):
            return True
        if s.startswith(op):
            s = s[len(op):].lstrip()
            break
    if not s:
        return True
    if s[0] != "{":
        return False
    obj, s = s, s[1:].lstrip()
    if s.startswith('"arguments"') or (s and '"arguments"'.startswith(s) and not '"name"'.startswith(s)):
        return _arguments_first_call(obj, names)
    key = '"name"'
    if len(s) < len(key):
        return key.startswith(s)
    if not s.startswith(key):
        return False
    s = s[len(key):].lstrip()
    if not s:
        return True
    if s[0] != ":":
        return False
    s = s[1:].lstrip()
    if not s:
        return True
    if s[0] != '"':
        return False
    name, closed, _ = s[1:].partition('"')
    return any(n == name if closed else n.startswith(name) for n in names)


def _arguments_first_call(obj: str, names) -> bool:
    """An envelope written {"arguments": ..., "name": ...}: a call can be ruled out only once its object
    closes (whether its name is a listed tool's)."""
    end = _value_end(obj)
    if end is None:
        return True
    try:
        parsed = json.loads(obj[:end])
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("name") in names


class ToolStream:
    """One choice of a streaming chat with tools: feed(text) per token, finish(text, reason) at the
    end; each returns the deltas to send (dicts), logprob entries paired with content."""

    def __init__(self, tools):
        self.tools = tools
        self.forced = tools.choice not in ("none", "auto")
        self.mode = "call" if self.forced else "open"     # open: undecided (auto); content; call
        self.text = ""
        self.sent = 0                  # chars of text sent as content, or of the arguments sent
        self.held_lp: list = []
        self.call_id = None            # set once the call's first delta is sent
        if self.forced and (tools.choice != "required" or len(tools.names) == 1):
            self.known = tools.choice if tools.choice != "required" else tools.names[0]
        else:
            self.known = None

    def feed(self, text: str, logprobs=None) -> list:
        self.text += text
        if self.mode == "open":
            if could_be_call(self.text, self.tools.names):
                self.held_lp += logprobs or []
                return []
            self.mode = "content"
        if self.mode == "content":
            out, lp = self.text[self.sent:], self.held_lp + list(logprobs or ())
            self.sent, self.held_lp = len(self.text), []
            return [({"content": out}, lp)] if out or lp else []
        name, args = self._envelope()
        return self._call_delta(name, args)

    def _envelope(self):
        """(the call's name or None, the arguments' text so far): the value after "arguments":,
        without the envelope's closing characters."""
        m = _NAME.match(self.text)
        name = self.known
        if m is not None and m.group(2):
            name = m.group(1)
        if m is None or not m.group(2):
            return name, ""
        a = _ARGS.match(self.text, m.end())
        if a is None:
            return name, ""
        args = self.text[a.end():]
        end = _value_end(args)
        return name, args if end is None else args[:end]

    def _call_delta(self, name, args) -> list:
        if name is None:
            return []
        fn = {}
        if self.call_id is None:
            self.call_id = "call_" + uuid.uuid4().hex[:24]
            fn["name"] = name
        if len(args) > self.sent or "name" in fn:
            fn["arguments"] = args[self.sent:]
            self.sent = len(args)
        if not fn:
            return []
        call = {"index": 0, "function": fn}
        if "name" in fn:
            call = {"index": 0, "id": self.call_id, "type": "function", "function": fn}
        return [({"tool_calls": [call]}, [])]

    def finish(self, text: str, reason: str) -> tuple:
        """(deltas, finish_reason) once the output is complete (`text`: all of it)."""
        self.text = text
        if self.mode == "content":
            return self.feed(""), reason
        if self.mode == "call":
            whole = self.tools.parse(text)
            if whole is None and reason == "length":
                calls = self.tools.partial(text)
                if calls:
                    self.known = calls[0]["function"]["name"]
                    name, args = self._envelope()
                    return self._call_delta(self.known, args), "length"
            name, args = self._envelope()
            return self._call_delta(name, args), "tool_calls" if whole else reason
        # auto, held to the end
        calls, fr = self.tools.parse(text), "tool_calls"
        if calls is None and reason == "length":
            calls, fr = self.tools.partial(text), "length"
        if calls:
            return [({"tool_calls": [{"index": 0, **calls[0]}]}, [])], fr
        self.mode = "content"
        return self.feed(""), reason
