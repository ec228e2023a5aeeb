"""The OpenAI side of the HTTP gateway (`colibri_server.http`): request validation, error
mapping and the shapes of WSGI answers (JSON bodies, server-sent events).

Sampling fields (completions and chat): max_tokens (chat: also max_completion_tokens; default
16 for completions as in OpenAI, `default_max_tokens` for chat), temperature in [0, 2]
(default 1, as in OpenAI: pass 0 for greedy), top_p in [0, 1] (0 means greedy: it is sent as
top_k=1), seed >= 0 (with n > 1, completion i uses seed + i), stop (str or list), stream,
stream_options.include_usage, n (1..16 completions from one prefill), presence_penalty and
frequency_penalty in [-2, 2] (OpenAI's: on the tokens of the completion so far), logit_bias
({"token id": bias in [-100, 100]}), and the extensions top_k (0 or -1: off), min_p,
repetition_penalty (multiplicative, on the prompt and the completion), stop_token_ids,
ignore_eos.  Log-probabilities are of the model's raw logits (before penalties, bias and
temperature, as vLLM returns by default): chat takes logprobs=true with top_logprobs 0..20;
completions take logprobs 0..20 and echo (the prompt's tokens and their logprobs first; with
echo, max_tokens may be 0 to score a text, as evaluation harnesses do).  Accepted only at
their neutral value (anything else is a 400 naming the field): best_of=1 (or n), suffix=null,
and tools/functions empty.  Unknown fields are refused (400, "unknown_parameter"), as OpenAI does.

Errors are OpenAI-style `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
JSON, field types or values (param names the field) and for an unknown model, 401, 404, 405,
413 for bodies over `max_body` (1 MiB), and colibri error codes map to: bad_request and
too_large -> 400 (too_large on the prompt: code "context_length_exceeded"), overloaded -> 429
with Retry-After (the queue is full: retry later), deadline_exceeded and timeout -> 504,
shutting_down and cancelled -> 503, starting -> 503 with Retry-After (the server is loading its
model), worker_lost -> 502, internal -> 500.  Once a stream has started (HTTP 200 sent), an error arrives as a last event `data: {"error": {...}}` followed by
`data: [DONE]` (the openai package raises it as APIError).  No traceback reaches a client.
"""
from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Callable, Iterator, Optional

from ..client import ColibriError
from ..sampling_fields import MAX_LOGPROBS
from ..wire.protocol import MAX_LOGIT_BIAS, MAX_N

log = logging.getLogger("colibri.http")

# ---------------------------------------------------------------------------- errors


