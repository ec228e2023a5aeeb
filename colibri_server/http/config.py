"""The HTTP gateway's COLIBRI_HTTP_* environment (see `colibri_server.http`): the options of
`app_from_env()` (gunicorn). Every variable is a gateway setting of the one schema
(settings/schema.py: GATEWAY), which gives its type, bound and default."""
from __future__ import annotations

import os

from ..settings.schema import GATEWAY, GATEWAY_SETTINGS, SettingsError, gateway_value

DEFAULT_CONNECT = GATEWAY_SETTINGS["connect"].value

# create_app option -> the gateway setting it comes from
APP_OPTIONS = {"connect": "connect", "api_key": "api_key", "model_name": "model_name", "timeout": "timeout",
               "max_body": "max_body", "default_max_tokens": "default_max_tokens", "metrics_auth": "metrics_auth",
               "curve": "curve_serverkey", "pages": "pages"}
ENV = {GATEWAY_SETTINGS[name].env: opt for opt, name in APP_OPTIONS.items()}   # variable -> create_app option

# every COLIBRI_HTTP_* variable (`colibri serve` does not take them for unknown settings)
ENV_VARS = frozenset(s.env for s in GATEWAY)


def read_key_file(path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"API key file {path}: {e.strerror or e}") from None
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def options_from_env(environ=None) -> dict:
    """create_app keyword arguments from COLIBRI_HTTP_* variables (ValueError naming a bad one); an
    option whose variable is unset is left to create_app's default."""
    environ = os.environ if environ is None else environ
    opts = {"connect": DEFAULT_CONNECT}
    try:
        for opt, name in APP_OPTIONS.items():
            if environ.get(GATEWAY_SETTINGS[name].env):
                opts[opt] = gateway_value(name, environ)
        kf = gateway_value("api_key_file", environ)
        if kf and "api_key" not in opts:
            opts["api_key"] = read_key_file(kf)
        curve = curve_from_files(gateway_value("curve_server_key", environ),
                                 gateway_value("curve_secret_key", environ))
    except SettingsError as e:
        raise ValueError(str(e)) from None
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
