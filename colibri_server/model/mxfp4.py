"""MXFP4 checkpoints (GPT-OSS): the experts' weights as 4-bit e2m1 values in blocks of 32 sharing one
e8m0 scale, stored as `<name>_blocks` (..., rows, cols/32, 16) uint8, two values a byte (the low
nibble first), and `<name>_scales` (..., rows, cols/32) uint8, value = e2m1 * 2^(scale - 127).
GPT-OSS's blocks hold each matrix transposed against the bf16 parameter it stands for (rows are the
outputs): transformers dequantizes them and swaps the last two axes, and so does `matrix` here.
By default the converter keeps them as they are, in llama.cpp's MXFP4 block kind (blocks.py: per 32
values one e8m0 byte, then 16 bytes holding value j in the low nibble of byte j and value j+16 in its
high nibble): `ggml_rows` reorders each row's nibbles, and `row_map` finds which block rows make each
row of our tensor through the family's own recipe (GPT-OSS's gate and up are the even and odd rows of
gate_up). `--quantize q8|q4` re-encodes the dequantized values instead (convert.py states that error).
Conversion-time only.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .checkpoint import _mxfp4_source, _read_rows

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



def ggml_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A matrix's blocks (rows, G, 16) and scales (rows, G) -> its rows in llama.cpp's MXFP4 block kind
    (rows, G*17) uint8: the same values (e2m1 x 2^(e - 127)), nibbles in llama.cpp's order."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree")
    codes = np.empty(blocks.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    out = np.empty(blocks.shape[:-1] + (17,), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(blocks.shape[0], -1)


def row_map(recipe, cols: int, rows: int):
    """Which row of the block matrix (rows outputs x cols inputs) each row of recipe(parameter) is, when the
    recipe (a function of the (cols, rows) parameter) only transposes and selects its columns; else None."""
    ids = np.broadcast_to(np.arange(rows, dtype=np.float32)[None, :], (cols, rows))
    try:
        got = np.asarray(recipe(ids))
    except Exception:                   # a recipe that computes: not a selection of rows
        return None
    if got.ndim != 2 or got.shape[1] != cols or not (got == got[:, :1]).all():
        return None
    return got[:, 0].astype(np.int64)


def keeps(recipe, tensors, shape) -> bool:
    """Whether our tensor (a family's recipe of one MXFP4 parameter, per matrix of a stack) is kept as MXFP4."""
    if recipe[0] != "derived" or recipe[3:] != ("per_matrix",) or len(recipe[1]) != 1 or shape[-1] % 32:
        return False
    src = _mxfp4_source(tensors, recipe[1][0][0])
    return src is not None and row_map(recipe[2], src.shape[1], src.shape[2]) is not None


def kept_pieces(recipe, tensors, shape):
    """("BLOCKS", its rows in llama.cpp's MXFP4) per matrix of a stack kept as MXFP4 (`keeps`)."""
    name = recipe[1][0][0]
    b, sc = tensors[name + "_blocks"], tensors[name + "_scales"]
    E, rows, G = sc.shape
    pick = row_map(recipe[2], G * 32, rows)
    flat = replace(b, shape=(E, rows * G, 16))
    for e in range(shape[0]):
        raw = ggml_rows(_read_rows(flat, 0, rows * G, e).reshape(rows, G, 16), _read_rows(sc, 0, rows, e))
        yield "BLOCKS", iter([np.ascontiguousarray(raw[pick])])
