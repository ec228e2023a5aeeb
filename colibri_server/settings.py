"""Server settings: one declared schema, four sources.

Every setting is declared once, in `SCHEMA` (like gunicorn's config.py): its name, type,
default, range, one doc line and when a change takes effect. The command-line flag
(`--kebab-name`), the environment variable (`COLIBRI_UPPER_NAME`), the argparse
arguments, the example file `configs/colibri.toml` (`example_toml()`) and
`colibri config --print` (`describe()`) are all derived from it.

Sources, later wins::

    defaults < TOML file < COLIBRI_* environment < command line

`load_settings()` returns an immutable `Settings` (attribute access, `.source(name)` is
'default', 'file:PATH', 'env:COLIBRI_X' or 'cli'). Every problem found (unknown key or
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
import json
import math
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "SettingsError", "Setting", "SCHEMA", "SETTINGS", "Settings", "HUP", "USR1", "RESTART",
    "ENV_PREFIX", "load_settings", "defaults", "add_arguments", "describe", "example_toml",
    "parse_size", "format_size", "parse_duration", "parse_bool", "resolve_runtime_dir",
]

ENV_PREFIX = "COLIBRI_"
# COLIBRI_* variables that are not settings (used by other parts of the program) and so are
# not reported as unknown. Add a name here when one is introduced.
ENV_NOT_SETTINGS: frozenset[str] = frozenset()
# other tools' namespaces: the HTTP gateway (http.py) and the soak tests read these themselves
ENV_NOT_SETTINGS_PREFIXES = ("COLIBRI_HTTP_", "COLIBRI_SOAK_")

HUP, USR1, RESTART = "hup", "usr1", "restart"
_RELOAD_TEXT = {HUP: "SIGHUP", USR1: "SIGUSR1 (model reload)", RESTART: "restart"}


class SettingsError(ValueError):
    """One or more invalid settings. `.problems` lists them; str() is all of them."""

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} problems with the settings:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(msg)


class _Invalid(Exception):
    """Internal: a value failed to parse or validate; the message says what is allowed."""


# ------------------------------------------------------------------ value syntax

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


_SIZE_UNITS = {"": 1, "b": 1,
               "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
               "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
               "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
               "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912, '2G' -> 2147483648, '1.5k' -> 1536, '4096' -> 4096."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(round(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]))


def format_size(n: int) -> str:
    """Bytes -> the largest exact binary unit: 1048576 -> '1MiB', 1000 -> '1000'."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds as a float: '30' -> 30.0, '2.5' -> 2.5, '500ms' -> 0.5, '2m' -> 120.0."""
    try:
        v = float(text)
    except ValueError:
        m = _DURATION_RE.match(text)
        if not m:
            raise ValueError(f"not a duration: {text!r}") from None
        v = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if not math.isfinite(v):
        raise ValueError(f"not a finite duration: {text!r}")
    return v


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def _show(raw) -> str:
    """A raw value as the user wrote it, for error messages."""
    if isinstance(raw, bool):
        return "true" if raw else "false"
    if isinstance(raw, str):
        return _toml_str(raw)
    return repr(raw)


def _kind(raw) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(raw), f"a {type(raw).__name__}")


# ------------------------------------------------------------------ types

class _Type:
    """How one kind of value is read from strings and TOML, and written back."""
    name = "value"
    metavar = "VALUE"
    allowed = "a value"
    native: tuple = ()

    def from_string(self, s: str):
        raise NotImplementedError

    def from_native(self, v):
        if isinstance(v, str):
            return self.from_string(v)
        if isinstance(v, self.native):
            return v
        raise ValueError(f"{_kind(v)}")

    def toml(self, v) -> str:
        return _toml_str(v)

    def bound(self, v) -> str:
        return str(v)


class _Int(_Type):
    name, metavar, allowed, native = "int", "N", "an integer", (int,)

    def from_string(self, s):
        return int(s.strip(), 10)

    def from_native(self, v):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise ValueError(_kind(v))

    def toml(self, v):
        return str(v)


