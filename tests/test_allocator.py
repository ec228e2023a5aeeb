"""host/allocator: a worker's malloc keeps the memory a step frees, so the next step's temporaries of the same size
are not fresh pages faulted in one by one."""
from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import resource, sys
import numpy as np
from colibri_server.host.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def layer():                            # a MoE layer's temporaries at a prefill step: 4 x 4 MiB, written, freed
    arrays = [np.empty(1 << 20, np.float32) for _ in range(4)]
    for a in arrays:
        a[:] = 1.0
for _ in range(3):
    layer()
f0 = faults()
for _ in range(20):
    layer()
print(faults() - f0)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_temporaries_are_reused_not_faulted_in_again():
    kept, default = _faults("keep"), _faults("default")
    # 20 layers of 4,096 pages: glibc's default faulted 40,400 of them in again (the trimmed top of the heap, half the
    # temporaries), kept ones none
    assert default > 10 * 2048, default
    assert kept < 1000, kept
