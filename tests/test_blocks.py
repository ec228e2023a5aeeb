"""llama.cpp's block kinds kept as they are: the dequantizers bit for bit against the `gguf` package,
the integer-dot products against the dequantized f32 product within the activations' rounding, and a
GGUF of mixed block types converted with --quantize blocks: the file holds the GGUF's bytes (its
size), and its logits match a model converted from the gguf package's dequantized values."""
from __future__ import annotations

import zlib

import gguf
import hf_models as H
import numpy as np
import pytest
from blocks_data import KINDS, Q, int8_rounded_products, quantized
from test_gguf_import import PROMPT, write_gguf

from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model.blocks import BASE, BY_GGML, BlockTensor
from colibri_server.model.blocks import KINDS as BLOCK_KINDS
from colibri_server.model.gguf_import import convert_gguf
from colibri_server.model.kernels import blocks as KB
from colibri_server.model.kernels import blocks_gemm as KG
from colibri_server.model.kernels import blocks_small as KS


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_dequantizer_is_bit_exact_against_gguf(kind):
    a = np.random.default_rng(int(kind)).standard_normal((6, 1024)).astype(np.float32) * 0.05
    raw = quantized(a, kind, seed=int(kind))
    ref = gguf.quants.dequantize(raw, kind)
    got = KB.dequantize_ref(raw, int(kind), 1024)
    assert np.isfinite(ref).all()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_the_table_matches_gguf():
    for kind in KINDS:
        bk = BY_GGML[int(kind)]
        assert (bk.block, bk.size) == gguf.GGML_QUANT_SIZES[kind] and bk.name == kind.name.lower()
    # and the ones stored as tiles: Q4_K's and Q6_K's blocks, 16 rows interleaved (kernels/blocks.to_x16)
    assert set(BLOCK_KINDS) == {k.name.lower() for k in KINDS} | {"q4_k_x16", "q6_k_x16"}
    for base, size in ((Q.Q4_K, 144), (Q.Q6_K, 210)):
        x = BLOCK_KINDS[f"{base.name.lower()}_x16"]
        assert (x.block, x.size, x.ggml) == (256, size, int(base) + KB.X16) and BASE[x.name] == base.name.lower()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_products_equal_the_dequantized_product_within_the_rounding(kind):
    rng = np.random.default_rng(7)
    d, n, T = 48, 512, 3
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=3)
    X = rng.standard_normal((T, n)).astype(np.float32)
    ref = KB.matmul_blocks_ref(raw, int(kind), X)
    out = np.zeros((T, d), np.float32)
    Xq, Xd, Xs = np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
    KG.matmul_blocks(raw, int(kind), X, out, Xq, Xd, Xs, np.zeros(KG.scratch_words(n), np.float32), np.float32(1.0), False)
    W = KB.dequantize_ref(raw, int(kind), n).astype(np.float64)
    if int(kind) in KB.FAST:
        # activations rounded to int8 per 32 (256): at most half a step (max|x_b|/127/2) per value, times |w|
        B = 256 if int(kind) in KB.KROUND else 32
        step = np.abs(X.reshape(T, -1, B)).max(axis=2) / 127 / 2                    # (T, n/B)
        bound = (np.repeat(step, B, axis=1) @ np.abs(W).T) * 1.001 + 1e-5
    else:
        bound = np.abs(X).astype(np.float64) @ np.abs(W).T * 1e-6 + 1e-6                 # f32 sums only
    assert (np.abs(out - ref) <= bound).all()
    one = np.zeros((1, d), np.float32)                                                 # one row: the same bits
    KG.matmul_blocks(raw, int(kind), X[1:2], one, Xq[:1], Xd[:1], Xs[:1], np.zeros(KG.scratch_words(n), np.float32), np.float32(1.0),
                     False)
    assert np.array_equal(one[0], out[1])


@pytest.mark.skipif(not KG.B32_TILES, reason="the tiled product runs on AVX-512 VNNI and AVX2 only")
@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda k: k.name)
def test_the_tiled_product_gives_each_rows_matvec_bits(kind):
    # 53 weight rows: 3 tiles of 16 and 5 rows through the row dots; 9, 10, 11 rows of X: 2 passes of 4 and a last
    # pass of 1, 2 or 3 rows (the k-quants, and Q8_0 on AVX2; the other 32-block kinds pass 2 rows at a time)
    for T in (9, 10, 11):
        _tiled_rows_are_the_matvecs(kind, T)


