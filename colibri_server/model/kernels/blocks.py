"""Numba kernels for llama.cpp's block kinds (the table: ..blocks; layouts: docs/format.md).

A block matrix is raw (d, row bytes) uint8, each row n/B blocks as the GGUF holds them; `kind` is
the GGML type id. Three things here:

* dequantizers, one per kind (deq_row: one row -> f32), bit for bit what the `gguf` package's
  dequantize gives (the same float32 operations in the same order, no fused multiply-add);
* the activations rounded once per row the way llama.cpp rounds them for its integer dots
  (quant_acts): int8 in blocks of 32 with one f32 scale each (Q8_0's rounding, for every kind:
  the k-quants' sub-blocks are 32 or 16 weights, so a 32-block scale folds into the sub-block's
  scale with no extra work, finer than Q8_K's one scale per 256), and the int32 sum of every 16
  rounded values (the offsets and minimums of Q4_0, Q4_1, Q5_*, Q4_K, Q2_K, Q6_K are folded through
  them);
* dots of one weight row with a rounded activation row: integer products accumulated in int32
  per sub-block, scaled by f32 once per sub-block (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), and for the other
  kinds the row dequantized to f32 and dotted with the f32 activations (the generic path).

Every product (batch-1 matvec, a serving step's rows, prefill, experts) goes through these row dots
or, for many rows of Q4_K / Q6_K, through kernels/blocks_gemm's tiles, which compute the same integers
and float operations: the same row and activation row give the same bits whatever the caller. The
output head's products (a kind id + ACTS16) round the activations to int16 instead: kernels/blocks_wide.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_link import by_reference
from .base import _REDUCE_FM, to_f32
from .blocks_ir import (
    HAVE_VBMI,
    kblock_q4_k,
    kblock_q5_k,
    kblock_q6_k,
)
from .blocks_row32 import acts_q4_0_swizzle, row_q4_0, row_q4_0_sw, row_q8_0
from .blocks_rows8 import ROWS, rows8_q4_k, rows8_q5_k, rows8_q6_k
from .quant_ir import _absmax, _bits_f32, _round

QB = 32          # activations per rounding block
ACTS16 = 256     # added to a kind's id: its activations rounded to int16, not int8 (the output head, whose two best
                 # logits can be near enough for the int8 rounding to swap them: kernels/blocks_wide)
SB = 16          # activations per int32 sum
X16 = 128        # added to Q4_K's / Q6_K's id: the matrix stored as tiles of X16_ROWS rows (to_x16, kernels/blocks_x16)
X16_ROWS = 16

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS, MXFP4 = 20, 23, 39
FAST = (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)    # the kinds with integer dots
KROUND = (Q4_K, Q5_K, Q6_K)                   # activations rounded per 256 (quant_acts_k), integer sums per block

_KV_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
_KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q2_K: (256, 84),
         Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_NL: (32, 18),
         IQ4_XS: (256, 136), MXFP4: (32, 17)}


@njit(cache=True, inline="always")
def _f16(r, o):
    return to_f32(np.uint16(np.uint16(r[o]) | (np.uint16(r[o + 1]) << np.uint16(8))))


@njit(cache=True, inline="always")
def _k_scale_min(sc, j):
    # Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes sc
    if j < 4:
        return np.int32(sc[j]) & 63, np.int32(sc[j + 4]) & 63
    return ((np.int32(sc[j + 4]) & 15) | ((np.int32(sc[j - 4]) >> 2) & 48),
            (np.int32(sc[j + 4]) >> 4) | ((np.int32(sc[j]) >> 2) & 48))


# ---------------------------------------------------------------------------- dequantizers

@by_reference          # linked by reference (model/numba_link): one copy of each kernel below, not one per caller
@njit(cache=True)
def deq_row(kind, r, y):
    # r (row bytes,) u8 one row of blocks of GGML type `kind` (+ ACTS16 or not) -> y (n,) f32
    kind = kind & (ACTS16 - 1)
    n = y.shape[0]
    if kind == Q8_0:
        for b in range(n // 32):
            o = b * 34
            d = _f16(r, o)
            for k in range(32):
                y[b * 32 + k] = np.float32(np.int8(r[o + 2 + k])) * d
    elif kind == Q4_0 or kind == IQ4_NL or kind == MXFP4:
        sz = 17 if kind == MXFP4 else 18
        for b in range(n // 32):
            o = b * sz
            if kind == MXFP4:
                e = np.int32(r[o])
                d = _bits_f32(np.int32(0x00200000 << e) if e < 2 else np.int32((e - 1) << 23))
                o += 1
            else:
                d = _f16(r, o)
                o += 2
            for k in range(16):
                lo = np.int32(r[o + k]) & 15
                hi = np.int32(r[o + k]) >> 4
                if kind == Q4_0:
                    y[b * 32 + k] = d * np.float32(lo - 8)
                    y[b * 32 + 16 + k] = d * np.float32(hi - 8)
                elif kind == IQ4_NL:
                    y[b * 32 + k] = d * _KV_IQ4[lo]
                    y[b * 32 + 16 + k] = d * _KV_IQ4[hi]
                else:
                    y[b * 32 + k] = d * _KV_MXFP4[lo]
                    y[b * 32 + 16 + k] = d * _KV_MXFP4[hi]
    elif kind == Q4_1:
        for b in range(n // 32):
            o = b * 20
            d = _f16(r, o)
            m = _f16(r, o + 2)
            for k in range(16):
                y[b * 32 + k] = d * np.float32(np.int32(r[o + 4 + k]) & 15) + m
                y[b * 32 + 16 + k] = d * np.float32(np.int32(r[o + 4 + k]) >> 4) + m
    elif kind == Q5_0 or kind == Q5_1:
        sz = 22 if kind == Q5_0 else 24
        for b in range(n // 32):
            o = b * sz
            d = _f16(r, o)
            m = _f16(r, o + 2) if kind == Q5_1 else np.float32(0.0)
            h0 = o + 2 if kind == Q5_0 else o + 4
            qh = np.uint32(r[h0]) | (np.uint32(r[h0 + 1]) << 8) | (np.uint32(r[h0 + 2]) << 16) \
                | (np.uint32(r[h0 + 3]) << 24)
            for k in range(32):
                byte = np.int32(r[h0 + 4 + (k & 15)])
                q = (byte & 15 if k < 16 else byte >> 4) | (np.int32((qh >> np.uint32(k)) & np.uint32(1)) << 4)
                if kind == Q5_0:
                    y[b * 32 + k] = d * np.float32(q - 16)
                else:
                    y[b * 32 + k] = d * np.float32(q) + m
    elif kind == Q2_K:
        for b in range(n // 256):
            o = b * 84
            d = _f16(r, o + 80)
            dmin = _f16(r, o + 82)
            for p in range(256):
                g = p // 16
                dl = d * np.float32(np.int32(r[o + g]) & 15)
                ml = dmin * np.float32(np.int32(r[o + g]) >> 4)
                h, s, k = p // 128, (p // 32) % 4, p % 32
                q = (np.int32(r[o + 16 + h * 32 + k]) >> (2 * s)) & 3
                y[b * 256 + p] = dl * np.float32(q) - ml
    elif kind == Q3_K:
        for b in range(n // 256):
            o = b * 110
            d = _f16(r, o + 108)
            for p in range(256):
                g = p // 16
                lsc = (np.int32(r[o + 96 + g]) & 15) if g < 8 else (np.int32(r[o + 96 + g - 8]) >> 4)
                hsc = (np.int32(r[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
                dl = d * np.float32((lsc | (hsc << 4)) - 32)
                h, s, k = p // 128, (p // 32) % 4, p % 32
                ql = (np.int32(r[o + 32 + h * 32 + k]) >> (2 * s)) & 3
                hb = (np.int32(r[o + k]) >> (p // 32)) & 1
                y[b * 256 + p] = dl * np.float32(ql - ((hb ^ 1) << 2))
    elif kind == Q4_K or kind == Q5_K:
        sz = 144 if kind == Q4_K else 176
        for b in range(n // 256):
            o = b * sz
            d = _f16(r, o)
            dmin = _f16(r, o + 2)
            sc = r[o + 4:o + 16]
            qs = o + 16 if kind == Q4_K else o + 48
            for j in range(8):
                s, m = _k_scale_min(sc, j)
                dj = d * np.float32(s)
                mj = dmin * np.float32(m)
                c, sh = j // 2, 4 * (j % 2)
                for k in range(32):
                    q = (np.int32(r[qs + c * 32 + k]) >> sh) & 15
                    if kind == Q5_K:
                        q |= ((np.int32(r[o + 16 + k]) >> j) & 1) << 4
                    y[b * 256 + j * 32 + k] = dj * np.float32(q) - mj
    elif kind == Q6_K:
        for b in range(n // 256):
            o = b * 210
            d = _f16(r, o + 208)
            for p in range(256):
                h, c, k = p // 128, (p // 32) % 4, p % 32
                ql = (np.int32(r[o + h * 64 + (c % 2) * 32 + k]) >> (4 * (c // 2))) & 15
                qh = (np.int32(r[o + 128 + h * 32 + k]) >> (2 * c)) & 3
                dl = d * np.float32(np.int8(r[o + 192 + p // 16]))
                y[b * 256 + p] = dl * np.float32((ql | (qh << 4)) - 32)
    elif kind == IQ4_XS:
        for b in range(n // 256):
            o = b * 136
            d = _f16(r, o)
            sh = np.int32(r[o + 2]) | (np.int32(r[o + 3]) << 8)
            for j in range(8):
                lo = (np.int32(r[o + 4 + j // 2]) >> (4 * (j % 2))) & 15
                hi = (sh >> (2 * j)) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                for k in range(16):
                    byte = np.int32(r[o + 8 + j * 16 + k])
                    y[b * 256 + j * 32 + k] = dl * _KV_IQ4[byte & 15]
                    y[b * 256 + j * 32 + 16 + k] = dl * _KV_IQ4[byte >> 4]


@njit(cache=True, nogil=True)
def rows_to_f32_blocks(raw, kind, r0, r1, out):
    # raw (d, row bytes) u8 -> out (r1-r0, n) f32: rows r0..r1 dequantized
    for i in range(r0, r1):
        deq_row(kind, raw[i], out[i - r0])


def to_x16(raw: np.ndarray, size: int) -> np.ndarray:
    """Rows of blocks of `size` bytes (Q4_K's 144, Q6_K's 210; raw (..., d, row bytes), d a multiple of 16) -> the same
    bytes as 16-row tiles (Q4_K_X16, Q6_K_X16): in a tile, block b is the transpose of its 16 rows' block b taken as
    size // 4 dwords (dword q of row r at dword 16q + r of the tile's block), then the rows' last size % 4 bytes
    (Q6_K's d) row after row (kernels/blocks_x16)."""
    n, w = raw.shape[-1], size // 4
    b = np.ascontiguousarray(raw).reshape(-1, X16_ROWS, n // size, size)
    head = np.ascontiguousarray(b[..., :4 * w]).view(np.uint32).transpose(0, 2, 3, 1)
    tail = b[..., 4 * w:].transpose(0, 2, 1, 3)
    tiles = np.concatenate([np.ascontiguousarray(head).view(np.uint8).reshape(head.shape[:2] + (-1,)),
                            tail.reshape(tail.shape[:2] + (-1,))], axis=2)
    return np.ascontiguousarray(tiles).reshape(raw.shape)


def from_x16(raw: np.ndarray, size: int) -> np.ndarray:
    """to_x16's inverse: 16-row tiles of blocks of `size` bytes -> the rows."""
    n, w = raw.shape[-1], size // 4
    t = np.ascontiguousarray(raw).reshape(-1, n // size, X16_ROWS * size)
    head = np.ascontiguousarray(t[..., :64 * w]).view(np.uint32).reshape(t.shape[:2] + (w, X16_ROWS))
    tail = t[..., 64 * w:].reshape(t.shape[:2] + (X16_ROWS, size - 4 * w))
    rows = np.concatenate([np.ascontiguousarray(head.transpose(0, 3, 1, 2)).view(np.uint8),
                           tail.transpose(0, 2, 1, 3)], axis=3)
    return np.ascontiguousarray(rows).reshape(raw.shape)


def dequantize_ref(raw: np.ndarray, kind: int, n: int) -> np.ndarray:
    """numpy: every row of raw (..., row bytes) dequantized -> (..., n) f32 (through deq_row)."""
    if kind & X16 and kind < ACTS16:
        raw, kind = from_x16(raw, BLOCK[kind - X16][1]), kind - X16
    flat = np.ascontiguousarray(raw).reshape(-1, raw.shape[-1])
    out = np.empty((flat.shape[0], n), np.float32)
    rows_to_f32_blocks(flat, kind, 0, flat.shape[0], out)
    return out.reshape(raw.shape[:-1] + (n,))


# ---------------------------------------------------------------------------- activations

@njit(cache=True, inline="always")
def quant_acts(x, xq, xd, xs):
    # x (n,) f32 -> xq (n,) i8 = round(x / d_b) per 32-block b, xd (n/32,) f32 = d_b = max|x_b| / 127,
    # xs (n/16,) i32 = sums of 16 consecutive xq
    for b in range(x.shape[0] // QB):
        xd[b] = _round_block(x[b * QB:(b + 1) * QB], xq[b * QB:(b + 1) * QB], xs, 2 * b)


@njit(cache=True, inline="always")
def _round_block(x, xq, xs, g0):
    # one rounding block x (m,) f32 -> xq (m,) i8 = round(x / d), xs[g0 + g] = the sums of xq's 16-groups; returns
    # d = max|x| / 127 (NaN when x holds a NaN, so it reaches the products). Each step is its own loop so that each
    # vectorises (one loop rounding, storing and summing stayed scalar: 2.0 against 0.4 ns a value), and the scale
    # is stored by the caller (stored here, the loops were scalar again)
    d = _absmax(x) / np.float32(127.0)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    for k in range(x.shape[0]):
        xq[k] = np.int8(_round(x[k] * inv))
    for g in range(x.shape[0] // SB):
        s = np.int32(0)
        for k in range(g * SB, g * SB + SB):
            s += np.int32(xq[k])
        xs[g0 + g] = s
    return d


# ---------------------------------------------------------------------------- dots

@njit(cache=True, fastmath=_REDUCE_FM)
def _dot_f32(y, x):
    s = np.float32(0.0)
    for k in range(x.shape[0]):
        s += y[k] * x[k]
    return s


@njit(cache=True, inline="always")
def _dot_q8_0(r, x, xq, xd, xs, v):
    return row_q8_0(r, xq, xd, xs, x.shape[0] // 32)


@njit(cache=True, inline="always")
def _dot_q4_0(r, x, xq, xd, xs, v):
    return row_q4_0(r, xq, xd, xs, x.shape[0] // 32)


@njit(cache=True, inline="always")
def _dot_q4_k(r, x, xq, xd, xs, v):
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        acc = kblock_q4_k(r, b * 144, xq, xd, xs, b, acc)
    return acc


@njit(cache=True, inline="always")
def _dot_q5_k(r, x, xq, xd, xs, v):
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        acc = kblock_q5_k(r, b * 176, xq, xd, xs, b, acc)
    return acc


@njit(cache=True, inline="always")
def _dot_q6_k(r, x, xq, xd, xs, v):
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        acc = kblock_q6_k(r, b * 210, xq, xd, xs, b, acc)
    return acc


@njit(cache=True)
def row_dot(kind, r, x, xq, xd, xs, tmp):
    # one weight row r (row bytes,) u8 . activations x (n,) f32 (rounded: xq, xd, xs) -> f32; tmp (n,) f32 scratch
    # (the integer kinds: its first 8 floats are the vector accumulator, summed once at the end of the row)
    if kind == Q8_0:
        return _dot_q8_0(r, x, xq, xd, xs, tmp[:16])
    if kind == Q4_0:
        return _dot_q4_0(r, x, xq, xd, xs, tmp[:16])
    if kind == Q4_K:
        return _dot_q4_k(r, x, xq, xd, xs, tmp[:16])
    if kind == Q6_K:
        return _dot_q6_k(r, x, xq, xd, xs, tmp[:16])
    if kind == Q5_K:
        return _dot_q5_k(r, x, xq, xd, xs, tmp[:16])
    y = tmp[:x.shape[0]]
    deq_row(kind, r, y)
    return _dot_f32(y, x)


@njit(cache=True, inline="always")
def _put2(out, t, i, v, alpha, accumulate):
    if accumulate:
        out[t, i] += alpha * v
    else:
        out[t, i] = alpha * v


# one loop per integer kind, so that its dot is inlined (a kind chosen per row costs 2.5x on Q8_0)
@njit(cache=True)
def _rows_q8_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    v = tmp[:16]
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot_q8_0(raw[i], X[t], Xq[t], Xd[t], Xs[t], v), alpha, accumulate)


@njit(cache=True)
def _rows_q4_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    n, T = X.shape[1], X.shape[0]
    w = n // 4        # f32 words of one row's swizzled activations (blocks_row32.row_q4_0_sw)
    if HAVE_VBMI and n >= 256 and tmp.shape[0] >= 16 + T * w:
        for t in range(T):
            acts_q4_0_swizzle(Xq[t], tmp[16 + t * w:16 + (t + 1) * w], n // 256)
        for i in range(i0, i1):
            for t in range(T):
                _put2(out, t, i, row_q4_0_sw(raw[i], Xq[t], tmp[16 + t * w:16 + (t + 1) * w], Xd[t], Xs[t], n // 32),
                      alpha, accumulate)
        return
    v = tmp[:16]
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot_q4_0(raw[i], X[t], Xq[t], Xd[t], Xs[t], v), alpha, accumulate)


@njit(cache=True)
def _rows_q4_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    v = tmp[:16]
    if X.shape[0] == 1:         # a decode token: 8 rows at a time (kernels/blocks_rows8), the rest one by one
        while i0 + ROWS <= i1:
            rows8_q4_k(raw, i0, Xq[0], Xd[0], Xs[0], X.shape[1] // 256, v)
            for r in range(ROWS):
                _put2(out, 0, i0 + r, v[r], alpha, accumulate)
            i0 += ROWS
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot_q4_k(raw[i], X[t], Xq[t], Xd[t], Xs[t], v), alpha, accumulate)


@njit(cache=True)
def _rows_q5_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    v = tmp[:16]
    if X.shape[0] == 1:         # a decode token: 8 rows at a time (kernels/blocks_rows8), the rest one by one
        while i0 + ROWS <= i1:
            rows8_q5_k(raw, i0, Xq[0], Xd[0], Xs[0], X.shape[1] // 256, v)
            for r in range(ROWS):
                _put2(out, 0, i0 + r, v[r], alpha, accumulate)
            i0 += ROWS
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot_q5_k(raw[i], X[t], Xq[t], Xd[t], Xs[t], v), alpha, accumulate)


@njit(cache=True)
def _rows_q6_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    v = tmp[:16]
    if X.shape[0] == 1:         # a decode token: 8 rows at a time (kernels/blocks_rows8), the rest one by one
        while i0 + ROWS <= i1:
            rows8_q6_k(raw, i0, Xq[0], Xd[0], Xs[0], X.shape[1] // 256, v)
            for r in range(ROWS):
                _put2(out, 0, i0 + r, v[r], alpha, accumulate)
            i0 += ROWS
    for i in range(i0, i1):
        for t in range(X.shape[0]):
            _put2(out, t, i, _dot_q6_k(raw[i], X[t], Xq[t], Xd[t], Xs[t], v), alpha, accumulate)


@by_reference
@njit(cache=True)
def _rows(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # out[t, i] (=|+=) alpha * raw[i] . X[t] for rows i0..i1 and every t (each weight row read once for all t)
    if kind == Q8_0:
        _rows_q8_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
    elif kind == Q4_0:
        _rows_q4_0(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
    elif kind == Q4_K:
        _rows_q4_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
    elif kind == Q5_K:
        _rows_q5_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
    elif kind == Q6_K:
        _rows_q6_k(raw, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
    else:
        y = tmp[:X.shape[1]]
        for i in range(i0, i1):
            deq_row(kind, raw[i], y)
            for t in range(X.shape[0]):
                _put2(out, t, i, _dot_f32(y, X[t]), alpha, accumulate)


@njit(cache=True, inline="always")
def quant_acts_k(x, xq, xd, xs):
    # x (n,) f32 -> xq (n,) i8 = round(x / d_b) per 256-block b (llama.cpp's Q8_K rounding, for the k-quants
    # whose sums are integer over a whole block: KROUND), xd[b] = d_b = max|x_b| / 127, xs (n/16,) i32 as quant_acts
    for b in range(x.shape[0] // 256):
        xd[b] = _round_block(x[b * 256:(b + 1) * 256], xq[b * 256:(b + 1) * 256], xs, 16 * b)


@njit(cache=True, inline="always")
def _kround(kind):
    return kind == Q4_K or kind == Q5_K or kind == Q6_K or kind == Q4_K + X16 or kind == Q6_K + X16


@by_reference
@njit(cache=True)
def round_rows(kind, X, Xq, Xd, Xs):
    # every row of X (T, n) rounded for kind into Xq (T, n) i8, Xd (T, n/32) f32, Xs (T, n/16) i32 (quant_acts, or
    # quant_acts_k for the KROUND kinds: their scales in Xd[:, :n/256]); nothing for kind + ACTS16 (blocks_wide's)
    if kind & ACTS16:
        return
    for t in range(X.shape[0]):
        if _kround(kind):
            quant_acts_k(X[t], Xq[t], Xd[t], Xs[t])
        else:
            quant_acts(X[t], Xq[t], Xd[t], Xs[t])


def matmul_blocks_ref(raw, kind, X):
    """numpy: X (T,n) @ the dequantized W.T in float64 -> (T,d) f32."""
    W = dequantize_ref(raw, kind, X.shape[1]).astype(np.float64)
    return (np.asarray(X, np.float64) @ W.T).astype(np.float32)


@njit(cache=True)
def embed_blocks(raw, kind, tokens, out):
    # raw (V, row bytes) u8 token embedding of GGML type kind, tokens (T,) i64 -> out (T, D) f32 (rows dequantized)
    for t in range(tokens.shape[0]):
        deq_row(kind, raw[tokens[t]], out[t])
