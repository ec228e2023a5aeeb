"""The feed-forward half of a layer: MoE routing and dispatch, shared expert, dense MLP.

Legend: T tokens in this step, D hidden, E experts, A active experts per token (top_k),
I expert intermediate, S shared-expert intermediate, F dense intermediate, c tokens routed
to one expert.

Dispatch is grouped by expert (a counting sort of the T*A assignments), so within one call
(one sequence's prefill chunk of T tokens) each selected expert's weights are streamed once,
not once per token; separate sequences and separate decode steps each stream them again.
Decode (T == 1) runs the router, top-k and the selected experts in one Numba call (kernels/decode).
"""
from __future__ import annotations

import itertools

import numpy as np

from . import kernels as K
from .blocks import is_block
from .kernels import decode as KD
from .kernels import experts_blocks as KEB
from .kernels import experts_q as KX
from .kernels import rowgemm as RG
from .panels import kernel_array


class RoutingNoise:
    """Optional Gumbel top-k noise on expert *selection* (the seed's exploration knob).

    Off when scale == 0 (the default). When on, experts are chosen by the top-k of
    logits + scale * Gumbel(0, 1) drawn from this object's own generator (one per
    process, never numpy's global one); the combine weights stay the clean softmax
    probabilities of the chosen experts (renormalised where the architecture does)."""

    def __init__(self, scale: float = 0.0, seed=None):
        if not np.isfinite(scale) or scale < 0:
            raise ValueError(f"routing noise scale {scale!r} must be a finite number >= 0")
        self.scale = float(scale)
        self.rng = np.random.default_rng(seed)

    def route(self, logits, top_k, renorm, idx_out, w_out):
        # logits (T,E) f32 -> idx_out (T,A) i32, w_out (T,A) f32
        z = logits.astype(np.float64)
        probs = np.exp(z - z.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)                              # (T,E)
        noisy = z + self.scale * self.rng.gumbel(size=z.shape)                 # (T,E)
        idx = np.argsort(-noisy, axis=1, kind="stable")[:, :top_k]             # (T,A)
        w = np.take_along_axis(probs, idx, axis=1)                             # (T,A)
        if renorm:
            w /= w.sum(axis=1, keepdims=True)
        idx_out[...] = idx
        w_out[...] = w


def swiglu(x, w1, w3, w2, ws, out):
    # x (T,D) -> out (T,D) = w2 @ (silu(w1 @ x) * (w3 @ x)); w1,w3 (F,D), w2 (D,F)
    T, F = x.shape[0], w1.shape[0]
    g, u = ws.ffn_rows(T, F)                                                   # (T,F) (T,F)
    ws.mm(x, w1, g)
    ws.mm(x, w3, u)
    K.silu_mul(g, u, g)
    ws.mm(g, w2, out)
    return out


