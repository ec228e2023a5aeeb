"""Where a decode token's time goes, per kernel and per thread: `perf record` on a process decoding in a loop.

    python bench/profile_decode.py MODEL.colibri [--threads 2] [--seconds 8] [--context 256] [--top 12] [--batch B | --prompts N]

--batch B profiles a serving step of B sequences (BatchEngine, as bench/step.py runs it) instead of the fused
decode token; --prompts N the prefill of N 32-token prompts that arrive at once (N clients starting together).

perf (Debian's linux-perf) samples the process's threads on the cpu-clock (no hardware counters needed, as on
VMs). Numba's compiled code has no symbols perf can read, so the child process keeps every Numba library's
object code as it is loaded or compiled (wrapping CPUCodeLibrary._set_compiled_object and the object cache
hook, before any kernel is imported) and, once warm, writes /tmp/perf-PID.map: each function's address from
the JIT and its size from the object's symbol table. Per thread, the share of its samples in each kernel
(mangled names shortened to module.function), in the threading layer's waiting (tbb, sched_yield, the
kernel's scheduler) and elsewhere. A decode token's kernels are in the fused decode_token's libraries, so a
kernel inlined into its caller is counted there. Measure on a quiet machine; the shares are what matters.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _keep_objects():
    """Make every Numba code library keep its object code (CPUCodeLibrary drops it once loaded)."""
    from numba.core import codegen as CG
    set_obj = CG.CPUCodeLibrary._set_compiled_object

    def keep(self, value):
        self._kept_object = value
        return set_obj(self, value)
    CG.CPUCodeLibrary._set_compiled_object = keep
    hook = CG.CPUCodeLibrary._object_compiled_hook.__func__

    def compiled(cls, ll_module, buf):
        lib = getattr(ll_module, "_CPUCodeLibrary__library", None) or getattr(ll_module, "__library", None)
        if lib is not None:
            lib._kept_object = buf
        return hook(cls, ll_module, buf)
    CG.CPUCodeLibrary._object_compiled_hook = classmethod(compiled)


def _write_map() -> int:
    """/tmp/perf-PID.map of every function in the kept object code -> the number of functions."""
    import gc

    from numba.core import codegen as CG
    lines, seen = [], set()
    for lib in [o for o in gc.get_objects() if isinstance(o, CG.CPUCodeLibrary)]:
        obj = getattr(lib, "_kept_object", None) or getattr(lib, "_compiled_object", None)
        if not obj or id(obj) in seen:
            continue
        seen.add(id(obj))
        with tempfile.NamedTemporaryFile(suffix=".o") as f:
            f.write(obj)
            f.flush()
            nm = subprocess.run(["nm", "-S", "--defined-only", f.name], capture_output=True, text=True).stdout
        for line in nm.splitlines():
            p = line.split()
            if len(p) == 4 and p[2] in "tTwW":
                addr = lib._codegen._engine.get_function_address(p[3])
                if addr:
                    lines.append(f"{addr:x} {int(p[1], 16):x} {p[3]}")
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as f:
        f.write("\n".join(lines) + "\n")
    return len(lines)


def child(a):
    _keep_objects()
    import numpy as np

    from colibri_server.model import Model
    from colibri_server.model.serving import BatchEngine
    m = Model.open(a.model, populate=True, context=max(a.context + 16, 64), threads=a.threads)
    if a.prompts:               # the prefill of `prompts` requests of 32 tokens arriving at once, over and over
        rng = np.random.default_rng(0)

        def step():
            eng = BatchEngine(m, max_seqs=a.prompts, max_batch_tokens=256, kv_dtype="f16")
            for i in range(a.prompts):
                eng.add(i, rng.integers(3, m.config.vocab_size, 32).tolist(), max_tokens=2, ignore_eos=True)
            while eng.sched.waiting or any(s.pending > 1 for s in eng.sched.running):
                eng.step()
            return 32 * a.prompts
    elif a.batch:               # a serving step of `batch` sequences (bench/step.py's engine), restarted as they end
        # each sequence its own random prompt (bench/step.py's): one prompt for all would route every row to the
        # same experts, a step that reads a quarter of the weights a real one does
        eng, ids = BatchEngine(m, max_seqs=a.batch, max_batch_tokens=256, kv_dtype="f16"), iter(range(1 << 30))
        rng = np.random.default_rng(0)

        def step():
            while len(eng.sched.running) + len(eng.sched.waiting) < a.batch:
                eng.add(next(ids), rng.integers(3, m.config.vocab_size, 32).tolist(), max_tokens=a.context - 32,
                        ignore_eos=True)
            return len(eng.step())
    else:                       # the fused decode token
        cache = [m.new_cache()]

        def step():
            if cache[0].length >= a.context:
                cache[0] = m.new_cache()
            m.decode(cache[0], 1 + cache[0].length % 100)
            return 1
    for _ in range(8):
        step()
    print("functions", _write_map(), flush=True)
    print("ready", os.getpid(), flush=True)
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < a.seconds + 4:
        n += step()
    what = f"prefill of {a.prompts} x 32" if a.prompts else f"step of {a.batch}" if a.batch else "decode"
    print(f"{what}: {n / (time.perf_counter() - t):.1f} tok/s", flush=True)


WAITING = re.compile(r"tbb::|sched_yield|__schedule|do_syscall|clock_gettime|futex|x64_sys_call|gomp_|GOMP_")


def _name(sym: str) -> str:
    """A Numba function's mangled name (_ZN<len><part>...B<abi tags>...) -> its parts after colibri_server.model.kernels,
    dotted (module.function); other symbols as they are."""
    if not sym.startswith("_ZN"):
        return sym[:60]
    parts, i = [], 3
    while i < len(sym) and sym[i].isdigit():
        j = i
        while sym[j].isdigit():
            j += 1
        n = int(sym[i:j])
        parts.append(sym[j:j + n])
        i = j + n
    if parts[:3] == ["colibri_server", "model", "kernels"] or parts[1:4] == ["colibri_server", "model", "kernels"]:
        parts = parts[parts.index("kernels") + 1:]
    return ".".join(parts)[:60] or sym[:60]


def report(pid: str, script: str, top: int):
    funcs = []
    with open(f"/tmp/perf-{pid}.map") as f:
        for line in f:
            addr, size, sym = line.rstrip("\n").split(" ", 2)
            funcs.append((int(addr, 16), int(size, 16), sym))
    funcs.sort()
    starts = [f[0] for f in funcs]
    per = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        p = line.split(None, 2)
        if len(p) < 2:
            continue
        ip = int(p[1], 16)
        i = bisect.bisect_right(starts, ip) - 1
        if i >= 0 and ip < funcs[i][0] + funcs[i][1]:
            name = _name(funcs[i][2])
        else:
            sym = p[2].strip() if len(p) > 2 else "?"
            name = "(waiting: threading layer, scheduler)" if WAITING.search(sym) else "(elsewhere: " + sym[:40] + ")"
        per[p[0]][name] += 1
    for tid, c in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        wait = c.get("(waiting: threading layer, scheduler)", 0)
        print(f"thread {tid}: {total} samples, {100 * wait / total:.1f}% waiting")
        for name, k in c.most_common(top):
            print(f"  {100 * k / total:5.1f}%  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--context", type=int, default=256, help="tokens per sequence before it starts again")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--batch", type=int, default=0, help="profile a serving step of this many sequences instead")
    ap.add_argument("--prompts", type=int, default=0,
                    help="profile the prefill of this many 32-token prompts arriving at once instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not shutil.which("perf"):
        sys.exit("profile_decode: perf not found (Debian: apt-get install linux-perf)")
    proc = subprocess.Popen([sys.executable, __file__, "--child", a.model, "--threads", str(a.threads), "--seconds",
                             str(a.seconds), "--context", str(a.context), "--batch", str(a.batch), "--prompts", str(a.prompts)],
                            stdout=subprocess.PIPE, text=True)
    pid = None
    for line in proc.stdout:
        print(line.rstrip(), flush=True)
        if line.startswith("ready"):
            pid = line.split()[1]
            break
    if pid is None:
        sys.exit(f"profile_decode: the decoding process ended before it was ready (exit {proc.wait()})")
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "perf.data")
        time.sleep(1)
        rec = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-p", pid, "-o", data, "--",
                              "sleep", str(a.seconds)], capture_output=True, text=True)
        if rec.returncode:
            proc.kill()
            os.unlink(f"/tmp/perf-{pid}.map")
            last = (rec.stderr.strip().splitlines() or ["no message"])[-1]
            sys.exit(f"profile_decode: perf record failed ({last}; as root, or with kernel.perf_event_paranoid <= 1)")
        script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,ip,sym"], capture_output=True,
                                text=True).stdout
    print(proc.stdout.read().rstrip())
    proc.wait()
    report(pid, script, a.top)
    os.unlink(f"/tmp/perf-{pid}.map")


if __name__ == "__main__":
    main()
