"""The serving step's kernels against their numpy twins: rowgemm (X (B,n) @ W.T, each weight row read
once for the batch; f32/f16/bf16, rows or panels, threads) and the paged KV cache (write_kv,
tiled_attention over block tables, f32 and f16 pools, sliding windows, threads)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_server.model.kernels import paged as KP
from colibri_server.model.kernels import rowgemm as RG
from colibri_server.model.kernels import tiled as KT
from colibri_server.model.kernels.packing import to_panels

NO_SINKS = np.zeros(0, np.float32)      # attention without GPT-OSS sinks
NO_SINKS.setflags(write=False)   # read-only as a model's absent sinks (model/weights): the kernels' one signature


def _weights(kind, d, n, rng):
    w = (rng.standard_normal((d, n)) * 0.1).astype(np.float32)
    if kind == "f16":
        bits = w.astype(np.float16).view(np.uint16)
        return bits, bits.view(np.float16).astype(np.float32)
    if kind == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        return bits, (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return w, w


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["rows", "panels"])
def test_rowgemm_is_the_product_for_every_batch_size(kind, layout):
    rng = np.random.default_rng(0)
    d, n = 37, 512                                     # an odd row count: the 1-row tail
    bits, logical = _weights(kind, d, n, rng)
    P = to_panels(bits) if layout == "panels" else bits[None]
    P.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
    for B in (1, 2, 3, 4, 5, 8, 9, 17):
        X = rng.standard_normal((B, n)).astype(np.float32)
        out = np.full((B, d), np.nan, np.float32)
        RG.rowgemm(P, X, out)
        ref = RG.rowgemm_ref(logical, X)
        assert np.abs(out - ref).max() < 1e-4 * np.abs(ref).max()
        out2 = np.full((B, d), np.nan, np.float32)
        RG.rowgemm_par(P, X, out2, 3)
        assert np.array_equal(out, out2)               # threads split rows, never a row's sum


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_rowgemm_row_does_not_depend_on_its_neighbours(kind):
    """A row's result is the same bits alone and inside a batch of any size (the batch shares weights,
    never sums): a group of fewer rows than the tile's width runs the tile of its own width, and every
    width computes a row with the same FMA chain."""
    rng = np.random.default_rng(1)
    bits, _ = _weights(kind, 64, 512, rng)
    P = to_panels(bits)
    X = rng.standard_normal((9, 512)).astype(np.float32)
    alone = np.zeros((9, 64), np.float32)
    for t in range(9):
        RG.rowgemm(P, X[t:t + 1], alone[t:t + 1])
    for B in range(2, 10):
        full = np.full((B, 64), np.nan, np.float32)
        RG.rowgemm(P, X[:B], full)
        assert np.array_equal(full, alone[:B]), B


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_experts_rows_are_each_chosen_experts_swiglu(kind):
    """A step's experts in one call: row t*k+a of the result is the SwiGLU of the a-th expert row t
    chose (one-row experts through the matvec, the others through the tile), threads give the same
    bits, and weighted_rows sums them with the routing weights."""
    from colibri_server.model.kernels import moe as KM
    rng = np.random.default_rng(4)
    E, D, I, T, k = 5, 512, 256, 9, 2
    w1, w3, w2 = [[_weights(kind, a, b, rng) for _ in range(E)] for a, b in ((I, D), (I, D), (D, I))]
    P1, P3, P2 = (np.stack([to_panels(bits) for bits, _ in w]) for w in (w1, w3, w2))
    for P in (P1, P3, P2):
        P.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
    X = rng.standard_normal((T, D)).astype(np.float32)
    idx = np.array([[0, 1]] * 5 + [[2, 1], [3, 0], [1, 2], [2, 0]], np.int32)      # expert 3: one row, 4: none
    counts, offsets, order = np.zeros(E, np.int64), np.zeros(E + 1, np.int64), np.zeros(T * k, np.int64)
    KM.group_by_expert(idx, E, counts, offsets, order)
    Y = np.full((T * k, D), np.nan, np.float32)
    RG.experts_rows(P1, P3, P2, X, order, offsets, k, Y)
    for t in range(T):
        for a in range(k):
            e = idx[t, a]
            g, u = w1[e][1] @ X[t].astype(np.float64), w3[e][1] @ X[t].astype(np.float64)
            ref = w2[e][1] @ (g / (1 + np.exp(-g)) * u)
            assert np.abs(Y[t * k + a] - ref).max() < 1e-4 * np.abs(ref).max()
    Y2 = np.full_like(Y, np.nan)
    RG.experts_rows_par(P1, P3, P2, X, order, offsets, k, Y2, np.flatnonzero(counts))
    assert np.array_equal(Y, Y2)
    Y2 = np.full_like(Y, np.nan)                         # the experts a few at a time (a budget's ReadAhead.stream)
    for part in (np.array([0, 1]), np.array([2]), np.array([3])):
        RG.experts_rows_par(P1, P3, P2, X, order, offsets, k, Y2, part)
    assert np.array_equal(Y, Y2)
    wts = rng.random((T, k)).astype(np.float32)
    out = np.full((T, D), np.nan, np.float32)
    RG.weighted_rows(Y, wts, out)
    assert np.allclose(out, (Y.reshape(T, k, D) * wts[:, :, None]).sum(1), rtol=1e-5, atol=1e-6)


def _pool(kvdt, rng, NB=12, Hkv=2, BS=4, hd=16):
    return np.zeros((NB, Hkv, BS, hd), kvdt), np.zeros((NB, Hkv, BS, hd), kvdt)


@pytest.mark.parametrize("kvdt", [np.float32, np.uint16])
@pytest.mark.parametrize("window", [0, 3])
def test_paged_attention_is_attention_over_each_rows_own_blocks(kvdt, window):
    """Two sequences with scattered blocks, rows of a decode and of a prefill chunk in one call: each
    row attends to its own sequence's positions only (causal, window), the threaded call the same bits."""
    rng = np.random.default_rng(2)
    kp, vp = _pool(kvdt, rng)
    Hkv, BS, hd, H = kp.shape[1], kp.shape[2], kp.shape[3], 4
    tables = np.array([[3, 7, 1, 0], [5, 2, 9, 11]], np.int32)
    hist = 8                                            # sequence 1 already holds positions 0..7
    pos = np.arange(hist)
    k1, v1 = (rng.standard_normal((hist, Hkv, hd)).astype(np.float32) for _ in range(2))
    KP.write_kv(k1, v1, kp, vp, tables[1][pos // BS].astype(np.int64), (pos % BS).astype(np.int64))
    row_seq = np.array([0, 0, 0, 1, 1], np.int64)
    row_pos = np.array([0, 1, 2, 8, 9], np.int64)
    k, v = (rng.standard_normal((5, Hkv, hd)).astype(np.float32) for _ in range(2))
    blocks = tables[row_seq, row_pos // BS].astype(np.int64)
    KP.write_kv(k, v, kp, vp, blocks, row_pos % BS)
    if kvdt == np.uint16:
        assert np.array_equal(kp[blocks[0], :, 0], KP.to_f16_bits(k[0]))
    q = rng.standard_normal((5, H, hd)).astype(np.float32)
    out, out2 = np.zeros_like(q), np.zeros_like(q)
    KT.tiled_attention(q, kp, vp, tables, row_seq, row_pos, window, 0.25, out, NO_SINKS)
    KT.tiled_attention_par(q, kp, vp, tables, row_seq, row_pos, window, 0.25, out2, NO_SINKS, 2)
    ref = KP.paged_attention_ref(q, kp, vp, tables, row_seq, row_pos, window, 0.25)
    assert np.abs(out - ref).max() < 1e-5
    assert np.array_equal(out, out2)
    # a row pointed at the other sequence's table gives another answer (the test can see a mix-up)
    wrong = np.zeros_like(q)
    KT.tiled_attention(q, kp, vp, tables, np.array([0, 0, 0, 0, 1]), row_pos, window, 0.25, wrong, NO_SINKS)
    assert np.abs(wrong[3] - ref[3]).max() > 1e-3


def test_paged_attention_refuses_a_position_beyond_its_table():
    kp, vp = _pool(np.float32, None)
    q = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match="beyond its block table"):
        KT.tiled_attention(q, kp, vp, np.zeros((1, 2), np.int32), np.zeros(1, np.int64), np.array([8]), 0, 1.0,
                           np.zeros_like(q), NO_SINKS)


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_quant_experts_rows_are_each_experts_matrix_calls(kind):
    """A step's q8/q4 experts in one call (kernels/experts_q): row t*k+a is exactly what the per-expert
    path computes (the matvec for a one-row expert, the integer GEMM for more: the same bits), whatever
    the number of thread parts, and close to the dequantized weights' SwiGLU."""
    from colibri_server.model.kernels import experts_q as KX
    from colibri_server.model.kernels import gemm as GE
    from colibri_server.model.kernels import moe as KM
    from colibri_server.model.kernels import quant as KQ
    from colibri_server.model.kernels.packing import dequantize_q4, dequantize_q8, quantize
    if not GE.HAVE_GEMM:
        pytest.skip("no integer GEMM on this CPU")
    rng = np.random.default_rng(5)
    E, D, I, T, k = 5, 256, 128, 9, 2
    mats = [[quantize(kind, (rng.standard_normal((a, b)) * 0.1).astype(np.float32), 32) for _ in range(E)]
            for a, b in ((I, D), (I, D), (D, I))]
    (q1, s1), (q3, s3), (q2, s2) = ((np.stack([q for q, _ in w]), np.stack([s for _, s in w])) for w in mats)
    for a in (q1, s1, q3, s3, q2, s2):    # read-only as a model's stacks (its mapped file): the kernel's one signature
        a.setflags(write=False)
    X = rng.standard_normal((T, D)).astype(np.float32)
    idx = np.array([[0, 1]] * 5 + [[2, 1], [3, 0], [1, 2], [2, 0]], np.int32)      # expert 3: one row, 4: none
    counts, offsets, order = np.zeros(E, np.int64), np.zeros(E + 1, np.int64), np.zeros(T * k, np.int64)
    KM.group_by_expert(idx, E, counts, offsets, order)
    active = np.flatnonzero(counts)
    got = []
    for parts in (1, 3):
        xs, xi = KQ.scratch(max(D, I), parts)
        Y = np.full((T * k, D), np.nan, np.float32)
        KX.experts_rows_q(q1, s1, q3, s3, q2, s2, X, order, offsets, k, Y, active, xs, xi)
        got.append(Y)
    assert np.array_equal(got[0], got[1])
    Y = np.full((T * k, D), np.nan, np.float32)        # the experts a few at a time (a budget's ReadAhead.stream)
    for part in (active[:1], active[1:3], active[3:]):
        KX.experts_rows_q(q1, s1, q3, s3, q2, s2, X, order, offsets, k, Y, part, xs, xi)
    assert np.array_equal(got[0], Y)
    Y = np.full((T * k, D), np.nan, np.float32)        # one expert: its rows written, no other row touched
    KX.experts_rows_q(q1, s1, q3, s3, q2, s2, X, order, offsets, k, Y, active[1:2], xs, xi)
    mine = np.isin(np.arange(T * k), order[offsets[active[1]]:offsets[active[1] + 1]])
    assert np.isnan(Y[~mine]).all() and np.array_equal(Y[mine], got[0][mine])
    deq = dequantize_q8 if kind == "q8" else dequantize_q4
    xs, xi = KQ.scratch(max(D, I))

    def mm(q, s, A):                       # Workspace.mm's choice for A's rows
        out = np.empty((A.shape[0], q.shape[0]), np.float32)
        if A.shape[0] == 1:
            KQ.matvec_q(q, s, A[0], out[0], xs, xi)
        else:
            (GE.matmul_q8_i16 if kind == "q8" else GE.matmul_q4_i8)(q, s, A, out)
        return out
    for e in active:
        flat = order[offsets[e]:offsets[e + 1]]
        xe = np.ascontiguousarray(X[flat // k])
        g, u = mm(q1[e], s1[e], xe), mm(q3[e], s3[e], xe)
        KM.silu_mul(g, u, g)
        assert np.array_equal(got[0][flat], mm(q2[e], s2[e], g))
        gf, uf = xe @ deq(q1[e], s1[e]).T.astype(np.float64), xe @ deq(q3[e], s3[e]).T.astype(np.float64)
        ref = (gf / (1 + np.exp(-gf)) * uf) @ deq(q2[e], s2[e]).T.astype(np.float64)
        assert np.abs(got[0][flat] - ref).max() < (0.02 if kind == "q8" else 0.05) * np.abs(ref).max()
