"""The decode step (one token, T == 1) in one Numba call: kernels/decode.decode_token.

A token of decode streams every layer's weights once; between two layers the Python of
transformer.forward (a dozen dispatches and numpy statements) runs on caches those
weights have just flushed. Measured on bench-mixtral f16, one process alternating both:
the whole token in one call is 2-5% faster per token, with the same logits bit for bit.

DecodeStep owns the argument tuples, built once per (weights, workspace): each per-layer
weight as a stack over the layers (kernels/stacks: addresses and shapes, so the compiled token
is one for any number of layers), absent q/k norms as empty arrays. It covers the models
whose every piece the fused kernel computes with forward's own kernels: routed layers with version-1
routing (Mixtral, Qwen3-MoE, OLMoE, and Qwen2-MoE with its q/k/v biases and gated shared expert) or
version-2 routing (GLM-4.5: sigmoid, correction bias, groups, routed scale, ungated shared expert) or
Phi-MoE's sparsemixer (with its LayerNorms' and head's biases), dense MLP layers among them (Qwen2-MoE's
mlp_only_layers, GLM's first_k_dense_replace) or in every layer (Llama, Qwen2, Qwen3), GPT-OSS's router
bias and biased experts with the clamped SwiGLU (each expert as moe()'s general path runs it), with
either kind of attention: q|k|v heads (q/k norms, biases, clip, sinks, a window per layer) or DeepSeek's
latent attention (mla.py's projections, the latent row cached); weights in f16/bf16 (rows or panels),
quantized, or in llama.cpp's block kinds (a GGUF's: each matrix the pair (raw bytes, GGML kind), the kind a
number per layer since llama-quantize's Q4_K_M mixes Q4_K and Q6_K; the products Workspace.mm_blocks' kernels,
the experts Workspace.expert's, or on threads experts_decode_par, as forward's general path runs them). Measured
on bench-mixtral Q4_K_M, one thread: the general path spent ~15% of a token in Python (gdb samples); fused, decode
went from 141 to 160 tok/s (bench/blocks.py, quiet). f32 weights (forward sends them through BLAS), or layers that
differ in kind where the kernel wants one type, get None from `build`, and forward keeps its general path.

With threads > 1 (a workspace of several scratch rows) every matrix's rows, q|k|v, wo, the
experts and the head, are split over Numba threads inside the one call, and attention's kv
heads run side by side (a 2-D scores scratch; on the paged pool its query heads split over the
threads, as forward_batch's tiled_attention_par does); the router stays on the calling thread.
forward's general path on threads runs the q|k|v stack and matrices of PAR_MIN_WEIGHTS and
more on threads, and pays a Python dispatch per matrix.
"""
from __future__ import annotations

import numba
import numpy as np

from . import mla as MLA
from .blocks import is_block
from .head import argmax_head, refine
from .kernels import decode as KD
from .panels import kernel_array
from .rope import attention_scale
from .weights import read_only

__all__ = ["DecodeStep"]

# an absent weight (q/k norm, bias, shared gate, routing rule...): read-only like the present ones (views of the
# mapped file), so that a stack's type, which keeps its arrays' read-only flag (kernels/stacks), is the same with
# or without it and families that differ only there (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5, Phi-MoE)
# share one compiled fused token per weight type (tests/test_parity pins it)
_NONE = np.zeros(0, np.float32)
_NONE.setflags(write=False)
_NO_SCORES = np.zeros(0, np.float32)  # the paged token's scores argument, to compile it (written: not read-only)
_NO_TABLE = np.zeros(0, np.int32)     # the block table argument of a sequence's own cache (unused)
_ROW0 = np.zeros(1, np.int64)         # the logits row head.refine recomputes


def _weight(W):
    """The kernel's form of a matrix: a float array, the pair (q, s), or for a block kind the pair (raw bytes,
    GGML kind); None for f32 (BLAS)."""
    if hasattr(W, "q"):
        return (W.q, W.s)
    if is_block(W):
        return (W.raw, W.ggml)
    a = kernel_array(W)
    return None if a.dtype == np.float32 else a


def _opt(a):
    return _NONE if a is None else a


