"""Security promises: CURVE key files, CurveServer validation, only allowed clients are served
(end to end, a real `colibri serve` on tcp://127.0.0.1), denials are logged, the
authenticator fails closed, ipc sockets are 0660 in a 0700 runtime directory."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import threading
import time

import pytest
import zmq
import zmq.auth
from server_harness import Server, wait_started

from colibri_server.client import Client, ColibriError, ColibriTimeout
from colibri_server.wire import security as S


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def keys(tmp_path):
    """server pair in keys/, one allowed client (its .key in allowed/), one unknown client."""
    d = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    spub, ssec = S.generate_keys(d, "server")
    S.generate_keys(d, "client-ok")
    os.makedirs(allowed)
    os.link(d / "client-ok.key", allowed / "client-ok.key")
    S.generate_keys(d, "client-bad")
    return argparse.Namespace(dir=d, allowed=allowed, server_pub=spub, server_sec=ssec,
                              ok=S.client_curve(spub, d / "client-ok.key_secret"),
                              bad=S.client_curve(spub, d / "client-bad.key_secret"))


# ---------------------------------------------------------------------------- key generation

def test_generate_keys_files_modes_and_content(tmp_path):
    pub, sec = S.generate_keys(tmp_path / "k", "server")
    assert (pub, sec) == (str(tmp_path / "k" / "server.key"), str(tmp_path / "k" / "server.key_secret"))
    assert mode(sec) == 0o600
    assert mode(pub) == 0o644
    assert mode(tmp_path / "k") == 0o700                  # created private
    assert sorted(os.listdir(tmp_path / "k")) == ["server.key", "server.key_secret"]   # no temp dir left
    p1, s1 = zmq.auth.load_certificate(pub)
    p2, s2 = zmq.auth.load_certificate(sec)
    assert s1 is None and p1 == p2 and zmq.curve_public(s2) == p1


def test_generate_keys_refuses_to_overwrite_unless_force(tmp_path):
    pub, sec = S.generate_keys(tmp_path, "client-a")
    before = open(sec).read()
    with pytest.raises(S.SecurityError, match="client-a.key.*exists.*--force"):
        S.generate_keys(tmp_path, "client-a")
    assert open(sec).read() == before
    os.unlink(pub)                                           # half a pair: still refused, nothing written
    with pytest.raises(S.SecurityError, match="client-a.key_secret exists"):
        S.generate_keys(tmp_path, "client-a")
    assert not os.path.exists(pub) and open(sec).read() == before
    S.generate_keys(tmp_path, "client-a", force=True)
    assert open(sec).read() != before and mode(sec) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["client-a.key", "client-a.key_secret"]


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 65])
def test_generate_keys_rejects_unsafe_names(tmp_path, name):
    with pytest.raises(S.SecurityError, match="key name"):
        S.generate_keys(tmp_path, name)
    assert os.listdir(tmp_path) == []


def _keys_cli(argv):
    p = argparse.ArgumentParser(prog="colibri")
    S.add_keys_parser(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    a.fn(a)


def test_keys_generate_cli(tmp_path, capsys):
    _keys_cli(["keys", "generate", "--dir", str(tmp_path), "--name", "server"])
    out = capsys.readouterr().out
    pub, _ = zmq.auth.load_certificate(tmp_path / "server.key")
    assert str(tmp_path / "server.key") in out and str(tmp_path / "server.key_secret") in out
    assert pub.decode() in out
    assert mode(tmp_path / "server.key_secret") == 0o600
    with pytest.raises(SystemExit) as e:                     # exists: error, exit 1
        _keys_cli(["keys", "generate", "--dir", str(tmp_path), "--name", "server"])
    assert e.value.code == 1 and "exists" in capsys.readouterr().err
    _keys_cli(["keys", "generate", "--dir", str(tmp_path), "--name", "server", "--force"])
    assert zmq.auth.load_certificate(tmp_path / "server.key")[0] != pub
    _keys_cli(["keys", "generate", "--dir", str(tmp_path), "--name", "client-alice"])
    assert "curve_allowed_keys" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:                     # only server | client-NAME
        _keys_cli(["keys", "generate", "--dir", str(tmp_path), "--name", "alice"])
    assert e.value.code == 2 and "client-NAME" in capsys.readouterr().err


# ---------------------------------------------------------------------------- CurveServer validation

def test_curve_server_validates_and_starts_nothing(keys, monkeypatch):
    """The constructor runs in the master before fork: files only, no thread, no context."""
    monkeypatch.setattr(zmq, "Context", None)
    monkeypatch.setattr(threading.Thread, "start", None)
    c = S.CurveServer(keys.server_sec, keys.allowed)
    assert c.public_key == zmq.auth.load_certificate(keys.server_pub)[0]
    assert list(c.allowed.values()) == [str(keys.allowed / "client-ok.key")]
    assert c.warnings == []


def test_missing_secret_file_is_named(keys):
    p = str(keys.dir / "nope.key_secret")
    with pytest.raises(S.SecurityError, match=f"{p}: file not found"):
        S.CurveServer(p, keys.allowed)


def test_public_key_given_as_secret_is_named(keys):
    with pytest.raises(S.SecurityError, match=f"{keys.server_pub}: holds no secret-key; it is a PUBLIC"):
        S.CurveServer(keys.server_pub, keys.allowed)


def test_garbage_and_mismatched_secret_files_are_named(keys, tmp_path):
    g = tmp_path / "garbage.key_secret"
    g.write_text("hello\n")
    with pytest.raises(S.SecurityError, match=f"{g}: not a ZeroMQ CURVE certificate"):
        S.CurveServer(g, keys.allowed)
    m = tmp_path / "mixed.key_secret"           # public key of one pair, secret of another
    pub = zmq.auth.load_certificate(keys.server_pub)[0].decode()
    sec = zmq.auth.load_certificate(keys.dir / "client-ok.key_secret")[1].decode()
    m.write_text(f'curve\n    public-key = "{pub}"\n    secret-key = "{sec}"\n')
    with pytest.raises(S.SecurityError, match=f"{m}: its public-key does not belong"):
        S.CurveServer(m, keys.allowed)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_secret_file_is_named(keys):
    os.chmod(keys.server_sec, 0)
    with pytest.raises(S.SecurityError, match=f"{keys.server_sec}: cannot be read"):
        S.CurveServer(keys.server_sec, keys.allowed)


def test_group_readable_secret_warns(keys, caplog):
    os.chmod(keys.server_sec, 0o640)
    with caplog.at_level(logging.WARNING, logger="colibri.security"):
        c = S.CurveServer(keys.server_sec, keys.allowed)
    assert any("group/world accessible" in w and "0640" in w for w in c.warnings)
    assert "chmod 600" in caplog.text


def test_allowed_dir_errors_are_named(keys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "client.key_secret").write_text("not a public certificate name\n")
    with pytest.raises(S.SecurityError, match=f"{empty} contains no \\*.key public certificate"):
        S.CurveServer(keys.server_sec, empty)
    with pytest.raises(S.SecurityError, match=f"{tmp_path / 'missing'}: not found"):
        S.CurveServer(keys.server_sec, tmp_path / "missing")
    with pytest.raises(S.SecurityError, match=f"{keys.server_pub}: not a directory"):
        S.CurveServer(keys.server_sec, keys.server_pub)
    bad = keys.allowed / "broken.key"
    bad.write_text("curve\n    public-key = \"short\"\n")
    with pytest.raises(S.SecurityError, match=f"{bad}: malformed public-key"):
        S.CurveServer(keys.server_sec, keys.allowed)


def test_secret_certificate_in_allowed_dir_warns(keys):
    os.link(keys.dir / "client-bad.key_secret", keys.allowed / "oops.key")
    c = S.CurveServer(keys.server_sec, keys.allowed)
    assert any("oops.key holds a SECRET key" in w for w in c.warnings)


def test_no_allowed_dir_means_any_client_with_a_warning(keys):
    c = S.CurveServer(keys.server_sec, "")
    assert c.allow_any and any("ANY client" in w for w in c.warnings)


# ---------------------------------------------------------------------------- CURVE in process

class Front:
    """A ROUTER with CurveServer applied, as the router does it, and DEALER clients."""

    def __init__(self, curve):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.curve = curve
        curve.apply_server(self.ctx, self.sock)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def served(self, curve_keys=None, wait=1.0) -> bool:
        c = self.ctx.socket(zmq.DEALER)
        c.linger = 0
        if curve_keys:
            c.curve_serverkey, c.curve_publickey, c.curve_secretkey = curve_keys
        c.sndtimeo = int(wait * 1000)      # a refused handshake can leave no pipe at all: send would block
        c.connect(f"tcp://127.0.0.1:{self.port}")
        try:
            c.send(b"hello")
        except zmq.Again:
            c.close()
            return False
        ok = bool(self.sock.poll(int(wait * 1000)))
        if ok:
            assert self.sock.recv_multipart()[1] == b"hello"
        c.close()
        return ok

    def close(self):
        self.sock.close()
        t0 = time.monotonic()
        self.ctx.term()          # must not hang: the authenticator thread ends on ETERM
        return time.monotonic() - t0


def test_only_allowed_keys_pass_and_denials_are_logged(keys, caplog):
    f = Front(S.CurveServer(keys.server_sec, keys.allowed))
    try:
        with caplog.at_level(logging.WARNING, logger="colibri.security"):
            assert f.served(keys.ok)
            assert not f.served(keys.bad)
            assert not f.served(None)
            time.sleep(0.3)
        bad_pub = keys.bad[1].decode()
        assert f"DENIED CURVE client from 127.0.0.1, public key {bad_pub}: Unknown key" in caplog.text
        assert "did not use CURVE" in caplog.text or "a client without CURVE" in caplog.text
        assert all(r.levelno == logging.WARNING for r in caplog.records if "DENIED" in r.getMessage())
        assert f.curve.denied >= 1
        assert f.served(keys.ok)
    finally:
        assert f.close() < 2.0


def test_reload_adds_and_revokes_keys(keys):
    f = Front(S.CurveServer(keys.server_sec, keys.allowed))
    try:
        assert not f.served(keys.bad)
        os.link(keys.dir / "client-bad.key", keys.allowed / "client-bad.key")
        os.unlink(keys.allowed / "client-ok.key")
        assert f.curve.reload() == 1
        assert f.served(keys.bad)
        assert not f.served(keys.ok)
        os.rename(keys.allowed, keys.allowed.with_name("gone"))   # missing dir: error, keys kept
        with pytest.raises(S.SecurityError, match="not found"):
            f.curve.reload()
        assert f.served(keys.bad)
    finally:
        f.close()


def test_fails_closed_without_the_authenticator(keys):
    """ZAP domain + ZMQ_ZAP_ENFORCE_DOMAIN: if the authenticator is gone, nobody gets in
    (plain libzmq would admit any client that knows the server public key)."""
    f = Front(S.CurveServer(keys.server_sec, keys.allowed))
    try:
        assert f.served(keys.ok)
        f.curve.stop()
        assert not f.served(keys.ok)
        assert not f.served(keys.bad)
    finally:
        f.close()


# ---------------------------------------------------------------------------- small helpers

@pytest.mark.parametrize("bind,curve,warn", [
    ("tcp://127.0.0.1:5555", False, None),
    ("tcp://localhost:5555", False, None),
    ("tcp://[::1]:5555", False, None),
    ("tcp://127.0.0.2:5555", False, None),
    ("tcp://0.0.0.0:5555", False, "ALL interfaces WITHOUT CURVE"),
    ("tcp://*:5555", False, "ALL interfaces WITHOUT CURVE"),
    ("tcp://10.1.2.3:5555", False, "10.1.2.3 (not loopback) WITHOUT CURVE"),
    ("tcp://eth0:5555", False, "eth0 (not loopback)"),
    ("tcp://0.0.0.0:5555", True, None),
    ("ipc://@colibri", False, "abstract-namespace"),
])
def test_check_bind_security(bind, curve, warn):
    w = S.check_bind_security(bind, curve)
    if warn is None:
        assert w == []
    else:
        assert len(w) == 1 and warn in w[0] and w[0].startswith("SECURITY WARNING")


def test_check_bind_security_ipc_directories(tmp_path):
    assert S.check_bind_security(f"ipc://{tmp_path}/s.sock", False) == []
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    assert "world-writable" in S.check_bind_security(f"ipc://{open_dir}/s.sock", False)[0]
    os.chmod(open_dir, 0o1777)                                # sticky, like /tmp
    assert S.check_bind_security(f"ipc://{open_dir}/s.sock", False) == []


# ---------------------------------------------------------------------------- real servers

@pytest.fixture(scope="module")
def model_path(built):
    return built("mixtral").colibri("f32")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_curve_end_to_end(model_path, keys, tmp_path):
    """A real `colibri serve` on tcp://127.0.0.1 with CURVE: the allowed client is served; an
    unknown key and a plain client get nothing (client-side timeout), the log names the
    attempts, and the server keeps serving and stops cleanly."""
    addr = f"tcp://127.0.0.1:{_free_port()}"
    srv = Server(model_path, tmp_path, workers=1, name="curve",
                 extra=["--bind", addr, "--curve-secret-key", keys.server_sec,
                        "--curve-allowed-keys", keys.allowed])
    try:
        def ready():
            if srv.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{srv.logs()}")
            try:
                with Client(addr, timeout=1.0, curve=keys.ok) as c:
                    return c.health()["workers_ready"] >= 1
            except ColibriError:
                return False
        wait_started(ready, "CURVE server", [srv.proc], srv.logs)
        with Client(addr, timeout=30, curve=keys.ok) as c:
            first = c.generate([5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(first.token_ids) == 4
        # the HTTP gateway as an allowed client: its key files (flags or COLIBRI_HTTP_CURVE_*_FILE)
        from colibri_server.http.config import curve_from_files, options_from_env
        opts = options_from_env({"COLIBRI_HTTP_CONNECT": addr,
                                 "COLIBRI_HTTP_CURVE_SERVER_KEY_FILE": str(keys.server_pub),
                                 "COLIBRI_HTTP_CURVE_SECRET_KEY_FILE": str(keys.dir / "client-ok.key_secret")})
        with Client(opts["connect"], timeout=10, curve=opts["curve"]) as c:
            assert c.health()["workers_ready"] >= 1
        with pytest.raises(ValueError, match="go together"):
            curve_from_files(keys.server_pub, None)

        server_key = zmq.auth.load_certificate(keys.server_pub)[0]
        for curve in (keys.bad, None, server_key):
            # an unknown client key; no CURVE at all; an ephemeral (so unknown) client key pair
            with Client(addr, timeout=2.0, curve=curve) as c:
                with pytest.raises(ColibriTimeout):
                    c.generate([5, 6, 7], max_tokens=4, ignore_eos=True)

        bad_pub = keys.bad[1].decode()
        srv.wait_for(lambda: f"public key {bad_pub}: Unknown key" in srv.logs(), timeout=10,
                     what="the denied key in the log")
        log = srv.logs()
        assert "colibri.security WARNING: DENIED CURVE client from 127.0.0.1" in log
        # the plain client: the server sees the mechanism mismatch, or the client seeing it first hang up
        assert "colibri.security WARNING: DENIED connection to" in log
        assert "did not use CURVE" in log or "a client without CURVE" in log
        assert "CURVE on: server public key" in log

        with Client(addr, timeout=30, curve=keys.ok) as c:      # still serving, same answer
            assert c.generate([5, 6, 7], max_tokens=4, ignore_eos=True).token_ids == first.token_ids
        t0 = time.monotonic()
        assert srv.stop() == 0
        assert time.monotonic() - t0 < 4.5, "the router hung at shutdown (the master kills it after 5 s)"
        log = srv.log_path.read_text()
        assert "router crashed" not in log and "Traceback" not in log, log
    finally:
        srv.stop()


def test_ipc_socket_0660_in_a_0700_runtime_dir(model_path, tmp_path):
    srv = Server(model_path, tmp_path, workers=1, name="ipc")
    try:
        srv.wait_ready(1)
        path = srv.addr[len("ipc://"):]
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert mode(path) == 0o660
        assert mode(srv.runtime) == 0o700
        backends = [p for p in os.listdir(srv.runtime) if p.startswith("backend-")]
        assert backends and all(mode(srv.runtime / p) == 0o600 for p in backends)
    finally:
        srv.stop()
