"""OpenAI-compatible HTTP gateway: a plain-WSGI app, served by gunicorn (gthread), that
talks to a running colibri server over ZeroMQ with `colibri_server.client.Client`.

    colibri http --connect tcp://127.0.0.1:5555 --bind 127.0.0.1:8000
    COLIBRI_HTTP_CONNECT=ipc:///run/colibri/colibri.sock \\
        gunicorn 'colibri_server.http:app_from_env()' -c configs/gunicorn.conf.py

Endpoints
    POST /v1/completions        prompt: str | [int] | [str] (one) | [[int]] (one)
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models, GET /v1/models/{id}
    POST /tokenize              {"prompt": str, "add_special_tokens": bool = true} -> {"tokens", "count"}
    POST /detokenize            {"tokens": [int]} -> {"prompt": str}
    GET  /health                200 {"status": "ok", ...} | 503 (starting, draining, unreachable in ~2 s)
    GET  /metrics               Prometheus text format

Sampling fields (completions and chat): max_tokens (chat: also max_completion_tokens; default
16 for completions as in OpenAI, `default_max_tokens` for chat), temperature in [0, 2]
(default 1, as in OpenAI: pass 0 for greedy), top_p in [0, 1] (0 means greedy: it is sent as
top_k=1), seed >= 0, stop (str or list), stream, stream_options.include_usage, and the
extensions top_k (0 or -1: off), min_p, repetition_penalty, stop_token_ids, ignore_eos.
Accepted only at their neutral value (anything else is a 400 naming the field): n=1,
best_of=1, echo=false, logprobs=null/false, top_logprobs=null/0, suffix=null, logit_bias={}
and tools/functions empty.  Unknown fields are refused (400, "unknown_parameter"), as OpenAI does.

Penalties: frequency_penalty and presence_penalty are accepted only as 0.  The engine has a
multiplicative `repetition_penalty` (CTRL-style, on every token already in the prompt or the
completion) and no additive count-based penalty; mapping one onto the other would silently
change what a client asked for, so it is exposed under its own name (as vLLM does) instead.

API key (optional: `--api-key`, `--api-key-file` or COLIBRI_HTTP_API_KEY): every endpoint
requires `Authorization: Bearer <key>` (compared with hmac.compare_digest) EXCEPT /health,
for load balancers and orchestrators, and /metrics, for Prometheus scrapers (set
`metrics_auth` / COLIBRI_HTTP_METRICS_AUTH=1 to protect /metrics too: it shows the model path
and worker pids, no prompts).  Failures are 401 with an OpenAI-style body.

Chat templates: the gateway has no tokenizer of its own.  `fetch_template(client)` asks the
server for `stats` (the model file's path), opens that file's header with
`ColibriFile.open` (a read-only map: nothing is loaded) and reads the chat template, the
model name and the bos/eos token strings.  This needs the gateway to run on the server's host
(or see the same path); when the file cannot be read the gateway logs a warning and falls
back to ChatML.  The rendered prompt is tokenized by the server with add_special_tokens=False
(the template writes its own special tokens, as in `apply_chat_template`); a ChatML fallback
is tokenized with them.  The template runs in jinja2's ImmutableSandboxedEnvironment.  The
model info is cached per process and refreshed every `INFO_TTL` seconds, and as soon as an
answer reveals a new model generation (`colibri reload`).

Errors are OpenAI-style `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
JSON, field types or values (param names the field) and for an unknown model, 401, 404, 405,
413 for bodies over `max_body` (1 MiB), and colibri error codes map to: bad_request and
too_large -> 400 (too_large on the prompt: code "context_length_exceeded"), overloaded -> 429
with Retry-After (the queue is full: retry later), deadline_exceeded and timeout -> 504,
shutting_down and cancelled -> 503, worker_lost -> 502, internal -> 500.  Once a stream has
started (HTTP 200 sent), an error arrives as a last event `data: {"error": {...}}` followed by
`data: [DONE]` (the openai package raises it as APIError).  No traceback reaches a client.

Streaming: server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`) produced by a
generator.  The gateway waits for the first token before answering, so an error before any
token gets its proper HTTP status.  When the HTTP client goes away, gunicorn's write fails and
it closes the response iterable: that closes the colibri Stream, which sends a `cancel`, and
the router frees the worker.  (A disconnect is noticed at the next write, i.e. the next token.)

Threads: a Client is not thread-safe, so each gunicorn thread lazily creates its own
(`threading.local`); a streaming response is iterated by the thread that created it, as
gunicorn's gthread worker does.

Metrics: each gateway process has its own registry (not prometheus_client's global one).
Request counters, the in-flight gauge, token counters and latency histograms count the
requests of THAT process only: with gunicorn `workers > 1` a scrape sees one process at random,
so run one gateway process with more threads (the default: workers=1, threads=8) or scrape
each process separately.  The `colibri_*` families (queue, in flight, workers, memory per
worker pid, server counters, model generation) come from the server's `stats`, fetched at
scrape time; `colibri_up` is 0 when that failed.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from .client import Client, ColibriError, ColibriTimeout

log = logging.getLogger("colibri.http")

__all__ = ["create_app", "app_from_env", "fetch_template", "ModelInfo", "render_chat", "Gateway",
           "serve", "add_http_arguments", "cmd_http", "main", "HTTPError"]

DEFAULT_CONNECT = "tcp://127.0.0.1:5555"
DEFAULT_BIND = "127.0.0.1:8000"
DEFAULT_TIMEOUT = 120.0        # seconds to wait for the next message of a request (queueing included)
HEALTH_TIMEOUT = 2.0
STATS_TIMEOUT = 5.0
MAX_BODY = 1 << 20             # bytes of an HTTP request body
DRAIN_LIMIT = 16 << 20         # bytes of an oversized body read and dropped so that its 413 is seen
DEFAULT_MAX_TOKENS = 16        # /v1/completions, as in OpenAI
DEFAULT_CHAT_MAX_TOKENS = 512  # /v1/chat/completions when neither max_tokens nor max_completion_tokens is given
INFO_TTL = 30.0                # seconds a fetched ModelInfo is trusted without a new generation seen

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_STATUS_TEXT = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
                413: "Payload Too Large", 429: "Too Many Requests", 500: "Internal Server Error",
                502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}

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


# colibri error code -> HTTP status (the OpenAI "code" and the metrics outcome are the colibri code)
_COLIBRI_STATUS = {
    "bad_request": 400, "too_large": 400, "overloaded": 429, "deadline_exceeded": 504, "timeout": 504,
    "shutting_down": 503, "cancelled": 503, "worker_lost": 502, "internal": 500,
    # the gateway's own bugs if they ever happen
    "unsupported_version": 500, "unknown_type": 500, "duplicate_id": 500, "not_found": 500,
}


def _param_of(message: str, prompt_param: str) -> Optional[str]:
    """The request field a colibri error message is about (the router names its fields)."""
    m = re.search(r"field '([A-Za-z_]+)'", message)
    if m:
        name = m.group(1)
        return prompt_param if name == "prompt" else name
    for prefix, param in (("prompt", prompt_param), ("max_tokens", "max_tokens"), ("at most", "stop"),
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
    headers = [("Retry-After", "1")] if code in ("overloaded", "shutting_down") else []
    oa_code = code
    if code == "too_large" and param == prompt_param:
        oa_code = "context_length_exceeded"
    return HTTPError(status, msg, param=param, code=oa_code, headers=headers, outcome=code)


# ---------------------------------------------------------------------------- model info and chat templates


@dataclass
class ModelInfo:
    """What the gateway knows of the served model (see `fetch_template`)."""
    name: str
    path: str
    generation: Optional[int]
    chat_template: Optional[str] = None     # None: the model has none (or its file is unreadable): ChatML
    bos_token: str = ""
    eos_token: str = ""
    created: int = 0
    source: str = "file"                    # "file" | "unreadable"
    fetched_at: float = field(default_factory=time.monotonic)
    _compiled: Any = field(default=None, repr=False)
    _compile_error: Optional[str] = field(default=None, repr=False)


def _name_from_path(path: str) -> str:
    base = os.path.basename(path or "") or "colibri"
    return base[:-len(".colibri")] if base.endswith(".colibri") else base


def model_info_from_stats(stats: dict, model_name: Optional[str] = None) -> ModelInfo:
    """Open the model file named by a `stats` answer and read its header blobs."""
    path = stats.get("model") or ""
    gen = stats.get("generation")
    try:
        from .model.format import ColibriFile
        cf = ColibriFile.open(path)
    except Exception as e:  # another host, permissions, a replaced file, ...
        log.warning("cannot read the model file %r (%s): chat completions fall back to ChatML; "
                    "run the gateway on the server's host to use the model's template", path, e)
        return ModelInfo(model_name or _name_from_path(path), path, gen, created=int(time.time()),
                         source="unreadable")
    try:
        try:
            meta = json.loads(cf.metadata_json or "{}")
        except ValueError:
            meta = {}
        try:
            cfg = json.loads(cf.config_json or "{}")
        except ValueError:
            cfg = {}
        template = cf.chat_template or None
        bos = eos = ""
        bos_id = cfg.get("bos_token_id", -1)
        eos_ids = cfg.get("eos_token_ids") or []
        if cf.tokenizer_json and (isinstance(bos_id, int) and bos_id >= 0 or eos_ids):
            try:
                import tokenizers
                tk = tokenizers.Tokenizer.from_str(cf.tokenizer_json)
                if isinstance(bos_id, int) and bos_id >= 0:
                    bos = tk.id_to_token(bos_id) or ""
                if eos_ids and isinstance(eos_ids[0], int):
                    eos = tk.id_to_token(eos_ids[0]) or ""
            except Exception as e:
                log.warning("cannot read the tokenizer of %r (%s): bos_token/eos_token are empty", path, e)
        name = model_name or (meta.get("name") if isinstance(meta.get("name"), str) and meta.get("name")
                              else _name_from_path(path))
        try:
            created = int(os.path.getmtime(path))
        except OSError:
            created = int(time.time())
        return ModelInfo(name, path, gen, template, bos, eos, created, "file")
    finally:
        cf.close()


def fetch_template(client: Client, model_name: Optional[str] = None, *, timeout: float = STATS_TIMEOUT) -> ModelInfo:
    """Ask the server which model it serves (`stats`) and read that file's chat template,
    bos/eos token strings and name.  Works only when the gateway can open the same path
    (same host); otherwise the ModelInfo has no template (ChatML is used) and `source` is
    "unreadable".  Raises ColibriError when the server does not answer."""
    return model_info_from_stats(client.stats(timeout=timeout), model_name)


class _TemplateRaise(Exception):
    pass


def _raise_exception(message):
    raise _TemplateRaise(str(message))


def _strftime_now(fmt):
    return time.strftime(str(fmt))


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                                        autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env


_ENV = None
_ENV_LOCK = threading.Lock()


def _compile(source: str):
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _environment()
        return _ENV.from_string(source)


def render_chat(info: ModelInfo, messages: list, add_generation_prompt: bool = True) -> tuple:
    """messages -> (prompt text, add_special_tokens for tokenizing it).

    The model's template when it has one (and it compiles), else ChatML.  Raises HTTPError
    (400 when the template refuses these messages)."""
    import jinja2
    compiled = None
    if info.chat_template and info._compile_error is None:
        if info._compiled is None:
            try:
                info._compiled = _compile(info.chat_template)
            except jinja2.TemplateError as e:
                info._compile_error = str(e)
                log.warning("the chat template of %s does not compile (%s): using ChatML", info.path, e)
        compiled = info._compiled
    templated = compiled is not None
    if compiled is None:
        compiled = _compile(CHATML)
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=info.bos_token, eos_token=info.eos_token)
    except _TemplateRaise as e:
        raise _bad(f"the model's chat template refused these messages: {e}", "messages") from None
    except jinja2.exceptions.SecurityError as e:
        log.error("the chat template of %s attempted an unsafe operation: %s", info.path, e)
        raise HTTPError(500, "the model's chat template attempted an unsafe operation",
                        code="internal", outcome="internal") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise _bad(f"the model's chat template failed on these messages: {type(e).__name__}: {e}",
                   "messages") from None
    # a template writes its own special tokens (as apply_chat_template); ChatML text does not
    return text, not templated


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
                  "repetition_penalty", "logit_bias", "user", "stop_token_ids", "ignore_eos"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
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
    f.neutral("n", [1], "n must be 1: one choice per request")
    f.neutral("best_of", [1], "best_of must be 1")
    for name in ("frequency_penalty", "presence_penalty"):
        f.num(name, 0.0, -2.0, 2.0)
        f.neutral(name, [0], "only 0; use the extension 'repetition_penalty' (multiplicative, > 1 penalises)")
    lb = f.body.get("logit_bias")
    if lb is not None and lb != {}:
        raise _bad("'logit_bias' is not supported by this server", "logit_bias", "unsupported_parameter")
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
        if m.get("tool_calls"):
            raise _bad(f"'{at}.tool_calls' is not supported by this server", f"{at}.tool_calls",
                       "unsupported_parameter")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        for k in ("name", "tool_call_id"):
            v = m.get(k)
            if v is not None:
                if not isinstance(v, str):
                    raise _bad(f"'{at}.{k}' must be a string", f"{at}.{k}", "invalid_type")
                msg[k] = v
        out.append(msg)
    return out


def _chat_unsupported(f: _Fields):
    for name in ("tools", "functions"):
        v = f.body.get(name)
        if v is not None and v != []:
            raise _bad(f"'{name}' (tool calling) is not supported by this server", name, "unsupported_parameter")
    tc = f.body.get("tool_choice")
    if tc is not None and tc not in ("none", "auto"):
        raise _bad("'tool_choice' must be 'none' or 'auto' (tool calling is not supported)", "tool_choice",
                   "unsupported_parameter")
    fc = f.body.get("function_call")
    if fc is not None and fc not in ("none", "auto"):
        raise _bad("'function_call' is not supported by this server", "function_call", "unsupported_parameter")
    rf = f.body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise _bad("'response_format' must be {\"type\": \"text\"} (structured output is not supported)",
                   "response_format", "unsupported_parameter")
    mod = f.body.get("modalities")
    if mod is not None and mod != ["text"]:
        raise _bad("'modalities' must be [\"text\"]", "modalities", "unsupported_parameter")
    lp = f.body.get("logprobs")
    if lp is not None and lp is not False:
        raise _bad("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")
    f.neutral("top_logprobs", [0], "logprobs are not supported")
    for name in ("parallel_tool_calls", "store"):
        f.bool(name, None)
    f.str("service_tier")
    md = f.body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise _bad("'metadata' must be an object", "metadata", "invalid_type")


# ---------------------------------------------------------------------------- responses


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


# ---------------------------------------------------------------------------- metrics


class _ServerCollector:
    """colibri_* families from the server's `stats`, fetched at scrape time."""

    def __init__(self, gw: "Gateway"):
        self.gw = gw

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        up = GaugeMetricFamily("colibri_up", "1 when the colibri server answered stats at this scrape")
        try:
            with self.gw._probe_client() as c:
                st = c.stats()
        except Exception as e:
            log.info("metrics: stats failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        self.gw._saw_generation(st.get("generation"), st.get("model"))

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value or 0))
            return g
        yield gauge("colibri_queue_depth", "requests queued at the router", st.get("queue"))
        yield gauge("colibri_in_flight", "requests running on workers", st.get("in_flight"))
        yield gauge("colibri_draining", "1 while the server drains before stopping", 1 if st.get("draining") else 0)
        yield gauge("colibri_model_generation", "generation of the served model (+1 per reload)",
                    st.get("generation"))
        yield gauge("colibri_model_size_bytes", "size of the served model file", st.get("model_bytes"))
        yield gauge("colibri_uptime_seconds", "router uptime", st.get("uptime_s"))
        info = GaugeMetricFamily("colibri_model_info", "the served model file", labels=["path", "generation"])
        info.add_metric([str(st.get("model", "")), str(st.get("generation", ""))], 1)
        yield info
        workers = [w for w in (st.get("workers") or []) if isinstance(w, dict)]
        states = GaugeMetricFamily("colibri_workers", "worker processes by state", labels=["state"])
        counts = {"ready": 0}
        for w in workers:
            counts[str(w.get("state"))] = counts.get(str(w.get("state")), 0) + 1
        for s, n in sorted(counts.items()):
            states.add_metric([s], n)
        yield states
        labels = ["pid", "wid", "generation"]
        fams = {k: GaugeMetricFamily(f"colibri_worker_{k}_bytes", doc, labels=labels) for k, doc in (
            ("rss", "worker resident set size"), ("uss", "worker unique set size (memory only it maps)"),
            ("pss", "worker proportional set size (shared pages divided among sharers)"),
            ("anon", "worker anonymous memory (smaps_rollup Anonymous)"))}
        running = GaugeMetricFamily("colibri_worker_running", "sequences running on the worker", labels=labels)
        served = CounterMetricFamily("colibri_worker_served", "requests the worker has finished", labels=labels)
        for w in workers:
            lv = [str(w.get("pid")), str(w.get("wid")), str(w.get("generation"))]
            for k, fam in fams.items():
                fam.add_metric(lv, float(w.get(k) or 0))
            running.add_metric(lv, float(w.get("running") or 0))
            served.add_metric(lv, float(w.get("served") or 0))
        yield from fams.values()
        yield running
        yield served
        router = st.get("router") or {}
        if isinstance(router, dict):
            yield gauge("colibri_router_rss_bytes", "router resident set size", router.get("rss"))
        counters = st.get("counters") or {}
        if isinstance(counters, dict):
            ev = CounterMetricFamily("colibri_server_events", "the router's event counters (requests, done, "
                                     "error:<code>, client_gone, retries, worker_lost, ...)", labels=["event"])
            for k, v in sorted(counters.items()):
                if _is_num(v):
                    ev.add_metric([str(k)], float(v))
            yield ev
            restarts = next((counters[k] for k in ("worker_restarts", "restarts", "respawns", "worker_respawns")
                             if _is_num(counters.get(k))), None)
            if restarts is not None:
                yield CounterMetricFamily("colibri_worker_restarts", "workers replaced after dying", value=restarts)


