"""The paged KV cache's layout, its store (write_kv) and attention's numpy twin over it; the attention
kernel itself is kernels/tiled.

A pool layer is (NB, Hkv, BS, hd): NB blocks of BS positions, f32, or f16 stored as uint16 bits.
A sequence owns a block table (its blocks in position order): position p lives in block
table[p // BS] at offset p % BS. A serving step's rows belong to several sequences; each row
carries the index of its sequence's table and its absolute position, so one call attends every
row of the step (decode tokens and prefill chunks alike), causally, with an optional sliding
window, grouped-query (H/Hkv query heads per kv head), each query head's keys read in place
(kernels/tiled: query blocks against tiles of keys).

Values may be narrower than keys (out's head dim below hd): latent attention (model/mla.py) caches one
row per position, the latent and the rotary key, and passes the key pool as the value pool too: a
row's values are the first out.shape[-1] dims of its key row.

write_kv stores the step's new keys and values at their rows' slots first, so a prefill chunk's
rows see each other (positions < their own) like the contiguous cache's attention does.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["write_kv", "paged_attention_ref", "to_f16_bits"]


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


def paged_attention_ref(q, kpool, vpool, tables, row_seq, row_pos, window, scale, dv=None, sinks=None):
    """numpy twin of kernels/tiled's attention, float64 inside; dv: the value dims (default all of vpool's)."""
    N, H, hd = q.shape
    dv = vpool.shape[3] if dv is None else dv
    Hkv, BS = kpool.shape[1], kpool.shape[2]
    group = H // Hkv

    def f64(a):
        return a.view(np.float16).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)
    seqs = {}                                   # a sequence's keys and values in position order, (Hkv,P,d)
    out = np.zeros((N, H, dv), np.float32)
    for r in range(N):
        p, s = int(row_pos[r]), int(row_seq[r])
        if s not in seqs or seqs[s][0].shape[1] <= p:
            P = int(row_pos[row_seq == s].max()) + 1
            blk = np.asarray(tables[s])[np.arange(P) // BS]
            seqs[s] = (f64(kpool[blk, :, np.arange(P) % BS]).transpose(1, 0, 2),
                       f64(vpool[blk, :, np.arange(P) % BS]).transpose(1, 0, 2)[:, :, :dv])
        K, V = seqs[s]
        lo = max(0, p - window + 1) if window > 0 else 0
        qr = q[r].astype(np.float64).reshape(Hkv, group, hd)
        sc = qr @ K[:, lo:p + 1].transpose(0, 2, 1) * scale                      # (Hkv,g,n)
        sink = np.full((Hkv, group, 1), -np.inf) if sinks is None or len(sinks) == 0 else \
            np.asarray(sinks, np.float64).reshape(Hkv, group, 1)
        m = np.maximum(sc.max(axis=2, keepdims=True), sink)
        w = np.exp(sc - m)
        out[r] = ((w @ V[:, lo:p + 1]) / (w.sum(axis=2, keepdims=True) + np.exp(sink - m))).reshape(H, dv)
    return out
