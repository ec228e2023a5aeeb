"""Q4_K and Q6_K expert matrices stored as 16-row tiles (q4_k_x16, q6_k_x16, kernels/blocks_x16): the same bytes
moved, the same values (the gguf package's dequantize of the rows), and every product the rows' bits: the tiles read
as stored (AVX-512 VNNI), their panels (many rows), a tile cut by a row range (its rows untiled through the row dots),
threads, a step's experts in one call and a decode token's; a converted model's logits are the rows' bit for bit."""
from __future__ import annotations

import gguf
import hf_models as H
import numpy as np
import pytest
from blocks_data import Q, quantized, read_only
from test_gguf_import import PROMPT, write_gguf

from colibri_server.model import Model
from colibri_server.model.blocks import BlockTensor, stored_kind
from colibri_server.model.convert import as_stored
from colibri_server.model.gguf_import import convert_gguf
from colibri_server.model.kernels import blocks as KB
from colibri_server.model.kernels import blocks_gemm as KG
from colibri_server.model.kernels import experts_blocks as KEB

SIZE = {Q.Q4_K: 144, Q.Q6_K: 210}
KINDS = [Q.Q4_K, Q.Q6_K]


def _rows(kind, d, n, seed):
    rng = np.random.default_rng(seed)
    return quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=seed)


def _tiles(raw, kind):
    return KB.to_x16(raw, SIZE[kind])


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_tiles_are_the_rows_bytes_moved_and_dequantize_to_gguf_values(kind):
    size = SIZE[kind]
    raw = _rows(kind, 48, 512, 1)
    x = _tiles(raw, kind)
    assert x.shape == raw.shape and not np.array_equal(x, raw)
    assert np.array_equal(np.sort(x, axis=None), np.sort(raw, axis=None))         # a permutation of the bytes
    assert np.array_equal(KB.from_x16(x, size), raw)
    # tile 1's block 1: dword q of row 16 + r at dword 16 q + r, then (Q6_K) the rows' last 2 bytes (d) in turn
    w = size // 4
    blk = x.reshape(3, 16 * 2 * size)[1][16 * size:32 * size]
    rows = raw[16:32, size:2 * size]
    assert np.array_equal(blk[:64 * w].view(np.uint32).reshape(w, 16).T, rows[:, :4 * w].copy().view(np.uint32))
    assert np.array_equal(blk[64 * w:].reshape(16, size - 4 * w), rows[:, 4 * w:])
    want = gguf.quants.dequantize(raw, kind)
    assert np.array_equal(_bits(KB.dequantize_ref(x, int(kind) + KB.X16, 512)), _bits(want))
    # a stack: each matrix its own tiles
    stack = np.stack([raw, _rows(kind, 48, 512, 2)])
    assert np.array_equal(_tiles(stack, kind)[1], _tiles(stack[1], kind))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_as_stored_regroups_any_row_blocks_into_whole_tiles(kind):
    name = kind.name.lower()
    raw = _rows(kind, 64, 256, 3)
    pieces = [raw[:5], raw[5:21], raw[21:22], raw[22:64]]
    got = np.concatenate(list(as_stored(f"{name}_x16", iter(pieces))))
    assert np.array_equal(got, _tiles(raw, kind))
    assert list(as_stored(name, iter(pieces)))[1] is pieces[1]
    with pytest.raises(ValueError, match="not a whole tile"):
        list(as_stored(f"{name}_x16", iter([raw[:20]])))
    assert stored_kind("blk.0.ffn_down_exps", name, (8, 64, 256)) == f"{name}_x16"
    assert stored_kind("blk.0.ffn_down_exps", name, (8, 40, 256)) == name        # rows not whole tiles
    assert stored_kind("blk.0.attn_q", name, (64, 256)) == name
    assert stored_kind("output", name, (64, 256)) == name
    with pytest.raises(TypeError, match="interleaved"):
        BlockTensor(f"{name}_x16", _tiles(raw, kind))[3:5]
    assert stored_kind("blk.0.ffn_up_exps", "q5_k", (8, 64, 256)) == "q5_k"


def _acts(kind, T, n, rng):
    X = (rng.standard_normal((T, n)) * rng.uniform(0.1, 3.0, (T, 1))).astype(np.float32)
    Xq, Xd, Xs = np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
    KB.round_rows(int(kind), X, Xq, Xd, Xs)
    return X, Xq, Xd, Xs


