"""Pure-numpy packing of weights, shared by the converter (model/convert.py, model/quant.py) and
the kernels' numpy twins: group quantization (q8, q4: layout in model/quant.py's docstring) and
float matrices in panels of PANEL columns (model/panels.py). No Numba here.
"""
from __future__ import annotations

import numpy as np

from ..format import PANEL

__all__ = ["GROUP", "CONVERT_GROUP", "PANEL", "quantize", "quantize_q8", "quantize_q4", "dequantize_q8",
           "dequantize_q4", "unpack_q4", "to_panels", "from_panels"]

GROUP = 32                     # default rows per scale of quantize_q8/q4 (config quant_group)
# The converter's rows per scale (config quant_group of new files). 64, not 32: the decode kernels fold
# a group's scales into the activations and requantize them once per group, and with VNNI that
# work costs as much as the dots at 32 rows. Measured on bench-mixtral (Zen 4, 1 thread), 32 -> 64:
# q4 decode 141 -> 148 tok/s, q8 78 -> 83, KL against f32 unchanged (q4 2.21e-2 -> 2.20e-2,
# q8 1.54e-3 -> 1.40e-3); 128 was faster still but lost quality (q4 KL 2.90e-2).
CONVERT_GROUP = 64
Q4_CANDIDATES = (1.0, 0.95, 0.9, 0.85, 0.8, 1.05)


# ---------------------------------------------------------------------------- quantize

def _f16(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return a.astype(np.float16)


def _grouped(w: np.ndarray, G: int) -> np.ndarray:
    """(..., d, n) -> (..., d/G, G, n) float32 view."""
    *lead, d, n = w.shape
    if d % G:
        raise ValueError(f"rows {d} are not a multiple of the group {G}")
    return np.asarray(w, np.float32).reshape(*lead, d // G, G, n)


def quantize_q8(w: np.ndarray, G: int = GROUP):
    """W (..., d, n) float -> (values int8 (..., d, n), scales uint16/f16 (..., d/G, n))."""
    wg = _grouped(w, G)                                                    # (..., g, G, n)
    amax = np.abs(wg).max(axis=-2)                                         # (..., g, n)
    s16 = _f16(amax / np.float32(127.0))
    s = s16.astype(np.float32)
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
    q = np.clip(np.rint(wg * inv[..., None, :]), -127, 127).astype(np.int8)
    return q.reshape(w.shape), s16.view(np.uint16)


def dequantize_q8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """numpy twin: values int8 (..., d, n), scales f16 bits (..., d/G, n) -> float32 (..., d, n)."""
    *lead, d, n = q.shape
    G = d // s.shape[-2]
    sf = s.view(np.float16).astype(np.float32)
    return (q.reshape(*lead, d // G, G, n).astype(np.float32) * sf[..., None, :]).reshape(q.shape)


def _q4_values(wg, d):
    """wg (..., g, G, n) f32, d (..., g, n) f32 scales -> u (..., g, G, n) int in 0..15."""
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    return np.clip(np.rint(wg * inv[..., None, :]) + 8, 0, 15)


def _q4_err(wg, d, u):
    r = wg - d[..., None, :] * (u - 8)
    return (r * r).sum(axis=-2)                                             # (..., g, n)


def quantize_q4(w: np.ndarray, G: int = GROUP):
    """W (..., d, n) float -> (values uint8 (..., d, n/2) packed, scales uint16/f16 (..., d/G, n))."""
    wg = _grouped(w, G)                                                    # (..., g, G, n)
    n = wg.shape[-1]
    if n % 2:
        raise ValueError(f"q4 needs an even number of columns, not {n}")
    # Q4_0's rule (d = signed absmax / -8, so the largest magnitude maps to -8), then a few
    # shrunken candidates, keep the best, refit by least squares
    idx = np.abs(wg).argmax(axis=-2)[..., None, :]
    m = np.take_along_axis(wg, idx, axis=-2)[..., 0, :]                   # (..., g, n) signed absmax
    best_d = best_u = best_e = None
    for f in Q4_CANDIDATES:
        d = _f16(m / np.float32(-8.0) * np.float32(f)).astype(np.float32)
        u = _q4_values(wg, d)
        e = _q4_err(wg, d, u)
        if best_e is None:
            best_d, best_u, best_e = d, u, e
        else:
            better = e < best_e
            best_d = np.where(better, d, best_d)
            best_u = np.where(better[..., None, :], u, best_u)
            best_e = np.minimum(e, best_e)
    v = best_u - 8
    num, den = (wg * v).sum(axis=-2), (v * v).sum(axis=-2)
    d = _f16(np.divide(num, den, out=best_d.copy(), where=den > 0)).astype(np.float32)
    d = np.where(np.isfinite(d), d, best_d)
    u = _q4_values(wg, d)
    e = _q4_err(wg, d, u)
    better = e < best_e
    d = np.where(better, d, best_d)
    u = np.where(better[..., None, :], u, best_u).astype(np.uint8)
    u = u.reshape(w.shape)
    h = n // 2
    packed = (u[..., :h] | (u[..., h:] << 4)).astype(np.uint8)
    return packed, _f16(d).view(np.uint16)


def unpack_q4(q: np.ndarray) -> np.ndarray:
    """Packed uint8 (..., d, n/2) -> values int8 (..., d, n) in -8..7."""
    lo = (q & 15).astype(np.int8) - 8
    hi = (q >> 4).astype(np.int8) - 8
    return np.concatenate([lo, hi], axis=-1)


def dequantize_q4(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """numpy twin: packed values (..., d, n/2), scales f16 bits (..., d/G, n) -> float32 (..., d, n)."""
    v = unpack_q4(q)
    *lead, d, n = v.shape
    G = d // s.shape[-2]
    sf = s.view(np.float16).astype(np.float32)
    return (v.reshape(*lead, d // G, G, n).astype(np.float32) * sf[..., None, :]).reshape(v.shape)


def quantize(kind: str, w: np.ndarray, G: int = GROUP):
    return quantize_q8(w, G) if kind == "q8" else quantize_q4(w, G)


# ---------------------------------------------------------------------------- panels

def to_panels(w: np.ndarray) -> np.ndarray:
    """(..., d, n) -> the contiguous panel array (..., n/PANEL, d, PANEL), any element type."""
    *lead, d, n = w.shape
    if n % PANEL:
        raise ValueError(f"{n} columns are not a multiple of the panel width {PANEL}")
    v = w.reshape(*lead, d, n // PANEL, PANEL)
    return np.ascontiguousarray(np.moveaxis(v, -2, -3))


def from_panels(p: np.ndarray) -> np.ndarray:
    """Inverse of to_panels: (..., n/PANEL, d, PANEL) -> contiguous (..., d, n)."""
    *lead, nb, d, w = p.shape
    return np.ascontiguousarray(np.moveaxis(p, -3, -2)).reshape(*lead, d, nb * w)
