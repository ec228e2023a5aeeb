"""FP8 checkpoints (DeepSeek-V3, Qwen3-FP8, GLM-4.5-FP8): float8_e4m3fn weights with one f32 scale per
128x128 block (`<name>.weight_scale_inv`, quantization_config.weight_block_size), dequantized by the
converter with no torch: value = e4m3(byte) * scale[row // bs_r, col // bs_c]. Conversion-time only.
"""
from __future__ import annotations

import numpy as np


def _e4m3fn_table() -> np.ndarray:
    """The 256 float8_e4m3fn values as f32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
    infinities, S.1111.111 is NaN; exponent 0 is subnormal (mantissa/8 * 2^-6)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3FN = _e4m3fn_table()


def dequantized_blocks(blocks, scale: np.ndarray, block: tuple, cols: int):
    """Row blocks (uint8, consecutive from row 0) of one FP8 matrix -> f32 row blocks, each value
    times its (block[0] x block[1]) tile's scale."""
    br, bc = block
    col_scale_idx = np.arange(cols) // bc
    r0 = 0
    for b in blocks:
        rows = np.arange(r0, r0 + b.shape[0]) // br
        yield E4M3FN[b] * scale[rows[:, None], col_scale_idx[None, :]]
        r0 += b.shape[0]
