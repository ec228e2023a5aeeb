"""The settings' schema: every setting declared once, the server's in SCHEMA and the HTTP gateway's
in GATEWAY (name, type, default, range, doc, reload kind, environment variable), the value types and
their parsers (int, float, bool, duration, size, path, enum, bind addresses). Loading and merging
the server's sources is load.py's; the gateway reads its own with gateway_options().
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

ENV_PREFIX = "COLIBRI_"
# COLIBRI_* variables that are not settings (used by other parts of the program) and so are
# not reported as unknown. Add a name here when one is introduced.
ENV_NOT_SETTINGS: frozenset[str] = frozenset()
# other namespaces: the HTTP gateway's (GATEWAY below), the soak tests' and the test harness's
# (tests/server_harness.py): `colibri serve` leaves them alone
ENV_NOT_SETTINGS_PREFIXES = ("COLIBRI_HTTP_", "COLIBRI_SOAK_", "COLIBRI_TEST_")

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
class _HttpCheck:
    def __call__(self, v: str) -> bool:
        return self.problem(v) is None

    @staticmethod
    def problem(v: str):
        if not v:
            return None
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or "://" in v:
            return "HOST:PORT with a port from 1 to 65535 (no scheme)"
        return None

    def text(self, typ):
        return "HOST:PORT, or empty"


class _BindCheck:
    def __init__(self, optional: bool = False, tcp_only: bool = False):
        self.optional, self.tcp_only = optional, tcp_only

    def __call__(self, v: str) -> bool:
        return self.problem(v) is None

    def problem(self, v: str):
        if self.optional and not v:
            return None
        if self.tcp_only and not v.startswith("tcp://"):
            return "the scheme must be tcp:// (another machine's worker hosts reach it)"
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
        if self.tcp_only:
            return "tcp://HOST:PORT" + (", or empty" if self.optional else "")
        return "tcp://HOST:PORT or ipc://PATH" + (", or empty" if self.optional else "")


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
    prefix: str = ENV_PREFIX    # of its environment variable (the gateway's: GATEWAY_ENV_PREFIX)
    env_name: str | None = None  # its environment variable when not prefix + NAME
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
        return self.env_name or self.prefix + self.name.upper()

    @property
    def allowed(self) -> str:
        """What values are allowed, in words: 'an integer from 0 to 1024'."""
        s = self.type.allowed
        if self.check is not None:
            if isinstance(self.check, (_BindCheck, _HttpCheck)):
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
            why = self.check.problem(v) if isinstance(self.check, (_BindCheck, _HttpCheck)) else None
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
    Setting("http", STR, "", "also serve the OpenAI-compatible HTTP API on HOST:PORT (the gateway runs under "
            "the master, restarted if it dies; empty: none, run `colibri http` yourself)", _HttpCheck(),
            reload=RESTART, metavar="HOST:PORT"),
    Setting("served_model_name", STR, "", "the model ids the HTTP API answers to and lists, comma-separated "
            "aliases, the first named in answers (empty: the model file's name)", reload=RESTART, metavar="NAME[,NAME]"),
    Setting("runtime_dir", PATH, "",
            "sockets and state (empty: $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/colibri, "
            "else /tmp/colibri-UID)", reload=RESTART),
    Setting("pidfile", PATH, "", "write the master's pid to this file (empty: none)", reload=RESTART),
    Setting("cache_dir", PATH, "", "compiled kernels, one directory per machine and build inside it (`colibri "
            "compile` fills it; empty: $CACHE_DIRECTORY, else $XDG_CACHE_HOME/colibri, else ~/.cache/colibri)",
            reload=RESTART),
    Setting("curve_secret_key", PATH, "",
            "ZeroMQ CURVE server secret key file for tcp binds (empty: no encryption)", reload=RESTART),
    Setting("curve_allowed_keys", PATH, "",
            "directory of allowed client CURVE public keys (empty: any client with the server key)",
            reload=RESTART),
    Setting("backend_bind", STR, "", "also accept worker hosts (`colibri serve --join`) on this address: "
            "their workers get requests from this router beside its own (empty: local workers only; "
            "`colibri router` needs it). Off loopback it needs curve_secret_key and worker_allowed_keys",
            _BindCheck(optional=True, tcp_only=True), reload=RESTART, metavar="tcp://HOST:PORT"),
    Setting("worker_allowed_keys", PATH, "", "directory of the worker hosts' CURVE public keys (*.key) that "
            "backend_bind admits (empty: none checked, loopback only)", reload=RESTART),
    Setting("join", STR, "", "run as a worker host: no router here, this master's workers join the head "
            "router's backend_bind at this address (empty: serve with a router of its own)",
            _BindCheck(optional=True), reload=RESTART, metavar="tcp://HEAD:PORT"),
    Setting("join_server_key", PATH, "", "the head's CURVE public key file (its curve_secret_key's .key) for "
            "join (empty: no encryption, loopback only)", reload=RESTART),
    Setting("join_secret_key", PATH, "", "this worker host's CURVE secret key file (*.key_secret) for join; "
            "its .key goes into the head's worker_allowed_keys", reload=RESTART),
    Setting("workers", INT, 0, "worker processes (0: one per NUMA node when threads_per_worker is 0, else one "
            "per threads_per_worker physical cores)", Range(0, 1024)),
    Setting("threads_per_worker", INT, 0, "compute threads in each worker (0: the physical cores shared out "
            "among the workers, so one worker steps its batch on every core)", Range(0, 256)),
    Setting("prefill_bf16", BOOL, False,
            "prefill bf16 weights with bf16-rounded activations (avx512bf16 CPUs; ~2x faster prefill, "
            "logits move by the rounding)"),
    Setting("exact_head", BOOL, True,
            "a block-kind output head takes the hidden state rounded to int16 (a real model's first token "
            "follows its f32 reference); false: llama.cpp's int8 rounding of it, which can swap two near tokens"),
    Setting("pin", ENUM("none", "cores", "numa"), "cores",
            "CPU pinning: none, cores (distinct physical cores per worker) or numa (workers round-robin over "
            "the NUMA nodes, each pinned to its node's CPUs; memory placed as numa_memory says)"),
    Setting("numa_memory", ENUM("node", "interleave", "off"), "node",
            "with pin = numa on a machine of several NUMA nodes: node (a copy of the model bound to each node, "
            "used by the workers pinned there: one model's memory per node), interleave (the file's pages "
            "spread over the nodes) or off", reload=USR1),
    Setting("slots", INT, 32, "sequences one worker runs at once, all in one batched forward per step",
            Range(1, 256)),
    Setting("context", INT, 4096, "most tokens of one sequence (prompt + generated)", Range(1, _MAXTOK)),
    Setting("max_batch_tokens", INT, 256,
            "rows in one batched step: every decoding sequence's next token first, then prefill chunks",
            Range(1, 1 << 16)),
    Setting("kv_cache_memory", SIZE, 0,
            "the paged KV pool of one worker (0: slots x context, at most a quarter of the RAM available "
            "at start shared by the workers)", Range(0)),
    Setting("kv_dtype", ENUM("f16", "f32"), "f16", "keys and values in the KV pool (f32: the exact path)"),
    Setting("prefix_cache", BOOL, True,
            "keep the KV blocks of full prompt blocks and reuse them for later requests that start alike"),
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
    Setting("max_prompt_tokens", INT, 8192, "longest prompt accepted, in tokens (the prompt must also be shorter than context, "
            "which refuses it otherwise)", Range(1, _MAXTOK)),
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
    Setting("weights_memory", SIZE, 0,
            "bytes of the model kept resident (0: all of it when the file fits in the memory available at "
            "start, else nine tenths of that less room for the experts being read); below the file's size the "
            "always-needed part and the most-routed experts are locked, the others read when a layer routes "
            "to them", Range(0), reload=USR1),
    Setting("expert_readahead", ENUM("chosen", "predicted"), "chosen",
            "with weights_memory below the model's size, which experts a worker asks the disk for: chosen (a "
            "layer's chosen experts not locked, at once when it has routed) or predicted (also the next "
            "layer's probable ones, one layer early: slower where the disk is the bottleneck, the guesses "
            "that miss read whole experts before the needed ones)"),
    Setting("verify_checksums", BOOL, True, "verify every tensor's CRC-32 when the model is opened (start, "
            "HUP, USR1): a corrupted file is refused naming the tensor", reload=USR1),
    Setting("hugepages", BOOL, True, "map the model on 2 MiB pages where the kernel can (re-reads "
            "once the parts of a large file found on 4 KiB pages)", reload=USR1),
    Setting("log_level", ENUM("debug", "info", "warning", "error"), "info", "log verbosity"),
    Setting("log_format", ENUM("text", "json"), "text", "log lines as text, or one JSON object per line (ts, "
            "level, logger, pid, role, msg, request_id) for log shippers", reload=RESTART),
    Setting("routing_noise", FLOAT, 0.0, "Gumbel noise scale on MoE expert routing (0: off)",
            Range(0.0)),
    Setting("seed", INT, -1, "sampling and routing-noise seed (-1: random per worker)",
            Range(-1, (1 << 63) - 1)),
)

SETTINGS: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SCHEMA})
assert len(SETTINGS) == len(SCHEMA), "duplicate setting name"


# ------------------------------------------------------------------ the HTTP gateway's
# `colibri http` (flags), gunicorn's app_from_env() and configs/gunicorn.conf.py (COLIBRI_HTTP_*), and
# the gateway the master runs for `serve --http` read these; a flag wins over its variable

GATEWAY_ENV_PREFIX = "COLIBRI_HTTP_"


def _gw(name, typ, default, doc, check=None, **kw) -> Setting:
    return Setting(name, typ, default, doc, check, reload=RESTART, prefix=GATEWAY_ENV_PREFIX, **kw)


GATEWAY: tuple[Setting, ...] = (
    _gw("connect", STR, "tcp://127.0.0.1:5555", "address of the colibri server (tcp://host:port or ipc:///path); "
        "several, comma-separated (or the flag repeated): requests are spread over them and fail over when one "
        "is down", metavar="ADDRESS"),
    _gw("bind", STR, "127.0.0.1:8000", "HTTP address to listen on"),
    _gw("workers", INT, 1, "gunicorn worker processes (each exports its own request metrics)", Range(1, 1024)),
    _gw("threads", INT, 8, "threads per worker process = concurrent HTTP requests per process", Range(1, 4096)),
    _gw("api_key", STR, "", "require 'Authorization: Bearer KEY' (as a flag it is visible in ps: prefer "
        "the file or the variable)", metavar="KEY"),
    _gw("api_key_file", PATH, "", "read the API key from this file"),
    _gw("model_name", STR, "", "model id to serve as; comma-separated aliases, the first named in answers "
        "(empty: the model file's metadata name)", metavar="NAME"),
    _gw("timeout", FLOAT, 120.0, "seconds to wait for the next message of a request, queueing included",
        Range(0.001)),
    _gw("max_body", SIZE, 1 << 20, "largest request body (413 beyond)", Range(1)),
    _gw("default_max_tokens", INT, 512, "max_tokens of a chat completion that gives none", Range(1, _MAXTOK)),
    _gw("metrics_auth", BOOL, False, "require the API key on /metrics too"),
    _gw("pages", BOOL, True, "serve the chat page at / and the status page at /status (read-only views; "
        "/status.json asks for the API key as the API does)"),
    _gw("curve_server_key", PATH, "", "the router's CURVE public key file (its curve_secret_key's .key), for a "
        "router that admits clients by key", env_name="COLIBRI_HTTP_CURVE_SERVER_KEY_FILE", metavar="FILE"),
    _gw("curve_secret_key", PATH, "", "the gateway's own CURVE secret key file (its .key goes into the router's "
        "curve_allowed_keys)", env_name="COLIBRI_HTTP_CURVE_SECRET_KEY_FILE", metavar="FILE"),
    _gw("curve_serverkey", STR, "", "the router's CURVE public key itself (z85): the gateway then connects "
        "with a fresh key pair of its own", metavar="KEY"),
    _gw("log_format", ENUM("text", "json"), "text", "log lines as text or one JSON object per line"),
    _gw("log_level", ENUM("debug", "info", "warning", "error", "critical"), "info",
        "gunicorn and gateway log verbosity"),
    _gw("header_timeout", FLOAT, 10.0, "seconds a request's line, headers and body have, from its first "
        "byte, to be all in (408 after)", Range(0.001)),
    _gw("access_log", STR, "", "gunicorn's access log (a path, or - for stderr; empty: none)"),
)
GATEWAY_SETTINGS: Mapping[str, Setting] = MappingProxyType({s.name: s for s in GATEWAY})
assert len(GATEWAY_SETTINGS) == len(GATEWAY), "duplicate gateway setting name"


def gateway_value(name: str, environ=None):
    """A gateway setting's value from its environment variable (its default when unset or empty);
    SettingsError, one line naming the variable, when the value is not allowed."""
    s = GATEWAY_SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(s.env)
    if raw is None or raw == "":
        return s.value
    try:
        return s.parse(raw, s.env)
    except _Invalid as e:
        raise SettingsError(str(e)) from None


def gateway_flag_value(name: str, text: str):
    """A gateway setting's value from its command-line flag's text; SettingsError naming the flag."""
    s = GATEWAY_SETTINGS[name]
    try:
        return s.parse(text, s.flag)
    except _Invalid as e:
        raise SettingsError(str(e)) from None
