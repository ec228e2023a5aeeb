"""The block kinds: llama.cpp's quantized block formats, stored byte for byte as a GGUF holds them.

A block-kind matrix (d, n) is d rows of n/B blocks each, every block B consecutive weights of one
row in `size` bytes (its scales and packed values: docs/format.md, "Block kinds"); an expert
stack (E, d, n) is E such matrices back to back, so an expert is one contiguous byte range.
The dtype code of a kind in a .colibri file is 64 + its GGML type id (format.py, version 3).

This module is the table only (names, ids, block sizes, bytes per block); the dequantizers and
kernels are kernels/blocks.py, the numpy wrapper of a stored tensor is `BlockTensor`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CODE_BASE = 64          # dtype code of a kind = CODE_BASE + GGML type id
ACTS16 = 256            # kernels/blocks.ACTS16: added to the id a product is given, the activations rounded to int16
QK_K = 256              # weights per block of the k-quants and IQ4_XS


@dataclass(frozen=True)
class BlockKind:
    name: str           # the dtype name in a .colibri file (lower case of llama.cpp's)
    ggml: int           # llama.cpp's type id (GGMLQuantizationType)
    block: int          # weights per block
    size: int           # bytes per block

    @property
    def code(self) -> int:
        return CODE_BASE + self.ggml

    @property
    def bits(self) -> float:
        """Bits per weight."""
        return 8.0 * self.size / self.block


KINDS = {k.name: k for k in (
    BlockKind("q4_0", 2, 32, 18), BlockKind("q4_1", 3, 32, 20), BlockKind("q5_0", 6, 32, 22),
    BlockKind("q5_1", 7, 32, 24), BlockKind("q8_0", 8, 32, 34), BlockKind("q2_k", 10, QK_K, 84),
    BlockKind("q3_k", 11, QK_K, 110), BlockKind("q4_k", 12, QK_K, 144), BlockKind("q5_k", 13, QK_K, 176),
    BlockKind("q6_k", 14, QK_K, 210), BlockKind("iq4_nl", 20, 32, 18), BlockKind("iq4_xs", 23, QK_K, 136),
    BlockKind("mxfp4", 39, 32, 17),
    BlockKind("q4_k_x16", 12 + 128, QK_K, 144),         # q4_k stored as 16-row tiles (kernels/blocks.to_x16)
    BlockKind("q6_k_x16", 14 + 128, QK_K, 210))}        # and q6_k
X16_OF = {"q4_k": "q4_k_x16", "q6_k": "q6_k_x16"}       # a kind -> the same blocks as 16-row tiles (stored_kind)
BASE = {v: k for k, v in X16_OF.items()}                # and back: the GGUF type whose bytes a tiled kind holds
TILE_ROWS = 16
BY_GGML = {k.ggml: k for k in KINDS.values()}
BY_CODE = {k.code: k for k in KINDS.values()}


def stored_kind(name: str, kind: str, shape) -> str:
    """The kind a matrix of `kind` is written in: an expert stack's Q4_K or Q6_K as 16-row tiles (kernels/blocks_x16: the
    serving step's tiles read them as they are) when its rows are whole tiles; every other matrix as it is."""
    if name.endswith("_exps") and kind in X16_OF and int(shape[-2]) % TILE_ROWS == 0:
        return X16_OF[kind]
    return kind


def row_bytes(kind: str, n: int) -> int:
    """Bytes of one row of n weights; ValueError when n is not a whole number of blocks."""
    k = KINDS[kind]
    if n % k.block:
        raise ValueError(f"a {kind} row holds whole blocks of {k.block} weights, not {n}")
    return n // k.block * k.size


def nbytes(kind: str, shape) -> int:
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    return rows * row_bytes(kind, int(shape[-1]))


def view_shape(kind: str, shape) -> tuple:
    """The uint8 view of a block tensor: the logical shape with its last dimension in bytes."""
    shape = tuple(int(s) for s in shape)
    return shape[:-1] + (row_bytes(kind, shape[-1]),)


class BlockTensor:
    """A block-kind matrix (or stack of matrices): a view of the mapping's bytes with its kind and
    logical shape (..., d, n). No copy."""

    __slots__ = ("kind", "raw", "shape", "acts16")

    def __init__(self, kind: str, raw: np.ndarray, shape=None, acts16: bool = False):
        self.kind = kind
        self.acts16 = acts16                    # products on the activations rounded to int16, not int8 (the head)
        self.raw = raw                          # uint8 (..., d, n/B*size)
        k = KINDS[kind]
        self.shape = tuple(shape) if shape is not None else \
            raw.shape[:-1] + (raw.shape[-1] // k.size * k.block,)

    @property
    def ggml(self) -> int:
        """The id the kernels are given: the kind's GGML id, + ACTS16 when the activations are rounded to int16."""
        return KINDS[self.kind].ggml + (ACTS16 if self.acts16 else 0)

    def with_acts16(self, on: bool = True) -> BlockTensor:
        """The same bytes, its products on the activations rounded to int16 (on: the output head's default, see
        kernels/blocks_wide) or to int8 as llama.cpp rounds them (off)."""
        return BlockTensor(self.kind, self.raw, self.shape, acts16=bool(on))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def __getitem__(self, e) -> BlockTensor:
        """One matrix of a stack, or a run of rows of a matrix (slices on the leading axis)."""
        if self.kind in BASE and self.raw.ndim == 2:
            raise TypeError(f"the rows of a {self.kind} matrix are interleaved in tiles, not a range of bytes")
        raw = self.raw[e]
        return BlockTensor(self.kind, raw)

    def __repr__(self) -> str:
        return f"BlockTensor({self.kind}, {list(self.shape)})"


def is_block(W) -> bool:
    return isinstance(W, BlockTensor)
