"""The `colibri` command line as a user meets it: flags, `config --print`, the demo."""
from __future__ import annotations

import pytest

from colibri_server import cli


def _usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()


@pytest.mark.parametrize("argv, usage, message", [
    (("serve", "--wokers", "2"), "usage: colibri serve ",
     "colibri serve: error: unrecognized argument: --wokers (did you mean --workers?)"),
    (("run", "--max-token", "5", "hi"), "usage: colibri run ",
     "colibri run: error: unrecognized argument: --max-token (did you mean --max-tokens?)"),
    (("run", "--max-token=5", "hi"), "usage: colibri run ",
     "colibri run: error: unrecognized argument: --max-token (did you mean --max-tokens?)"),
    (("debug", "routing", "--input", "x", "--tokens-ids"), "usage: colibri debug routing ",
     "colibri debug routing: error: unrecognized argument: --tokens-ids (did you mean --token-ids?)"),
    (("config", "--prin"), "usage: colibri config ",
     "colibri config: error: unrecognized argument: --prin (did you mean --print?)"),
])
def test_a_mistyped_flag_is_named_under_its_subcommands_usage(capsys, argv, usage, message):
    """No prefix of a flag is taken for the flag (`--max-token 5` is not --max-tokens 5), and the
    subcommand owning the arguments reports them (its usage, not the top-level one)."""
    lines = _usage_error(capsys, *argv)
    assert lines[0].startswith(usage), lines
    assert lines[-1] == message
    assert len(lines) <= 7, lines      # serve's flag-per-setting usage is cut to one line


def test_an_exact_flag_still_parses_and_the_gateway_takes_no_prefix(capsys, monkeypatch):
    a = cli.build_parser().parse_args(["run", "--max-tokens", "5", "hi"])
    assert a.max_tokens == 5 and a.prompt == "hi"
    import importlib
    gateway = importlib.import_module("colibri_server.http.serve")
    monkeypatch.setattr(gateway, "cmd_http", lambda a: pytest.fail(f"started a gateway with {a}"))
    with pytest.raises(SystemExit) as e:
        gateway.main(["--connec", "tcp://127.0.0.1:1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "colibri-http: error: unrecognized argument: --connec (did you mean --connect?)"


def test_demo_shows_clean_output_and_real_memory_figures():
    """`colibri demo` on a terminal (stdout and stderr on one stream): the answer follows the prompt
    with no server log line inside it (the server's log goes to a file), and the memory report has
    a figure for every worker, sampled after the request (a report taken before the router's
    sampler covers the workers would have none: no `USS 0.0 MiB`)."""
    import os
    import re
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "demo", "--max-tokens", "24"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, out
    assert not re.search(r"colibri\.\w+ (DEBUG|INFO|WARNING|ERROR)", out), out
    answer = out[out.index(">>> def fibonacci(n):"):out.index(" tokens from worker ")]
    assert len(answer) > len(">>> def fibonacci(n):") + 5, out
    rows = re.findall(r"^ +\d+ +(\d+) +\d+ +ready .*?MiB +(\S+) MiB +(\S+) MiB +(\S+) MiB$", out, re.M)
    assert [wid for wid, *_ in rows] == ["0", "1"], out
    assert all(float(x) > 0 for _, *figs in rows for x in figs), out       # USS, PSS, private anonymous
    resident = re.search(r"add up to ([\d.]+) MiB resident", out)
    assert resident and float(resident.group(1)) > 0, out
    assert "not sampled yet" not in out
    log = re.search(r"server log: (\S+); ", out)
    assert log and "server stopped (exit 0)" in out
    assert not os.path.exists(os.path.dirname(log.group(1))), "a clean demo left its directory behind"


def test_status_shows_an_unsampled_worker_as_unknown_not_zero():
    """A `stats` answered before the router's memory sampler covered a worker (just started, or the
    sampler's first pass still running) has no figures for it: `colibri status` says so."""
    import os

    from colibri_server.host.memory import MemorySampler
    got = MemorySampler().get(os.getpid())
    assert got["memory_sampled"] is False and got["rss"] > 0
    w = {"pid": 11, "wid": 0, "generation": 1, "state": "ready", "cores": [0], "running": 0, "served": 0,
         "rss": 2**20, "uss": 0, "pss": 0, "anon_private": 0, "model_pss": 0, "memory_sampled": False}
    ok = dict(w, pid=12, wid=1, uss=5 * 2**20, pss=6 * 2**20, anon_private=2**20, model_pss=2**20,
              memory_sampled=True)
    st = {"model": "m", "model_bytes": 2**20, "generation": 1, "queue": 0, "in_flight": 0, "draining": False,
          "router": {"pid": 1, "rss": 3 * 2**20}, "master": {"pid": 2, "model_rss": 0, "model_pss": 0},
          "workers": [w, ok], "memory_age_s": 0.5}
    from colibri_server.commands.status import format_status
    text = format_status(st)
    assert "0.0 MiB" not in text, text
    assert "not sampled yet for 1 of 2 workers" in text
    assert "add up to" not in text          # the weights' total needs every worker's share
    assert "5.0 MiB" in text and "6.0 MiB" in text
    from colibri_server.http.metrics import _ServerCollector
    fams = {f.name: f for f in _ServerCollector._families(st)}
    assert [s.labels["pid"] for s in fams["colibri_worker_uss_bytes"].samples] == ["12"]   # no 0 for 11
    assert [s.labels["pid"] for s in fams["colibri_worker_rss_bytes"].samples] == ["11", "12"]
