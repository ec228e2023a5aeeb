"""How fast an expert's bytes come from the disk, by how they are asked for, in a memory cgroup.

Root only. The read half of a weights budget (model/residency.py, model/prefetch.py) without the model's
compute: the .colibri file is read in expert-sized pieces (--piece MiB), each asked for one piece ahead of
the one being touched (a byte a page, as a layer's kernels would), inside a memory cgroup of --limit MiB
(the page cache the reads fill is charged to it and reclaimed as they go), the file dropped from the page
cache before each run. Ways of asking, in turns, --rounds times:

- willneed: the mapping advised MADV_RANDOM (an unlocked expert's advice), madvise(MADV_WILLNEED) in 2 MiB
  calls from the thread that then touches the piece (how a worker asked before prefetch.py);
- prefetch: the mapping advised MADV_HUGEPAGE and MADV_RANDOM, as a server maps the model under a budget,
  the piece asked of prefetch.Prefetcher (a thread faulting it in with MADV_POPULATE_READ);
- faults: no advice, no asking: the kernel's own fault readahead (what llama.cpp's mmap gets).

Prints GB/s of each (the file's bytes over the wall time) and the seconds the touching thread spent asking.

    python bench/readahead.py [--limit 300] [--piece 13] [--rounds 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import memory_limit as ML  # noqa: E402  (Cgroup, drop_cache, DATA)
from decode import _cpu  # noqa: E402

WAYS = ("willneed", "prefetch", "faults")


def child(path: str, way: str, piece: int) -> dict:
    import numpy as np

    from colibri_server.model.prefetch import READ_CHUNK, Prefetcher
    n = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ)
    a = np.frombuffer(mm, np.uint8)
    base = a.ctypes.data
    if way == "prefetch":
        mm.madvise(mmap.MADV_HUGEPAGE)
    if way != "faults":
        mm.madvise(mmap.MADV_RANDOM)
    reader = Prefetcher(populate=True) if way == "prefetch" else None
    pieces = [(o, min(piece, n - o)) for o in range(0, n, piece)]

    def ask(o, size):
        if reader is not None:
            reader.ask(base + o, size)
        elif way == "willneed":
            for c in range(o, o + size, READ_CHUNK):
                mm.madvise(mmap.MADV_WILLNEED, c, min(READ_CHUNK, o + size - c))
    t0 = time.perf_counter()
    asking = 0.0
    ask(*pieces[0])
    total = 0
    for k, (o, size) in enumerate(pieces):
        if k + 1 < len(pieces):
            ta = time.perf_counter()
            ask(*pieces[k + 1])
            asking += time.perf_counter() - ta
        total += int(a[o:o + size:mmap.PAGESIZE].sum())
    wall = time.perf_counter() - t0
    return {"way": way, "gb_s": round(n / wall / 1e9, 2), "asking_s": round(asking, 3), "wall_s": round(wall, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=ML.DATA / "bench-mixtral-f16.colibri")
    ap.add_argument("--limit", type=int, default=300, help="the cgroup's limit, MiB")
    ap.add_argument("--piece", type=int, default=13, help="MiB asked for at a time (bench-mixtral f16: an expert)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(str(a.model), a.child, a.piece << 20)))
        return
    if os.geteuid() != 0:
        sys.exit("bench/readahead.py makes memory cgroups: run it as root")
    print(f"{a.model.name}: {a.model.stat().st_size / 2**20:.0f} MiB in {a.piece} MiB pieces, a cgroup of {a.limit} MiB",
          flush=True)
    runs = []
    for r in range(a.rounds):
        for way in a.ways:
            ML.drop_cache(a.model)
            cg = ML.Cgroup(f"colibri-readahead-{os.getpid()}", a.limit << 20)
            try:
                out = ML.run_in(cg, [sys.executable, __file__, "--model", str(a.model), "--piece", str(a.piece),
                                     "--child", way], timeout=600)
                got = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else \
                    {"way": way, "error": out.stderr.strip()[-300:]}
                got["peak_bytes"], got["oom_kills"] = cg.peak(), cg.ooms()
            finally:
                time.sleep(0.3)
                cg.remove()
            got["round"] = r
            runs.append(got)
            print(f"round {r}: {way:12s} {got.get('gb_s', 0):5.2f} GB/s, asking {got.get('asking_s', 0):.2f} s of "
                  f"{got.get('wall_s', 0):.2f} s, peak {got['peak_bytes'] / 2**20:.0f} MiB {got.get('error', '')}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model.name, "limit_mib": a.limit, "piece_mib": a.piece, "runs": runs,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "uname": os.uname().release, "cpu": _cpu()}, f,
                      indent=1)


if __name__ == "__main__":
    main()
