"""The attention kernel against its numpy twin: decode and prefill, sliding windows, grouped and
multi-query heads, long contexts, the threaded split over kv and query heads (bit for bit), and the
vector inner loops of its IR (attn_ir).

Tolerances as in test_kernels.py: the kernels differ from the twins only by float32 accumulation order.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from colibri_server.model import kernels as K
from colibri_server.model.kernels import attn_ir as KA_IR

NO_SINKS = np.zeros(0, np.float32)      # attention without GPT-OSS sinks
NO_SINKS.setflags(write=False)   # read-only as a model's absent sinks (model/weights): the kernels' one signature


@pytest.fixture
def rng():
    return np.random.default_rng(1234)



@pytest.mark.parametrize(
    "T,start,window,H,Hkv",
    [
        (1, 6, 0, 2, 2),  # decode
        (5, 3, 0, 2, 2),  # prefill continuing a prompt
        (5, 0, 0, 4, 2),  # prefill from scratch, GQA
        (1, 9, 4, 4, 2),  # decode, sliding window, GQA
        (6, 2, 3, 4, 1),  # prefill, window, MQA
    ],
)
def test_attention(rng, T, start, window, H, Hkv):
    S, hd = 16, 12
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    v = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    # positions after the last query are garbage: must never be read
    k[:, start + T :] = np.nan
    v[:, start + T :] = np.nan
    scale = 1.0 / np.sqrt(hd)
    out = np.full((T, H, hd), np.nan, np.float32)
    scores = np.empty(H // Hkv * S, np.float32)
    K.attention(q, k, v, start, window, scale, out, scores, NO_SINKS)
    ref = K.attention_ref(q, k, v, start, window, scale)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


def _attention_case(rng, T, H, Hkv, S, hd, start):
    # random q (T,H,hd) and caches (Hkv,S,hd) whose positions past the queries are NaN (never read), NaN out
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    v = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    k[:, start + T:] = np.nan
    v[:, start + T:] = np.nan
    return q, k, v, np.full((T, H, hd), np.nan, np.float32)


@pytest.mark.parametrize("T,start,window", [(1, 299, 0), (1, 299, 64), (3, 150, 0)])
def test_attention_long_context_groups_of_four(rng, T, start, window):
    # each kv head's 4 query heads read its keys and values together (kernels_attention)
    H, Hkv, S, hd = 8, 2, 320, 64
    q, k, v, out = _attention_case(rng, T, H, Hkv, S, hd, start)
    K.attention(q, k, v, start, window, 0.125, out, np.empty(H // Hkv * S, np.float32), NO_SINKS)
    np.testing.assert_allclose(out, K.attention_ref(q, k, v, start, window, 0.125), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="scores scratch"):
        K.attention(q, k, v, start, window, 0.125, out, np.empty(S, np.float32), NO_SINKS)


@pytest.mark.parametrize("T,start,window,Hkv", [(1, 299, 0, 4), (1, 299, 64, 2), (5, 150, 0, 4), (3, 0, 0, 1)])
def test_attention_par_is_attention_bit_for_bit(rng, T, start, window, Hkv):
    # a worker on threads runs the kv heads side by side, one scratch row each: same bits as one thread
    import numba
    H, S, hd = 4 * Hkv, 320, 64
    q, k, v, out = _attention_case(rng, T, H, Hkv, S, hd, start)
    K.attention(q, k, v, start, window, 0.125, out, np.empty(H // Hkv * S, np.float32), NO_SINKS)
    par = np.full_like(out, np.nan)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        K.attention_par(q, k, v, start, window, 0.125, par, np.full((Hkv, H // Hkv * S), np.nan, np.float32), NO_SINKS)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.isfinite(par).all()
    np.testing.assert_array_equal(par, out)
    with pytest.raises(ValueError, match="fewer rows than kv heads"):
        K.attention_par(q, k, v, start, window, 0.125, par, np.empty((Hkv - 1, H // Hkv * S), np.float32), NO_SINKS)
    with pytest.raises(ValueError, match="scores scratch"):
        K.attention_par(q, k, v, start, window, 0.125, par, np.empty((Hkv, 4 * (start + T) - 1), np.float32), NO_SINKS)


@pytest.mark.parametrize("Hkv,chunks", [(1, 2), (1, 3), (2, 2)])
def test_attention_par_splits_query_heads_bit_for_bit(rng, Hkv, chunks):
    # fewer kv heads than threads (latent attention: one for all heads): each kv head's query heads split in
    # chunks (3 of a group of 8: 3, 3, 2), a scratch row each, every head as on one thread
    import numba
    H, S, hd, T, start = 8 * Hkv, 200, 72, 2, 90
    q, k, v, out = _attention_case(rng, T, H, Hkv, S, hd, start)
    sinks = rng.standard_normal(H).astype(np.float32)
    K.attention(q, k, v, start, 0, 0.125, out, np.empty(H // Hkv * S, np.float32), sinks)
    per = -(-(H // Hkv) // chunks) * S
    par = np.full_like(out, np.nan)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        K.attention_par(q, k, v, start, 0, 0.125, par, np.full((Hkv * chunks, per), np.nan, np.float32), sinks)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(par, out)
    if Hkv > 1:
        with pytest.raises(ValueError, match="not a multiple of the kv heads"):
            K.attention_par(q, k, v, start, 0, 0.125, par, np.empty((Hkv * chunks + 1, per), np.float32), sinks)
    with pytest.raises(ValueError, match="scores scratch is smaller"):
        K.attention_par(q, k, v, start, 0, 0.125, par,
                        np.empty((Hkv * chunks, per // S * (start + T) - 1), np.float32), sinks)


@pytest.mark.parametrize("hd", [64, 72, 136, 12])
@pytest.mark.parametrize("T,start,window", [(1, 77, 0), (1, 150, 40), (4, 60, 0)])
def test_attention_vector_loops_every_head_dim(rng, hd, T, start, window):
    # kernels_attention_ir: scores of 8 keys at a time and V rows summed in registers (8-register
    # blocks of 64 columns, then single registers: 72 and 136 take both), the last keys of a block
    # and head dims not a multiple of 8 (12) in Numba's loops
    H, Hkv, S = 8, 2, 160
    q, k, v, out = _attention_case(rng, T, H, Hkv, S, hd, start)
    scale = 1.0 / np.sqrt(hd)
    K.attention(q, k, v, start, window, scale, out, np.empty(H // Hkv * S, np.float32), NO_SINKS)
    np.testing.assert_allclose(out, K.attention_ref(q, k, v, start, window, scale), rtol=1e-5, atol=2e-6)


@pytest.mark.skipif(not KA_IR.HAVE_ATTN_IR, reason="the attention IR needs AVX2 and FMA")
def test_attention_inner_loops_are_vector_fmas(rng):
    from colibri_server.model.kernels import attn as KA
    Q = rng.standard_normal((4, 64)).astype(np.float32)
    kv = rng.standard_normal((32, 64)).astype(np.float32)
    S = np.empty((4, 32), np.float32)

    # uncached copies of the two kernels (linked by reference, a caller's asm holds only a call): asm to inspect
    scores, wsum = (numba.njit(fastmath=f.targetoptions.get("fastmath", False))(f.py_func)
                    for f in (KA._scores_group, KA._weighted_sum_group))
    scores(Q, kv, np.float32(0.125), S)
    wsum(S, kv, np.empty((4, 64), np.float32))
    for f in (scores, wsum):
        asm = f.inspect_asm(f.signatures[0])
        fmas = [ln for ln in asm.splitlines() if "vfmadd" in ln and "ymm" in ln]
        assert len(fmas) >= 8, f.__name__                    # 8 keys, or 8 registers of a V block
        if f is scores:                                      # 8 keys' sums reduced together
            assert "vhaddps" in asm


def test_attention_window_and_group_matter(rng):
    T, H, Hkv, S, hd, start = 3, 4, 2, 12, 8, 6
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    v = rng.standard_normal((Hkv, S, hd)).astype(np.float32)
    out = np.empty((T, H, hd), np.float32)
    sc = np.empty(H // Hkv * S, np.float32)
    K.attention(q, k, v, start, 3, 0.5, out, sc, NO_SINKS)
    assert not np.allclose(out, K.attention_ref(q, k, v, start, 0, 0.5), atol=1e-3)
    # heads 0,1 -> kv 0; heads 2,3 -> kv 1 (not h % Hkv)
    wrong = np.empty_like(out)
    K.attention(q[:, [0, 2, 1, 3]], k, v, start, 3, 0.5, wrong, sc, NO_SINKS)
    assert not np.allclose(out, wrong[:, [0, 2, 1, 3]], atol=1e-3)
    # decode at position 0 returns v[0] exactly-ish
    o1 = np.empty((1, H, hd), np.float32)
    K.attention(q[:1], k, v, 0, 0, 0.5, o1, sc, NO_SINKS)
    np.testing.assert_allclose(o1[0, 0], v[0, 0], rtol=1e-6)
    np.testing.assert_allclose(o1[0, 3], v[1, 0], rtol=1e-6)
