"""Structured output in the gateway: the OpenAI fields that constrain what the model writes
(`response_format`, vLLM's `structured_outputs`, `tools` with `tool_choice`) turned into the
protocol's `grammar`, and tool calls read back from the output.

    response_format   {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
                      "strict"}}: json_object is any JSON object, json_schema validates against the
                      schema (always strict: the grammar allows nothing else)
    structured_outputs (vLLM's extension; exactly one of) {"json": schema, "regex": str,
                      "grammar": a Lark grammar, "choice": [str, ...]}
    tools, tool_choice  tools are shown to the model through its chat template (`tools=` as in
                      transformers' apply_chat_template); a template that does not read them gets
                      them in a system message instead. "required" and a named function constrain the
                      output to {"name": <a listed tool>, "arguments": <its parameters' schema>};
                      "auto" lets the model write freely and returns a tool call when the output is
                      such an object (bare, in ```json fences or in <tool_call> tags); "none" hides
                      nothing and calls nothing.

Owns: the validation of those fields (400s name the field), the grammar they imply, the tool
prompt, and parsing a tool call out of the output.  Never: talks to the server or renders HTTP.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from .openai import _bad

JSON_OBJECT = '{"type": "object"}'
TOOL_PROMPT = 'To call a tool, reply with only {"name": <tool>, "arguments": {...}}. Tools:\n'


def _json_text(schema, param):
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(f"'{param}' is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"'{param}' must be a JSON schema (an object)", param, "invalid_type")
    return json.dumps(schema)


def checked(grammar: Optional[dict], param: str) -> Optional[dict]:
    """The grammar, compiled once here so that a mistake is a 400 naming the request's field."""
    if grammar is not None:
        from ..model.grammar import GrammarError, check
        try:
            check(grammar["type"], grammar["value"])
        except GrammarError as e:
            raise _bad(str(e), param) from None
    return grammar


def response_grammar(body: dict) -> Optional[dict]:
    """response_format / structured_outputs -> the protocol's grammar ({type, value}) or None."""
    g = _response_grammar(body)
    return checked(g, "response_format" if "response_format" in body else "structured_outputs")


def _response_grammar(body: dict) -> Optional[dict]:
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise _bad("give response_format or structured_outputs, not both", "structured_outputs")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise _bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
        t = rf["type"]
        if t == "text":
            return None
        if t == "json_object":
            return {"type": "json_schema", "value": JSON_OBJECT}
        if t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("'response_format.json_schema' must be an object with a 'schema'",
                           "response_format.json_schema", "invalid_type")
            if not isinstance(js.get("name", ""), str):
                raise _bad("'response_format.json_schema.name' must be a string", "response_format.json_schema.name",
                           "invalid_type")
            return {"type": "json_schema", "value": _json_text(js.get("schema", {}), "response_format.json_schema.schema")}
        raise _bad("'response_format.type' must be text, json_object or json_schema", "response_format.type")
    if so is None:
        return None
    if not isinstance(so, dict) or len(so) != 1:
        raise _bad("'structured_outputs' must be an object with exactly one of json, regex, grammar, choice",
                   "structured_outputs", "invalid_type")
    (k, v), = so.items()
    if k == "json":
        return {"type": "json_schema", "value": _json_text(v, "structured_outputs.json")}
    if k in ("regex", "grammar"):
        if not isinstance(v, str) or not v:
            raise _bad(f"'structured_outputs.{k}' must be a non-empty string", f"structured_outputs.{k}", "invalid_type")
        return {"type": "regex" if k == "regex" else "lark", "value": v}
    if k == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise _bad("'structured_outputs.choice' must be a list of non-empty strings", "structured_outputs.choice",
                       "invalid_type")
        return {"type": "lark", "value": "start: " + " | ".join(json.dumps(c) for c in v)}
    raise _bad(f"unknown structured output {str(k)[:40]!r} (json, regex, grammar, choice)", "structured_outputs")


