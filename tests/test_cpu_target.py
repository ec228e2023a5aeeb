"""The kernels follow the CPU Numba compiles for, not only the host: with NUMBA_CPU_NAME/NUMBA_CPU_FEATURES
naming an AVX2-only CPU (kernels/cpu.without_avx512: the AVX2 runs of bench/blocks.py --avx2 on an AVX-512
machine, or a cache built for another machine), the integer kernels take their AVX2 paths and give the
products the host's path gives."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from blocks_data import Q, quantized

from colibri_server.model.kernels import blocks as KB
from colibri_server.model.kernels import cpu

KINDS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0)
D, N, T = 24, 512, 3

CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from blocks_data import quantized
from colibri_server.model.kernels import blocks as KB, blocks_gemm as KG, blocks_ir as KI, cpu
out = {"vnni512": cpu.HAVE_VNNI512, "vnni256": KI.HAVE_VNNI256, "tiles": KG.HAVE_TILES, "avx2": cpu.HAVE_AVX2}
for kind in json.loads(sys.argv[2]):
    rng = np.random.default_rng(kind)
    raw = quantized(rng.standard_normal((%d, %d)).astype(np.float32) * 0.05, kind, seed=kind)
    X = rng.standard_normal((%d, %d)).astype(np.float32)
    y = np.zeros((X.shape[0], raw.shape[0]), np.float32)
    n = X.shape[1]
    KG.matmul_blocks(raw, kind, X, y, np.zeros(X.shape, np.int8), np.zeros((X.shape[0], n // 32), np.float32),
                     np.zeros((X.shape[0], n // 16), np.int32), np.zeros(KG.scratch_words(n), np.float32),
                     np.float32(1.0), False)
    out[str(kind)] = y.tolist()
    y1 = np.zeros((1, raw.shape[0]), np.float32)    # one activation row: a decode token's row dots (8 rows at once)
    KG.matmul_blocks(raw, kind, X[:1], y1, np.zeros((1, n), np.int8), np.zeros((1, n // 32), np.float32),
                     np.zeros((1, n // 16), np.int32), np.zeros(KG.scratch_words(n), np.float32), np.float32(1.0), False)
    out[str(kind) + "/1"] = y1.tolist()
    if kind in (12, 13, 14):      # the int16 head's row dots (blocks_wide._krows8: 8 weight rows a pass)
        KG.matmul_blocks(raw, kind + KB.ACTS16, X[:1], y1, np.zeros((1, 2 * n), np.int8),
                         np.zeros((1, n // 32), np.float32), np.zeros((1, n // 16), np.int32),
                         np.zeros(KG.scratch_words(n), np.float32), np.float32(1.0), False)
        out[str(kind) + "/16"] = y1.tolist()
# the dots are compiled into the row loops (a decode token's Q4_K rows: blocks._rows_q4_k), not into the dispatch
asm = "".join(a for f in (KG.matmul_blocks, KB._rows_q4_k) for a in f.inspect_asm().values())
out["zmm"] = "zmm" in asm
out["ymm_dots"] = "vpmaddubsw" in asm and "ymm" in asm
print(json.dumps(out))
""" % (D, N, T, N)


def products(env) -> dict:
    tests = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", CHILD, tests, json.dumps([int(k) for k in KINDS])], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow          # two cold compiles of the block products (about a minute each on a loaded core)
@pytest.mark.skipif(not cpu.HAVE_VNNI512, reason="needs an AVX-512 VNNI host to force the AVX2 paths on")
def test_an_avx2_target_forced_on_an_avx512_host_takes_the_avx2_paths_with_the_same_products(tmp_path):
    # each child compiles into its own empty cache: a function loaded from Numba's cache has no assembly to inspect
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=cpu.without_avx512(),
               NUMBA_CACHE_DIR=str(tmp_path / "avx2"))
    avx2, host = products(env), products(dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "host")))
    assert avx2["avx2"] and not avx2["vnni512"] and not avx2["vnni256"] and not avx2["tiles"]
    assert host["vnni512"]
    assert not avx2["zmm"] and avx2["ymm_dots"]           # 256-bit vectors only: it runs on an AVX2 CPU
    assert host["zmm"]
    for kind in KINDS:
        rng = np.random.default_rng(int(kind))
        raw = quantized(rng.standard_normal((D, N)).astype(np.float32) * 0.05, kind, seed=int(kind))
        X = rng.standard_normal((T, N)).astype(np.float32)
        ref = KB.matmul_blocks_ref(raw, int(kind), X)
        a, h = np.asarray(avx2[str(int(kind))], np.float32), np.asarray(host[str(int(kind))], np.float32)
        # the same int8 rounding and exact integer sums per block on both paths; only the f32 sum of the
        # blocks' products may be ordered otherwise
        scale = np.abs(X).astype(np.float64) @ np.abs(KB.dequantize_ref(raw, int(kind), N)).T.astype(np.float64)
        assert (np.abs(a - h) <= scale * 1e-6 + 1e-7).all(), kind.name
        assert (np.abs(a - ref) <= scale * 2e-2 + 1e-5).all(), kind.name
        # one row (a decode token's row dots; the k-quants' 8 weight rows at once, kernels/blocks_rows8 on
        # blocks_ir.q45_ints / q6_ints, whose AVX2 and AVX-512 paths sum the same integers per block and step the
        # same floats: the same bits)
        a1, h1 = (np.asarray(p[str(int(kind)) + "/1"], np.float32) for p in (avx2, host))
        if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            assert np.array_equal(a1.view(np.uint32), h1.view(np.uint32)), kind.name
            # the int16 head's rows: the AVX2 byte split (blocks_wide._split_ints_avx2) and AVX-512's (VBMI or
            # widened) sum the same integers
            a16, h16 = (np.asarray(p[str(int(kind)) + "/16"], np.float32) for p in (avx2, host))
            assert np.array_equal(a16.view(np.uint32), h16.view(np.uint32)), kind.name
            assert (np.abs(a16 - ref[:1]) <= scale[:1] * 2e-2 + 1e-5).all(), kind.name
        assert (np.abs(a1 - h1) <= scale[:1] * 1e-6 + 1e-7).all(), kind.name
        assert (np.abs(a1 - ref[:1]) <= scale[:1] * 2e-2 + 1e-5).all(), kind.name


