"""Running the gateway: `colibri http` (its flags and COLIBRI_HTTP_* variables: the schema's GATEWAY settings) and `serve`, which
runs gunicorn (HeadFirstWorker, a gthread) programmatically in this process; `python -m colibri_server.http`."""
from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import Optional

from ..settings.schema import GATEWAY_SETTINGS, SettingsError, gateway_flag_value, gateway_value
from .app import DEFAULT_BIND, DEFAULT_TIMEOUT, create_app, log
from .config import curve_from_files, read_key_file
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


# the gateway settings `colibri http` takes as flags (settings/schema.py: GATEWAY); the others are
# variables only (COLIBRI_HTTP_CURVE_SERVERKEY, _HEADER_TIMEOUT, _ACCESS_LOG)
FLAGS = ("connect", "bind", "workers", "threads", "api_key", "api_key_file", "model_name", "timeout", "max_body",
         "default_max_tokens", "curve_server_key", "curve_secret_key", "metrics_auth", "pages", "log_format",
         "log_level")


def _flag_type(name):
    def parse(text):
        try:
            return gateway_flag_value(name, text)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = name
    return parse


def add_http_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `colibri http` options, one per gateway setting of the schema; a flag not given takes its
    COLIBRI_HTTP_* variable, else the default (read by cmd_http, so that a malformed variable is
    reported only by `colibri http`)."""
    for name in FLAGS:
        st = GATEWAY_SETTINGS[name]
        shown = st.default if st.default not in ("", None) else "none"
        text = f"{st.doc} (default {shown}) [{st.env}]"
        if name == "connect":
            p.add_argument(st.flag, action="append", default=None, metavar=st.metavar, help=text)
        elif name == "metrics_auth":
            p.add_argument(st.flag, action="store_true", default=None, help=text)
        else:
            p.add_argument(st.flag, default=None, type=_flag_type(name), metavar=st.metavar or st.type.metavar,
                           help=text)
    return p


def _setting(a, name):
    """A flag's value when given, else its variable's, else the schema's default."""
    v = getattr(a, name)
    return gateway_value(name) if v is None else v


def cmd_http(a):
    """`colibri http`: run the gateway (gunicorn, gthread) until stopped."""
    try:
        key = _setting(a, "api_key") or None
        if not key and _setting(a, "api_key_file"):
            key = read_key_file(_setting(a, "api_key_file"))
        metrics_auth = _setting(a, "metrics_auth")
        log_level, log_format = _setting(a, "log_level"), _setting(a, "log_format")
        from ..host.logs import set_role, setup
        setup(log_level, log_format)
        set_role("http")                       # gunicorn titles its processes itself from here on
        gunicorn_options = {"logconfig_dict": _json_logconfig(log_level)} if log_format == "json" else None
        connect = a.connect or [gateway_value("connect")]
        serve(connect if len(connect) > 1 else connect[0], bind=_setting(a, "bind"), workers=_setting(a, "workers"),
              threads=_setting(a, "threads"), api_key=key, model_name=_setting(a, "model_name") or None,
              timeout=_setting(a, "timeout"), log_level=log_level, max_body=_setting(a, "max_body"),
              default_max_tokens=_setting(a, "default_max_tokens"), metrics_auth=metrics_auth,
              pages=_setting(a, "pages"),
              curve=curve_from_files(_setting(a, "curve_server_key"), _setting(a, "curve_secret_key"))
              or gateway_value("curve_serverkey") or None, gunicorn_options=gunicorn_options)
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

