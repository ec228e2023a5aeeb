"""The MoE kernels: the SwiGLU expert (one matvec per weight, or split across Numba threads),
top-k routing and the grouping of prefill tokens by expert, each with its numpy twin.
Conventions: base.py; the package's face re-exports them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..numba_link import by_reference
from .base import expf, nrows, row_slice
from .dense import _matvec_core, matvec_ref

__all__ = ["silu_mul", "silu_mul_ref", "expert_ffn", "expert_ffn_ref", "matvec_par", "matvec_qkv_par",
           "expert_ffn_par",
           "route", "route_ref", "route_rule", "route_rule_ref", "RULE_RENORM", "RULE_SIGMOID", "RULE_GROUPS",
           "group_by_expert", "group_by_expert_ref"]


# ---------------------------------------------------------------------------
# SwiGLU pieces
# ---------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")   # no ZeroDivision check: it blocks vectorisation
def silu_mul(g, u, out):
    # g (T,I), u (T,I) f32 -> out (T,I) = g / (1 + exp(-g)) * u; out may be g (in place) or apart
    T, I = g.shape
    one = np.float32(1.0)
    inplace = out.ctypes.data == g.ctypes.data
    for t in range(T):
        if inplace:
            # LLVM's overlap check fails when out is g, and its fallback is the scalar loop
            # (measured: 50 ns an element in prefill); the in-place loop has no such check
            _silu_mul_1d(g[t], u[t])
            continue
        gt = g[t]
        ut = u[t]
        ot = out[t]
        for j in range(I):
            gv = gt[j]
            ot[j] = gv / (one + expf(-gv)) * ut[j]


def silu_mul_ref(g, u, out=None):
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        r = (g / (np.float32(1.0) + np.exp(-g)) * u).astype(np.float32)
    if out is not None:
        out[...] = r
    return r


@by_reference          # Phi-MoE's routing, as route below: compiled once, not into each MoE kernel
@njit(cache=True, error_model="numpy")
def route_sparsemixer(logits, eps, idx, w):
    # Phi-MoE's sparsemixer at inference: logits (T,E) f32 -> idx (T,2) i32, w (T,2) f32. The best expert i1
    # (the lower index on a tie), its weight a softmax over the experts j with (z1 - z_j) / max(|z_j|, z1) <= 2 eps;
    # then the best i2 of the others, its weight a softmax over the others within 2 eps of it the same way
    T, E = logits.shape
    two = np.float32(2.0) * np.float32(eps)
    for t in range(T):
        z = logits[t]
        i1 = 0
        for j in range(1, E):
            if z[j] > z[i1]:
                i1 = j
        i2 = 1 if i1 == 0 else 0
        for j in range(E):
            if j != i1 and z[j] > z[i2]:
                i2 = j
        for a in range(2):
            best = i1 if a == 0 else i2
            m = z[best]
            tot = np.float32(0.0)
            for j in range(E):
                if a == 1 and j == i1:
                    continue
                if (m - z[j]) / max(abs(z[j]), m) > two:
                    continue
                tot += np.float32(np.exp(z[j] - m))
            idx[t, a] = best
            w[t, a] = np.float32(1.0) / tot


@njit(cache=True, error_model="numpy")
def swiglu_clamped(g, u, b1, b3, alpha, limit, out):
    # GPT-OSS's expert activation: g, u (T,I) f32 the gate and up projections without their biases
    # b1, b3 (I,) -> out (T,I) = (min(max(u + b3, -limit), limit) + 1) * gc * sigmoid(alpha * gc),
    # gc = min(g + b1, limit); out may be g
    T, I = g.shape
    one = np.float32(1.0)
    a, lim = np.float32(alpha), np.float32(limit)
    for t in range(T):
        gt = g[t]
        ut = u[t]
        ot = out[t]
        for j in range(I):
            gv = min(gt[j] + b1[j], lim)
            uv = min(max(ut[j] + b3[j], -lim), lim)
            ot[j] = (uv + one) * (gv / (one + expf(-a * gv)))


def swiglu_clamped_ref(g, u, b1, b3, alpha, limit):
    gv = np.minimum(g.astype(np.float64) + b1, limit)
    uv = np.clip(u.astype(np.float64) + b3, -limit, limit)
    return ((uv + 1) * gv / (1 + np.exp(-alpha * gv))).astype(np.float32)


@njit(cache=True, error_model="numpy")   # no ZeroDivision check: it blocks vectorisation
def _silu_mul_1d(g, u):
    # g (I,) f32 in place = silu(g) * u
    one = np.float32(1.0)
    for j in range(g.shape[0]):
        gv = g[j]
        g[j] = gv / (one + expf(-gv)) * u[j]


@njit(cache=True)
def expert_ffn(w1, w3, w2, e, x, weight, h1, h3, out):
    # w1,w3 (E,I,D), w2 (E,D,I) any, x (D,) f32 -> out (D,) += weight * w2[e] @ (silu(w1[e]@x) * (w3[e]@x)); h1,h3 (I,) scratch
    one = np.float32(1.0)
    _matvec_core(w1[e], x, h1, one, np.bool_(False))
    _matvec_core(w3[e], x, h3, one, np.bool_(False))
    _silu_mul_1d(h1, h3)
    _matvec_core(w2[e], h1, out, np.float32(weight), np.bool_(True))


@njit(cache=True)
def shared_gate_scale(x, g):
    # Qwen2-MoE's shared-expert gate for one token: sigmoid(g . x), x, g (D,) f32 (one summation order for
    # the general path and the fused token)
    a = np.float32(0.0)
    for j in range(x.shape[0]):
        a += x[j] * g[j]
    return np.float32(1.0) / (np.float32(1.0) + np.float32(np.exp(-a)))


@njit(cache=True, inline="always")
def chunk_rows(c, d, nchunks):
    # rows r0..r1 of chunk c when d rows are split in nchunks (boundaries multiples of 8)
    r0 = (c * d // nchunks) // 8 * 8
    r1 = d if c == nchunks - 1 else ((c + 1) * d // nchunks) // 8 * 8
    return r0, r1


@by_reference          # the float matvec on threads: compiled once, not into each caller
@njit(cache=True, parallel=True)
def _matvec_par(W, x, out, nchunks, alpha, accumulate):
    # W (d,n) any or panels, x (n,) -> out (d,) = alpha * W@x (+=), rows split in nchunks (multiples of 8)
    d = nrows(W)
    for c in prange(nchunks):
        r0, r1 = chunk_rows(c, d, nchunks)
        if r1 > r0:
            _matvec_core(row_slice(W, r0, r1), x, out[r0:r1], alpha, accumulate)


@njit(cache=True, parallel=True)
def matvec_qkv_par(W0, W1, W2, x, out, nchunks):
    # three float matrices (or panels) of one n, x (n,) -> out = their stacked rows @ x (decode's q|k|v):
    # each chunk takes its share of every matrix's rows, one region for the three
    d0, d1, d2 = nrows(W0), nrows(W1), nrows(W2)
    one = np.float32(1.0)
    for c in prange(nchunks):
        r0, r1 = chunk_rows(c, d0, nchunks)
        if r1 > r0:
            _matvec_core(row_slice(W0, r0, r1), x, out[r0:r1], one, np.bool_(False))
        r0, r1 = chunk_rows(c, d1, nchunks)
        if r1 > r0:
            _matvec_core(row_slice(W1, r0, r1), x, out[d0 + r0:d0 + r1], one, np.bool_(False))
        r0, r1 = chunk_rows(c, d2, nchunks)
        if r1 > r0:
            _matvec_core(row_slice(W2, r0, r1), x, out[d0 + d1 + r0:d0 + d1 + r1], one, np.bool_(False))


@njit(cache=True)
def matvec_par(W, x, out, nchunks):
    # matvec with the rows split in nchunks run by Numba threads (threads > 1 only)
    _matvec_par(W, x, out, nchunks, np.float32(1.0), np.bool_(False))


@njit(cache=True, parallel=True)
def _matvec_pair_par(W1, W3, x, h1, h3, nchunks):
    # h1 = W1@x and h3 = W3@x (W1, W3 (d,n)) in ONE parallel region of 2*nchunks row chunks:
    # a workqueue launch costs ~50 us here, so launches are counted
    d = nrows(W1)
    for c2 in prange(2 * nchunks):
        r0, r1 = chunk_rows(c2 % nchunks, d, nchunks)
        if r1 > r0:
            if c2 < nchunks:
                _matvec_core(row_slice(W1, r0, r1), x, h1[r0:r1], np.float32(1.0), np.bool_(False))
            else:
                _matvec_core(row_slice(W3, r0, r1), x, h3[r0:r1], np.float32(1.0), np.bool_(False))


@njit(cache=True)
def expert_ffn_par(w1, w3, w2, e, x, weight, h1, h3, out, nchunks):
    # expert_ffn on Numba threads: two parallel regions (w1 and w3 together, then w2)
    _matvec_pair_par(w1[e], w3[e], x, h1, h3, nchunks)
    _silu_mul_1d(h1, h3)
    _matvec_par(w2[e], h1, out, nchunks, np.float32(weight), np.bool_(True))


def expert_ffn_ref(w1, w3, w2, e, x, weight, out):
    """Returns out + weight * ffn(x) (does not modify out)."""
    g = matvec_ref(w1[e], x)
    u = matvec_ref(w3[e], x)
    h = silu_mul_ref(g[None], u[None])[0]
    return (out + np.float32(weight) * matvec_ref(w2[e], h)).astype(np.float32)


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------


@by_reference          # routing, called by every MoE kernel: compiled once, not into each caller (model/numba_link)
@njit(cache=True)
def route(logits, top_k, renorm, idx_out, w_out):
    # logits (T,E) f32 -> idx_out (T,k) i32, w_out (T,k) f32: top-k of softmax (desc, ties -> lower index), renorm optional
    T, E = logits.shape
    if top_k < 1 or top_k > E:
        raise ValueError("route: top_k must be in 1..E")
    for t in range(T):
        row = logits[t]
        m = row[0]
        for e in range(1, E):
            if row[e] > m:
                m = row[e]
        tot = np.float32(0.0)
        for e in range(E):
            tot += np.exp(row[e] - m)
        inv = np.float32(1.0) / tot
        # selection on the probabilities: slot s takes the largest (p, -index)
        # strictly after slot s-1 in the order (p desc, index asc)
        pv = np.float32(np.inf)
        pi = -1
        wsum = np.float32(0.0)
        for s in range(top_k):
            bi = -1
            bv = np.float32(0.0)
            for e in range(E):
                v = np.exp(row[e] - m) * inv
                if v < pv or (v == pv and e > pi):
                    if bi < 0 or v > bv:
                        bi = e
                        bv = v
            idx_out[t, s] = bi
            w_out[t, s] = bv
            wsum += bv
            pv = bv
            pi = bi
        if renorm:
            for s in range(top_k):
                w_out[t, s] = w_out[t, s] / wsum


# route_rule's rule: float32 [flags, n_group, topk_group, routed_scale] (docs/format.md, version 2)
RULE_RENORM, RULE_SIGMOID, RULE_GROUPS = 1, 2, 4


@by_reference          # as route
@njit(cache=True)
def route_rule(logits, top_k, rule, bias, idx_out, w_out):
    # logits (T,E) f32 -> idx_out (T,k) i32, w_out (T,k) f32 under a version-2 routing rule:
    # scores s = softmax(z) or sigmoid(z); choice on c = s + bias (bias (E,) or size 0: the
    # selection-only correction of DeepSeek-V3 / GLM-4.5), within the topk_group best of n_group
    # consecutive groups when RULE_GROUPS (a group's score: its 2 largest c under sigmoid, its
    # largest under softmax); weights s[chosen], / (sum + 1e-20) when RULE_RENORM, * routed_scale.
    # Ties go to the lower index, in groups and experts.
    T, E = logits.shape
    flags = int(rule[0])
    n_group, topk_group, scale = int(rule[1]), int(rule[2]), np.float32(rule[3])
    if top_k < 1 or top_k > E:
        raise ValueError("route_rule: top_k must be in 1..E")
    groups = (flags & RULE_GROUPS) != 0
    if groups and (n_group < 2 or E % n_group != 0 or topk_group < 1 or topk_group > n_group):
        raise ValueError("route_rule: bad n_group / topk_group")
    gsize = E // n_group if groups else E
    sig = (flags & RULE_SIGMOID) != 0
    s = np.empty(E, np.float32)
    c = np.empty(E, np.float32)
    allowed = np.empty(E, np.bool_)
    taken = np.empty(E, np.bool_)
    gscore = np.empty(max(n_group, 1), np.float32)
    gtaken = np.empty(max(n_group, 1), np.bool_)
    for t in range(T):
        row = logits[t]
        if sig:
            for e in range(E):
                s[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[e]))
        else:
            m = row[0]
            for e in range(1, E):
                if row[e] > m:
                    m = row[e]
            tot = np.float32(0.0)
            for e in range(E):
                s[e] = np.exp(row[e] - m)
                tot += s[e]
            inv = np.float32(1.0) / tot
            for e in range(E):
                s[e] = s[e] * inv
        for e in range(E):
            c[e] = s[e] + bias[e] if bias.shape[0] else s[e]
            allowed[e] = not groups
            taken[e] = False
        if groups:
            for g in range(n_group):
                b1 = np.float32(-np.inf)
                b2 = np.float32(-np.inf)
                for e in range(g * gsize, (g + 1) * gsize):
                    if c[e] > b1:
                        b2 = b1
                        b1 = c[e]
                    elif c[e] > b2:
                        b2 = c[e]
                gscore[g] = b1 + b2 if sig else b1
                gtaken[g] = False
            for _ in range(topk_group):
                bg = -1
                for g in range(n_group):
                    if not gtaken[g] and (bg < 0 or gscore[g] > gscore[bg]):
                        bg = g
                gtaken[bg] = True
                for e in range(bg * gsize, (bg + 1) * gsize):
                    allowed[e] = True
        wsum = np.float32(0.0)
        for a in range(top_k):
            bi = -1
            for e in range(E):
                if allowed[e] and not taken[e] and (bi < 0 or c[e] > c[bi]):
                    bi = e
            taken[bi] = True
            idx_out[t, a] = bi
            w_out[t, a] = s[bi]
            wsum += s[bi]
        for a in range(top_k):
            w = w_out[t, a]
            if flags & RULE_RENORM:
                w = w / (wsum + np.float32(1e-20))
            w_out[t, a] = w * scale


def route_rule_ref(logits, top_k, rule, bias):
    """numpy twin of route_rule (the reference the tests compare it with)."""
    z = np.asarray(logits, np.float32)
    flags, n_group, topk_group, scale = int(rule[0]), int(rule[1]), int(rule[2]), np.float32(rule[3])
    if flags & RULE_SIGMOID:
        s = (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    else:
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        s = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    c = s + np.asarray(bias, np.float32) if len(bias) else s.copy()
    if flags & RULE_GROUPS:
        T, E = c.shape
        cg = c.reshape(T, n_group, E // n_group)
        top = -np.sort(-cg, axis=-1)
        gs = top[..., 0] + top[..., 1] if flags & RULE_SIGMOID else top[..., 0]
        keep = np.argsort(-gs, axis=-1, kind="stable")[:, :topk_group]
        mask = np.zeros((T, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        c = np.where(np.repeat(mask, E // n_group, axis=-1), c, -np.inf)
    idx = np.argsort(-c, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(s, idx, axis=-1)
    if flags & RULE_RENORM:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return idx, (w * scale).astype(np.float32)


def route_ref(logits, top_k, renorm):
    """Returns (idx (T,k) int32, w (T,k) float32)."""
    logits = np.asarray(logits, np.float32)
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p = (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)
    # stable sort of -p: descending probability, ties by ascending index
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(p, idx, axis=-1)
    if renorm:
        w = (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)
    return idx, w.astype(np.float32)


@njit(cache=True)
def group_by_expert(idx, E, counts, offsets, order):
    # idx (T,k) i32, E -> counts (E,) i64, offsets (E+1,) i64, order (T*k,) i64: stable counting sort of flat t*k+s by expert
    T, k = idx.shape
    for e in range(E):
        counts[e] = 0
    for t in range(T):
        for s in range(k):
            e = idx[t, s]
            if e < 0 or e >= E:
                raise ValueError("group_by_expert: expert index out of range")
            counts[e] += 1
    offsets[0] = 0
    for e in range(E):
        offsets[e + 1] = offsets[e] + counts[e]
        counts[e] = 0  # reused as the fill cursor, restored by the fill below
    for t in range(T):
        for s in range(k):
            e = idx[t, s]
            order[offsets[e] + counts[e]] = t * k + s
            counts[e] += 1


def group_by_expert_ref(idx, E):
    """Returns (counts, offsets, order) as int64 arrays."""
    flat = np.asarray(idx).reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=E).astype(np.int64)
    offsets = np.zeros(E + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    order = np.argsort(flat, kind="stable").astype(np.int64)
    return counts, offsets, order
