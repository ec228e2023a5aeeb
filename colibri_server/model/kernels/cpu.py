"""What this CPU can run, asked of LLVM once at import: the feature set and the two levels the
integer kernels branch on (AVX2; AVX-512 VNNI). Every IR kernel module takes its flags from here."""
from __future__ import annotations


def _host_features() -> set:
    try:
        import llvmlite.binding as llvm
        return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    except Exception:      # pragma: no cover - no feature query: take the portable path
        return set()


FEATURES = _host_features()
HAVE_AVX2 = "avx2" in FEATURES
# Zen 4, Ice Lake and later: 512-bit integer dots with VNNI (vpdpbusd u8 x s8, vpdpwssd s16 x s16,
# each a multiply and an accumulate in one instruction, 64 bytes of weights at a time)
HAVE_VNNI512 = HAVE_AVX2 and {"avx512f", "avx512bw", "avx512vnni"} <= FEATURES
