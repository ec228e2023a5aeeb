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
    """No prefix of a flag is taken for the flag (`--max-token 5` used to run with --max-tokens 5),
    and the subcommand owning the arguments reports them (its usage, not the top-level one)."""
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
