"""forward(): one step of the decoder over T new tokens, top to bottom like the math.

As in llama2.c, three things are kept apart: the config (config.py), the weights
(views into the mapping, weights.py) and the run state: a KVCache per sequence slot
and a Workspace of activation buffers per process. forward() allocates nothing in
the decode path (T == 1); every buffer below is a view of the workspace.

Legend: T new tokens, P0 position of the first, D hidden, H heads, Hkv kv heads,
hd head dim, S cache capacity, V vocab.

Three forward paths, each for a reason, all built from the same kernels and per-layer helpers
(embed, norm, qkv_rows, qkv_finish, moe) and held to the same logits by the tests:
- forward() here: the general path on one sequence's contiguous KVCache (`colibri run`,
  `generate`, parity against transformers), and every case the fused token declines (f32 weights,
  layers of mixed kinds);
- batch.forward_batch(): the serving step, rows of many sequences on the paged pool (kv.py),
  each selected expert read once per step for all its rows (test_batching: a step's rows equal
  each sequence run alone), its greedy rows' head on int8 with the int16 head's tokens (head.py);
- decode_step.DecodeStep: a batch-1 decode token in one Numba call, 2-5% faster than forward's
  dozen dispatches per layer, bit for bit the same logits (test_parity, test_batching).
"""
from __future__ import annotations

import numpy as np

from . import kernels as K
from . import mla as MLA
from .blocks import is_block
from .config import ModelConfig
from .decode_step import DecodeStep
from .head import head_logits
from .kernels import aligned_zeros, lazy_zeros
from .kernels import blocks as KB
from .kernels import blocks_gemm as KG
from .kernels import decode as KD
from .kernels import experts_blocks as KEB
from .kernels import gemm as GE
from .kernels import quant as KQ
from .kernels import rowgemm as RG
from .moe import moe, swiglu
from .panels import Panels, kernel_array
from .rope import attention_scale


class KVCache:
    """The state of one sequence (one slot): its keys and values and how many are filled.
    A large capacity costs only the pages the sequence has reached."""

    def __init__(self, cfg: ModelConfig, capacity: int):
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.cache_dim)      # (L,Hkv,S,hd)
        self.k = lazy_zeros(shape)
        # latent attention caches one row per position, its values the first kv_lora_rank dims (mla.py)
        self.v = self.k if cfg.mla else lazy_zeros(shape)
        self.capacity = capacity
        self.length = 0            # positions 0..length-1 are filled

    def reset(self) -> None:
        self.length = 0