def _tiled_rows_are_the_matvecs(kind, T):
    rng = np.random.default_rng(11)
    d, n = 53, 768
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=5)
    X = rng.standard_normal((T, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (T, 1)).astype(np.float32)

    def scratch(t):
        return (np.zeros((t, n), np.int8), np.zeros((t, n // 32), np.float32), np.zeros((t, n // 16), np.int32),
                np.zeros(KG.scratch_words(n), np.float32))
    assert T >= KG.GEMM_MIN_ROWS and T > KS.SMALL_MAX_ROWS
    out = np.full((T, d), 0.5, np.float32)
    KG.matmul_blocks(raw, int(kind), X, out, *scratch(T), np.float32(0.75), True)
    for t in range(T):
        one = np.full((1, d), 0.5, np.float32)
        KG.matmul_blocks(raw, int(kind), X[t:t + 1], one, *scratch(1), np.float32(0.75), True)     # the row dots
        assert np.array_equal(one[0].view(np.uint32), out[t].view(np.uint32)), t
    ref = KB.matmul_blocks_ref(raw, int(kind), X)
    W = np.abs(KB.dequantize_ref(raw, int(kind), n).astype(np.float64))
    B = 256 if int(kind) in KB.KROUND else 32
    step = np.abs(X.reshape(T, -1, B)).max(axis=2) / 127 / 2
    bound = (np.repeat(step, B, axis=1) @ W.T) * 1.001 + 1e-5
    assert (np.abs((out - 0.5) / 0.75 - ref) <= bound * 1.01 + 1e-5).all()


@pytest.mark.parametrize("block", [32, 256])
def test_activation_rounding_is_llama_cpps_and_a_nan_reaches_the_scale(block):
    # kernels/blocks.round_rows (every block-kind product's int8 activations): per block, d = max|x| / 127 in f32,
    # x * (1/d) rounded to nearest even (nothing when the block is all zeros), the 16-sums of the integers; a block
    # holding a NaN gets d = NaN, so the products it enters are NaN (the worker's non-finite check sees it) rather
    # than a finite number from a NaN rounded to some integer
    kind = int(Q.Q4_K if block == 256 else Q.Q8_0)
    rng = np.random.default_rng(23)
    T, n = 5, 1024
    X = (rng.standard_normal((T, n)) * rng.uniform(0.01, 30.0, (T, n // block)).repeat(block, 1)).astype(np.float32)
    X[1, :block] = 0.0                                      # a block of zeros
    X[2, 3] = np.float32(1e-40)                             # a denormal maximum
    X[3, block + 1] = np.nan
    Xq, Xd, Xs = np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
    KB.round_rows(kind, X, Xq, Xd, Xs)
    xb = X.reshape(T, -1, block)
    d = np.abs(xb).max(-1) / np.float32(127)                # NaN where the block holds one
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.rint(xb * inv[..., None])
    nb = n // block
    assert np.array_equal(Xd[:, :nb].view(np.uint32), d.astype(np.float32).view(np.uint32))
    assert np.isnan(Xd[3, 1]) and np.isfinite(np.delete(Xd[:, :nb], 3 * nb + 1)).all()
    ok = np.isfinite(d)                                     # the NaN's block: its integers are not defined
    assert np.array_equal(Xq.reshape(T, nb, block)[ok], q[ok].astype(np.int8))
    assert np.array_equal(Xs.reshape(T, nb, block // 16)[ok], q[ok].reshape(-1, block // 16, 16).sum(-1))
    assert (Xq[1, :block] == 0).all() and Xd[1, 0] == 0


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda k: k.name)
def test_the_small_row_product_gives_each_rows_matvec_bits(kind):
    # kernels/blocks_small: one weight row against passes of 8, 7..2 activation rows (a last single one: the row
    # dot), each block unpacked once for all of them; Q8_0 / Q4_0 over 25 blocks: 3 vectors of 8 and one alone
    rng = np.random.default_rng(13)
    d, n = 37, 768 if int(kind) in KB.KROUND else 800
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=7)

    def scratch(t):
        return (np.zeros((t, n), np.int8), np.zeros((t, n // 32), np.float32), np.zeros((t, n // 16), np.int32),
                np.zeros(KG.scratch_words(n), np.float32))
    for T in list(range(2, 10)) + [15, 19]:
        X = rng.standard_normal((T, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (T, 1)).astype(np.float32)
        Xq, Xd, Xs, tmp = scratch(T)
        KB.round_rows(int(kind), X, Xq, Xd, Xs)
        out = np.full((T, d), 0.5, np.float32)
        KS.small_rows(raw, int(kind), X, Xq, Xd, Xs, out, tmp, 0, d, np.float32(0.75), True)
        for t in range(T):
            one = np.full((1, d), 0.5, np.float32)
            KG.matmul_blocks(raw, int(kind), X[t:t + 1], one, *scratch(1), np.float32(0.75), True)   # the row dots
            assert np.array_equal(one[0].view(np.uint32), out[t].view(np.uint32)), (T, t)
        if T <= KS.SMALL_MAX_ROWS:              # matmul_blocks takes it for so few rows: the same bits
            got = np.full((T, d), 0.5, np.float32)
            KG.matmul_blocks(raw, int(kind), X, got, *scratch(T), np.float32(0.75), True)
            assert np.array_equal(got.view(np.uint32), out.view(np.uint32)), T


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_a_decode_tokens_eight_row_product_gives_each_rows_dot_bits(kind):
    # kernels/blocks_rows8: one activation row against 8 weight rows at a time (19 rows from row 2: 2 groups of 8, then
    # 1 row alone), their integers folded into one vector: each output is the row dot's, bit for bit
    rng = np.random.default_rng(17)
    d, n = 21, 1280
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=9)
    x = rng.standard_normal((1, n)).astype(np.float32) * 2.5
    xq, xd, xs = np.zeros((1, n), np.int8), np.zeros((1, n // 32), np.float32), np.zeros((1, n // 16), np.int32)
    KB.round_rows(int(kind), x, xq, xd, xs)
    tmp = np.zeros(KG.scratch_words(n), np.float32)
    out = np.full((1, d), 0.5, np.float32)
    KB._rows(raw, int(kind), x, xq, xd, xs, out, tmp, 2, d, np.float32(0.75), True)
    want = np.array([np.float32(0.5) + np.float32(0.75) * KB.row_dot(int(kind), raw[i], x[0], xq[0], xd[0], xs[0], tmp)
                     for i in range(2, d)], np.float32)
    assert np.array_equal(out[0, 2:].view(np.uint32), want.view(np.uint32))
    assert (out[0, :2] == 0.5).all()


def test_a_decode_tokens_q4_0_rows_on_swizzled_activations_give_each_rows_dot_bits():
    # kernels/blocks._rows_q4_0 at one activation row where the CPU has AVX-512 VBMI: the activations swizzled once
    # (blocks_row32.acts_q4_0_swizzle), then 8 blocks a step with no fold across blocks (row_q4_0_sw); 1056 columns:
    # 4 groups of 8 blocks and one block alone. Each output is the one-row dot's (kernels/blocks.row_dot), bit for
    # bit, and a scratch too small for the swizzled activations takes that dot
    rng = np.random.default_rng(19)
    d, n = 19, 1056
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, Q.Q4_0, seed=11)
    x = rng.standard_normal((1, n)).astype(np.float32) * 2.5
    xq, xd, xs = np.zeros((1, n), np.int8), np.zeros((1, n // 32), np.float32), np.zeros((1, n // 16), np.int32)
    KB.round_rows(int(Q.Q4_0), x, xq, xd, xs)
    want = np.array([np.float32(0.5) + np.float32(0.75) * KB.row_dot(int(Q.Q4_0), raw[i], x[0], xq[0], xd[0], xs[0],
                                                                        np.zeros(16, np.float32))
                     for i in range(2, d)], np.float32)
    ref = KB.matmul_blocks_ref(raw, int(Q.Q4_0), x)[0, 2:]
    assert np.abs(want - 0.5 - 0.75 * ref).max() < 0.01 * np.abs(ref).max()
    for words in (KG.scratch_words(n), 16 + n // 4 - 1):       # the swizzled activations, and no room for them
        out = np.full((1, d), 0.5, np.float32)
        KB._rows(raw, int(Q.Q4_0), x, xq, xd, xs, out, np.zeros(words, np.float32), 2, d, np.float32(0.75), True)
        assert np.array_equal(out[0, 2:].view(np.uint32), want.view(np.uint32)), words
        assert (out[0, :2] == 0.5).all()


def _mixed(name, a):
    """Every matrix in a block kind (the kinds in turn, by name), where its columns are whole blocks."""
    kinds = [k for k in KINDS if a.shape[-1] % gguf.GGML_QUANT_SIZES[k][0] == 0]
    if a.ndim < 2 or not kinds or "ffn_gate_inp" in name:
        return a, Q.F32
    kind = kinds[zlib.crc32(name.encode()) % len(kinds)]
    return quantized(a, kind, seed=zlib.crc32(name.encode())), kind


def test_a_gguf_of_mixed_block_types_keeps_them_and_runs(tmp_path, monkeypatch):
    c = {**H.SMALL_CONFIGS["mixtral"], "hidden_size": 256}
    H.build_hf_model("mixtral", tmp_path / "hf", hidden_size=256)
    write_gguf(tmp_path / "hf", tmp_path / "mixed.gguf", "mixtral", matrix_type=_mixed, config=c)

    def dequantized(name, a):
        b, t = _mixed(name, a)
        return (gguf.quants.dequantize(b, t) if t != Q.F32 else a), Q.F32
    write_gguf(tmp_path / "hf", tmp_path / "ref.gguf", "mixtral", matrix_type=dequantized, config=c)
    reader = gguf.GGUFReader(str(tmp_path / "mixed.gguf"))
    used = {t.tensor_type for t in reader.tensors} - {Q.F32}
    assert len(used) >= 8
    convert_gguf(str(tmp_path / "mixed.gguf"), str(tmp_path / "b.colibri"), "f32", quantize="blocks",
                            progress=False, require_tokenizer=False)
    convert_gguf(str(tmp_path / "ref.gguf"), str(tmp_path / "ref.colibri"), "f32", quantize="none", progress=False,
                 require_tokenizer=False)
    cf = fmt.ColibriFile.open(tmp_path / "b.colibri")
    assert cf.header["version"] == 3
    kept = {r.dtype for r in cf.record_list} & fmt.BLOCK_DTYPES
    assert {BASE.get(k, k) for k in kept} == {t.name.lower() for t in used}
    for t in reader.tensors:               # the GGUF's bytes, unchanged (q/k rows aside: unpermuted; Q4_K, Q6_K experts as tiles)
        ours = "token_embd" if t.name == "token_embd.weight" else t.name[:-len(".weight")]
        if t.tensor_type != Q.F32 and not ours.endswith(("attn_q", "attn_k")) and ours in cf.records:
            stored = cf.view(ours)
            if cf.records[ours].dtype in BASE:
                stored = KB.from_x16(stored, BLOCK_KINDS[cf.records[ours].dtype].size)
            assert stored.tobytes() == np.asarray(t.data).tobytes(), ours
    cf.close()
    m = Model.open(str(tmp_path / "b.colibri"))
    assert isinstance(m.weights.layers[0].w1, BlockTensor)
    assert isinstance(m.weights.output, BlockTensor) and m.weights.output.acts16  # int16 (tests/test_blocks_head)
    assert not m.set_exact_head(False) and not m.weights.output.acts16             # llama.cpp's rounding
    assert m.set_exact_head(True) and m.weights.output.acts16 and not m.weights.token_embd.acts16
    got = Model.open(str(tmp_path / "b.colibri")).logits(PROMPT)
    exact = Model.open(str(tmp_path / "ref.colibri")).logits(PROMPT)
    int8_rounded_products(monkeypatch)
    ref = Model.open(str(tmp_path / "b.colibri")).logits(PROMPT)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 5e-3, err                # f32 sums against float64 (measured 1.5e-3 on the llama-quantize'd file)
    assert (got.argmax(-1) == exact.argmax(-1)).mean() >= 0.9    # and the rounding itself stays small


@pytest.mark.parametrize("kinds", [(Q.Q4_K, Q.Q8_0, Q.Q8_0), (Q.Q4_K, Q.Q4_0, Q.Q4_0), (Q.Q8_0, Q.Q8_0, Q.Q6_K),
                                   (Q.Q6_K, Q.Q4_K, Q.Q8_0), (Q.Q4_K, Q.Q5_K, Q.Q6_K)],
                         ids=lambda ks: "-".join(k.name for k in ks))
@pytest.mark.parametrize("T", [1, 3, 16, 40])       # from 16 rows rounded on the threads (PAR_ROUND_MIN_ROWS)
def test_q_k_and_v_in_one_parallel_region_are_three_products_bit_for_bit(kinds, T):
    """blocks_gemm.matmul3_blocks_par (a decode token's q, k and v in one parallel region, each on its kind's rounding of
    the input: rounded once per rounding the three take, whichever of them share one) gives each matrix's own
    matmul_blocks bits."""
    rng = np.random.default_rng(3)
    n, dims = 512, (96, 48, 64)
    raws = [quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, k, seed=d) for d, k in zip(dims, kinds)]
    X = rng.standard_normal((T, n)).astype(np.float32)
    tmps = np.zeros((2, KG.scratch_words(n)), np.float32)
    ref = []
    for raw, k in zip(raws, kinds):
        out = np.zeros((T, raw.shape[0]), np.float32)
        KG.matmul_blocks(raw, int(k), X, out, np.zeros((T, n), np.int8), np.zeros((T, n // 32), np.float32),
                         np.zeros((T, n // 16), np.int32), tmps[0], np.float32(1.0), False)
        ref.append(out)
    outs = [np.full((T, d), np.nan, np.float32) for d in dims]
    KG.matmul3_blocks_par(raws[0], int(kinds[0]), raws[1], int(kinds[1]), raws[2], int(kinds[2]), X, *outs,
                          np.zeros((3 * T, n), np.int8), np.zeros((3 * T, n // 32), np.float32),
                          np.zeros((3 * T, n // 16), np.int32), tmps)
    for got, want in zip(outs, ref):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
