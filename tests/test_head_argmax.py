"""The int16 head's argmax from the int8 head's logits (kernels/head_argmax, model/head): a greedy row's token is the
int16 head's, bit for bit, where the int8 rounding alone would pick another; the rows that read their logits
(sampling, log-probabilities) get the int16 head's logits as before."""
from __future__ import annotations

import numpy as np
import pytest
from blocks_data import Q, quantized, read_only
from test_blocks_head import FAST, _head_model, _product

from colibri_server.model import Model
from colibri_server.model.kernels import blocks as KB
from colibri_server.model.kernels import blocks_gemm as KG
from colibri_server.model.kernels import head_argmax as KH
from colibri_server.model.serving import BatchEngine


def _refined(raw, kind, X, L8, bias):
    got = L8.copy()
    n = X.shape[1]
    done = KH.refine_argmax(raw, int(kind), X, got, np.arange(X.shape[0]), bias, KH.head_l2_max(raw, int(kind), n),
                            np.zeros(KG.scratch_words(n), np.float32))
    return got, done


@pytest.mark.parametrize("kind", FAST, ids=lambda k: k.name)
@pytest.mark.parametrize("biased", [False, True], ids=["", "bias"])
def test_the_refined_int8_logits_have_the_int16_argmax(kind, biased):
    """64 rows against a 2048-row head (a bias added as the head adds it, or none): the refined rows' argmax is the
    int16 one; every logit refined has the int16 bits; a few logits a row were recomputed, not the head."""
    rng = np.random.default_rng(int(kind) + 7 * biased)
    d, n, T = 2048, 512, 64
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=9)
    X = rng.standard_normal((T, n)).astype(np.float32)
    bias = (rng.standard_normal(d) * 0.02).astype(np.float32) if biased else np.zeros(0, np.float32)
    L16, L8 = _product(raw, int(kind) + KB.ACTS16, X), _product(raw, int(kind), X)
    if biased:
        L16 += bias
        L8 += bias
    got, done = _refined(raw, kind, X, L8, bias)
    assert np.array_equal(got.argmax(1), L16.argmax(1))
    changed = got.view(np.uint32) != L8.view(np.uint32)
    assert np.array_equal(got[changed].view(np.uint32), L16[changed].view(np.uint32))
    assert T <= done < d * T // 20, done


@pytest.mark.parametrize("kind", FAST, ids=lambda k: k.name)
def test_where_the_int8_rounding_swaps_the_top_two_the_int16_one_wins(kind):
    """A head of two rows whose int16 logits and int8 logits are in opposite orders, above 200 rows below both: the
    int8 argmax is the first row, the refined one the second, as the int16 head's."""
    rng = np.random.default_rng(int(kind))
    d, n = 2048, 512
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=3)
    x = rng.standard_normal((1, n)).astype(np.float32)
    L16, L8 = _product(raw, int(kind) + KB.ACTS16, x)[0], _product(raw, int(kind), x)[0]
    order = np.argsort(L16)
    pairs = [(hi, lo) for hi, lo in zip(order[1:], order[:-1]) if L8[hi] < L8[lo]]
    assert pairs, "no neighbours in int16 order that the int8 rounding swaps"
    hi, lo = pairs[-1]
    below = np.flatnonzero((L16 < L16[lo]) & (L8 < L8[hi]))[:200]
    head = read_only(raw[np.concatenate([[lo, hi], below])])       # read-only, as a model's rows: one compile
    h16, h8 = _product(head, int(kind) + KB.ACTS16, x), _product(head, int(kind), x)
    assert h8[0].argmax() == 0 and h16[0].argmax() == 1
    got, _ = _refined(head, kind, x, h8, np.zeros(0, np.float32))
    assert got[0].argmax() == 1 and got[0, 1] == h16[0, 1]


def test_the_rows_split_over_threads_give_the_same_logits():
    """refine_argmax_par (a threaded worker's) with the rows in two parts: refine_argmax's logits, bit for bit."""
    rng = np.random.default_rng(11)
    d, n, T = 512, 512, 7
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, Q.Q6_K, seed=4)
    X = rng.standard_normal((T, n)).astype(np.float32)
    L8 = _product(raw, int(Q.Q6_K), X)
    one, _ = _refined(raw, Q.Q6_K, X, L8, np.zeros(0, np.float32))
    two = L8.copy()
    done = KH.refine_argmax_par(raw, int(Q.Q6_K), X, two, np.arange(T), np.zeros(0, np.float32),
                                KH.head_l2_max(raw, int(Q.Q6_K), n), np.zeros((2, KG.scratch_words(n)), np.float32))
    assert done >= T and np.array_equal(two.view(np.uint32), one.view(np.uint32))
    assert not np.array_equal(two.view(np.uint32), L8.view(np.uint32))


