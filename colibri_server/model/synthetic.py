"""A .colibri file of random weights for any config: every tensor `expected_tensors` names, in its
stored dtype (f32, f16, bf16, their panels, q8/q4 values with their f16 scales, llama.cpp's block kinds
as its quantizers write them: kquants.py), finite and small.

What it is for: compiling the kernels a model of that kind needs without the model (precompile.py),
and tests and benches that need a file of a given shape but not meaningful outputs. Never a model
anyone serves: its outputs are noise.
"""
from __future__ import annotations

import numpy as np

from . import format as fmt
from .blocks import KINDS as BLOCK_KINDS
from .config import ModelConfig, expected_tensors
from .convert import routing_records
from .writer import ColibriWriter

__all__ = ["write_synthetic"]


def _floats(rng, pool, n, offset):
    # n small normal floats (std 0.02), a shifted view of one pool: cheap for large tensors
    reps = -(-n // pool.size)
    return np.tile(np.roll(pool, offset), reps)[:n] if reps > 1 else np.roll(pool, offset)[:n]


def _encode(dtype: str, x: np.ndarray) -> np.ndarray:
    """float32 values as the stored dtype's elements."""
    if dtype == "f32":
        return x
    if dtype in ("f16", "f16p"):
        return x.astype(np.float16).view(np.uint16)
    if dtype in ("bf16", "bf16p"):
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    raise ValueError(dtype)


def _block_rows(kind: str, rng, pool, shape, offset: int) -> np.ndarray:
    from .kquants import quantize
    n = int(shape[-1])
    rows = int(np.prod(shape[:-1]))
    return quantize(kind, _floats(rng, pool, rows * n, offset * 7919).reshape(rows, n))


def write_synthetic(path, cfg: ModelConfig, seed: int = 0, chunk: int = 1 << 20) -> int:
    """Write a file of random weights for `cfg` at `path`; returns the file's size in bytes."""
    cfg.check()
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(chunk, dtype=np.float32) * np.float32(0.02)
    with ColibriWriter(path, config=cfg.to_dict(), metadata={"name": "synthetic"},
                       num_experts=cfg.num_experts, num_layers=cfg.num_layers) as w:
        plan = list(expected_tensors(cfg))
        for name, shape, dts in plan:
            w.declare(name, dts[0], shape)
        w.set_routing(routing_records(cfg, w))
        for k, (name, shape, dts) in enumerate(plan):
            dt = dts[0]
            nb = fmt.nbytes(dt, shape)
            if dt in ("i8", "u4"):                       # quantized values: any bytes are valid
                w.write(name, rng.integers(-127 if dt == "i8" else 0, 128 if dt == "i8" else 256, nb,
                                           dtype=np.int16).astype(np.int8 if dt == "i8" else np.uint8))
                continue
            if dt in BLOCK_KINDS:                        # random rows, quantized as `colibri convert` would
                w.write(name, _block_rows(dt, rng, pool, shape, k))
                continue
            if name.endswith(".s"):                      # quantization scales: small and positive
                w.write(name, np.full(nb // 2, 1e-3, np.float16).view(np.uint16))
                continue
            esize = 4 if dt == "f32" else 2
            n = nb // esize
            if name.endswith("norm") and dt == "f32":
                w.write(name, np.ones(n, np.float32))
                continue
            done = 0
            while done < n:
                m = min(n - done, chunk)
                w.write(name, _encode(dt, _floats(rng, pool, m, k * 7919 + done)))
                done += m
    return fmt.ColibriFile.open(path).header["file_size"]
