"""Running the gateway: `colibri http` (its arguments, COLIBRI_HTTP_* defaults) and `serve`, which
runs gunicorn (HeadFirstWorker, a gthread) programmatically in this process; `python -m colibri_server.http`."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Optional

from .app import DEFAULT_BIND, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_TIMEOUT, MAX_BODY, create_app, log
from .config import DEFAULT_CONNECT, _env_bool, _read_key_file, curve_from_files
from .headfirst import WORKER_CLASS

__all__ = ["serve", "add_http_arguments", "cmd_http", "main"]


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


def serve(connect, bind: str = DEFAULT_BIND, workers: int = 1, threads: int = 8,
          api_key: Optional[str] = None, *, model_name: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
          log_level: str = "info", gunicorn_options: Optional[dict] = None, **app_options):
    """Run the gateway under gunicorn (gthread workers) in this process; does not return. connect: an
    address, or several (a list, or "A,B"): see http/routers.py."""
    from gunicorn.app.base import BaseApplication
    if not api_key and not _is_loopback(bind):
        log.warning("the HTTP gateway listens on %s without an API key: anyone who can reach it can use the model",
                    bind)
    # build one app now so that bad options fail here, not in every worker
    create_app(connect, api_key, model_name, timeout, **app_options)
    options = {"bind": bind, "workers": workers, "threads": threads, "worker_class": WORKER_CLASS,
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
    p.add_argument("--connect", action="append", default=None, metavar="ADDRESS",
                   help="address of the colibri server (tcp://host:port or ipc:///path); repeat it (or give "
                        "A,B) for several routers: requests are spread over them and fail over when one is down "
                        f"(default {DEFAULT_CONNECT}) [COLIBRI_HTTP_CONNECT, comma-separated]")
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
                   help="model id to serve as; comma-separated aliases, the first named in answers (default: the model file's metadata name) [COLIBRI_HTTP_MODEL_NAME]")
    p.add_argument("--timeout", type=float, default=env("COLIBRI_HTTP_TIMEOUT", str(DEFAULT_TIMEOUT)),
                   help="seconds to wait for the next message of a request, queueing included")
    p.add_argument("--max-body", type=int, default=env("COLIBRI_HTTP_MAX_BODY", str(MAX_BODY)),
                   help="largest request body in bytes (413 beyond)")
    p.add_argument("--default-max-tokens", type=int,
                   default=env("COLIBRI_HTTP_DEFAULT_MAX_TOKENS", str(DEFAULT_CHAT_MAX_TOKENS)),
                   help="max_tokens of a chat completion that gives none")
    p.add_argument("--curve-server-key", default=env("COLIBRI_HTTP_CURVE_SERVER_KEY_FILE"), metavar="FILE",
                   help="the router's CURVE public key file (its curve_secret_key's .key), for a router that "
                        "admits clients by key [COLIBRI_HTTP_CURVE_SERVER_KEY_FILE]")
    p.add_argument("--curve-secret-key", default=env("COLIBRI_HTTP_CURVE_SECRET_KEY_FILE"), metavar="FILE",
                   help="the gateway's own CURVE secret key file (its .key goes into the router's "
                        "curve_allowed_keys) [COLIBRI_HTTP_CURVE_SECRET_KEY_FILE]")
    p.add_argument("--metrics-auth", action="store_true", default=None,
                   help="require the API key on /metrics too [COLIBRI_HTTP_METRICS_AUTH=1]")
    p.add_argument("--log-format", default=env("COLIBRI_HTTP_LOG_FORMAT", "text"), choices=("text", "json"),
                   help="log lines as text or one JSON object per line [COLIBRI_HTTP_LOG_FORMAT]")
    p.add_argument("--log-level", default=env("COLIBRI_HTTP_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="gunicorn and gateway log verbosity [COLIBRI_HTTP_LOG_LEVEL]")
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
        from ..host.logs import set_role, setup
        setup(a.log_level, a.log_format)
        set_role("http")                       # gunicorn titles its processes itself from here on
        gunicorn_options = {"logconfig_dict": _json_logconfig(a.log_level)} if a.log_format == "json" else None
        connect = a.connect or [os.environ.get("COLIBRI_HTTP_CONNECT") or DEFAULT_CONNECT]
        serve(connect if len(connect) > 1 else connect[0], bind=a.bind, workers=a.workers, threads=a.threads, api_key=key, model_name=a.model_name,
              timeout=a.timeout, log_level=a.log_level, max_body=a.max_body,
              default_max_tokens=a.default_max_tokens, metrics_auth=metrics_auth,
              curve=curve_from_files(a.curve_server_key, a.curve_secret_key)
              or os.environ.get("COLIBRI_HTTP_CURVE_SERVERKEY") or None, gunicorn_options=gunicorn_options)
    except ValueError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        sys.exit(2)


def _json_logconfig(level: str) -> dict:
    """gunicorn's own lines (its arbiter, worker boots) as JSON too."""
    h = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": "colibri_server.host.logs.JsonFormatter"}}, "handlers": {"json": h},
            "loggers": {"gunicorn.error": {"handlers": ["json"], "level": level.upper(), "propagate": False}},
            "root": {"handlers": ["json"], "level": level.upper()}}


def main(argv=None):
    from ..settings.parser import Parser
    p = Parser(prog="colibri-http", description="OpenAI-compatible HTTP gateway to a colibri server")
    add_http_arguments(p)
    cmd_http(p.parse_args(argv))

