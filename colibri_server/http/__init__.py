"""The OpenAI-compatible HTTP gateway: a plain-WSGI app served by gunicorn that talks to a running
colibri server over ZeroMQ through `colibri_server.client`.

  app       Gateway (routing, API key, completions/chat/models/tokenize/health/metrics), create_app, app_from_env
  openai    the OpenAI request fields, their validation, error mapping and answer shapes
  template  the model's info and chat template (read from the server's stats / the model file)
  metrics   the Prometheus registry and the server collector
  config    the COLIBRI_HTTP_* environment          serve   gunicorn in-process, `colibri http`
  routers   several routers (--connect A --connect B): /health and /metrics per router
  headfirst HeadFirstWorker: gthread that reads request heads (and small bodies) before taking a thread
  pages     the chat page (/), the status page (/status) and /status.json; their files are in static/

It never runs a model: every token comes from the server (the model file is only read for its
chat template and name, when the gateway runs beside the server).
Users load `colibri_server.http:app_from_env()` (gunicorn) or run `colibri http` /
`python -m colibri_server.http`.
"""
from .app import (  # noqa: F401
    CHATML,
    DEFAULT_BIND,
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_TIMEOUT,
    MAX_BODY,
    STATS_TIMEOUT,
    Gateway,
    app_from_env,
    create_app,
)
from .config import DEFAULT_CONNECT, ENV, ENV_VARS, options_from_env  # noqa: F401
from .headfirst import HEADER_TIMEOUT, WORKER_CLASS  # noqa: F401
from .openai import HTTPError  # noqa: F401
from .serve import add_http_arguments, cmd_http, main, serve  # noqa: F401
from .template import ModelInfo, fetch_template, model_info_from_stats, render_chat, render_chat_segments  # noqa: F401


def __getattr__(name):
    # gunicorn imports worker_class = "colibri_server.http.HeadFirstWorker"; built on first use
    # so that importing the gateway does not import gunicorn's worker machinery
    if name == "HeadFirstWorker":
        from . import headfirst
        cls = globals()["HeadFirstWorker"] = headfirst.HeadFirstWorker
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
