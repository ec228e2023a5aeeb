"""Tiled attention over the paged pool (kernels/tiled): against the float64 twin at lengths that cross
many tiles and split-K segments, with windows, sinks, latent attention's narrower values and grouped
queries; and a row's bits whatever the chunking of its prompt, the rows beside it and the threads."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from colibri_server.model.kernels import paged as KP
from colibri_server.model.kernels import tiled as KT

NO_SINKS = np.zeros(0, np.float32)
NO_SINKS.setflags(write=False)   # read-only as a model's absent sinks (model/weights): the kernels' one signature


def _sequence(rng, P, Hkv, hd, BS=16, f16=True, latent=False):
    """One sequence of P positions in a pool of scattered blocks: (kpool, vpool, tables (1,maxb))."""
    NB = -(-P // BS) + 3
    kp = rng.standard_normal((NB, Hkv, BS, hd)).astype(np.float32)
    vp = kp if latent else rng.standard_normal((NB, Hkv, BS, hd)).astype(np.float32)
    if f16:
        kp = KP.to_f16_bits(kp)
        vp = kp if latent else KP.to_f16_bits(vp)
    return kp, vp, rng.permutation(NB).astype(np.int32)[None]


def _run(kp, vp, tables, q, pos, window, scale, dv, sinks, chunk, threads):
    """The rows of one sequence at positions pos, attended `chunk` rows per call (as a serving step's
    prefill chunks would), on one thread or `threads`."""
    T, H = q.shape[:2]
    out = np.full((T, H, dv), np.nan, np.float32)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        args = (q[s:e], kp, vp, tables, np.zeros(e - s, np.int64), pos[s:e], window, scale, out[s:e], sinks)
        if threads > 1:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            try:
                KT.tiled_attention_par(*args, threads)
            finally:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        else:
            KT.tiled_attention(*args)
    return out


def _check(rng, P, H, Hkv, hd, dv=None, window=0, sinks=False, rows=None, BS=16, chunks=(256,), threads=(1,),
           f16=True):
    dv = hd if dv is None else dv
    kp, vp, tables = _sequence(rng, P, Hkv, hd, BS, f16, latent=dv < hd)
    pos = np.arange(P) if rows is None else np.asarray(rows, np.int64)
    q = rng.standard_normal((len(pos), H, hd)).astype(np.float32)
    sk = (2 * rng.standard_normal(H)).astype(np.float32) if sinks else NO_SINKS
    sk.setflags(write=False)        # read-only as a model's sinks: the kernels' signature a served model compiles
    scale = 1.0 / np.sqrt(hd)
    ref = KP.paged_attention_ref(q, kp, vp, tables, np.zeros(len(pos), np.int64), pos, window, scale, dv=dv,
                                 sinks=sk if sinks else None)
    first = None
    for chunk in chunks:
        for t in threads:
            got = _run(kp, vp, tables, q, pos, window, scale, dv, sk, chunk, t)
            if first is None:
                first = got
                np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
            else:
                np.testing.assert_array_equal(got, first)      # the same bits for every row
    return first, ref


def test_a_4096_token_prompt_is_the_reference_whatever_its_chunking_and_threads():
    """bench-mixtral's attention shape (16 heads on 4 kv heads of 64), a 4096-position prompt in chunks of
    4096, 256 and 100 rows and row by row for its last 40 (decode), on one thread and two: within f32
    tolerance of the float64 twin, and every row's bits the same every way."""
    rng = np.random.default_rng(0)
    _check(rng, 4096, 16, 4, 64, chunks=(4096, 256, 100), threads=(1, 2))
    rows = np.arange(4056, 4096)
    _check(np.random.default_rng(0), 4096, 16, 4, 64, rows=rows, chunks=(40, 1), threads=(1, 2))


def test_decode_rows_are_the_prefill_rows_bit_for_bit():
    """Rows attended one at a time (a sequence decoding: split-K over segments on two threads) carry the
    bits of the same rows inside a prefill chunk, across segment and tile boundaries."""
    rng = np.random.default_rng(1)
    P = 1600
    rows = np.r_[np.arange(0, 70), np.arange(500, 530), np.arange(1020, 1100), np.arange(1530, 1600)]
    _check(rng, P, 16, 4, 64, rows=rows, chunks=(len(rows), 1, 7), threads=(1, 2))


@pytest.mark.parametrize("window", [37, 300, 700])
def test_sliding_windows(window):
    _check(np.random.default_rng(2), 1300, 8, 2, 64, window=window, chunks=(1300, 128, 1), threads=(1, 2))


def test_sinks_and_a_window():
    """GPT-OSS: per-head sink logits in every softmax's sum, a window on the layer."""
    _check(np.random.default_rng(3), 900, 16, 4, 64, window=128, sinks=True, chunks=(900, 64, 1), threads=(1, 2))


def test_latent_attention_values_narrower_than_keys():
    """MLA: one kv head for 16 query heads, the key pool passed as the value pool, the values the first 32
    of 40 dims (head dims not a multiple of 8, blocks of 4)."""
    _check(np.random.default_rng(4), 1100, 16, 1, 40, dv=32, BS=4, chunks=(1100, 96, 1), threads=(1, 2))


def test_grouped_queries_8_to_1_and_f32_pool():
    _check(np.random.default_rng(5), 700, 16, 2, 32, f16=False, chunks=(700, 50, 1), threads=(1, 2))


def test_query_blocks_are_runs_of_one_sequence():
    seq = np.array([0, 0, 0, 1, 1, 0, 0], np.int64)
    pos = np.array([5, 6, 7, 0, 2, 8, 9], np.int64)
    assert KT.query_blocks(seq, pos, 2).tolist() == [[0, 2], [2, 3], [3, 4], [4, 5], [5, 7]]


@pytest.mark.slow
@pytest.mark.parametrize("P", [16384, 32768])
def test_long_prompts_are_the_reference(P):
    """The last 64 rows of a 16k / 32k prompt (every row before them only as keys) and 3 decode rows."""
    rng = np.random.default_rng(6)
    rows = np.r_[np.arange(P - 67, P - 3), np.arange(P - 3, P)]
    _check(rng, P, 16, 4, 64, rows=rows, chunks=(64, 1), threads=(1, 2))


def test_a_decoding_row_with_8_heads_per_kv_head_f16():
    """GQA 8:1 on the f16 pool (a decoding row's two head groups of 4 on one kv head), head dims 64: decode
    rows and prefill rows carry the same bits, a partial last tile and segment included."""
    rng = np.random.default_rng(7)
    rows = np.r_[np.arange(0, 40), np.arange(1000, 1109)]
    _check(rng, 1109, 16, 2, 64, rows=rows, chunks=(len(rows), 1, 13), threads=(1, 2))


def test_a_decoding_row_with_narrower_values_and_odd_head_groups():
    """Latent attention's shape on the f16 pool with dims the row path takes (keys 80, values the first 48):
    12 heads on one kv head (three head groups), a window; decode rows are the prefill rows' bits."""
    rng = np.random.default_rng(8)
    _check(rng, 700, 12, 1, 80, dv=48, window=300, BS=8, chunks=(700, 64, 1), threads=(1, 2))
