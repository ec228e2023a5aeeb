"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi-K2): the projections around an
attention whose cache holds one latent row per position instead of every head's key and value.

Per position, the hidden state h (normed) gives
    q       = W_q h, or W_q norm(W_qa h) with a query rank          (H heads of nope + dr dims)
    c | k_r = W_kva h                                                (the latent c, r dims; the rotary key, dr)
    c       = norm(c)
and transformers expands every head's key and value from the latent: k_h = [W_uk_h c, rope(k_r)],
v_h = W_uv_h c. Nothing here expands them. The query is moved into the latent space instead
(the "absorbed" form, as llama.cpp and vLLM run it):
    q_h . k_h = (W_uk_h^T q_nope_h) . c + rope(q_rope_h) . rope(k_r)
so each head's query becomes qa_h = [W_uk_h^T q_nope_h, rope(q_rope_h)] (r + dr dims) against the
cached row [c, rope(k_r)], one kv head shared by all H query heads; and since softmax weights sum
the values linearly, o_h = W_uv_h (sum_j p_j c_j): the attention's value is the latent itself
(the first r dims of each cached row) and W_uv_h applies once to its output.
So the cache costs (r + dr) numbers per position and layer: 576 for DeepSeek-V3 against 2 x 128 x
128 expanded (kv.py, transformer.KVCache). The rotary dims of q and k_r are stored by the converter
in the order RoPE's rotate-half runs on (DeepSeek's checkpoints interleave them: families/deepseek.py).

Legend: T rows, H heads, nope / dr the query head's parts without and with position, r the
latent's rank, v a value head, D hidden.

Owns: the latent projections, the query absorption and the value expansion of one layer.
Never: touches the cache (the forward writes the rows and runs the attention over its own
cache: transformer.forward's contiguous one, batch.forward_batch's pool).
"""
from __future__ import annotations

from . import kernels as K
from .kernels import heads as KH

# transformers' (and DeepSeek's own) q_a_layernorm and kv_a_layernorm: built with the default eps,
# not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def project(cfg, L, h, ws, pos, cos, sin):
    """h (T,D) -> (qa (T,H,r+dr): the queries in the latent space, rows (T,1,r+dr): what the cache
    keeps for these positions), RoPE applied at the positions pos (T,)."""
    T, H = h.shape[0], cfg.num_heads
    r, dr, nope = cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim
    q = ws.q[:T]                                                           # (T,H*(nope+dr))
    if L.q_a is not None:
        ql = ws.q_lora[:T]                                                 # (T,q_lora_rank)
        ws.mm(h, L.q_a, ql)
        K.rmsnorm(ql, L.q_a_norm, LATENT_NORM_EPS, ql)
        ws.mm(ql, L.wq, q)
    else:
        ws.mm(h, L.wq, q)
    q3 = q.reshape(T, H, nope + dr)
    rows = ws.k[:T]                                                        # (T,r+dr)
    ws.mm(h, L.kv_a, rows)
    c = rows[:, :r]
    K.rmsnorm(c, L.kv_a_norm, LATENT_NORM_EPS, c)
    rows3 = rows.reshape(T, 1, r + dr)
    K.rope(q3[:, :, nope:], pos, cos, sin)
    K.rope(rows3[:, :, r:], pos, cos, sin)
    qa = ws.q_latent[:T].reshape(T, H, r + dr)
    (KH.heads_matmul_par if ws.threads > 1 else KH.heads_matmul)(q3[:, :, :nope], L.k_up, qa[:, :, :r])
    qa[:, :, r:] = q3[:, :, nope:]
    return qa, rows3


def output(cfg, L, lat, ws, sub) -> None:
    """lat (T,H,r): each head's attention over the latent -> sub (T,D): W_o [W_uv_h lat_h]_h."""
    T = lat.shape[0]
    attn = ws.attn[:T]                                                     # (T,H*v)
    (KH.heads_matmul_par if ws.threads > 1 else KH.heads_matmul)(lat, L.v_up, attn.reshape(T, cfg.num_heads,
                                                                                           cfg.v_head_dim))
    ws.mm(attn, L.wo, sub)


def compile_threaded(cfg, weights, ws) -> None:
    """Compile, without running, the threaded per-head products for these weights as project and
    output call them (ws: a Workspace with threads > 1; safe in a pre-fork master)."""
    import numba
    H, r, dr, nope = cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim
    q3 = ws.q[:1].reshape(1, H, nope + dr)
    qa = ws.q_latent[:1].reshape(1, H, r + dr)
    lat = ws.latent_out[:1].reshape(1, H, r)
    attn = ws.attn[:1].reshape(1, H, cfg.v_head_dim)
    seen = set()
    for L in weights.layers:
        for args in ((q3[:, :, :nope], L.k_up, qa[:, :, :r]), (lat, L.v_up, attn)):
            sig = tuple(numba.typeof(a) for a in args)
            if sig not in seen:
                seen.add(sig)
                KH.heads_matmul_par.compile(sig)