def moe(layer, x, ws, out, noise=None, trace=None, stream=None):
    """x (T,D) normed hidden -> out (T,D) = sum_a w_a * expert_a(x) [+ shared expert]. stream: with weights larger
    than their budget, a residency.ReadAhead's stream(active, n), through which a step's experts run n at a time
    while the next ones are read (T > 1; a decode token's few experts were all asked for at once)."""
    T = x.shape[0]
    E, A = layer.gate.shape[0], layer.top_k
    logits = ws.router[:T, :E]                                                 # (T,E)
    idx, wts = ws.route_idx[:T, :A], ws.route_w[:T, :A]                       # (T,A) i32, (T,A) f32
    general = layer.b1 is not None          # GPT-OSS: biased experts and its clamped SwiGLU (config: both or neither)
    if T == 1 and ws.threads == 1 and trace is None and (noise is None or noise.scale <= 0) and layer.rule is None \
            and layer.gate_b is None and not general and not layer.sparsemixer and not is_block(layer.w1):
        # decode: router, top-k and the experts in one Numba call (kernels/decode), same kernels
        if hasattr(layer.w1, "q"):
            KD.moe_quant(layer.gate, layer.w1.q, layer.w1.s, layer.w3.q, layer.w3.s, layer.w2.q, layer.w2.s, x[0],
                         A, layer.renorm, logits, idx, wts, ws.h1, ws.h3, out[0], ws.xs[0], ws.xi[0],
                         ws.no_block_scratch)
        else:
            KD.moe_float(layer.gate, kernel_array(layer.w1), kernel_array(layer.w3), kernel_array(layer.w2), x[0], A,
                         layer.renorm, logits, idx, wts, ws.h1, ws.h3, out[0], ws.no_block_scratch)
        return _shared_expert(layer, x, ws, out)
    if T == 1:
        K.matvec(layer.gate, x[0], logits[0])                                  # (E,D) f32: BLAS costs more to call
    else:
        ws.mm(x, layer.gate, logits)
    if layer.gate_b is not None:    # GPT-OSS: the router's logits are W x + b
        logits += layer.gate_b
    if layer.rule is not None:      # version-2 routing (sigmoid, correction bias, groups, scale)
        K.route_rule(logits, A, layer.rule, layer.corr_bias, idx, wts)
    elif layer.sparsemixer:         # Phi-MoE
        K.route_sparsemixer(logits, layer.sparsemixer, idx, wts)
    elif noise is not None and noise.scale > 0:
        noise.route(logits, A, layer.renorm, idx, wts)
    else:
        K.route(logits, A, layer.renorm, idx, wts)
    if trace is not None:
        trace.append((idx.copy(), wts.copy()))
    if general and T == 1 and ws.threads == 1 and not hasattr(layer.w1, "q") and not is_block(layer.w1):
        # GPT-OSS decode on one thread: its biased experts in one Numba call, as the loop below adds them
        KD.experts_biased(kernel_array(layer.w1), kernel_array(layer.w3), kernel_array(layer.w2), layer.b1, layer.b3,
                          layer.b2, idx[0], wts[0], x[0], layer.swiglu[0], layer.swiglu[1], ws.h1, ws.h3,
                          ws.expert_out[0], out[0], ws.xs[0], ws.xi[0], ws.no_block_scratch)
        return _shared_expert(layer, x, ws, out)
    if T > 1 or general:
        counts, offsets, order = ws.counts[:E], ws.offsets[:E + 1], ws.order[:T * A]
        K.group_by_expert(idx, E, counts, offsets, order)
        active = np.flatnonzero(counts)
        if not general and ws.experts_in_one_call(layer, T, len(active)):
            # a serving step's (or a short prompt's) experts in one Numba call (kernels/rowgemm.experts_rows)
            Y = ws.expert_rows(T * A)                                          # (T*A,D) one row per choice
            w1, w3, w2 = kernel_array(layer.w1), kernel_array(layer.w3), kernel_array(layer.w2)
            if stream is None and ws.threads == 1:
                RG.experts_rows(w1, w3, w2, x, order, offsets, A, Y)
            else:
                for part in _parts(stream, active, ws.threads):
                    RG.experts_rows_par(w1, w3, w2, x, order, offsets, A, Y, part)
            RG.weighted_rows(Y, wts, out)
            return _shared_expert(layer, x, ws, out)
        if not general and ws.block_experts_in_one_call(layer):
            # the same for block-kind experts (kernels/experts_blocks): a few rows each through the small-T product
            Y = ws.expert_rows(T * A)
            w1, w3, w2 = layer.w1, layer.w3, layer.w2
            for part in _parts(stream, active, ws.threads):
                KEB.experts_rows_blocks(w1.raw, w1.ggml, w3.raw, w3.ggml, w2.raw, w2.ggml, x, order, offsets, A, Y, part,
                                        ws.block_tmps(max(w1.shape[1], w1.shape[2])))
            RG.weighted_rows(Y, wts, out)
            return _shared_expert(layer, x, ws, out)
        if not general and ws.quant_experts_in_one_call(layer):
            # the same for q8/q4 experts (kernels/experts_q): the matvec's or the integer GEMM's row groups
            Y = ws.expert_rows(T * A)
            w1, w3, w2 = layer.w1, layer.w3, layer.w2
            for part in _parts(stream, active, ws.threads):
                KX.experts_rows_q(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, x, order, offsets, A, Y, part,
                                  ws.xs[:ws.threads], ws.xi[:ws.threads])
            RG.weighted_rows(Y, wts, out)
            return _shared_expert(layer, x, ws, out)
    out[...] = 0.0
    if T == 1 and not general and ws.threads > 1 and is_block(layer.w1):
        ws.experts_blocks(layer, idx[0], wts[0], x[0], out[0])
        return _shared_expert(layer, x, ws, out)
    if T == 1 and not general:
        for a in range(A):
            ws.expert(layer.w1, layer.w3, layer.w2, int(idx[0, a]), x[0], float(wts[0, a]), out[0])
    else:
        I = layer.w1.shape[1]
        for e in itertools.chain.from_iterable(_parts(stream, active, 1)):
            flat = order[offsets[e]:offsets[e + 1]]                            # (c,) positions t*A + a
            tok = flat // A                                                    # (c,) token rows, unique
            c = tok.shape[0]
            xe = ws.gather[:c]                                                 # (c,D)
            np.take(x, tok, axis=0, out=xe)
            (g, u), y = ws.ffn_rows(c, I), ws.expert_out[:c]                  # (c,I) (c,I) (c,D)
            ws.mm(xe, layer.w1[e], g)
            ws.mm(xe, layer.w3[e], u)
            if general:
                K.swiglu_clamped(g, u, layer.b1[e], layer.b3[e], layer.swiglu[0], layer.swiglu[1], g)
            else:
                K.silu_mul(g, u, g)
            ws.mm(g, layer.w2[e], y)
            if layer.b2 is not None:
                y += layer.b2[e]
            y *= wts.reshape(-1)[flat][:, None]                                # (c,D) scaled by routing weight
            out[tok] += y
    return _shared_expert(layer, x, ws, out)


def _parts(stream, active, n):
    """The experts that got rows (active, ascending) n at a time through stream (moe's), else all at once."""
    return (active,) if stream is None else stream(active, n)


def _shared_expert(layer, x, ws, out):
    """out (T,D) += the shared expert of x (Qwen2-MoE), gated; out unchanged without one."""
    T = x.shape[0]
    if layer.shared_w1 is not None:
        s = ws.shared_out[:T]                                                  # (T,D)
        swiglu(x, layer.shared_w1, layer.shared_w3, layer.shared_w2, ws, s)
        if layer.shared_gate is not None:                                      # Qwen2-MoE; DeepSeek/GLM: ungated
            g = layer.shared_gate[0]                                           # (D,) f32
            for t in range(T):
                s[t] *= K.shared_gate_scale(x[t], g)
        out += s
    return out
