"""Numba encoders of llama.cpp's k-quants (Q4_K, Q5_K, Q6_K) from f32 rows, with a numpy twin.

`quantize_k(ggml, x, out)` writes the blocks of the rows x (R, n) into out (R, n/256 x block bytes),
rows over threads. The search is llama.cpp's (ggml-quants.c, without an importance matrix): per
sub-block of 32 (Q4_K, Q5_K: levels 0..15 / 0..31 with a minimum, make_qkx2_quants) or of 16 (Q6_K:
levels -32..31, make_qx_quants with weights x^2) a scale fitted by weighted least squares over a few
candidate grids; then the sub-block scales at 6 bits (Q4_K, Q5_K) or 8 bits (Q6_K) against the
super-block's f16 scale, and the levels again against the stored scales. Every operation is float32 in
llama.cpp's order (no fused multiply-add), so the bytes equal llama-quantize's on the same values.

`quantize_k_ref` is the twin: the same search in numpy over many sub-blocks at once (the tests hold the
kernel, the twin and llama.cpp's own library to the same bytes).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .base import _f16_bits_to_f32
from .paged import _f32_to_f16_bits

Q4_K, Q5_K, Q6_K = 12, 13, 14
SIZE = {Q4_K: 144, Q5_K: 176, Q6_K: 210}      # bytes per block of 256
_F = np.float32


# ---------------------------------------------------------------------------- the kernel

@njit(cache=True, inline="always")
def _near(v):
    return np.int32(np.rint(v))


@njit(cache=True)
def _qkx2(x, w, L, Laux, nmax, rmin, rdelta, nstep):
    """One sub-block: levels 0..nmax into L, -> (scale, -min)."""
    n = x.shape[0]
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > _F(0):
        mn = _F(0)
    if mx == mn:
        L[:] = 0
        return _F(0), -mn
    iscale = _F(nmax) / (mx - mn)
    scale = _F(1) / iscale
    best = _F(0)
    for i in range(n):
        q = min(nmax, max(0, _near(iscale * (x[i] - mn))))
        L[i] = q
        d = scale * _F(q) + mn - x[i]
        best += w[i] * (d * d)
    for s in range(nstep + 1):
        iscale = (rmin + rdelta * _F(s) + _F(nmax)) / (mx - mn)
        sl, sl2, sxl = _F(0), _F(0), _F(0)
        for i in range(n):
            q = min(nmax, max(0, _near(iscale * (x[i] - mn))))
            Laux[i] = q
            wl = w[i] * _F(q)
            sl += wl
            sl2 += wl * _F(q)
            sxl += wl * x[i]
        D = sum_w * sl2 - sl * sl
        if D > _F(0):
            ts = (sum_w * sxl - sum_x * sl) / D
            tm = (sl2 * sum_x - sl * sxl) / D
            if tm > _F(0):
                tm = _F(0)
                ts = sxl / sl2
            cur = _F(0)
            for i in range(n):
                d = ts * _F(Laux[i]) + tm - x[i]
                cur += w[i] * (d * d)
            if cur < best:
                L[:] = Laux
                best, scale, mn = cur, ts, tm
    return scale, -mn


@njit(cache=True)
def _qx(x, L, nmax):
    """One Q6_K sub-block: levels 0..2*nmax-1 into L, -> scale."""
    n = x.shape[0]
    amax, mx = _F(0), _F(0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax, mx = abs(x[i]), x[i]
    if amax < _F(1e-15):
        L[:] = 0
        return _F(0)
    best, scale = _F(0), _F(0)
    for t in range(-1, 18):             # t = -1: the plain grid; then -9..9 tenths, 0 skipped
        s = t - 9 if t < 9 else t - 8
        iscale = _F(-nmax) / mx if t < 0 else -(_F(nmax) + _F(0.1) * _F(s)) / mx
        slx, sl2 = _F(0), _F(0)
        for i in range(n):
            q = min(nmax - 1, max(-nmax, _near(iscale * x[i])))
            w = x[i] * x[i]
            slx += w * x[i] * _F(q)
            sl2 += w * _F(q) * _F(q)
        if t < 0:
            scale = slx / sl2 if sl2 != _F(0) else _F(0)
            best = scale * slx
        elif not (sl2 > _F(0) and slx * slx > best * sl2):
            continue
        else:
            scale = slx / sl2
            best = scale * slx
        for i in range(n):
            L[i] = min(nmax - 1, max(-nmax, _near(iscale * x[i]))) + nmax
    return scale


@njit(cache=True)
def _k45_block(x, o, nmax, rmin, nstep, L, Laux, w, scales, mins):
    """One Q4_K (nmax 15) or Q5_K (nmax 31) block of 256 values into o's bytes."""
    ms, mm = _F(0), _F(0)
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sx2 = _F(0)
        for i in range(32):
            sx2 += sub[i] * sub[i]
        av = np.sqrt(sx2 / _F(32))
        for i in range(32):
            w[i] = av + abs(sub[i])
        sc, m = _qkx2(sub, w, L[32 * j:32 * j + 32], Laux, nmax, rmin, _F(0.1), nstep)
        scales[j], mins[j] = sc, m
        ms = max(ms, sc)
        mm = max(mm, m)
    inv_s = _F(63) / ms if ms > _F(0) else _F(0)
    inv_m = _F(63) / mm if mm > _F(0) else _F(0)
    hd, hm = _f32_to_f16_bits(ms / _F(63)), _f32_to_f16_bits(mm / _F(63))
    o[0], o[1], o[2], o[3] = hd & 0xFF, hd >> 8, hm & 0xFF, hm >> 8
    d, dmin = _f16_bits_to_f32(hd), _f16_bits_to_f32(hm)
    sc = o[4:16]
    sc[:] = 0
    for j in range(8):
        ls = min(63, _near(inv_s * scales[j]) & 0xFF)
        lm = min(63, _near(inv_m * mins[j]) & 0xFF)
        if j < 4:
            sc[j] = ls
            sc[j + 4] = lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
        dd = d * _F(ls)
        if dd == _F(0):
            continue
        dm = dmin * _F(lm)
        for i in range(32):
            L[32 * j + i] = min(nmax, max(0, _near((x[32 * j + i] + dm) / dd)))
    if nmax == 15:
        for c in range(4):
            for i in range(32):
                o[16 + 32 * c + i] = L[64 * c + i] | (L[64 * c + 32 + i] << 4)
    else:
        qh = o[16:48]
        qh[:] = 0
        for c in range(4):
            for i in range(32):
                lo, hi = L[64 * c + i], L[64 * c + 32 + i]
                qh[i] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
                o[48 + 32 * c + i] = (lo & 0xF) | ((hi & 0xF) << 4)


