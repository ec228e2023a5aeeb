"""Settings (colibri_server/settings/): sources and precedence, unknown keys, invalid
values from every source, value syntax, reload kinds, the example file, describe()."""
from __future__ import annotations

import argparse
import os
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from colibri_server.settings import SCHEMA, SETTINGS, SettingsError, load_settings, schema
from colibri_server.settings import load as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "configs", "colibri.toml")


def write(tmp_path, text, name="colibri.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def parse_cli(*argv):
    p = argparse.ArgumentParser()
    S.add_arguments(p)
    return p.parse_args(list(argv))


# ------------------------------------------------------------------ schema

def test_schema_names_flags_env():
    assert len({s.name for s in SCHEMA}) == len(SCHEMA)
    for s in SCHEMA:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", s.name)
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.env == "COLIBRI_" + s.name.upper()
        assert s.doc and "\n" not in s.doc
        assert s.reload in (S.HUP, S.USR1, S.RESTART)


def test_defaults():
    d = S.defaults()
    assert (d.model, d.bind, d.pin) == ("", "tcp://127.0.0.1:5555", "cores")
    assert d.source("workers") == d.source("threads_per_worker") == "default"
    assert d.workers * d.threads_per_worker <= max(1, __import__("psutil").cpu_count()) and d.threads_per_worker >= 1
    assert (d.slots, d.context, d.timeout, d.graceful_timeout, d.heartbeat_interval) == (32, 4096, 30.0, 30.0, 1.0)
    assert (d.max_batch_tokens, d.kv_cache_memory, d.kv_dtype, d.prefix_cache) == (256, 0, "f16", True)
    assert (d.max_requests, d.max_requests_jitter, d.max_queue) == (0, 0, 64)
    assert (d.max_prompt_tokens, d.max_tokens, d.max_stop, d.max_body) == (8192, 4096, 16, 1 << 20)
    assert (d.mlock, d.populate, d.pidfile, d.runtime_dir, d.log_level) == (False, True, "", "", "info")
    assert (d.routing_noise, d.seed, d.memory_limit) == (0.0, -1, 0)
    assert (d.curve_secret_key, d.curve_allowed_keys, d.config) == ("", "", "")
    assert all(d.source(n) == "default" for n in SETTINGS)
    assert load_settings(env={}) == d


def test_reload_kinds():
    hup = {"workers", "threads_per_worker", "pin", "slots", "timeout", "graceful_timeout",
           "heartbeat_interval", "max_requests", "max_requests_jitter", "max_queue",
           "max_prompt_tokens", "max_tokens", "max_stop", "max_body", "log_level",
           "routing_noise", "seed"}
    restart = {"bind", "runtime_dir", "pidfile", "mlock", "curve_secret_key", "curve_allowed_keys", "config"}
    for n in hup:
        assert SETTINGS[n].reload == S.HUP, n
    for n in restart:
        assert SETTINGS[n].reload == S.RESTART, n
    assert SETTINGS["model"].reload == S.USR1
    old = load_settings({"threads_per_worker": 1}, env={})
    new = load_settings({"workers": 3, "bind": "ipc:///tmp/x.sock", "model": "m.colibri", "threads_per_worker": 1},
                        env={})
    assert old.diff(new) == {"workers": (0, 3), "bind": ("tcp://127.0.0.1:5555", "ipc:///tmp/x.sock"),
                             "model": ("", "m.colibri")}
    assert old.changes_needing(new, S.RESTART) == ["bind"]
    assert old.changes_needing(new, S.USR1) == ["model"]


def test_settings_immutable_and_picklable():
    s = load_settings({"workers": 2}, env={})
    with pytest.raises(AttributeError):
        s.workers = 3
    with pytest.raises(AttributeError, match="did you mean workers"):
        s.wrokers
    t = pickle.loads(pickle.dumps(s))
    assert t == s and t.source("workers") == "cli"


# ------------------------------------------------------------------ precedence

def test_precedence_and_sources(tmp_path):
    path = write(tmp_path, 'workers = 2\nslots = 3\ncontext = 1024\nlog_level = "debug"\n')
    env = {"COLIBRI_SLOTS": "4", "COLIBRI_CONTEXT": "2048", "COLIBRI_CONFIG": path}
    s = load_settings(parse_cli("--context", "512"), env=env)
    assert (s.workers, s.slots, s.context, s.log_level, s.pin) == (2, 4, 512, "debug", "cores")
    assert s.source("workers") == f"file:{path}"
    assert s.source("log_level") == f"file:{path}"
    assert s.source("slots") == "env:COLIBRI_SLOTS"
    assert s.source("context") == "cli"
    assert s.source("pin") == "default"
    assert (s.config, s.source("config")) == (path, "env:COLIBRI_CONFIG")


def test_config_path_sources(tmp_path):
    a = write(tmp_path, "workers = 5\n", "a.toml")
    b = write(tmp_path, "workers = 6\n", "b.toml")
    # the caller's default path; skipped silently if it does not exist
    assert load_settings(config_path=a, env={}).workers == 5
    s = load_settings(config_path=str(tmp_path / "nope.toml"), env={})
    assert (s.workers, s.config) == (S.defaults().workers, "")
    # COLIBRI_CONFIG beats the default path, --config beats COLIBRI_CONFIG
    assert load_settings(config_path=a, env={"COLIBRI_CONFIG": b}).workers == 6
    s = load_settings({"config": a}, config_path=b, env={"COLIBRI_CONFIG": b})
    assert (s.workers, s.source("config")) == (5, "cli")
    # an explicitly named missing file is an error
    missing = str(tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match=r"not found: .*missing\.toml \(named by --config\)"):
        load_settings(parse_cli("--config", missing), env={})
    with pytest.raises(SettingsError, match=r"not found: .*missing\.toml \(named by COLIBRI_CONFIG\)"):
        load_settings(env={"COLIBRI_CONFIG": missing})


def test_file_format_errors(tmp_path):
    p = write(tmp_path, "workers = = 3\n")
    with pytest.raises(SettingsError, match=f"cannot parse settings file {re.escape(p)}"):
        load_settings(config_path=p, env={})
    p = write(tmp_path, "[server]\nworkers = 3\n")
    with pytest.raises(SettingsError, match=r"table \[server\].*flat"):
        load_settings(config_path=p, env={})
    p = write(tmp_path, 'config = "other.toml"\n')
    with pytest.raises(SettingsError, match="'config' in .*--config or COLIBRI_CONFIG"):
        load_settings(config_path=p, env={})


def test_paths_relative_to_file(tmp_path):
    (tmp_path / "etc").mkdir()
    p = write(tmp_path / "etc", 'model = "models/m.colibri"\npidfile = "/run/c.pid"\nruntime_dir = "~/run"\n')
    s = load_settings(config_path=p, env={})
    assert s.model == str(tmp_path / "etc" / "models" / "m.colibri")
    assert s.pidfile == "/run/c.pid"
    assert s.runtime_dir == os.path.expanduser("~/run")
    # command line and environment paths are left as given (relative to the cwd)
    assert load_settings({"model": "rel.colibri"}, env={}).model == "rel.colibri"
    assert load_settings({"model": tmp_path / "m.colibri"}, env={}).model == str(tmp_path / "m.colibri")


# ------------------------------------------------------------------ unknown keys

def test_unknown_key_in_file(tmp_path):
    p = write(tmp_path, "wrokers = 4\n")
    with pytest.raises(SettingsError) as ei:
        load_settings(config_path=p, env={})
    msg = str(ei.value)
    assert "unknown setting 'wrokers'" in msg and p in msg and "did you mean workers?" in msg
    p = write(tmp_path, "max-queue = 4\n")
    with pytest.raises(SettingsError, match="did you mean max_queue"):
        load_settings(config_path=p, env={})
    p = write(tmp_path, "zzzzzz = 4\n")
    with pytest.raises(SettingsError, match="unknown setting 'zzzzzz'.*config --print"):
        load_settings(config_path=p, env={})


def test_unknown_env_var():
    with pytest.raises(SettingsError) as ei:
        load_settings(env={"COLIBRI_WROKERS": "4", "PATH": "/bin"})
    msg = str(ei.value)
    assert "COLIBRI_WROKERS" in msg and "did you mean COLIBRI_WORKERS?" in msg
    with pytest.raises(SettingsError, match="did you mean COLIBRI_MAX_QUEUE"):
        load_settings(env={"COLIBRI_MAXQUEUE": "4"})
    with pytest.raises(SettingsError, match="unknown environment variable COLIBRI_workers"):
        load_settings(env={"COLIBRI_workers": "4"})  # exact spelling only


def test_unknown_cli_dict_key():
    with pytest.raises(SettingsError, match="unknown setting 'threads' .*did you mean threads_per_worker"):
        load_settings({"threads": 2}, env={})
    # a Namespace may carry other arguments: only settings are read
    ns = argparse.Namespace(workers="2", prompt="hi", fn=None, slots=None)
    s = load_settings(ns, env={})
    assert (s.workers, s.source("workers"), s.source("slots")) == (2, "cli", "default")


def test_all_problems_reported_together(tmp_path):
    p = write(tmp_path, "wrokers = 4\nslots = 0\n")
    with pytest.raises(SettingsError) as ei:
        load_settings({"context": "big"}, config_path=p, env={"COLIBRI_PIN": "all"})
    assert len(ei.value.problems) == 4
    assert "4 problems" in str(ei.value)


# ------------------------------------------------------------------ invalid values, every source

INVALID = [
    # name, raw string, fragment of "allowed"
    ("workers", "2000", "an integer from 0 to 1024"),
    ("workers", "four", "an integer from 0 to 1024"),
    ("threads_per_worker", "-1", "from 0 to 256"),
    ("slots", "257", "from 1 to 256"),
    ("pin", "all", "one of none, cores, numa"),
    ("timeout", "0.5", "at least 1.0"),
    ("timeout", "soon", "a duration in seconds"),
    ("graceful_timeout", "-1", "at least 0.0"),
    ("heartbeat_interval", "0.01", "from 0.05 to 60.0"),
    ("max_queue", "1000001", "from 0 to 1000000"),
    ("max_body", "1PB", "a size in bytes"),
    ("max_body", "2G", "from 1KiB to 1GiB"),
    ("mlock", "maybe", "a boolean"),
    ("log_level", "verbose", "one of debug, info, warning, error"),
    ("routing_noise", "-0.1", "at least 0.0"),
    ("routing_noise", "nan", "a number"),
    ("seed", "-2", "from -1 to"),
    ("bind", "http://localhost:80", "the scheme must be tcp:// or ipc://"),
    ("bind", "tcp://localhost", "tcp:// needs HOST:PORT"),
    ("bind", "tcp://localhost:70000", "port from 1 to 65535"),
    ("bind", "ipc://", "ipc:// needs a path"),
]


@pytest.mark.parametrize("name,raw,allowed", INVALID)
def test_invalid_value_each_source(tmp_path, name, raw, allowed):
    env_var = SETTINGS[name].env
    cases = [
        ({}, {env_var: raw}, None, f"environment {env_var}"),
        # a bool flag takes no value: give the string through a dict, as code would
        ({name: raw} if SETTINGS[name].type is schema.BOOL else parse_cli(SETTINGS[name].flag + "=" + raw),
         {}, None, f"command line {SETTINGS[name].flag}"),
    ]
    toml_raw = schema._toml_str(raw) if SETTINGS[name].type not in (schema.INT, schema.FLOAT, schema.BOOL) else raw
    if raw not in ("four", "maybe", "nan"):  # not TOML literals
        p = write(tmp_path, f"{name} = {toml_raw}\n")
        cases.append((None, {}, p, f"file {p}"))
    for argv, env, path, where in cases:
        with pytest.raises(SettingsError) as ei:
            load_settings(argv, config_path=path, env=env)
        msg = str(ei.value)
        assert f"invalid value for {name} ({where})" in msg, msg
        assert raw in msg and allowed in msg, msg


def test_file_types_are_strict(tmp_path):
    for text, frag in [('workers = "4"', '"4" (a string); allowed: an integer'),
                       ("mlock = 1", "1 (an integer); allowed: a boolean"),
                       ("workers = 2.5", "2.5 (a float)"),
                       ('timeout = true', "true (a boolean)"),
                       ("pin = 3", "3 (an integer); allowed: one of none")]:
        p = write(tmp_path, text + "\n")
        with pytest.raises(SettingsError, match=re.escape(frag)):
            load_settings(config_path=p, env={})
    # sizes and durations may be strings in the file too
    p = write(tmp_path, 'max_body = "64KiB"\nmemory_limit = 1048576\ntimeout = "2m"\ngraceful_timeout = 5\n')
    s = load_settings(config_path=p, env={})
    assert (s.max_body, s.memory_limit, s.timeout, s.graceful_timeout) == (65536, 1 << 20, 120.0, 5.0)
    assert isinstance(s.graceful_timeout, float)


def test_cross_checks():
    with pytest.raises(SettingsError, match="heartbeat_interval = 5.0 .* less than timeout = 2.0"):
        load_settings({"heartbeat_interval": 5.0, "timeout": 2.0}, env={})
    with pytest.raises(SettingsError, match="curve_allowed_keys .* needs curve_secret_key"):
        load_settings(env={"COLIBRI_CURVE_ALLOWED_KEYS": "/etc/keys"})
    with pytest.raises(SettingsError, match="tcp:// binds only"):
        load_settings({"curve_secret_key": "/k", "bind": "ipc:///tmp/s"}, env={})
    s = load_settings({"curve_secret_key": "/k", "curve_allowed_keys": "/d"}, env={})
    assert s.curve_secret_key == "/k"


# ------------------------------------------------------------------ value syntax

@pytest.mark.parametrize("text,value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("off", False)])
def test_bool_strings(text, value):
    assert load_settings(env={"COLIBRI_MLOCK": text}).mlock is value


def test_bool_flags():
    assert load_settings(parse_cli("--mlock"), env={}).mlock is True
    s = load_settings(parse_cli("--no-populate"), env={"COLIBRI_POPULATE": "yes"})
    assert (s.populate, s.source("populate")) == (False, "cli")
    s = load_settings(parse_cli(), env={"COLIBRI_POPULATE": "no"})
    assert (s.populate, s.source("populate")) == (False, "env:COLIBRI_POPULATE")


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("512MiB", 512 << 20), ("2G", 2 << 30), ("2g", 2 << 30), ("64k", 65536),
    ("1KiB", 1024), ("1kB", 1000), ("3MB", 3_000_000), ("1.5M", 3 << 19), ("1T", 1 << 40),
    ("7 MiB", 7 << 20), ("100b", 100)])