class _Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("colibri_http_requests", "HTTP requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.in_flight = Gauge("colibri_http_requests_in_flight", "HTTP requests being answered", registry=r)
        self.duration = Histogram("colibri_http_request_duration_seconds", "HTTP request duration (streams "
                                  "included, until their last event)", ["endpoint"], registry=r,
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.prompt_tokens = Counter("colibri_http_prompt_tokens", "prompt tokens of finished generations",
                                     registry=r)
        self.completion_tokens = Counter("colibri_http_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("colibri_http_time_to_first_token_seconds", "from sending a generate to its first "
                              "token (queueing and prefill)", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("colibri_http_inter_token_latency_seconds", "time between consecutive streamed "
                             "tokens", registry=r,
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


# ---------------------------------------------------------------------------- the app


@dataclass
class _Route:
    name: str
    methods: tuple
    handler: Callable
    auth: bool = True


class Gateway:
    """The WSGI callable (see the module docstring).  Build it with `create_app`."""

    def __init__(self, connect: str, api_key: Optional[str] = None, model_name: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT, *, max_body: int = MAX_BODY,
                 default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, metrics_auth: bool = False,
                 curve=None, health_timeout: float = HEALTH_TIMEOUT):
        if not isinstance(connect, str) or "://" not in connect:
            raise ValueError(f"connect address {connect!r} must look like tcp://host:port or ipc:///path")
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (omit it to run without one)")
        for name, v in (("timeout", timeout), ("max_body", max_body), ("default_max_tokens", default_max_tokens),
                        ("health_timeout", health_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number (got {v!r})")
        self.connect, self.timeout, self.curve = connect, float(timeout), curve
        self._key = api_key.encode("utf-8") if api_key else None
        self.model_name = model_name or None
        self.max_body, self.default_max_tokens = int(max_body), int(default_max_tokens)
        self.metrics_auth, self.health_timeout = bool(metrics_auth), float(health_timeout)
        self._local = threading.local()
        self._info: Optional[ModelInfo] = None
        self._info_lock = threading.Lock()
        self._stale = False
        self.metrics = _Metrics()
        self.registry = self.metrics.registry
        self.registry.register(_ServerCollector(self))
        self.routes = {
            "/v1/completions": _Route("/v1/completions", ("POST",), self.completions),
            "/v1/chat/completions": _Route("/v1/chat/completions", ("POST",), self.chat_completions),
            "/v1/models": _Route("/v1/models", ("GET",), self.models),
            "/tokenize": _Route("/tokenize", ("POST",), self.tokenize),
            "/detokenize": _Route("/detokenize", ("POST",), self.detokenize),
            "/health": _Route("/health", ("GET",), self.health, auth=False),
            "/metrics": _Route("/metrics", ("GET",), self.metrics_endpoint, auth=self.metrics_auth),
        }
        self._model_route = _Route("/v1/models/{id}", ("GET",), self.model)

    # -- plumbing

    def _client(self) -> Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = Client(self.connect, timeout=self.timeout, curve=self.curve)
            self._local.client = c
        return c

    def _probe_client(self) -> Client:
        """A fresh short-lived Client for /health and /metrics: while the server is away, the
        long-lived per-thread clients would queue probe after probe (up to the socket's
        high-water mark, after which sends block) to be delivered in a burst on its return."""
        return Client(self.connect, timeout=self.health_timeout, curve=self.curve)

    def _drop_client(self):
        """After an unexpected failure inside the client: start this thread afresh."""
        c = getattr(self._local, "client", None)
        self._local.client = None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    def _saw_generation(self, generation, path=None):
        info = self._info
        if info is not None and ((generation is not None and generation != info.generation)
                                 or (path is not None and path != info.path)):
            self._stale = True

    def model_info(self) -> ModelInfo:
        """The cached ModelInfo, refreshed (a `stats` call) every INFO_TTL seconds or after a
        new generation was seen.  A failed refresh keeps the cached info (the request itself
        will then meet the server's state); with none cached, the error is the answer."""
        info = self._info
        if info is not None and not self._stale and time.monotonic() - info.fetched_at < INFO_TTL:
            return info
        try:
            # no lock around the network call: a slow server must not serialise every thread
            st = self._call(lambda c: c.stats(timeout=min(self.timeout, STATS_TIMEOUT)))
        except HTTPError:
            if info is not None:
                info.fetched_at = time.monotonic() - INFO_TTL + 2.0     # retry in 2 s, not at once
                return info
            raise
        with self._info_lock:
            info = self._info
            if info is not None and st.get("model") == info.path and st.get("generation") == info.generation:
                info.fetched_at = time.monotonic()
                self._stale = False
                return info
            self._info = info = model_info_from_stats(st, self.model_name)
            self._stale = False
            log.info("serving model %r (%s, generation %s, chat template: %s)", info.name, info.path,
                     info.generation, "the model's" if info.chat_template else "ChatML")
            return info

    def _call(self, fn, prompt_param="prompt"):
        """Run fn(client) mapping colibri errors to HTTP errors."""
        try:
            return fn(self._client())
        except ColibriError as e:
            raise http_error_for(e, prompt_param) from None
        except HTTPError:
            raise
        except Exception as e:      # zmq trouble or a client bug: a fresh client next time
            self._drop_client()
            log.exception("colibri client failure")
            raise HTTPError(502, f"cannot talk to the colibri server ({type(e).__name__})", code="upstream_error",
                            outcome="upstream_error") from None

    def _too_large(self, stream, message):
        """413, after reading (and dropping) what the client sends anyway, up to DRAIN_LIMIT:
        closing a socket with unread data resets it, and the client would never see the 413."""
        left = DRAIN_LIMIT
        try:
            while stream is not None and left > 0:
                chunk = stream.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass
        return HTTPError(413, message, code="request_too_large", outcome="too_large")

    def _read_json(self, environ) -> dict:
        length = environ.get("CONTENT_LENGTH") or ""
        stream = environ.get("wsgi.input")
        if length:
            try:
                n = int(length)
            except ValueError:
                raise _bad("invalid Content-Length header") from None
            if n > self.max_body:
                raise self._too_large(stream, f"request body of {n} bytes exceeds the limit of {self.max_body}")
            data = stream.read(n) if stream is not None and n > 0 else b""
        else:
            data = stream.read(self.max_body + 1) if stream is not None else b""
            if len(data) > self.max_body:
                raise self._too_large(stream, f"request body exceeds the limit of {self.max_body} bytes")
        if not data.strip():
            raise _bad("the request body is empty: send a JSON object", None, "invalid_json")

        def no_constants(c):
            raise ValueError(f"{c} is not valid JSON")
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=no_constants)
        except UnicodeDecodeError:
            raise _bad("the request body is not UTF-8", None, "invalid_json") from None
        except (ValueError, RecursionError) as e:
            raise _bad(f"the request body is not valid JSON ({str(e)[:120]})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad(f"the request body must be a JSON object, not {type(body).__name__}", None, "invalid_json")
        return body

    def _check_auth(self, environ):
        if self._key is None:
            return
        h = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = h.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise HTTPError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers=[("WWW-Authenticate", "Bearer")],
                            outcome="unauthorized")
        try:
            given = token.encode("latin-1")       # WSGI headers are latin-1 decoded bytes
        except UnicodeEncodeError:
            given = token.encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._key):
            raise HTTPError(401, "incorrect API key provided", code="invalid_api_key",
                            headers=[("WWW-Authenticate", "Bearer")], outcome="unauthorized")

    def _check_model(self, f: _Fields) -> ModelInfo:
        model = f.str("model")
        info = self.model_info()
        if model is not None and model != info.name:
            raise _bad(f"the model {model[:100]!r} does not exist: this server serves {info.name!r}", "model",
                       "model_not_found")
        return info

    def _record(self, endpoint, outcome, t0):
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(endpoint, outcome).inc()
        m.duration.labels(endpoint).observe(time.monotonic() - t0)

    # -- WSGI

    def __call__(self, environ, start_response):
        t0 = time.monotonic()
        self.metrics.in_flight.inc()
        path = environ.get("PATH_INFO") or "/"
        route = self.routes.get(path.rstrip("/") or "/")
        arg = None
        if route is None and path.startswith("/v1/models/"):
            route, arg = self._model_route, path[len("/v1/models/"):]
        endpoint = route.name if route is not None else "other"
        try:
            if route is None:
                raise HTTPError(404, f"no such endpoint: {path[:100]}", code="not_found", outcome="not_found")
            method = environ.get("REQUEST_METHOD", "GET")
            if method not in route.methods:
                raise HTTPError(405, f"{route.name} does not accept {method[:16]} (use {', '.join(route.methods)})",
                                code="method_not_allowed", headers=[("Allow", ", ".join(route.methods))],
                                outcome="method_not_allowed")
            if route.auth:
                self._check_auth(environ)
            resp = route.handler(environ, arg) if arg is not None else route.handler(environ)
        except HTTPError as e:
            resp = _error_resp(e)
        except Exception:
            log.exception("unexpected error answering %s", path[:100])
            resp = _error_resp(HTTPError(500, "internal error in the HTTP gateway (see its log)", code="internal",
                                         outcome="internal"))
        status = f"{resp.status} {_STATUS_TEXT.get(resp.status, 'Error')}"
        if isinstance(resp.body, (bytes, bytearray)):
            start_response(status, resp.headers + [("Content-Length", str(len(resp.body)))])
            self._record(endpoint, resp.outcome, t0)
            return [bytes(resp.body)]
        body: _StreamBody = resp.body
        body._finish = lambda outcome: self._record(endpoint, outcome, t0)
        start_response(status, resp.headers + [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")])
        return body

    # -- generation core

    def _start(self, prompt, params, prompt_param):
        """Send a generate and wait for its first message: (stream, first chunk)."""
        t0 = time.monotonic()
        stream = self._call(lambda c: c.stream(prompt, **params), prompt_param)
        try:
            first = self._call(lambda c: next(stream), prompt_param)
        except BaseException:
            stream.close()
            raise
        if first.token_ids and not first.is_final:
            self.metrics.ttft.observe(time.monotonic() - t0)
        return stream, first

    def _chunks(self, stream, first):
        """The chunks of a started stream, observing inter-token latencies."""
        chunk, last = first, time.monotonic()
        while True:
            yield chunk
            if chunk.is_final:
                self._saw_generation(chunk.generation)
                u = chunk.usage or {}
                if _is_num(u.get("prompt_tokens")):
                    self.metrics.prompt_tokens.inc(u["prompt_tokens"])
                if _is_num(u.get("completion_tokens")):
                    self.metrics.completion_tokens.inc(u["completion_tokens"])
                return
            chunk = next(stream)
            now = time.monotonic()
            if not chunk.is_final and chunk.token_ids:
                self.metrics.itl.observe(now - last)
                last = now

    @staticmethod
    def _usage(final, prompt_len=None):
        u = final.usage or {}
        pt = u.get("prompt_tokens", prompt_len or 0)
        ct = u.get("completion_tokens", 0)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    def _generate(self, prompt, params, prompt_param):
        """Non-streaming: (text, final chunk)."""
        stream, first = self._start(prompt, params, prompt_param)
        try:
            parts, final = [], None
            for ch in self._call(lambda c: list(self._chunks(stream, first)), prompt_param):
                parts.append(ch.text)
                final = ch
        finally:
            stream.close()
        if final.finish_reason not in ("stop", "length"):
            raise HTTPError(503, f"the server ended the request early (finish_reason {final.finish_reason!r})",
                            code="cancelled", outcome="cancelled")
        return "".join(parts), final

    def _events(self, stream, first, piece, finish, usage_chunk, state, prompt_param, opening=None):
        """SSE events of a started stream: opening, pieces, the finish chunk, usage, [DONE]."""
        try:
            if opening is not None:
                yield _sse(opening)
            for ch in self._chunks(stream, first):
                if ch.text:
                    yield _sse(piece(ch.text))
                if ch.is_final:
                    if ch.finish_reason not in ("stop", "length"):
                        raise ColibriError(f"the server ended the request early (finish_reason "
                                           f"{ch.finish_reason!r})", code="cancelled")
                    yield _sse(finish(ch.finish_reason))
                    if usage_chunk is not None:
                        yield _sse(usage_chunk(self._usage(ch)))
            state["outcome"] = "ok"
            yield _DONE
        except ColibriError as e:
            err = http_error_for(e, prompt_param)
            state["outcome"] = err.outcome
            yield _sse(err.body())
            yield _DONE
        except GeneratorExit:
            raise
        except Exception:
            log.exception("stream failed")
            state["outcome"] = "internal"
            yield _sse(HTTPError(500, "internal error in the HTTP gateway (see its log)", code="internal").body())
            yield _DONE
        finally:
            stream.close()

    def _streaming(self, gen_factory, stream) -> _Resp:
        state: dict = {}
        body = _StreamBody(gen_factory(state), state, stream.close, lambda outcome: None)
        return _Resp(200, body, content_type="text/event-stream; charset=utf-8")

    # -- endpoints

    def completions(self, environ) -> _Resp:
        body = self._read_json(environ)
        _check_known(body, _COMPLETION_FIELDS)
        f = _Fields(body)
        prompt = _completion_prompt(body)
        params = _sampling(f, DEFAULT_MAX_TOKENS, chat=False)
        stream_mode = f.bool("stream", False)
        include_usage = _stream_options(f, stream_mode)
        f.neutral("echo", [False], "echo must be false")
        f.neutral("logprobs", [], "logprobs must be null")
        f.neutral("suffix", [], "suffix must be null")
        info = self._check_model(f)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

        def obj(choices, usage=None):
            o = {"id": rid, "object": "text_completion", "created": created, "model": info.name,
                 "system_fingerprint": None, "choices": choices}
            if usage is not None or include_usage:
                o["usage"] = usage
            return o

        def choice(text, fr):
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": fr}

        if not stream_mode:
            text, final = self._generate(prompt, params, "prompt")
            return _json(obj([choice(text, final.finish_reason)], self._usage(final)))
        stream, first = self._start(prompt, params, "prompt")
        return self._streaming(lambda state: self._events(
            stream, first, lambda t: obj([choice(t, None)]), lambda fr: obj([choice("", fr)]),
            (lambda u: obj([], u)) if include_usage else None, state, "prompt"), stream)

    def chat_completions(self, environ) -> _Resp:
        body = self._read_json(environ)
        _check_known(body, _CHAT_FIELDS)
        f = _Fields(body)
        messages = _chat_messages(body)
        params = _sampling(f, self.default_max_tokens, chat=True)
        stream_mode = f.bool("stream", False)
        include_usage = _stream_options(f, stream_mode)
        _chat_unsupported(f)
        add_gen = f.bool("add_generation_prompt", True)
        info = self._check_model(f)
        text, special = render_chat(info, messages, add_gen)
        ids = self._call(lambda c: c.tokenize(text, add_special_tokens=special), "messages")
        if not ids:
            raise _bad("the messages render to an empty prompt", "messages")
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        fingerprint = f"colibri-g{info.generation}" if info.generation is not None else None

        def obj(kind, choices, usage=None):
            o = {"id": rid, "object": kind, "created": created, "model": info.name,
                 "system_fingerprint": fingerprint, "choices": choices}
            if kind == "chat.completion" or include_usage:
                o["usage"] = usage
            return o

        def delta(d, fr=None):
            return obj("chat.completion.chunk", [{"index": 0, "delta": d, "logprobs": None, "finish_reason": fr}])

        if not stream_mode:
            out, final = self._generate(ids, params, "messages")
            return _json(obj("chat.completion", [{
                "index": 0, "message": {"role": "assistant", "content": out, "refusal": None},
                "logprobs": None, "finish_reason": final.finish_reason}], self._usage(final, len(ids))))
        stream, first = self._start(ids, params, "messages")
        return self._streaming(lambda state: self._events(
            stream, first, lambda t: delta({"content": t}), lambda fr: delta({}, fr),
            (lambda u: obj("chat.completion.chunk", [], u)) if include_usage else None, state, "messages",
            opening=delta({"role": "assistant", "content": ""})), stream)

    def _model_obj(self, info):
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "colibri",
                "root": info.path, "parent": None}

    def models(self, environ) -> _Resp:
        info = self.model_info()
        return _json({"object": "list", "data": [self._model_obj(info)]})

    def model(self, environ, name) -> _Resp:
        info = self.model_info()
        if name != info.name:
            raise HTTPError(404, f"the model {name[:100]!r} does not exist: this server serves {info.name!r}",
                            param="model", code="model_not_found", outcome="not_found")
        return _json(self._model_obj(info))

    def tokenize(self, environ) -> _Resp:
        body = self._read_json(environ)
        _check_known(body, {"prompt", "add_special_tokens", "model"})
        f = _Fields(body)
        prompt = body.get("prompt")
        if prompt is None:
            raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string", "prompt", "invalid_type")
        add = f.bool("add_special_tokens", True)
        if body.get("model") is not None:
            self._check_model(f)
        ids = self._call(lambda c: c.tokenize(prompt, add_special_tokens=add))
        return _json({"tokens": ids, "count": len(ids)})

    def detokenize(self, environ) -> _Resp:
        body = self._read_json(environ)
        _check_known(body, {"tokens", "model"})
        f = _Fields(body)
        toks = body.get("tokens")
        if toks is None:
            raise _bad("'tokens' is required", "tokens", "missing_required_parameter")
        if not isinstance(toks, list) or not all(_is_int(t) and t >= 0 for t in toks):
            raise _bad("'tokens' must be a list of token ids (integers >= 0)", "tokens", "invalid_type")
        if body.get("model") is not None:
            self._check_model(f)
        text = self._call(lambda c: c.detokenize(toks), "tokens")
        return _json({"prompt": text})

    def health(self, environ) -> _Resp:
        try:
            with self._probe_client() as c:
                h = c.health()
        except ColibriTimeout:
            return _Resp(503, _json_bytes({"status": "unreachable", "error": f"the colibri server at "
                         f"{self.connect} did not answer within {self.health_timeout:g} s"}), outcome="unavailable")
        except ColibriError as e:
            return _Resp(503, _json_bytes({"status": "error", "error": str(e)}), outcome="unavailable")
        except Exception as e:
            log.warning("health check failed: %r", e)
            return _Resp(503, _json_bytes({"status": "error", "error": type(e).__name__}), outcome="unavailable")
        self._saw_generation(h.get("generation"))
        out = {k: h.get(k) for k in ("status", "workers_ready", "generation", "queue")}
        ok = h.get("status") == "ok"
        return _Resp(200 if ok else 503, _json_bytes(out), outcome="ok" if ok else "unavailable")

    def metrics_endpoint(self, environ) -> _Resp:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return _Resp(200, generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)


def create_app(connect: str, api_key: Optional[str] = None, model_name: Optional[str] = None,
               timeout: float = DEFAULT_TIMEOUT, **options) -> Gateway:
    """The WSGI callable.  options: max_body, default_max_tokens, metrics_auth, curve,
    health_timeout (see Gateway)."""
    return Gateway(connect, api_key, model_name, timeout, **options)


# ---------------------------------------------------------------------------- configuration

ENV = {  # env variable -> (create_app option, parser)
    "COLIBRI_HTTP_CONNECT": ("connect", str),
    "COLIBRI_HTTP_API_KEY": ("api_key", str),
    "COLIBRI_HTTP_MODEL_NAME": ("model_name", str),
    "COLIBRI_HTTP_TIMEOUT": ("timeout", float),
    "COLIBRI_HTTP_MAX_BODY": ("max_body", int),
    "COLIBRI_HTTP_DEFAULT_MAX_TOKENS": ("default_max_tokens", int),
    "COLIBRI_HTTP_METRICS_AUTH": ("metrics_auth", None),
    "COLIBRI_HTTP_CURVE_SERVERKEY": ("curve", str),
}


# every COLIBRI_HTTP_* variable read here or by configs/gunicorn.conf.py (`colibri serve` must
# not take them for unknown settings: settings.ENV_NOT_SETTINGS)
ENV_VARS = frozenset(ENV) | {"COLIBRI_HTTP_API_KEY_FILE", "COLIBRI_HTTP_BIND", "COLIBRI_HTTP_WORKERS",
                             "COLIBRI_HTTP_THREADS", "COLIBRI_HTTP_LOG_LEVEL", "COLIBRI_HTTP_ACCESS_LOG"}


def _env_bool(name, v):
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={v!r}: expected 1/0, true/false, yes/no or on/off")


def _read_key_file(path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"API key file {path}: {e.strerror or e}") from None
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def options_from_env(environ=None) -> dict:
    """create_app keyword arguments from COLIBRI_HTTP_* variables (ValueError naming a bad one)."""
    environ = os.environ if environ is None else environ
    opts = {"connect": DEFAULT_CONNECT}
    for name, (opt, parse) in ENV.items():
        v = environ.get(name)
        if v is None or v == "":
            continue
        try:
            opts[opt] = _env_bool(name, v) if parse is None else parse(v)
        except ValueError as e:
            raise ValueError(f"{name}={v!r}: {e}") from None
    kf = environ.get("COLIBRI_HTTP_API_KEY_FILE")
    if kf and "api_key" not in opts:
        opts["api_key"] = _read_key_file(kf)
    return opts


def app_from_env() -> Gateway:
    """App factory for `gunicorn 'colibri_server.http:app_from_env()'`: options from the
    COLIBRI_HTTP_* environment (CONNECT, API_KEY or API_KEY_FILE, MODEL_NAME, TIMEOUT, MAX_BODY,
    DEFAULT_MAX_TOKENS, METRICS_AUTH, CURVE_SERVERKEY)."""
    opts = options_from_env()
    return create_app(opts.pop("connect"), **opts)


def _is_loopback(bind: str) -> bool:
    if bind.startswith("unix:"):
        return True
    host = bind.rsplit(":", 1)[0].strip("[]") if ":" in bind else bind
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(connect: str, bind: str = DEFAULT_BIND, workers: int = 1, threads: int = 8,
          api_key: Optional[str] = None, *, model_name: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
          log_level: str = "info", gunicorn_options: Optional[dict] = None, **app_options):
    """Run the gateway under gunicorn (gthread workers) in this process; does not return."""
    from gunicorn.app.base import BaseApplication
    if not api_key and not _is_loopback(bind):
        log.warning("the HTTP gateway listens on %s without an API key: anyone who can reach it can use the model",
                    bind)
    # build one app now so that bad options fail here, not in every worker
    create_app(connect, api_key, model_name, timeout, **app_options)
    options = {"bind": bind, "workers": workers, "threads": threads, "worker_class": "gthread",
               "timeout": 120, "graceful_timeout": 30, "keepalive": 5, "loglevel": log_level,
               "proc_name": "colibri-http", "accesslog": None, "errorlog": "-",
               # gunicorn >= 24 opens a control socket at a fixed per-user path: two gateways
               # on one host would fight over it, and nothing here uses it
               "control_socket_disable": True}
    options.update(gunicorn_options or {})

    class _Application(BaseApplication):
        def load_config(self):
            for k, v in options.items():
                if k in self.cfg.settings and (v is not None or k == "accesslog"):
                    self.cfg.set(k, v)

        def load(self):
            return create_app(connect, api_key, model_name, timeout, **app_options)

    _Application().run()


def add_http_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `colibri http` options (defaults from the COLIBRI_HTTP_* environment; string
    defaults, so that a malformed variable is reported by argparse only for `colibri http`)."""
    env = os.environ.get
    p.add_argument("--connect", default=env("COLIBRI_HTTP_CONNECT", DEFAULT_CONNECT),
                   help="address of the colibri server (tcp://host:port or ipc:///path) [COLIBRI_HTTP_CONNECT]")
    p.add_argument("--bind", default=env("COLIBRI_HTTP_BIND", DEFAULT_BIND),
                   help=f"HTTP address to listen on (default {DEFAULT_BIND}) [COLIBRI_HTTP_BIND]")
    p.add_argument("--workers", type=int, default=env("COLIBRI_HTTP_WORKERS", "1"),
                   help="gunicorn worker processes (each exports its own request metrics)")
    p.add_argument("--threads", type=int, default=env("COLIBRI_HTTP_THREADS", "8"),
                   help="threads per worker process = concurrent HTTP requests per process")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or "
                        "COLIBRI_HTTP_API_KEY)")
    p.add_argument("--api-key-file", default=env("COLIBRI_HTTP_API_KEY_FILE"),
                   help="read the API key from this file [COLIBRI_HTTP_API_KEY_FILE]")
    p.add_argument("--model-name", default=env("COLIBRI_HTTP_MODEL_NAME"),
                   help="model id to serve as (default: the model file's metadata name) [COLIBRI_HTTP_MODEL_NAME]")
    p.add_argument("--timeout", type=float, default=env("COLIBRI_HTTP_TIMEOUT", str(DEFAULT_TIMEOUT)),
                   help="seconds to wait for the next message of a request, queueing included")
    p.add_argument("--max-body", type=int, default=env("COLIBRI_HTTP_MAX_BODY", str(MAX_BODY)),
                   help="largest request body in bytes (413 beyond)")
    p.add_argument("--default-max-tokens", type=int,
                   default=env("COLIBRI_HTTP_DEFAULT_MAX_TOKENS", str(DEFAULT_CHAT_MAX_TOKENS)),
                   help="max_tokens of a chat completion that gives none")
    p.add_argument("--metrics-auth", action="store_true", default=None,
                   help="require the API key on /metrics too [COLIBRI_HTTP_METRICS_AUTH=1]")
    p.add_argument("--log-level", default=env("COLIBRI_HTTP_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error", "critical"))
    return p


def cmd_http(a):
    """`colibri http`: run the gateway (gunicorn, gthread) until stopped."""
    try:
        key = a.api_key or os.environ.get("COLIBRI_HTTP_API_KEY") or None
        if not key and a.api_key_file:
            key = _read_key_file(a.api_key_file)
        metrics_auth = a.metrics_auth
        if metrics_auth is None:
            metrics_auth = _env_bool("COLIBRI_HTTP_METRICS_AUTH", os.environ.get("COLIBRI_HTTP_METRICS_AUTH", "0"))
        if a.workers < 1 or a.threads < 1:
            raise ValueError("--workers and --threads must be >= 1")
        logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO), stream=sys.stderr,
                            format="%(asctime)s [%(process)d] %(name)s %(levelname)s: %(message)s")
        serve(a.connect, bind=a.bind, workers=a.workers, threads=a.threads, api_key=key, model_name=a.model_name,
              timeout=a.timeout, log_level=a.log_level, max_body=a.max_body,
              default_max_tokens=a.default_max_tokens, metrics_auth=metrics_auth,
              curve=os.environ.get("COLIBRI_HTTP_CURVE_SERVERKEY") or None)
    except ValueError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(prog="colibri-http", description="OpenAI-compatible HTTP gateway to a colibri server")
    add_http_arguments(p)
    cmd_http(p.parse_args(argv))


if __name__ == "__main__":
    main()
