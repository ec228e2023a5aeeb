"""Server settings: one declared schema, four sources.

Every setting is declared once, in `SCHEMA` (like gunicorn's config.py): its name, type,
default, range, one doc line and when a change takes effect. The command-line flag
(`--kebab-name`), the environment variable (`COLIBRI_UPPER_NAME`), the argparse
arguments, the example file `configs/colibri.toml` (`example_toml()`) and
`colibri config --print` (`describe()`) are all derived from it.

Sources, later wins::

    defaults < TOML file < COLIBRI_* environment < command line

`load_settings()` returns an immutable `Settings` (attribute access, `.source(name)` is
'default', 'file:PATH', 'env:COLIBRI_X' or 'cli'). Automatic values (workers and
threads_per_worker 0) are resolved for this machine; `.configured(name)` is what the
sources said. Every problem found (unknown key or
variable, with a "did you mean"; invalid value, naming the setting, the source, the value
and what is allowed) is collected and raised together as one `SettingsError`.

Value syntax (environment and command-line strings; TOML uses its native types):
  int       decimal, `1_000` allowed
  float     decimal or exponent; never nan/inf
  bool      true/false, 1/0, yes/no, on/off (any case); flags are --x / --no-x
  duration  seconds: 30, 2.5, or with a unit 500ms, 30s, 2m, 1h
  size      bytes: 4096, or with a unit: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024,
            kB/MB/GB/TB powers of 1000 (any case); a TOML integer is bytes
  path      `~` expanded; relative paths in the TOML file are relative to the file's folder
  enum      one of the listed words (any case)

Reload kinds (`Setting.reload`): HUP (re-read on SIGHUP; workers are replaced gracefully),
USR1 (takes effect when the model is re-mapped on SIGUSR1, which also re-reads settings),
RESTART (the master holds it: only a restart changes it).
"""
from __future__ import annotations

import argparse
import difflib
import os
from types import MappingProxyType
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "SettingsError", "Setting", "SCHEMA", "SETTINGS", "Settings", "HUP", "USR1", "RESTART",
    "ENV_PREFIX", "load_settings", "defaults", "add_arguments", "describe", "example_toml",
    "parse_size", "format_size", "parse_duration", "parse_bool", "resolve_runtime_dir",
]

from .schema import (
    _RELOAD_TEXT,
    ENV_NOT_SETTINGS,
    ENV_NOT_SETTINGS_PREFIXES,
    ENV_PREFIX,
    HUP,
    RESTART,
    SCHEMA,
    SETTINGS,
    USR1,
    Setting,
    SettingsError,
    _Bool,
    _Invalid,
    _show,
    format_size,
    parse_bool,
    parse_duration,
    parse_size,
)

_NOT_IN_FILE = ("config",)


def _suggest(word: str, names, fmt=lambda n: n) -> str:
    w = word.strip().lower().replace("-", "_")
    if w in names and w != word:
        return f"; did you mean {fmt(w)}?"
    m = difflib.get_close_matches(w, list(names), n=1, cutoff=0.6)
    if not m and len(w) >= 3:  # a prefix: 'threads' -> threads_per_worker
        m = [n for n in names if n.startswith(w)][:1]
    if m:
        return f"; did you mean {fmt(m[0])}?"
    return "; `colibri config --print` lists the settings"


# ------------------------------------------------------------------ the settings object