TILE_KINDS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q8_0)

TILES_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from blocks_data import quantized
from colibri_server.model.kernels import blocks as KB, blocks_gemm as KG, cpu
out = {"vnni512": cpu.HAVE_VNNI512, "small_tiles": KG.TILES_SMALL_VALUES, "diff": {}}
d, n, T = 37, 512, 11              # 2 tiles of 16 and 5 rows through the row dots; 2 passes of 4 rows and 3 alone
for kind in json.loads(sys.argv[2]):
    rng = np.random.default_rng(kind)
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=kind)
    X = rng.standard_normal((T, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (T, 1)).astype(np.float32)

    def product(X):
        y = np.zeros((X.shape[0], d), np.float32)
        KG.matmul_blocks(raw, kind, X, y, np.zeros(X.shape, np.int8), np.zeros((X.shape[0], n // 32), np.float32),
                         np.zeros((X.shape[0], n // 16), np.int32), np.zeros(KG.scratch_words(n), np.float32),
                         np.float32(1.0), False)
        return y
    tiles = product(X)
    rows = np.concatenate([product(X[t:t + 1]) for t in range(T)])          # one row at a time: the row dots
    out["diff"][str(kind)] = int((tiles.view(np.uint32) != rows.view(np.uint32)).sum())
    out[str(kind)] = tiles.tolist()
    if kind in (12, 14):      # Q4_K's and Q6_K's rows as 16-row tiles: on AVX2 the tiles through 256-bit halves
        w = quantized(rng.standard_normal((48, n)).astype(np.float32) * 0.05, kind, seed=kind)
        x16 = KB.to_x16(w, 144 if kind == 12 else 210)
        diff = 0
        for rows in (X, X[:1], X[:3], np.tile(X, (5, 1))):      # 1, 3 rows: the tiles as stored; 11, 55: their panels
            a, b = (np.zeros((rows.shape[0], 48), np.float32) for _ in range(2))
            for m, k, y in ((w, kind, a), (x16, kind + KB.X16, b)):
                KG.matmul_blocks(m, k, rows, y, np.zeros(rows.shape, np.int8),
                                 np.zeros((rows.shape[0], n // 32), np.float32),
                                 np.zeros((rows.shape[0], n // 16), np.int32), np.zeros(KG.scratch_words(n), np.float32),
                                 np.float32(1.0), False)
            diff += int((a.view(np.uint32) != b.view(np.uint32)).sum())
        out["x16diff"] = out.get("x16diff", 0) + diff
asm = "".join(KG._tiles_q45_k.inspect_asm().values()) + "".join(KG._tiles_b32.inspect_asm().values())
out["zmm"] = "zmm" in asm
out["maddubsw"] = "vpmaddubsw" in asm
print(json.dumps(out))
"""


@pytest.mark.slow          # a cold compile of the tiled products for each target (minutes on a loaded core)
@pytest.mark.skipif(not cpu.HAVE_VNNI512, reason="needs an AVX-512 VNNI host to force the AVX2 paths on")
def test_the_avx2_tiles_give_the_row_dots_bits_and_the_vnni_tiles_bits(tmp_path):
    # kernels/blocks_gemm on an AVX2-only target: Q4_K, Q5_K, Q6_K, Q4_0 and Q8_0 (the sign trick) tiles from
    # `vpmaddubsw` + `vpmaddwd` on 256-bit halves, each output row the row dots' bits (one activation row at a time)
    # and the AVX-512 tiles' bits
    kinds = json.dumps([int(k) for k in TILE_KINDS])
    tests = os.path.dirname(__file__)

    def run(env):
        r = subprocess.run([sys.executable, "-c", TILES_CHILD, tests, kinds], env=env, capture_output=True, text=True,
                           timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    avx2 = run(dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=cpu.without_avx512(),
                    NUMBA_CACHE_DIR=str(tmp_path / "avx2")))     # empty caches: cached functions show no assembly
    host = run(dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "host")))
    assert avx2["small_tiles"] and not avx2["vnni512"] and avx2["maddubsw"] and not avx2["zmm"]
    assert host["vnni512"] and host["zmm"]
    assert avx2["x16diff"] == 0 and host["x16diff"] == 0
    for kind in TILE_KINDS:
        assert avx2["diff"][str(int(kind))] == 0 and host["diff"][str(int(kind))] == 0, kind.name
        a, h = np.asarray(avx2[str(int(kind))], np.float32), np.asarray(host[str(int(kind))], np.float32)
        assert np.array_equal(a.view(np.uint32), h.view(np.uint32)), kind.name
