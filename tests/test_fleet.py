"""Worker hosts joining a head over tcp (issue 21, items 1-3), on loopback: a head with no workers of
its own (`colibri router`), worker hosts (`colibri serve --join`) admitted by CURVE key, load from 16
clients, a host's master killed, the host back, a host with another model file refused, a rollout
by USR1 on the head. The same over network namespaces with a link cut is test_fleet_netns.py."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time

import psutil
import pytest
from server_harness import READY_TIMEOUT, Server, wait_until

from colibri_server.client import Client, ColibriError
from colibri_server.wire.identity import file_identity
from colibri_server.wire.security import generate_keys

FAST = ("--timeout", "3", "--heartbeat-interval", "0.5", "--graceful-timeout", "10")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    head_pub, head_sec = generate_keys(d / "head", "head")
    allowed = d / "allowed"
    hosts = {}
    for name in ("a", "b", "c", "intruder"):
        pub, sec = generate_keys(d / name, f"host-{name}")
        hosts[name] = sec
        if name != "intruder":
            allowed.mkdir(exist_ok=True)
            shutil.copy(pub, allowed / os.path.basename(pub))
    return {"head_pub": head_pub, "head_sec": head_sec, "allowed": allowed, **hosts}


def _events(server, n=4000):
    """A server's log without its per-request lines: what a failed wait needs to show."""
    return "\n".join(x for x in server.logs().splitlines() if " done (" not in x)[-n:]


def _head(model, tmp_path, keys, port, name="head"):
    return Server(model, tmp_path, cmd="router", name=name,
                  extra=("--backend-bind", f"tcp://127.0.0.1:{port}", "--curve-secret-key", keys["head_sec"],
                         "--worker-allowed-keys", keys["allowed"], *FAST))


def _host(model, tmp_path, keys, port, name, key=None):
    return Server(model, tmp_path, workers=1, name=name,
                  extra=("--join", f"tcp://127.0.0.1:{port}", "--join-server-key", keys["head_pub"],
                         "--join-secret-key", keys[key or name.split("-")[-1]], "--slots", "8", *FAST))


def model_copies(tmp_path, model, who=("head", "a", "b")):
    """Each machine's own copy of the model file: {name: path}."""
    paths = {}
    for name in who:
        (tmp_path / name).mkdir()
        paths[name] = tmp_path / name / "model.colibri"
        shutil.copy(model, paths[name])
    return paths


def replace_everywhere(paths, model):
    """A new model file on every machine, written beside and renamed over (never in place)."""
    for path in paths.values():
        tmp = path.with_suffix(".tmp")
        shutil.copy(model, tmp)
        os.replace(tmp, path)


def _by_host(head):
    """host tag (hostname:master pid) -> the pids of its ready workers, from the head's status."""
    out = {}
    for w in head.stats()["workers"]:
        if w["state"] == "ready":
            out.setdefault(w["host"], set()).add(w["pid"])
    return out


class Load:
    """16 clients sending short requests until stopped; every outcome recorded."""

    def __init__(self, addr, clients=16, max_tokens=12):
        self.addr, self.max_tokens = addr, max_tokens
        self.done, self.errors, self.sent = [], [], 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def _run(self, i):
        with Client(self.addr, timeout=60.0) as c:
            k = 0
            while not self.stop.is_set():
                k += 1
                with self.lock:
                    self.sent += 1
                try:
                    r = c.generate(f"def f{i}_{k}(x):", max_tokens=self.max_tokens, temperature=0.0,
                                   ignore_eos=True)
                    with self.lock:
                        self.done.append(r)
                except ColibriError as e:
                    with self.lock:
                        self.errors.append(e)

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(90)
        assert not any(t.is_alive() for t in self.threads), "a client never got its answer"


