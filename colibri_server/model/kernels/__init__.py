"""The Numba CPU kernels: every loop over weights or activations, each kernel with a plain-numpy twin.

Rooms, imports running upward only (a module imports only those above it):
  cpu       what the CPU can run (AVX2, AVX-512 VNNI, ...), asked of LLVM once
  packing   pure numpy: q8/q4 group quantization and the f16/bf16 panel layout (converter and twins)
  buffers   aligned and lazily mapped allocation of activations and scratch
  base      threading layer, f16/bf16 -> f32 loads (to_f32), expf, shape helpers; the conventions
  quant_ir, float_ir, attn_ir   LLVM IR inner loops (integer dots, f16/bf16 rows, attention rows)
  dense     float rmsnorm, matvec family, embed, rope, argmax
  moe       router, expert grouping, SwiGLU experts, threaded float matvecs
  quant     q8/q4 matvecs and experts      gemm   q8/q4 and bf16 GEMMs for prefill
  attn      causal attention               matmuls   X @ W.T for any weight kind (BLAS tiles or GEMM)
  heads     per-head products (latent attention's query absorption and value expansion), over dense and rowgemm
  paged     the paged KV pool's store and attention twin   tiled  tiled attention over it (online softmax)
  rowgemm   few-row GEMM of a serving step
  experts_q a serving step's q8/q4 experts in one call  prefetch  software prefetch for slow weight readers
  blocks_ir, blocks_row32, blocks   llama.cpp's block kinds: IR dots (the k-quants' blocks), the 32-block kinds'
                      row dots; dequantizers, activation rounding, row products
  blocks_tile_ir      the tiles' micro-kernel IR helpers (a tile's 16 weight rows as the lanes of a vector)
  blocks_head         the output head's Q6_K tiles on int16 activations
  blocks_x16          Q4_K and Q6_K matrices stored as 16-row tiles (q4_k_x16, q6_k_x16): read as stored, any rows
  blocks_gemm         their tiled product of many rows (16-row panels, VNNI micro-kernels)
  experts_blocks      a serving step's and a decode token's block-kind experts in one call
  head_argmax         the int16 head's argmax from the int8 head's logits (the few near the top recomputed)
  decode    the whole decode token fused into one Numba call
  kquants   llama.cpp's k-quant encoders (converter), over base and paged's f16 conversions

Kernels never allocate (outputs and scratch are passed in), never import a model-level module
(only ..format's constants, and ..numba_cache, ..numba_link, ..numba_wrappers: where and how their code
compiles, set up here first),
and know nothing of configs, files or requests. Model code imports them through this face:
`from . import kernels as K` and the families as `from .kernels import quant as KQ`.
"""
from .. import numba_cache as _numba_cache
from .. import numba_link as _numba_link
from .. import numba_wrappers as _numba_wrappers

_numba_cache.configure()    # before any kernel module is imported: the machine's and build's own cache directory
_numba_cache.lock_saves()   # and two processes compiling at once never cross their cache entries
_numba_cache.lock_compiles()    # and a kernel another process is compiling is waited for and loaded
_numba_link.install()           # and a kernel marked by_reference is compiled once, not into every caller
_numba_wrappers.install()       # and the wrappers around each kernel compile cheaply

from . import attn, attn_ir, cpu, decode, dense, float_ir, gemm, heads, packing, quant, quant_ir  # noqa: F401,E402
from .attn import attend, attention, attention_par, attention_ref  # noqa: F401
from .base import expf, nrows, parallel_runtime, row_slice, to_f32, weights_to_f32  # noqa: F401  (sets the threading layer first)
from .buffers import ALIGN, aligned_zeros, lazy_zeros  # noqa: F401
from .dense import (  # noqa: F401  (the Numba loops, for the tests)  # noqa: F401
                    _matvec_core,
                    _panels_loop,
                    argmax,
                    argmax_ref,
                    embed,
                    embed_ref,
                    layernorm,
                    layernorm_ref,
                    matvec,
                    matvec_ref,
                    matvec_stack,
                    panel_rows_to_f32,
                    rmsnorm,
                    rmsnorm_heads,
                    rmsnorm_heads_ref,
                    rmsnorm_ref,
                    rope,
                    rope_ref,
                    rows_to_f32,
                    rows_to_f32_ref,
)
from .matmuls import matmul, matmul_par, matmul_ref  # noqa: F401
from .moe import (  # noqa: F401
                    expert_ffn,
                    expert_ffn_par,
                    expert_ffn_ref,
                    group_by_expert,
                    group_by_expert_ref,
                    matvec_par,
                    matvec_qkv_par,
                    route,
                    route_ref,
                    route_rule,
                    route_rule_ref,
                    route_sparsemixer,
                    shared_gate_scale,
                    silu_mul,
                    silu_mul_ref,
                    swiglu_clamped,
                    swiglu_clamped_ref,
)
