"""Attention over a paged KV cache: the keys and values of many sequences in one pool of blocks.

A pool layer is (NB, Hkv, BS, hd): NB blocks of BS positions, f32, or f16 stored as uint16 bits.
A sequence owns a block table (its blocks in position order): position p lives in block
table[p // BS] at offset p % BS. A serving step's rows belong to several sequences; each row
carries the index of its sequence's table and its absolute position, so one call attends every
row of the step (decode tokens and prefill chunks alike), causally, with an optional sliding
window, grouped-query (H/Hkv query heads per kv head), each query head's keys read in place.

Values may be narrower than keys (out's head dim below hd): latent attention (model/mla.py) caches one
row per position, the latent and the rotary key, and passes the key pool as the value pool too: a
row's values are the first out.shape[-1] dims of its key row.

write_kv stores the step's new keys and values at their rows' slots first, so a prefill chunk's
rows see each other (positions < their own) like the contiguous cache's attention does.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .base import _REDUCE_FM, _max_finite, expf, to_f32

__all__ = ["write_kv", "paged_attention", "paged_attention_par", "paged_attention_ref", "to_f16_bits"]


@intrinsic
def _f32_to_f16_bits(typingctx, v):
    """float32 -> IEEE half bits (uint16), round to nearest even (fptrunc)."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))

    return types.uint16(types.float32), codegen


def to_f16_bits(x: np.ndarray) -> np.ndarray:
    """numpy twin of the f16 store: float32 -> uint16 half bits."""
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def _put_row(src, dst):
    """src (hd,) f32 -> dst (hd,): f32, or uint16 f16 bits (Numba specialises on dst's type)."""
    dst[:] = src.astype(np.float16).view(np.uint16) if dst.dtype == np.uint16 else src


@overload(_put_row, inline="always")
def _put_row_overload(src, dst):
    if dst.dtype == types.uint16:
        def put_f16(src, dst):
            for c in range(src.shape[0]):
                dst[c] = _f32_to_f16_bits(src[c])
        return put_f16

    def put(src, dst):
        for c in range(src.shape[0]):
            dst[c] = src[c]
    return put


@njit(cache=True)
def write_kv(k, v, kpool, vpool, blocks, offsets):
    # k, v (N,Hkv,hd) f32 -> kpool/vpool (NB,Hkv,BS,hd) at [blocks[r], :, offsets[r]] for every row r
    for r in range(k.shape[0]):
        b, o = blocks[r], offsets[r]
        for kh in range(k.shape[1]):
            _put_row(k[r, kh], kpool[b, kh, o])
            _put_row(v[r, kh], vpool[b, kh, o])


@njit(cache=True, fastmath=_REDUCE_FM, error_model="numpy")
def _attend_row(q, kpool, vpool, table, p, window, scale, out, sc, acc, sinks):
    # q (H,hd) one row at position p -> out (H,dv), dv <= hd the first dims of each value row;
    # table (>= p//BS + 1,) its sequence's blocks; sc (>= H/Hkv * (p+1),) f32 and acc (H/Hkv, dv) f32
    # scratch; sinks (H,) f32 per-head logits in each softmax's sum (GPT-OSS), or size 0
    _attend_heads(q, kpool, vpool, table, p, window, scale, out, sc, acc, sinks, 0, q.shape[0])


