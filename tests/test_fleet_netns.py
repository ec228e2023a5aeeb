"""Issue 21's fleet on three (four) hosts: network namespaces this test makes (veth pairs, its own
10.78.k.0/24 addresses, nothing leaves them): a head with no workers (`colibri router`), worker hosts
a and b joining it over tcp with CURVE, 16 clients. Host a's master is SIGKILLed and started again,
host b's link is cut past the timeout and mended, a host c with another model file is refused, and
a USR1 on the head rolls every host to a new file: every request ends done or with an explicit
error, the router's counts equal the clients', and the rollout fails none.

Marker `netns` (root and iproute2; skips with the reason otherwise): pytest -m netns -n 0 tests/test_fleet_netns.py
"""
from __future__ import annotations

import os
import signal
import time

import pytest
from netns_hosts import Hosts
from server_harness import Server, wait_until
from test_fleet import FAST, Load, _by_host, keys, model_copies, replace_everywhere  # noqa: F401  (keys: the fixture)

from colibri_server.wire.identity import file_identity

pytestmark = pytest.mark.netns
PORT = 5556


def _host(net, model, tmp_path, keys, name, key=None):
    ns = name.split("-")[0]
    return Server(model, tmp_path, workers=1, name=name, prefix=net.run(ns),
                  extra=("--join", f"tcp://{net.head_address(ns)}:{PORT}", "--join-server-key", keys["head_pub"],
                         "--join-secret-key", keys[key or ns], "--slots", "8", *FAST))


def test_three_hosts_in_namespaces(tmp_path, keys, built, model_b):
    why = Hosts.problem()
    if why:
        pytest.skip(f"cannot make network namespaces here: {why}")
    x, y = built("mixtral").colibri(), model_b
    paths = model_copies(tmp_path, x)
    servers = []
    with Hosts("cfnt", ["a", "b", "c"], subnet=78) as net:
        try:
            # the head binds its backend on every address of its namespace (off loopback: CURVE and
            # worker_allowed_keys are required); clients reach it on an ipc socket
            head = Server(paths["head"], tmp_path, cmd="router", name="head", prefix=net.run("head"),
                          extra=("--backend-bind", f"tcp://0.0.0.0:{PORT}", "--curve-secret-key", keys["head_sec"],
                                 "--worker-allowed-keys", keys["allowed"], *FAST))
            servers.append(head)
            a = _host(net, paths["a"], tmp_path, keys, "a")
            servers.append(a)
            head.wait_ready(workers=1, watch=[a])
            b = _host(net, paths["b"], tmp_path, keys, "b")
            servers.append(b)
            head.wait_ready(workers=2, watch=[a, b])
            with Load(head.addr, clients=16) as load:
                wait_until(lambda: len(load.done) >= 64, 120, "64 answers")
                hosts = _by_host(head)
                assert len(hosts) == 2 and all(p & {r.worker_pid for r in load.done} for p in hosts.values())

                # SIGKILL of host a's master; its worker sees its parent gone and leaves
                os.kill(a.pid, signal.SIGKILL)
                wait_until(lambda: len(_by_host(head)) == 1, 30, "the head drops host a",
                           lambda: head.logs()[-3000:])
                a = _host(net, paths["a"], tmp_path, keys, "a-again", key="a")
                servers.append(a)
                wait_until(lambda: len(_by_host(head)) == 2, 120, "host a rejoins", lambda: a.logs()[-3000:])

                # host b's link cut past the timeout (3 s), then mended: dropped as silent, then back
                n = len(load.done)
                net.cut("b")
                wait_until(lambda: "silent for" in head.logs(), 30, "the head drops host b as silent",
                           lambda: head.logs()[-3000:])
                time.sleep(1.0)
                net.mend("b")
                wait_until(lambda: len(_by_host(head)) == 2, 60, "host b rejoins after the cut",
                           lambda: head.logs()[-3000:] + b.logs()[-2000:])
                wait_until(lambda: len(load.done) >= n + 32, 120, "answers after the cut")

                # host c runs another model file: refused by name on both sides
                c = _host(net, y, tmp_path, keys, "c")
                servers.append(c)
                wait_until(lambda: "a different model file" in head.logs(), 240, "the head refuses host c",
                           lambda: c.logs()[-3000:])
                assert "refused by the head" in c.logs() and len(_by_host(head)) == 2
            st = head.stats()["counters"]
            assert all(e.code == "worker_lost" for e in load.errors), [(e.code, str(e)) for e in load.errors]
            assert st.get("done", 0) == len(load.done) and load.sent == len(load.done) + len(load.errors)
            assert st.get("worker_lost", 0) == len(load.errors) and st.get("hosts_lost", 0) >= 2
            assert st.get("hosts_refused", 0) >= 1

            # a USR1 rollout of the head under load: y on every host, no request fails
            with Load(head.addr, clients=16, max_tokens=16) as roll:
                wait_until(lambda: len(roll.done) >= 16, 120, "answers before the rollout")
                replace_everywhere(paths, y)
                head.signal(signal.SIGUSR1)
                want = file_identity(y)
                wait_until(lambda: head.stats()["generation"] == 2, 240, "the head commits the new file",
                           lambda: head.logs()[-3000:])
                # host c (already on y) is admitted once the head serves y
                wait_until(lambda: {w["identity"] for w in head.stats()["workers"]} == {want}
                           and len(_by_host(head)) == 3, 120, "old workers drained, c admitted",
                           lambda: head.logs()[-3000:])
                n = len(roll.done)
                wait_until(lambda: len(roll.done) >= n + 16, 60, "answers after the rollout")
            assert not roll.errors, [(e.code, str(e)) for e in roll.errors]
            assert {r.generation for r in roll.done} == {1, 2}
        finally:
            for s in reversed(servers):
                s.stop(15)
