"""The HTTP gateway's COLIBRI_HTTP_* environment (see `colibri_server.http`): the options
of `app_from_env()` (gunicorn) and the variables `colibri serve` must leave alone."""
from __future__ import annotations

import os

DEFAULT_CONNECT = "tcp://127.0.0.1:5555"

ENV = {  # env variable -> (create_app option, parser)
    "COLIBRI_HTTP_CONNECT": ("connect", str),       # "A,B": several routers (http/routers.py)
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
ENV_VARS = frozenset(ENV) | {"COLIBRI_HTTP_API_KEY_FILE", "COLIBRI_HTTP_CURVE_SERVER_KEY_FILE",
                             "COLIBRI_HTTP_CURVE_SECRET_KEY_FILE", "COLIBRI_HTTP_BIND", "COLIBRI_HTTP_WORKERS",
                             "COLIBRI_HTTP_THREADS", "COLIBRI_HTTP_LOG_LEVEL", "COLIBRI_HTTP_ACCESS_LOG",
                             "COLIBRI_HTTP_HEADER_TIMEOUT"}


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
    curve = curve_from_files(environ.get("COLIBRI_HTTP_CURVE_SERVER_KEY_FILE"),
                             environ.get("COLIBRI_HTTP_CURVE_SECRET_KEY_FILE"))
    if curve is not None:
        opts["curve"] = curve
    return opts


def curve_from_files(server_key_file, secret_key_file):
    """The gateway's CURVE as a client with a key of its own (a router with curve_allowed_keys admits
    it by that key): (server public, own public, own secret) from the two certificate files; None
    when neither is given; ValueError naming what is wrong."""
    if not server_key_file and not secret_key_file:
        return None
    if not (server_key_file and secret_key_file):
        raise ValueError("the gateway's CURVE key files go together: the router's public key "
                         "(--curve-server-key) and the gateway's own secret key (--curve-secret-key)")
    from ..wire.security import SecurityError, client_curve
    try:
        return client_curve(server_key_file, secret_key_file)
    except SecurityError as e:
        raise ValueError(str(e)) from None