@njit(cache=True, fastmath=_REDUCE_FM, error_model="numpy")
def _attend_heads(q, kpool, vpool, table, p, window, scale, out, sc, acc, sinks, hlo, hhi):
    # _attend_row for the query heads hlo..hhi-1 only. Per kv head, its query heads of the range together:
    # each key and value row is read (and converted from f16) once for them, as kernels/attn does for the
    # contiguous cache (latent attention's 16-128 heads share one kv head). A head's result does not
    # depend on the range it is computed in.
    H, hd = q.shape
    dv = out.shape[1]
    Hkv, BS = kpool.shape[1], kpool.shape[2]
    group_all = H // Hkv
    lo = 0
    if window > 0:
        lo = max(0, p - window + 1)
    n = p + 1 - lo
    row = np.empty(hd, np.float32)
    for kh in range(hlo // group_all, (hhi - 1) // group_all + 1):
        h0 = max(hlo, kh * group_all)
        group = min(hhi, (kh + 1) * group_all) - h0
        S = sc[:group * n].reshape((group, n))
        for j in range(n):
            pos = lo + j
            kr = kpool[table[pos // BS], kh, pos % BS]
            for c in range(hd):
                row[c] = to_f32(kr[c])
            for g in range(group):
                qh = q[h0 + g]
                a = np.float32(0.0)
                for c in range(hd):
                    a += qh[c] * row[c]
                S[g, j] = np.float32(scale) * a
        for g in range(group):
            s = S[g]
            m = _max_finite(s)
            if sinks.shape[0] > 0 and sinks[h0 + g] > m:
                m = sinks[h0 + g]
            tot = np.float32(0.0)
            for j in range(n):
                e = expf(s[j] - m)
                s[j] = e
                tot += e
            if sinks.shape[0] > 0:
                tot += expf(sinks[h0 + g] - m)
            inv = np.float32(1.0) / tot
            for j in range(n):
                s[j] *= inv
            for c in range(dv):
                acc[g, c] = 0.0
        for j in range(n):
            pos = lo + j
            vr = vpool[table[pos // BS], kh, pos % BS]
            for c in range(dv):
                row[c] = to_f32(vr[c])
            for g in range(group):
                w = S[g, j]
                ag = acc[g]
                for c in range(dv):
                    ag[c] += w * row[c]
        for g in range(group):
            o = out[h0 + g]
            ag = acc[g]
            for c in range(dv):
                o[c] = ag[c]


@njit(cache=True)
def _checked(q, kpool, vpool, out, tables, row_pos):
    # the shapes' checks of both entry points; returns the positions the longest row attends to
    if q.shape[1] % kpool.shape[1] != 0:
        raise ValueError("paged attention: H must be a multiple of Hkv")
    if q.shape[2] != kpool.shape[3] or out.shape[2] > vpool.shape[3]:
        raise ValueError("paged attention: head dims of q, the pools and out disagree")
    maxp = 1
    for r in range(q.shape[0]):
        maxp = max(maxp, row_pos[r] + 1)
    if (maxp + kpool.shape[2] - 1) // kpool.shape[2] > tables.shape[1]:
        raise ValueError("paged attention: a position beyond its block table")
    return maxp


@njit(cache=True)
def paged_attention(q, kpool, vpool, tables, row_seq, row_pos, window, scale, out, sinks):
    # q (N,H,hd) f32 rows of a step, kpool/vpool (NB,Hkv,BS,hd), tables (S,maxb) i32 block tables,
    # row_seq (N,) index into tables, row_pos (N,) absolute positions -> out (N,H,dv), dv <= hd
    N, H, hd = q.shape
    maxp = _checked(q, kpool, vpool, out, tables, row_pos)
    group = H // kpool.shape[1]
    sc = np.empty(group * maxp, np.float32)
    acc = np.empty((group, out.shape[2]), np.float32)
    for r in range(N):
        _attend_row(q[r], kpool, vpool, tables[row_seq[r]], row_pos[r], window, scale, out[r], sc, acc, sinks)


@njit(cache=True, parallel=True)
def paged_attention_par(q, kpool, vpool, tables, row_seq, row_pos, window, scale, out, sinks, threads):
    # paged_attention with the rows split over Numba threads, and with fewer rows than `threads` (one
    # sequence decoding) each row's heads split too; the same bits: rows and heads are independent
    N, H, hd = q.shape
    _checked(q, kpool, vpool, out, tables, row_pos)
    group = H // kpool.shape[1]
    chunks = 1 if N >= threads else min(H, (threads + N - 1) // N)
    per = (H + chunks - 1) // chunks
    for i in prange(N * chunks):
        r, c = i // chunks, i % chunks
        hlo, hhi = c * per, min(H, (c + 1) * per)
        if hhi <= hlo:
            continue
        sc = np.empty(group * (row_pos[r] + 1), np.float32)
        acc = np.empty((group, out.shape[2]), np.float32)
        _attend_heads(q[r], kpool, vpool, tables[row_seq[r]], row_pos[r], window, scale, out[r], sc, acc, sinks,
                      hlo, hhi)


def paged_attention_ref(q, kpool, vpool, tables, row_seq, row_pos, window, scale, dv=None, sinks=None):
    """numpy twin, float64 inside; dv: the value dims (default all of vpool's)."""
    N, H, hd = q.shape
    dv = vpool.shape[3] if dv is None else dv
    Hkv, BS = kpool.shape[1], kpool.shape[2]
    group = H // Hkv

    def f32(a):
        return a.view(np.float16).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)
    out = np.zeros((N, H, dv), np.float32)
    for r in range(N):
        p = int(row_pos[r])
        lo = max(0, p - window + 1) if window > 0 else 0
        pos = np.arange(lo, p + 1)
        blk = np.asarray(tables[row_seq[r]])[pos // BS]
        for h in range(H):
            K = f32(kpool[blk, h // group, pos % BS])                           # (n,hd)
            V = f32(vpool[blk, h // group, pos % BS])[:, :dv]
            s = K @ q[r, h].astype(np.float64) * scale
            sink = -np.inf if sinks is None or len(sinks) == 0 else float(sinks[h])
            m = max(s.max(), sink)
            w = np.exp(s - m)
            out[r, h] = (w / (w.sum() + np.exp(sink - m))) @ V
    return out