class HTTPError(Exception):
    """An answer other than 200, with an OpenAI-style body.  `outcome` labels the metrics."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers=(), outcome: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 and status != 429 else
                             "rate_limit_error" if status == 429 else "server_error")
        self.headers = list(headers)
        self.outcome = outcome or code or str(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message, param=None, code="invalid_value"):
    return HTTPError(400, message, param=param, code=code, outcome="bad_request")


# seconds a client is told to wait while the server loads its model and compiles (a cold compile
# takes seconds to minutes; polling faster only adds load)
STARTING_RETRY_AFTER = "5"

# colibri error code -> HTTP status (the OpenAI "code" and the metrics outcome are the colibri code)
_COLIBRI_STATUS = {
    "bad_request": 400, "too_large": 400, "overloaded": 429, "deadline_exceeded": 504, "timeout": 504,
    "shutting_down": 503, "starting": 503, "cancelled": 503, "worker_lost": 502, "internal": 500, "unreachable": 503,
    "unauthorized": 502,
    # the gateway's own bugs if they ever happen
    "unsupported_version": 500, "unknown_type": 500, "duplicate_id": 500, "not_found": 500,
}


def _param_of(message: str, prompt_param: str) -> Optional[str]:
    """The request field a colibri error message is about (the router names its fields)."""
    m = re.search(r"field '([A-Za-z_]+)'", message)
    if m:
        name = m.group(1)
        return prompt_param if name == "prompt" else name
    for prefix, param in (("prompt_embeds", "prompt_embeds"), ("prompt", prompt_param), ("max_tokens", "max_tokens"),
                          ("at most", "stop"),
                          ("logit_bias", "logit_bias"),
                          ("token id", prompt_param), ("this model has no tokenizer", prompt_param),
                          ("request body", prompt_param)):
        if message.startswith(prefix):
            return param
    return None


def http_error_for(e: ColibriError, prompt_param: str = "prompt") -> HTTPError:
    """A colibri error (server-side or client-side) -> the HTTP error the gateway answers."""
    code = e.code or "internal"
    status = _COLIBRI_STATUS.get(code, 502)
    msg = e.message or code
    param = _param_of(msg, prompt_param) if status == 400 else None
    if code == "timeout":
        msg = f"the colibri server did not answer in time ({msg})"
    headers = [("Retry-After", STARTING_RETRY_AFTER if code == "starting" else "1")] \
        if code in ("overloaded", "shutting_down", "starting") else []
    oa_code = code
    if code == "too_large" and param == prompt_param:
        oa_code = "context_length_exceeded"
    return HTTPError(status, msg, param=param, code=oa_code, headers=headers, outcome=code)


# ---------------------------------------------------------------------------- request validation

_NUM = (int, float)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, _NUM) and not isinstance(v, bool)


class _Fields:
    """Typed access to a JSON request object; every failure names its field."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def int(self, name, default, lo=None, hi=None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            raise _bad(f"'{name}' must be an integer", name, "invalid_type")
        if lo is not None and v < lo:
            raise _bad(f"'{name}' must be >= {lo} (got {v})", name)
        if hi is not None and v > hi:
            raise _bad(f"'{name}' must be <= {hi} (got {v})", name)
        return v

    def num(self, name, default, lo=None, hi=None, lo_open=False):
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_num(v):
            raise _bad(f"'{name}' must be a number", name, "invalid_type")
        v = float(v)
        if not math.isfinite(v):
            raise _bad(f"'{name}' must be finite", name)
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise _bad(f"'{name}' must be {'>' if lo_open else '>='} {lo:g} (got {v:g})", name)
        if hi is not None and v > hi:
            raise _bad(f"'{name}' must be <= {hi:g} (got {v:g})", name)
        return v

    def bool(self, name, default):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(f"'{name}' must be a boolean", name, "invalid_type")
        return v

    def str(self, name, default=None):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise _bad(f"'{name}' must be a string", name, "invalid_type")
        return v

    def neutral(self, name, allowed, what):
        """A field supported only at its neutral value(s)."""
        v = self.body.get(name)
        if v is None or any(v == a and type(v) is type(a) for a in allowed):
            return
        if _is_num(v) and any(_is_num(a) and v == a for a in allowed):
            return
        raise _bad(f"'{name}' is not supported by this server ({what})", name, "unsupported_parameter")


_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                  "stream_options", "n", "best_of", "logprobs", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "logit_bias", "user", "stop_token_ids", "ignore_eos", "response_format",
                  "structured_outputs"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "prompt_embeds"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                 "tool_choice", "functions", "function_call", "parallel_tool_calls", "store",
                                 "metadata", "service_tier", "modalities", "add_generation_prompt"}


def _check_known(body, known):
    for k in body:
        if k not in known:
            raise _bad(f"unrecognized request argument supplied: {str(k)[:60]!r}", str(k)[:60], "unknown_parameter")


