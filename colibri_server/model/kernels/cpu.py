"""What this CPU can run, asked of LLVM once at import: the feature set and the two levels the
integer kernels branch on (AVX2; AVX-512 VNNI). Every IR kernel module takes its flags from here."""
from __future__ import annotations

import os


def _target_features() -> set:
    """The features Numba compiles for: NUMBA_CPU_FEATURES when set (Numba's own override: a cache
    built for another machine, or an AVX2 run forced on an AVX-512 one), else the host's."""
    given = os.environ.get("NUMBA_CPU_FEATURES")
    if given:
        return {f[1:] for f in given.split(",") if f.startswith("+")}
    try:
        import llvmlite.binding as llvm
        return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    except Exception:      # pragma: no cover - no feature query: take the portable path
        return set()


def without_avx512() -> str:
    """NUMBA_CPU_FEATURES for this host as an AVX2-only CPU (its AVX-512, AMX and AVX-VNNI turned off)."""
    import llvmlite.binding as llvm
    off = ("+avx512", "+avx10", "+amx", "+avxvnni", "+avxifma", "+avxneconvert", "+evex512")
    return ",".join("-" + f[1:] if f.startswith(off) else f for f in llvm.get_host_cpu_features().flatten().split(","))


FEATURES = _target_features()
HAVE_AVX2 = "avx2" in FEATURES
# Zen 4, Ice Lake and later: 512-bit integer dots with VNNI (vpdpbusd u8 x s8, vpdpwssd s16 x s16,
# each a multiply and an accumulate in one instruction, 64 bytes of weights at a time)
HAVE_VNNI512 = HAVE_AVX2 and {"avx512f", "avx512bw", "avx512vnni"} <= FEATURES
