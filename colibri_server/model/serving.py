"""BatchEngine: a worker's requests stepped together, one forward per step over all of them.

    eng = BatchEngine(model, max_seqs=16, max_batch_tokens=256)
    eng.add("r1", [1, 2, 3], max_tokens=32)          # or a prompt string; sampling fields as Model.stream
    while eng.has_work():
        for rid, ev in eng.step():                   # a StreamEvent per sampled token
            ...                                      # ev.finish_reason set on a request's last event

Each step: the scheduler picks the rows (every decoding sequence's next token, prefill chunks under
the token budget), forward_batch runs them in one pass over the weights, each sequence whose rows
reached its last known token samples its next one with its own sampler (engine.Sequence: the same
sampling, stop strings and detokenization as Model.stream). Finished and cancelled requests leave
the pool at once; their prompt blocks stay in the prefix cache.

Non-finite logits (corrupted weights, an overflow) end only the requests whose rows gave them:
after a step, `eng.faults` lists (rid, engine.NumericalFault naming the first layer whose keys or
values of that request are non-finite); those requests have left the engine, the others go on.
A request whose grammar admits no next token ends the same way, with a grammar.GrammarDeadEnd.
A kernel's ArithmeticError on NaNs (the MoE router's ZeroDivisionError) aborts the forward: the
requests whose new keys/values are non-finite are faulted the same way (all of the step's, when
none is), the others are recomputed by the next step.

Owns: the KV pool, the scheduler, the step's row arrays and logits buffer, per-request timings.
Never: touches a socket or a process (worker/process.py does), or decides routing (the router does).
"""
from __future__ import annotations

import time

import numpy as np

from .batch import Rows, forward_batch
from .engine import NumericalFault, Sequence
from .grammar import GrammarDeadEnd
from .kernels import aligned_zeros
from .kv import BLOCK_SIZE, KVPool, block_bytes
from .sampler import SamplingParams
from .scheduler import Scheduler
from .transformer import Workspace


class RequestTooLarge(ValueError):
    """A prompt and max_tokens beyond the context, or beyond what the KV pool can ever hold."""