class Tools:
    """A chat request's tools and tool_choice, validated."""

    def __init__(self, tools: list, choice):
        self.tools, self.choice = tools, choice          # choice: "none" | "auto" | "required" | a name
        self.names = [t["function"]["name"] for t in tools]

    @classmethod
    def from_body(cls, body: dict) -> Optional["Tools"]:
        tools, tc = body.get("tools"), body.get("tool_choice")
        if body.get("functions") not in (None, []) or body.get("function_call") not in (None, "none", "auto"):
            raise _bad("'functions' and 'function_call' are deprecated: use 'tools' and 'tool_choice'",
                       "functions", "unsupported_parameter")
        if tools in (None, []):
            if tc not in (None, "none", "auto"):
                raise _bad("'tool_choice' needs 'tools'", "tool_choice")
            return None
        if not isinstance(tools, list) or len(tools) > 128:
            raise _bad("'tools' must be a list of at most 128 tools", "tools", "invalid_type")
        out = []
        for i, t in enumerate(tools):
            at = f"tools[{i}]"
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise _bad(f"'{at}' must be {{\"type\": \"function\", \"function\": {{...}}}}", at, "invalid_type")
            name = fn.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
                raise _bad(f"'{at}.function.name' must be 1-64 letters, digits, _ . or -", f"{at}.function.name")
            # no parameters: no arguments (as OpenAI), so a call of it is {"name": ..., "arguments": {}}
            params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
            if not isinstance(params, dict):
                raise _bad(f"'{at}.function.parameters' must be a JSON schema object", f"{at}.function.parameters",
                           "invalid_type")
            if not isinstance(fn.get("description", ""), str):
                raise _bad(f"'{at}.function.description' must be a string", f"{at}.function.description",
                           "invalid_type")
            out.append({"type": "function", "function": {**fn, "parameters": params}})
        names = [t["function"]["name"] for t in out]
        if len(set(names)) != len(names):
            raise _bad("'tools' names a function twice", "tools")
        if tc is None:
            tc = "auto"
        elif isinstance(tc, dict):
            fn = tc.get("function") if tc.get("type") == "function" else None
            if not isinstance(fn, dict) or fn.get("name") not in names:
                raise _bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                           "{\"name\": <a listed tool>}}", "tool_choice")
            tc = fn["name"]
        elif tc not in ("none", "auto", "required"):
            raise _bad("'tool_choice' must be none, auto, required or a named function", "tool_choice")
        return cls(out, tc)

    def grammar(self) -> Optional[dict]:
        """The constraint of required / a named function: one call object of a listed tool."""
        if self.choice in ("none", "auto"):
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        defs, alts = {}, []
        for i, t in enumerate(chosen):
            params = t["function"]["parameters"]
            if _has_ref(params):
                # nested under properties.arguments, the parameters' own references ("#/$defs/Loc",
                # "#/definitions/Loc", "#") would point into the call object: the parameters go
                # under the root's $defs and their references follow them there
                key = f"colibri_tool_{i}"
                defs[key] = _rebase(params, f"#/$defs/{key}")
                params = {"$ref": f"#/$defs/{key}"}
            alts.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                          "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
        schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
        if defs:
            schema = {**schema, "$defs": defs}
        return checked({"type": "json_schema", "value": json.dumps(schema)}, "tools")

    def prompt_messages(self, messages: list, template_reads_tools: bool) -> list:
        """The messages, with the tools in a system message when the template does not show them."""
        if template_reads_tools:
            return messages
        text = TOOL_PROMPT + "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":"))
                                       for t in self.tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
        return [{"role": "system", "content": text}] + messages

    def parse(self, text: str) -> Optional[list]:
        """The tool calls in an output ([{id, type, function: {name, arguments}}]), or None when it is
        not a call of a listed tool."""
        s = text.strip()
        m = re.fullmatch(r"(?:<tool_call>\s*(.*?)\s*</tool_call>|```(?:json)?\s*(.*?)\s*```|(.*))", s, re.S)
        s = next(g for g in m.groups() if g is not None) if m else s
        try:
            obj = json.loads(s)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names or not isinstance(obj.get("arguments"), dict):
            return None
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}]

    def partial(self, text: str) -> Optional[list]:
        """The tool call an output cut off by max_tokens had begun ({"name": ..., "arguments": <partial
        JSON text>}, as OpenAI returns it with finish_reason length), or None when it had not begun one
        of a listed tool (a cut name must be the start of exactly one, or the named tool_choice's)."""
        forced = self.choice not in ("none", "auto")      # the grammar held the output to the envelope
        m = re.match(r'\s*(?:<tool_call>\s*|```(?:json)?\s*)?\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]*)(")?', text)
        if m is None and not forced:
            return None
        prefix, closed = (m.group(1), m.group(2)) if m else ("", None)     # forced, cut before the name
        names = [n for n in self.names if (n == prefix if closed else n.startswith(prefix))]
        if self.choice != "required" and forced:
            names = [n for n in names if n == self.choice]
        if len(names) != 1:
            return None
        a = re.match(r'\s*,\s*"arguments"\s*:\s*', text[m.end():]) if closed else None
        args = text[m.end() + a.end():] if a else ""
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": names[0], "arguments": args}}]


_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})      # values, not schemas
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _has_ref(schema) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(
            _has_ref(v) for k, v in schema.items() if k not in _DATA_KEYS)
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rebase(schema, base: str, names: bool = False):
    """A copy of a schema whose local references ("#", "#/...") point at the same place once the
    schema itself lives at `base` ("#/$defs/x"); data (const, enum, ...) is left as it is."""
    if isinstance(schema, list):
        return [_rebase(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if names:                       # a map of names to schemas: every key is a name
        return {k: _rebase(v, base) for k, v in schema.items()}
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _DATA_KEYS:
            out[k] = v
        else:
            out[k] = _rebase(v, base, names=k in _NAME_MAPS)
    return out


def messages_for_template(messages: list, reads_tool_calls: bool) -> list:
    """Assistant tool calls for a template that does not read `tool_calls`: written into the content as
    the JSON objects the model was asked to produce."""
    if reads_tool_calls:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + calls
        out.append(m)
    return out
