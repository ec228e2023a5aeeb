"""Peak RSS of `colibri convert` on a ~1 GB sharded checkpoint (bench-mixtral shape, f16).

    python bench/convert_memory.py [--dir DATA_DIR] [--dtype f16]

Prints checkpoint size, largest tensor, the converter's peak RSS (ru_maxrss of the child)
and the budget the issue sets (300 MB + the largest tensor); exits 1 if over it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to build the checkpoint (default: a temp dir)")
    ap.add_argument("--dtype", default="f16", choices=("f32", "f16", "bf16"))
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="colibri-convmem-")
    hf = os.path.join(d, "hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors.index.json")):
        # built in a child: a forked child starts with its parent's RSS, so the parent stays small
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from synth_checkpoint import write_checkpoint; write_checkpoint(sys.argv[2])",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"), hf], check=True)
        print(f"built checkpoint in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    import numpy as np
    from synth_checkpoint import BENCH_MIXTRAL, mixtral_tensors
    sizes = [int(np.prod(s)) * 2 for _, s in mixtral_tensors(BENCH_MIXTRAL)]
    total, largest = sum(sizes), max(sizes)
    out = os.path.join(d, f"model-{a.dtype}.colibri")
    t0 = time.perf_counter()
    # the child reports its own peak (RUSAGE_CHILDREN would mix in the builder's)
    code = ("import resource, sys\nfrom colibri_server.cli import main\n"
            "try:\n    main(sys.argv[1:])\nfinally:\n"
            "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, "convert", hf, out, "--dtype", a.dtype, "--no-tokenizer",
                        "--quiet"], check=True, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    peak = int(r.stderr.strip().splitlines()[-1]) * 1024
    budget = 300 * 2**20 + largest
    print(f"checkpoint {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB, "
          f"output {os.path.getsize(out) / 2**20:.0f} MiB in {dt:.1f}s")
    print(f"peak RSS of convert: {peak / 2**20:.0f} MiB; budget 300 MiB + largest = {budget / 2**20:.0f} MiB "
          f"-> {'OK' if peak <= budget else 'OVER'}")
    return 0 if peak <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
