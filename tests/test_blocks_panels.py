"""kernels/blocks_panels: the tiles' panels laid out by register transposes equal the layout written out in numpy
(every byte of the 16 rows, the k-quants' values unpacked to bytes, the unpacked scales and mins, the f16 factors), for a middle tile and the matrix's last."""
from __future__ import annotations

import numpy as np
import pytest
from blocks_data import Q, quantized

from colibri_server.model.kernels import blocks_panels as KP

R = KP.R


def _dwords(rows, lo, hi):
    """(R, nb, (hi-lo)/4) int32 of bytes lo..hi of each block, as the panel's order: [(b*w + q)*R + r]."""
    return np.ascontiguousarray(rows[:, :, lo:hi]).view("<i4").transpose(1, 2, 0).ravel()


def _f16(rows, o):
    return np.ascontiguousarray(rows[:, :, o:o + 2]).view(np.float16)[..., 0].astype(np.float32).T.ravel()


def _k_ref(rows, five):
    sc = rows[:, :, 4:16].astype(np.int32)
    s, m = [], []
    for j in range(8):
        if j < 4:
            s.append(sc[..., j] & 63)
            m.append(sc[..., j + 4] & 63)
        else:
            s.append((sc[..., j + 4] & 15) | ((sc[..., j - 4] >> 2) & 48))
            m.append((sc[..., j + 4] >> 4) | ((sc[..., j] >> 2) & 48))
    SC = np.stack(s, axis=2).transpose(1, 2, 0).ravel()
    MN = np.stack([m[2 * p] | (m[2 * p + 1] << 16) for p in range(4)], axis=2).transpose(1, 2, 0).ravel()
    qs = 48 if five else 16
    q, qh = rows[:, :, qs:qs + 128].astype(np.uint8), rows[:, :, 16:48].astype(np.uint8)
    vals = []                               # sub-block j's 32 values: a nibble (+ 16 for Q5_K's fifth bit j)
    for j in range(8):
        v = (q[:, :, 32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2))) & 15
        vals.append(v | (((qh >> j) & 1) << 4) if five else v)
    return _dwords(np.concatenate(vals, axis=2), 0, 256), SC, MN, _f16(rows, 0), _f16(rows, 2)


def _b32_ref(rows, nibbles):
    nd = 4 if nibbles else 8
    P = _dwords(rows, 2, 2 + 4 * nd)
    return (P if nibbles else P ^ np.int32(-0x7F7F7F80)), _f16(rows, 0)


def _q6_ref(rows):
    s = rows[:, :, 192:208].view(np.int8).astype(np.int32)
    SC = s.transpose(1, 2, 0).ravel()
    SP = np.stack([(s[..., 2 * p] & 0xFFFF) | (s[..., 2 * p + 1] << 16) for p in range(8)], axis=2).transpose(1, 2, 0).ravel()
    ql, qh = rows[:, :, 0:128].astype(np.uint8), rows[:, :, 128:192].astype(np.uint8)
    vals = []                               # values 128h + 32c + i: 4 bits of ql, 2 of qh (dequantize_row_q6_K)
    for h in range(2):
        for c in range(4):
            lo = (ql[:, :, 64 * h + 32 * (c % 2):64 * h + 32 * (c % 2) + 32] >> (4 * (c // 2))) & 15
            vals.append(lo | (((qh[:, :, 32 * h:32 * h + 32] >> (2 * c)) & 3) << 4))
    return _dwords(np.concatenate(vals, axis=2), 0, 256), SC, SP, _f16(rows, 208)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda k: k.name)
def test_the_transposed_panel_is_the_tiles_layout(kind):
    rng = np.random.default_rng(3)
    d, n = 40, 768
    nb = n // (32 if int(kind) in (int(Q.Q8_0), int(Q.Q4_0)) else 256)
    raw = quantized(rng.standard_normal((d, n)).astype(np.float32) * 0.05, kind, seed=9)
    raw = np.ascontiguousarray(raw)
    for r0 in (16, d - R):                  # a middle tile; the last rows of the matrix (its end: no read beyond)
        rows = raw[r0:r0 + R].reshape(R, nb, -1)
        if int(kind) in (int(Q.Q8_0), int(Q.Q4_0)):
            nibbles = int(kind) == int(Q.Q4_0)
            got = (np.zeros(nb * (4 if nibbles else 8) * R, np.int32), np.zeros(nb * R, np.float32))
            KP.prep_b32(raw, r0, nb, nibbles, *got)
            want = _b32_ref(rows, nibbles)
        elif int(kind) == int(Q.Q6_K):
            got = (np.zeros(nb * 64 * R, np.int32), np.zeros(nb * 16 * R, np.int32), np.zeros(nb * 8 * R, np.int32),
                   np.zeros(nb * R, np.float32))
            KP.prep_q6_k(raw, r0, nb, *got)
            want = _q6_ref(rows)
        else:
            five = int(kind) == int(Q.Q5_K)
            got = (np.zeros(nb * 64 * R, np.int32), np.zeros(nb * 8 * R, np.int32), np.zeros(nb * 4 * R, np.int32),
                   np.zeros(nb * R, np.float32), np.zeros(nb * R, np.float32))
            KP.prep_q45_k(raw, r0, nb, five, *got)
            want = _k_ref(rows, five)
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None:
                assert np.array_equal(g.view(np.uint32), np.asarray(w, g.dtype).view(np.uint32)), (r0, i)
