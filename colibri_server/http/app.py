"""The gateway's WSGI app: `Gateway` routes each request, checks the API key, and answers from a
running colibri server through a per-thread `colibri_server.client.Client`; `create_app` and
`app_from_env` build it (gunicorn loads `colibri_server.http:app_from_env()`).

    colibri http --connect tcp://127.0.0.1:5555 --bind 127.0.0.1:8000
    colibri http --connect tcp://10.0.0.1:5555 --connect tcp://10.0.0.2:5555    # several routers (routers.py)
    COLIBRI_HTTP_CONNECT=ipc:///run/colibri/colibri.sock \\
        gunicorn 'colibri_server.http:app_from_env()' -c configs/gunicorn.conf.py

Endpoints
    POST /v1/completions        prompt: str | [int] | [str] (one) | [[int]] (one)
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models, GET /v1/models/{id}
    POST /tokenize              {"prompt": str, "add_special_tokens": bool = true} -> {"tokens", "count"}:
                                the prompt as /v1/completions reads it (special-token text parsed);
                                or {"messages": [...], "add_generation_prompt": bool = true}: as chat does
    POST /apply-template        {"messages": [...], "add_generation_prompt": bool = true} -> {"prompt": str},
                                the chat template's text (llama.cpp's server has the same endpoint)
    POST /detokenize            {"tokens": [int]} -> {"prompt": str}
    GET  /health                200 {"status": "ok", ...} | 503 (starting, draining, unreachable in ~2 s);
                                "starting" (the model loads, kernels compile) with Retry-After, as every
                                other endpoint's 503 meanwhile (code "starting");
                                several routers: 200 while one is ok, each under "routers"
    GET  /metrics               Prometheus text format
    GET  /, /status, /status.json  the chat and status pages and the stats they poll (pages.py; `pages` off: 404)

API key (optional: `--api-key`, `--api-key-file` or COLIBRI_HTTP_API_KEY): every endpoint
requires `Authorization: Bearer <key>` (compared with hmac.compare_digest) EXCEPT /health,
for load balancers and orchestrators, and /metrics, for Prometheus scrapers (set
`metrics_auth` / COLIBRI_HTTP_METRICS_AUTH=1 to protect /metrics too: it shows the model path
and worker pids, no prompts).  Failures are 401 with an OpenAI-style body.

Streaming: server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`) produced by a
generator.  The gateway waits for the first token before answering, so an error before any
token gets its proper HTTP status.  When the HTTP client goes away, gunicorn's write fails and
it closes the response iterable: that closes the colibri Stream, which sends a `cancel`, and
the router frees the worker.  A non-streaming request writes nothing until it ends: between its
tokens the gateway peeks at the connection and, once the client has hung up, cancels the request
the same way.  While a request waits for its next message (queued, or on a worker that sends
nothing) the gateway peeks every HANGUP_POLL (0.25) s too, so a hang-up is noticed within a
second whether tokens flow or not.

Slow clients: `HeadFirstWorker` (the default worker class of `colibri http` and
configs/gunicorn.conf.py) reads each request whole (head and body, Content-Length or chunked,
"100 Continue" sent by it) in gunicorn's main loop, and hands it to a thread only when it is all
there; a request not all in within COLIBRI_HTTP_HEADER_TIMEOUT (10 s) of its first byte gets
408, a Content-Length over max_body 413 before its body is read.  Idle or half-sent
connections (slowloris) therefore hold no thread; GET /health and /metrics have threads of
their own.

Threads: a Client is not thread-safe, so each gunicorn thread lazily creates its own
(`threading.local`); a streaming response is iterated by the thread that created it, as
gunicorn's gthread worker does.

The rest of the gateway lives beside this module (the package's face re-exports what callers
use): `openai` (request fields and their validation, error mapping, the shapes of answers),
`template` (the model's info and chat template), `metrics` (the Prometheus registry), `config`
(the COLIBRI_HTTP_* environment), `serve` (gunicorn and `colibri http`) and `headfirst`
(HeadFirstWorker).
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ..client import Client, ColibriError, ColibriTimeout, RouterSet, Starting
from ..settings.schema import GATEWAY_SETTINGS
from ..wire.protocol import REQUEST_ID
from .completions import DEFAULT_MAX_TOKENS, Generations  # noqa: F401  (re-exported)
from .config import DEFAULT_CONNECT, ENV, ENV_VARS, options_from_env  # noqa: F401
from .metrics import _Metrics, _ServerCollector
from .openai import (  # noqa: F401
    _CHAT_FIELDS,
    _COMPLETION_FIELDS,
    _DONE,
    STARTING_RETRY_AFTER,
    HTTPError,
    _bad,
    _chat_messages,
    _chat_unsupported,
    _check_known,
    _completion_prompt,
    _error_resp,
    _Fields,
    _is_int,
    _is_num,
    _json,
    _json_bytes,
    _Resp,
    _sampling,
    _sse,
    _stream_options,
    _StreamBody,
    chat_logprobs,
    chat_logprobs_obj,
    completion_embeds,
    completion_logprobs,
    http_error_for,
    legacy_logprobs_obj,
)
from .routers import connect_addresses
from .template import (  # noqa: F401
    CHATML,
    STATS_TIMEOUT,
    ModelInfo,
    fetch_template,
    model_info_from_stats,
    render_chat,
    render_chat_segments,
)

log = logging.getLogger("colibri.http")

__all__ = ["create_app", "app_from_env", "fetch_template", "ModelInfo", "render_chat", "Gateway", "HTTPError"]

# the defaults of the gateway's settings (settings/schema.py: GATEWAY)
DEFAULT_BIND = GATEWAY_SETTINGS["bind"].value
DEFAULT_TIMEOUT = GATEWAY_SETTINGS["timeout"].value   # seconds to wait for the next message of a request
HEALTH_TIMEOUT = 2.0
MAX_BODY = GATEWAY_SETTINGS["max_body"].value        # bytes of an HTTP request body
DRAIN_LIMIT = 16 << 20         # bytes of an oversized body read and dropped so that its 413 is seen
DEFAULT_CHAT_MAX_TOKENS = GATEWAY_SETTINGS["default_max_tokens"].value   # a chat completion that gives none
INFO_TTL = 30.0                # seconds a fetched ModelInfo is trusted without a new generation seen
HANGUP_POLL = 0.25             # seconds between looks at a waiting request's HTTP connection

_STATUS_TEXT = {200: "OK", 304: "Not Modified", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
                408: "Request Timeout", 413: "Payload Too Large", 429: "Too Many Requests",
                499: "Client Closed Request", 500: "Internal Server Error",
                502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}

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
                 curve=None, health_timeout: float = HEALTH_TIMEOUT, pages: bool = True):
        addrs = connect_addresses(connect)
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (omit it to run without one)")
        for name, v in (("timeout", timeout), ("max_body", max_body), ("default_max_tokens", default_max_tokens),
                        ("health_timeout", health_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number (got {v!r})")
        # several routers (http/routers.py): the threads' clients share one RouterSet
        self.routers = RouterSet(addrs) if len(addrs) > 1 else None
        self.connect = addrs[0] if self.routers is None else ",".join(addrs)
        self.timeout, self.curve = float(timeout), curve
        self._seen: dict = {}       # several routers: router -> (generation, model path) last seen
        self._key = api_key.encode("utf-8") if api_key else None
        # "a,b": aliases (vLLM's --served-model-name a b); the first is the name answers carry
        self.model_names = [n.strip() for n in (model_name or "").split(",") if n.strip()]
        self.model_name = self.model_names[0] if self.model_names else None
        self.max_body, self.default_max_tokens = int(max_body), int(default_max_tokens)
        self.metrics_auth, self.health_timeout = bool(metrics_auth), float(health_timeout)
        self._local = threading.local()
        self._info: Optional[ModelInfo] = None
        self._info_lock = threading.Lock()
        self._stale = False
        self.metrics = _Metrics()
        self.registry = self.metrics.registry
        self.registry.register(_ServerCollector(self))
        self.generations = Generations(self)
        self.routes = {
            "/v1/completions": _Route("/v1/completions", ("POST",), self.generations.completions),
            "/v1/chat/completions": _Route("/v1/chat/completions", ("POST",), self.generations.chat_completions),
            "/v1/models": _Route("/v1/models", ("GET",), self.models),
            "/tokenize": _Route("/tokenize", ("POST",), self.tokenize),
            "/detokenize": _Route("/detokenize", ("POST",), self.detokenize),
            "/apply-template": _Route("/apply-template", ("POST",), self.apply_template),
            "/health": _Route("/health", ("GET",), self.health, auth=False),
            "/metrics": _Route("/metrics", ("GET",), self.metrics_endpoint, auth=self.metrics_auth),
        }
        self._model_route = _Route("/v1/models/{id}", ("GET",), self.model)
        if pages:               # the chat and status pages, their assets and /status.json (pages.py)
            from .pages import Pages
            self.routes.update({p: _Route(p, m, h, a) for p, (m, h, a) in Pages(self).routes().items()})

    # -- plumbing

    def _client(self) -> Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = Client(self.routers or self.connect, timeout=self.timeout, curve=self.curve)
            self._local.client = c
        return c

    def probe_client(self) -> Client:
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

    def saw_generation(self, generation, path=None, router=None):
        if router is not None:      # several routers: each counts its own generations (and has its own path)
            with self._info_lock:
                prev = self._seen.get(router, (None, None))
                cur = self._seen[router] = (prev[0] if generation is None else generation,
                                            prev[1] if path is None else path)
            if prev != (None, None) and cur != prev:
                self._stale = True
            return
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
            st = self.call(lambda c: c.stats(timeout=min(self.timeout, STATS_TIMEOUT)))
            if st.get("starting"):          # no generation yet: nothing to describe, nothing to serve
                raise http_error_for(Starting("the server is loading its model and compiling its kernels: "
                                              "retry shortly"))
        except HTTPError:
            if info is not None:
                info.fetched_at = time.monotonic() - INFO_TTL + 2.0     # retry in 2 s, not at once
                return info
            raise
        if self.routers is not None and isinstance(st.get("addr"), str):
            self.saw_generation(st.get("generation"), st.get("model"), router=st["addr"])
        with self._info_lock:
            info = prev = self._info
            if info is not None and st.get("model") == info.path and st.get("generation") == info.generation:
                info.fetched_at = time.monotonic()
                self._stale = False
                return info
            self._info = info = model_info_from_stats(st, self.model_name)
            self._stale = False
            if self.routers is not None and prev is not None and (prev.name, prev.path, prev.chat_template) == \
                    (info.name, info.path, info.chat_template):
                return info         # another router's generation number of the same model: nothing to say
            log.info("serving model %r (%s, generation %s, chat template: %s)", info.name, info.path,
                     info.generation, "the model's" if info.chat_template else "ChatML")
            return info

    def call(self, fn, prompt_param="prompt"):
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

    def read_json(self, environ) -> dict:
        length = environ.get("CONTENT_LENGTH") or ""
        stream = environ.get("wsgi.input")
        if length:
            try:
                n = int(length)
            except ValueError:
                raise _bad("invalid Content-Length header") from None
            if n > self.max_body:
                raise self._too_large(stream, f"request body of {n} bytes exceeds the limit of {self.max_body}")
            data = _read_body(stream, n) if stream is not None and n > 0 else b""
        else:
            data = _read_body(stream, self.max_body + 1) if stream is not None else b""
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

    def check_model(self, f: _Fields) -> ModelInfo:
        model = f.str("model")
        info = self.model_info()
        if model is not None and model != info.name and model not in self.model_names:
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
        rq = environ.get("HTTP_X_REQUEST_ID") or ""
        if not REQUEST_ID.fullmatch(rq):          # the client's id when it is one the server accepts
            rq = uuid.uuid4().hex
        environ["colibri.request_id"] = rq
        self._local.gone = _hangup_probe(environ)     # for _await: this thread's request
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
        resp.headers.append(("X-Request-Id", rq))
        if isinstance(resp.body, (bytes, bytearray)):
            start_response(status, resp.headers + [("Content-Length", str(len(resp.body)))])
            self._record(endpoint, resp.outcome, t0)
            return [bytes(resp.body)]
        body: _StreamBody = resp.body
        body._finish = lambda outcome: self._record(endpoint, outcome, t0)
        start_response(status, resp.headers + [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")])
        return body

    # -- generation core

    def start(self, prompt, params, prompt_param):
        """Send a generate and wait for its first message: (stream, first chunk)."""
        t0 = time.monotonic()
        stream = self.call(lambda c: c.stream(prompt, **params), prompt_param)
        try:
            first = self.call(lambda c: (self._await(stream), next(stream))[1], prompt_param)
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
                self.saw_generation(chunk.generation, router=getattr(stream, "addr", None))
                u = chunk.usage or {}
                if _is_num(u.get("prompt_tokens")):
                    self.metrics.prompt_tokens.inc(u["prompt_tokens"])
                if _is_num(u.get("completion_tokens")):
                    self.metrics.completion_tokens.inc(u["completion_tokens"])
                t = chunk.timings or {}
                for key, hist in (("prefill_s", self.metrics.prefill), ("decode_s", self.metrics.decode)):
                    if _is_num(t.get(key)):
                        hist.observe(t[key])
                return
            self._await(stream)
            chunk = next(stream)
            now = time.monotonic()
            if not chunk.is_final and chunk.token_ids:
                self.metrics.itl.observe(now - last)
                last = now

    def _await(self, stream):
        """Wait for the stream's next message, looking every HANGUP_POLL s whether the HTTP client
        hung up meanwhile (499, and the caller's close cancels the request): a request queued, or
        on a worker that sends nothing, is noticed as soon as one sending tokens."""
        gone = getattr(self._local, "gone", None)
        if gone is None or not hasattr(stream, "wait"):
            return
        end = time.monotonic() + self.timeout
        while not stream.wait(max(0.0, min(HANGUP_POLL, end - time.monotonic()))):
            if gone():
                raise HTTPError(499, "the client closed the connection", code="client_gone", outcome="disconnected")
            if time.monotonic() >= end:
                raise ColibriTimeout(f"no message within {self.timeout:g} s", code="timeout")

    @staticmethod
    def usage(final, prompt_len=None):
        u = final.usage or {}
        pt = u.get("prompt_tokens", prompt_len or 0)
        ct = u.get("completion_tokens", 0)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    def generate(self, prompt, params, prompt_param, environ=None):
        """Non-streaming: (text, final chunk).  The HTTP client's socket is probed between
        tokens: when it has hung up, the request is cancelled (closing the stream sends the
        cancel) and its worker is free at once, not after the whole completion."""
        stream, first = self.start(prompt, params, prompt_param)
        gone = _hangup_probe(environ)
        parts, final = [], None

        def collect(c):
            nonlocal final
            for ch in self._chunks(stream, first):
                parts.append(ch.text)
                final = ch
                if not ch.is_final and gone():
                    raise HTTPError(499, "the client closed the connection", code="client_gone",
                                    outcome="disconnected")
        try:
            self.call(collect, prompt_param)
        finally:
            stream.close()
        if final.finish_reason not in ("stop", "length"):
            raise HTTPError(503, f"the server ended the request early (finish_reason {final.finish_reason!r})",
                            code="cancelled", outcome="cancelled")
        return "".join(parts), final

    def events(self, stream, first, piece, finish, usage_chunk, state, prompt_param, opening=()):
        """SSE events of a started stream: the opening objects, a piece per chunk with text or
        logprobs (piece(chunk) -> obj or None), the finish objects of every choice (finish(final)),
        usage, [DONE]."""
        try:
            for o in opening:
                yield _sse(o)
            for ch in self._chunks(stream, first):
                if ch.text or ch.logprobs:
                    o = piece(ch)
                    if o is not None:
                        yield _sse(o)
                if ch.is_final:
                    if ch.finish_reason not in ("stop", "length"):
                        raise ColibriError(f"the server ended the request early (finish_reason "
                                           f"{ch.finish_reason!r})", code="cancelled")
                    for o in finish(ch):
                        yield _sse(o)
                    if usage_chunk is not None:
                        yield _sse(usage_chunk(self.usage(ch)))
            state["outcome"] = "ok"
            yield _DONE
        except ColibriError as e:
            err = http_error_for(e, prompt_param)
            state["outcome"] = err.outcome
            yield _sse(err.body())
            yield _DONE
        except GeneratorExit:
            raise
        except HTTPError as e:                  # the client hung up before the first byte: nobody to tell
            state["outcome"] = e.outcome
        except Exception:
            log.exception("stream failed")
            state["outcome"] = "internal"
            yield _sse(HTTPError(500, "internal error in the HTTP gateway (see its log)", code="internal").body())
            yield _DONE
        finally:
            stream.close()

    def streaming(self, gen_factory, stream) -> _Resp:
        state: dict = {}
        body = _StreamBody(gen_factory(state), state, stream.close, lambda outcome: None)
        return _Resp(200, body, content_type="text/event-stream; charset=utf-8")

    # -- endpoints

    def _model_obj(self, info, name=None):
        return {"id": name or info.name, "object": "model", "created": info.created, "owned_by": "colibri",
                "root": info.path, "parent": None, "max_model_len": info.context}     # vLLM's name for the context

    def models(self, environ) -> _Resp:
        info = self.model_info()
        return _json({"object": "list", "data": [self._model_obj(info, n) for n in self.model_names or [info.name]]})

    def model(self, environ, name) -> _Resp:
        info = self.model_info()
        if name != info.name and name not in self.model_names:
            raise HTTPError(404, f"the model {name[:100]!r} does not exist: this server serves {info.name!r}",
                            param="model", code="model_not_found", outcome="not_found")
        return _json(self._model_obj(info, name))

    def tokenize(self, environ) -> _Resp:
        """A prompt's tokens as /v1/completions reads it (its special-token text parsed), or the
        tokens of messages as /v1/chat/completions renders them (their content stays text)."""
        body = self.read_json(environ)
        _check_known(body, {"prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"})
        f = _Fields(body)
        prompt = body.get("prompt")
        if body.get("messages") is not None:
            if prompt is not None:
                raise _bad("give either 'prompt' or 'messages', not both", "messages")
            segments, add = self._chat_segments(body, f)
            if body.get("add_special_tokens") is not None:
                add = f.bool("add_special_tokens", add)
            ids = self.call(lambda c: c.tokenize(segments, add_special_tokens=add), "messages")
            return _json({"tokens": ids, "count": len(ids)})
        if prompt is None:
            raise _bad("'prompt' (or 'messages') is required", "prompt", "missing_required_parameter")
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string", "prompt", "invalid_type")
        f.neutral("add_generation_prompt", [], "add_generation_prompt applies to messages")
        add = f.bool("add_special_tokens", True)
        if body.get("model") is not None:
            self.check_model(f)
        ids = self.call(lambda c: c.tokenize([(prompt, True)], add_special_tokens=add), "prompt")
        return _json({"tokens": ids, "count": len(ids)})

    def _chat_segments(self, body, f) -> tuple:
        """messages (with the chat endpoint's checks) -> (segments, add_special_tokens), as chat renders them."""
        from .structured import messages_for_template
        messages = _chat_messages(body)
        info = self.check_model(f)
        return render_chat_segments(info, messages_for_template(messages, "tool_calls" in (info.chat_template or "")),
                                    f.bool("add_generation_prompt", True))

    def apply_template(self, environ) -> _Resp:
        """messages -> the chat template's text, as /v1/chat/completions renders it."""
        body = self.read_json(environ)
        _check_known(body, {"messages", "add_generation_prompt", "model"})
        f = _Fields(body)
        segments, _ = self._chat_segments(body, f)
        return _json({"prompt": "".join(t for t, _ in segments)})

    def detokenize(self, environ) -> _Resp:
        body = self.read_json(environ)
        _check_known(body, {"tokens", "model"})
        f = _Fields(body)
        toks = body.get("tokens")
        if toks is None:
            raise _bad("'tokens' is required", "tokens", "missing_required_parameter")
        if not isinstance(toks, list) or not all(_is_int(t) and t >= 0 for t in toks):
            raise _bad("'tokens' must be a list of token ids (integers >= 0)", "tokens", "invalid_type")
        if body.get("model") is not None:
            self.check_model(f)
        text = self.call(lambda c: c.detokenize(toks), "tokens")
        return _json({"prompt": text})

    def health(self, environ) -> _Resp:
        if self.routers is not None:
            from .routers import health
            return health(self)
        try:
            with self.probe_client() as c:
                h = c.health()
        except ColibriTimeout:
            return _Resp(503, _json_bytes({"status": "unreachable", "error": f"the colibri server at "
                         f"{self.connect} did not answer within {self.health_timeout:g} s"}), outcome="unavailable")
        except ColibriError as e:
            return _Resp(503, _json_bytes({"status": "error", "error": str(e)}), outcome="unavailable")
        except Exception as e:
            log.warning("health check failed: %r", e)
            return _Resp(503, _json_bytes({"status": "error", "error": type(e).__name__}), outcome="unavailable")
        self.saw_generation(h.get("generation"))
        out = {k: h.get(k) for k in ("status", "workers_ready", "generation", "queue", "reason") if k in h}
        ok = h.get("status") == "ok"
        retry = [("Retry-After", STARTING_RETRY_AFTER)] if h.get("status") == "starting" else []
        return _Resp(200 if ok else 503, _json_bytes(out), retry, outcome="ok" if ok else "unavailable")

    def metrics_endpoint(self, environ) -> _Resp:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return _Resp(200, generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)


def _read_body(stream, n: int) -> bytes:
    """Up to n bytes of a request body; its framing's faults (a chunk size that is not hex, a
    body cut short) are the client's: 400 naming them, not a 500 with a traceback."""
    try:
        return stream.read(n)
    except Exception as e:
        if not type(e).__module__.startswith("gunicorn.http") and not isinstance(e, OSError):
            raise
        raise _bad(f"the request body is malformed or cut short ({type(e).__name__}: {str(e)[:100]})",
                   None, "invalid_body") from None


def _hangup_probe(environ, every: float = 0.2):
    """A cheap `gone()` for the connection of a WSGI request (gunicorn puts its socket in the
    environ): True once the peer has closed it (a zero-byte peek), checked at most every
    `every` seconds.  Pipelined bytes of a next request do not count as a hang-up."""
    import socket as _socket
    sock = (environ or {}).get("gunicorn.socket")
    if sock is None:
        return lambda: False
    state = {"next": 0.0, "gone": False}

    def gone():
        now = time.monotonic()
        if state["gone"] or now < state["next"]:
            return state["gone"]
        state["next"] = now + every
        try:
            state["gone"] = sock.recv(1, _socket.MSG_PEEK | _socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            state["gone"] = True        # reset, or the socket was closed
        return state["gone"]
    return gone


def create_app(connect: str, api_key: Optional[str] = None, model_name: Optional[str] = None,
               timeout: float = DEFAULT_TIMEOUT, **options) -> Gateway:
    """The WSGI callable.  options: max_body, default_max_tokens, metrics_auth, curve,
    health_timeout, pages (see Gateway)."""
    return Gateway(connect, api_key, model_name, timeout, **options)


# ---------------------------------------------------------------------------- serving


def app_from_env() -> Gateway:
    """App factory for `gunicorn 'colibri_server.http:app_from_env()'`: options from the
    COLIBRI_HTTP_* environment (CONNECT, API_KEY or API_KEY_FILE, MODEL_NAME, TIMEOUT, MAX_BODY,
    DEFAULT_MAX_TOKENS, METRICS_AUTH, CURVE_SERVERKEY)."""
    opts = options_from_env()
    return create_app(opts.pop("connect"), **opts)