def _sampling(f: _Fields, max_tokens_default: int, chat: bool) -> dict:
    """The OpenAI sampling fields -> Client.stream keyword arguments."""
    max_tokens = f.int("max_tokens", None, lo=1)
    if chat:
        mct = f.int("max_completion_tokens", None, lo=1)
        if mct is not None:
            if max_tokens is not None and max_tokens != mct:
                raise _bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
            max_tokens = mct
    p = {"max_tokens": max_tokens_default if max_tokens is None else max_tokens,
         "temperature": f.num("temperature", 1.0, 0.0, 2.0)}
    top_p = f.num("top_p", 1.0, 0.0, 1.0)
    top_k = f.int("top_k", 0, lo=-1)
    if top_k == -1:
        top_k = 0
    if top_p == 0.0:          # nucleus of probability 0: the most likely token only
        top_p, top_k = 1.0, 1
    p["top_p"], p["top_k"] = top_p, top_k
    p["min_p"] = f.num("min_p", 0.0, 0.0, 1.0)
    p["repetition_penalty"] = f.num("repetition_penalty", 1.0, 0.0, 100.0, lo_open=True)
    p["seed"] = f.int("seed", None, lo=0, hi=(1 << 63) - 1)
    stop = f.body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(not s for s in stop):
        raise _bad("'stop' strings must not be empty", "stop")
    p["stop"] = stop
    sids = f.body.get("stop_token_ids")
    if sids is not None:
        if not isinstance(sids, list) or not all(_is_int(t) and t >= 0 for t in sids):
            raise _bad("'stop_token_ids' must be a list of token ids (integers >= 0)", "stop_token_ids",
                       "invalid_type")
        p["stop_token_ids"] = sids
    if f.bool("ignore_eos", False):
        p["ignore_eos"] = True
    n = f.int("n", 1, lo=1, hi=MAX_N)
    if n > 1:
        p["n"] = n
    bo = f.int("best_of", None, lo=1)
    if bo is not None and bo != n:
        raise _bad("'best_of' must equal n (candidates are not ranked by this server)", "best_of",
                   "unsupported_parameter")
    for name in ("frequency_penalty", "presence_penalty"):
        v = f.num(name, 0.0, -2.0, 2.0)
        if v:
            p[name] = v
    lb = f.body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias", "invalid_type")
        if len(lb) > MAX_LOGIT_BIAS:
            raise _bad(f"'logit_bias' has {len(lb)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
        bias = {}
        for k, v in lb.items():
            if not (isinstance(k, str) and k.isdigit() and len(k) < 12):
                raise _bad(f"'logit_bias' key {str(k)[:20]!r} is not a token id", "logit_bias")
            if not _is_num(v) or not -100 <= v <= 100:
                raise _bad(f"'logit_bias[{k}]' must be a number in [-100, 100]", "logit_bias")
            bias[int(k)] = float(v)
        if bias:
            p["logit_bias"] = bias
    f.str("user")
    return p


def _stream_options(f: _Fields, stream: bool) -> bool:
    so = f.body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for k in so:
        if k not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise _bad(f"unrecognized stream option {str(k)[:40]!r}", "stream_options", "unknown_parameter")
    v = so.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage",
                   "invalid_type")
    return bool(v)


def completion_embeds(body) -> Optional[bytes]:
    """prompt_embeds (the prompt as input embeddings, (T, hidden) float32): a base64 string of the raw
    little-endian float32 values, row-major, or a list of rows of numbers -> the protocol's bytes."""
    pe = body.get("prompt_embeds")
    if pe is None:
        return None
    if body.get("prompt") is not None:
        raise _bad("give 'prompt' or 'prompt_embeds', not both", "prompt_embeds")
    if isinstance(pe, str):
        import base64
        import binascii
        try:
            raw = base64.b64decode(pe, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("'prompt_embeds' is not valid base64", "prompt_embeds") from None
    elif isinstance(pe, list) and pe and all(isinstance(r, list) and r and all(_is_num(v) for v in r) for r in pe):
        if len({len(r) for r in pe}) != 1:
            raise _bad("'prompt_embeds' rows must all have the same length", "prompt_embeds")
        import numpy as np
        raw = np.asarray(pe, "<f4").tobytes()
    else:
        raise _bad("'prompt_embeds' must be base64 of float32 values or a list of rows of numbers", "prompt_embeds",
                   "invalid_type")
    if not raw or len(raw) % 4:
        raise _bad("'prompt_embeds' must hold whole float32 values", "prompt_embeds")
    return raw


def _completion_prompt(body):
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]            # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise _bad("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list):
        if not p:
            raise _bad("'prompt' is an empty list", "prompt")
        if all(isinstance(x, (str, list)) for x in p):
            raise _bad("batched prompts are not supported: send one prompt per request", "prompt",
                       "unsupported_parameter")
        for i, t in enumerate(p):
            if not _is_int(t) or t < 0:
                raise _bad(f"'prompt[{i}]' is not a token id (an integer >= 0)", "prompt", "invalid_type")
        return p
    raise _bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")


_ROLES = {"system", "developer", "user", "assistant", "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "refusal", "function_call"}


def _chat_messages(body) -> list:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{at}' must be an object", at, "invalid_type")
        for k in m:
            if k not in _MESSAGE_KEYS:
                raise _bad(f"'{at}' has an unrecognized field {str(k)[:40]!r}", f"{at}.{str(k)[:40]}",
                           "unknown_parameter")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"'{at}.role' must be one of {', '.join(sorted(_ROLES))}", f"{at}.role")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"'{at}.content' is required", f"{at}.content", "missing_required_parameter")
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pat = f"{at}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"'{pat}' must be {{\"type\": \"text\", \"text\": str}} (only text is supported)",
                               pat, "invalid_type")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise _bad(f"'{at}.content' must be a string or a list of text parts", f"{at}.content", "invalid_type")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
        for k in ("name", "tool_call_id"):
            v = m.get(k)
            if v is not None:
                if not isinstance(v, str):
                    raise _bad(f"'{at}.{k}' must be a string", f"{at}.{k}", "invalid_type")
                msg[k] = v
        out.append(msg)
    return out


def chat_logprobs(f: _Fields):
    """Chat's logprobs (bool) and top_logprobs (0..20, needs logprobs) -> the protocol's logprobs or None."""
    on = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(f: _Fields):
    """Completions' logprobs (an integer 0..20, or null) -> the protocol's logprobs or None."""
    v = f.body.get("logprobs")
    if v is None or v is False:
        return None
    if v is True:
        return 0
    return f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)


