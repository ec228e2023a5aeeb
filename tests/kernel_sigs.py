"""Opt-in pytest plugin: every compiled signature of every colibri Numba kernel, with the test that first
compiled (or loaded) it and the seconds its compile took.

    KERNEL_SIGS=OUT.jsonl pytest -n 0 tests/test_x.py   (conftest loads it when the variable is set)

With an empty COLIBRI_CACHE_DIR every signature is a compile; with a warm one it is a load (seconds ~0).
Writes one JSON line per (kernel, signature): kernel (module.name), sig (the argument types as Numba
prints them), test (the node id that first had it), s (compile seconds, nested compiles included).
Off unless the variable is set; with -n 2 each worker appends its own lines.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

ENV = "KERNEL_SIGS"


def _dispatchers():
    from numba.core.dispatcher import Dispatcher
    for name, mod in list(sys.modules.items()):
        if not name.startswith("colibri_server.model.kernels") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, Dispatcher) and getattr(obj, "__module__", name) == name:
                yield f"{name.rsplit('.', 1)[-1]}.{attr}", obj


class _Recorder:
    def __init__(self, path):
        self.path, self.seen, self.secs, self.starts = path, {}, {}, {}
        from numba.core import event

        class L(event.Listener):
            def on_start(s, ev):
                self.starts[id(ev.data["dispatcher"]), str(tuple(ev.data["args"]))] = time.perf_counter()

            def on_end(s, ev):
                key = (id(ev.data["dispatcher"]), str(tuple(ev.data["args"])))
                t = self.starts.pop(key, None)
                if t is not None:
                    self.secs[key] = self.secs.get(key, 0.0) + time.perf_counter() - t
        event.register("numba:compile", L())

    def collect(self, test):
        out = []
        for name, d in _dispatchers():
            for sig in list(d.overloads):
                key = (name, tuple(str(t) for t in sig))
                if key not in self.seen:
                    self.seen[key] = test
                    s = self.secs.get((id(d), str(tuple(sig))), 0.0)
                    out.append({"kernel": name, "sig": list(key[1]), "test": test, "s": round(s, 2)})
        if out:
            with open(self.path, "a") as f:
                for r in out:
                    f.write(json.dumps(r) + "\n")


_rec = None


def pytest_configure(config):
    global _rec
    if os.environ.get(ENV) and _rec is None:
        _rec = _Recorder(os.environ[ENV])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _rec is not None:
        _rec.collect(item.nodeid)
