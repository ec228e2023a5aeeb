"""Issue 20's control-plane guards: the router's loop stays fast whatever one client sends,
the gateway outlives idle connections, removed CURVE keys stop working, user text never
becomes control tokens, clients and the CLI fail fast with one line naming the thing."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq
from server_harness import Server, wait_started

from colibri_server.client import Client, ColibriError
from colibri_server.wire import protocol as P


@pytest.fixture(scope="module")
def model_path(built):
    return built("mixtral").colibri("f32")


@pytest.fixture(scope="module")
def live(model_path, tmp_path_factory):
    s = Server(model_path, tmp_path_factory.mktemp("guards"), workers=1, extra=("--control-rate", "20"))
    try:
        s.wait_ready(1)
        yield s
    finally:
        s.stop()


def _dealer(addr):
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(addr)
    return d


# ---------------------------------------------------------------------------- item 7: the router's loop


def test_stats_never_reads_smaps_in_the_router_loop(monkeypatch, model_path):
    """stats answers from a cache filled by a thread: a slow smaps read costs the loop nothing."""
    from colibri_server.host import memory
    from colibri_server.router.loop import Router, W
    from colibri_server.settings import defaults

    def slow(*a, **k):
        time.sleep(0.5)
        return {"rss": 1, "pss": 1}
    monkeypatch.setattr(memory, "file_mapping", slow)
    r = Router(frontend="inproc://x", backend="inproc://y", pipe_fd=-1, settings=defaults(), generation=1,
               model_path=str(model_path))
    r.ppid = os.getppid()
    r.workers[b"w"] = W(b"w", {"pid": os.getpid(), "wid": 1}, time.monotonic())
    t0 = time.monotonic()
    for _ in range(3):
        st = r.stats()
    assert time.monotonic() - t0 < 0.2, "stats waited for smaps"
    assert st["workers"][0]["pid"] == os.getpid()
    deadline = time.monotonic() + 5
    while r.control_requests.memory.get(os.getpid())["model_rss"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.stats()["workers"][0]["model_rss"] == 1     # the figures arrive, from the thread


def test_tokenize_has_a_size_guard_and_control_requests_are_rate_limited(live):
    with live.client(10) as c:
        t0 = time.monotonic()
        with pytest.raises(ColibriError) as e:
            c.tokenize("a" * (1 << 20))
        assert e.value.code == "too_large" and time.monotonic() - t0 < 1.0
    # one client pipelines 300 stats; another's generate is not held up behind them
    d = _dealer(live.addr)
    try:
        for i in range(300):
            d.send_multipart(P.frames({"type": "stats", "id": i}))
        with live.client(10) as c:
            t0 = time.monotonic()
            c.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
            took = time.monotonic() - t0
        codes = []
        while len(codes) < 300 and d.poll(5000):
            body = P.unpack(d.recv_multipart()[1], max_body=64 << 20)
            codes.append(body.get("code", body["type"]))
        assert len(codes) == 300
        assert codes.count("overloaded") >= 200, codes[:60]     # burst 2 x control_rate, then refused
        assert took < 2.0
    finally:
        d.close()


# ---------------------------------------------------------------------------- item 11: special tokens


def _specials(model_path):
    from colibri_server.model import format as fmt
    from colibri_server.model.tokenizer import Tokenizer
    cf = fmt.ColibriFile.open(str(model_path))
    tok = Tokenizer.from_json(cf.tokenizer_json)
    cf.close()
    added = {t.content: i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    return tok, added


def test_user_text_never_yields_special_tokens(live, model_path):
    tok, added = _specials(model_path)
    assert added, "the test model's tokenizer has no special tokens"
    text = "a" + "b".join(added) + "c"          # every special-token string, inside user text
    with live.client(10) as c:
        ids = c.tokenize(text, add_special_tokens=False)
        assert not set(ids) & set(added.values()), ids
        r = c.generate(text, max_tokens=1, ignore_eos=True)
        assert r.usage["prompt_tokens"] == len(tok.encode(text))
        # a chat template's own text still yields its control tokens, the content between does not
        first = next(iter(added))
        ids = c.tokenize([(first, True), (text, False), (first, True)], add_special_tokens=False)
        assert ids[0] == ids[-1] == added[first] and not set(ids[1:-1]) & set(added.values())
    assert not set(tok.encode(text)) - {tok.bos_token_id} & set(added.values())


def test_chat_content_is_kept_apart_from_the_template_control_tokens():
    from colibri_server.http.template import ModelInfo, render_chat_segments
    info = ModelInfo("m", "/p", 1, chat_template="{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    segs, special = render_chat_segments(info, [{"role": "user", "content": "a</s>b<s>"}])
    assert segs == [("<s>", True), ("a</s>b<s>", False), ("</s>", True)] and special is False


# ---------------------------------------------------------------------------- item 10: CURVE keys removed on HUP


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_curve_key_removed_on_hup_stops_working_on_its_open_connection(model_path, tmp_path):
    import signal

    from colibri_server.wire import security as S
    d, allowed = tmp_path / "keys", tmp_path / "allowed"
    spub, ssec = S.generate_keys(d, "server")
    S.generate_keys(d, "a")
    S.generate_keys(d, "b")
    os.makedirs(allowed)
    for n in ("a", "b"):
        os.link(d / f"{n}.key", allowed / f"{n}.key")
    a, b = S.client_curve(spub, d / "a.key_secret"), S.client_curve(spub, d / "b.key_secret")
    addr = f"tcp://127.0.0.1:{_free_port()}"
    srv = Server(model_path, tmp_path, workers=1, name="curve",
                 extra=["--bind", addr, "--curve-secret-key", ssec, "--curve-allowed-keys", allowed])
    try:
        def ready():
            if srv.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{srv.logs()}")
            try:
                with Client(addr, timeout=1.0, curve=a) as c:
                    return c.health()["workers_ready"] >= 1
            except ColibriError:
                return False
        wait_started(ready, "CURVE server", [srv.proc], srv.logs)
        with Client(addr, timeout=10, curve=a) as ca, Client(addr, timeout=10, curve=b) as cb:
            assert len(ca.generate([5, 6, 7], max_tokens=2, ignore_eos=True).token_ids) == 2
            assert len(cb.generate([5, 6, 7], max_tokens=2, ignore_eos=True).token_ids) == 2
            os.unlink(allowed / "a.key")
            srv.signal(signal.SIGHUP)
            deadline, code = time.monotonic() + 30, None
            while time.monotonic() < deadline:
                try:
                    ca.health()
                except ColibriError as e:
                    code = e.code
                    if code == "unauthorized":
                        break
                time.sleep(0.2)
            assert code == "unauthorized", "the removed key still works on its open connection"
            with pytest.raises(ColibriError) as e:
                ca.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
            assert e.value.code == "unauthorized"
            assert cb.health()["status"] in ("ok", "starting")      # the key that stays keeps working
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- item 14: clients fail fast


def test_client_of_a_server_that_is_not_running_fails_fast_naming_address_and_cause(tmp_path):
    from colibri_server.client import Unreachable
    port = _free_port()
    for addr, cause in ((f"tcp://127.0.0.1:{port}", "connection refused"),
                        (f"ipc://{tmp_path}/none.sock", "does not exist")):
        t0 = time.monotonic()
        with Client(addr, timeout=60) as c, pytest.raises(Unreachable) as e:
            c.generate("hello", max_tokens=2)
        assert time.monotonic() - t0 < 6, "waited for the whole timeout"
        assert addr in e.value.message and cause in e.value.message, e.value.message

    async def agen():
        from colibri_server.client import AsyncClient
        c = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=60)
        try:
            await c.generate("hello", max_tokens=2)
        finally:
            await c.close()
    import asyncio
    t0 = time.monotonic()
    with pytest.raises(Unreachable):
        asyncio.run(agen())
    assert time.monotonic() - t0 < 6


def test_gateway_to_a_server_that_is_not_running_answers_503_fast():
    import io
    import json

    from colibri_server.http import create_app
    addr = f"tcp://127.0.0.1:{_free_port()}"
    app = create_app(addr)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    env = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/completions", "CONTENT_LENGTH": str(len(body)),
           "wsgi.input": io.BytesIO(body)}
    got = {}
    t0 = time.monotonic()
    out = b"".join(app(env, lambda status, headers: got.update(status=status)))
    assert time.monotonic() - t0 < 10
    assert got["status"].startswith("503") and addr.encode() in out, (got, out)


# ---------------------------------------------------------------------------- item 13: CLI mistakes


def _cli(*args, timeout=120):
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def _one_line(err, *names):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in names:
        assert str(n) in lines[0], (n, err)


@pytest.mark.parametrize("kind", ["text", "directory", "empty", "pidfile"])
def test_serve_mistakes_are_one_line_and_exit_4(tmp_path, model_path, kind):
    model = {"text": tmp_path / "notes.txt", "directory": tmp_path, "empty": tmp_path / "e.colibri",
             "pidfile": model_path}[kind]
    if kind == "text":
        model.write_text("hello\n")
    if kind == "empty":
        model.write_bytes(b"")
    extra = ["--pidfile", tmp_path / "missing" / "colibri.pid"] if kind == "pidfile" else []
    code, _, err = _cli("serve", "--model", model, "--bind", f"ipc://{tmp_path}/s.sock", "--runtime-dir",
                        tmp_path / "run", "--pin", "none", *extra)
    assert code == 4, err
    _one_line(err, "missing" if kind == "pidfile" else model)


def test_demo_generate_and_convert_mistakes_are_one_line(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    code, _, err = _cli("demo", "--model", bad)
    assert code == 4
    _one_line(err, bad)
    code, _, err = _cli("generate", "--connect", "localhost:5555", "hi")
    assert code == 2
    _one_line(err, "localhost:5555")
    code, _, err = _cli("convert", tmp_path, tmp_path / "missing" / "m.colibri")
    assert code == 1
    _one_line(err, tmp_path / "missing")


def test_convert_onto_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    from colibri_server import cli
    from colibri_server.model import convert as conv

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(conv, "convert", full)
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(tmp_path), str(tmp_path / "m.colibri")])
    assert e.value.code == 1
    _one_line(capsys.readouterr().err, "m.colibri", "No space left")


def test_integer_beyond_64_bits_is_a_400_not_a_502(live):
    import io
    import json

    from colibri_server.http import create_app
    app = create_app(live.addr)
    for body in ({"prompt": [5, 2 ** 64], "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 70}):
        raw = json.dumps(body).encode()
        env = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/completions", "CONTENT_LENGTH": str(len(raw)),
               "wsgi.input": io.BytesIO(raw)}
        got = {}
        out = b"".join(app(env, lambda status, headers: got.update(status=status)))
        assert got["status"].startswith("400"), (got, out)


# ---------------------------------------------------------------------------- item 15: pinning


def test_each_worker_keeps_a_core_of_its_own_after_hup_and_ttin(model_path, tmp_path):
    import signal

    from colibri_server.host.pinning import current_affinity
    ncpu = len(current_affinity() or [])
    if ncpu < 2:
        pytest.skip("needs 2 allowed CPUs")
    s = Server(model_path, tmp_path, workers=1, extra=("--pin", "cores", "--threads-per-worker", "1"), name="pin")
    try:
        s.wait_ready(1)

        def cores(n, generation=None):
            ws = [w for w in s.stats()["workers"] if w["state"] == "ready"
                  and (generation is None or w["generation"] == generation)]
            return [tuple(w["cores"]) for w in ws] if len(ws) == n else None
        s.signal(signal.SIGHUP)                     # generation 2 replaces the worker
        s.wait_for(lambda: cores(1, 2) and len(s.stats()["workers"]) == 1, timeout=60, what="HUP done")
        for n in range(2, ncpu + 2):                # TTIN up to one worker more than the CPUs
            s.signal(signal.SIGTTIN)
            got = s.wait_for(lambda: cores(n), timeout=60, what=f"{n} workers")
            if n <= ncpu:
                assert len(set(got)) == n, f"two workers share a core: {got}"
        s.wait_for(lambda: "pinning: " in s.logs() and "share CPUs" in s.logs(), timeout=10,
                   what="the oversubscription warning")
    finally:
        s.stop()


# ---------------------------------------------------------------------------- item 16: help, version, compile notice


def _subparsers(p, path=()):
    import argparse
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield path + (name,), sp
                yield from _subparsers(sp, path + (name,))


def test_every_subcommand_has_a_description_and_every_option_help_and_its_default():
    import argparse

    from colibri_server.cli import build_parser
    p = build_parser()
    seen = 0
    for path, sp in _subparsers(p):
        assert sp.description, f"colibri {' '.join(path)} --help has no description"
        text = sp.format_help()
        for a in sp._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            seen += 1
            assert a.help, f"colibri {' '.join(path)}: {a.option_strings or a.dest} has no help"
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS):
                assert "default" in sp._get_formatter()._get_help_string(a).lower() or "default" in a.help, \
                    f"colibri {' '.join(path)} {a.option_strings[0]}: no default shown"
        if any(a.option_strings and a.default not in (None, False, argparse.SUPPRESS) for a in sp._actions
               if not isinstance(a, argparse._HelpAction)):
            assert "default" in text
    assert seen > 60


def test_version(capsys):
    from colibri_server import __version__
    from colibri_server.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_a_slow_kernel_compile_is_announced_and_not_counted(model_path, monkeypatch):
    from colibri_server.model import Model
    m = Model.open(str(model_path))
    said = []
    m.warm_up(announce=said.append)                  # compiles or loads the cache: quick or announced
    said.clear()
    assert m.warm_up(announce=said.append) < 1.0 and said == []     # warm: nothing to say
    real = Model.generate

    def slow(self, *a, **k):                         # as a first run's compile
        time.sleep(0.6)
        return real(self, *a, **k)
    monkeypatch.setattr(Model, "generate", slow)
    t0 = time.monotonic()
    m.warm_up(announce=lambda msg: said.append((msg, time.monotonic() - t0)), after=0.2)
    assert len(said) == 1 and "compiling" in said[0][0] and said[0][1] < 0.5    # said while it went on
    m.close()


def test_run_reports_tok_s_without_the_compile(model_path):
    code, out, err = _cli("run", "--model", model_path, "--max-tokens", "4", "--ignore-eos", "--token-ids", "5,6,7")
    assert code == 0, err
    assert "kernels ready in" in err and "not counted" in err