@njit(cache=True)
def _q6_block(x, o, L, scales):
    """One Q6_K block of 256 values into o's 210 bytes: ql[128], qh[64], scales[16] (int8), d (f16)."""
    mx, amx = _F(0), _F(0)
    for j in range(16):
        scales[j] = _qx(x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], 32)
        if abs(scales[j]) > amx:
            amx, mx = abs(scales[j]), scales[j]
    o[:] = 0
    if amx < _F(1e-15):
        return
    iscale = _F(-128) / mx
    hd = _f32_to_f16_bits(_F(1) / iscale)
    o[208], o[209] = hd & 0xFF, hd >> 8
    d = _f16_bits_to_f32(hd)
    for j in range(16):
        q = np.int8(min(127, _near(iscale * scales[j])))
        o[192 + j] = np.uint8(q)
        dd = d * _F(q)
        if dd == _F(0):
            continue
        for i in range(16):
            L[16 * j + i] = min(31, max(-32, _near(x[16 * j + i] / dd))) + 32
    for h in range(2):
        for i in range(32):
            a, b = L[128 * h + i], L[128 * h + 32 + i]
            c, e = L[128 * h + 64 + i], L[128 * h + 96 + i]
            o[64 * h + i] = (a & 0xF) | ((c & 0xF) << 4)
            o[64 * h + 32 + i] = (b & 0xF) | ((e & 0xF) << 4)
            o[128 + 32 * h + i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)


