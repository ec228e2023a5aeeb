"""Decode (T == 1) steps fused into one Numba call each: a token's Python work is dispatch,
so the fewer calls per layer the better (llama.cpp's fixed cost is ~54 us a token; eight
layers of a dozen dispatches and numpy statements each cost colibri ~200 us).

decode_token runs the whole token (every layer and the head) for the models decode_step.py
covers; moe_float/moe_quant and rope_cache_attend are the per-layer steps forward uses otherwise.
Its cache is either a sequence's own (L,Hkv,S,hd) arrays (Model.decode) or a paged pool
(L,NB,Hkv,BS,hd) with the sequence's block table (a serving step of one decoding sequence:
serving.BatchEngine), chosen by the arrays' rank; the paged keys/values are stored and read as
forward_batch does (paged.write_kv's rounding, kernels/tiled's attention: the same bits for a row).
Each function calls the same kernels, in the same order, as transformer.forward's general
path, so the logits are bit for bit the same (tests/test_parity.py checks it).
"""
from __future__ import annotations

import numpy as np
from numba import literal_unroll, njit, types
from numba.extending import overload

from ..numba_link import by_reference
from .attn import attend
from .blocks import ACTS16, QB, SB, embed_blocks
from .blocks_gemm import matmul3_blocks_par, matmul_blocks, matmul_blocks_par
from .dense import _matvec_core, embed, layernorm, matvec_stack, rmsnorm, rope
from .experts_blocks import experts_decode_par
from .heads import heads_matmul, heads_matmul_par
from .moe import (
    _matvec_par,
    _silu_mul_1d,
    expert_ffn,
    expert_ffn_par,
    matvec_qkv_par,
    route,
    route_rule,
    route_sparsemixer,
    shared_gate_scale,
    swiglu_clamped,
)
from .paged import _put_row
from .quant import _qmv_par, expert_ffn_q, expert_ffn_q_par, matvec_q, matvec_q_qkv_par
from .stacks import layer
from .tiled import tiled_attention, tiled_attention_par

__all__ = ["decode_token", "experts_biased", "moe_float", "moe_quant", "rope_cache_attend"]


@njit(cache=True)
def moe_float(gate, w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out, bk):
    # x (D,) normed hidden; gate (E,D) f32; w1,w3 (E,I,D), w2 (E,D,I) float -> out (D,) = sum_a w_a * expert_a(x)
    # logits (1,E), idx (1,k) i32, wts (1,k) f32: the routing, as moe() leaves it; bk the block kinds' scratch
    # (Workspace.block_scratch: unused here, its type the fused token's)
    _experts(gate, w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out, x[:0], x[:0], bk)   # no scratch


@njit(cache=True)
def moe_quant(gate, q1, s1, q3, s3, q2, s2, x, top_k, renorm, logits, idx, wts, h1, h3, out, xs, xi, bk):
    # moe_float for quantized experts (values q*, scales s*; xs/xi the matvec scratch, bk as moe_float's)
    _experts(gate, (q1, s1), (q3, s3), (q2, s2), x, top_k, renorm, logits, idx, wts, h1, h3, out, xs, xi, bk)


@njit(cache=True)
def rope_cache_attend(q3, k3, v3, pos, cos, sin, kcache, vcache, start, window, scale, out, scores, sinks):
    # one token: RoPE on q3 (1,H,hd) and k3 (1,Hkv,hd) in place, k3/v3 into the cache (Hkv,S,hd) at
    # position `start`, attention of q3 over 0..start -> out (1,H,hd); a 2-D scores scratch: kv heads on threads;
    # sinks (H,) per-head softmax sinks or size 0
    rope(q3, pos, cos, sin)
    rope(k3, pos, cos, sin)
    for h in range(k3.shape[1]):
        kcache[h, start] = k3[0, h]
        vcache[h, start] = v3[0, h]
    attend(q3, kcache, vcache, start, window, scale, out, scores, sinks)


def _store_attend(kc, vc, table, l, q3, k3, v3, start, window, scale, out, scores, sinks, xs):
    """Python stand-in (never called): layer l's cache store of k3/v3 (1,Hkv,dk) at `start` and the attention
    of q3 (1,H,dk) over it -> out (1,H,dv), by the cache's rank (RoPE already applied)."""
    raise NotImplementedError


