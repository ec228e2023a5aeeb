"""Block-kind tensors for the tests: written by the `gguf` package's quantize where it has one, else
random valid blocks (random bytes, the f16 scale fields set to a finite value that gives weights of a
trained model's size)."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KINDS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
         Q.MXFP4)
# kind -> [(byte offset of an f16 field in a block, its value)], for the kinds gguf cannot quantize
_F16_FIELDS = {Q.Q2_K: [(80, 2e-3), (82, 2e-3)], Q.Q3_K: [(108, 5e-4)], Q.Q4_K: [(0, 3e-4), (2, 4e-4)],
               Q.Q5_K: [(0, 1.5e-4), (2, 2e-4)], Q.Q6_K: [(208, 1e-5)], Q.IQ4_NL: [(0, 5e-4)], Q.IQ4_XS: [(0, 2e-5)]}


def quantized(a: np.ndarray, kind, seed: int = 0) -> np.ndarray:
    """a (..., n) f32 as blocks of `kind` (uint8 (..., n/B*size)): gguf's quantize of a, or random valid
    blocks of the same shape where gguf has no quantizer for the kind."""
    B, S = gguf.GGML_QUANT_SIZES[kind]
    if kind not in _F16_FIELDS:
        return read_only(gguf.quants.quantize(np.ascontiguousarray(a, np.float32), kind))
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(a.size // B, S), dtype=np.uint8)
    for off, v in _F16_FIELDS[kind]:            # a scale of its own per block (0.5-1.5 times v), as real rows have
        d = (v * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return read_only(blocks.reshape(*a.shape[:-1], a.shape[-1] // B * S))


def read_only(raw: np.ndarray) -> np.ndarray:
    """Read-only, as a model's rows are (views of its mapped file): a kernel a test calls on them is then the
    signature the model's calls compile too, one compile for both (a writable array is a type of its own)."""
    raw = np.ascontiguousarray(raw)
    raw.setflags(write=False)
    return raw


def int8_rounded_products(monkeypatch):
    """Make every block-kind product of a Model the exact (float64) product of the `gguf` package's
    dequantized weights with the activations rounded as llama.cpp rounds them for its integer dots
    (int8 per 32, or per 256 for the k-quants in KROUND, scale max|x|/127, ties to even) for the kinds the kernels multiply that way (kernels/blocks
    FAST; the others take f32 activations): the reference the kernels are held to. (That rounding alone
    moves a small random model's logits far: its error is not the kernels'.)"""
    from colibri_server.model import transformer as TR
    from colibri_server.model.kernels.blocks import FAST, KROUND

    def product(self, X, W, out, alpha=1.0, accumulate=False):
        X = np.asarray(X, np.float64)
        T, n = X.shape
        xb = X.reshape(T, -1, 256 if W.ggml in KROUND else 32)
        d = (np.abs(xb).max(-1, keepdims=True).astype(np.float32) / np.float32(127)).astype(np.float64)
        xr = (np.round(np.divide(xb, d, out=np.zeros_like(xb), where=d > 0)) * d).reshape(T, n) if W.ggml in FAST else X
        Wf = gguf.quants.dequantize(np.ascontiguousarray(W.raw), Q(W.ggml % 256)).reshape(-1, n).astype(np.float64)
        r = (xr @ Wf.T * alpha).astype(np.float32)
        if accumulate:
            out += r
        else:
            out[...] = r
        return out
    monkeypatch.setattr(TR.Workspace, "mm_blocks", product)