class Stacks:
    """Builds kernels/stacks' stacks: per-layer arrays (or pairs, or triples of them) as addresses and shapes,
    one compiled type for any number of layers; keeps every array it points at alive (`keep`)."""

    def __init__(self):
        self.keep = []

    def __call__(self, items):
        """items (one per layer) as a stack, or None where one type cannot hold them all (mixed kinds,
        dtypes, ranks, or an array not C-contiguous: forward's general path then runs the model)."""
        items = list(items)
        if not items:
            return None
        if all(isinstance(a, int) for a in items):          # a number per layer (a block kind's GGML id)
            return np.array(items, np.int64)
        if all(isinstance(a, tuple) for a in items):
            n = len(items[0])
            if n not in (2, 3) or any(len(a) != n for a in items):
                return None
            parts = tuple(self([a[k] for a in items]) for k in range(n))
            return None if any(p is None for p in parts) else parts
        if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in items):
            return None
        if len({numba.typeof(a) for a in items}) != 1:
            return None
        self.keep.extend(items)
        return (np.array([a.ctypes.data for a in items], np.int64),
                np.array([a.shape for a in items], np.int64).reshape(len(items), items[0].ndim), items[0])


class DecodeStep:
    """One decode token of a model, fused; build() says whether this model is covered."""

    def __init__(self, cfg, ws, args, moe_layers, keep=(), blocks=False, output=(None, None, None)):
        self.cfg, self.ws, self.args = cfg, ws, args
        # output: (the head, its bias or None, the kernel's head tuple of argmax_head or None: a greedy token's head;
        # None, every token takes the head in args)
        self.output = output
        self._keep = keep                        # the arrays the stacks in args point at
        E, A, S = cfg.num_experts, cfg.top_k, cfg.shared_expert_intermediate_size
        self.ids = np.zeros(1, np.int64)
        # the layers that route (dense ones among them do not) and the experts each chose for the last token
        self.moe_layers = np.asarray(moe_layers, np.int64)
        self.routes = np.zeros((len(moe_layers), A), np.int32)       # (n_moe,A)
        self.views = (ws.x[:1], ws.h[:1], ws.sub[:1], ws.router[:1, :E], self.routes, ws.route_w[:1, :A],
                      ws.h1, ws.h3, ws.expert_out[0], ws.ffn_g[0, :S], ws.ffn_u[0, :S], ws.shared_out[0],
                      ws.ffn_g[0, :cfg.intermediate_size], ws.ffn_u[0, :cfg.intermediate_size],
                      *((ws.xs[0], ws.xi[0]) if ws.threads == 1 else (ws.xs, ws.xi)),
                      ws.block_scratch(blocks, A if moe_layers else 0, cfg.moe_intermediate_size))
        self.scale = attention_scale(cfg)

    @staticmethod
    def _attention(cfg, Ls, ws, st):
        """The kernel's `attn` tuple (kernels/decode._attention): the layers' attention weights as stacks over
        the layers (st: the Stacks that builds them) and the workspace's scratch for them; None where not covered."""
        if cfg.mla:                                        # latent attention (mla.py)
            nope = cfg.qk_nope_head_dim
            has_qa = Ls[0].q_a is not None
            if any((L.q_a is not None) != has_qa for L in Ls):
                return None
            cols = [[_weight(L.wq) for L in Ls], [_weight(L.kv_a) for L in Ls]]
            if has_qa:
                cols.append([_weight(L.q_a) for L in Ls])
            if any(W is None for col in cols for W in col):
                return None
            wq, kv_a = (st(col) for col in cols[:2])
            q_a = st(cols[2]) if has_qa else wq             # never read without a query rank
            q_a_norm = st(L.q_a_norm if has_qa else _NONE for L in Ls)
            kv_a_norm, k_up, v_up = (st(getattr(L, n) for L in Ls) for n in ("kv_a_norm", "k_up", "v_up"))
            if any(t is None for t in (wq, kv_a, q_a, q_a_norm, kv_a_norm, k_up, v_up)):
                return None
            ql = ws.q_lora[:1] if has_qa else ws.q[:1, :0]
            return (q_a, q_a_norm, wq, kv_a, kv_a_norm, k_up, v_up, nope, MLA.LATENT_NORM_EPS, ws.q[:1], ql,
                    ws.k[:1], ws.q_latent[:1], ws.latent_out[:1], ws.attn[:1])

        def qkv(L):
            if L.wqkv is not None:
                return _weight(L.wqkv)
            if L.qkv_stack is not None:
                return L.qkv_stack
            ws_ = tuple(_weight(W) for W in (L.wq, L.wk, L.wv))
            return ws_ if all(isinstance(p, tuple) for p in ws_) else None

        if len({L.bq is None for L in Ls}) != 1:
            return None
        qk_mode = {"none": 0, "full": 1, "head": 2}.get(cfg.qk_norm)
        wqkv = [qkv(L) for L in Ls]
        if qk_mode is None or any(W is None for W in wqkv):
            return None
        wqkv, qnorm, knorm = st(wqkv), st(_opt(L.q_norm) for L in Ls), st(_opt(L.k_norm) for L in Ls)
        # Qwen2-MoE's and GPT-OSS's q|k|v biases as one vector
        bqkv = st(_NONE if L.bq is None else read_only(np.concatenate([L.bq, L.bk, L.bv])) for L in Ls)
        if any(t is None for t in (wqkv, qnorm, knorm, bqkv)):
            return None
        H, Hkv, hd, qd, kvd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
        qkv_ = ws.qkv[:1]
        return (wqkv, bqkv, qnorm, knorm, qk_mode, np.float32(cfg.clip_qkv or 0.0), qkv_,
                qkv_[0, :qd].reshape(1, H, hd), qkv_[0, qd:qd + kvd].reshape(1, Hkv, hd),
                qkv_[0, qd + kvd:].reshape(1, Hkv, hd), ws.attn[:1].reshape(1, H, hd))

    @classmethod
    def build(cls, cfg, w, ws) -> "DecodeStep | None":
        Ls = w.layers
        if not Ls:
            return None
        routed = [i for i, L in enumerate(Ls) if L.gate is not None]
        moe = [Ls[i] for i in routed]                                    # routed layers
        mlps = [L for L in Ls if L.gate is None]                         # dense layers (Llama's every one)
        if any(L.w1 is None for L in moe) or any(L.mlp_w1 is None for L in mlps):
            return None
        if len({L.rule is None for L in moe}) > 1 or len({L.bo is None for L in Ls}) != 1:
            return None
        if len({(L.top_k, L.renorm, L.shared_w1 is None, L.shared_gate is None, L.sparsemixer, L.b1 is None,
                 L.gate_b is None, L.swiglu) for L in moe}) > 1:
            return None
        biased = bool(moe) and moe[0].b1 is not None                      # GPT-OSS
        if biased and (moe[0].gate_b is None or moe[0].rule is not None or moe[0].sparsemixer
                       or moe[0].b2 is None or moe[0].shared_w1 is not None):
            return None
        if moe and not biased and moe[0].gate_b is not None:
            return None
        st = Stacks()
        attn = cls._attention(cfg, Ls, ws, st)
        if attn is None:
            return None
        per_layer = [
            [L.attn_norm for L in Ls], [_weight(L.wo) for L in Ls], [L.ffn_norm for L in Ls],
            [_opt(L.attn_norm_b) for L in Ls], [_opt(L.ffn_norm_b) for L in Ls], [_opt(L.bo) for L in Ls],
            [L.sinks for L in Ls],
            *([_weight(getattr(L, n)) for L in moe] for n in ("w1", "w3", "w2")),
            *([_weight(getattr(L, n)) for L in mlps] for n in ("mlp_w1", "mlp_w3", "mlp_w2"))]
        if any(x is None for col in per_layer for x in col):
            return None
        tuples = [st(col) for col in per_layer[:7]]
        wout = _weight(w.output)
        if any(t is None for t in tuples) or wout is None:
            return None
        anorm, wo, fnorm, anorm_b, fnorm_b, bo, sinks = tuples
        # each kind's stacks over its own layers; a kind the model lacks gets a placeholder of a type its code
        # compiles with, never read (no MoE: gate None, the MoE branch is not compiled)
        never = st(per_layer[1][:1])
        w1, w3, w2 = (st(col) for col in per_layer[7:10]) if moe else (never,) * 3
        mw1, mw3, mw2 = (st(col) for col in per_layer[10:13]) if mlps else (never,) * 3
        if any(t is None for t in (w1, w3, w2, mw1, mw3, mw2)):
            return None
        gate = st(L.gate for L in moe) if moe else None           # None: decode_token runs only MLPs
        rule = st(_opt(L.rule) for L in moe) if moe else st([_NONE])
        cbias = st(_opt(L.corr_bias) for L in moe) if moe else st([_NONE])
        if moe and (gate is None or rule is None or cbias is None):
            return None
        bias = None
        if biased:                       # GPT-OSS: the router's bias, the experts' biases, the clamped SwiGLU
            bias = (*(st(getattr(L, n) for L in moe) for n in ("gate_b", "b1", "b3", "b2")), *moe[0].swiglu)
            if any(t is None for t in bias[:4]):
                return None
        ffn_of = np.zeros(len(Ls), np.int64)                            # >= 0: MoE layer index; < 0: -1 - MLP index
        m = d = 0
        for i, L in enumerate(Ls):
            if L.gate is not None:
                ffn_of[i], m = m, m + 1
            else:
                ffn_of[i], d = -1 - d, d + 1
        has_shared = bool(moe) and moe[0].shared_w1 is not None
        if has_shared:
            cols = [[_weight(getattr(L, n)) for L in moe] for n in ("shared_w1", "shared_w3", "shared_w2")]
            if any(W is None for col in cols for W in col):
                return None
            shared = [st(col) for col in cols]
            sgate = st(_NONE if L.shared_gate is None else L.shared_gate[0] for L in moe)
        else:                                              # never read: any matrices of a uniform type
            shared, sgate = [wo, wo, wo], st(_NONE for _ in Ls)
        if any(t is None for t in (sgate, *shared)):
            return None
        top_k, renorm = (moe[0].top_k, moe[0].renorm) if moe else (Ls[0].top_k, Ls[0].renorm)
        sparse = np.float32(moe[0].sparsemixer if moe else 0.0)          # Phi-MoE's sparsemixer eps
        windows = np.array([cfg.window(i) for i in range(len(Ls))], np.int64)
        emb = (w.token_embd.raw, w.token_embd.ggml) if is_block(w.token_embd) else w.token_embd
        args = (emb, anorm, anorm_b, attn, wo, bo, sinks, windows, fnorm, fnorm_b, ffn_of, gate, rule,
                cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, *shared, sgate, has_shared, top_k, renorm,
                cfg.rms_norm_eps)
        head = (w.output_norm, _opt(w.output_norm_b), wout, _opt(w.output_b))
        fast = argmax_head(w.output)
        output = (w.output, w.output_b, None if fast is None else head[:2] + (_weight(fast),) + head[3:])
        blocks = any(is_block(W) for W in (w.token_embd, w.output)) or any(
            is_block(W) for L in Ls for W in vars(L).values())
        return cls(cfg, ws, (args, head), routed, st.keep, blocks, output)

    def _call_args(self, rope, k, v, table, start, scores, argmax_only=False) -> tuple:
        layers, head = self.args
        if argmax_only and self.output[2] is not None:
            head = self.output[2]               # the same types: the kind is a number the kernel reads
        return (self.ids, *layers, k, v, table, start, rope[0], rope[1], self.scale, *head, *self.views, scores,
                self.ws.positions[:1], self.ws.logits)

    def __call__(self, rope, cache, token: int, scores, argmax_only: bool = False) -> np.ndarray:
        """Token `token` at position cache.length (forward has checked that the cache has room;
        scores: its attention scratch) -> the workspace's (1,V) logits; cache advanced. argmax_only: the caller
        reads only the logits' argmax (a greedy sequence, Sequence.argmax_only): a block-kind head then takes
        the int8 head and head.refine, as a serving step's greedy rows do (the int16 head's argmax; the
        other logits the int8 head's)."""
        self.ids[0] = token
        KD.decode_token(*self._call_args(rope, cache.k, cache.v, _NO_TABLE, cache.length, scores, argmax_only))
        cache.length += 1
        return self._logits(argmax_only)

    def paged(self, rope, pool, table, pos: int, token: int, scores, argmax_only: bool = False) -> np.ndarray:
        """Token `token` at position `pos` of the sequence whose blocks are `table` (int32, the
        block of pos allocated) in a paged pool (kv.KVPool); scores: a 1-D scratch of >= H/Hkv * (pos+1)
        -> the workspace's (1,V) logits (a serving step of one decoding sequence); argmax_only as __call__'s."""
        self.ids[0] = token
        KD.decode_token(*self._call_args(rope, pool.k, pool.v, table, pos, scores, argmax_only))
        return self._logits(argmax_only)

    def _logits(self, argmax_only):
        head, bias, fast = self.output
        if argmax_only and fast is not None:                # the head's input: the workspace's h, normed
            refine(self.ws, self.ws.h[:1], head, bias, self.ws.logits, _ROW0)
        return self.ws.logits

    def signature(self, rope, cache, scores) -> tuple:
        """The argument types decode_token compiles for on this cache: one compiled token per distinct signature."""
        return tuple(numba.typeof(a) for a in self._call_args(rope, cache.k, cache.v, _NO_TABLE, cache.length, scores))

    def compile(self, rope, cache, scores) -> None:
        """Compile decode_token for these arguments' types without running it (a pre-fork master
        compiles the threaded token this way: nothing is launched)."""
        KD.decode_token.compile(self.signature(rope, cache, scores))

    def compile_paged(self, rope, pool) -> None:
        """compile() for the paged form (`paged`)."""
        KD.decode_token.compile(tuple(numba.typeof(a) for a in self._call_args(
            rope, pool.k, pool.v, _NO_TABLE, 0, _NO_SCORES)))