@overload(_store_attend, inline="always")
def _store_attend_overload(kc, vc, table, l, q3, k3, v3, start, window, scale, out, scores, sinks, xs):
    if kc.ndim == 4:            # (L,Hkv,S,hd): the sequence's own cache (rope_cache_attend's store and attention;
        # a 2-D scores scratch runs the kv heads, or a latent's query heads, on threads)
        def own(kc, vc, table, l, q3, k3, v3, start, window, scale, out, scores, sinks, xs):
            kcl, vcl = kc[l], vc[l]
            for h in range(k3.shape[1]):        # element by element: an array slice assignment compiles Numba's
                for d in range(k3.shape[2]):    # shape-mismatch message (string formatting), seconds of a first start
                    kcl[h, start, d] = k3[0, h, d]
                for d in range(v3.shape[2]):
                    vcl[h, start, d] = v3[0, h, d]
            attend(q3, kcl, vcl, start, window, scale, out, scores, sinks)
        return own
    par = _threaded(xs)

    def paged(kc, vc, table, l, q3, k3, v3, start, window, scale, out, scores, sinks, xs):
        # (L,NB,Hkv,BS,hd) pool, table the sequence's blocks (scores unused). On threads the kv heads, or a
        # long sequence's segments, split over them as forward_batch's tiled_attention_par does for one row
        BS = kc.shape[3]
        b, o = table[start // BS], start % BS
        for h in range(k3.shape[1]):
            _put_row(k3[0, h], kc[l, b, h, o])
            _put_row(v3[0, h], vc[l, b, h, o])
        row = np.zeros(1, np.int64)
        row_pos = np.full(1, start, np.int64)
        if par:
            tiled_attention_par(q3, kc[l], vc[l], table.reshape((1, table.shape[0])), row, row_pos, window, scale,
                                out, sinks, xs.shape[0] // 2)
        else:
            tiled_attention(q3, kc[l], vc[l], table.reshape((1, table.shape[0])), row, row_pos, window, scale, out,
                            sinks)
    return paged


# -- the whole token --------------------------------------------------------------------------
# A weight reaches these kernels as: a float array (f16/bf16 rows or panels, or a q|k|v view),
# a quantized pair (q, s), a block-kind pair (raw bytes, GGML kind: kernels/blocks), or for q|k|v
# a tuple of three float arrays (a stack), of three pairs or of three block pairs.
# The scratch xs/xi picks the threads: one row (1-D) runs every matrix on the calling thread; a
# workspace's (2*chunks, ...) rows split each matrix's rows over Numba threads (prange, `chunks`
# chunks; the experts' w1 and w3 take 2*chunks in one region). Rows give the same bits either way.
# bk: the block kinds' scratch (Workspace.block_scratch): Xq, Xd, Xs, tmps (block_acts' buffers), and
# H1, H3, Hq, Hd, Hs (the threaded experts' rows, experts_decode_par), small arrays for other kinds; and
# the weights from which a block-kind matrix goes to the threads (Workspace.PAR_MIN_WEIGHTS).

def _is_pair(W):
    return (isinstance(W, types.BaseTuple) and len(W) == 2 and isinstance(W[0], types.Array)
            and W[0].dtype in (types.int8, types.uint8) and isinstance(W[1], types.Array))


def _is_blocks(W):
    return (isinstance(W, types.BaseTuple) and len(W) == 2 and isinstance(W[0], types.Array)
            and W[0].dtype == types.uint8 and isinstance(W[1], types.Integer))


@njit(cache=True, inline="always")
def _acts(bk, n, kind):
    # the rounding scratch of one row of n activations for kind, C-contiguous (1, ...) views of the workspace's flat
    # buffers as Workspace.block_acts makes them (so every block kernel gets the types forward's general path
    # compiled), and the per-thread scratch rows
    w = 2 * n if kind & ACTS16 else n
    return (bk[0][:w].reshape((1, w)), bk[1][:n // QB].reshape((1, n // QB)), bk[2][:n // SB].reshape((1, n // SB)),
            bk[3])


@njit(cache=True, inline="always")
def _blocks_mv(raw, kind, x, out, alpha, accumulate, bk, nt):
    # out (d,) (=|+=) alpha * raw (d, row bytes) @ x (n,): Workspace.mm_blocks at T == 1 (on nt threads from
    # bk[9] weights: Workspace.PAR_MIN_WEIGHTS)
    n, d = x.shape[0], out.shape[0]
    q, xd, xsum, tm = _acts(bk, n, kind)
    acc = np.bool_(accumulate)      # not a literal: a literal True or False is a compile of the block chain of its own
    if nt > 1 and d * n >= bk[9]:
        matmul_blocks_par(raw, kind, x.reshape((1, n)), out.reshape((1, d)), q, xd, xsum, tm[:nt], alpha, acc)
    else:
        matmul_blocks(raw, kind, x.reshape((1, n)), out.reshape((1, d)), q, xd, xsum, tm[0], alpha, acc)


@njit(cache=True, inline="always")
def _qkv_blocks_together(W, x, xs, bk):
    # whether q, k and v (block kinds) take one parallel region (blocks_gemm.matmul3_blocks_par): each would take the
    # threads on its own (bk[9]), none rounds to int16, and bk's rounding buffers hold three rows of x
    n = x.shape[0]
    d = min(W[0][0].shape[0], W[1][0].shape[0], W[2][0].shape[0])
    return (d * n >= bk[9] and not (W[0][1] | W[1][1] | W[2][1]) & ACTS16 and bk[0].shape[0] >= 3 * n
            and bk[1].shape[0] >= 3 * (n // QB) and bk[2].shape[0] >= 3 * (n // SB))


@njit(cache=True, inline="always")
def _qkv_blocks(W, x, out, nt, bk):
    # out (qd+2kvd,) = q|k|v @ x in one parallel region of nt chunks (a token's ~3 regions fewer than _proj's each)
    n = x.shape[0]
    dq, dk = W[0][0].shape[0], W[1][0].shape[0]
    dv = W[2][0].shape[0]
    matmul3_blocks_par(W[0][0], W[0][1], W[1][0], W[1][1], W[2][0], W[2][1], x.reshape((1, n)),
                       out[:dq].reshape((1, dq)), out[dq:dq + dk].reshape((1, dk)), out[dq + dk:dq + dk + dv].reshape((1, dv)),
                       bk[0][:3 * n].reshape((3, n)), bk[1][:3 * (n // QB)].reshape((3, n // QB)),
                       bk[2][:3 * (n // SB)].reshape((3, n // SB)), bk[3][:nt])


def _threaded(xs):
    return isinstance(xs, types.Array) and xs.ndim == 2


def _proj(W, x, out, xs, xi, bk):
    pass


@overload(_proj)
def _proj_overload(W, x, out, xs, xi, bk):
    # out (d,) = W @ x for a float array, a quantized pair or a block pair
    par = _threaded(xs)
    if _is_blocks(W):
        def impl(W, x, out, xs, xi, bk):
            _blocks_mv(W[0], W[1], x, out, np.float32(1.0), False, bk, xs.shape[0] // 2 if par else 1)
        return impl
    if isinstance(W, types.Array) and par:
        def impl(W, x, out, xs, xi, bk):
            _matvec_par(W, x, out, xs.shape[0] // 2, np.float32(1.0), np.bool_(False))
        return impl
    if isinstance(W, types.Array):
        def impl(W, x, out, xs, xi, bk):
            _matvec_core(W, x, out, np.float32(1.0), np.bool_(False))
        return impl
    if _is_pair(W) and par:
        def impl(W, x, out, xs, xi, bk):
            n = xs.shape[0] // 2
            _qmv_par(W[0], W[1], x, out, xs[:n], xi[:n], np.float32(1.0), np.bool_(False))
        return impl
    if _is_pair(W):
        def impl(W, x, out, xs, xi, bk):
            matvec_q(W[0], W[1], x, out, xs, xi)
        return impl


def _qkv(W, x, out, xs, xi, bk):
    pass


@overload(_qkv)
def _qkv_overload(W, x, out, xs, xi, bk):
    # out (qd+2kvd,) = q|k|v @ x: one view, a float stack (rows streamed together), three pairs or three block pairs
    par = _threaded(xs)
    if isinstance(W, types.Array):
        return lambda W, x, out, xs, xi, bk: _proj(W, x, out, xs, xi, bk)
    if isinstance(W, types.BaseTuple) and len(W) == 3 and all(_is_blocks(p) for p in W):
        def impl(W, x, out, xs, xi, bk):        # forward's qkv_rows: q, k, v each its own product
            if par and _qkv_blocks_together(W, x, xs, bk):
                _qkv_blocks(W, x, out, xs.shape[0] // 2, bk)
                return
            o = 0
            for p in literal_unroll(W):
                d = p[0].shape[0]
                _proj(p, x, out[o:o + d], xs, xi, bk)
                o += d
        return impl
    if isinstance(W, types.BaseTuple) and len(W) == 3 and all(_is_pair(p) for p in W):
        if par:
            def impl(W, x, out, xs, xi, bk):
                n = xs.shape[0] // 2
                matvec_q_qkv_par(W[0][0], W[0][1], W[1][0], W[1][1], W[2][0], W[2][1], x, out, xs[:n], xi[:n])
            return impl

        def impl(W, x, out, xs, xi, bk):
            o = 0
            for p in literal_unroll(W):
                d = p[0].shape[0]
                matvec_q(p[0], p[1], x, out[o:o + d], xs, xi)
                o += d
        return impl
    if isinstance(W, types.BaseTuple) and all(isinstance(a, types.Array) for a in W):
        if par and len(W) == 3:
            return lambda W, x, out, xs, xi, bk: matvec_qkv_par(W[0], W[1], W[2], x, out, xs.shape[0] // 2)
        if par:
            return None
        return lambda W, x, out, xs, xi, bk: matvec_stack(W, x, out)


def _expert(w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk):
    pass


@overload(_expert)
def _expert_overload(w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk):
    # out (D,) += weight * expert e's SwiGLU of x: float (E,I,D)/(E,D,I) arrays, quantized or block pairs
    par = _threaded(xs)
    if _is_blocks(w1):          # Workspace.expert's three products
        def blocks(w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk):
            nt = xs.shape[0] // 2 if par else 1
            one = np.float32(1.0)
            _blocks_mv(w1[0][e], w1[1], x, h1, one, False, bk, nt)
            _blocks_mv(w3[0][e], w3[1], x, h3, one, False, bk, nt)
            _silu_mul_1d(h1, h3)
            _blocks_mv(w2[0][e], w2[1], h1, out, weight, True, bk, nt)
        return blocks
    if isinstance(w1, types.Array) and par:
        return lambda w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk: expert_ffn_par(
            w1, w3, w2, e, x, weight, h1, h3, out, xs.shape[0] // 2)
    if isinstance(w1, types.Array):
        return lambda w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk: expert_ffn(w1, w3, w2, e, x, weight, h1, h3, out)
    if _is_pair(w1):
        ffn = expert_ffn_q_par if par else expert_ffn_q
        return lambda w1, w3, w2, e, x, weight, h1, h3, out, xs, xi, bk: ffn(
            w1[0], w1[1], w3[0], w3[1], w2[0], w2[1], e, x, weight, h1, h3, out, xs, xi)


@njit(cache=True)
def _experts(gate, w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out, xs, xi, bk):
    # out (D,) = sum over the top_k routed experts of their weight * SwiGLU of x; the router's
    # (E,D) f32 gate on the calling thread
    _routed(gate, x[:0], x[:0], np.float32(0.0), w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out, xs,
            xi, bk)


@by_reference          # a MoE layer of the decode token: one copy, not one in each token's module (model/numba_link)
@njit(cache=True)
def _routed(gate, rule, cbias, sparse, w1, w3, w2, x, top_k, renorm, logits, idx, wts, h1, h3, out, xs, xi, bk):
    # _experts under Phi-MoE's sparsemixer when sparse (its eps) > 0, a version-2 routing rule when rule (4,) is
    # given (kernels/moe.route_rule, cbias (E,) or size 0), else version 1's softmax top-k: moe()'s kernels and
    # order at T == 1
    _matvec_core(gate, x, logits[0], np.float32(1.0), np.bool_(False))
    if sparse > 0:
        route_sparsemixer(logits, sparse, idx, wts)
    elif rule.shape[0] > 0:
        route_rule(logits, top_k, rule, cbias, idx, wts)
    else:
        route(logits, top_k, renorm, idx, wts)
    out[:] = 0.0
    _chosen(w1, w3, w2, x, top_k, idx, wts, h1, h3, out, xs, xi, bk)


def _chosen(w1, w3, w2, x, top_k, idx, wts, h1, h3, out, xs, xi, bk):
    pass


@overload(_chosen)
def _chosen_overload(w1, w3, w2, x, top_k, idx, wts, h1, h3, out, xs, xi, bk):
    # out (D,) += the top_k chosen experts (idx, wts (1,k)) of x, one after another; block kinds on threads: in two
    # parallel regions (kernels/experts_blocks.experts_decode_par, as Workspace.experts_blocks runs them: the same bits)
    if _is_blocks(w1) and _threaded(xs):
        def par(w1, w3, w2, x, top_k, idx, wts, h1, h3, out, xs, xi, bk):
            D = x.shape[0]
            q, xd, xsum, tm = _acts(bk, D, w1[1])
            experts_decode_par(w1[0], w1[1], w3[0], w3[1], w2[0], w2[1], idx[0].astype(np.int64), wts[0],
                               x.reshape((1, D)), bk[4], bk[5], out.reshape((1, D)), q, xd, xsum, bk[6], bk[7], bk[8],
                               tm[:xs.shape[0] // 2])
        return par

    def each(w1, w3, w2, x, top_k, idx, wts, h1, h3, out, xs, xi, bk):
        for a in range(top_k):
            _expert(w1, w3, w2, idx[0, a], x, wts[0, a], h1, h3, out, xs, xi, bk)
    return each


def _at(W, e):
    pass


@overload(_at, inline="always")
def _at_overload(W, e):
    # expert e of a float (E,...) stack, of a quantized pair (q, s) or a block pair: what _proj takes
    if _is_blocks(W):
        return lambda W, e: (W[0][e], W[1])
    if _is_pair(W):
        return lambda W, e: (W[0][e], W[1][e])
    return lambda W, e: W[e]


@njit(cache=True)
def experts_biased(w1, w3, w2, b1, b3, b2, idx, wts, x, alpha, limit, h1, h3, y, out, xs, xi, bk):
    # GPT-OSS, one token: out (D,) = sum over its chosen experts (idx (A,) i32, in increasing order as moe()'s
    # general path adds them) of wts[a] * (w2[e] @ act + b2[e]), act = swiglu_clamped(w1[e] @ x, w3[e] @ x, b1[e],
    # b3[e]); w1,w3 (E,I,D), w2 (E,D,I) float rows or panels or quantized pairs; h1,h3 (I,), y (D,) f32 scratch;
    # xs/xi pick the threads (_proj). moe() calls it for a decode token on one thread, the fused token in any case
    out[:] = 0.0
    order = np.argsort(idx)
    n = h1.shape[0]
    for k in range(idx.shape[0]):
        a = order[k]
        e = idx[a]
        _proj(_at(w1, e), x, h1, xs, xi, bk)
        _proj(_at(w3, e), x, h3, xs, xi, bk)
        swiglu_clamped(h1.reshape((1, n)), h3.reshape((1, n)), b1[e], b3[e], alpha, limit, h1.reshape((1, n)))
        _proj(_at(w2, e), h1, y, xs, xi, bk)
        wa = wts[a]
        be = b2[e]
        for j in range(out.shape[0]):
            out[j] += (y[j] + be[j]) * wa


@by_reference          # as _routed
@njit(cache=True)
def _routed_biased(gate, gate_b, w1, w3, w2, b1, b3, b2, alpha, limit, x, top_k, renorm, logits, idx, wts, h1, h3, y,
                   out, xs, xi, bk):
    # GPT-OSS's routed layer at T == 1, moe()'s general path call for call: the router's logits W x + gate_b, softmax
    # top-k, then its biased experts (experts_biased)
    _matvec_core(gate, x, logits[0], np.float32(1.0), np.bool_(False))
    _add(logits[0], gate_b)
    route(logits, top_k, renorm, idx, wts)
    experts_biased(w1, w3, w2, b1, b3, b2, idx[0], wts[0], x, alpha, limit, h1, h3, y, out, xs, xi, bk)


@by_reference          # as _routed, for a dense layer
@njit(cache=True)
def _mlp(w1, w3, w2, x, m1, m3, out, xs, xi, bk):
    # a dense layer's SwiGLU MLP of x (D,) -> out (D,) = w2 @ (silu(w1 @ x) * (w3 @ x)), through m1, m3 (F,)
    _proj(w1, x, m1, xs, xi, bk)
    _proj(w3, x, m3, xs, xi, bk)
    _silu_mul_1d(m1, m3)
    _proj(w2, m1, out, xs, xi, bk)


def _ffn(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, x, top_k, renorm, logits, idx, wts, h1, h3, m1,
         m3, y, out, xs, xi, bk):
    pass


@overload(_ffn)
def _ffn_overload(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, x, top_k, renorm, logits, idx, wts, h1,
                  h3, m1, m3, y, out, xs, xi, bk):
    # a layer's feed-forward of x (D,) -> out (D,). j >= 0: the j-th MoE layer's routed experts (gate, rule, cbias,
    # w1, w3, w2: tuples over the MoE layers); j < 0: the (-1-j)-th dense layer's SwiGLU MLP w2 @ (silu(w1 @ x) *
    # (w3 @ x)) (mw1, mw3, mw2: tuples over the dense layers) through m1, m3 (F,), moe.swiglu's kernels and order.
    # gate None: a model whose every layer is dense (the MoE branch is not compiled). bias None, or GPT-OSS's
    # (gate_b, b1, b3, b2: tuples over the MoE layers, alpha, limit): its biased experts (_routed_biased, y scratch)
    if isinstance(gate, types.NoneType):
        def dense(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, x, top_k, renorm, logits, idx, wts,
                  h1, h3, m1, m3, y, out, xs, xi, bk):
            i = -1 - j
            _mlp(layer(mw1, i), layer(mw3, i), layer(mw2, i), x, m1, m3, out, xs, xi, bk)
        return dense
    if not isinstance(bias, types.NoneType):
        def biased(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, x, top_k, renorm, logits, idx, wts,
                   h1, h3, m1, m3, y, out, xs, xi, bk):
            if j < 0:
                i = -1 - j
                _mlp(layer(mw1, i), layer(mw3, i), layer(mw2, i), x, m1, m3, out, xs, xi, bk)
            else:
                gate_b, b1, b3, b2, alpha, limit = bias
                _routed_biased(layer(gate, j), layer(gate_b, j), layer(w1, j), layer(w3, j), layer(w2, j),
                               layer(b1, j), layer(b3, j), layer(b2, j), alpha, limit, x, top_k,
                               renorm, logits, idx[j:j + 1], wts, h1, h3, y, out, xs, xi, bk)
        return biased

    def either(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, x, top_k, renorm, logits, idx, wts, h1,
               h3, m1, m3, y, out, xs, xi, bk):
        if j < 0:
            i = -1 - j
            _mlp(layer(mw1, i), layer(mw3, i), layer(mw2, i), x, m1, m3, out, xs, xi, bk)
        else:
            _routed(layer(gate, j), layer(rule, j), layer(cbias, j), sparse, layer(w1, j), layer(w3, j),
                    layer(w2, j), x, top_k, renorm, logits, idx[j:j + 1], wts, h1, h3, out, xs, xi, bk)
    return either


def _attention(attn, l, h, pos, cos, sin, kc, vc, table, start, window, scale, sinks, scores, eps, xs, xi, bk):
    pass


_MLA_LEN = 15       # the length of a latent-attention `attn` tuple (decode_step.DecodeStep.build)


@overload(_attention)
def _attention_overload(attn, l, h, pos, cos, sin, kc, vc, table, start, window, scale, sinks, scores, eps, xs, xi, bk):
    # layer l's attention of the normed hidden h (D,) at position `start` -> the flat attention output (the input
    # of wo), keys/values into the cache. attn's kind picks the code: q|k|v heads (transformer._attention), or
    # latent attention (mla.project/output: transformer.forward's cfg.mla branch), their kernels and order.
    if len(attn) == _MLA_LEN:
        def latent(attn, l, h, pos, cos, sin, kc, vc, table, start, window, scale, sinks, scores, eps, xs, xi, bk):
            # q_a, q_a_norm, wq, kv_a, kv_a_norm: tuples over the layers (q_a_norm size 0: no query rank, q_a
            # then never read); k_up (H,r,nope), v_up (H,v,r) per layer; leps the latent norms' eps; q
            # (1,H*(nope+dr)), ql (1,q_lora_rank), rows (1,r+dr), qa (1,H*(r+dr)), lat (1,H*r), ah (1,H*v) scratch
            q_a, q_a_norm, wq, kv_a, kv_a_norm, k_up, v_up, nope, leps, q, ql, rows, qa, lat, ah = attn
            kup = layer(k_up, l)
            H, r = kup.shape[0], kup.shape[1]
            dr = rows.shape[1] - r
            qan = layer(q_a_norm, l)
            if qan.shape[0] > 0:
                _proj(layer(q_a, l), h, ql[0], xs, xi, bk)
                rmsnorm(ql, qan, leps, ql)
                _proj(layer(wq, l), ql[0], q[0], xs, xi, bk)
            else:
                _proj(layer(wq, l), h, q[0], xs, xi, bk)
            q3 = q.reshape((1, H, nope + dr))
            _proj(layer(kv_a, l), h, rows[0], xs, xi, bk)
            c = rows[0, :r].reshape((1, r))        # contiguous, as forward's view of it is: the same norm's code
            rmsnorm(c, layer(kv_a_norm, l), leps, c)
            rows3 = rows.reshape((1, 1, r + dr))
            rope(q3[:, :, nope:], pos, cos, sin)
            rope(rows3[:, :, r:], pos, cos, sin)
            qa3 = qa.reshape((1, H, r + dr))
            _heads(q3[:, :, :nope], kup, qa3[:, :, :r], xs)
            for hh in range(H):
                qa3[0, hh, r:] = q3[0, hh, nope:]
            lat3 = lat.reshape((1, H, r))
            _store_attend(kc, vc, table, l, qa3, rows3, rows3, start, window, scale, lat3, scores, sinks, xs)
            _heads(lat3, layer(v_up, l), ah.reshape((1, H, ah.shape[1] // H)), xs)
            return ah[0]
        return latent

    def heads(attn, l, h, pos, cos, sin, kc, vc, table, start, window, scale, sinks, scores, eps, xs, xi, bk):
        # wqkv, bqkv (size 0: none), qnorm, knorm (size 0: none): tuples over the layers; qk_mode 0 none, 1 over the
        # whole projection, 2 per head; clip 0 off; qkv (1,qd+2kvd) with q3 (1,H,hd), k3, v3 (1,Hkv,hd) its views;
        # attn3 (1,H,hd)
        wqkv, bqkv, qnorm, knorm, qk_mode, clip, qkv, q3, k3, v3, attn3 = attn
        _, H, hd = q3.shape
        Hkv = k3.shape[1]
        _qkv(layer(wqkv, l), h, qkv[0], xs, xi, bk)
        b = layer(bqkv, l)
        if b.shape[0] > 0:
            _add(qkv[0], b)
        if qk_mode == 1:
            rmsnorm(q3.reshape(1, H * hd), layer(qnorm, l), eps, q3.reshape(1, H * hd))
            rmsnorm(k3.reshape(1, Hkv * hd), layer(knorm, l), eps, k3.reshape(1, Hkv * hd))
        if clip > 0:
            _clip(q3.reshape(H * hd), clip)
            _clip(k3.reshape(Hkv * hd), clip)
            _clip(v3.reshape(Hkv * hd), clip)
        if qk_mode == 2:
            rmsnorm(q3.reshape(H, hd), layer(qnorm, l), eps, q3.reshape(H, hd))
            rmsnorm(k3.reshape(Hkv, hd), layer(knorm, l), eps, k3.reshape(Hkv, hd))
        rope(q3, pos, cos, sin)
        rope(k3, pos, cos, sin)
        _store_attend(kc, vc, table, l, q3, k3, v3, start, window, scale, attn3, scores, sinks, xs)
        return attn3.reshape(H * hd)
    return heads


def _heads(X, W, out, xs):
    pass


@overload(_heads)
def _heads_overload(X, W, out, xs):
    # mla's per-head products: on the Numba threads when the scratch says so (the same bits: heads are independent)
    if _threaded(xs):
        return lambda X, W, out, xs: heads_matmul_par(X, W, out)
    return lambda X, W, out, xs: heads_matmul(X, W, out)


def _embed(emb, ids, x):
    pass


@overload(_embed, inline="always")
def _embed_overload(emb, ids, x):
    # x (1,D) = the token's row of the embedding: a float table, or a block pair (transformer.embed's kernels)
    if _is_blocks(emb):
        return lambda emb, ids, x: embed_blocks(emb[0], emb[1], ids, x)
    return lambda emb, ids, x: embed(emb, ids, x)


@njit(cache=True, inline="always")
def _norm(x, w, b, eps, out):
    # transformer.norm: LayerNorm where the model has its bias b (Phi-MoE), else RMSNorm (b size 0)
    if b.shape[0] > 0:
        layernorm(x, w, b, eps, out)
    else:
        rmsnorm(x, w, eps, out)


@njit(cache=True, inline="always")
def _add(a, b):
    # a (n,) += b (n,)
    for j in range(a.shape[0]):
        a[j] += b[j]


@njit(cache=True, inline="always")
def _clip(a, c):
    # a (n,) clipped to [-c, c] in place, NaN kept (np.clip's result)
    lo = -c
    for j in range(a.shape[0]):
        if a[j] < lo:
            a[j] = lo
        elif a[j] > c:
            a[j] = c


@njit(cache=True)
def decode_token(ids, emb, anorm, anorm_b, attn, wo, bo, sinks, windows, fnorm, fnorm_b, ffn_of, gate, rule, cbias,
                 sparse, bias, w1, w3, w2, mw1, mw3, mw2, sw1, sw3, sw2, sgate, has_shared, top_k, renorm, eps,
                 kcache, vcache, table, start, cos, sin, scale, onorm, onorm_b, wout, wout_b,
                 x, h, sub, logits_e, idx, wts, h1, h3, y, sh1, sh3, sout, m1, m3, xs, xi, bk, scores, pos, logits):
    # One token ids (1,) at position `start` through every layer and the head -> logits (1,V), the
    # kernels and order of transformer.forward's T == 1 path. Per-layer weights are tuples over the
    # layers (one type each). attn: the attention's weights and scratch, q|k|v heads or latent attention
    # (_attention); wo, bo (size 0: none) its output projection; sinks (H,) per layer (GPT-OSS, size 0: none);
    # windows (L,) int64 each layer's sliding window (0: none). x, h, sub (1,D); logits_e (1,E), wts (1,k) the
    # routing, idx (n_moe,k) the experts each MoE layer chose (kept for the caller's routing counts).
    # ffn_of (L,) int64: layer l's feed-forward is the ffn_of[l]-th MoE layer's (gate (E,D) f32, rule (4,) f32
    # and cbias (E,) of version-2 routing or size 0, expert stacks w1/w3/w2: tuples over the MoE layers) or,
    # when negative, the (-1-ffn_of[l])-th dense layer's MLP (mw1/mw3/mw2: tuples over the dense layers, through
    # m1, m3 (F,)): DeepSeek/GLM/Qwen2-MoE dense layers among MoE ones. bias: GPT-OSS's router and expert biases
    # (_ffn), else None; y (D,) its scratch. The MoE layers' shared expert sw1/sw3/sw2 (tuples over the MoE
    # layers) with the gate sgate (D,) (size 0: ungated), has_shared False: none (sw* then hold other matrices,
    # never read); sh1, sh3 (S,), sout (D,) its scratch. A dense model (every layer an MLP: Llama, Qwen2,
    # Qwen3): gate None. Phi-MoE: anorm_b, fnorm_b (tuples over the layers), onorm_b the LayerNorms' biases
    # (size 0: RMSNorm), wout_b the head's bias (size 0: none), sparse sparsemixer's eps (0: another routing).
    # kcache/vcache: (L,Hkv,S,hd) (table unused) or a paged pool (L,NB,Hkv,BS,hd) with the table.
    _embed(emb, ids, x)
    pos[0] = start
    for l in range(ffn_of.shape[0]):
        _norm(x, layer(anorm, l), layer(anorm_b, l), eps, h)
        a = _attention(attn, l, h[0], pos, cos, sin, kcache, vcache, table, start, windows[l], scale,
                       layer(sinks, l), scores, eps, xs, xi, bk)
        _proj(layer(wo, l), a, sub[0], xs, xi, bk)
        b = layer(bo, l)
        if b.shape[0] > 0:
            _add(sub[0], b)
        _add(x[0], sub[0])
        _norm(x, layer(fnorm, l), layer(fnorm_b, l), eps, h)
        j = ffn_of[l]
        _ffn(gate, j, rule, cbias, sparse, bias, w1, w3, w2, mw1, mw3, mw2, h[0], top_k, renorm, logits_e, idx, wts,
             h1, h3, m1, m3, y, sub[0], xs, xi, bk)
        if has_shared and j >= 0:          # moe._shared_expert: swiglu, then the gate's sigmoid, then added
            _proj(layer(sw1, j), h[0], sh1, xs, xi, bk)
            _proj(layer(sw3, j), h[0], sh3, xs, xi, bk)
            _silu_mul_1d(sh1, sh3)
            _proj(layer(sw2, j), sh1, sout, xs, xi, bk)
            sg = layer(sgate, j)
            if sg.shape[0] > 0:
                gs = shared_gate_scale(h[0], sg)
                for c in range(sout.shape[0]):
                    sout[c] *= gs
            _add(sub[0], sout)
        _add(x[0], sub[0])
    _norm(x, onorm, onorm_b, eps, h)
    _proj(wout, h[0], logits[0], xs, xi, bk)
    if wout_b.shape[0] > 0:                # Phi-MoE's head bias
        _add(logits[0], wout_b)
