"""numba_cache: the kernels' cache directory is the machine's and build's own (any kernel source edited,
another Numba or CPU: another directory), outside the package, chosen by cache_dir / systemd / XDG; saves
into it never cross between processes; a second start of a read-only install compiles nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from colibri_server.model import numba_cache


def _tree(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "dense.py").write_text("a = 1\n")
    (tmp_path / "kernels" / "float_ir.py").write_text("b = 2\n")
    (tmp_path / "other.py").write_text("c = 3\n")
    return tmp_path


def test_the_key_changes_with_any_kernel_source_and_only_with_them(tmp_path):
    t = _tree(tmp_path)
    k0 = numba_cache.build_key(t)
    assert numba_cache.build_key(t) == k0
    (t / "other.py").write_text("c = 4\n")                   # not a kernel source
    assert numba_cache.build_key(t) == k0
    (t / "kernels" / "float_ir.py").write_text("b = 3\n")    # a kernel another one inlines
    k1 = numba_cache.build_key(t)
    assert k1 != k0 and re.fullmatch(r"[0-9a-f]{16}", k1)


def test_the_cpu_is_part_of_the_key(tmp_path, monkeypatch):
    t = _tree(tmp_path)
    k0 = numba_cache.build_key(t)
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert numba_cache.build_key(t) != k0


@pytest.mark.parametrize("env, root", [
    ({"COLIBRI_CACHE_DIR": "/c", "CACHE_DIRECTORY": "/s", "XDG_CACHE_HOME": "/x"}, "/c"),
    ({"CACHE_DIRECTORY": "/var/cache/colibri:/other", "XDG_CACHE_HOME": "/x"}, "/var/cache/colibri"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/colibri"),
    ({}, os.path.join(os.path.expanduser("~"), ".cache", "colibri")),
])
def test_the_root_follows_the_setting_then_systemd_then_xdg(env, root):
    assert numba_cache.cache_root(env) == root
    assert numba_cache.kernel_dir(env) == os.path.join(root, f"kernels-{numba_cache.build_key()}")


def test_a_user_numba_cache_dir_is_left_to_numba():
    assert numba_cache.kernel_dir({"NUMBA_CACHE_DIR": "/mine", "COLIBRI_CACHE_DIR": "/c"}) == "/mine"


def _run(env, *args):
    return subprocess.run([sys.executable, "-m", "colibri_server.cli", *args], env=env, capture_output=True,
                          text=True, timeout=1800)


def _clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "COLIBRI_CACHE_DIR")}
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME="", **extra)
    return env


def test_an_unwritable_root_falls_back_to_a_temporary_directory_and_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")                       # a directory below a regular file cannot be made, even by root
    env = _clean_env(tmp_path, COLIBRI_CACHE_DIR=str(blocker / "cache"))
    r = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); import colibri_server.model.kernels; "
                        "import os; print(os.environ['NUMBA_CACHE_DIR'])"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    used = r.stdout.strip()
    assert "cannot be written" in r.stderr and str(blocker / "cache") in r.stderr and used in r.stderr
    assert os.path.isdir(used) and os.path.basename(used).startswith("kernels-")


def test_compile_names_a_bad_family_and_a_missing_model(tmp_path):
    env = _clean_env(tmp_path, COLIBRI_CACHE_DIR=str(tmp_path / "cache"))
    r = _run(env, "compile", "--family", "nope")
    assert r.returncode == 2 and "unknown family 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = _run(env, "compile", "--model", str(tmp_path / "missing.colibri"))
    assert r.returncode != 0 and "missing.colibri" in r.stderr and "Traceback" not in r.stderr


def _save_many(cache_dir, who, n, locked, barrier):
    from numba.core import caching
    if locked:
        numba_cache.lock_saves()
    else:       # Numba's own save (importing the kernels installed the lock in this process)
        caching.IndexDataCacheFile.save = getattr(caching.IndexDataCacheFile.save, "__wrapped__",
                                                  caching.IndexDataCacheFile.save)
    f = caching.IndexDataCacheFile(str(cache_dir), "kernel-1", ("stamp", 1))
    barrier.wait()
    for i in range(n):
        f.save((who, i), f"{who}:{i}".encode() * 4096)


def _crossed_entries(tmp_path, locked, procs=4, n=60):
    """Several processes save distinct signatures of one kernel at once; how many keys then load
    another key's data (what made a cached kernel run another signature's code), and how many
    keys the index kept."""
    import multiprocessing as mp

    from numba.core import caching
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    ps = [ctx.Process(target=_save_many, args=(tmp_path, w, n, locked, barrier)) for w in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    f = caching.IndexDataCacheFile(str(tmp_path), "kernel-1", ("stamp", 1))
    index = f._load_index()
    crossed = sum(1 for key in index if f.load(key) != f"{key[0]}:{key[1]}".encode() * 4096)
    return crossed, len(index)


def test_concurrent_saves_never_cross_entries(tmp_path):
    crossed, kept = _crossed_entries(tmp_path, locked=True)
    assert (crossed, kept) == (0, 4 * 60)       # every signature kept, each with its own code


_KERNEL = "import numba\n\n@numba.njit(cache=True)\ndef slow_kernel(x):\n    s = 0.0\n" + "".join(
    f"    for i in range({k + 2}):\n        s += (x * i + {k}) % {k + 3}\n" for k in range(16)) + "    return s\n"

_COMPILE_AT_ONCE = """
import os, sys, time
from numba.core import event
import colibri_server.model.kernels      # the cache's setup, as in every process of the server
folder, me, other, unlocked = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if unlocked:                            # Numba's own compile
    from numba.core import dispatcher
    dispatcher.Dispatcher.compile = dispatcher.Dispatcher.compile.__wrapped__
