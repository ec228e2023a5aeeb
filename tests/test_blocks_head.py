"""The output head's products (kernels/blocks_wide): a block-kind head multiplied by its input rounded to int16,
not to int8 as llama.cpp rounds it. Its logits are about 258 times nearer the f32 product; where the int8
rounding swaps two near candidates it keeps the f32 order; every caller (one row, a batch of rows, threads,
prefill or decode) gets the same bits; and it is the default, `exact_head = false` giving llama.cpp's."""
from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
from blocks_data import Q, quantized, read_only
from test_gguf_import import PROMPT, write_gguf

from colibri_server.model import Model
from colibri_server.model.blocks import BlockTensor
from colibri_server.model.gguf_import import convert_gguf
from colibri_server.model.kernels import blocks as KB
from colibri_server.model.kernels import blocks_gemm as KG
from colibri_server.model.kernels import experts_blocks as KEB

FAST = [Q.Q8_0, Q.Q6_K, Q.Q4_0, Q.Q4_K, Q.Q5_K]          # the kinds with integer dots (kernels/blocks.FAST)


def _product(raw, kind, X, par=False):
    """X (T, n) @ the block matrix raw through matmul_blocks (kind as the kernels take it: + ACTS16 or not)."""
    T, n = X.shape
    out = np.zeros((T, raw.shape[0]), np.float32)
    wq = 2 * n if kind & KB.ACTS16 else n                       # the rounded input's bytes a row (matmul_blocks)
    Xq, Xd, Xs = np.zeros((T, wq), np.int8), np.zeros((T, n // 32), np.float32), np.zeros((T, n // 16), np.int32)
    if par:
        KG.matmul_blocks_par(raw, kind, X, out, Xq, Xd, Xs, np.zeros((2, KG.scratch_words(n)), np.float32),
                             np.float32(1.0), False)
    else:
        KG.matmul_blocks(raw, kind, X, out, Xq, Xd, Xs, np.zeros(KG.scratch_words(n), np.float32), np.float32(1.0),
                         False)
    return out


def _ref(raw, kind, X):
    """The exact product in float64 of the dequantized rows with the f32 activations."""
    W = KB.dequantize_ref(raw, int(kind), X.shape[1]).astype(np.float64)
    return X.astype(np.float64) @ W.T


@pytest.mark.parametrize("kind", FAST + [Q.Q4_1, Q.IQ4_XS], ids=lambda k: k.name)
def test_the_int16_product_is_258_times_nearer_the_f32_product_than_int8(kind):
    rng = np.random.default_rng(21)
    d, n, T = 64, 1024, 3
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=7)
    X = rng.standard_normal((T, n)).astype(np.float32) * rng.uniform(0.2, 4.0, (T, n // 256, 1)).repeat(256, 1).reshape(
        T, n).astype(np.float32)
    ref = _ref(raw, kind, X)
    wide, int8 = _product(raw, int(kind) + KB.ACTS16, X), _product(raw, int(kind), X)
    W = np.abs(KB.dequantize_ref(raw, int(kind), n).astype(np.float64))
    if int(kind) not in KB.FAST:            # no integer dots: the f32 activations either way, the same bits
        assert np.array_equal(wide, int8)
        return
    B = 256 if int(kind) in KB.KROUND else 32
    step = np.abs(X.reshape(T, -1, B)).max(axis=2) / 32767 / 2                       # half an int16 step (T, n/B)
    bound = np.repeat(step, B, axis=1) @ W.T * 1.001 + np.abs(X).astype(np.float64) @ W.T * 1e-6 + 1e-6
    assert (np.abs(wide - ref) <= bound).all()
    rms8, rms16 = np.sqrt(((int8 - ref) ** 2).mean()), np.sqrt(((wide - ref) ** 2).mean())
    assert rms8 / rms16 > 150, (rms8, rms16)             # 32767 / 127 = 258 steps; measured 200-280


@pytest.mark.parametrize("kind", FAST, ids=lambda k: k.name)
def test_the_head_keeps_the_f32_order_of_two_near_candidates_that_int8_swaps(kind):
    """Among random rows, two whose f32 logits are near (their gap above twice the int16 rounding's largest
    possible error) and whose order the int8 rounding of the input swaps: a head of just those two picks the
    f32 argmax."""
    rng = np.random.default_rng(int(kind))
    d, n = 2048, 512
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=3)
    x = rng.standard_normal((1, n)).astype(np.float32)
    ref = _ref(raw, kind, x)[0]
    int8 = _product(raw, int(kind), x)[0]
    B = 256 if int(kind) in KB.KROUND else 32
    step = np.repeat(np.abs(x.reshape(-1, B)).max(axis=1) / 32767 / 2, B)            # half an int16 step a column
    bound16 = np.abs(KB.dequantize_ref(raw, int(kind), n).astype(np.float64)) @ step + 1e-6   # per row
    order = np.argsort(ref)
    pairs = [(order[k + 1], order[k]) for k in range(d - 1)          # (higher, lower) neighbours in f32
             if ref[order[k + 1]] - ref[order[k]] > 2 * (bound16[order[k + 1]] + bound16[order[k]])
             and int8[order[k + 1]] < int8[order[k]]]
    assert pairs, "no pair of near candidates swapped by the int8 rounding"
    hi, lo = pairs[0]
    head = read_only(raw[[lo, hi]])                                      # the f32 argmax is row 1
    assert _product(head, int(kind), x)[0].argmax() == 0                 # llama.cpp's rounding: the other one
    got = _product(head, int(kind) + KB.ACTS16, x)[0]
    assert got.argmax() == 1 and got[1] - got[0] > 0.5 * (ref[hi] - ref[lo])


@pytest.mark.parametrize("kind", FAST, ids=lambda k: k.name)
def test_every_caller_gets_the_same_bits(kind):
    """Rows of a batch (13: the int16 Q8_0 / Q4_0 / Q6_K tiles' count, 3 tiles of 16 weight rows and 5 row dots; Q4_K
    and Q5_K 8 rows a weight row at once, then 5 one by one), each row alone (a k-quant's weight rows 8 at a time,
    blocks_wide's _krows8, then 5 one by one), and the rows split over threads: the same bits."""
    rng = np.random.default_rng(4)
    d, n, T = 53, 768, 13
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=5)
    X = rng.standard_normal((T, n)).astype(np.float32)
    k = int(kind) + KB.ACTS16
    batch = _product(raw, k, X)
    assert T >= KG.WIDE_TILE_MIN_ROWS
    for t in range(T):
        assert np.array_equal(_product(raw, k, X[t:t + 1])[0].view(np.uint32), batch[t].view(np.uint32)), t
    assert np.array_equal(_product(raw, k, X, par=True), batch)
    assert np.array_equal(_product(raw, k, X[2:3], par=True)[0], batch[2])


