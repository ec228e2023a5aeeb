"""A head's retirement of a model file is a state, not a message sent once (no servers started here;
test_fleet.py runs the rollout end to end).

The race these pin down: at a rollout the head commits as soon as it has accepted each host's new
workers, and retires the old file, while a host's own master may not have committed its reload yet.
The host's old workers drain on RETIRE; had their master replaced them (they were still its serving
generation), the replacement would announce the old file to the head after the one RETIRE was sent,
be accepted and never drain: the head would show a worker of the old file for ever."""
from __future__ import annotations

import collections
import os
import threading
from types import SimpleNamespace

import msgpack
import zmq

from colibri_server.master.generations import Reloads
from colibri_server.router.remote import RemoteHosts
from colibri_server.worker import EXIT_RETIRED, Worker


def _remote_hosts(gens, retired):
    sent, to_master = [], []
    workers = {}
    hosts = RemoteHosts(settings=SimpleNamespace(timeout=3.0), curve=None, workers=workers, gens=gens,
                        retired=retired, counters=collections.Counter(),
                        send=lambda ident, kind, body, sock=None: sent.append((ident, kind)),
                        to_master=to_master.append, remove_worker=lambda ident, why: workers.pop(ident, None))
    return hosts, workers, sent, to_master


def _ready(hosts, identity, host, pid, serving=2):
    return hosts.ready(f"{host}-{pid}".encode(), {"pid": pid, "slots": 1, "identity": identity, "host": host},
                       0.0, serving)


def test_a_retired_files_workers_drain_on_hosts_that_run_the_serving_file_whenever_they_appear():
    gens = {1: SimpleNamespace(identity="old", model_path="m"), 2: SimpleNamespace(identity="new", model_path="m")}
    retired = set()
    hosts, workers, sent, to_master = _remote_hosts(gens, retired)
    a_old, a_new = _ready(hosts, "old", "a", 1), _ready(hosts, "new", "a", 2)
    b_old = _ready(hosts, "old", "b", 3)
    # the master's fleet view counts the worker that just announced itself: host a runs both files
    assert to_master[-1] == {"op": "fleet", "hosts": {"a": ["new", "old"], "b": ["old"]}}
    assert sent == [] and {w.state for w in workers.values()} == {"ready"}      # generation 1 not retired yet
    retired.add(1)
    hosts.retire(1, 2)
    assert sent == [(b"a-1", b"RETIRE")] and a_old.state == "draining"
    assert b_old.state == "ready"           # host b runs only the old file: its master would replace what drains
    # a replacement of the old file appearing on host a after the RETIRE: told at once, not counted
    a_again = _ready(hosts, "old", "a", 4)
    assert sent[-1] == (b"a-4", b"RETIRE") and a_again.state == "draining"
    assert to_master[-1]["hosts"]["a"] == ["new"]
    # once generation 1 is forgotten: on host a it drains without joining, on a host without the new file it is refused
    del gens[1]
    retired.discard(1)
    assert _ready(hosts, "old", "a", 5) is None and sent[-1] == (b"a-5", b"RETIRE")
    assert _ready(hosts, "old", "c", 6) is None and sent[-1] == (b"c-6", b"REFUSE")
    assert a_new.state == "ready" and sum(k == b"RETIRE" for _, k in sent) == 3
    # host b rolls late: its worker of the forgotten file drains once the new one is there
    _ready(hosts, "new", "b", 7)
    assert sent[-1] == (b"b-3", b"RETIRE") and b_old.state == "draining"


def _reloads(generation, reloading):
    r = Reloads(SimpleNamespace(), workers={}, fleet=None, to_router=None, notify=None, spawn_worker=None,
                kill=None, open_model=None)
    r.generation, r.reloading = generation, reloading
    return r


def test_a_hosts_master_does_not_replace_workers_the_head_retired_while_its_reload_comes_up():
    r = _reloads(1, None)
    assert r.staffed() == [1]
    r.reloading = 2
    assert r.staffed() == [1, 2]
    r.retired_by_head(1, 1234)
    assert r.staffed() == [2]                  # the head serves the new file: no replacement of the old
    r.generation, r.reloading = 2, None        # committed
    assert r.staffed() == [2]
    # with no reload under way the serving generation keeps its workers, retired or not: the host
    # is then one the head committed without, and its replacements say by name that they are refused
    r = _reloads(1, None)
    r.retired_by_head(1, 1234)
    assert r.staffed() == [1]


class _Engine:
    def stats(self):
        return {}

    def cancel(self, rid):
        pass


def _worker(ctx, addr):
    model = SimpleNamespace(path="m.colibri", file=SimpleNamespace(identity="old"))
    settings = SimpleNamespace(heartbeat_interval=0.05, timeout=3.0, slots=1)
    w = Worker(wid=1, slot=0, generation=1, model=model, settings=settings, backend=addr, cpus=None,
               heartbeats=SimpleNamespace(beat=lambda slot: None, joined=lambda slot: True,
                                          set_joined=lambda slot, v: None), host="a:1")
    w.pid, w.ppid, w.engine = os.getpid(), os.getppid(), _Engine()
    w.sock = ctx.socket(zmq.DEALER)
    w.sock.connect(addr)
    return w


def _run_until_bye(router, w, send):
    """Run the worker's loop in a thread; once it announced itself, send it `send`; -> (exit code, kinds)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("code", w.run()), daemon=True)
    t.start()
    kinds = []
    assert router.poll(10_000)
    ident, kind, _ = router.recv_multipart()
    kinds.append(kind)
    send(ident)
    while b"BYE" not in kinds:
        assert router.poll(10_000), kinds
        kinds.append(router.recv_multipart()[1])
    t.join(10)
    return out["code"], kinds


def test_a_worker_drained_by_the_heads_retire_exits_so_that_its_master_knows():
    ctx = zmq.Context()
    try:
        for i, (send, code) in enumerate((
                (lambda r, ident: r.send_multipart([ident, b"RETIRE", msgpack.packb({})]), EXIT_RETIRED),
                (None, 0))):        # SIGTERM's drain (or max_requests): an ordinary exit
            router = ctx.socket(zmq.ROUTER)
            addr = f"inproc://retire-{i}"
            router.bind(addr)
            w = _worker(ctx, addr)
            got, kinds = _run_until_bye(router, w, (lambda ident: send(router, ident)) if send
                                        else (lambda ident: w._on_term()))
            assert got == code and kinds[0] == b"READY", (got, kinds)
    finally:
        ctx.destroy(linger=0)