class Workspace:
    """Activation buffers for up to `rows` tokens per forward call, allocated once, and the
    choice of kernels: `threads` > 1 runs the decode matvecs on that many Numba threads
    (only in a process that may start threads: a forked worker, never the master);
    `prefill_bf16` multiplies bf16 weights by bf16-rounded activations in prefill (opt-in,
    where the CPU has avx512bf16: about 2x the f32 path, with the activations' rounding)."""

    TILE_ROWS = 256   # rows of a f16/bf16/quantized weight converted to f32 at once for BLAS
    # matrices of at least this many weights x rows run on the threads (each thread its share of the weight rows),
    # smaller ones on the calling thread: a parallel region costs ~50 us to launch on Numba's workqueue, 7-13 us
    # on tbb (both measured on VMs). One threshold for every kind. At 8M (1 << 23) a small model's block-kind
    # attention projections stay on the calling thread while the other waits; bench-mixtral Q4_K_M blocks on 2
    # threads (2-vCPU Xeon, bench/step.py, 3 rounds in turn): at 1M a one-row step took 6.0-6.5 ms against 6.4-8.2,
    # a 4-row step 16.5-18.3 against 19.3-19.8. At 256K (1 << 18) its 256 x 1024 k and v go to the threads too:
    # the fused decode token 134.1-145.0 tok/s against 126.9-138.7 at 1M (4 rounds in turn, separate processes,
    # 1 << 18 the faster in each); bench-mixtral f16's 1- and 2-row steps the same at both. A prefill's or a serving
    # step's many rows thread every matrix
    PAR_MIN_WEIGHTS = 1 << 18
    # up to this many rows, f16/bf16 matrices go through kernels.rowgemm (each weight converted once, in a
    # register, for every row) instead of converting 256-row tiles to f32 for BLAS: since rowgemm's IR
    # tile, a 256-row serving step (8 prompts of 32 tokens, bench-mixtral f16, 2 threads) took 727 ms
    # with it against 808 with tiles above 48 rows (a 2-vCPU AVX-512 Xeon); both run at the FMA peak
    ROWGEMM_MAX_ROWS = 256
    # on threads, moe() runs a step's experts in one call (each expert on one thread) up to this many rows,
    # beyond it one expert after another with each matrix's rows split over the threads: bench-mixtral
    # f16, 2 threads, BatchEngine step one call / per expert: B=8 64.8/81.5 ms, 16 95.6/112.2, 24
    # 120.6/129.6, 32 134.4/127.8 (the same Xeon); one thread: one call at every size
    EXPERTS_ONE_CALL_MAX_ROWS = 24

    def __init__(self, cfg: ModelConfig, rows: int, threads: int = 1, prefill_bf16: bool = False):
        D, E, A = cfg.hidden_size, cfg.num_experts, cfg.top_k
        F = max(cfg.moe_intermediate_size, cfg.intermediate_size, cfg.shared_expert_intermediate_size)
        f32 = np.float32
        self.rows = rows
        self.x = aligned_zeros((rows, D), f32)                  # residual stream
        self.h = aligned_zeros((rows, D), f32)                  # normed input of a sublayer
        self.q = aligned_zeros((rows, cfg.q_dim), f32)
        self.k = aligned_zeros((rows, cfg.kv_dim), f32)
        self.v = aligned_zeros((rows, cfg.kv_dim), f32)
        self.qkv = aligned_zeros((1, cfg.q_dim + 2 * cfg.kv_dim), f32)   # decode's fused projection
        self.attn = aligned_zeros((rows, cfg.attn_dim), f32)
        if cfg.mla:                                             # latent attention's own (mla.py)
            H, r = cfg.num_heads, cfg.kv_lora_rank
            self.q_lora = aligned_zeros((rows, cfg.q_lora_rank), f32) if cfg.q_lora_rank else None
            self.q_latent = aligned_zeros((rows, H * (r + cfg.head_dim)), f32)   # the queries absorbed
            self.latent_out = aligned_zeros((rows, H * r), f32)                   # attention over the latent
        self.sub = aligned_zeros((rows, D), f32)                # a sublayer's output
        self.ffn_g = aligned_zeros((rows, F), f32)
        self.ffn_u = aligned_zeros((rows, F), f32)
        self.gather = aligned_zeros((rows, D), f32)
        self.expert_out = aligned_zeros((rows, D), f32)
        self.shared_out = aligned_zeros((rows, D), f32)
        self.router = aligned_zeros((rows, E), f32)
        self.route_idx = aligned_zeros((rows, A), np.int32)
        self.route_w = aligned_zeros((rows, A), f32)
        self.counts = aligned_zeros(E, np.int64)
        self.offsets = aligned_zeros(E + 1, np.int64)
        self.order = aligned_zeros(rows * A, np.int64)
        self.h1 = aligned_zeros(cfg.moe_intermediate_size, f32)
        self.h3 = aligned_zeros(cfg.moe_intermediate_size, f32)
        n_max = max(D, F, cfg.q_dim, cfg.attn_dim, cfg.q_lora_rank)
        self.threads = max(1, int(threads))
        # the tiles of f16/bf16 weights for BLAS and one tile's product, one pair per thread
        self.tiles = [aligned_zeros((self.TILE_ROWS, n_max), f32) for _ in range(self.threads)]
        self.mm_tmps = [aligned_zeros((rows, self.TILE_ROWS), f32) for _ in range(self.threads)]
        self._pool = None                                  # prefill's threads, started on first use
        # opt-in: prefill of bf16 weights with bf16 activations (kernels/gemm.matmul_bf16)
        self.prefill_bf16 = bool(prefill_bf16) and GE.HAVE_BF16_GEMM
        self.xs, self.xi = KQ.scratch(n_max, 2 * self.threads)  # quantized matvec scratch, one row per chunk
        # block kinds (kernels/blocks): the rows' activations rounded to int8 per 32 (the head's: int16, two bytes
        # a column), their scales and 16-sums, and one row of f32 scratch per thread chunk; allocated on first use
        self._n_max = -(-n_max // KB.QB) * KB.QB
        self._q_bytes = max(self._n_max, 2 * D)
        self._block_acts = None
        self._block_h = None
        self.no_block_scratch = self.block_scratch(False)    # the kernels' bk where no block kind is used
        self.logits = aligned_zeros((1, cfg.vocab_size), f32)
        self.positions = aligned_zeros(rows, np.int64)
        self.scores = None                                 # the attention scratch, sized on use (attention_scores)
        self._step = None                                  # (weights, DecodeStep or None), see decode_step()
        self._expert_rows = None                           # moe's per-choice rows, sized on use (expert_rows)

    def tile_for(self, n: int, i: int = 0) -> np.ndarray:
        """Thread i's tile scratch with exactly n columns (rows, n) f32, for matmul of f16/bf16 weights."""
        return self.tiles[i].reshape(-1)[:self.TILE_ROWS * n].reshape(self.TILE_ROWS, n)

    def pool(self):
        """The threads - 1 threads that convert and multiply prefill tiles beside the caller's
        (matmul_par: the conversion kernels release the GIL, and so does BLAS)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="colibri-prefill")
        return self._pool

    def mm(self, X, W, out):
        """X (T,n) f32 @ W (d,n).T -> out (T,d): W float or a QTensor; decode (T == 1) on
        `threads` threads when > 1, and so is prefill (T > 1): the integer GEMM's row groups for
        quantized weights, the converted tiles of f16/bf16 ones (f32 weights: one BLAS call)."""
        n = X.shape[1]
        if is_block(W):
            return self.mm_blocks(X, W, out)
        if X.shape[0] == 1 and self.threads > 1 and out.shape[1] * n >= self.PAR_MIN_WEIGHTS:
            if hasattr(W, "q"):
                KQ.matvec_q_par(W.q, W.s, X[0], out[0], self.xs[:self.threads], self.xi[:self.threads])
            else:
                K.matvec_par(kernel_array(W), X[0], out[0], self.threads)
            return out
        if X.shape[0] == 1 and hasattr(W, "q"):            # the workspace's aligned scratch
            KQ.matvec_q(W.q, W.s, X[0], out[0], self.xs[0], self.xi[0])
            return out
        if X.shape[0] == 1 and W.dtype != np.float32:      # f16/bf16 rows or panels: straight to the kernel
            K.matvec(kernel_array(W), X[0], out[0])
            return out
        if 1 < X.shape[0] <= self.ROWGEMM_MAX_ROWS and not hasattr(W, "q") and W.dtype != np.float32 \
                and not self.prefill_bf16:
            # a few rows (a serving step, an expert's rows): each f16/bf16 weight converted once for all of them
            P = W.p if isinstance(W, Panels) else W[None]                      # (nb,d,P) or (1,d,n), a view
            if self.threads > 1:
                RG.rowgemm_par(P, X, out, self.threads)
            else:
                RG.rowgemm(P, X, out)
            return out
        if X.shape[0] > 1 and self.prefill_bf16 and not hasattr(W, "q") and W.dtype == np.int16:   # rows or panels
            if self.threads > 1:
                return GE.matmul_bf16_par(W, X, out, self.threads)
            return GE.matmul_bf16(W, X, out)
        if X.shape[0] > 1 and self.threads > 1 and hasattr(W, "q") and GE.HAVE_GEMM:
            # prefill of a quantized matrix: the integer GEMM's row groups split over the threads
            (GE.matmul_q4_i8_par if W.q.dtype == np.uint8 else GE.matmul_q8_i16_par)(W.q, W.s, X, out, self.threads)
            return out
        if X.shape[0] > 1 and self.threads > 1 and (hasattr(W, "q") or W.dtype != np.float32):
            # prefill of f16/bf16 weights (or quantized without the integer GEMM): tiles on threads
            return K.matmul_par(X, W, out, [self.tile_for(n, i) for i in range(self.threads)], self.mm_tmps,
                                self.pool())
        return K.matmul(X, W, out, self.tile_for(n), self.mm_tmps[0])

    def ffn_rows(self, T: int, F: int):
        """(T,F) views of the gate and up scratch (ffn_g, ffn_u), C-contiguous whatever F: a column slice of the
        widest would be layout A for a narrower MLP, shared or routed expert and C for the widest, two compiled
        signatures of every kernel they reach."""
        return (self.ffn_g.reshape(-1)[:T * F].reshape(T, F), self.ffn_u.reshape(-1)[:T * F].reshape(T, F))

    def block_acts(self, T: int, n: int, acts16: bool = False):
        """The block kinds' activation scratch for T rows of n columns: (Xq, Xd, Xs, tmps); Xq of 2n bytes a row
        for the int16 rounding (acts16: the output head's, kernels/blocks_wide)."""
        if self._block_acts is None or self._block_acts[0] < T:
            R, N = max(T, self.rows), self._n_max
            self._block_acts = (R, aligned_zeros(R * self._q_bytes, np.int8), aligned_zeros(R * (N // KB.QB), np.float32),
                                aligned_zeros(R * (N // KB.SB), np.int32),
                                aligned_zeros(2 * self.threads * KG.scratch_words(N), np.float32))
        _, q, d, s, tmps = self._block_acts

        def rows(a, r, c):        # (r, c) C-contiguous at the start of a: whatever n, one array type for the kernels
            return a[:r * c].reshape(r, c)
        return (rows(q, T, 2 * n if acts16 else n), rows(d, T, n // KB.QB), rows(s, T, n // KB.SB),
                rows(tmps, 2 * self.threads, KG.scratch_words(n)))

    def mm_blocks(self, X, W, out, alpha: float = 1.0, accumulate: bool = False):
        """out (T,d) (=|+=) alpha * X (T,n) @ W.T for a block-kind W (kernels/blocks): the rows of X rounded
        once, each weight row read once for all of them; weight rows over the threads when the work is big."""
        T, n = X.shape
        if self.threads > 1 and out.shape[1] * n * T >= self.PAR_MIN_WEIGHTS:
            KG.matmul_blocks_par(*self.mm_blocks_args(X, W, out, alpha, accumulate))
        else:
            Xq, Xd, Xs, tmps = self.block_acts(T, n, W.acts16)
            KG.matmul_blocks(W.raw, W.ggml, X, out, Xq, Xd, Xs, tmps[0], np.float32(alpha), accumulate)
        return out

    def qkv_blocks(self, X, L, q, k, v) -> bool:
        """q, k, v (T,*) = X (T,n) @ L.wq.T, L.wk.T, L.wv.T in one parallel region (blocks_gemm.matmul3_blocks_par,
        each product the bits of its own mm_blocks) when all three are block kinds on int8 activations that would
        each take the threads: two launches and roundings fewer a layer (a 16-row step of bench-mixtral Q4_K_M:
        162 -> 114 us a layer). False, with nothing done, otherwise."""
        T, n = X.shape
        Ws = (L.wq, L.wk, L.wv)
        if self.threads < 2 or not all(is_block(W) and not W.acts16 for W in Ws) \
                or min(W.shape[0] for W in Ws) * n * T < self.PAR_MIN_WEIGHTS:
            return False
        KG.matmul3_blocks_par(*self.qkv_blocks_args(X, L, q, k, v))
        return True

    def qkv_blocks_args(self, X, L, q, k, v) -> tuple:
        """matmul3_blocks_par's arguments for qkv_blocks, its scratch from this workspace (three roundings' rows)."""
        Xq, Xd, Xs, tmps = self.block_acts(3 * X.shape[0], X.shape[1])
        return (L.wq.raw, L.wq.ggml, L.wk.raw, L.wk.ggml, L.wv.raw, L.wv.ggml, X, q, k, v, Xq, Xd, Xs,
                tmps[:self.threads])

    def experts_blocks(self, layer, idx, wts, x, out) -> None:
        """out (D,) += the chosen experts (idx (A,), wts (A,)) of block-kind stacks on x (D,), on the threads in two
        parallel regions (kernels/experts_blocks.experts_decode_par: the same bits as one expert after another)."""
        KEB.experts_decode_par(*self.experts_blocks_args(layer, idx, wts, x, out))

    def experts_blocks_args(self, layer, idx, wts, x, out) -> tuple:
        """experts_decode_par's arguments, its scratch from this workspace (compile_parallel compiles for them)."""
        A, I, D = idx.shape[0], layer.w1.shape[1], x.shape[0]
        Xq, Xd, Xs, tmps = self.block_acts(1, D)
        H1, H3, Hq, Hd, Hs = self._experts_rows(A, I)
        return (layer.w1.raw, layer.w1.ggml, layer.w3.raw, layer.w3.ggml, layer.w2.raw, layer.w2.ggml,
                np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(wts, np.float32), x[None],
                H1, H3, out[None], Xq, Xd, Xs, Hq, Hd, Hs, tmps[:self.threads])

    def _experts_rows(self, A: int, I: int) -> tuple:
        """experts_decode_par's scratch for A experts of I rows: H1, H3 (A, I) f32 and H1's rounding (Hq, Hd, Hs)."""
        if self._block_h is None or self._block_h[0].shape != (A, I):
            self._block_h = (aligned_zeros((A, I), np.float32), aligned_zeros((A, I), np.float32),
                             aligned_zeros((A, I), np.int8), aligned_zeros((A, I // KB.QB), np.float32),
                             aligned_zeros((A, I // KB.SB), np.int32))
        return self._block_h

    def block_scratch(self, blocks: bool, A: int = 0, I: int = 0) -> tuple:
        """The fused decode token's block-kind scratch (kernels/decode's bk): block_acts' buffers whole (Xq, Xd, Xs
        flat; tmps one row per thread chunk), experts_decode_par's for A routed experts of I rows (_experts_rows),
        and PAR_MIN_WEIGHTS. Where the model has no block kinds (blocks False), or no routed ones (A == 0),
        small arrays of the same types stand in (never read), so that every model's token has one type of scratch."""
        z = (np.zeros(1, np.int8), np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros((1, 1), np.float32),
             *(np.zeros((1, 1), dt) for dt in (np.float32, np.float32, np.int8, np.float32, np.int32)))
        if blocks:
            self.block_acts(1, self._n_max)
            _, q, d, s, tmps = self._block_acts
            acts = (q, d, s, tmps.reshape(2 * self.threads, -1))
        else:
            acts = z[:4]
        rows = self._experts_rows(A, I) if blocks and A else z[4:]
        return (*acts, *rows, np.int64(self.PAR_MIN_WEIGHTS))

    def mm_blocks_args(self, X, W, out, alpha: float = 1.0, accumulate: bool = False) -> tuple:
        """matmul_blocks_par's arguments for mm_blocks on threads, its scratch from this workspace."""
        Xq, Xd, Xs, tmps = self.block_acts(X.shape[0], X.shape[1], W.acts16)
        return W.raw, W.ggml, X, out, Xq, Xd, Xs, tmps[:self.threads], np.float32(alpha), accumulate

    def expert(self, w1, w3, w2, e, x, weight, out):
        """out (D,) += weight * expert e's SwiGLU of x (D,): one fused kernel call."""
        if is_block(w1):
            h1, h3 = self.h1[None], self.h3[None]
            self.mm_blocks(x[None], w1[e], h1)
            self.mm_blocks(x[None], w3[e], h3)
            K.silu_mul(h1, h3, h1)
            self.mm_blocks(h1, w2[e], out[None], weight, True)
            return
        if hasattr(w1, "q"):
            if self.threads > 1:
                KQ.expert_ffn_q_par(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, e, x, weight, self.h1, self.h3, out,
                                    self.xs, self.xi)
            else:
                KQ.expert_ffn_q(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, e, x, weight, self.h1, self.h3, out,
                                self.xs[0], self.xi[0])
        elif self.threads > 1:
            K.expert_ffn_par(kernel_array(w1), kernel_array(w3), kernel_array(w2), e, x, weight, self.h1, self.h3,
                             out, self.threads)
        else:
            K.expert_ffn(kernel_array(w1), kernel_array(w3), kernel_array(w2), e, x, weight, self.h1, self.h3, out)

    def experts_in_one_call(self, layer, T: int, active: int) -> bool:
        """Whether moe() runs a T-row step's experts (`active` of them got rows) in one call
        (kernels/rowgemm.experts_rows): f16/bf16 expert stacks (rows or panels), rows few enough for
        rowgemm (what mm would give each expert), not the bf16 prefill GEMM; on threads (each expert on
        one of them) only while the experts outnumber the threads and T <= EXPERTS_ONE_CALL_MAX_ROWS."""
        if T > self.ROWGEMM_MAX_ROWS or self.prefill_bf16:
            return False
        if self.threads > 1 and (T > self.EXPERTS_ONE_CALL_MAX_ROWS or active < self.threads):
            return False
        for W in (layer.w1, layer.w3, layer.w2):
            a = kernel_array(W) if W is not None and not hasattr(W, "q") and not is_block(W) else None
            if a is None or a.dtype not in (np.uint16, np.int16) or a.ndim != (4 if isinstance(W, Panels) else 3) \
                    or not a.flags.c_contiguous:
                return False
        return True

    def block_experts_in_one_call(self, layer) -> bool:
        """Whether moe() runs a step's block-kind experts in one call (kernels/experts_blocks): the three stacks
        in block kinds."""
        return all(W is not None and is_block(W) for W in (layer.w1, layer.w3, layer.w2))

    def block_tmps(self, n: int):
        """One f32 scratch per thread for the block kinds' products of n columns (blocks_gemm.scratch_words)."""
        return self.block_acts(1, n)[3][:self.threads]

    def quant_experts_in_one_call(self, layer) -> bool:
        """Whether moe() runs a step's q8/q4 experts in one call (kernels/experts_q): the three stacks
        quantized, on a CPU with the integer GEMM (what mm would give each expert)."""
        return GE.HAVE_GEMM and all(W is not None and hasattr(W, "q") for W in (layer.w1, layer.w3, layer.w2))

    def expert_rows(self, n: int) -> np.ndarray:
        """(n, D) f32 scratch: one output row per (row, chosen expert) of a step."""
        if self._expert_rows is None or self._expert_rows.shape[0] < n:
            self._expert_rows = aligned_zeros((max(n, 2 * self.rows), self.x.shape[1]), np.float32)
        return self._expert_rows[:n]

    def decode_step(self, cfg: ModelConfig, w):
        """The fused decode step for these weights (decode_step.DecodeStep), None where not covered;
        built on first use and kept for the same weights."""
        if self._step is None or self._step[0] is not w:
            self._step = (w, DecodeStep.build(cfg, w, self))
        return self._step[1]

    def score_buffer(self, capacity: int) -> np.ndarray:
        if self.scores is None or self.scores.shape[0] < capacity:
            self.scores = aligned_zeros(capacity, np.float32)
        return self.scores

    def attention_scores(self, cfg: ModelConfig, capacity: int) -> np.ndarray:
        """The attention scratch for a cache of `capacity` positions: (H/Hkv * capacity,) on one
        thread; on threads one row per kv head, (Hkv, H/Hkv * capacity), and the kv heads run side by
        side (kernels/attn.attend); with fewer kv heads than threads (latent attention: one) each kv
        head's query heads split into chunks, a row each: (Hkv * C, ceil(H/Hkv/C) * capacity)."""
        n = cfg.num_heads // cfg.num_kv_heads * capacity
        if self.threads == 1:
            return self.score_buffer(n)
        Hkv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        chunks = max(1, min(group, self.threads // Hkv))
        per = -(-group // chunks) * capacity
        return self.score_buffer(Hkv * chunks * per)[:Hkv * chunks * per].reshape(Hkv * chunks, per)


def compile_parallel(weights, ws: Workspace) -> None:
    """Compile, without running, the threaded decode kernels for the types of these weights
    (ws: a Workspace with threads > 1). Safe before fork with a fork-safe threading layer."""
    import numba
    K.parallel_runtime()

    def compile_for(kernel, *args):
        kernel.compile(tuple(numba.typeof(a) for a in args))
    x, seen = ws.x[0], set()
    mats = [w for L in weights.layers for w in (L.wq, L.wk, L.wv, L.wo, L.shared_w1, L.shared_w3, L.shared_w2,
                                                  L.mlp_w1, L.mlp_w3, L.mlp_w2, L.q_a, L.kv_a)] + [weights.output]
    # one expert of each stack: a serving step's expert with one routed row is a matvec (Workspace.mm)
    mats += [E[0] for L in weights.layers for E in (L.w1, L.w3, L.w2) if E is not None and not hasattr(E, "q")]
    mats = [W for W in mats if not is_block(W)]          # block kinds: below
    for W in mats:
        if W is None:
            continue
        if (W.shape[0] * W.shape[1]) < ws.PAR_MIN_WEIGHTS:
            continue
        args = (W.q, W.s, x, x, ws.xs[:ws.threads], ws.xi[:ws.threads]) if hasattr(W, "q") else (kernel_array(W), x, x, 1)
        key = tuple(numba.typeof(a) for a in args)
        if key not in seen:
            seen.add(key)
            compile_for(KQ.matvec_q_par if hasattr(W, "q") else K.matvec_par, *args)
    X2 = np.zeros((2, x.shape[0]), np.float32)      # a 2-token prefill's activations / outputs
    if GE.HAVE_GEMM:
        for W in mats + [L.w1 for L in weights.layers] + [L.w2 for L in weights.layers]:
            if W is None or not hasattr(W, "q"):
                continue
            q, s = (W.q, W.s) if W.q.ndim == 2 else (W.q[0], W.s[0])
            for out in (X2, X2[:, :1]):          # contiguous outputs, and column slices (moe's ffn_g/u)
                args = (q, s, X2, out, 1)
                key = ("gemm",) + tuple(numba.typeof(a) for a in args)
                if key not in seen:
                    seen.add(key)
                    compile_for(GE.matmul_q4_i8_par if q.dtype == np.uint8 else GE.matmul_q8_i16_par, *args)
    if GE.HAVE_BF16_GEMM:                        # prefill_bf16 on threads: the bf16 GEMM's row split
        x2 = np.zeros((4, x.shape[0]), np.int16)
        for W in mats + [L.w1 for L in weights.layers] + [L.w2 for L in weights.layers]:
            if W is None or hasattr(W, "q") or is_block(W) or W.dtype != np.int16:
                continue
            W2 = kernel_array(W if W.ndim == 2 else W[0])
            for out in (X2, X2[:, :1]):
                args = (W2, x2, 2, out, 1)
                key = ("bf16",) + tuple(numba.typeof(a) for a in args)
                if key not in seen:
                    seen.add(key)
                    compile_for(GE._bf16_rows_par, *args)
    # block kinds: a matrix's weight rows over the threads (mm_blocks: one or a few rows of X, outputs whole or a
    # column slice) and a decode token's experts (experts_blocks), for the types this workspace's scratch gives them
    blocks = [W for L in weights.layers for W in (L.wq, L.wk, L.wv, L.wo, L.shared_w1, L.shared_w3, L.shared_w2,
                                                  L.mlp_w1, L.mlp_w3, L.mlp_w2, L.q_a, L.kv_a)] + [weights.output]
    blocks += [E[0] for L in weights.layers for E in (L.w1, L.w3, L.w2) if E is not None]
    for W in (W for W in blocks if W is not None and is_block(W)):
        d, n = W.shape
        for T in (1, 2):
            X, wide = np.zeros((T, n), np.float32), np.zeros((T, d + 1), np.float32)
            for out in (wide[:, :d].copy(), wide[:, :d]):
                args = ws.mm_blocks_args(X, W, out)
                key = ("blocks",) + tuple(numba.typeof(a) for a in args)
                if key not in seen:
                    seen.add(key)
                    compile_for(KG.matmul_blocks_par, *args)
    for L in weights.layers:         # a step's q, k and v in one region (qkv_blocks)
        if all(W is not None and is_block(W) and not W.acts16 for W in (L.wq, L.wk, L.wv)):
            args = ws.qkv_blocks_args(ws.x[:2], L, ws.q[:2], ws.k[:2], ws.v[:2])
            key = ("qkv_blocks",) + tuple(numba.typeof(a) for a in args)
            if key not in seen:
                seen.add(key)
                compile_for(KG.matmul3_blocks_par, *args)
    for L in weights.layers:
        if L.w1 is not None and is_block(L.w1) and is_block(L.w3) and is_block(L.w2):
            idx, wts = np.zeros(2, np.int64), np.zeros(2, np.float32)   # two chosen experts: the types hold for any
            args = ws.experts_blocks_args(L, idx, wts, x, x)
            key = ("experts_blocks",) + tuple(numba.typeof(a) for a in args)
            if key not in seen:
                seen.add(key)
                compile_for(KEB.experts_decode_par, *args)
    for L in weights.layers:
        if L.qkv_stack is not None and len(L.qkv_stack) == 3:      # forward's q|k|v stack on threads
            key = ("qkv",) + tuple(numba.typeof(a) for a in L.qkv_stack)
            if key not in seen:
                seen.add(key)
                compile_for(K.matvec_qkv_par, *L.qkv_stack, x, x, ws.threads)
        if L.w1 is None or is_block(L.w1):
            continue
        if hasattr(L.w1, "q"):
            args = (L.w1.q, L.w1.s, L.w3.q, L.w3.s, L.w2.q, L.w2.s, 0, x, 1.0, ws.h1, ws.h3, x, ws.xs, ws.xi)
            kernel = KQ.expert_ffn_q_par
        else:
            args = (kernel_array(L.w1), kernel_array(L.w3), kernel_array(L.w2), 0, x, 1.0, ws.h1, ws.h3, x, 1)
            kernel = K.expert_ffn_par
        key = tuple(numba.typeof(a) for a in args)
        if key not in seen:
            seen.add(key)
            compile_for(kernel, *args)


def embed(W, tokens, out) -> None:
    """out (T,D) = the rows of the token embedding W for tokens (T,) (a block kind: each row dequantized)."""
    if is_block(W):
        KB.embed_blocks(W.raw, W.ggml, tokens, out)
    else:
        K.embed(W, tokens, out)


def norm(x, w, b, eps, out) -> None:
    """RMSNorm of the rows of x (T,D) into out, or LayerNorm where the model has its bias b (Phi-MoE)."""
    if b is None:
        K.rmsnorm(x, w, eps, out)
    else:
        K.layernorm(x, w, b, eps, out)


def qkv_rows(ws, h, L, n):
    """q, k, v of n rows (the workspace's views (n,H*hd) (n,Hkv*hd) (n,Hkv*hd)): block kinds in one parallel region
    (Workspace.qkv_blocks), else each its own matrix product."""
    q, k, v = ws.q[:n], ws.k[:n], ws.v[:n]
    if not ws.qkv_blocks(h, L, q, k, v):
        ws.mm(h, L.wq, q)
        ws.mm(h, L.wk, k)
        ws.mm(h, L.wv, v)
    return q, k, v


def qkv_finish(cfg: ModelConfig, L, q, k, v):
    """After the projections, in place: biases (Qwen2 qkv_bias, attention_bias), OLMoE's q/k norm over
    the whole projection, clip_qkv, Qwen3's q/k norm per head. q (T,H*hd), k and v (T,Hkv*hd) ->
    the (T,H,hd) and (T,Hkv,hd) views of q and k."""
    T, H, Hkv, hd = q.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if L.bq is not None:
        q += L.bq
        k += L.bk
        v += L.bv
    if cfg.qk_norm == "full":
        K.rmsnorm(q, L.q_norm, cfg.rms_norm_eps, q)
        K.rmsnorm(k, L.k_norm, cfg.rms_norm_eps, k)
    if cfg.clip_qkv:
        np.clip(q, -cfg.clip_qkv, cfg.clip_qkv, out=q)
        np.clip(k, -cfg.clip_qkv, cfg.clip_qkv, out=k)
        np.clip(v, -cfg.clip_qkv, cfg.clip_qkv, out=v)
    if cfg.qk_norm == "head":
        K.rmsnorm(q.reshape(T * H, hd), L.q_norm, cfg.rms_norm_eps, q.reshape(T * H, hd))
        K.rmsnorm(k.reshape(T * Hkv, hd), L.k_norm, cfg.rms_norm_eps, k.reshape(T * Hkv, hd))
    return q.reshape(T, H, hd), k.reshape(T, Hkv, hd)


_ARGMAX_ROW = np.ones(1, np.bool_)      # head_logits' argmax_rows of forward's one row of logits


def forward(cfg: ModelConfig, w, rope, ws: Workspace, cache: KVCache, tokens=None, embeddings=None,
            all_logits: bool = False, noise=None, trace=None, out=None, argmax_only: bool = False) -> np.ndarray:
    """Run T new tokens (ids (T,), or embeddings (T,D)) at positions cache.length.. and
    return logits: (T,V) if all_logits (into `out` when given), else the last row (1,V). argmax_only: the
    caller reads only the last row's argmax (a greedy sequence): a block-kind head then gives that row the int8
    head's logits with those near the top recomputed on the int16 head (head.py), the int16 head's argmax."""
    T = len(tokens) if tokens is not None else embeddings.shape[0]
    P0 = cache.length
    if T > ws.rows:
        raise ValueError(f"{T} tokens exceed the workspace's {ws.rows} rows")
    if P0 + T > cache.capacity:
        raise ValueError(f"sequence of {P0 + T} tokens exceeds the context of {cache.capacity}")
    H = cfg.num_heads
    cos, sin = rope
    x, h, sub = ws.x[:T], ws.h[:T], ws.sub[:T]                                # (T,D)
    pos = ws.positions[:T]                                                     # (T,)
    if T == 1:
        pos[0] = P0
    else:
        pos[:] = np.arange(P0, P0 + T)
    scores = ws.attention_scores(cfg, cache.capacity)                         # (H/Hkv*S,), on threads (Hkv, ...)
    if T == 1 and embeddings is None and not all_logits and trace is None and (noise is None or noise.scale <= 0):
        step = ws.decode_step(cfg, w)
        if step is not None:                                                   # the whole token in one call
            return step(rope, cache, int(tokens[0]), scores, argmax_only)
    scale = attention_scale(cfg)

    # token embedding (or caller-supplied embeddings)
    if embeddings is not None:
        x[...] = embeddings
    else:
        embed(w.token_embd, np.asarray(tokens, np.int64), x)

    for l, L in enumerate(w.layers):
        # attention: RMSNorm -> latent attention, or q, k, v -> RoPE -> cache -> attention (_attention)
        norm(x, L.attn_norm, L.attn_norm_b, cfg.rms_norm_eps, h)
        if cfg.mla:                                                            # latent attention (mla.py)
            qa, rows = MLA.project(cfg, L, h, ws, pos, cos, sin)              # (T,H,r+dr) (T,1,r+dr)
            cache.k[l, :, P0:P0 + T] = rows.transpose(1, 0, 2)
            lat = ws.latent_out[:T].reshape(T, H, cfg.kv_lora_rank)
            K.attend(qa, cache.k[l], cache.k[l], P0, cfg.window(l), scale, lat, scores, L.sinks)
            MLA.output(cfg, L, lat, ws, sub)
        else:
            _attention(cfg, L, h, ws, cache, l, P0, pos, rope, scale, scores, sub)
        x += sub                                                               # residual

        # feed-forward: RMSNorm -> MoE (or dense MLP) -> residual
        norm(x, L.ffn_norm, L.ffn_norm_b, cfg.rms_norm_eps, h)
        if L.gate is not None:
            moe(L, h, ws, sub, noise=noise, trace=trace)
        else:
            swiglu(h, L.mlp_w1, L.mlp_w3, L.mlp_w2, ws, sub)
        x += sub

    cache.length = P0 + T
    # final norm and output head
    if all_logits:
        norm(x, w.output_norm, w.output_norm_b, cfg.rms_norm_eps, h)
        logits = out if out is not None else np.empty((T, cfg.vocab_size), np.float32)   # (T,V)
        ws.mm(h, w.output, logits)
        if w.output_b is not None:
            logits += w.output_b
        return logits
    norm(x[T - 1:T], w.output_norm, w.output_norm_b, cfg.rms_norm_eps, h[:1])
    return head_logits(ws, h[:1], w.output, w.output_b, ws.logits, _ARGMAX_ROW if argmax_only else None)   # (1,V)


def _attention(cfg: ModelConfig, L, h, ws: Workspace, cache: KVCache, l: int, P0: int, pos, rope, scale: float,
               scores, sub) -> None:
    """Layer l's attention of the T rows h (normed) at positions P0.. over the contiguous cache -> sub (T,D):
    q, k, v projections (+ bias) -> [clip] -> [q/k norm] -> RoPE -> cache -> attention -> output projection."""
    T, H, Hkv, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qd, kvd = cfg.q_dim, cfg.kv_dim
    cos, sin = rope
    if T == 1 and (L.wqkv is not None or L.qkv_stack is not None):             # q|k|v rows in one call
        qkv = ws.qkv[:1]                                                       # (1,H*hd+2*Hkv*hd)
        if L.wqkv is not None:                                                 # one view: one stream
            ws.mm(h, L.wqkv, qkv)
        elif ws.threads > 1 and len(L.qkv_stack) == 3:                          # stacked, rows over the threads
            K.matvec_qkv_par(*L.qkv_stack, h[0], qkv[0], ws.threads)
        else:                                                                  # f16/bf16 q, k, v stacked
            K.matvec_stack(L.qkv_stack, h[0], qkv[0])
        q, k, v = qkv[:, :qd], qkv[:, qd:qd + kvd], qkv[:, qd + kvd:]
    else:
        q, k, v = qkv_rows(ws, h, L, T)
    q3, k3 = qkv_finish(cfg, L, q, k, v)                                         # (T,H,hd) (T,Hkv,hd)
    attn = ws.attn[:T]                                                         # (T,H*hd)
    if T == 1:                                                                 # one call (kernels/decode)
        KD.rope_cache_attend(q3, k3, v.reshape(1, Hkv, hd), pos, cos, sin, cache.k[l], cache.v[l], P0,
                             cfg.window(l), scale, attn.reshape(1, H, hd), scores, L.sinks)
    else:
        K.rope(q3, pos, cos, sin)
        K.rope(k3, pos, cos, sin)
        # append to the cache, attend over positions 0..P0+T-1
        cache.k[l, :, P0:P0 + T] = k3.transpose(1, 0, 2)                       # (Hkv,T,hd)
        cache.v[l, :, P0:P0 + T] = v.reshape(T, Hkv, hd).transpose(1, 0, 2)
        K.attend(q3, cache.k[l], cache.v[l], P0, cfg.window(l), scale, attn.reshape(T, H, hd), scores, L.sinks)
    ws.mm(attn, L.wo, sub)
    if L.bo is not None:
        sub += L.bo
