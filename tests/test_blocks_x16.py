"""Q4_K expert matrices stored as 16-row tiles (q4_k_x16, kernels/blocks_x16): the same bytes moved, the same values
(the gguf package's dequantize of the Q4_K rows), and every product the Q4_K rows' bits: the tiles read as stored
(AVX-512 VNNI), a tile cut by a row range (its rows untiled through the row dots), threads, a step's experts in one
call and a decode token's; a converted model's logits are the Q4_K rows' bit for bit."""
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

X16 = int(Q.Q4_K) + KB.X16


def _q4k(d, n, seed):
    rng = np.random.default_rng(seed)
    return quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, Q.Q4_K, seed=seed)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_tiles_are_the_rows_bytes_moved_and_dequantize_to_gguf_values():
    raw = _q4k(48, 512, 1)
    x = KB.to_x16(raw)
    assert x.shape == raw.shape and not np.array_equal(x, raw)
    assert np.array_equal(np.sort(x, axis=None), np.sort(raw, axis=None))         # a permutation of the bytes
    assert np.array_equal(KB.from_x16(x), raw)
    # tile 1's block 1: dword q of row 16 + r at dword 16 q + r
    blk = x.reshape(3, 16 * 2 * 144)[1].view(np.uint32)[36 * 16:72 * 16].reshape(36, 16)
    assert np.array_equal(blk.T, raw[16:32].view(np.uint32)[:, 36:72])
    want = gguf.quants.dequantize(raw, Q.Q4_K)
    assert np.array_equal(_bits(KB.dequantize_ref(x, X16, 512)), _bits(want))
    # a stack: each matrix its own tiles
    stack = np.stack([raw, _q4k(48, 512, 2)])
    assert np.array_equal(KB.to_x16(stack)[1], KB.to_x16(stack[1]))


def test_as_stored_regroups_any_row_blocks_into_whole_tiles():
    raw = _q4k(64, 256, 3)
    pieces = [raw[:5], raw[5:21], raw[21:22], raw[22:64]]
    got = np.concatenate(list(as_stored("q4_k_x16", iter(pieces))))
    assert np.array_equal(got, KB.to_x16(raw))
    assert list(as_stored("q4_k", iter(pieces)))[1] is pieces[1]
    with pytest.raises(ValueError, match="not a whole tile"):
        list(as_stored("q4_k_x16", iter([raw[:20]])))
    assert stored_kind("blk.0.ffn_up_exps", "q4_k", (8, 64, 256)) == "q4_k_x16"
    assert stored_kind("blk.0.ffn_up_exps", "q4_k", (8, 40, 256)) == "q4_k"        # rows not whole tiles
    assert stored_kind("blk.0.attn_q", "q4_k", (64, 256)) == "q4_k"
    assert stored_kind("blk.0.ffn_up_exps", "q6_k", (8, 64, 256)) == "q6_k"
    with pytest.raises(TypeError, match="interleaved"):
        BlockTensor("q4_k_x16", KB.to_x16(raw))[3:5]


def _acts(T, n, rng):
    X = (rng.standard_normal((T, n)) * rng.uniform(0.1, 3.0, (T, 1))).astype(np.float32)
    Xq, Xd, Xs = np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
    KB.round_rows(int(Q.Q4_K), X, Xq, Xd, Xs)
    return X, Xq, Xd, Xs


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 9, 13, 17, 50])     # 50: panels of the tiles (X16_PANEL_MIN_ROWS)
def test_every_product_of_the_tiles_has_the_q4_k_rows_bits(T):
    d, n = 64, 1024
    raw = _q4k(d, n, T)
    x = read_only(KB.to_x16(raw))
    rng = np.random.default_rng(10 + T)
    X, Xq, Xd, Xs = _acts(T, n, rng)
    tmp = np.zeros(KG.scratch_words(n), np.float32)
    # whole tiles, a range cutting two tiles, one inside a tile; = and += with alpha
    for i0, i1, alpha, acc in ((0, d, 1.0, False), (5, 40, 0.5, True), (17, 30, -2.0, False)):
        want = rng.standard_normal((T, d)).astype(np.float32)
        got = want.copy()
        KG.gemm_rows(raw, int(Q.Q4_K), X, Xq, Xd, Xs, want, tmp, np.int64(i0), i1, np.float32(alpha), np.bool_(acc))
        KG.gemm_rows(x, X16, X, Xq, Xd, Xs, got, tmp, np.int64(i0), i1, np.float32(alpha), np.bool_(acc))
        assert np.array_equal(_bits(got), _bits(want)), (i0, i1)
    # and on threads (each chunk whole tiles)
    one = np.zeros((T, d), np.float32)
    par = np.zeros((T, d), np.float32)
    KG.matmul_blocks(raw, int(Q.Q4_K), X, one, Xq, Xd, Xs, tmp, np.float32(1.0), False)
    KG.matmul_blocks_par(x, X16, X, par, Xq, Xd, Xs, np.zeros((3, KG.scratch_words(n)), np.float32),
                         np.float32(1.0), False)
    assert np.array_equal(_bits(par), _bits(one))


def test_a_decode_tokens_experts_on_threads_have_the_q4_k_rows_bits():
    E, I, D, A = 4, 256, 256, 2
    rng = np.random.default_rng(5)
    r1, r3, r2 = (np.stack([_q4k(256, 256, 20 + 4 * k + e) for e in range(E)]) for k in (0, 1, 2))
    idx, wts = np.array([3, 1], np.int64), np.array([0.6, 0.4], np.float32)
    x = rng.standard_normal((1, D)).astype(np.float32)

    def run(w, kind):
        out = np.zeros((1, D), np.float32)
        KEB.experts_decode_par(w[0], kind, w[1], kind, w[2], kind, idx, wts, x, np.zeros((A, I), np.float32),
                               np.zeros((A, I), np.float32), out, np.zeros((1, D), np.int8),
                               np.zeros((1, D // 32), np.float32), np.zeros((1, D // 16), np.int32),
                               np.zeros((A, I), np.int8), np.zeros((A, I // 32), np.float32),
                               np.zeros((A, I // 16), np.int32), np.zeros((2, KG.scratch_words(max(I, D))), np.float32))
        return out
    want = run((r1, r3, r2), int(Q.Q4_K))
    got = run(tuple(read_only(KB.to_x16(r)) for r in (r1, r3, r2)), X16)
    assert np.array_equal(_bits(got), _bits(want))


def test_a_converted_models_tiled_experts_give_the_q4_k_rows_logits(tmp_path, monkeypatch):
    H.build_hf_model("mixtral", tmp_path / "hf", hidden_size=256, intermediate_size=256)
    cfg = {**H.SMALL_CONFIGS["mixtral"], "hidden_size": 256, "intermediate_size": 256}

    def matrix(name, a):
        if a.ndim < 2 or a.shape[-1] % 256 or "ffn_gate_inp" in name:
            return a, Q.F32
        return quantized(a, Q.Q4_K, seed=len(name)), Q.Q4_K
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "mixtral", matrix_type=matrix, config=cfg)
    c, _ = convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "x16.colibri"), "f32", progress=False,
                        require_tokenizer=False)
    assert {k for n, k in c.block_types.items() if n.endswith("_exps")} == {"q4_k_x16"}
    with monkeypatch.context() as mp:         # the same file with the experts as the GGUF's Q4_K rows
        mp.setattr("colibri_server.model.blocks.stored_kind", lambda name, kind, shape: kind)
        c, _ = convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "rows.colibri"), "f32", progress=False,
                            require_tokenizer=False)
    assert "q4_k_x16" not in c.block_types.values()
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