@njit(cache=True, parallel=True)
def quantize_k(ggml, x, out):
    """x (R, n) f32, n a multiple of 256 -> out (R, n/256 x SIZE[ggml]) uint8, rows over threads."""
    R, n = x.shape
    nb = n // 256
    size = 144 if ggml == Q4_K else (176 if ggml == Q5_K else 210)
    for r in prange(R):
        L = np.empty(256, np.int32)
        Laux = np.empty(32, np.int32)
        w = np.empty(32, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(8, np.float32)
        for b in range(nb):
            xb = x[r, 256 * b:256 * b + 256]
            ob = out[r, size * b:size * b + size]
            if ggml == Q6_K:
                _q6_block(xb, ob, L, scales)
            elif ggml == Q4_K:
                _k45_block(xb, ob, 15, _F(-1.0), 20, L, Laux, w, scales, mins)
            else:
                _k45_block(xb, ob, 31, _F(-0.5), 15, L, Laux, w, scales, mins)


# ---------------------------------------------------------------------------- the numpy twin

def _rint(v) -> np.ndarray:
    """llama.cpp's nearest_int: round half to even of a float32."""
    return np.rint(v.astype(_F, copy=False)).astype(np.int32)


def _fp16(v) -> np.ndarray:
    """Through f16 and back (the block's stored super-scale)."""
    return v.astype(np.float16).astype(_F)


def _qkx2_ref(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants over B sub-blocks of n values: x, w (B, n) f32 -> (L (B, n) int32, scale (B,),
    -min (B,)): levels 0..nmax, a scale and a minimum <= 0 minimising the weighted squared error."""
    B, n = x.shape
    mn, mx = x.min(1), x.max(1)
    sum_w, sum_x = w[:, 0].copy(), w[:, 0] * x[:, 0]
    for i in range(1, n):
        sum_w += w[:, i]
        sum_x += w[:, i] * x[:, i]
    mn = np.minimum(mn, _F(0))
    flat = mx == mn
    mn0 = mn
    iscale = _F(nmax) / np.where(flat, _F(1), mx - mn)
    scale = _F(1) / iscale
    L = np.clip(_rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = np.zeros(B, _F)
    for i in range(n):
        d = scale * L[:, i].astype(_F) + mn - x[:, i]
        best += w[:, i] * (d * d)
    for step in range(nstep + 1):      # (the range is from the best minimum so far, as llama.cpp's)
        iscale = (_F(rmin) + _F(rdelta) * _F(step) + _F(nmax)) / np.where(flat, _F(1), mx - mn)
        La = np.clip(_rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = La.astype(_F)
        sl, sl2, sxl = np.zeros(B, _F), np.zeros(B, _F), np.zeros(B, _F)
        for i in range(n):
            wl = w[:, i] * lf[:, i]
            sl += wl
            sl2 += wl * lf[:, i]
            sxl += wl * x[:, i]
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, _F(1))
        ts = (sum_w * sxl - sum_x * sl) / Ds
        tm = (sl2 * sum_x - sl * sxl) / Ds
        pos = tm > 0
        tm = np.where(pos, _F(0), tm)
        ts = np.where(pos, sxl / np.where(sl2 > 0, sl2, _F(1)), ts)
        cur = np.zeros(B, _F)
        for i in range(n):
            d = ts * lf[:, i] + tm - x[:, i]
            cur += w[:, i] * (d * d)
        take = ok & (cur < best)
        L = np.where(take[:, None], La, L)
        best = np.where(take, cur, best)
        scale = np.where(take, ts, scale)
        mn = np.where(take, tm, mn)
    L = np.where(flat[:, None], 0, L)
    return L, np.where(flat, _F(0), scale), -np.where(flat, mn0, mn)


def _qx_ref(x, nmax: int):
    """make_qx_quants (rmse_type 1: weights x^2) over B sub-blocks: -> (L (B, n) int32 in 0..2*nmax-1, scale)."""
    B, n = x.shape
    idx = np.abs(x).argmax(1)
    mx = x[np.arange(B), idx]
    zero = np.abs(mx) < _F(1e-15)
    mxs = np.where(zero, _F(1), mx)

    def sums(iscale):
        lv = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(_F)
        slx, sl2 = np.zeros(B, _F), np.zeros(B, _F)
        for i in range(n):
            wv = x[:, i] * x[:, i]
            slx += wv * x[:, i] * lf[:, i]
            sl2 += wv * lf[:, i] * lf[:, i]
        return lv, slx, sl2

    L, slx, sl2 = sums(_F(-nmax) / mxs)
    scale = np.where(sl2 != 0, slx / np.where(sl2 != 0, sl2, _F(1)), _F(0))
    best = scale * slx
    for step in range(-9, 10):
        if step == 0:
            continue
        lv, slx, sl2 = sums(-(_F(nmax) + _F(0.1) * _F(step)) / mxs)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(take[:, None], lv, L)
        scale = np.where(take, slx / np.where(sl2 > 0, sl2, _F(1)), scale)
        best = np.where(take, scale * slx, best)
    return np.where(zero[:, None], -nmax, L) + nmax, np.where(zero, _F(0), scale)


def _k_scales(scales, mins):
    """The 8 sub-block scales and minimums of a q4_k/q5_k super-block at 6 bits: (d, dmin, ls, lm,
    packed (nb, 12) uint8)."""
    ms, mm = np.maximum(scales.max(1), 0), np.maximum(mins.max(1), 0)
    inv_s = np.where(ms > 0, _F(63) / np.where(ms > 0, ms, _F(1)), _F(0))
    inv_m = np.where(mm > 0, _F(63) / np.where(mm > 0, mm, _F(1)), _F(0))
    ls = np.minimum(_rint(inv_s[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_rint(inv_m[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    sc = np.zeros((scales.shape[0], 12), np.uint8)
    sc[:, 0:4], sc[:, 4:8] = ls[:, :4], lm[:, :4]
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    sc[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    sc[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return _F(ms) / _F(63), _F(mm) / _F(63), ls, lm, sc


def _k_levels(x, L, d, dmin, ls, lm, nmax):
    """The final levels of a q4_k/q5_k super-block against its stored scales (a zero scale keeps the search's)."""
    dd = _fp16(d)[:, None] * ls.astype(_F)                # (nb, 8)
    dm = _fp16(dmin)[:, None] * lm.astype(_F)
    xs = x.reshape(x.shape[0], 8, 32)
    safe = np.where(dd != 0, dd, _F(1))
    new = np.clip(_rint((xs + dm[:, :, None]) / safe[:, :, None]), 0, nmax)
    return np.where((dd != 0)[:, :, None], new, L.reshape(new.shape)).reshape(x.shape)


def _q45_k_ref(x, nmax, rmin, nstep):
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    sx2 = np.zeros(nb * 8, _F)
    for i in range(32):
        sx2 += sub[:, i] * sub[:, i]
    av = np.sqrt(sx2 / _F(32))
    w = av[:, None] + np.abs(sub)
    L, scales, mins = _qkx2_ref(sub, w, nmax, rmin, 0.1, nstep)
    d, dmin, ls, lm, sc = _k_scales(scales.reshape(nb, 8), mins.reshape(nb, 8))
    L = _k_levels(x, L.reshape(nb, 256), d, dmin, ls, lm, nmax)
    head = np.empty((nb, 2), np.float16)
    head[:, 0], head[:, 1] = d, dmin
    return head.view(np.uint8), sc, L.astype(np.uint8)


def _q4_k_ref(x):
    head, sc, L = _q45_k_ref(x, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, sc, qs], axis=1)


def _q5_k_ref(x):
    head, sc, L = _q45_k_ref(x, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32)
    lo, hi = q & 0xF, q >> 4
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for n in range(4):
        qh |= (hi[:, n, 0] << (2 * n)) | (hi[:, n, 1] << (2 * n + 1))
    return np.concatenate([head, sc, qh, qs], axis=1)


def _q6_k_ref(x):
    nb = x.shape[0]
    L, scales = _qx_ref(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    idx = np.abs(scales).argmax(1)
    ms = scales[np.arange(nb), idx]
    zero = np.abs(ms) < _F(1e-15)
    iscale = _F(-128) / np.where(zero, _F(1), ms)
    d = np.where(zero, _F(0), _F(1) / iscale).astype(np.float16)
    sc = np.minimum(_rint(iscale[:, None] * scales), 127).astype(np.int8)
    dd = d.astype(_F)[:, None] * sc.astype(_F)
    xs = x.reshape(nb, 16, 16)
    new = np.clip(_rint(xs / np.where(dd != 0, dd, _F(1))[:, :, None]), -32, 31) + 32
    L = np.where((dd != 0)[:, :, None], new, L.reshape(nb, 16, 16)).reshape(nb, 256).astype(np.uint8)
    L = np.where(zero[:, None], 0, L).astype(np.uint8)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    q = L.reshape(nb, 2, 4, 32)                      # [half of 128][quarter][32]
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.reshape(nb, 1).view(np.uint8)],
                          axis=1)


_REF = {Q4_K: _q4_k_ref, Q5_K: _q5_k_ref, Q6_K: _q6_k_ref}


def quantize_k_ref(ggml: int, x: np.ndarray) -> np.ndarray:
    """numpy: quantize_k's bytes for the rows x (R, n), over many sub-blocks at once."""
    R = x.shape[0]
    return _REF[ggml](np.ascontiguousarray(x, np.float32).reshape(-1, 256)).reshape(R, -1)