def _tool_calls(calls, at) -> list:
    """An assistant message's tool_calls, checked; arguments as objects (what chat templates read)."""
    if not isinstance(calls, list):
        raise _bad(f"'{at}' must be a list", at, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _bad(f"'{at}[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                       f"\"arguments\": a JSON string}}}}", f"{at}[{j}]", "invalid_type")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise _bad(f"'{at}[{j}].function.arguments' is not JSON", f"{at}[{j}].function.arguments") from None
        out.append({"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _chat_unsupported(f: _Fields):
    mod = f.body.get("modalities")
    if mod is not None and mod != ["text"]:
        raise _bad("'modalities' must be [\"text\"]", "modalities", "unsupported_parameter")
    for name in ("parallel_tool_calls", "store"):
        f.bool(name, None)
    f.str("service_tier")
    md = f.body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise _bad("'metadata' must be an object", "metadata", "invalid_type")


# ---------------------------------------------------------------------------- responses

# A logprobs entry from colibri (protocol): [token text, logprob, [[id, token text, logprob], ...]];
# a prompt's first entry has logprob None (nothing predicts it). A token holding part of a UTF-8
# character (text U+FFFD) carries its own bytes last: [..., bytes] (OpenAI's `bytes` field).


def chat_logprobs_obj(entries) -> dict:
    """Chat's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def one(text, lp, raw=None):
        return {"token": text, "logprob": lp, "bytes": list(raw if raw is not None else text.encode("utf-8"))}
    return {"content": [{**one(e[0], e[1], e[3] if len(e) > 3 else None),
                         "top_logprobs": [one(a[1], a[2], a[3] if len(a) > 3 else None) for a in e[2]]}
                        for e in entries or ()],
            "refusal": None}


def legacy_logprobs_obj(entries, offset: int = 0) -> dict:
    """Completions' choice.logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (each token's character offset in the choice's text, from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries or ():
        out["tokens"].append(e[0])
        out["token_logprobs"].append(e[1])
        out["top_logprobs"].append({a[1]: a[2] for a in e[2]} if e[1] is not None else None)
        out["text_offset"].append(offset)
        offset += len(e[0])
    return out


class _Resp:
    def __init__(self, status=200, body: Any = b"", headers=(), outcome="ok", content_type="application/json"):
        self.status, self.body, self.outcome = status, body, outcome
        self.headers = [("Content-Type", content_type), *headers]


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json(obj, status=200, headers=()) -> _Resp:
    return _Resp(status, _json_bytes(obj), headers)


def _error_resp(e: HTTPError) -> _Resp:
    return _Resp(e.status, _json_bytes(e.body()), e.headers, outcome=e.outcome)


def _sse(obj) -> bytes:
    return b"data: " + _json_bytes(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _StreamBody:
    """The WSGI iterable of a streaming answer: `finish(outcome)` runs exactly once, when the
    events are exhausted or the iterable is closed early (the client went away: "disconnected");
    `cleanup` (closing the colibri stream: a cancel) runs even if iteration never started."""

    def __init__(self, gen: Iterator[bytes], state: dict, cleanup: Callable[[], None],
                 finish: Callable[[str], None]):
        self._gen, self._state, self._cleanup, self._finish = gen, state, cleanup, finish
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._gen)
        except StopIteration:
            self._end()
            raise
        except BaseException:
            self._state.setdefault("outcome", "internal")
            self._end()
            raise

    def close(self):
        try:
            self._gen.close()
        finally:
            self._end()

    def _end(self):
        if self._ended:
            return
        self._ended = True
        try:
            self._cleanup()
        except Exception:
            log.exception("closing a colibri stream failed")
        self._finish(self._state.get("outcome", "disconnected"))