class Settings:
    """Immutable effective settings: `s.workers`, `s.source('workers')`, `s.as_dict()`;
    `s.configured('workers')` is the value before automatic ones were resolved (0 for auto)."""
    __slots__ = ("_values", "_sources", "_configured")

    def __init__(self, values: Mapping[str, Any], sources: Mapping[str, str] | None = None,
                 configured: Mapping[str, Any] | None = None):
        missing = set(SETTINGS) - set(values)
        extra = set(values) - set(SETTINGS)
        if missing or extra:
            raise TypeError(f"Settings: missing {sorted(missing)}, unknown {sorted(extra)}")
        sources = dict(sources or {})
        object.__setattr__(self, "_values", MappingProxyType({n: values[n] for n in SETTINGS}))
        object.__setattr__(self, "_sources", MappingProxyType(
            {n: sources.get(n, "default") for n in SETTINGS}))
        object.__setattr__(self, "_configured", MappingProxyType(
            {n: v for n, v in (configured or {}).items() if n in SETTINGS and v != values[n]}))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}{_suggest(name, SETTINGS)}") from None

    def __setattr__(self, name, value):
        raise AttributeError("Settings are immutable")

    __delattr__ = __setattr__

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __eq__(self, other):
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self):
        return hash(tuple(self._values.items()))

    def __reduce__(self):
        return (Settings, (dict(self._values), dict(self._sources), dict(self._configured)))

    def __repr__(self):
        changed = ", ".join(f"{n}={v!r}" for n, v in self._values.items() if v != SETTINGS[n].value)
        return f"Settings({changed})"

    def source(self, name: str) -> str:
        """'default', 'file:PATH', 'env:COLIBRI_X' or 'cli'."""
        if name not in self._sources:
            raise KeyError(f"no setting {name!r}{_suggest(name, SETTINGS)}")
        return self._sources[name]

    def configured(self, name: str):
        """What the sources set (auto stays 0), where the attribute is the value resolved for this machine."""
        return self._configured.get(name, self[name])

    def as_dict(self) -> dict:
        return dict(self._values)

    to_dict = as_dict

    def diff(self, other: "Settings") -> dict[str, tuple[Any, Any]]:
        """{name: (self's value, other's value)} for every setting that differs."""
        return {n: (v, other._values[n]) for n, v in self._values.items() if other._values[n] != v}

    def changes_needing(self, other: "Settings", kind: str) -> list[str]:
        """Names that differ between self and other and take effect only on `kind`
        (HUP, USR1 or RESTART): e.g. warn 'bind changed; needs a restart' on SIGHUP."""
        return [n for n in self.diff(other) if SETTINGS[n].reload == kind]


def defaults() -> Settings:
    values = {s.name: s.value for s in SCHEMA}
    return Settings(_layout(dict(values)), configured=values)


def _layout(values: dict, topology=None) -> dict:
    """The automatic worker layout made concrete: threads_per_worker 0 shares the allowed physical
    cores among the workers (workers 0 with it: one worker per NUMA node). A worker steps all its
    sequences together (continuous batching), so one worker with every core of a node reads each
    weight once per step for all of them, and one request alone still decodes on every core.
    workers 0 with threads_per_worker set stays 0: one worker per that many cores (pinning)."""
    if values.get("threads_per_worker") == 0:
        from ..host.pinning import detect
        topology = topology or detect()
        if not values.get("workers"):
            values["workers"] = max(1, len(topology.nodes))
        values["threads_per_worker"] = max(1, topology.physical_cores // values["workers"])
    return values


# ------------------------------------------------------------------ loading

def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"cannot parse settings file {path}: {e}") from None
    except OSError as e:
        raise SettingsError(f"cannot read settings file {path}: {e.strerror or e}") from None


def _cli_items(argv) -> tuple[dict, list]:
    """Non-None schema values of an argparse Namespace (other attributes are ignored) or a
    dict (every key must be a setting)."""
    if argv is None:
        return {}, []
    problems = []
    if isinstance(argv, argparse.Namespace):
        items = {k: v for k, v in vars(argv).items() if k in SETTINGS}
    else:
        items = dict(argv)
        for k in list(items):
            if k not in SETTINGS:
                problems.append(f"unknown setting {k!r} (command line){_suggest(k, SETTINGS)}")
                del items[k]
    return {k: v for k, v in items.items() if v is not None}, problems


