"""Group quantization of weight matrices: q8 (int8) and q4 (4-bit), numpy side.

Layout (chosen for the kernels, see kernels/quant.py). A matrix W (d, n) (PyTorch
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

from .kernels.packing import (  # noqa: F401
    CONVERT_GROUP,
    GROUP,
    Q4_CANDIDATES,
    dequantize_q4,
    dequantize_q8,
    quantize,
    quantize_q4,
    quantize_q8,
    unpack_q4,
)


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


def dequantize(t: QTensor) -> np.ndarray:
    return dequantize_q8(t.q, t.s) if t.kind == "q8" else dequantize_q4(t.q, t.s)


# ---------------------------------------------------------------------------- files

def dequantize_file(src, dst, dtype: str = "f16", progress=None, layout: str | None = None) -> None:
    """Write a float copy (dtype f32/f16/bf16; layout rows|panels, default as the converter's)
    of a .colibri file: every quantized matrix is dequantized (one matrix of a stack at a
    time), everything else is copied or re-encoded."""
    from . import format as fmt
    from .config import ModelConfig, expected_tensors, file_config
    from .convert import _encode, default_layout
    from .writer import ColibriWriter
    layout = default_layout(dtype, layout)
    cf = fmt.ColibriFile.open(src)
    try:
        cfg = file_config(cf)
        out_cfg = ModelConfig.from_dict({**cfg.to_dict(), "dtype": dtype, "quant": "none", "quant_overrides": {},
                                         "layout": layout, "block_types": {}})
        meta = fmt.read_json_blob(cf.path, "metadata", cf.metadata_json, required=False)
        meta = {**meta, "dequantized_from": f"{cfg.quant} {dict(cfg.quant_overrides)}"}
        plan = list(expected_tensors(out_cfg))
        with ColibriWriter(dst, config=out_cfg.to_dict(), metadata=meta, tokenizer_json=cf.tokenizer_json,
                           chat_template=cf.chat_template, num_experts=cf.header["num_experts"],
                           num_layers=cf.header["num_layers"]) as w:
            for name, shape, dts in plan:
                w.declare(name, dts[0], shape)
            names = {n: i for i, (n, _, _) in enumerate(plan)}
            def index(i):
                return names[fmt_name(cf, i)] if i != fmt.NO_TENSOR else i
            w.set_routing([(index(r.gate), index(r.bias), r.top_k, r.num_experts, r.flags, index(r.shared_gate),
                            r.n_group, r.topk_group, r.routed_scale) for r in cf.routing])
            for name, shape, dts in plan:
                rec = cf.records[name]
                if rec.dtype in ("i8", "u4"):
                    t = QTensor("q8" if rec.dtype == "i8" else "q4", cf.view(name), cf.view(name + ".s"))
                    stack = [t[e] for e in range(shape[0])] if len(shape) == 3 else [t]
                    for m in stack:
                        w.write(name, _encode(dequantize(m), "F32", dts[0], name))
                elif rec.dtype in fmt.BLOCK_DTYPES:             # llama.cpp's blocks, one matrix at a time
                    from .blocks import KINDS
                    from .kernels.blocks import dequantize_ref
                    v = cf.view(name)
                    for m in (v if v.ndim == 3 else (v,)):
                        w.write(name, _encode(dequantize_ref(m, KINDS[rec.dtype].ggml, shape[-1]), "F32", dts[0], name))
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
