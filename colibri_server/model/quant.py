"""Group quantization of weight matrices: q8 (int8) and q4 (4-bit), numpy side.

Layout (chosen for the kernels, see kernels_quant.py). A matrix W (d, n) (PyTorch
[out, in], y = W @ x; experts stacked in front: (E, d, n)) is cut into groups of G
consecutive *rows* that share one scale per *column*:

    W[i, j] ~= s[i // G, j] * v[i, j]          s: f16, shape (d/G, n)

so a decode kernel folds a row group's scales into the activations once,
xs[j] = s[g, j] * x[j], and every row of the group is a plain dot product of
its integer values with xs, with a long, vectorisable inner loop and no
per-group horizontal sums. Size per weight: q8 1 + 2/G bytes, q4 1/2 + 2/G
(G = 32: 1.0625 and 0.5625, the same as llama.cpp's Q8_0 and Q4_0).

    q8: v int8 in [-127, 127], s = absmax / 127 (over the G rows of the column).
    q4: v = u - 8 with u in 0..15 stored two per byte: byte k of a row holds
        column k in its low nibble and column k + n/2 in its high nibble (so both
        halves of the row are read with contiguous loads). The scale of each
        group is chosen among a few candidates to minimise the squared error,
        then refitted by least squares (rounded to f16 before the values are
        rounded, so the values are optimal for the stored scale).

A file stores the values as `<name>` (dtype i8 or u4, the logical shape) and the
scales as `<name>.s` (f16, shape (..., d/G, n)). `QTensor` pairs the two views.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32                     # default rows per scale of quantize_q8/q4 (config quant_group)
# The converter's rows per scale (config quant_group of new files). 64, not 32: the decode kernels fold
# a group's scales into the activations and requantize them once per group, and with VNNI that
# work costs as much as the dots at 32 rows. Measured on bench-mixtral (Zen 4, 1 thread), 32 -> 64:
# q4 decode 141 -> 148 tok/s, q8 78 -> 83, KL against f32 unchanged (q4 2.21e-2 -> 2.20e-2,
# q8 1.54e-3 -> 1.40e-3); 128 was faster still but lost quality (q4 KL 2.90e-2).
CONVERT_GROUP = 64
Q4_CANDIDATES = (1.0, 0.95, 0.9, 0.85, 0.8, 1.05)


@dataclass(frozen=True)
class QTensor:
    """A quantized matrix (or stack of matrices): values and scales views of one mapping."""
    kind: str                  # "q8" | "q4"
    q: np.ndarray              # q8: int8 (..., d, n); q4: uint8 (..., d, n/2)
    s: np.ndarray              # uint16 (f16 bits) (..., d/G, n)

    @property
    def shape(self) -> tuple:
        """Logical shape (..., d, n)."""
        return self.q.shape[:-1] + (self.s.shape[-1],)

    @property
    def group(self) -> int:
        return self.q.shape[-2] // self.s.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes

    def __getitem__(self, e) -> "QTensor":
        """One matrix of a stack (an int index on the leading axis)."""
        return QTensor(self.kind, self.q[e], self.s[e])


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


def dequantize(t: QTensor) -> np.ndarray:
    return dequantize_q8(t.q, t.s) if t.kind == "q8" else dequantize_q4(t.q, t.s)


# ---------------------------------------------------------------------------- files

def dequantize_file(src, dst, dtype: str = "f16", progress=None, layout: str | None = None) -> None:
    """Write a float copy (dtype f32/f16/bf16; layout rows|panels, default as the converter's)
    of a .colibri file: every quantized matrix is dequantized (one matrix of a stack at a
    time), everything else is copied or re-encoded."""
    from . import format as fmt
    from .config import ModelConfig, expected_tensors
    from .convert import _encode, default_layout
    layout = default_layout(dtype, layout)
    cf = fmt.ColibriFile.open(src)
    try:
        raw = fmt.read_json_blob(cf.path, "config", cf.config_json)
        cfg = ModelConfig.from_dict(raw)
        out_cfg = ModelConfig.from_dict({**cfg.to_dict(), "dtype": dtype, "quant": "none", "quant_overrides": {},
                                         "layout": layout})
        meta = fmt.read_json_blob(cf.path, "metadata", cf.metadata_json, required=False)
        meta = {**meta, "dequantized_from": f"{cfg.quant} {dict(cfg.quant_overrides)}"}
        plan = list(expected_tensors(out_cfg))
        with fmt.ColibriWriter(dst, config=out_cfg.to_dict(), metadata=meta, tokenizer_json=cf.tokenizer_json,
                               chat_template=cf.chat_template, num_experts=cf.header["num_experts"],
                               num_layers=cf.header["num_layers"]) as w:
            for name, shape, dts in plan:
                w.declare(name, dts[0], shape)
            names = {n: i for i, (n, _, _) in enumerate(plan)}
            w.set_routing([(names[fmt_name(cf, r.gate)] if r.gate != fmt.NO_TENSOR else r.gate,
                            r.bias, r.top_k, r.num_experts, r.flags,
                            names[fmt_name(cf, r.shared_gate)] if r.shared_gate != fmt.NO_TENSOR else r.shared_gate)
                           for r in cf.routing])
            for name, shape, dts in plan:
                rec = cf.records[name]
                if rec.dtype in ("i8", "u4"):
                    t = QTensor("q8" if rec.dtype == "i8" else "q4", cf.view(name), cf.view(name + ".s"))
                    stack = [t[e] for e in range(shape[0])] if len(shape) == 3 else [t]
                    for m in stack:
                        w.write(name, _encode(dequantize(m), "F32", dts[0], name))
                else:
                    w.write(name, _encode_view(cf.view(name), rec.dtype, dts[0], name))
                if progress:
                    progress(name)
    finally:
        cf.close()


def fmt_name(cf, index: int) -> str:
    return cf.record_list[index].name


def _encode_view(a: np.ndarray, src_dtype: str, dst: str, name: str) -> np.ndarray:
    from .convert import _encode
    from .format import PANEL_DTYPES
    from .kernels import weights_to_f32
    from .panels import Panels
    if src_dtype == dst:
        return np.ascontiguousarray(a)
    f = weights_to_f32(Panels(a) if src_dtype in PANEL_DTYPES else a)     # the logical matrix
    return _encode(np.ascontiguousarray(f, np.float32), "F32", dst, name)
