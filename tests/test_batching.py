"""Continuous batching (model/serving.py, scheduler.py, kv.py, batch.py): the answers of requests
stepped together are the answers of each request run alone, whatever joins or leaves, is preempted
or reuses a prefix; the context and the pool are checked before a request starts."""
from __future__ import annotations

import hf_models as H
import numpy as np
import pytest

from colibri_server.model import Model
from colibri_server.model.batch import Rows, forward_batch
from colibri_server.model.kv import KVPool
from colibri_server.model.scheduler import Scheduler
from colibri_server.model.serving import BatchEngine, RequestTooLarge


def _requests(V, n=16, seed=1, long_prompts=False):
    rng = np.random.default_rng(seed)
    hi = 90 if long_prompts else 40
    prompts = [rng.integers(3, V, size=int(rng.integers(1, hi))).tolist() for _ in range(n)]
    lengths = [int(rng.integers(1, 20)) for _ in range(n)]
    return prompts, lengths


def _run(eng, prompts, lengths, join_every=2, per_join=3):
    """Add the requests a few at a time (every `join_every` steps) while stepping; the tokens of each."""
    out = {i: [] for i in range(len(prompts))}
    waiting, steps = list(range(len(prompts))), 0
    while waiting or eng.has_work():
        if waiting and steps % join_every == 0:
            for _ in range(per_join):
                if waiting:
                    i = waiting.pop(0)
                    eng.add(i, prompts[i], max_tokens=lengths[i], ignore_eos=True)
        for rid, ev in eng.step():
            out[rid].append(ev.token_id)
        steps += 1
        assert steps < 10_000
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", H.ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_batched_greedy_is_each_request_alone(built, arch, dtype):
    """16 requests of different prompt and output lengths, joining at different steps, through one
    batched forward per step: every request's tokens are those it gets alone (Model.generate)."""
    m = Model.open(built(arch).colibri(dtype))
    prompts, lengths = _requests(m.config.vocab_size, long_prompts=True)
    alone = [m.generate(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    eng = BatchEngine(m, max_seqs=16, max_batch_tokens=64, kv_dtype="f32")
    assert _run(eng, prompts, lengths) == alone
    assert eng.stats()["batch_rows_mean"] > 4          # the rows really were stepped together


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_f16_kv_pool_keeps_the_greedy_tokens(built, arch):
    """The default kv_dtype f16 rounds keys and values to half precision: on these models the greedy
    tokens stay those of the f32 cache."""
    m = Model.open(built(arch).colibri("f32"))
    prompts, lengths = _requests(m.config.vocab_size, seed=3)
    alone = [m.generate(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    got = _run(BatchEngine(m, max_seqs=16, max_batch_tokens=64, kv_dtype="f16"), prompts, lengths)
    assert sum(a == b for a, b in zip(got, alone)) >= 15


def test_batched_step_logits_equal_the_one_sequence_forward(built):
    """One step holding a decode row of one sequence and a prefill chunk of another: each row's logits
    equal Model.logits of its own sequence within 2e-5 (f32: the pool's tiled attention sums in another
    order than the contiguous cache's), so no row reads another's KV."""
    m = Model.open(built("qwen3_moe").colibri("f32"))
    V = m.config.vocab_size
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, V, size=21).tolist(), rng.integers(3, V, size=13).tolist()
    eng = BatchEngine(m, max_seqs=4, max_batch_tokens=64, kv_dtype="f32", prefix_cache=False)
    pool, ws = eng.pool, eng.ws
    ta = [pool.allocate() for _ in range(pool.blocks_for(len(a)))]
    tb = [pool.allocate() for _ in range(pool.blocks_for(len(b)))]
    tables = np.zeros((2, max(len(ta), len(tb))), np.int32)
    tables[0, :len(ta)], tables[1, :len(tb)] = ta, tb
    # a's first 20 tokens, then one step: a's 21st token (decode) beside all of b (prefill)
    first = Rows(a[:20], [0] * 20, range(20), tables, pool.block_size, [19])
    forward_batch(m.config, m.weights, m.rope, ws, pool, first, eng.logits)
    rows = Rows([a[20]] + b, [0] + [1] * len(b), [20] + list(range(len(b))), tables, pool.block_size,
                list(range(len(b) + 1)))
    got = forward_batch(m.config, m.weights, m.rope, ws, pool, rows, np.zeros((len(b) + 1, V), np.float32))
    ref_a, ref_b = m.logits(a), m.logits(b)
    assert np.abs(got[0] - ref_a[20]).max() < 2e-5
    assert np.abs(got[1:] - ref_b).max() < 2e-5


@pytest.mark.parametrize("arch,threads", [("mixtral", 1), ("deepseek_v3", 1), ("gpt_oss", 1),
                                          pytest.param("deepseek_v3", 2, marks=pytest.mark.slow)])   # 27 s cold
def test_one_sequence_step_is_the_fused_token_on_the_pool(built, arch, threads):
    """A step of ONE decoding sequence runs the fused decode token on the paged pool (decode_step.py,
    as fast as batch-1 decode was before batching): it stores the keys/values forward_batch stores and
    gives its logits; the engine takes that path whenever a step holds a single decode row. deepseek_v3: the
    latent row is the pool's one array; gpt_oss: sinks, a window of 8 shorter than the 21 positions; on two
    threads the query heads of the pool's attention split over them, as forward_batch's do."""
    m = Model.open(built(arch).colibri("f16"))
    if threads > 1:
        m.compile_threaded()
        m.set_threads(threads)
    V = m.config.vocab_size
    a = np.random.default_rng(11).integers(3, V, size=21).tolist()
    eng = BatchEngine(m, max_seqs=2, max_batch_tokens=64, kv_dtype="f16", prefix_cache=False)
    assert eng.single is not None
    pool, ws = eng.pool, eng.ws
    tables = np.array([[pool.allocate() for _ in range(pool.blocks_for(len(a)))]], np.int32)
    forward_batch(m.config, m.weights, m.rope, ws, pool, Rows(a[:20], [0] * 20, range(20), tables, pool.block_size,
                                                                [19]), eng.logits)
    k0, v0 = pool.k[:, tables[0]].copy(), pool.v[:, tables[0]].copy()
    fused = eng.single.paged(m.rope, pool, tables[0], 20, a[20], eng.scores)[0].copy()
    kf, vf = pool.k[:, tables[0]].copy(), pool.v[:, tables[0]].copy()
    pool.k[:, tables[0]], pool.v[:, tables[0]] = k0, v0
    ref = forward_batch(m.config, m.weights, m.rope, ws, pool, Rows([a[20]], [0], [20], tables, pool.block_size, [0]),
                        np.zeros((1, V), np.float32))[0]
    assert not np.array_equal(kf, k0)                                   # position 20 was written
    assert np.array_equal(kf, pool.k[:, tables[0]]) and np.array_equal(vf, pool.v[:, tables[0]])
    assert np.abs(fused - ref).max() < 1e-4 * np.abs(ref).max()
    calls = []
    real = eng.single.paged
    eng.single.paged = lambda *args: calls.append(args[3]) or real(*args)
    got = _run(eng, [a[:5]], [4])
    assert calls == [5, 6, 7] and got == [m.generate(a[:5], max_tokens=4, ignore_eos=True)]


def test_moe_of_a_step_in_one_call_is_the_per_expert_path(built, monkeypatch):
    """moe() over a step's rows with f16 panel experts runs them in one Numba call (rowgemm.experts_rows);
    its output is the per-expert path's (each expert's rows gathered, three matrix calls, scattered)."""
    from colibri_server.model.moe import moe
    from colibri_server.model.transformer import Workspace
    m = Model.open(built("mixtral").colibri("f16"))
    L, ws = m.weights.layers[1], m.workspace
    x = np.random.default_rng(2).standard_normal((12, m.config.hidden_size)).astype(np.float32)
    assert ws.experts_in_one_call(L, len(x), 2)
    one = moe(L, x, ws, np.zeros_like(x)).copy()
    monkeypatch.setattr(Workspace, "experts_in_one_call", lambda self, layer, T, active: False)
    each = moe(L, x, ws, np.zeros_like(x))
    assert np.abs(one - each).max() < 1e-5 * np.abs(each).max()


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_quant_moe_of_a_step_in_one_call_is_the_per_expert_path(built, monkeypatch, tmp_path, dtype):
    """moe() over a step's rows with q8/q4 experts runs them in one Numba call (kernels/experts_q); its
    output is the per-expert path's (three matrix calls per expert, scattered). Thread parts: the
    kernel's own test."""
    from colibri_server.model.kernels import gemm as GE
    from colibri_server.model.moe import moe
    from colibri_server.model.transformer import Workspace
    if not GE.HAVE_GEMM:
        pytest.skip("no integer GEMM on this CPU")
    from colibri_server.model.convert import convert
    path = str(tmp_path / f"mixtral-{dtype}.colibri")
    convert(built("mixtral").hf_dir, path, "f16", progress=False, quantize=dtype, quant_group=32)
    m = Model.open(path)
    L, ws = m.weights.layers[1], m.workspace
    x = np.random.default_rng(2).standard_normal((12, m.config.hidden_size)).astype(np.float32)
    assert ws.quant_experts_in_one_call(L)
    one = moe(L, x, ws, np.zeros_like(x)).copy()
    monkeypatch.setattr(Workspace, "quant_experts_in_one_call", lambda self, layer: False)
    each = moe(L, x, ws, np.zeros_like(x))
    assert np.abs(one - each).max() < 1e-5 * np.abs(each).max()


def test_preemption_recomputes_and_keeps_the_tokens(built):
    """A pool far smaller than the requests need: sequences are preempted and recomputed from their
    tokens, and every answer is still the one it gets alone; none is refused."""
    m = Model.open(built("mixtral").colibri("f32"))
    prompts, lengths = _requests(m.config.vocab_size, seed=7)
    alone = [m.generate(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    per_block = KVPool(m.config, 1, 4, "f32").bytes_per_block
    eng = BatchEngine(m, max_seqs=8, max_batch_tokens=32, kv_dtype="f32", block_size=4,
                      kv_cache_memory=16 * per_block, prefix_cache=False)
    assert _run(eng, prompts, lengths, per_join=6) == alone
    assert eng.sched.preemptions > 0
    assert eng.pool.used() == 0


def test_prefix_reuse_skips_the_shared_prompt_and_keeps_the_tokens(built):
    """Requests sharing a 40-token system prompt: after the first, each reuses its full blocks (not
    prefilled again: fewer rows run) and answers exactly as a cold run does."""
    m = Model.open(built("olmoe").colibri("f32"))
    V = m.config.vocab_size
    rng = np.random.default_rng(11)
    system = rng.integers(3, V, size=40).tolist()
    prompts = [system + rng.integers(3, V, size=int(rng.integers(1, 9))).tolist() for _ in range(6)]
    lengths = [6] * 6
    alone = [m.generate(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    cold = BatchEngine(m, max_seqs=8, max_batch_tokens=64, kv_dtype="f32", block_size=8, prefix_cache=False)
    warm = BatchEngine(m, max_seqs=8, max_batch_tokens=64, kv_dtype="f32", block_size=8)
    assert _run(cold, prompts, lengths, join_every=100, per_join=1) == alone
    assert _run(warm, prompts, lengths, join_every=100, per_join=1) == alone
    assert warm.pool.hits == 5 * 5                      # 5 full blocks of 8, reused by the 5 later requests
    assert warm.rows_total == cold.rows_total - 5 * 40


def test_context_and_pool_are_checked_before_the_request_starts(built):
    m = Model.open(built("mixtral").colibri("f32"), context=64)
    eng = BatchEngine(m, max_seqs=2, max_batch_tokens=16, kv_dtype="f32")
    with pytest.raises(RequestTooLarge, match="exceeds the context of 64"):
        eng.add("a", list(range(3, 53)), max_tokens=20)
    small = BatchEngine(m, max_seqs=2, max_batch_tokens=16, kv_dtype="f32", block_size=4,
                        kv_cache_memory=3 * KVPool(m.config, 1, 4, "f32").bytes_per_block)
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        small.add("b", [5] * 10, max_tokens=4)            # 14 positions: 4 blocks of 4 > 3
    assert not small.has_work() and not eng.has_work()


def test_scheduler_puts_decode_rows_first_and_chunks_long_prompts(built):
    m = Model.open(built("mixtral").colibri("f32"))
    pool = KVPool(m.config, 64, 4, "f32")
    s = Scheduler(pool, max_seqs=4, max_batch_tokens=10)
    a = s.add("a", [5] * 3, 8)
    plan = s.schedule()
    assert [(g.state.rid, g.start, g.n, g.sample) for g in plan] == [("a", 0, 3, True)]
    s.advance(plan[0])
    a.tokens.append(7)                                    # a sampled; now it decodes
    b = s.add("b", [6] * 25, 30)
    plan = s.schedule()
    assert [(g.state.rid, g.start, g.n, g.sample) for g in plan] == [("a", 3, 1, True), ("b", 0, 9, False)]
    for g in plan:
        s.advance(g)
    a.tokens.append(8)
    plan = s.schedule()
    assert [(g.state.rid, g.start, g.n) for g in plan] == [("a", 4, 1), ("b", 9, 9)]
    s.finish(a)
    s.finish(b)
    assert pool.used() == 0 and len(s) == 0


@pytest.mark.parametrize("arch", H.ARCHS)
def test_kv_pool_logits_against_transformers(built, arch):
    """The logits at every position of a 40-token prompt through the paged pool, against transformers
    (f32 weights): kv_dtype f32 within 1e-4 (the exact path); f16 (the default) within 5e-2 of the
    largest logit (measured: 4e-4 to 3e-3, 3.7e-2 on qwen2_moe where a near-tie routing choice flips),
    the same argmax at every position."""
    b = built(arch)
    m = Model.open(b.colibri("f32"))
    V = m.config.vocab_size
    ids = np.random.default_rng(0).integers(3, V, 40).tolist()
    ref = H.hf_logits(b.hf, ids)
    for kv_dtype, bound in (("f32", 1e-4), ("f16", 5e-2)):
        eng = BatchEngine(m, max_seqs=1, max_batch_tokens=64, kv_dtype=kv_dtype, prefix_cache=False)
        blocks = [eng.pool.allocate() for _ in range(eng.pool.blocks_for(40))]
        rows = Rows(ids, [0] * 40, range(40), np.array([blocks]), eng.pool.block_size, list(range(40)))
        got = forward_batch(m.config, m.weights, m.rope, eng.ws, eng.pool, rows, np.zeros((40, V), np.float32))
        err = np.abs(got - ref).max()
        assert (err if kv_dtype == "f32" else err / np.abs(ref).max()) < bound, (kv_dtype, err)
        assert np.array_equal(got.argmax(1), ref.argmax(1))


def _run_n(eng, reqs):
    """reqs: [(prompt, params)] added at once; {(rid, choice): tokens}, and each request's first Sequence."""
    out, seqs = {}, {}
    for i, (p, kw) in enumerate(reqs):
        seqs[i] = eng.add(i, p, **kw).seq
    steps = 0
    while eng.has_work():
        for rid, ev in eng.step():
            out.setdefault((rid, ev.choice), []).append(ev.token_id)
        steps += 1
        assert steps < 10_000
    return out, seqs


def test_n_completions_fork_after_one_prefill_and_survive_a_dry_pool(built):
    """n = 3 sampled completions of a 21-token prompt: choice i is what a lone request seeded seed + i gives;
    the prompt is computed once. On a pool too small for all of them, siblings are preempted or start by
    recomputing, and the answers stay the same; the blocks all come back."""
    m = Model.open(built("mixtral").colibri("f32"))
    V = m.config.vocab_size
    prompt = np.random.default_rng(5).integers(3, V, size=21).tolist()
    kw = dict(max_tokens=7, temperature=1.0, seed=40, ignore_eos=True)
    alone = {i: m.generate(prompt, **{**kw, "seed": 40 + i}) for i in range(3)}
    big = BatchEngine(m, max_seqs=4, max_batch_tokens=32, kv_dtype="f32", block_size=4)
    out, _ = _run_n(big, [(prompt, dict(n=3, **kw))])
    assert {c: out[(0, c)] for c in range(3)} == alone
    assert big.prefill_rows == 21 and big.pool.used() == 0
    per_block = KVPool(m.config, 1, 4, "f32").bytes_per_block
    small = BatchEngine(m, max_seqs=4, max_batch_tokens=8, kv_dtype="f32", block_size=4,
                        kv_cache_memory=9 * per_block, prefix_cache=True)
    other = np.random.default_rng(6).integers(3, V, size=9).tolist()
    out, _ = _run_n(small, [(prompt, dict(n=3, **kw)), (other, dict(max_tokens=12, ignore_eos=True))])
    assert {c: out[(0, c)] for c in range(3)} == alone
    assert out[(1, 0)] == m.generate(other, max_tokens=12, ignore_eos=True)
    assert small.sched.preemptions > 0 and small.pool.used() == 0


def test_prompt_logprobs_score_every_prompt_token_once_even_when_preempted(built):
    """A scored prompt computes all its rows (no prefix reuse) and keeps one entry per token through a
    preemption; the values are a log-softmax of Model.logits."""
    m = Model.open(built("mixtral").colibri("f32"))
    V = m.config.vocab_size
    prompt = np.random.default_rng(8).integers(3, V, size=30).tolist()
    x = m.logits(prompt).astype(np.float64)
    ref = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    per_block = KVPool(m.config, 1, 4, "f32").bytes_per_block
    eng = BatchEngine(m, max_seqs=4, max_batch_tokens=8, kv_dtype="f32", block_size=4,
                      kv_cache_memory=12 * per_block)
    _run_n(eng, [(prompt, dict(max_tokens=1))])                  # the prompt's blocks are now cached
    filler = np.random.default_rng(9).integers(3, V, size=5).tolist()
    out, seqs = _run_n(eng, [(prompt, dict(max_tokens=16, prompt_logprobs=2, ignore_eos=True)),
                             (filler, dict(max_tokens=30, ignore_eos=True))])
    lp = seqs[0].prompt_logprobs
    assert len(lp) == 30 and lp[0] is None
    # the paged and the contiguous attention sum in different orders: f32 apart, relative to the logprobs' size
    # (1.4e-5 on values up to ~20 measured on an AVX-512 VM)
    assert max(abs(lp[i][0] - ref[i - 1, prompt[i]]) for i in range(1, 30)) < 2e-6 * max(1.0, np.abs(ref).max())
    assert [e[1].tolist() for e in lp[1:]] == [np.argsort(-ref[i], kind="stable")[:2].tolist() for i in range(29)]
    assert eng.sched.preemptions > 0


def test_a_prompt_of_embeddings_is_its_tokens_through_preemption_and_never_cached(built):
    """Input embeddings (the token rows of an f32 file) answer as the ids, also when preempted and recomputed;
    their placeholder ids never enter the prefix cache (a later prompt of those ids matches nothing)."""
    m = Model.open(built("mixtral").colibri("f32"))
    V = m.config.vocab_size
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, V, size=int(rng.integers(5, 30))).tolist() for _ in range(6)]
    alone = [m.generate(p, max_tokens=10, ignore_eos=True) for p in prompts]
    per_block = KVPool(m.config, 1, 4, "f32").bytes_per_block
    eng = BatchEngine(m, max_seqs=6, max_batch_tokens=16, kv_dtype="f32", block_size=4,
                      kv_cache_memory=20 * per_block)
    out, _ = _run_n(eng, [(None, dict(embeddings=np.asarray(m.weights.token_embd[p], np.float32), max_tokens=10,
                                      ignore_eos=True)) for p in prompts])
    assert [out[(i, 0)] for i in range(6)] == alone
    assert eng.sched.preemptions > 0 and eng.pool.used() == 0 and eng.pool.hits == 0
    _run_n(eng, [([0] * 8, dict(max_tokens=1))])
    assert eng.pool.hits == 0
    with pytest.raises(ValueError, match="prompt_embeds: expected"):
        eng.add("bad", None, embeddings=np.zeros((3, m.config.hidden_size + 1), np.float32))


def test_n_completions_whose_blocks_never_fit_at_once_run_in_turns(built):
    """Issue 38 item 9: a 5-token prompt with n = 5 on a pool of 3 blocks of 4 holds one sequence
    (2 blocks) but never the prompt's blocks plus 4 siblings' copies at once. It used to wait
    forever (waiting: 1, every step empty); it runs its completions in turns, each what a lone
    request seeded seed + i gives, and the pool is empty after."""
    m = Model.open(built("mixtral").colibri("f32"))
    prompt = np.random.default_rng(8).integers(3, m.config.vocab_size, size=5).tolist()
    kw = dict(max_tokens=3, temperature=1.0, seed=7, ignore_eos=True)
    alone = {i: m.generate(prompt, **{**kw, "seed": 7 + i}) for i in range(5)}
    per_block = KVPool(m.config, 1, 4, "f32").bytes_per_block
    eng = BatchEngine(m, max_seqs=5, max_batch_tokens=16, kv_dtype="f32", block_size=4,
                      kv_cache_memory=3 * per_block)
    eng.add(0, prompt, n=5, **kw)
    out, steps = {}, 0
    while eng.has_work() and steps < 200:
        for rid, ev in eng.step():
            out.setdefault(ev.choice, []).append(ev.token_id)
        steps += 1
    assert not eng.has_work(), f"still {eng.sched.stats()} after {steps} steps"
    assert out == alone and eng.pool.used() == 0
