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

import time
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from . import weights as W
from .config import ConfigError, ModelConfig
from .moe import RoutingNoise
from .rope import rope_tables
from .sampler import Sampler, SamplingParams, StopChecker
from .tokenizer import IncrementalDecoder, Tokenizer
from .transformer import KVCache, Workspace, forward

DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class StreamEvent:
    token_id: int | None        # None on the closing event
    text: str                   # text that became final with this event ("" when held back)
    finish_reason: str | None = None   # "stop" | "length" on the last event


@dataclass
class Completion:
    token_ids: list
    text: str
    finish_reason: str
    prompt_tokens: int
    timings: dict = field(default_factory=dict)   # prefill_s, decode_s


class Model:
    def __init__(self, cf: fmt.ColibriFile, cfg: ModelConfig, weights: W.Weights, *, context: int,
                 prefill_chunk: int, routing_noise: float, seed):
        self.file, self.config, self.weights = cf, cfg, weights
        self.path = cf.path
        self.metadata = fmt.read_json_blob(cf.path, "metadata", cf.metadata_json, required=False)
        self.context = context
        self.rope = rope_tables(cfg, context)
        self.workspace = Workspace(cfg, prefill_chunk)
        self.noise = RoutingNoise(routing_noise, seed) if routing_noise else None
        self._tokenizer = None
        self.last_timings = {}

    # -- opening ----------------------------------------------------------------
    @classmethod
    def open(cls, path, *, context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             populate: bool = False, deep: bool = False, routing_noise: float = 0.0, seed=None) -> "Model":
        """Map and validate a .colibri file (deep: also every tensor checksum). Raises
        FileNotFoundError, or a ColibriFormatError subclass naming the field or tensor."""
        cf = fmt.ColibriFile.open(path, populate=populate)
        try:
            raw = fmt.read_json_blob(cf.path, "config", cf.config_json)
            try:
                cfg = ModelConfig.from_dict(raw)
            except ConfigError as e:
                raise fmt.BadConfig(cf.path, f"config.{e.key}", str(e)) from None
            weights = W.load(cf, cfg)
            if deep:
                cf.verify_checksums()
            ctx = min(context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
            if ctx < 1 or prefill_chunk < 1:
                raise ValueError(f"context ({ctx}) and prefill_chunk ({prefill_chunk}) must be >= 1")
            return cls(cf, cfg, weights, context=ctx, prefill_chunk=prefill_chunk,
                       routing_noise=routing_noise, seed=seed)
        except BaseException:
            cf.close()
            raise

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

    def prefill(self, cache: KVCache, ids, all_logits: bool = False, trace=None) -> np.ndarray:
        """Feed ids (T,) at cache.length.. in chunks; return (T,V) logits or the last row (1,V)."""
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
                           out=out[s:s + len(part)] if all_logits else None)
        return out if all_logits else last

    def decode(self, cache: KVCache, token_id: int) -> np.ndarray:
        """One token through the KV cache -> (1,V) logits (a view of the workspace)."""
        if cache.length >= cache.capacity:
            raise ValueError(f"the context of {cache.capacity} tokens is full")
        return forward(self.config, self.weights, self.rope, self.workspace, cache,
                       tokens=np.array([token_id], np.int64), noise=self.noise)

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

    # -- high level -------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """(T, V) float32 logits of every position of `token_ids`, from one prefill."""
        ids = self._ids(token_ids)
        return self.prefill(self.new_cache(len(ids)), ids, all_logits=True)

    def stream(self, prompt, cache: KVCache | None = None, **params):
        """Yield StreamEvents: one per generated token, the last with its finish_reason
        ("stop": eos, stop token or stop string; "length": max_tokens or the context is full)
        and the timings {prompt_tokens, prefill_s, decode_s}."""
        p = SamplingParams(**params)
        ids = self._ids(prompt)
        cache = cache or self.new_cache()
        cache.reset()
        decoder = IncrementalDecoder(self.tokenizer) if self.file.tokenizer_json else None
        stops = StopChecker(p.stop, p.stop_token_ids, self.config.eos_token_ids, ignore_eos=p.ignore_eos)
        sampler = Sampler(p, self.config.vocab_size)
        history = ids.tolist()
        t0 = time.perf_counter()
        logits = self.prefill(cache, ids)
        t1 = time.perf_counter()
        timings = {"prompt_tokens": len(ids), "prefill_s": t1 - t0, "decode_s": 0.0}
        for i in range(p.max_tokens):
            t = sampler.sample(logits[0], history)
            history.append(t)
            emit, finished, reason = stops.push(t, decoder.push(t) if decoder is not None else "")
            if not finished and (i == p.max_tokens - 1 or cache.length >= cache.capacity):
                tail = decoder.flush() if decoder is not None else ""
                emit += stops.push(None, tail)[0] + stops.flush()
                finished, reason = True, "length"
            if finished:
                timings["decode_s"] = time.perf_counter() - t1
                self.last_timings = timings
                yield StreamEvent(t, emit, reason)
                return
            yield StreamEvent(t, emit)
            logits = self.decode(cache, t)

    def generate(self, prompt, max_tokens: int = 16, temperature: float = 0.0, seed=None, **params) -> list:
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
