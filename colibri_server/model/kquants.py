"""Float weights -> llama.cpp's block kinds: the k-quants' search, and llama-quantize's mixes.

`quantize(kind, rows)` turns f32 rows into the bytes of block kind `kind` (blocks.py), row by
row. The 32-blocks (q4_0, q4_1, q5_0, q5_1, q8_0) come from the `gguf` package's quantizers;
the k-quants (q4_k, q5_k, q6_k) from kernels/kquants.py, llama-quantize's search without an
importance matrix, whose bytes equal llama-quantize's on the same values (tests/test_kquants.py).

`scheme_kinds(cfg, scheme)`: which kind each matrix gets under `colibri convert --quantize
q4_k_m | q5_k_m | q6_k | q8_0 | q4_0` (llama-quantize's choices for those file types: the output
head at q6_k, more bits for attn_v and ffn_down in the first and last eighth and every third
layer between, 8-expert models' attn_k / attn_v at q8_0 and attn_output at q5_k). A row length
that is not a multiple of a kind's block falls back as llama-quantize falls back.

Owns: these encoders and the mixes.  Never: reads files or knows the .colibri layout.
"""
from __future__ import annotations

import numpy as np

from .blocks import KINDS, stored_kind

SCHEMES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}    # a row that is not a multiple of 256


def quantize(kind: str, rows: np.ndarray) -> np.ndarray:
    """f32 rows (R, n) -> their bytes in block kind `kind` (R, n / block x block bytes), uint8."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    k = KINDS[kind]
    R, n = rows.shape
    if n % k.block:
        raise ValueError(f"rows of {n} values are not a whole number of {kind} blocks ({k.block})")
    if kind in ("q4_k", "q5_k", "q6_k"):
        from .kernels.kquants import quantize_k
        out = np.empty((R, n // k.block * k.size), np.uint8)
        rows = rows.view()
        rows.setflags(write=False)      # one compiled signature, whether the caller's rows are writable or mapped
        quantize_k(k.ggml, rows, out)
        return out
    import gguf
    return np.asarray(gguf.quants.quantize(rows, gguf.GGMLQuantizationType(k.ggml)), np.uint8).reshape(R, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def scheme_kinds(cfg, scheme: str) -> dict:
    """Our tensor name -> block kind for every matrix the kernels multiply (the QUANTIZABLE ones and the
    token embedding), as llama-quantize chooses them for `scheme`; a kind whose block does not divide
    the row falls back (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0), and a row that fits no block
    (not a multiple of 32) stays float (absent from the map)."""
    from .config import QUANTIZABLE, expected_tensors
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize {scheme!r}: choose one of {', '.join(SCHEMES)}")
    base = {"q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k": "q6_k", "q8_0": "q8_0", "q4_0": "q4_0"}[scheme]
    mixed = scheme in ("q4_k_m", "q5_k_m")
    n_layers, eight = cfg.num_layers, cfg.num_experts == 8
    tied = not any(n == "output" for n, _, _ in expected_tensors(cfg))
    kinds = {}
    for n, shape, _ in expected_tensors(cfg):
        key = n.split(".", 2)[-1]
        if n != "token_embd" and key not in QUANTIZABLE:
            continue
        layer = int(n.split(".")[1]) if n.startswith("blk.") else 0
        kind = base
        if n == "output" or (n == "token_embd" and tied):
            kind = "q8_0" if scheme == "q8_0" else "q6_k"
        elif mixed and key == "attn_v":
            kind = "q8_0" if eight else ("q6_k" if _more_bits(layer, n_layers) else base)
        elif mixed and key == "attn_k" and eight:
            kind = "q8_0"
        elif mixed and key in ("ffn_down", "ffn_down_exps", "ffn_down_shexp") and _more_bits(layer, n_layers):
            kind = "q6_k"
        elif scheme == "q4_k_m" and key == "attn_o" and eight:
            kind = "q5_k"
        cols = shape[-1]
        if cols % KINDS[kind].block:
            kind = _FALLBACK.get(kind, kind)
        if cols % KINDS[kind].block == 0:
            kinds[n] = stored_kind(n, kind, shape)
    return kinds
