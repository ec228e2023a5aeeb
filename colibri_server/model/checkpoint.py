"""A Hugging Face checkpoint's tensors: the safetensors headers of a directory indexed, rows read.

Owns: SourceTensor (where a tensor's bytes are), reading rows of one matrix of a tensor, and the
MXFP4 pair (`<name>_blocks` + `_scales`) seen as one source.  Never: decides how a tensor is stored.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np

from .families import ConvertError

_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
              "F8_E4M3": np.dtype("u1")}     # with its block scales, dequantized to f32 (fp8.py)
_RAW_DTYPES = {**_ST_DTYPES, "U8": np.dtype("u1")}     # and MXFP4's blocks and scales (mxfp4.py), read raw     # with its block scales, dequantized to f32 (fp8.py)


@dataclass(frozen=True)
class SourceTensor:
    file: str
    dtype: str          # safetensors dtype string: F32, F16, BF16
    shape: tuple
    start: int          # absolute byte offset in file
    nbytes: int
    name: str = ""      # its name in the checkpoint


def read_safetensors_header(path) -> dict:
    """name -> SourceTensor for one .safetensors file (format: u64 n, n bytes of JSON, data)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, 100 << 20):
            raise ConvertError(f"{path}: safetensors header length {n} is larger than the file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConvertError(f"{path}: safetensors header is not JSON: {e}") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            dt, shape = info["dtype"], tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if 8 + n + e > size or b > e:
            raise ConvertError(f"{path}: tensor {name!r} data [{b}, {e}) lies outside the file")
        out[name] = SourceTensor(str(path), dt, shape, 8 + n + b, e - b, name)
    return out


def index_checkpoint(hf_dir) -> dict:
    """All tensors of a checkpoint directory, sharded (with model.safetensors.index.json) or not."""
    idx = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        try:
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{idx}: not a valid safetensors index ({e})") from None
    else:
        files = sorted(p for p in os.listdir(hf_dir) if p.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise ConvertError(f"{path}: listed in the index but missing")
        tensors.update(read_safetensors_header(path))
    return tensors


def _read_rows(t: SourceTensor, row0: int, row1: int, lead: int = 0) -> np.ndarray:
    """Rows [row0, row1) of the 2-D matrix number `lead` of a tensor (f32, bf16 as raw uint16)."""
    dt = _RAW_DTYPES[t.dtype]
    cols = t.shape[-1]
    rows = t.shape[-2] if len(t.shape) >= 2 else 1
    off = t.start + ((lead * rows + row0) * cols) * dt.itemsize
    count = (row1 - row0) * cols
    with open(t.file, "rb") as f:
        a = np.fromfile(f, dtype=dt, count=count, offset=off)
    if a.size != count:
        raise ConvertError(f"{t.file}: truncated while reading a tensor at byte {off}")
    return a.reshape(row1 - row0, cols)


def _mxfp4_source(tensors, hf_name):
    """A parameter stored as MXFP4 `<hf_name>_blocks` (E, rows, G, 16) + `_scales` (E, rows, G) (GPT-OSS's
    experts): a source of dtype MXFP4 whose shape is the parameter's, (E, G*32, rows) (mxfp4.py), or None."""
    b, sc = tensors.get(hf_name + "_blocks"), tensors.get(hf_name + "_scales")
    if b is None or sc is None:
        return None
    if b.dtype != "U8" or sc.dtype != "U8" or len(b.shape) != 4 or b.shape[-1] != 16 or tuple(sc.shape) != b.shape[:-1]:
        raise ConvertError(f"checkpoint: MXFP4 tensor {hf_name!r}: blocks {b.dtype}{list(b.shape)} and scales "
                           f"{sc.dtype}{list(sc.shape)} are not (E, rows, G, 16) and (E, rows, G) uint8")
    E, rows, G, _ = b.shape
    return replace(b, dtype="MXFP4", shape=(E, G * 32, rows), name=hf_name)