# 20, 50: panels of the tiles (X16_Q6_PANEL_MIN_ROWS, X16_PANEL_MIN_ROWS)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 9, 13, 17, 20, 50])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_product_of_the_tiles_has_the_rows_bits(kind, T):
    d, n = 64, 1024
    raw = _rows(kind, d, n, T)
    x = read_only(_tiles(raw, kind))
    xk = int(kind) + KB.X16
    rng = np.random.default_rng(10 + T)
    X, Xq, Xd, Xs = _acts(kind, T, n, rng)
    tmp = np.zeros(KG.scratch_words(n), np.float32)
    # whole tiles, a range cutting two tiles, one inside a tile; = and += with alpha
    for i0, i1, alpha, acc in ((0, d, 1.0, False), (5, 40, 0.5, True), (17, 30, -2.0, False)):
        want = rng.standard_normal((T, d)).astype(np.float32)
        got = want.copy()
        KG.gemm_rows(raw, int(kind), X, Xq, Xd, Xs, want, tmp, np.int64(i0), i1, np.float32(alpha), np.bool_(acc))
        KG.gemm_rows(x, xk, X, Xq, Xd, Xs, got, tmp, np.int64(i0), i1, np.float32(alpha), np.bool_(acc))
        assert np.array_equal(_bits(got), _bits(want)), (i0, i1)
    # and on threads (each chunk whole tiles)
    one = np.zeros((T, d), np.float32)
    par = np.zeros((T, d), np.float32)
    KG.matmul_blocks(raw, int(kind), X, one, Xq, Xd, Xs, tmp, np.float32(1.0), False)
    KG.matmul_blocks_par(x, xk, X, par, Xq, Xd, Xs, np.zeros((3, KG.scratch_words(n)), np.float32),
                         np.float32(1.0), False)
    assert np.array_equal(_bits(par), _bits(one))


@pytest.mark.parametrize("down", KINDS, ids=lambda k: k.name)
def test_a_decode_tokens_experts_on_threads_have_the_rows_bits(down):
    """Q4_K_M's experts: gate and up Q4_K, down Q4_K or (the layers llama-quantize gives more bits) Q6_K."""
    E, I, D, A = 4, 256, 256, 2
    rng = np.random.default_rng(5)
    kinds = (Q.Q4_K, Q.Q4_K, down)
    r1, r3, r2 = (read_only(np.stack([_rows(kinds[k], 256, 256, 20 + 4 * k + e) for e in range(E)])) for k in (0, 1, 2))
    idx, wts = np.array([3, 1], np.int64), np.array([0.6, 0.4], np.float32)
    x = rng.standard_normal((1, D)).astype(np.float32)

    def run(w, ks):
        out = np.zeros((1, D), np.float32)
        KEB.experts_decode_par(w[0], ks[0], w[1], ks[1], w[2], ks[2], idx, wts, x, np.zeros((A, I), np.float32),
                               np.zeros((A, I), np.float32), out, np.zeros((1, D), np.int8),
                               np.zeros((1, D // 32), np.float32), np.zeros((1, D // 16), np.int32),
                               np.zeros((A, I), np.int8), np.zeros((A, I // 32), np.float32),
                               np.zeros((A, I // 16), np.int32), np.zeros((2, KG.scratch_words(max(I, D))), np.float32))
        return out
    want = run((r1, r3, r2), [int(k) for k in kinds])
    got = run(tuple(read_only(_tiles(r, k)) for r, k in zip((r1, r3, r2), kinds)), [int(k) + KB.X16 for k in kinds])
    assert np.array_equal(_bits(got), _bits(want))


def test_a_converted_models_tiled_experts_give_the_rows_logits(tmp_path, monkeypatch):
    H.build_hf_model("mixtral", tmp_path / "hf", hidden_size=256, intermediate_size=256)
    cfg = {**H.SMALL_CONFIGS["mixtral"], "hidden_size": 256, "intermediate_size": 256}

    def matrix(name, a):
        if a.ndim < 2 or a.shape[-1] % 256 or "ffn_gate_inp" in name:
            return a, Q.F32
        kind = Q.Q6_K if "ffn_down" in name or name == "output.weight" else Q.Q4_K    # as Q4_K_M's more-bits layers
        return quantized(a, kind, seed=len(name)), kind
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "mixtral", matrix_type=matrix, config=cfg)
    c, _ = convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "x16.colibri"), "f32", progress=False,
                        require_tokenizer=False)
    assert {n: k for n, k in c.block_types.items() if n.endswith("_exps") or n == "output"} == {
        **{f"blk.{i}.ffn_{p}_exps": "q4_k_x16" for i in range(cfg["num_hidden_layers"]) for p in ("gate", "up")},
        **{f"blk.{i}.ffn_down_exps": "q6_k_x16" for i in range(cfg["num_hidden_layers"])}, "output": "q6_k"}
    with monkeypatch.context() as mp:         # the same file with the experts as the GGUF's Q4_K rows
        mp.setattr("colibri_server.model.blocks.stored_kind", lambda name, kind, shape: kind)
        c, _ = convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "rows.colibri"), "f32", progress=False,
                            require_tokenizer=False)
    assert not {"q4_k_x16", "q6_k_x16"} & set(c.block_types.values())
    for threads in (1, 2):
        runs = []
        for f in ("x16", "rows"):
            m = Model.open(str(tmp_path / f"{f}.colibri"), threads=threads)
            cache = m.new_cache(64)
            m.prefill(cache, PROMPT)
            tokens = [m.decode(cache, t).copy() for t in (5, 9, 11)]          # the fused decode token
            runs.append([m.logits(PROMPT)] + tokens)
        for got, want in zip(*runs):
            assert np.array_equal(_bits(got), _bits(want)), threads
