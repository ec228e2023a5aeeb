"""Decode (T == 1) steps fused into one Numba call each: a token's Python work is dispatch,
so the fewer calls per layer the better (llama.cpp's fixed cost is ~54 us a token; eight
layers of a dozen dispatches and numpy statements each cost colibri ~200 us).

Each function calls the same kernels, in the same order, as transformer.forward's general
path, so the logits are bit for bit the same (tests/test_parity.py checks it).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import _matvec_core, attention, expert_ffn, rope, route
from .kernels_quant import expert_ffn_q

__all__ = ["moe_float", "moe_quant", "rope_cache_attend"]


@njit(cache=True)
def moe_float(gate, w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out):
    # x (D,) normed hidden; gate (E,D) f32; w1,w3 (E,I,D), w2 (E,D,I) float -> out (D,) = sum_a w_a * expert_a(x)
    # logits (1,E), idx (1,k) i32, wts (1,k) f32: the routing, as moe() leaves it
    _matvec_core(gate, x, logits[0], np.float32(1.0), False)
    route(logits, top_k, renorm, idx, wts)
    out[:] = 0.0
    for a in range(top_k):
        expert_ffn(w1, w3, w2, idx[0, a], x, wts[0, a], h1, h3, out)


@njit(cache=True)
def moe_quant(gate, q1, s1, q3, s3, q2, s2, x, top_k, renorm, logits, idx, wts, h1, h3, out, xs, xi):
    # moe_float for quantized experts (values q*, scales s*; xs/xi the matvec scratch)
    _matvec_core(gate, x, logits[0], np.float32(1.0), False)
    route(logits, top_k, renorm, idx, wts)
    out[:] = 0.0
    for a in range(top_k):
        expert_ffn_q(q1, s1, q3, s3, q2, s2, idx[0, a], x, wts[0, a], h1, h3, out, xs, xi)


@njit(cache=True)
def rope_cache_attend(q3, k3, v3, pos, cos, sin, kcache, vcache, start, window, scale, out, scores):
    # one token: RoPE on q3 (1,H,hd) and k3 (1,Hkv,hd) in place, k3/v3 into the cache (Hkv,S,hd) at
    # position `start`, attention of q3 over 0..start -> out (1,H,hd)
    rope(q3, pos, cos, sin)
    rope(k3, pos, cos, sin)
    for h in range(k3.shape[1]):
        kcache[h, start] = k3[0, h]
        vcache[h, start] = v3[0, h]
    attention(q3, kcache, vcache, start, window, scale, out, scores)