def _kill_tree(pid):
    try:
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for q in [p, *kids]:
        try:
            q.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def test_two_hosts_serve_a_killed_host_loses_nothing_silently_and_rejoins(tmp_path, keys):
    from colibri_server.bundled import BUNDLED_MODEL
    port = _free_port()
    head = _head(BUNDLED_MODEL, tmp_path, keys, port)
    a = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-a")
    intruder = None
    try:
        head.wait_ready(workers=1, watch=[a])     # a alone first: b then finds the kernels compiled
        b = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-b")
        head.wait_ready(workers=2, watch=[a, b])
        # a host whose key the head does not list never gets in
        intruder = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-intruder")
        with Load(head.addr) as load:
            hosts = _by_host(head)
            assert len(hosts) == 2, hosts

            def both_serve():           # a host's first request may wait on a loaded machine: on answers, not a count
                served = {r.worker_pid for r in load.done}
                return len(load.done) >= 48 and all(pids & served for pids in hosts.values())
            wait_until(both_serve, READY_TIMEOUT, "48 answers, both hosts' workers among them",
                       lambda: f"{hosts} served {sorted({r.worker_pid for r in load.done})}")
            before = len(load.done)
            _kill_tree(a.pid)                      # host a's master and its worker, kill -9
            wait_until(lambda: len(_by_host(head)) == 1, 20, "the head drops the killed host",
                       lambda: head.logs()[-3000:])
            wait_until(lambda: len(load.done) >= before + 32, 60, "answers after the kill")
        st = head.stats()["counters"]
        lost = [e for e in load.errors if e.code == "worker_lost"]
        assert all(e.code == "worker_lost" for e in load.errors), [(e.code, str(e)) for e in load.errors]
        # the ledger: every request ended in exactly one answer, as the router counts them
        assert st.get("done", 0) == len(load.done) and load.sent == len(load.done) + len(load.errors)
        assert st.get("worker_lost", 0) == len(lost) and st.get("hosts_lost", 0) >= 1
        assert " lost: " in head.logs()     # (retried or worker_lost: the ledger above counts which)
        # the intruder's key was denied by name at the head; the intruder says it is not let in
        import zmq.auth
        pub, _ = zmq.auth.load_certificate(str(keys["intruder"]))
        wait_until(lambda: f"DENIED CURVE client from 127.0.0.1, public key {pub.decode()}" in head.logs(), 60,
                   "the head denies the intruder", lambda: head.logs()[-2000:])
        wait_until(lambda: "not accepted by the head" in intruder.logs(), 60, "the intruder's warning",
                   lambda: intruder.logs()[-2000:])
        assert len(_by_host(head)) == 1
        # host a comes back by itself when started again
        a.stop(5)
        a = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-a2", key="a")
        wait_until(lambda: len(_by_host(head)) == 2, 60, "host a rejoins", lambda: a.logs()[-3000:])
        with head.client() as c:
            assert c.generate("def g(x):", max_tokens=4, temperature=0.0).token_ids
    finally:
        for s in (intruder, a, locals().get("b"), head):
            if s is not None:
                s.stop(15)


@pytest.fixture(scope="module")
def two_models(built, model_b):
    return built("mixtral").colibri(), model_b