def load_settings(argv_namespace_or_dict=None, config_path=None, env=None) -> Settings:
    """Effective settings: defaults < TOML file < COLIBRI_* env < command line.

    argv_namespace_or_dict: an argparse Namespace from a parser given `add_arguments()`
        (attributes that are not settings, and None values, are ignored), or a dict
        {name: value}; string values are parsed like environment values.
    config_path: the file to read when neither --config nor COLIBRI_CONFIG names one; it
        is skipped if missing, while a missing --config/COLIBRI_CONFIG file is an error.
    env: the environment (default os.environ).
    """
    env = os.environ if env is None else env
    values = {s.name: s.value for s in SCHEMA}
    sources = {s.name: "default" for s in SCHEMA}
    cli, problems = _cli_items(argv_namespace_or_dict)

    def put(name, raw, source, where, base_dir=None, typed=False):
        try:
            values[name] = SETTINGS[name].parse(raw, where, base_dir, typed)
            sources[name] = source
        except _Invalid as e:
            problems.append(str(e))

    env_items = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in ENV_NOT_SETTINGS or var.startswith(ENV_NOT_SETTINGS_PREFIXES):
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in SETTINGS or var != SETTINGS[name].env:
            problems.append(f"unknown environment variable {var} (no setting {name!r})"
                            f"{_suggest(name, SETTINGS, lambda n: SETTINGS[n].env)}")
            continue
        env_items[name] = (var, env[var])

    # which file: --config, else COLIBRI_CONFIG, else the caller's default (optional)
    explicit = True
    if "config" in cli:
        put("config", cli["config"], "cli", f"command line {SETTINGS['config'].flag}")
    elif "config" in env_items:
        var, raw = env_items["config"]
        put("config", raw, f"env:{var}", f"environment {var}")
    elif config_path:
        explicit = False
        values["config"] = os.path.expanduser(os.fspath(config_path))
    path = values["config"]

    if path and not explicit and not os.path.exists(path):
        values["config"] = path = ""
    if path:
        if not os.path.exists(path):
            where = "--config" if sources["config"] == "cli" else SETTINGS["config"].env
            problems.append(f"settings file not found: {path} (named by {where})")
        else:
            try:
                data = _read_toml(path)
            except SettingsError as e:
                problems.extend(e.problems)
                data = {}
            base = os.path.dirname(os.path.abspath(path))
            for key, raw in data.items():
                if isinstance(raw, dict):
                    problems.append(f"table [{key}] in {path}: settings files are flat "
                                    f"(write `name = value` at the top level)")
                elif key in _NOT_IN_FILE:
                    problems.append(f"{key!r} in {path}: the settings file is named only by "
                                    f"--config or {SETTINGS[key].env}, not inside a file")
                elif key not in SETTINGS:
                    problems.append(f"unknown setting {key!r} in {path}{_suggest(key, SETTINGS)}")
                else:
                    put(key, raw, f"file:{path}", f"file {path}", base, typed=True)

    for name, (var, raw) in env_items.items():
        if name != "config":
            put(name, raw, f"env:{var}", f"environment {var}")
    for name, raw in cli.items():
        if name != "config":
            put(name, raw, "cli", f"command line {SETTINGS[name].flag}")

    if not problems:
        problems.extend(_cross_check(values, sources))
    if problems:
        raise SettingsError(problems)
    return Settings(_layout(dict(values)), sources, configured=values)


def _cross_check(v, src) -> list[str]:
    """Constraints between settings (only checked once each value is valid on its own)."""
    out = []

    def at(n):
        return f"{n} = {_show(v[n])} ({src[n]})"
    if v["heartbeat_interval"] >= v["timeout"]:
        out.append(f"{at('heartbeat_interval')} must be less than {at('timeout')}, "
                   "or live workers would be killed as silent")
    if v["curve_allowed_keys"] and not v["curve_secret_key"]:
        out.append(f"{at('curve_allowed_keys')} needs curve_secret_key (the server's key)")
    if v["curve_secret_key"] and not v["bind"].startswith("tcp://") and not v["backend_bind"]:
        out.append(f"{at('curve_secret_key')} applies to tcp:// binds only, but {at('bind')}")
    if v["join"] and v["backend_bind"]:
        out.append(f"{at('join')} makes this a worker host, which runs no router: {at('backend_bind')} "
                   "belongs on the head")
    if v["join"] and v["http"]:
        out.append(f"{at('join')} makes this a worker host, which has no router for a gateway: {at('http')} "
                   "belongs on the head")
    if bool(v["join_server_key"]) != bool(v["join_secret_key"]):
        out.append(f"{at('join_server_key')} and {at('join_secret_key')} go together (the head's public key "
                   "and this host's secret key)")
    if v["join_server_key"] and not v["join"]:
        out.append(f"{at('join_server_key')} applies to a worker host only, but join is not set")
    if v["join"] and not v["join_server_key"] and not _loopback_address(v["join"]):
        out.append(f"{at('join')} leaves this machine: set join_server_key and join_secret_key (CURVE: the head "
                   "admits worker hosts by key)")
    if v["backend_bind"] and not _loopback_address(v["backend_bind"]) and not (
            v["curve_secret_key"] and v["worker_allowed_keys"]):
        out.append(f"{at('backend_bind')} is reachable from other machines: set curve_secret_key and "
                   "worker_allowed_keys (CURVE: worker hosts are admitted by key)")
    if v["worker_allowed_keys"] and not (v["backend_bind"] and v["curve_secret_key"]):
        out.append(f"{at('worker_allowed_keys')} needs backend_bind and curve_secret_key")
    return out