class _Float(_Type):
    name, metavar, allowed, native = "float", "X", "a number", (int, float)

    def from_string(self, s):
        v = float(s)
        if not math.isfinite(v):
            raise ValueError("not finite")
        return v

    def from_native(self, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        raise ValueError(_kind(v))

    def toml(self, v):
        return repr(float(v))


class _Duration(_Float):
    name, metavar = "duration", "SECONDS"
    allowed = "a duration in seconds (30, 2.5, 500ms, 2m, 1h)"

    def from_string(self, s):
        return parse_duration(s)

    def from_native(self, v):
        if isinstance(v, str):
            return parse_duration(v)
        return super().from_native(v)


class _Bool(_Type):
    name, metavar, allowed = "bool", "BOOL", "a boolean (true/false, 1/0, yes/no)"

    def from_string(self, s):
        return parse_bool(s)

    def from_native(self, v):
        if isinstance(v, bool):
            return v
        raise ValueError(_kind(v))

    def toml(self, v):
        return "true" if v else "false"


class _Str(_Type):
    name, metavar, allowed, native = "str", "TEXT", "a string", (str,)

    def from_string(self, s):
        return s


class _Path(_Str):
    name, metavar, allowed = "path", "PATH", "a path"

    def from_string(self, s):
        return os.path.expanduser(s) if s else ""

    def from_native(self, v):
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
        return super().from_native(v)


class _Enum(_Str):
    name = "enum"

    def __init__(self, *choices):
        self.choices = choices
        self.metavar = "{" + ",".join(choices) + "}"
        self.allowed = "one of " + ", ".join(choices)

    def from_string(self, s):
        t = s.strip().lower()
        if t not in self.choices:
            raise ValueError(s)
        return t


class _Size(_Type):
    name, metavar = "size", "SIZE"
    allowed = "a size in bytes (4096, 512MiB, 2G)"

    def from_string(self, s):
        return parse_size(s)

    def from_native(self, v):
        if isinstance(v, str):
            return parse_size(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise ValueError(_kind(v))

    def toml(self, v):
        s = format_size(v)
        return _toml_str(s) if not s.isdigit() else s

    def bound(self, v):
        return format_size(v)


INT, FLOAT, DURATION, BOOL, STR, PATH, SIZE = _Int(), _Float(), _Duration(), _Bool(), _Str(), _Path(), _Size()
ENUM = _Enum


# ------------------------------------------------------------------ validators

@dataclass(frozen=True)
class Range:
    """lo <= v <= hi (either bound optional)."""
    lo: Any = None
    hi: Any = None

    def __call__(self, v) -> bool:
        return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)

    def text(self, typ: _Type) -> str:
        if self.lo is not None and self.hi is not None:
            return f"from {typ.bound(self.lo)} to {typ.bound(self.hi)}"
        if self.lo is not None:
            return f"at least {typ.bound(self.lo)}"
        return f"at most {typ.bound(self.hi)}"


_BIND_RE = re.compile(r"^(?P<scheme>[a-z0-9+]+)://(?P<rest>.*)$")
_IPC_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


@dataclass(frozen=True)
class _BindCheck:
    def __call__(self, v: str) -> bool:
        return self.problem(v) is None

    @staticmethod
    def problem(v: str):
        m = _BIND_RE.match(v)
        if not m or m.group("scheme") not in ("tcp", "ipc"):
            return "the scheme must be tcp:// or ipc://"
        rest = m.group("rest")
        if m.group("scheme") == "ipc":
            if not rest:
                return "ipc:// needs a path"
            if len(rest.encode()) > _IPC_MAX:
                return f"the ipc path is longer than {_IPC_MAX} bytes"
            return None
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            return "tcp:// needs HOST:PORT with a port from 1 to 65535"
        if host.startswith("[") != host.endswith("]"):
            return "an IPv6 host is written in brackets: tcp://[::1]:5555"
        return None

    def text(self, typ):
        return "tcp://HOST:PORT or ipc://PATH"


# ------------------------------------------------------------------ the schema

@dataclass(frozen=True)
class Setting:
    """One setting. `default` is given as it would be written in TOML and parsed once."""
    name: str
    type: _Type
    default: Any
    doc: str
    check: Callable | None = None
    reload: str = HUP
    metavar: str | None = None  # for --help (default: the type's)
    value: Any = field(init=False, repr=False, compare=False)  # the parsed default

    def __post_init__(self):
        assert self.reload in _RELOAD_TEXT, self.reload
        object.__setattr__(self, "value", self.type.from_native(self.default))
        assert self.check is None or self.check(self.value), f"default of {self.name} fails its check"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def allowed(self) -> str:
        """What values are allowed, in words: 'an integer from 0 to 1024'."""
        s = self.type.allowed
        if self.check is not None:
            if isinstance(self.check, _BindCheck):
                return self.check.text(self.type)
            s += " " + self.check.text(self.type)
        return s

    def parse(self, raw, where: str, base_dir: str | None = None, typed: bool = False):
        """raw -> the typed value; raises _Invalid naming the setting, `where`, the value and
        what is allowed. Strings are parsed by the type's syntax unless `typed` (a TOML
        file: its own types must match, so `workers = "4"` is an error)."""
        try:
            if isinstance(raw, str) and not typed:
                v = self.type.from_string(raw)
            else:
                v = self.type.from_native(raw)
        except (ValueError, TypeError, OverflowError):
            got = f" ({_kind(raw)})" if typed or not isinstance(raw, str) else ""
            raise _Invalid(f"invalid value for {self.name} ({where}): {_show(raw)}{got}; "
                           f"allowed: {self.allowed}") from None
        if isinstance(self.type, _Path) and v and base_dir and not os.path.isabs(v):
            v = os.path.normpath(os.path.join(base_dir, v))
        if self.check is not None and not self.check(v):
            why = self.check.problem(v) if isinstance(self.check, _BindCheck) else None
            raise _Invalid(f"invalid value for {self.name} ({where}): {_show(raw)}; "
                           f"{why + '; ' if why else ''}allowed: {self.allowed}")
        return v


_MAXTOK = 1 << 20

SCHEMA: tuple[Setting, ...] = (
    Setting("config", PATH, "", "the TOML settings file to read (command line or environment only)",
            reload=RESTART),
    Setting("model", PATH, "", "the .colibri model file (empty: the bundled model)", reload=USR1),
    Setting("bind", STR, "tcp://127.0.0.1:5555", "client address: tcp://HOST:PORT or ipc://PATH",
            _BindCheck(), reload=RESTART, metavar="ADDRESS"),
    Setting("runtime_dir", PATH, "",
            "sockets and state (empty: $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/colibri, "
            "else /tmp/colibri-UID)", reload=RESTART),
    Setting("pidfile", PATH, "", "write the master's pid to this file (empty: none)", reload=RESTART),
    Setting("curve_secret_key", PATH, "",
            "ZeroMQ CURVE server secret key file for tcp binds (empty: no encryption)", reload=RESTART),
    Setting("curve_allowed_keys", PATH, "",
            "directory of allowed client CURVE public keys (empty: any client with the server key)",
            reload=RESTART),
    Setting("workers", INT, 0, "worker processes (0: one per physical core)", Range(0, 1024)),
    Setting("threads_per_worker", INT, 1, "compute threads in each worker", Range(1, 256)),
    Setting("prefill_bf16", BOOL, False,
            "prefill bf16 weights with bf16-rounded activations (avx512bf16 CPUs; ~2x faster prefill, "
            "logits move by the rounding)"),
    Setting("pin", ENUM("none", "cores", "numa"), "cores",
            "CPU pinning: none, cores (distinct physical cores per worker) or numa (one node per worker)"),
    Setting("slots", INT, 1, "sequences one worker runs at once", Range(1, 256)),
    Setting("context", INT, 4096, "KV cache tokens per sequence", Range(1, _MAXTOK)),
    Setting("timeout", DURATION, 30.0, "a worker silent this long is killed and replaced", Range(1.0)),
    Setting("graceful_timeout", DURATION, 30.0,
            "on stop or reload, time for workers to finish their requests before they are killed",
            Range(0.0)),
    Setting("heartbeat_interval", DURATION, 1.0, "how often a worker reports that it is alive",
            Range(0.05, 60.0)),
    Setting("max_requests", INT, 0, "requests a worker serves before it is recycled (0: never recycle)",
            Range(0)),
    Setting("max_requests_jitter", INT, 0, "random extra 0..N added to max_requests per worker",
            Range(0)),
    Setting("max_queue", INT, 64,
            "queued requests beyond the busy workers; more are answered 'overloaded'", Range(0, 10**6)),
    Setting("max_prompt_tokens", INT, 8192, "longest prompt accepted, in tokens", Range(1, _MAXTOK)),
    Setting("max_tokens", INT, 4096, "most tokens one request may generate", Range(1, _MAXTOK)),
    Setting("max_stop", INT, 16, "most stop strings in one request", Range(0, 1024)),
    Setting("max_body", SIZE, "1MiB", "largest request message accepted", Range(1 << 10, 1 << 30)),
    Setting("control_rate", FLOAT, 50.0,
            "tokenize, detokenize and stats requests one client may send a second (bursts of twice "
            "that); more are answered 'overloaded' (0: no limit)", Range(0.0)),
    Setting("memory_limit", SIZE, 0, "per-worker private memory budget checked at start (0: none)",
            Range(0)),
    Setting("mlock", BOOL, False, "lock the model mapping in RAM (needs RLIMIT_MEMLOCK)",
            reload=RESTART),
    Setting("populate", BOOL, True, "fault every model page in at start", reload=USR1),
    Setting("hugepages", BOOL, True, "map the model on 2 MiB pages where the kernel can (re-reads "
            "once the parts of a large file found on 4 KiB pages)", reload=USR1),
    Setting("log_level", ENUM("debug", "info", "warning", "error"), "info", "log verbosity"),
    Setting("routing_noise", FLOAT, 0.0, "Gumbel noise scale on MoE expert routing (0: off)",
            Range(0.0)),
    Setting("seed", INT, -1, "sampling and routing-noise seed (-1: random per worker)",
            Range(-1, (1 << 63) - 1)),
)

SETTINGS: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SCHEMA})
assert len(SETTINGS) == len(SCHEMA), "duplicate setting name"

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
    """Immutable effective settings: `s.workers`, `s.source('workers')`, `s.as_dict()`."""
    __slots__ = ("_values", "_sources")

    def __init__(self, values: Mapping[str, Any], sources: Mapping[str, str] | None = None):
        missing = set(SETTINGS) - set(values)
        extra = set(values) - set(SETTINGS)
        if missing or extra:
            raise TypeError(f"Settings: missing {sorted(missing)}, unknown {sorted(extra)}")
        sources = dict(sources or {})
        object.__setattr__(self, "_values", MappingProxyType({n: values[n] for n in SETTINGS}))
        object.__setattr__(self, "_sources", MappingProxyType(
            {n: sources.get(n, "default") for n in SETTINGS}))

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
        return (Settings, (dict(self._values), dict(self._sources)))

    def __repr__(self):
        changed = ", ".join(f"{n}={v!r}" for n, v in self._values.items() if v != SETTINGS[n].value)
        return f"Settings({changed})"

    def source(self, name: str) -> str:
        """'default', 'file:PATH', 'env:COLIBRI_X' or 'cli'."""
        if name not in self._sources:
            raise KeyError(f"no setting {name!r}{_suggest(name, SETTINGS)}")
        return self._sources[name]

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
    return Settings({s.name: s.value for s in SCHEMA})


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
    return Settings(values, sources)


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
    if v["curve_secret_key"] and not v["bind"].startswith("tcp://"):
        out.append(f"{at('curve_secret_key')} applies to tcp:// binds only, but {at('bind')}")
    return out


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
    """Every setting, its effective value, where it came from and when a change applies,
    aligned; the `name = value` part is valid TOML."""
    rows = [(f"{n} = {_toml_value(n, settings[n])}", settings.source(n), _RELOAD_TEXT[SETTINGS[n].reload])
            for n in SETTINGS]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    head = f"{'# setting = value':<{w0}}  # {'source':<{w1}}  applies on"
    return "\n".join([head] + [f"{a:<{w0}}  # {b:<{w1}}  {c}".rstrip() for a, b, c in rows]) + "\n"


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


if __name__ == "__main__":
    import sys
    sys.stdout.write(example_toml())