def test_another_model_is_refused_and_a_usr1_rollout_fails_no_request(tmp_path, keys, two_models):
    x, y = two_models
    assert file_identity(x) != file_identity(y)
    paths = model_copies(tmp_path, x)
    port = _free_port()
    head = _head(paths["head"], tmp_path, keys, port)
    a = _host(paths["a"], tmp_path, keys, port, "host-a")
    other = None
    try:
        head.wait_ready(workers=1, watch=[a])
        b = _host(paths["b"], tmp_path, keys, port, "host-b")
        head.wait_ready(workers=2, watch=[a, b])
        # a host with another model file: refused by name on both sides, never given work
        other = _host(y, tmp_path, keys, port, "host-c")
        # both sides log it, each in its own process: the host's line can come after the head's
        wait_until(lambda: "a different model file" in head.logs() and "refused by the head" in other.logs(), 120,
                   "the head refuses host c, and host c says so", lambda: other.logs()[-3000:])
        assert file_identity(y) in head.logs()
        assert len(_by_host(head)) == 2
        other.stop(10)
        other = None
        # the rollout: y replaces x on every machine (rename over), then USR1 to the head only
        with Load(head.addr, clients=8, max_tokens=16) as load:
            wait_until(lambda: len(load.done) >= 16, 60, "answers before the rollout")
            replace_everywhere(paths, y)
            head.signal(signal.SIGUSR1)
            want = file_identity(y)
            wait_until(lambda: head.stats()["generation"] == 2, 180, "the head commits generation 2",
                       lambda: head.logs()[-3000:] + a.logs()[-2000:])
            wait_until(lambda: {w["identity"] for w in head.stats()["workers"]} == {want}, 120,
                       "the old workers drained",
                       lambda: f"{head.stats()['workers']}\n{_events(head)}\n{_events(a)}\n{_events(b)}")
            n = len(load.done)
            wait_until(lambda: len(load.done) >= n + 16, 60, "answers after the rollout")
        assert not load.errors, [(e.code, str(e)) for e in load.errors]
        gens = {r.generation for r in load.done}
        assert gens == {1, 2}, gens
        for h in (a, b):
            assert "USR2" in h.logs() and "reloading" in h.logs()
    finally:
        for s in (other, a, locals().get("b"), head):
            if s is not None:
                s.stop(15)


def test_settings_name_what_a_fleet_needs(tmp_path):
    """The role's mistakes are refused before anything starts, each naming the settings."""
    from colibri_server.settings import SettingsError, load_settings
    cases = [
        ({"join": "tcp://10.1.2.3:5556"}, "join_server_key"),
        ({"backend_bind": "tcp://0.0.0.0:5556"}, "worker_allowed_keys"),
        ({"backend_bind": "ipc:///tmp/x.sock"}, "tcp://"),
        ({"join": "tcp://127.0.0.1:5556", "backend_bind": "tcp://127.0.0.1:5557"}, "belongs on the head"),
        ({"join": "tcp://127.0.0.1:5556", "http": "127.0.0.1:8000"}, "belongs on the head"),
        ({"join": "tcp://127.0.0.1:5556", "join_server_key": "/x.key"}, "go together"),
    ]
    for values, needle in cases:
        with pytest.raises(SettingsError) as e:
            load_settings(values, env={})
        assert needle in str(e.value), (values, str(e.value))


def test_a_head_without_backend_bind_halts_with_a_named_error(tmp_path):
    from colibri_server.bundled import BUNDLED_MODEL
    head = Server(BUNDLED_MODEL, tmp_path, cmd="router", name="lonely")
    try:
        assert head.proc.wait(60) == 4
        assert "--backend-bind" in head.logs() and "Traceback" not in head.logs()
    finally:
        head.stop(5)


def test_model_identity_follows_the_files_content(tmp_path, built, capsys):
    """The identity a head admits hosts by: equal for equal bytes (a copy), different for other
    weights or another dtype; `colibri inspect` prints it."""
    from colibri_server.bundled import BUNDLED_MODEL
    from colibri_server.cli import main
    copy = tmp_path / "copy.colibri"
    shutil.copy(BUNDLED_MODEL, copy)
    assert file_identity(copy) == file_identity(BUNDLED_MODEL)
    m = built("mixtral")
    ids = {file_identity(BUNDLED_MODEL), file_identity(m.colibri("f32")), file_identity(m.colibri("f16"))}
    assert len(ids) == 3
    main(["inspect", str(copy)])
    assert f"identity  {file_identity(BUNDLED_MODEL)}" in capsys.readouterr().out