def test_rows_not_asked_for_and_non_finite_rows_are_left_as_they_are():
    """Only the rows named are refined; a row whose logits hold NaN (a NaN input) is left for the caller to fault."""
    rng = np.random.default_rng(3)
    d, n = 256, 256
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, Q.Q6_K, seed=2)
    X = rng.standard_normal((3, n)).astype(np.float32)
    X[2, 5] = np.nan
    L8 = _product(raw, int(Q.Q6_K), X)
    got = L8.copy()
    done = KH.refine_argmax(raw, int(Q.Q6_K), X, got, np.array([1, 2]), np.zeros(0, np.float32),
                            KH.head_l2_max(raw, int(Q.Q6_K), n), np.zeros(KG.scratch_words(n), np.float32))
    assert done >= 1 and np.array_equal(got[0], L8[0]) and np.isnan(got[2]).all()
    assert got[1].argmax() == _product(raw, int(Q.Q6_K) + KB.ACTS16, X[1:2])[0].argmax()


def _greedy_run(path, argmax, monkeypatch, requests):
    """The tokens of `requests` ((prompt, params) pairs, stepped together) on a BatchEngine; argmax False: every
    row through the int16 head (no row taken as argmax-only)."""
    m = Model.open(path)
    with monkeypatch.context() as mp:
        if not argmax:
            mp.setattr(BatchEngine, "_argmax_rows", staticmethod(lambda plan, rows: np.zeros(len(rows.sample), bool)))
        eng = BatchEngine(m, max_seqs=len(requests), max_batch_tokens=64)
        for i, (p, params) in enumerate(requests):
            eng.add(i, p, max_tokens=12, ignore_eos=True, **params)
        out = {i: [] for i in range(len(requests))}
        while eng.has_work():
            for rid, ev in eng.step():
                out[rid].append(ev.token_id)
    return out


def test_a_serving_step_gives_greedy_rows_the_int16_heads_tokens(tmp_path, monkeypatch):
    """A Q6_K head, greedy requests beside a sampled one and one asking log-probabilities, stepped together: every
    request's tokens are those of the same run with every row through the int16 head, and the greedy rows did go
    through the refinement."""
    path = _head_model(tmp_path, Q.Q6_K)
    rng = np.random.default_rng(5)
    requests = [(rng.integers(3, 200, 6).tolist(), {}) for _ in range(4)]
    requests += [(rng.integers(3, 200, 6).tolist(), {"temperature": 0.8, "seed": 3}),
                 (rng.integers(3, 200, 6).tolist(), {"logprobs": 2})]
    calls = []
    refine = KH.refine_argmax

    def counted(*a):
        calls.append(a[4].size)
        return refine(*a)
    monkeypatch.setattr(KH, "refine_argmax", counted)
    fast = _greedy_run(path, True, monkeypatch, requests)
    assert calls and max(calls) == 4            # the greedy rows: not the sampled one, not the log-probabilities one
    del calls[:]
    exact = _greedy_run(path, False, monkeypatch, requests)
    assert not calls and fast == exact


def test_the_warm_up_compiles_the_refinement_before_fork(tmp_path):
    """serving.warm_up (a pre-fork master's) runs greedy rows through the head: the refinement is compiled for the
    mapped head's types and its W2 known, so a forked worker does neither at its first greedy step."""
    import numba

    from colibri_server.model import head as MH
    from colibri_server.model import serving
    m = Model.open(_head_model(tmp_path, Q.Q6_K))
    serving.warm_up(m)
    head = m.weights.output
    assert any(s[0] == numba.typeof(head.raw) for s in KH.refine_argmax.signatures)
    assert id(head.raw) in MH._L2


@pytest.mark.slow          # compile_threaded's cold compile: minutes on a loaded core
def test_the_threaded_refinement_is_compiled_before_fork(tmp_path):
    """serving.compile_threaded (a pre-fork master's) compiles refine_argmax_par for the types a 2-thread worker's
    step gives it, so the worker compiles nothing at its first greedy step."""
    import numba

    from colibri_server.model import head as MH
    from colibri_server.model import serving
    from colibri_server.model.transformer import Workspace
    m = Model.open(_head_model(tmp_path, Q.Q6_K))
    serving.compile_threaded(m)
    ws = Workspace(m.config, 16, threads=2)
    V = m.config.vocab_size
    args = MH._refine_args(ws, ws.gather[:3], m.weights.output, m.weights.output_b, np.zeros((16, V), np.float32)[:3],
                           np.arange(3))
    assert tuple(numba.typeof(a) for a in args) in {tuple(s) for s in KH.refine_argmax_par.signatures}


