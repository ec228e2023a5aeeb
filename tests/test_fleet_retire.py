"""A head's retirement of a model file is a state, not a message sent once (no servers started here;
test_fleet.py runs the rollout end to end).

The race these pin down: at a rollout the head commits as soon as it has accepted each host's new
workers, and retires the old file, while a host's own master may not have committed its reload yet.
The host's old workers drain on RETIRE; had their master replaced them (they were still its serving
generation), the replacement would announce the old file to the head after the one RETIRE was sent,
be accepted and never drain: the head would show a worker of the old file for ever."""
from __future__ import annotations

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
                        retired=retired, counters={}, send=lambda ident, kind, body, sock=None: sent.append(kind),
                        to_master=to_master.append, remove_worker=lambda ident, why: workers.pop(ident, None))
    return hosts, workers, sent, to_master


def _ready(hosts, workers, identity, serving):
    w = hosts.ready(b"host-a-7", {"pid": 7, "slots": 1, "identity": identity, "host": "a:1"}, 0.0, serving)
    workers[w.ident] = w
    return w


def test_a_worker_of_a_retired_generations_file_is_told_to_drain_when_it_announces_itself():
    gens = {1: SimpleNamespace(identity="old"), 2: SimpleNamespace(identity="new")}
    hosts, workers, sent, to_master = _remote_hosts(gens, retired={1})
    w = _ready(hosts, workers, "old", serving=2)
    assert w.generation == 1 and sent == [b"RETIRE"] and w.state == "draining"
    # the fleet the master waits on does not count it: the host runs the new file or nothing
    assert to_master[-1] == {"op": "fleet", "hosts": {}}
    # the serving generation's file, and an old one not yet retired, are taken as they come
    for retired, identity in (({1}, "new"), (set(), "old")):
        hosts, workers, sent, _ = _remote_hosts(gens, retired)
        w = _ready(hosts, workers, identity, serving=2)
        assert sent == [] and w.state == "ready", (retired, identity)


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
