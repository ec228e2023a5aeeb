"""MXFP4 checkpoints (GPT-OSS): the experts' weights as 4-bit e2m1 values in blocks of 32 sharing one
e8m0 scale, stored as `<name>_blocks` (..., rows, cols/32, 16) uint8, two values a byte (the low
nibble first), and `<name>_scales` (..., rows, cols/32) uint8, value = e2m1 * 2^(scale - 127).
GPT-OSS's blocks hold each matrix transposed against the bf16 parameter it stands for (rows are the
outputs): transformers dequantizes them and swaps the last two axes, and so does `matrix` here.
Dequantized by the converter with no torch; the kernels do not run MXFP4 yet, so the converter stores
the values in the float dtype or requantizes them to q8/q4 (convert.py states that error). Conversion-time only.
"""
from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (..., G, 16) uint8, scales (..., G) uint8 -> (..., G*32) f32."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree")
    out = np.empty(blocks.shape[:-1] + (32,), np.float32)
    out[..., 0::2] = E2M1[blocks & 0x0F]
    out[..., 1::2] = E2M1[blocks >> 4]
    out *= np.exp2(scales.astype(np.float32) - 127)[..., None]
    return out.reshape(blocks.shape[:-2] + (blocks.shape[-2] * 32,))


def matrix(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One matrix's blocks (rows, G, 16) and scales (rows, G) -> the parameter it stands for, (G*32, rows) f32."""
    return np.ascontiguousarray(dequantize(blocks, scales).T)