def test_sizes(text, value):
    assert S.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "-1M", "1 PiB", "1e3", "1.2.3K"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        S.parse_size(text)


@given(st.integers(0, 1 << 50))
@hsettings(max_examples=60, deadline=None)
def test_size_round_trip(n):
    assert S.parse_size(S.format_size(n)) == n


def test_size_settings():
    s = load_settings({"max_body": "2MiB"}, env={"COLIBRI_MEMORY_LIMIT": "2G"})
    assert (s.max_body, s.memory_limit) == (2 << 20, 2 << 30)


@pytest.mark.parametrize("text,value", [
    ("30", 30.0), ("2.5", 2.5), ("500ms", 0.5), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0),
    (" 1.5 s ", 1.5), ("1e1", 10.0)])
def test_durations(text, value):
    assert S.parse_duration(text) == value


@pytest.mark.parametrize("text", ["", "s", "1d", "inf", "nan", "1 2"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        S.parse_duration(text)


def test_duration_and_scalar_settings():
    s = load_settings(parse_cli("--timeout", "90s", "--routing-noise", "0.25", "--seed", "7",
                                "--pin", "NUMA", "--log-level", "Warning"),
                      env={"COLIBRI_GRACEFUL_TIMEOUT": "1m", "COLIBRI_WORKERS": "1_000"})
    assert (s.timeout, s.graceful_timeout, s.routing_noise, s.seed) == (90.0, 60.0, 0.25, 7)
    assert (s.pin, s.log_level, s.workers) == ("numa", "warning", 1000)


def test_bind_forms():
    for b in ("tcp://0.0.0.0:5555", "tcp://*:1", "tcp://[::1]:5555", "tcp://eth0:65535",
              "ipc:///run/colibri/sock", "ipc://@abstract"):
        assert load_settings({"bind": b}, env={}).bind == b
    with pytest.raises(SettingsError, match="longer than 107 bytes"):
        load_settings({"bind": "ipc:///" + "x" * 120}, env={})


def test_resolve_runtime_dir():
    d = S.defaults()
    assert S.resolve_runtime_dir(d, {"RUNTIME_DIRECTORY": "/run/colibri:/run/x",
                                     "XDG_RUNTIME_DIR": "/run/user/1"}) == "/run/colibri"
    assert S.resolve_runtime_dir(d, {"XDG_RUNTIME_DIR": "/run/user/1"}) == "/run/user/1/colibri"
    assert S.resolve_runtime_dir(d, {}, uid=123) == "/tmp/colibri-123"
    assert S.resolve_runtime_dir(load_settings({"runtime_dir": "/srv/c"}, env={}), {}) == "/srv/c"


# ------------------------------------------------------------------ argparse

def test_add_arguments():
    p = argparse.ArgumentParser()
    S.add_arguments(p)
    ns = p.parse_args([])
    assert all(getattr(ns, n) is None for n in SETTINGS)  # "not given" is distinguishable
    helps = {a.dest: a for a in p._actions}
    for s in SCHEMA:
        assert helps[s.name].help.startswith(s.doc + " (default: ")      # the doc, then default and variable
        assert s.flag in helps[s.name].option_strings
    assert "--no-mlock" in helps["mlock"].option_strings
    assert isinstance(helps["mlock"], argparse.BooleanOptionalAction)
    q = argparse.ArgumentParser()
    S.add_arguments(q, exclude=("model", "seed"))
    assert "seed" not in {a.dest for a in q._actions}


# ------------------------------------------------------------------ example file, describe

def test_example_file_matches_schema():
    with open(EXAMPLE) as f:
        committed = f.read()
    assert committed == S.example_toml(), (
        "configs/colibri.toml is out of date: python -m colibri_server.settings > configs/colibri.toml")
    for s in SCHEMA:
        assert re.search(rf"^(# )?{s.name} = ", committed, re.M), s.name
        assert s.doc[1:] in committed


def test_example_file_loads_to_defaults():
    s = load_settings(config_path=EXAMPLE, env={})
    d = S.defaults()
    assert {n: v for n, v in s.as_dict().items() if n != "config"} == \
        {n: v for n, v in d.as_dict().items() if n != "config"}
    assert s.config == EXAMPLE
    assert all(s.source(n) == f"file:{EXAMPLE}" for n in SETTINGS if n != "config")


def test_describe(tmp_path):
    p = write(tmp_path, "workers = 3\n")
    s = load_settings(parse_cli("--max-body", "2MiB"), config_path=p, env={"COLIBRI_SEED": "5"})
    out = S.describe(s)
    lines = out.splitlines()[1:]
    assert len(lines) == len(SCHEMA)
    for line, setting in zip(lines, SCHEMA):
        assert line.startswith(setting.name + " = ")
    text = {line.split(" = ")[0]: line for line in lines}
    assert re.search(rf"^workers = 3 +# file:{re.escape(p)} +SIGHUP$", text["workers"])
    assert re.search(r'^max_body = "2MiB" +# cli +SIGHUP$', text["max_body"])
    assert re.search(r"^seed = 5 +# env:COLIBRI_SEED +SIGHUP$", text["seed"])
    assert re.search(r'^bind = "tcp://127.0.0.1:5555" +# default +restart$', text["bind"])
    # aligned: the source column starts at the same offset on every line
    assert len({line.index("# ") for line in lines}) == 1


def test_describe_prints_automatic_values_as_configured(tmp_path):
    """`config --print` prints the configured value of an automatic setting (0), not this
    machine's resolution of it (`workers = 1  # file:...` where the file says 0 would, pasted into
    a file, pin what is meant to follow the machine); the resolution is a comment."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    p = write(tmp_path, "workers = 0\nseed = 5\n")
    s = load_settings({}, config_path=p, env={})
    assert s.workers >= 1 and s.threads_per_worker >= 1          # resolved for this machine
    text = {line.split(" = ")[0]: line for line in S.describe(s).splitlines()[1:]}
    assert re.search(rf"^workers = 0 +# file:{re.escape(p)} +SIGHUP +resolves to {s.workers} here$",
                     text["workers"]), text["workers"]
    assert re.search(rf"^threads_per_worker = 0 +# default +SIGHUP +resolves to {s.threads_per_worker} here$",
                     text["threads_per_worker"]), text["threads_per_worker"]
    pasted = tomllib.loads("\n".join(v for k, v in text.items() if k != "config"))
    assert (pasted["workers"], pasted["threads_per_worker"], pasted["seed"]) == (0, 0, 5)
    assert (s.configured("workers"), s.configured("threads_per_worker"), s.configured("seed")) == (0, 0, 5)
    assert pickle.loads(pickle.dumps(s)).configured("workers") == 0
    explicit = load_settings({"workers": "3", "threads_per_worker": "1"}, env={})
    text = {line.split(" = ")[0]: line for line in S.describe(explicit).splitlines()[1:]}
    assert re.search(r"^workers = 3 +# cli +SIGHUP$", text["workers"])        # nothing to resolve


def test_gateway_and_soak_variables_are_not_settings():
    from colibri_server.settings import SettingsError, load_settings
    s = load_settings({}, env={"COLIBRI_HTTP_CONNECT": "tcp://127.0.0.1:1", "COLIBRI_SOAK_SECONDS": "5",
                               "COLIBRI_WORKERS": "3"})
    assert s.workers == 3
    import pytest
    with pytest.raises(SettingsError, match="COLIBRI_HTTPX"):
        load_settings({}, env={"COLIBRI_HTTPX": "1"})


def test_automatic_layout_gives_each_node_one_worker_on_all_its_cores():
    """threads_per_worker 0 (the default): one worker per NUMA node stepping its batch on every
    physical core of it; workers set: the cores shared out among them; threads set: workers stay 0."""
    from colibri_server.host.pinning import Topology
    two_nodes = Topology.from_cores([[c] for c in range(8)], nodes=[[0, 1, 2, 3], [4, 5, 6, 7]])
    one = Topology.from_cores([[0], [1]])
    assert S._layout({"workers": 0, "threads_per_worker": 0}, one) == {"workers": 1, "threads_per_worker": 2}
    assert S._layout({"workers": 0, "threads_per_worker": 0}, two_nodes) == {"workers": 2, "threads_per_worker": 4}
    assert S._layout({"workers": 3, "threads_per_worker": 0}, two_nodes) == {"workers": 3, "threads_per_worker": 2}
    assert S._layout({"workers": 4, "threads_per_worker": 0}, one) == {"workers": 4, "threads_per_worker": 1}
    assert S._layout({"workers": 0, "threads_per_worker": 2}, two_nodes) == {"workers": 0, "threads_per_worker": 2}


# ---------------------------------------------------------------------------- the gateway's settings

def test_every_gateway_variable_the_code_reads_is_a_setting_of_the_schema():
    """COLIBRI_HTTP_* named anywhere in the package or the gunicorn config is declared once, in
    schema.GATEWAY, with its type and default (no second settings system in http/)."""
    import re

    from colibri_server.settings.schema import GATEWAY
    declared = {s.env for s in GATEWAY}
    named = set()
    for path in [*__import__("pathlib").Path(ROOT, "colibri_server").rglob("*.py"),
                 __import__("pathlib").Path(ROOT, "configs", "gunicorn.conf.py")]:
        named |= set(re.findall(r"COLIBRI_HTTP_[A-Z_]*[A-Z]", path.read_text()))
    assert named - declared == set()
    assert all(s.reload == "restart" for s in GATEWAY)


def test_gateway_variables_and_flags_are_parsed_by_the_schema():
    from colibri_server.http.config import options_from_env
    from colibri_server.http.serve import add_http_arguments
    from colibri_server.settings import Parser
    opts = options_from_env({"COLIBRI_HTTP_TIMEOUT": "2.5", "COLIBRI_HTTP_MAX_BODY": "2MiB",
                             "COLIBRI_HTTP_METRICS_AUTH": "yes", "COLIBRI_HTTP_MODEL_NAME": "m"})
    assert opts == {"connect": "tcp://127.0.0.1:5555", "timeout": 2.5, "max_body": 2 << 20, "metrics_auth": True,
                    "model_name": "m"}
    with pytest.raises(ValueError, match="COLIBRI_HTTP_DEFAULT_MAX_TOKENS.*allowed: an integer from 1"):
        options_from_env({"COLIBRI_HTTP_DEFAULT_MAX_TOKENS": "0"})
    p = add_http_arguments(Parser(prog="colibri http"))
    a = p.parse_args(["--workers", "3", "--max-body", "64KiB"])
    assert (a.workers, a.max_body, a.threads) == (3, 64 << 10, None)     # not given: the variable, then the default
    with pytest.raises(SystemExit):
        p.parse_args(["--threads", "0"])