def test_a_plain_serve_takes_worker_hosts_beside_its_own_workers(tmp_path, keys):
    """`colibri serve --backend-bind`: its own worker and a worker host's, both served by its router."""
    from colibri_server.bundled import BUNDLED_MODEL
    port = _free_port()
    srv = Server(BUNDLED_MODEL, tmp_path, workers=1, name="serve",
                 extra=("--backend-bind", f"tcp://127.0.0.1:{port}", "--curve-secret-key", keys["head_sec"],
                        "--worker-allowed-keys", keys["allowed"], "--slots", "4", *FAST))
    host = None      # (4 slots here, 8 there: 8 clients need both; the router fills the most free first)
    try:
        srv.wait_ready(workers=1)
        host = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-a")
        srv.wait_ready(workers=2, watch=[host])
        ws = srv.stats()["workers"]
        assert sorted(w["remote"] for w in ws) == [False, True]
        # issue 38 item 11: the host's ready line names the head it joined, not an address it never listens on
        ready = wait_until(lambda: [ln for ln in host.logs().splitlines() if "ready:" in ln], 30, "the host's ready line")
        assert f"tcp://127.0.0.1:{port}" in ready[0] and host.addr not in ready[0], ready
        with Load(srv.addr, clients=8) as load:
            wait_until(lambda: len({r.worker_pid for r in load.done}) == 2, 60, "both workers answer")
        assert not load.errors
    finally:
        for s in (host, srv):
            if s is not None:
                s.stop(15)


def test_a_hosts_own_reloads_drain_its_old_workers(tmp_path, keys):
    """A worker host's HUP (same file: the head sees no new model and never retires anything) still
    leaves one worker per slot at the head: the old generation drains at the host's commit."""
    from colibri_server.bundled import BUNDLED_MODEL
    port = _free_port()
    head = _head(BUNDLED_MODEL, tmp_path, keys, port)
    host = None
    try:
        host = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-a")
        head.wait_ready(workers=1, watch=[host])
        for n in (2, 3):
            first = {w["pid"] for w in head.stats()["workers"]}
            host.signal(signal.SIGHUP)
            wait_until(lambda: f"generation {n} serving" in host.logs(), 60, f"the host's generation {n}")
            wait_until(lambda: len(head.stats()["workers"]) == 1 and
                       not first & {w["pid"] for w in head.stats()["workers"]}, 30,
                       "the old worker drained", lambda: host.logs()[-2000:])
        with head.client() as c:
            assert c.generate("def g(x):", max_tokens=4, temperature=0.0).token_ids
    finally:
        for s in (host, head):
            if s is not None:
                s.stop(15)


def test_term_on_a_head_lets_the_streams_on_its_hosts_finish(tmp_path, keys):
    """TERM on a head drains as a master does: it has no workers of its own, and the streams in flight
    on its hosts' workers run to their end (within graceful_timeout) before its router exits; then it
    exits 0. The host's worker is paused across the TERM so the streams are surely mid-way."""
    from colibri_server.bundled import BUNDLED_MODEL
    port = _free_port()
    head = _head(BUNDLED_MODEL, tmp_path, keys, port)
    host = None
    n, M = 3, 120
    started, results, errors = threading.Semaphore(0), [], []

    def one(i):
        try:
            with Client(head.addr, timeout=60.0) as c:
                s = c.stream(f"def h{i}(x):", max_tokens=M, temperature=0.0, ignore_eos=True)
                chunks = [next(s)]
                started.release()
                chunks += list(s)
                results.append((sum(len(ch.token_ids) for ch in chunks), chunks[-1].finish_reason))
        except ColibriError as e:
            errors.append(e)
            started.release()
    try:
        host = _host(BUNDLED_MODEL, tmp_path, keys, port, "host-a")
        head.wait_ready(workers=1, watch=[host])
        (wpid,) = head.worker_pids()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for _ in range(n):
            assert started.acquire(timeout=60)
        os.kill(wpid, signal.SIGSTOP)
        try:
            head.signal(signal.SIGTERM)
            wait_until(lambda: "graceful stop" in head.logs(), 10, "the head's graceful stop")
            time.sleep(0.5)
        finally:
            os.kill(wpid, signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert not errors, [(e.code, str(e)) for e in errors]
        assert sorted(results) == [(M, "length")] * n, results
        assert head.proc.wait(30) == 0, head.logs()[-2000:]
    finally:
        for s in (host, head):
            if s is not None:
                s.stop(15)
