"""Model: open a .colibri file, and turn a prompt into a stream of tokens.

    m = Model.open("model.colibri")
    m.logits([1, 2, 3])                      # (3, V) float32, one prefill
    m.generate([1, 2, 3], max_tokens=32)     # greedy token ids, through the KV cache
    for ev in m.stream("Hello", max_tokens=32, temperature=0.8, seed=1): print(ev.text, end="")

A Model holds the mapping, the weights (views), the rope tables and one Workspace; a
sequence's state lives in a KVCache (one per slot), so one process can hold several
sequences and step them in turn.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from . import weights as W
from .config import ModelConfig, file_config
from .kernels import gemm as GE
from .moe import RoutingNoise
from .rope import rope_tables
from .sampler import Sampler, SamplingParams, StopChecker, token_logprobs
from .tokenizer import IncrementalDecoder, Tokenizer
from .transformer import KVCache, Workspace, forward

DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 256


class NumericalFault(ArithmeticError):
    """A forward pass gave non-finite logits. `layer`: the first layer whose keys or values for
    the new positions are non-finite (None: every layer's are finite, so the fault is after the
    last layer's attention input: its MLP/MoE, the final norm or the output head)."""

    def __init__(self, message, layer=None):
        super().__init__(message)
        self.layer = layer


def check_finite(logits: np.ndarray, cache, start: int, n: int) -> None:
    """Raise NumericalFault if the logits hold a NaN or an infinity, naming the layer where the
    non-finite values first show in the KV cache (positions start..start+n-1). Costs a pass over
    one row of logits per step; the search runs only after a fault."""
    if np.isfinite(logits).all():
        return
    raise numerical_fault(cache, start, n, f"non-finite logits at position {start + n - 1}")


def numerical_fault(cache, start: int, n: int, what: str) -> NumericalFault:
    """The NumericalFault for positions start..start+n-1, naming the first layer whose keys or
    values there are non-finite."""
    layer = None
    for l in range(cache.k.shape[0]):
        if not (np.isfinite(cache.k[l, :, start:start + n]).all() and np.isfinite(cache.v[l, :, start:start + n]).all()):
            layer = l
            break
    where = (f"first non-finite in layer {layer}'s keys/values (its input or attention projections)"
             if layer is not None else "every layer's keys/values are finite: the last layer's MLP/MoE, the "
             "final norm or the output head")
    return NumericalFault(f"{what}: {where}", layer)


@dataclass
class StreamEvent:
    token_id: int | None        # None on the closing event
    text: str                   # text that became final with this event ("" when held back)
    finish_reason: str | None = None   # "stop" | "length" on the last event
    logprobs: tuple | None = None      # (log p(token), top ids, their log p), when params.logprobs is set
    choice: int = 0                    # which of a request's n completions (BatchEngine)


@dataclass
class Completion:
    token_ids: list
    text: str
    finish_reason: str
    prompt_tokens: int
    timings: dict = field(default_factory=dict)   # prefill_s, decode_s


class Model:
    def __init__(self, cf: fmt.ColibriFile, cfg: ModelConfig, weights: W.Weights, *, context: int,
                 prefill_chunk: int, routing_noise: float, seed, threads: int = 1, prefill_bf16: bool = False):
        self.file, self.config, self.weights = cf, cfg, weights
        self.residency = None            # a residency.Residency when the weights have a budget below the file
        self.path = cf.path
        self.metadata = fmt.read_json_blob(cf.path, "metadata", cf.metadata_json, required=False)
        self.context = context
        self.rope = rope_tables(cfg, context)
        self.threads = 1
        self.prefill_bf16 = bool(prefill_bf16)
        self.workspace = Workspace(cfg, prefill_chunk, prefill_bf16=self.prefill_bf16)
        self.set_exact_head(True)         # a block-kind head on the int16 rounding of its input (exact_head)
        if threads > 1:
            self.set_threads(threads)
        if routing_noise and any(L.rule is not None for L in self.weights.layers):
            raise ValueError(f"routing_noise: {cf.path} routes by version-2 rules ({cfg.score_func} scores, "
                             "correction bias or groups); routing noise applies to softmax routing only")
        self.noise = RoutingNoise(routing_noise, seed) if routing_noise else None
        self._tokenizer = None
        self.last_timings = {}
        self.compiled = 0                  # kernels the last warm_up compiled (0: all from the cache)

    # -- opening ----------------------------------------------------------------
    @classmethod
    def open(cls, path, *, context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             populate: bool = False, deep: bool = False, routing_noise: float = 0.0, seed=None,
             blas_threads: int | None = 1, threads: int = 1, prefill_bf16: bool = False,
             hugepages: bool = True) -> "Model":
        """Map and validate a .colibri file (deep: also every tensor checksum). Raises
        FileNotFoundError, or a ColibriFormatError subclass naming the field or tensor.

        blas_threads: limit the process's BLAS pool (None: leave it). The default is 1:
        OpenBLAS's threads, spinning beside our single-threaded kernels, made small prefill
        GEMMs up to 40x slower on 2-core VMs (measured: 1.0 s vs 0.06 s for one prompt).

        threads: > 1 runs decode on that many Numba threads (see set_threads). Only in a
        process that may start threads: a pre-fork master opens with 1 and calls
        compile_threaded() instead; each forked worker then calls set_threads(n).

        prefill_bf16: prefill bf16 weights with bf16-rounded activations (see
        set_prefill_bf16). Off by default: outputs then match the weights run in f32.

        hugepages: ask for the mapping on 2 MiB pages (model/hugepages.py; with populate, the parts
        of a large file found on 4 KiB pages are read again once). file.huge_bytes says how much got them."""
        if blas_threads is not None:
            from threadpoolctl import threadpool_limits
            threadpool_limits(blas_threads, user_api="blas")
        cf = fmt.ColibriFile.open(path, populate=populate, hugepages=hugepages)
        try:
            cfg = file_config(cf)
            weights = W.load(cf, cfg)
            if deep:
                cf.verify_checksums()
            ctx = min(context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
            if ctx < 1 or prefill_chunk < 1:
                raise ValueError(f"context ({ctx}) and prefill_chunk ({prefill_chunk}) must be >= 1")
            return cls(cf, cfg, weights, context=ctx, prefill_chunk=prefill_chunk,
                       routing_noise=routing_noise, seed=seed, threads=threads, prefill_bf16=prefill_bf16)
        except BaseException:
            cf.close()
            raise

    def set_threads(self, n: int) -> None:
        """Run decode on n Numba threads from now on (n == 1: the single-threaded kernels).
        Starts the threading layer's pool: call it after fork, never in a pre-fork master."""
        import numba
        n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
        if n > 1:
            numba.set_num_threads(n)
        self.threads = n
        self.workspace = Workspace(self.config, self.workspace.rows, n, prefill_bf16=self.prefill_bf16)

    def set_prefill_bf16(self, on: bool) -> bool:
        """Prefill bf16 weight matrices with activations rounded to bf16 (vdpbf16ps, f32 sums),
        as transformers' bf16 CPU path does: about twice the speed of the default f32 path, and
        logits that move by the activations' rounding (relative 2^-9 per input). Returns whether
        it is in effect: it needs a CPU with avx512bf16 and a file with bf16 matrices; decode
        and other dtypes are unchanged."""
        self.prefill_bf16 = bool(on)
        self.workspace.prefill_bf16 = self.prefill_bf16 and GE.HAVE_BF16_GEMM
        return self.workspace.prefill_bf16 and self.has_bf16_weights()

    def set_exact_head(self, on: bool) -> bool:
        """A block-kind output head multiplied by the hidden state rounded to int16 (on, the default: a step 258
        times finer than int8, kernels/blocks_wide, at the int8 dots' speed on Q8_0 and Q6_K heads) or to int8
        as llama.cpp rounds it (off). On, a real model's first token follows its f32 reference where the int8
        rounding would swap two near candidates (docs/models.md, "The output head"). Returns whether it is
        in effect (the head is a block kind; the kinds without integer dots take the f32 hidden state anyway)."""
        from .blocks import BlockTensor
        head = self.weights.output
        if not isinstance(head, BlockTensor):
            return False
        if head.acts16 != bool(on):
            self.weights = dataclasses.replace(self.weights, output=head.with_acts16(on))
        return bool(on)

    def has_bf16_weights(self) -> bool:
        """Whether a matrix multiplication reads bf16 weights, rows or panels (the token embedding
        counts only as a tied output head)."""
        return any(r.dtype in ("bf16", "bf16p") and len(r.shape) >= 2
                   and (r.name != "token_embd" or self.config.tie_word_embeddings) for r in self.file.record_list)

    def compile_threaded(self) -> None:
        """Compile the parallel decode kernels for this model's weight types without running
        them (safe in a pre-fork master: nothing is launched)."""
        import numba

        from .decode_step import DecodeStep
        from .kernels import attn as KA
        from .transformer import compile_parallel
        cfg, ws, cache = self.config, Workspace(self.config, 1, threads=2), self.new_cache(1)
        compile_parallel(self.weights, ws)
        scores = ws.attention_scores(cfg, cache.capacity)
        step = DecodeStep.build(cfg, self.weights, ws)               # the fused token on threads
        if step is not None:
            step.compile(self.rope, cache, scores)
        q3 = np.zeros((1, cfg.num_heads, cfg.cache_dim), np.float32)  # prefill's attention (forward, T > 1)
        KA.attention_par.compile(tuple(numba.typeof(a) for a in (
            q3, cache.k[0], cache.v[0], 0, cfg.sliding_window, 1.0, q3, scores, self.weights.layers[0].sinks)))
        if cfg.mla:
            from .mla import compile_threaded as mla_compile
            mla_compile(cfg, self.weights, ws)

    def close(self) -> None:
        self.weights = None
        self.file.close()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if not self.file.tokenizer_json:
                raise ValueError(f"{self.path} has no tokenizer: pass token ids instead of text")
            try:
                self._tokenizer = Tokenizer.from_json(
                    self.file.tokenizer_json, chat_template=self.file.chat_template or None,
                    bos_token_id=self.config.bos_token_id if self.config.bos_token_id >= 0 else None,
                    eos_token_ids=self.config.eos_token_ids)
            except ValueError as e:
                raise fmt.BadBlob(self.path, "tokenizer", str(e)) from None
        return self._tokenizer

    # -- sequences --------------------------------------------------------------
    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(self.config, min(capacity or self.context, self.context))

    def _ids(self, prompt) -> np.ndarray:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        a = np.asarray(ids, dtype=np.int64) if ids else np.zeros(0, np.int64)
        if a.ndim != 1 or a.size == 0:
            raise ValueError("the prompt is empty: give at least one token")
        V = self.config.vocab_size
        bad = np.flatnonzero((a < 0) | (a >= V))
        if bad.size:
            raise ValueError(f"token id {int(a[bad[0]])} at position {int(bad[0])} is outside the vocabulary 0..{V - 1}")
        return a

    def prefill(self, cache: KVCache, ids, all_logits: bool = False, trace=None, argmax_only: bool = False) -> np.ndarray:
        """Feed ids (T,) at cache.length.. in chunks; return (T,V) logits or the last row (1,V) (argmax_only: of
        which the caller reads only the argmax, transformer.forward's)."""
        T = len(ids)
        if cache.length + T > cache.capacity:
            raise ValueError(f"{cache.length + T} tokens exceed the context of {cache.capacity}")
        chunk = self.workspace.rows
        out = np.empty((T, self.config.vocab_size), np.float32) if all_logits else None
        last = None
        for s in range(0, T, chunk):
            part = ids[s:s + chunk]
            last = forward(self.config, self.weights, self.rope, self.workspace, cache, tokens=part,
                           all_logits=all_logits, noise=self.noise, trace=trace,
                           out=out[s:s + len(part)] if all_logits else None, argmax_only=argmax_only)
        return out if all_logits else last

    def decode(self, cache: KVCache, token_id: int, argmax_only: bool = False) -> np.ndarray:
        """One token through the KV cache -> (1,V) logits (a view of the workspace; argmax_only: of which the caller
        reads only the argmax, a greedy sequence's: transformer.forward's)."""
        if cache.length >= cache.capacity:
            raise ValueError(f"the context of {cache.capacity} tokens is full")
        return forward(self.config, self.weights, self.rope, self.workspace, cache,
                       tokens=np.array([token_id], np.int64), noise=self.noise, argmax_only=argmax_only)

    def embed_forward(self, cache: KVCache, embeddings: np.ndarray) -> np.ndarray:
        """Feed raw input embeddings (T,D) instead of token ids (debugging); returns (1,V) logits."""
        e = np.ascontiguousarray(embeddings, dtype=np.float32)
        if e.ndim != 2 or e.shape[1] != self.config.hidden_size:
            raise ValueError(f"embeddings must be (T, {self.config.hidden_size}), got {e.shape}")
        last = None
        for s in range(0, e.shape[0], self.workspace.rows):
            last = forward(self.config, self.weights, self.rope, self.workspace, cache,
                           embeddings=e[s:s + self.workspace.rows], noise=self.noise)
        return last

    def generate_from_embeddings(self, embeddings: np.ndarray, max_tokens: int, temperature: float = 0.0,
                                 seed: int | None = None) -> list[int]:
        """Sample up to max_tokens token ids after raw input embeddings (T,D) (debugging: `colibri run
        --embedding`); stops early when the context is full."""
        cache = self.new_cache()
        logits = self.embed_forward(cache, embeddings)
        s = Sampler(SamplingParams(temperature=temperature, seed=seed), self.config.vocab_size)
        out: list[int] = []
        for _ in range(max_tokens):
            t = s.sample(logits[0], out)
            out.append(t)
            if cache.length >= cache.capacity:
                break
            logits = self.decode(cache, t)
        return out

    # -- high level -------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """(T, V) float32 logits of every position of `token_ids`, from one prefill."""
        ids = self._ids(token_ids)
        return self.prefill(self.new_cache(len(ids)), ids, all_logits=True)

    def sequence(self, prompt, cache: KVCache | None = None, **params) -> "Sequence":
        """A generation as a state machine: call step() until .finished (see Sequence)."""
        return Sequence(self, prompt, cache or self.new_cache(), SamplingParams(**params))

    def stream(self, prompt, cache: KVCache | None = None, **params):
        """Yield StreamEvents: one per generated token, the last with its finish_reason
        ("stop": eos, stop token or stop string; "length": max_tokens or the context is full)."""
        seq = self.sequence(prompt, cache, **params)
        while not seq.finished:
            ev = seq.step()
            if ev is not None:
                yield ev
        self.last_timings = seq.timings

    def warm_up(self, announce=None, after: float = 1.0, run=None, every: float = 10.0, on_compile=None) -> float:
        """Run a two-token generation (or `run()`: what a server's workers will run), so that every
        kernel this model uses is compiled (or loaded from the kernel cache) now rather than inside the
        first request or measurement. When that takes longer than `after` seconds (compiling: a first
        run of this kind of model on this machine, unless `colibri compile` ran), `announce(message)` is
        called, and again every `every` seconds with the count so far, so that the wait does not look
        like a hang; `on_compile()` once when the first kernel compiles. Returns the seconds spent;
        `self.compiled` is the number of kernels compiled."""
        import threading
        import time

        from .numba_cache import Compiles
        done = threading.Event()

        def later():
            if not done.wait(after) and announce is not None:
                announce("compiling the CPU kernels for this kind of model (once per machine: they are cached; "
                         "`colibri compile` does it ahead of time)")
        t = threading.Thread(target=later, name="colibri-compile-notice", daemon=True)
        t.start()
        t0 = time.perf_counter()
        report = None if announce is None else (
            lambda c: announce(f"compiling kernels: {c.count} so far, last {c.last} ({time.perf_counter() - t0:.0f}s)"))
        try:
            with Compiles(report, every, on_compile) as compiles:
                if run is not None:
                    run()
                else:
                    # the fused token first, alone: the longest compile of a first start, which a first `colibri
                    # run` overlaps with a second process compiling the prompt's kernels (precompile.PREFILL)
                    bos = self.config.bos_token_id if self.config.bos_token_id >= 0 else 0
                    self.decode(self.new_cache(2), bos)
                    self.generate([bos, bos], max_tokens=2, ignore_eos=True)
        finally:
            done.set()
            t.join()
        self.compiled = compiles.count
        return time.perf_counter() - t0

    def generate(self, prompt, max_tokens: int = SamplingParams.max_tokens,
                 temperature: float = SamplingParams.temperature, seed=None, **params) -> list:
        """Generated token ids (temperature 0 = greedy), through the decode path and the KV cache."""
        return [ev.token_id for ev in self.stream(prompt, max_tokens=max_tokens, temperature=temperature,
                                                  seed=seed, **params)]

    def complete(self, prompt, **params) -> Completion:
        ids, text, reason = [], [], None
        for ev in self.stream(prompt, **params):
            ids.append(ev.token_id)
            text.append(ev.text)
            reason = ev.finish_reason
        t = dict(self.last_timings)
        return Completion(ids, "".join(text), reason, t.pop("prompt_tokens"), t)


class Sequence:
    """One generation, advanced one bounded step at a time so a worker can interleave
    several sequences, answer its socket and heartbeat between steps.

    step() feeds one prefill chunk of the prompt, or samples one token (decoding the
    previous one through the KV cache first), and returns the StreamEvent of a new token
    or None while the prompt is still being fed. Logits are consumed within the step that
    produced them, so sequences of one Model can share its Workspace."""

    def __init__(self, model: Model, prompt, cache: KVCache, params: SamplingParams, embeddings=None):
        self.model, self.params, self.cache = model, params, cache
        # embeddings (T,D) float32: the prompt's input embeddings instead of token ids (its ids are then
        # placeholders, 0: they are never embedded, never matched in a prefix cache, never penalised)
        self.embeddings = None
        if embeddings is not None:
            e = np.asarray(embeddings)
            D = model.config.hidden_size
            if e.ndim != 2 or e.shape[1] != D or e.shape[0] < 1:
                raise ValueError(f"prompt_embeds: expected (T, {D}) with T >= 1, got {e.shape}")
            if not np.isfinite(e).all():
                raise ValueError("prompt_embeds: holds NaN or infinite values")
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: a prompt given as embeddings has no tokens to score")
            self.embeddings = np.ascontiguousarray(e, np.float32)
            prompt = [0] * e.shape[0]
        self.prompt_ids = model._ids(prompt)
        # cache None: the sequence's keys and values live elsewhere (a BatchEngine's paged pool), which
        # calls _sample with each step's logits; the context is then the model's
        self.capacity = cache.capacity if cache is not None else model.context
        if len(self.prompt_ids) > self.capacity:
            raise ValueError(f"prompt of {len(self.prompt_ids)} tokens exceeds the context of {self.capacity}")
        if cache is not None:
            cache.reset()
        tok = model.tokenizer if model.file.tokenizer_json else None
        self.decoder = IncrementalDecoder(tok) if tok is not None else None
        self.stops = StopChecker(params.stop, params.stop_token_ids, model.config.eos_token_ids,
                                 ignore_eos=params.ignore_eos)
        self.sampler = Sampler(params, model.config.vocab_size)
        self.constraint = None
        if params.grammar is not None:                  # raises GrammarError (a ValueError) naming the problem
            from .grammar import Constraint
            self.constraint = Constraint.build(model, params.grammar)
        self.history = self.prompt_ids.tolist() if self.embeddings is None else []
        self.fed = 0                     # prompt tokens fed so far
        self.generated = []              # token ids
        self.last = None                 # the last sampled token, not yet fed
        self.finished, self.finish_reason = False, None
        self.timings = {"prompt_tokens": len(self.prompt_ids), "prefill_s": 0.0, "decode_s": 0.0}
        # params.prompt_logprobs: one entry per prompt position, None for the first (nothing predicts it)
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None

    def fork(self, seed) -> "Sequence":
        """A sibling for another of a request's n completions: the same prompt, nothing sampled yet,
        its own sampler (seeded with `seed`), stop checker and decoder."""
        params = dataclasses.replace(self.params, seed=seed, prompt_logprobs=None)
        return Sequence(self.model, self.prompt_ids, self.cache, params, self.embeddings)

    def score_prompt(self, start: int, logits) -> None:
        """Prompt logprobs from the logits of prompt rows start..start+len(logits)-1 (row r predicts
        prompt token r+1); rows already scored (a recomputation after preemption) are skipped."""
        if self.prompt_logprobs is None:
            return
        P, k = len(self.prompt_ids), self.params.prompt_logprobs
        for r in range(max(start, len(self.prompt_logprobs) - 1), min(start + len(logits), P - 1)):
            self.prompt_logprobs.append(token_logprobs(logits[r - start], int(self.prompt_ids[r + 1]), k))

    def step(self):
        if self.finished:
            return None
        m, t0 = self.model, time.perf_counter()
        start, n = self.cache.length, 1
        try:
            if self.fed < len(self.prompt_ids):
                part = self.prompt_ids[self.fed:self.fed + m.workspace.rows]
                n = len(part)
                if self.prompt_logprobs is not None:
                    logits = m.prefill(self.cache, part, all_logits=True)
                    self.score_prompt(self.fed, logits)
                    logits = logits[-1:]
                else:
                    logits = m.prefill(self.cache, part, argmax_only=self.argmax_only())
                self.fed += len(part)
                self.timings["prefill_s"] += time.perf_counter() - t0
                if self.fed < len(self.prompt_ids):
                    return None
            else:
                logits = m.decode(self.cache, self.last, argmax_only=self.argmax_only())
        except ArithmeticError as e:        # a kernel met NaNs (the MoE router's weights sum to 0, ...)
            raise numerical_fault(self.cache, start, n, f"{e.__class__.__name__} in the forward pass at "
                                                        f"positions {start}..{start + n - 1}") from None
        check_finite(logits, self.cache, start, n)
        ev = self._sample(logits)
        if self.generated[1:]:
            self.timings["decode_s"] += time.perf_counter() - t0
        return ev

    def argmax_only(self) -> bool:
        """Whether the next token reads nothing of its logits but which is largest: argmax_only sampling, no
        grammar, no log-probabilities (model/head then gives that argmax at the int8 head's speed)."""
        return self.params.argmax_only and self.constraint is None and self.params.logprobs is None

    def _sample(self, logits) -> StreamEvent:
        p = self.params
        allowed, complete = None, False
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            complete = self.constraint.accepting        # the output so far satisfies the grammar
            if not complete and (self.constraint.error is not None or not allowed.any()):
                raise self._dead_end()
            if not allowed.any():                       # complete, nothing more allowed: the end
                allowed = np.zeros_like(allowed)        # (EOS; any token for a model without one)
                allowed[list(self.model.config.eos_token_ids) or slice(None)] = True
        t = self.sampler.sample(logits[0], self.history, allowed)
        lp = token_logprobs(logits[0], t, p.logprobs) if p.logprobs is not None else None
        self.history.append(t)
        self.generated.append(t)
        self.last = t
        emit, finished, reason = self.stops.push(t, self.decoder.push(t) if self.decoder is not None else "")
        if self.constraint is not None:
            self.constraint.advance(t)
            if self.constraint.error is not None and not complete:   # stopped in error: not a completed grammar
                raise self._dead_end()
            grammar_end = self.constraint.done or t in self.model.config.eos_token_ids or complete and \
                self.constraint.error is not None
            if grammar_end and not finished:            # complete (or ended by EOS under ignore_eos)
                tail = self.decoder.flush() if self.decoder is not None else ""
                emit += self.stops.push(None, tail)[0] + self.stops.flush()
                finished, reason = True, "stop"
        if not finished and (len(self.generated) >= p.max_tokens or len(self.history) - 1 >= self.capacity):
            tail = self.decoder.flush() if self.decoder is not None else ""
            emit += self.stops.push(None, tail)[0] + self.stops.flush()
            finished, reason = True, "length"
        if finished:
            self.finished, self.finish_reason = True, reason
        return StreamEvent(t, emit, reason if finished else None, lp)

    def _dead_end(self):
        from .grammar import GrammarDeadEnd
        kind = self.params.grammar[0]
        err = self.constraint.error
        tail = self.model.tokenizer.decode(self.generated[-8:]) if self.decoder is not None else str(self.generated[-8:])
        return GrammarDeadEnd(f"grammar: the output admits no continuation within its {kind} after "
                              f"{len(self.generated)} tokens (ending {tail[-40:]!r})"
                              + (f": {err.splitlines()[0][:200]}" if err else ": it cannot be satisfied"))

    def cancel(self) -> None:
        self.finished, self.finish_reason = True, "cancelled"