class BatchEngine:
    def __init__(self, model, *, max_seqs: int = 16, max_batch_tokens: int = 256, kv_cache_memory: int = 0,
                 kv_dtype: str = "f16", block_size: int = BLOCK_SIZE, prefix_cache: bool = True,
                 predict_experts: bool = False):
        cfg = model.config
        self.model = model
        per_block = block_bytes(cfg, block_size, kv_dtype)
        full = max_seqs * -(-model.context // block_size)            # every slot at full context
        blocks = full if kv_cache_memory <= 0 else max(1, min(full, kv_cache_memory // per_block))
        self.pool = KVPool(cfg, blocks, block_size, kv_dtype)
        self.sched = Scheduler(self.pool, max_seqs, max_batch_tokens, prefix_cache)
        ws = model.workspace            # the model's own activations when they hold a step (a worker runs no other path)
        if ws.rows < self.sched.max_batch_tokens or ws.threads != model.threads:
            ws = Workspace(cfg, self.sched.max_batch_tokens, model.threads, prefill_bf16=model.prefill_bf16)
        self.ws = ws
        # a step of one decoding sequence runs the fused decode token on the pool (decode_step.py), at
        # least as fast as batch-1 decode was before batching; None for models it does not cover
        self.single = ws.decode_step(cfg, model.weights)
        # weights under a budget (residency.py): every step through forward_batch, whose layers ask for the
        # experts that are not resident before they run (the fused token has no place between layers), and with
        # predict_experts the next layer's probable ones (expert_readahead)
        residency = getattr(model, "residency", None)
        self.fetch = residency.reader(cfg, predict_experts) if residency is not None else None
        if self.fetch is not None:
            self.single = None
        self.scores = aligned_zeros(cfg.num_heads // cfg.num_kv_heads * model.context, np.float32) \
            if self.single is not None else None
        self.logits = aligned_zeros((max_seqs, cfg.vocab_size), np.float32)   # (M,V), M <= max_seqs
        self.states = {}                                              # rid -> SeqState
        self.faults = []                                              # [(rid, NumericalFault)] of the last step
        self.expert_counts = np.zeros((cfg.num_layers, max(1, cfg.num_experts)), np.int64)   # (L,E) choices
        # the routing layers of the fused one-sequence token, (n_moe,1): its routes row j is their j-th's experts
        self._moe_rows = self.single.moe_layers[:, None] if self.single is not None else None
        self.steps = 0
        self.prefill_rows = 0                                         # prompt positions computed (recomputations too)
        self.rows_total = 0
        self.last_rows = 0
        self.tokens_out = 0                                           # tokens sampled (every completion's)

    # -- requests -------------------------------------------------------------------------
    def add(self, rid, prompt, n: int = 1, embeddings=None, **params):
        """Queue a request of n completions (sampled from one prefill of the prompt: the first
        completion's prompt blocks are shared with the others when it samples its first token);
        embeddings: the prompt as input embeddings (T, hidden) instead of token ids (prompt is then
        ignored). Raises ValueError (a bad prompt or parameter) or RequestTooLarge."""
        if rid in self.states:
            raise ValueError(f"request {rid!r} is already running")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: must be an integer >= 1, got {n!r}")
        if n > self.sched.max_seqs:
            raise RequestTooLarge(f"n = {n} completions exceed the worker's {self.sched.max_seqs} slots")
        m = self.model
        seq = Sequence(m, prompt, None, SamplingParams(**params), embeddings)
        P, mt = len(seq.prompt_ids), seq.params.max_tokens
        if P + mt > m.context:
            raise RequestTooLarge(f"prompt of {P} tokens plus max_tokens {mt} exceeds the context of {m.context} "
                                  f"tokens: shorten the prompt or lower max_tokens to {max(0, m.context - P)}")
        try:
            st = self.sched.add(rid, seq.prompt_ids.tolist(), P + mt)
        except ValueError as e:
            raise RequestTooLarge(str(e)) from None
        st.seq, st.width = seq, n
        st.reuse = seq.prompt_logprobs is None and embeddings is None   # a scored prompt computes every row itself
        st.cacheable = embeddings is None                # placeholder ids must never meet a real prompt
        self.states[rid] = [st]
        return st

    def cancel(self, rid) -> bool:
        group = self.states.pop(rid, None)
        if group is None:
            return False
        for st in group:
            st.seq.cancel()
            self.sched.finish(st)
        return True

    def has_work(self) -> bool:
        return bool(self.states)

    def __len__(self) -> int:
        return len(self.states)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batched forward; return [(rid, StreamEvent)] for every token sampled in it
        (ev.choice: which of the request's n completions)."""
        self.faults = []
        plan = self.sched.schedule()
        if not plan:
            s = self.sched.stuck()              # never expected: a request that can never start
            if s is not None and s.rid in self.states:
                self._fault(s, RequestTooLarge(f"request of {len(s.tokens)} positions cannot start in the worker's "
                                               f"pool of {self.pool.num_blocks} KV blocks"))
            return []
        t0 = time.perf_counter()
        rows = self._rows(plan)
        m = self.model
        out = self.logits if len(rows.sample) <= self.logits.shape[0] else \
            np.empty((len(rows.sample), self.logits.shape[1]), np.float32)      # a scored prompt's rows
        try:
            if len(rows) == 1 and len(plan) == 1 and plan[0].sample and self.single is not None and not rows.embeds \
                    and (m.noise is None or m.noise.scale <= 0):
                logits = self.single.paged(m.rope, self.pool, rows.tables[0], int(rows.pos[0]), int(rows.tokens[0]),
                                           self.scores, self._argmax_rows(plan, rows)[0])
                self.expert_counts[self._moe_rows, self.single.routes] += 1    # (n_moe,A): a layer's experts differ
            else:
                logits = forward_batch(m.config, m.weights, m.rope, self.ws, self.pool, rows, out, noise=m.noise,
                                       expert_counts=self.expert_counts, fetch=self.fetch,
                                       argmax_rows=self._argmax_rows(plan, rows))
        except ArithmeticError as e:        # a kernel met NaNs: fault whose rows hold them, recompute the rest
            self._arithmetic_fault(plan, e)
            return []
        dt = time.perf_counter() - t0
        events = []
        for seg, (first, j) in zip(plan, rows.seg_logits):
            st = seg.state
            if st.rid not in self.states:
                continue                                        # faulted by a sibling in this step
            if seg.sample and not np.isfinite(logits[j]).all():
                self._fault(st, self._numerical_fault(st, seg.start + seg.n, f"non-finite logits at position "
                                                                             f"{seg.start + seg.n - 1}"))
                continue
            self.sched.advance(seg)
            P = len(st.seq.prompt_ids)
            prefill = seg.start < P
            st.seq.timings["prefill_s" if prefill else "decode_s"] += dt
            self.prefill_rows += max(0, min(seg.start + seg.n, P) - seg.start)
            if first is not None:
                st.seq.score_prompt(seg.start, logits[first:first + seg.n])
            if not seg.sample:
                continue
            group = [st]
            if st.width > 1:                                    # the first token of n: fork the siblings
                group += [self.sched.fork(st, i, st.seq.fork(None if st.seq.params.seed is None
                                                             else st.seq.params.seed + i))
                          for i in range(1, st.width)]
                st.width = 1
                self.states[st.rid].extend(group[1:])
            for s in group:
                if s.rid not in self.states:
                    break                                       # a sibling's grammar ended the request
                try:
                    ev = s.seq._sample(logits[j:j + 1])
                except GrammarDeadEnd as e:
                    self._fault(s, e)
                    continue
                ev.choice = s.choice
                s.tokens.append(ev.token_id)
                events.append((s.rid, ev))
                if s.seq.finished:
                    self._leave(s)
        self.steps += 1
        self.last_rows = len(rows)
        self.rows_total += len(rows)
        self.tokens_out += len(events)
        return events

    def _leave(self, st) -> None:
        """st is finished: its blocks go back to the pool; the request leaves with its last completion."""
        self.sched.finish(st)
        group = self.states.get(st.rid)
        if group is not None:
            group.remove(st)
            if not group:
                del self.states[st.rid]

    # -- numerical faults -------------------------------------------------------------------
    def _nonfinite_layer(self, st, end: int):
        """The first layer whose keys or values at st's positions 0..end-1 are non-finite, or None."""
        pool, BS = self.pool, self.pool.block_size
        for l in range(pool.k.shape[0]):
            for i, b in enumerate(st.blocks[:-(-end // BS)]):
                n = min(BS, end - i * BS)
                for arr in (pool.k, pool.v):
                    x = arr[l, b, :, :n]
                    bad = ((x & 0x7C00) == 0x7C00).any() if x.dtype == np.uint16 else not np.isfinite(x).all()
                    if bad:
                        return l
        return None

    def _numerical_fault(self, st, end: int, what: str) -> NumericalFault:
        layer = self._nonfinite_layer(st, end)
        where = (f"first non-finite in layer {layer}'s keys/values (its input or attention projections)"
                 if layer is not None else "every layer's keys/values are finite: the last layer's MLP/MoE, the "
                 "final norm or the output head")
        return NumericalFault(f"{what}: {where}", layer)

    def _fault(self, st, exc: Exception) -> None:
        """The request of st ends with exc, every completion of it."""
        self.faults.append((st.rid, exc))
        for s in self.states.pop(st.rid, [st]):
            s.seq.cancel()
            for b in s.blocks[s.registered:]:   # no stale NaNs for the block's next owner to be blamed for
                if self.pool.refs[b] == 1:
                    self.pool.k[:, b] = 0
                    self.pool.v[:, b] = 0
            self.sched.finish(s)

    def _arithmetic_fault(self, plan, e: ArithmeticError) -> None:
        what = lambda seg: (f"{e.__class__.__name__} in the forward pass at positions "    # noqa: E731
                            f"{seg.start}..{seg.start + seg.n - 1}")
        found = [(seg, self._nonfinite_layer(seg.state, seg.start + seg.n)) for seg in plan]
        bad = [seg for seg, layer in found if layer is not None] or list(plan)
        for seg in bad:
            if seg.state.rid in self.states:
                self._fault(seg.state, self._numerical_fault(seg.state, seg.start + seg.n, what(seg)))

    @staticmethod
    def _argmax_rows(plan, rows) -> np.ndarray:
        """(M,) bool over the sampled rows: those whose token is the argmax of their logits and which nothing else
        reads (no scored prompt rows, one completion, Sequence.argmax_only)."""
        mask = np.zeros(len(rows.sample), np.bool_)
        for seg, (first, j) in zip(plan, rows.seg_logits):
            if j is not None and first is None and seg.state.width == 1 and seg.state.seq.argmax_only():
                mask[j] = True
        return mask

    def _rows(self, plan) -> Rows:
        """The step's rows; rows.seg_logits[i] = (first logits row of segment i's scored prompt rows or
        None, its sampled row's logits row or None)."""
        n = sum(seg.n for seg in plan)
        maxb = max(len(seg.state.blocks) for seg in plan)
        tokens = np.empty(n, np.int64)
        seq = np.empty(n, np.int64)
        pos = np.empty(n, np.int64)
        tables = np.zeros((len(plan), maxb), np.int32)
        sample, seg_logits, embeds, r = [], [], [], 0
        for i, seg in enumerate(plan):
            st = seg.state
            tokens[r:r + seg.n] = st.tokens[seg.start:seg.start + seg.n]
            seq[r:r + seg.n] = i
            pos[r:r + seg.n] = np.arange(seg.start, seg.start + seg.n)
            tables[i, :len(st.blocks)] = st.blocks
            e = st.seq.embeddings
            if e is not None and seg.start < e.shape[0]:         # rows of a prompt given as embeddings
                embeds.append((r, e[seg.start:min(seg.start + seg.n, e.shape[0])]))
            first = None
            if st.seq.prompt_logprobs is not None and seg.start < len(st.seq.prompt_ids) - 1:
                first = len(sample)                             # every row's logits: each scores a prompt token
                sample.extend(range(r, r + seg.n))
            elif seg.sample:
                sample.append(r + seg.n - 1)
            r += seg.n
            seg_logits.append((first, len(sample) - 1 if seg.sample else None))
        rows = Rows(tokens, seq, pos, tables, self.pool.block_size, sample)
        rows.seg_logits, rows.embeds = seg_logits, embeds
        return rows

    def stats(self) -> dict:
        s = dict(self.pool.stats())
        s.update(self.sched.stats())
        s.update(steps=self.steps, prefill_tokens=self.prefill_rows, expert_counts=self.expert_counts.tolist(),
                 batch_rows_last=self.last_rows, rows_total=self.rows_total, tokens_out=self.tokens_out,
                 batch_rows_mean=round(self.rows_total / self.steps, 2) if self.steps else 0.0)
        if self.fetch is not None:
            s["weights"] = self.fetch.figures()
        return s


def warm_up(model, kv_dtype: str = "f16", threads: int = 1) -> None:
    """Compile the batched step's one-thread kernels for this model (a pre-fork master runs it once, at
    every start): two short requests stepped together, a 5-token prompt on a workspace whose few-row
    limit is 4 (so it takes prefill's tiles or GEMM, as a long prompt would, without a long prefill at
    start), and, for one-thread workers, one request alone (the fused one-sequence step; threaded
    workers run its threaded form: compile_threaded)."""
    eng = BatchEngine(model, max_seqs=2, max_batch_tokens=8, kv_dtype=kv_dtype, block_size=4,
                      kv_cache_memory=8 * block_bytes(model.config, 4, kv_dtype), prefix_cache=False)
    bos = max(0, model.config.bos_token_id)

    def run(*prompts):
        for rid, p in enumerate(prompts):
            eng.add(rid, p, max_tokens=2, ignore_eos=True)
        while eng.has_work():
            eng.step()
    run([bos] * 3, [bos] * 3)
    if model.context > Workspace.ROWGEMM_MAX_ROWS:  # else no step can exceed the few-row kernels
        if eng.ws is model.workspace:               # the limit goes on a workspace of the warm-up's own
            eng.ws = Workspace(model.config, eng.ws.rows, eng.ws.threads, prefill_bf16=eng.ws.prefill_bf16)
        eng.ws.ROWGEMM_MAX_ROWS = 4
        run([bos] * 5)
    if threads <= 1:
        run([bos] * 3)


def compile_threaded(model, kv_dtype: str = "f16") -> None:
    """The threaded kernels of the batched step, compiled by signature without running them."""
    import numba

    from . import kernels as K
    from .blocks import is_block
    from .head import compile_refine
    from .kernels import parallel_runtime
    from .kernels import rowgemm as RG
    from .kernels import tiled as KT
    from .panels import Panels, kernel_array
    from .transformer import compile_parallel
    parallel_runtime()

    def sig(*args):
        return tuple(numba.typeof(a) for a in args)
    cfg, w = model.config, model.weights
    X = np.zeros((2, max(cfg.hidden_size, cfg.q_dim, cfg.attn_dim, cfg.q_lora_rank, cfg.moe_intermediate_size,
                         cfg.intermediate_size)), np.float32)
    seen = set()
    mats = [m for L in w.layers for m in (L.wq, L.wk, L.wv, L.wo, L.w1, L.w3, L.w2, L.mlp_w1, L.mlp_w3, L.mlp_w2,
                                          L.shared_w1, L.shared_w3, L.shared_w2, L.q_a, L.kv_a)] + [w.output]
    mats = [W for W in mats if not is_block(W)]          # block kinds: kernels/blocks, compiled on first use
    for W in mats:
        if W is None or hasattr(W, "q") or W.dtype == np.float32:
            continue
        if isinstance(W, Panels):
            P = W.p if W.p.ndim == 3 else W.p[0]
        else:
            P = (W if W.ndim == 2 else W[0])[None]
        n, d = P.shape[0] * P.shape[2], P.shape[1]
        # activations and outputs whole (ws.h[:N], ws.q[:N]) or column slices (moe's ffn_g/ffn_u)
        for x in (X[:, :n], np.zeros((2, n), np.float32)):
            for out in (X[:, :d], np.zeros((2, d), np.float32)):
                s = sig(P, x, out, 2)
                if s not in seen:
                    seen.add(s)
                    RG.rowgemm_par.compile(s)
    ws = Workspace(cfg, 1, threads=2)
    compile_parallel(w, ws)                                                  # mm's threaded matvecs and GEMMs
    compile_refine(ws, w.output, w.output_b)                                 # the greedy rows' head (model/head)
    for W in mats:                                       # and its one-thread matvec for the matrices below that
        if W is not None and not hasattr(W, "q") and W.dtype != np.float32 and W.ndim == 2 \
                and W.shape[0] * W.shape[1] < ws.PAR_MIN_WEIGHTS:
            s = sig(kernel_array(W), X[0, :W.shape[1]], X[1, :W.shape[0]])
            if s not in seen:
                seen.add(s)
                K.matvec.compile(s)
    for L in w.layers:                                                       # moe's experts in one call
        if L.w1 is not None and ws.experts_in_one_call(L, 2, ws.threads):
            i64 = np.zeros(2, np.int64)
            h = np.zeros((2, cfg.hidden_size), np.float32)
            s = sig(kernel_array(L.w1), kernel_array(L.w3), kernel_array(L.w2), h, i64, i64, 2, h, i64)
            if s not in seen:
                seen.add(s)
                RG.experts_rows_par.compile(s)
    pool = KVPool(cfg, 1, 1, kv_dtype)
    step = ws.decode_step(cfg, w)                                            # the fused one-sequence step
    if step is not None:
        step.compile_paged(model.rope, pool)
    q = np.zeros((1, cfg.num_heads, cfg.cache_dim), np.float32)
    KT.tiled_attention_par.compile(sig(q, pool.k[0], pool.v[0], np.zeros((1, 1), np.int32), np.zeros(1, np.int64),
                                       np.zeros(1, np.int64), cfg.sliding_window, 1.0, q, w.layers[0].sinks, 2))
    if cfg.mla:
        from .mla import compile_threaded as mla_compile
        mla_compile(cfg, w, ws)