sys.path.insert(0, folder)
compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        pass
    def on_end(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)
event.register("numba:compile", Count())
import kernel_module
open(os.path.join(folder, me), "w").close()
while not os.path.exists(os.path.join(folder, other)):
    time.sleep(0.001)
print(kernel_module.slow_kernel(3.0), len(compiled))
"""


def _compile_at_once(tmp_path, unlocked=False):
    """Two processes call one new kernel at the same moment, with one empty cache -> (results, compiles)."""
    (tmp_path / "kernel_module.py").write_text(_KERNEL)
    env = _clean_env(tmp_path, COLIBRI_CACHE_DIR=str(tmp_path / "cache"))
    ps = [subprocess.Popen([sys.executable, "-c", _COMPILE_AT_ONCE, str(tmp_path), me, other, str(int(unlocked))],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for me, other in (("a", "b"), ("b", "a"))]
    outs = [p.communicate(timeout=600) for p in ps]
    assert all(p.returncode == 0 for p in ps), outs
    got = [o.split() for o, _ in outs]
    return {r for r, _ in got}, sum(int(n) for _, n in got)


def test_a_kernel_compiles_once_when_two_processes_need_it_at_once(tmp_path):
    """The second process waits for the first one's compile and loads its code from the cache."""
    results, compiles = _compile_at_once(tmp_path)
    assert len(results) == 1 and compiles == 1, (results, compiles)


def test_a_first_run_compiles_what_serve_needs_beside_it(monkeypatch, capsys):
    """`colibri run` that compiles (a first start of its kind) starts `colibri compile --model` for the other
    layouts and waits for it; one that compiles nothing starts nothing."""
    from colibri_server import cli
    from colibri_server.model import engine, precompile
    started = []

    class _Proc:
        def __init__(self):
            self.waited = False

        def poll(self):
            return None if not self.waited else 0

        def wait(self):
            self.waited = True
            return 0

        def terminate(self):
            raise AssertionError("a finished run does not kill its compile")

    def fake_start(path, own, kv_dtype="f16"):
        started.append((path, own, _Proc()))
        return started[-1][2]
    monkeypatch.setattr(precompile, "start_other_layouts", fake_start)
    real = engine.Model.warm_up

    def compiling(self, announce=None, on_compile=None, **kw):
        if on_compile is not None:
            on_compile()
        return real(self, announce=announce, **kw)
    monkeypatch.setattr(engine.Model, "warm_up", compiling)
    cli.main(["run", "1,2", "--token-ids", "--max-tokens", "1"])
    assert len(started) == 1 and started[0][1] == "run" and started[0][2].waited
    assert "finishing the kernels" in capsys.readouterr().err
    monkeypatch.setattr(engine.Model, "warm_up", real)
    cli.main(["run", "1,2", "--token-ids", "--max-tokens", "1"])      # the same kernels: nothing compiles
    assert len(started) == 1