def _loopback_address(addr: str) -> bool:
    """ipc://, or tcp:// on a loopback host."""
    if addr.startswith("ipc://"):
        return True
    from ..wire.security import is_loopback
    host = addr[len("tcp://"):].rpartition(":")[0].strip("[]")
    return is_loopback(host)


def resolve_runtime_dir(settings: Settings, env=None, uid: int | None = None) -> str:
    """runtime_dir, else $RUNTIME_DIRECTORY (systemd; the first of a ':' list), else
    $XDG_RUNTIME_DIR/colibri, else /tmp/colibri-UID."""
    env = os.environ if env is None else env
    if settings.runtime_dir:
        return settings.runtime_dir
    if env.get("RUNTIME_DIRECTORY"):
        return env["RUNTIME_DIRECTORY"].split(":")[0]
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "colibri")
    return f"/tmp/colibri-{os.getuid() if uid is None else uid}"


# ------------------------------------------------------------------ argparse, printing, example

def add_arguments(parser, names=None, exclude=()) -> None:
    """Add every setting's flag (or those in `names`, minus `exclude`) to an argparse parser
    or argument group. default=None so an absent flag leaves the lower sources in force;
    values stay strings and are parsed (and errors reported) by load_settings."""
    for s in SCHEMA:
        if (names is not None and s.name not in names) or s.name in exclude:
            continue
        shown = "unset" if s.default in ("", None) else _toml_value(s.name, s.value).strip('"')
        doc = f"{s.doc} (default: {shown}; {ENV_PREFIX}{s.name.upper()})".replace("%", "%%")
        if isinstance(s.type, _Bool):
            parser.add_argument(s.flag, dest=s.name, default=None, help=doc,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, help=doc,
                                metavar=s.metavar or s.type.metavar)


def _toml_value(name, v) -> str:
    return SETTINGS[name].type.toml(v)


def describe(settings: Settings) -> str:
    """Every setting as configured (an automatic value stays automatic), where it came from,
    when a change applies and, for an automatic value, what it resolves to on this machine,
    aligned; the `name = value` part is valid TOML and the rest a comment, so pasted into a
    file the lines set what was configured, never this machine's resolution of it."""
    rows = []
    for n in SETTINGS:
        conf, now = settings.configured(n), settings[n]
        rows.append((f"{n} = {_toml_value(n, conf)}", settings.source(n), _RELOAD_TEXT[SETTINGS[n].reload],
                     f"resolves to {_toml_value(n, now)} here" if now != conf else ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    head = f"{'# setting = value':<{w0}}  # {'source':<{w1}}  applies on"
    return "\n".join([head] + [f"{a:<{w0}}  # {b:<{w1}}  {c:<{w2}}  {d}".rstrip() for a, b, c, d in rows]) + "\n"


_EXAMPLE_HEAD = """\
# colibri-server settings: every setting, set to its default.
#
# Generated from the schema by colibri_server.settings.example_toml()
# (python -m colibri_server.settings > configs/colibri.toml); a test keeps them equal.
#
# Sources, later wins: defaults < this file < COLIBRI_* environment < command line.
# The file is flat (no [tables]); each setting's variable and flag are named below.
# `colibri config --print` shows the effective values and where each came from.
# Applies on: SIGHUP (settings re-read, workers replaced gracefully), SIGUSR1 (model
# reload), or restart.
# Sizes: 4096, 512MiB, 2G (K/M/G/T = 1024^n; kB/MB/GB = 1000^n). Durations: seconds,
# or 500ms, 2m, 1h.
"""


def example_toml() -> str:
    parts = [_EXAMPLE_HEAD]
    for s in SCHEMA:
        line = f"{s.name} = {s.type.toml(s.value)}"
        parts.append(
            f"\n# {s.doc[0].upper()}{s.doc[1:]}.\n"
            f"# Allowed: {s.allowed}. Applies on: {_RELOAD_TEXT[s.reload]}.\n"
            f"# Env: {s.env}  Flag: {s.flag}\n"
            + (f"# {line}    (not valid in this file)\n" if s.name in _NOT_IN_FILE else line + "\n"))
    return "".join(parts)