def test_the_q6_k_head_tiles_keep_exact_sums_at_the_extremes():
    """The Q6_K head's tiles (kernels/blocks_head) at the bounds their i32 sums are sized for: every scale -128, the
    values all 63 or all 0 (31 or -32 after the offset) row by row, the int16 activations all +-32767 (a constant
    magnitude: each block's max), two rows of one sign and the others' signs in runs: each output the bits of its row alone (the row
    dots' i64 sums), and the float64 product of the dequantized weights within the float steps' rounding."""
    from colibri_server.model.kernels import blocks_head as KH
    d, n, T = 48, 512, 7                       # 3 tiles; passes of 4 and 3 rows
    assert T >= KH.HEAD_TILE_MIN_ROWS
    block = np.zeros(210, np.uint8)
    block[192:208] = np.array([-128] * 16, np.int8).view(np.uint8)                   # the 16 group scales
    block[208:210] = np.array([1.0], np.float16).view(np.uint8)                       # d
    rows = []
    for r in range(d):
        b = block.copy()
        b[:192] = 255 if r % 3 else 0          # ql and qh all ones (values 63) or all zeros (0)
        rows.append(np.tile(b, n // 256))
    raw = read_only(np.stack(rows))
    signs = np.where((np.arange(n)[None, :] // (1 + np.arange(T)[:, None])) % 2 == 0, 1.0, -1.0)
    signs[0], signs[1] = 1.0, -1.0             # the largest sums: every value of a row one sign
    X = (signs * 3.0).astype(np.float32)
    k = int(Q.Q6_K) + KB.ACTS16
    batch = _product(raw, k, X)
    for t in range(T):
        assert np.array_equal(_product(raw, k, X[t:t + 1])[0].view(np.uint32), batch[t].view(np.uint32)), t
    ref = _ref(raw, Q.Q6_K, X)
    assert np.abs(batch - ref).max() <= 1e-5 * np.abs(ref).max()


def _head_model(tmp_path, head):
    """A small Mixtral GGUF: its matrices Q4_K, but attn_v and the second layer's ffn_down in Q6_K as llama-quantize's
    Q4_K_M has them (a kind that differs between layers), the output head in `head`, converted with the defaults."""
    c = {**H.SMALL_CONFIGS["mixtral"], "hidden_size": 256, "intermediate_size": 256}
    H.build_hf_model("mixtral", tmp_path / "hf", hidden_size=256, intermediate_size=256)

    def matrix(name, a):
        if a.ndim < 2 or "ffn_gate_inp" in name:
            return a, Q.F32
        k = head if name == "output.weight" else Q.Q6_K if "attn_v" in name or "blk.1.ffn_down" in name else Q.Q4_K
        return quantized(a, k, seed=len(name)), k
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "mixtral", matrix_type=matrix, config=c)
    convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "m.colibri"), "f32", progress=False, require_tokenizer=False)
    return str(tmp_path / "m.colibri")


@pytest.mark.parametrize("head", [Q.Q8_0, Q.Q6_K], ids=lambda k: k.name)
def test_the_int16_head_is_the_default_and_every_path_gets_its_bits(tmp_path, head):
    """The model's own head: on by default; a batch of hidden rows (a serving step's, a prefill's) and each row
    alone (decode) through the workspace every path calls, on one and two threads: the same bits; decode's
    logits on one and two threads the same bits, the fused token's (decode_step) those of forward's general
    path, and near the prefill's; exact_head false: llama.cpp's."""
    from colibri_server.model.decode_step import DecodeStep
    from colibri_server.model.transformer import forward
    path = _head_model(tmp_path, head)
    m = Model.open(path)
    assert isinstance(m.weights.output, BlockTensor) and m.weights.output.acts16       # the default
    assert m.weights.output.ggml == int(head) + KB.ACTS16 and not m.weights.layers[0].wq.acts16
    hs = np.random.default_rng(2).standard_normal((6, m.config.hidden_size)).astype(np.float32)
    V = m.config.vocab_size
    batch = m.workspace.mm(hs, m.weights.output, np.zeros((6, V), np.float32))
    two = Model.open(path, threads=2)
    two.workspace.PAR_MIN_WEIGHTS = 0                       # the head's rows over the threads even this small
    assert np.array_equal(two.workspace.mm(hs, two.weights.output, np.zeros((6, V), np.float32)), batch)
    for t in range(6):
        for w in (m, two):
            one = w.workspace.mm(hs[t:t + 1], w.weights.output, np.zeros((1, V), np.float32))
            assert np.array_equal(one[0].view(np.uint32), batch[t].view(np.uint32)), t
    full = m.logits(PROMPT)
    runs = []
    for threads in (1, 2):
        m = Model.open(path, threads=threads)
        assert isinstance(m.workspace.decode_step(m.config, m.weights), DecodeStep)     # block kinds: fused
        for trace in (None, []):                    # a routing trace keeps forward on its general path
            c = m.new_cache(64)
            m.prefill(c, PROMPT[:8])
            runs.append(np.stack([forward(m.config, m.weights, m.rope, m.workspace, c, tokens=np.array([t]),
                                          trace=trace)[0].copy() for t in PROMPT[8:14]]))
        assert trace
    for r in runs[1:]:
        assert np.array_equal(r.view(np.uint32), runs[0].view(np.uint32))
    assert np.abs(runs[0][:-1] - full[8:13]).max() < 1e-4 * np.abs(full).max()
    assert not m.set_exact_head(False) and not m.weights.output.acts16                # llama.cpp's rounding
    c = m.new_cache(64)
    m.prefill(c, PROMPT[:8])
    int8 = m.decode(c, PROMPT[8])[0]
    assert not np.array_equal(int8, runs[1][0]) and np.abs(int8 - runs[1][0]).max() < 0.05 * np.abs(int8).max()


@pytest.mark.slow          # the threaded block kernels' cold compile: minutes on a loaded core
def test_a_block_models_threaded_kernels_are_compiled_before_fork(tmp_path):
    """compile_threaded (a pre-fork master's) compiles the block kinds' threaded kernels for the types a 2-thread
    worker's workspace gives them (mm_blocks on one and a few rows, a decode token's experts, a step's q, k and v in
    one region), so a worker compiles none at its first requests: compiled there, they stalled a first 16-client
    burst on Q4_K_M for 26 s."""
    import numba

    from colibri_server.model.transformer import Workspace
    m = Model.open(_head_model(tmp_path, Q.Q8_0))
    m.compile_threaded()
    ws = Workspace(m.config, 4, threads=2)
    L = m.weights.layers[0]
    mm = {tuple(s) for s in KG.matmul_blocks_par.signatures}
    for W in (L.wq, L.w2[0], m.weights.output):
        for T in (1, 2):
            args = ws.mm_blocks_args(np.zeros((T, W.shape[1]), np.float32), W, np.zeros((T, W.shape[0]), np.float32))
            assert tuple(numba.typeof(a) for a in args) in mm, (W.shape, T)
    args = ws.experts_blocks_args(L, np.zeros(2, np.int64), np.zeros(2, np.float32), ws.x[0], ws.h[0])
    assert tuple(numba.typeof(a) for a in args) in {tuple(s) for s in KEB.experts_decode_par.signatures}
    args = ws.qkv_blocks_args(ws.h[:3], L, ws.q[:3], ws.k[:3], ws.v[:3])     # a step's q, k and v in one region
    assert tuple(numba.typeof(a) for a in args) in {tuple(s) for s in KG.matmul3_blocks_par.signatures}


def test_decode_on_two_threads_gives_the_one_thread_bits(tmp_path):
    """A model of five block kinds mixed matrix by matrix (q, k, v, the experts' three each their own): its fused
    decode token on two threads gives the one-thread bits, also with every matrix on the threads (q, k and v then in
    one parallel region, each on its kind's rounding of the input). Here, beside the head's tests, so that the same worker
    runs it after them and loads the block-kind token they compiled rather than waiting on that compile."""
    from test_blocks_convert import _cfg, _hf
    hf = _hf(tmp_path)
    kinds = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_K]

    def mixed(name, a):
        if a.ndim < 2 or "ffn_gate_inp" in name:
            return a, Q.F32
        k = kinds[sum(map(ord, name)) % len(kinds)]
        return quantized(a * 0.5, k, seed=len(name)), k
    write_gguf(hf, tmp_path / "m.gguf", "mixtral", matrix_type=mixed, config=_cfg())
    convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "b.colibri"), "f32", quantize="blocks", progress=False,
                 require_tokenizer=False)
    runs = []
    for threads, par_min in ((1, None), (2, None), (2, 0)):
        m = Model.open(str(tmp_path / "b.colibri"), threads=threads)
        if par_min is not None:     # every matrix on the threads, q, k and v in one region (matmul3_blocks_par)
            m.workspace.PAR_MIN_WEIGHTS = par_min
        c = m.new_cache(64)
        m.prefill(c, PROMPT[:8])
        runs.append(np.stack([m.decode(c, t)[0].copy() for t in PROMPT[8:14]]))
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])