_TOP_COMPILES = """
from numba.core import event
from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.model import Model
names, depth = [], [0]
class Top(event.Listener):
    def on_start(self, ev):
        if depth[0] == 0:
            names.append(ev.data["dispatcher"].py_func.__name__)
        depth[0] += 1
    def on_end(self, ev):
        depth[0] -= 1
m = Model.open(BUNDLED_MODEL)
with event.install_listener("numba:compile", Top()):
    m.warm_up()
print(" ".join(names))
"""


def test_a_first_run_shares_its_compile_and_any_model_of_that_kind_then_starts_warm(tmp_path):
    """One empty cache (a cold compile is ~35 s: the claims share one). `colibri compile` of the prompt's kernels
    (the prefill layout) for one family and kind: a small synthetic model, of another shape than the bundled one.
    A cold run's warm-up of the bundled model then compiles its fused token and nothing else: the prompt's kernels
    of any model of that kind serve it, and those two parts, which a first `colibri run` overlaps (the token here,
    the prompt's kernels in the process start_other_layouts starts), are the whole run. `colibri run` then
    compiles nothing, and no cache file is written into the package directory (a read-only install works the
    same)."""
    import colibri_server
    from colibri_server.model import precompile
    pkg = os.path.dirname(colibri_server.__file__)

    def package_cache_files():
        return {os.path.join(d, f) for d, _, fs in os.walk(pkg) for f in fs if f.endswith((".nbi", ".nbc"))}
    before = package_cache_files()
    cache = tmp_path / "cache"
    env = _clean_env(tmp_path, COLIBRI_CACHE_DIR=str(cache))
    c = _run(env, "compile", "--family", "mixtral", "--kind", "f16", "--layout", precompile.PREFILL)
    assert c.returncode == 0, c.stderr
    m = re.search(r"\[1/1\] mixtral f16: (\d+) kernels compiled", c.stderr)
    assert m and int(m.group(1)) > 0, c.stderr
    r = subprocess.run([sys.executable, "-c", _TOP_COMPILES], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["decode_token"], r.stdout
    r = _run(env, "run", "def", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "(0 compiled)" in r.stderr, r.stderr
    kdirs = list(cache.glob("kernels-*"))
    assert len(kdirs) == 1 and any(kdirs[0].rglob("*.nbi"))
    assert package_cache_files() == before
    started = []

    class _Popen:
        def __init__(self, args, **kw):
            started.append(args)
    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess, "Popen", _Popen)
    try:
        precompile.start_other_layouts("m.colibri", "run")
    finally:
        mp.undo()
    layouts = [a for i, a in enumerate(started[0]) if i and started[0][i - 1] == "--layout"]
    assert layouts == [precompile.PREFILL, "serve-1", "serve-n"]       # the run's share first


def test_the_warm_up_compiles_the_fused_token_before_the_prompt(monkeypatch):
    """The order that lets a first run overlap its two parts: the token (this process) while the prompt's kernels
    compile in the other, whose results this process then loads."""
    from colibri_server.bundled import BUNDLED_MODEL
    from colibri_server.model import Model
    calls = []
    monkeypatch.setattr(Model, "decode", lambda self, cache, token: calls.append("decode"))
    monkeypatch.setattr(Model, "generate", lambda self, prompt, **kw: calls.append("generate"))
    m = Model.open(BUNDLED_MODEL)
    try:
        m.warm_up()
    finally:
        m.close()
    assert calls == ["decode", "generate"]


@pytest.mark.slow
def test_serve_after_a_first_run_compiles_nothing(tmp_path):
    """From an empty cache: `colibri run`, then `colibri serve` with threaded workers on the same model starts
    with nothing to compile (run compiled serve's kernels beside its own). Two cold compiles: behind `slow`."""
    cache = tmp_path / "cache"
    env = _clean_env(tmp_path, COLIBRI_CACHE_DIR=str(cache))
    r = _run(env, "run", "def", "--max-tokens", "2")
    assert r.returncode == 0 and int(re.search(r"\((\d+) compiled\)", r.stderr).group(1)) > 0, r.stderr
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "colibri_server.cli", "serve", "--workers", "1",
                              "--threads-per-worker", "2", "--bind", f"ipc://{tmp_path}/s.sock", "--runtime-dir",
                              str(tmp_path / "run"), "--pin", "none"], env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        import time
        deadline = time.monotonic() + 900
        while "ready:" not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert "ready:" in text, text
        assert "(0 compiled)" in text, text
    finally:
        p.terminate()
        p.wait(60)