def test_a_heads_norm_is_forgotten_with_its_bytes():
    """W2 is kept per head array while it lives: a reload's model, whatever address its head lands at, gets its own."""
    import gc

    from colibri_server.model import head as MH
    from colibri_server.model.blocks import BlockTensor
    rng = np.random.default_rng(8)
    raw = quantized(rng.standard_normal((32, 256)).astype(np.float32) * 0.05, Q.Q6_K, seed=1)
    head = BlockTensor("q6_k", raw, acts16=True)
    key = id(raw)
    w2 = MH._l2_max(head)
    assert MH._L2[key] == w2 == KH.head_l2_max(raw, int(Q.Q6_K), 256) > 0
    del head, raw
    gc.collect()
    assert key not in MH._L2


def test_a_heads_norm_is_its_largest_rows_norm():
    """W2 = max_v |w_v|_2 of the dequantized rows (the bound the refinement stands on): numpy's in float64 within
    rounding (the kernel adds a row in four running sums)."""
    rng = np.random.default_rng(9)
    raw = quantized(rng.standard_normal((40, 512)).astype(np.float32) * 0.05, Q.Q8_0, seed=2).copy()
    raw[17] = quantized(rng.standard_normal((1, 512)).astype(np.float32) * 0.2, Q.Q8_0, seed=3)[0]   # the largest
    W = KB.dequantize_ref(raw, int(Q.Q8_0), 512).astype(np.float64)
    want = np.sqrt((W * W).sum(axis=1)).max()
    assert KH.head_l2_max(raw, int(Q.Q8_0), 512) == pytest.approx(want, rel=1e-12)


def test_a_greedy_decode_token_takes_the_int8_head_and_keeps_the_int16_argmax(tmp_path, monkeypatch):
    """The fused decode token of a greedy sequence (argmax_only) multiplies the int8 head and refines its top: its
    argmax and every logit it recomputed are the int16 token's bits, the other logits the int8 head's; without
    argmax_only the token is the int16 head's, refinement not called."""
    m = Model.open(_head_model(tmp_path, Q.Q6_K))
    cfg, w = m.config, m.weights
    assert m.workspace.decode_step(cfg, w) is not None                  # the fused token covers this model
    calls = []
    refine = KH.refine_argmax
    monkeypatch.setattr(KH, "refine_argmax", lambda *a: calls.append(a[4].size) or refine(*a))
    prompt = np.random.default_rng(4).integers(3, 200, 5)
    out = {}
    for fast in (False, True):
        cache = m.new_cache(16)
        m.prefill(cache, prompt)
        out[fast] = [m.decode(cache, t, argmax_only=fast)[0].copy() for t in (7, 11, 13)]
        assert len(calls) == (3 if fast else 0)
    # the head's int8 logits of the same hidden state: the fast token's unrefined logits
    h = m.workspace.h[:1].copy()
    int8 = m.workspace.mm(h, w.output.with_acts16(False), np.zeros((1, cfg.vocab_size), np.float32))[0]
    for exact, fast in zip(out[False], out[True]):
        assert fast.argmax() == exact.argmax()
        other = fast.view(np.uint32) != exact.view(np.uint32)
        assert other.sum() > cfg.vocab_size // 2                     # most logits are the int8 head's
        assert not other[exact.argmax()]
    assert np.array_equal(out[True][-1][other].view(np.uint32), int8[other].view(np.uint32))


def test_a_greedy_sequence_alone_gets_the_int16_heads_tokens_on_either_path(tmp_path, monkeypatch):
    """A greedy request alone, through Model.generate (Sequence: the token on the sequence's cache) and through a
    serving step of one sequence (the token on the paged pool): the tokens of the same request asking
    log-probabilities (every logit on the int16 head), each greedy token through the refinement."""
    m = Model.open(_head_model(tmp_path, Q.Q6_K))
    calls = []
    refine = KH.refine_argmax
    monkeypatch.setattr(KH, "refine_argmax", lambda *a: calls.append(a[4].size) or refine(*a))
    prompt = np.random.default_rng(6).integers(3, 200, 6).tolist()
    greedy = m.generate(prompt, max_tokens=10, ignore_eos=True)
    assert len(calls) == 10                          # the prompt's last row and 9 decode tokens
    del calls[:]
    exact = [ev.token_id for ev in m.stream(prompt, max_tokens=10, ignore_eos=True, logprobs=1)]
    assert not calls and greedy == exact
    served = {}
    for params in ({}, {"logprobs": 1}):
        eng = BatchEngine(m, max_seqs=1, max_batch_tokens=64)
        eng.add(0, prompt, max_tokens=10, ignore_eos=True, **params)
        served[bool(params)] = [ev.token_id for _ in iter(eng.has_work, False) for _, ev in eng.step()]
        assert len(calls) == (0 if params else 10)
        del calls[:]
    assert served[False] == served[True] == exact
