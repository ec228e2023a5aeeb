"""The .colibri binary layout, and nothing else.

A .colibri file is a memory image: map it once (MAP_SHARED, PROT_READ) and every
tensor is a numpy view at an offset, with no parsing and no copy. The byte-level
spec is docs/format.md; this module is its reference implementation.

    0x000  header (128 bytes, little-endian; see HEADER below)
    0x080  tensor table: tensor_count fixed 64-byte records
    ....   routing table: num_layers fixed 32-byte records
    ....   config JSON | metadata JSON | tokenizer.json | chat template (UTF-8)
    data_offset (page aligned): tensor data, each tensor aligned to `alignment`

Reader: `ColibriFile.open(path)` validates everything that is cheap (structure,
bounds, alignment, sizes, names) and raises one named `ColibriFormatError` per
failure. Checking shapes against the model config is the caller's (weights.py);
checksums are checked only by `verify_checksums()` (deep validation).

The writer is writer.py's `ColibriWriter`.
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import os
import stat
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from . import blocks as _blocks
from .release import release


class _KernelPages:
    """The page policy until the memory layer installs its own: pages as the kernel makes them."""

    @staticmethod
    def advise(mm) -> bool:
        return False

    @staticmethod
    def populate(mm, size: int, start: int = 0) -> None:
        int(np.frombuffer(mm, np.uint8, count=size, offset=start)[::mmap.PAGESIZE].sum(dtype=np.uint64))  # touch each page

    @staticmethod
    def rehome(path, mm, size: int):
        return None

    @staticmethod
    def drop_cached(path, pieces=None) -> None:
        pass


# How a mapping gets its pages (2 MiB advice, pre-faulting, dropping a written file's pages from
# the cache) is the memory layer's business, not the byte layout's: hugepages.py installs itself
# here (use_pages) when colibri_server.model is imported; format only calls it where it maps.
PAGES = _KernelPages


def use_pages(pages) -> None:
    """Install the page policy: an object with advise, populate, rehome and drop_cached."""
    global PAGES
    PAGES = pages


MAGIC = b"COLI"
VERSION = 3              # the newest version written; 1 and 2 are still read (docs/format.md "Version 2", "Version 3")
VERSIONS = (1, 2, 3)
HEADER_SIZE = 128
RECORD_SIZE = 64
ROUTING_RECORD_SIZE = 32
NAME_BYTES = 24
MAX_NDIM = 4
ALIGNMENT = 64          # every tensor starts on a 64-byte boundary (one cache line / AVX-512 register)
PAGE = 4096             # data_offset is page aligned
# The reference writer puts the expert stacks after every other tensor, and starts one on a 2 MiB boundary when
# its per-expert slice is a whole number of 2 MiB pieces: under a weights budget the server locks whole 2 MiB
# pieces (residency.py), so such an expert then costs exactly its bytes and the always-resident part is one
# run of pieces, not one per layer with edges shared with the stacks.
PIECE = 2 << 20
NO_TENSOR = 0xFFFFFFFF  # "absent" in the routing table

# magic, version, num_experts, num_layers, header_size, tensor_count,
# routing_offset, data_offset, file_size,
# config (offset, size), metadata (offset, size), tokenizer (offset, size), template (offset, size),
# alignment, reserved[12]
HEADER = struct.Struct("<4sIIIII QQQ QQ QQ QQ QQ I 12s")
# name[24], dtype u8, ndim u8, reserved u16, shape u32 x4, offset u64, size u64, crc32 u32
RECORD = struct.Struct("<24sBBH4IQQI")
# gate tensor index, bias tensor index, top_k, num_experts, flags, shared-expert gate index, reserved u64
ROUTING = struct.Struct("<IIIIIIQ")
# version 2: the reserved u64 is n_group u16, topk_group u16, routed_scale f32
ROUTING_V2 = struct.Struct("<IIIIIIHHf")
assert HEADER.size == HEADER_SIZE and RECORD.size == RECORD_SIZE and ROUTING.size == ROUTING_RECORD_SIZE

# Routing flags (per layer).
ROUTE_SOFTMAX = 1 << 0        # probabilities are softmax(gate logits) over all experts
ROUTE_RENORM = 1 << 1         # the top-k weights are renormalised to sum to 1
ROUTE_SHARED_EXPERT = 1 << 2  # the layer adds sigmoid(shared_gate . x) * shared_expert(x) (ungated in v2 without a gate)
# version 2
ROUTE_SIGMOID = 1 << 3        # scores are sigmoid(gate logits), each expert on its own
ROUTE_GROUP_LIMITED = 1 << 5  # choose topk_group of n_group consecutive expert groups first
ROUTE_SPARSEMIXER = 1 << 6     # Phi-MoE's sparsemixer (top_k 2; its jitter eps is the config's sparsemixer_eps)
ROUTE_BIAS_IN_LOGITS = 1 << 8  # `bias` is part of the logits (W x + b, GPT-OSS), not a selection-only correction
V1_FLAGS = ROUTE_SOFTMAX | ROUTE_RENORM | ROUTE_SHARED_EXPERT
V2_FLAGS = V1_FLAGS | ROUTE_SIGMOID | ROUTE_GROUP_LIMITED | ROUTE_BIAS_IN_LOGITS | ROUTE_SPARSEMIXER

# dtype code -> (name, numpy view dtype, bytes per element); docs/format.md lays each out. f16 is
# viewed as uint16 and bf16 as int16 (Numba has no float16 on the CPU; the view dtype tells a kernel
# which conversion to apply). i8 / u4: a group-quantized matrix's values (quant.py; scales in
# `<name>.s`), u4 two per byte. f16p / bf16p: in panels of PANEL columns, the bytes the array
# (..., n/PANEL, d, PANEL) of the logical (..., d, n) (panels.py). Codes 5..7 are left for floats.
DTYPES = {
    0: ("f32", np.dtype("<f4"), 4),
    1: ("f16", np.dtype("<u2"), 2),
    2: ("bf16", np.dtype("<i2"), 2),
    3: ("f16p", np.dtype("<u2"), 2),
    4: ("bf16p", np.dtype("<i2"), 2),
    8: ("i8", np.dtype("i1"), 1),
    9: ("u4", np.dtype("u1"), 0.5),
}
# Codes 64 + a GGML type id (version 3): llama.cpp's block kinds as a GGUF holds them (blocks.py), uint8 views.
DTYPES.update({k.code: (k.name, np.dtype("u1"), k.size / k.block) for k in _blocks.KINDS.values()})
BLOCK_DTYPES = frozenset(_blocks.KINDS)
DTYPE_CODES = {name: code for code, (name, _, _) in DTYPES.items()}
PANEL = 256                       # columns per panel of an f16p / bf16p matrix
PANEL_DTYPES = {"f16p": "f16", "bf16p": "bf16"}   # panel dtype -> the element type it stores


# ---------------------------------------------------------------------------- errors

class ColibriFormatError(Exception):
    """A .colibri file is not valid. `field` names the header field or tensor at fault."""

    def __init__(self, path, field, message):
        self.path, self.field = str(path), field
        super().__init__(f"{path}: {field}: {message}")


class BadMagic(ColibriFormatError): pass
class UnsupportedVersion(ColibriFormatError): pass
class Truncated(ColibriFormatError): pass
class BadHeader(ColibriFormatError): pass
class TensorOutOfBounds(ColibriFormatError): pass
class Misaligned(ColibriFormatError): pass
class UnknownDtype(ColibriFormatError): pass
class BadTensorRecord(ColibriFormatError): pass
class DuplicateName(ColibriFormatError): pass
class BadBlob(ColibriFormatError): pass
class BadConfig(ColibriFormatError): pass
class BadRouting(ColibriFormatError): pass
class MissingTensor(ColibriFormatError): pass
class ShapeMismatch(ColibriFormatError): pass
class ChecksumMismatch(ColibriFormatError): pass
class NotARegularFile(ColibriFormatError): pass


# ---------------------------------------------------------------------------- records

@dataclass(frozen=True)
class TensorRecord:
    index: int
    name: str
    dtype: str
    shape: tuple
    offset: int
    size: int
    crc32: int


@dataclass(frozen=True)
class RoutingRecord:
    gate: int          # tensor index of the router gate [E, D]
    bias: int          # tensor index of a per-expert bias [E], or NO_TENSOR
    top_k: int
    num_experts: int   # 0 for a dense (non-MoE) layer
    flags: int
    shared_gate: int   # tensor index of the shared-expert gate [1, D], or NO_TENSOR
    n_group: int = 0           # version 2: expert groups (0: none)
    topk_group: int = 0        # version 2: groups kept
    routed_scale: float = 1.0  # version 2: factor on the routed weights

    @property
    def is_v2(self) -> bool:
        return bool(self.flags & ~V1_FLAGS) or self.bias != NO_TENSOR or self.n_group or self.topk_group \
            or self.routed_scale != 1.0 or (self.flags & ROUTE_SHARED_EXPERT and self.shared_gate == NO_TENSOR)


def nbytes(dtype: str, shape) -> int:
    """Bytes of a dense tensor; ValueError for a packed u4 tensor whose last dimension is odd, or a
    panel tensor that is not a matrix of whole panels."""
    if dtype in PANEL_DTYPES and (len(shape) < 2 or int(shape[-1]) % PANEL):
        raise ValueError(f"a {dtype} tensor is a matrix of whole {PANEL}-column panels, not {list(shape)}")
    if dtype in BLOCK_DTYPES:
        return _blocks.nbytes(dtype, shape)
    n = 1
    for s in shape:
        n *= int(s)
    if dtype == "u4":
        if not shape or int(shape[-1]) % 2:
            raise ValueError(f"a u4 tensor needs an even last dimension, not {list(shape)}")
        return n // 2
    return n * DTYPES[DTYPE_CODES[dtype]][2]


def view_shape(dtype: str, shape) -> tuple:
    """Shape of the numpy view of a tensor (u4: the last dimension counts bytes, two elements each;
    f16p / bf16p: (..., n/PANEL, d, PANEL) for the logical (..., d, n))."""
    shape = tuple(int(s) for s in shape)
    if dtype in BLOCK_DTYPES:
        return _blocks.view_shape(dtype, shape)
    if dtype in PANEL_DTYPES:
        return shape[:-2] + (shape[-1] // PANEL, shape[-2], PANEL)
    return shape[:-1] + (shape[-1] // 2,) if dtype == "u4" else shape


# ---------------------------------------------------------------------------- reader

class ColibriFile:
    """An open, structurally validated .colibri file: header fields, tensor records,
    routing table, blobs, and zero-copy read-only views of one mapping."""

    def __init__(self, path, mm, header, records, routing, blobs):
        self.path, self._mm = str(path), mm
        self.header, self.routing = header, routing
        self.records = {r.name: r for r in records}
        self.record_list = records
        self.config_json, self.metadata_json, self.tokenizer_json, self.chat_template = blobs
        self._buf = np.frombuffer(mm, dtype=np.uint8)
        self.huge_bytes, self.hugepages = None, False     # bytes on 2 MiB pages (open() measured), 2 MiB advised
        # the file mapped: (st_dev, st_ino, st_size, st_mtime_ns) of the descriptor mapped, when it was (open() sets
        # it): a stat of the path later is this file only where its device and inode are these (master/faults.py)
        self.mapped = None

    @functools.cached_property
    def identity(self) -> str:
        """The model's identity: a hash of everything before the tensor data (header, the tensor
        table with each tensor's CRC-32, routing table, config, metadata, tokenizer, template), so
        two files with the same bytes have the same identity and a changed tensor changes it."""
        import hashlib
        return hashlib.sha256(self._mm[: self.header["data_offset"]]).hexdigest()[:32]

    # -- opening and validation -------------------------------------------------
    @classmethod
    def open(cls, path, populate: bool = False, hugepages: bool = True) -> "ColibriFile":
        """Map and validate. populate: fault every page in now. hugepages: advise 2 MiB pages and,
        when populating a large file, re-read once the parts that came back on 4 KiB pages
        (hugepages.py); `huge_bytes` then says how much is on 2 MiB pages (None: unknown)."""
        path = os.fspath(path)
        mm, st, advised = cls._map(path, populate, hugepages)
        size = st.st_size
        huge = PAGES.rehome(path, mm, size) if hugepages and populate else None
        try:
            header, records, routing, blobs = _validate(path, mm, size)
        except BaseException:
            mm.close()
            raise
        cf = cls(path, mm, header, records, routing, blobs)
        cf.huge_bytes = huge
        cf.mapped = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cf.hugepages = advised          # the mapping advised 2 MiB pages: a fault reads a 2 MiB folio
        return cf

    @staticmethod
    def _map(path, populate, hugepages):
        try:
            # O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; fstat then refuses
            # anything but a regular file before a single blocking read
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise FileNotFoundError(f"model file not found: {path}") from None
        except IsADirectoryError:
            raise NotARegularFile(path, "file", "is a directory, not a regular file") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) \
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
                raise NotARegularFile(path, "file", f"is {kind}, not a regular file")
            os.set_blocking(fd, True)
            size = st.st_size
            if size < HEADER_SIZE:
                raise Truncated(path, "header", f"file is {size} bytes, the header alone is {HEADER_SIZE}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        advised = bool(hugepages and PAGES.advise(mm))
        if populate:
            PAGES.populate(mm, size)
        return mm, st, advised

    def close(self) -> None:
        """Drop the mapping now, views taken from it alive or not (release.py). They must not be used after."""
        if self._buf is not None:
            addr, size, self._buf = self._buf.ctypes.data, self._buf.size, None
            try:
                self._mm.close()
            except BufferError:
                release(addr, size)

    # -- access -----------------------------------------------------------------
    def __contains__(self, name) -> bool:
        return name in self.records

    def view(self, name: str) -> np.ndarray:
        """Read-only numpy view of a tensor (f16 as uint16, bf16 as int16, i8 as int8, u4 as
        uint8 with half the last dimension, f16p / bf16p as their panels). No copy."""
        r = self.records[name]
        _, dt, _ = DTYPES[DTYPE_CODES[r.dtype]]
        a = self._buf[r.offset:r.offset + r.size].view(dt).reshape(view_shape(r.dtype, r.shape))
        return a

    def stacked_view(self, names) -> np.ndarray | None:
        """One read-only view of tensors stored back to back in this order with the same dtype
        and columns, their rows stacked (e.g. attn_q, attn_k, attn_v: one matvec streams all
        three); None when they are not stored that way. No copy."""
        rs = [self.records.get(n) for n in names]
        if any(r is None or len(r.shape) != 2 or r.dtype in PANEL_DTYPES or r.dtype in BLOCK_DTYPES for r in rs):
            return None
        first = rs[0]
        for a, b in zip(rs, rs[1:]):
            if b.dtype != first.dtype or b.offset != a.offset + a.size or b.shape[1] != first.shape[1]:
                return None
        _, dt, _ = DTYPES[DTYPE_CODES[first.dtype]]
        rows = sum(r.shape[0] for r in rs)
        size = rs[-1].offset + rs[-1].size - first.offset
        shape = view_shape(first.dtype, (rows, first.shape[1]))
        return self._buf[first.offset:first.offset + size].view(dt).reshape(shape)

    def tensor_bytes(self, name: str) -> memoryview:
        r = self.records[name]
        return memoryview(self._mm)[r.offset:r.offset + r.size]

    def verify_checksums(self, progress=None, records=None) -> None:
        """Deep validation: the CRC-32 of every tensor's bytes (of `records`, default all) against
        its record."""
        for r in self.record_list if records is None else records:
            crc = 0
            mv = memoryview(self._mm)
            for start in range(r.offset, r.offset + r.size, 1 << 24):
                crc = zlib.crc32(mv[start:min(start + (1 << 24), r.offset + r.size)], crc)
            mv.release()
            if crc != r.crc32:
                raise ChecksumMismatch(self.path, r.name,
                                       f"CRC-32 of the data is {crc:#010x}, the record says {r.crc32:#010x}")
            if progress:
                progress(r)


def _field_bounds(path, name, offset, size, lo, hi):
    if offset < lo or size < 0 or offset + size > hi:
        raise BadHeader(path, name, f"region [{offset}, {offset + size}) is outside [{lo}, {hi})")


def _validate(path, mm, size):
    raw = HEADER.unpack_from(mm, 0)
    (magic, version, num_experts, num_layers, header_size, tensor_count,
     routing_offset, data_offset, file_size,
     cfg_off, cfg_size, meta_off, meta_size, tok_off, tok_size, tpl_off, tpl_size,
     alignment, reserved) = raw
    if magic != MAGIC:
        raise BadMagic(path, "magic", f"expected {MAGIC!r}, found {magic!r}: not a .colibri file")
    if version not in VERSIONS:
        raise UnsupportedVersion(path, "version", f"file is version {version}, this reader supports "
                                                  f"{' and '.join(map(str, VERSIONS))}")
    if header_size != HEADER_SIZE:
        raise BadHeader(path, "header_size", f"{header_size}, expected {HEADER_SIZE}")
    if file_size != size:
        if size < file_size:
            raise Truncated(path, "file_size", f"header says {file_size} bytes, the file has {size}")
        raise BadHeader(path, "file_size", f"header says {file_size} bytes, the file has {size} (trailing bytes)")
    if alignment < ALIGNMENT or alignment & (alignment - 1) or alignment > PAGE:
        raise BadHeader(path, "alignment", f"{alignment} is not a power of two in {ALIGNMENT}..{PAGE}")
    if any(reserved):
        raise BadHeader(path, "reserved", "reserved header bytes must be zero")
    if num_layers == 0 or num_layers > 4096:
        raise BadHeader(path, "num_layers", f"{num_layers} is not in 1..4096")
    if num_experts > 65536:
        raise BadHeader(path, "num_experts", f"{num_experts} is not in 0..65536")
    if data_offset % PAGE or data_offset > size:
        raise BadHeader(path, "data_offset", f"{data_offset} is not page aligned inside the file")
    table_end = HEADER_SIZE + tensor_count * RECORD_SIZE
    if tensor_count == 0 or table_end > data_offset:
        raise BadHeader(path, "tensor_count", f"{tensor_count} records do not fit before data_offset {data_offset}")
    _field_bounds(path, "routing_offset", routing_offset, num_layers * ROUTING_RECORD_SIZE, table_end, data_offset)
    blobs = []
    for name, off, n in (("config", cfg_off, cfg_size), ("metadata", meta_off, meta_size),
                         ("tokenizer", tok_off, tok_size), ("chat_template", tpl_off, tpl_size)):
        _field_bounds(path, name + "_offset", off, n, table_end, data_offset)
        try:
            blobs.append(bytes(mm[off:off + n]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadBlob(path, name, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    regions = sorted((off, off + n, name) for name, off, n in (
        ("routing_offset", routing_offset, num_layers * ROUTING_RECORD_SIZE), ("config_offset", cfg_off, cfg_size),
        ("metadata_offset", meta_off, meta_size), ("tokenizer_offset", tok_off, tok_size),
        ("chat_template_offset", tpl_off, tpl_size)) if n)
    for (_, end_a, _), (start_b, _, name_b) in zip(regions, regions[1:]):
        if start_b < end_a:
            raise BadHeader(path, name_b, f"region starting at {start_b} overlaps the previous one (ends at {end_a})")
    header = dict(version=version, num_experts=num_experts, num_layers=num_layers,
                  header_size=header_size, tensor_count=tensor_count, routing_offset=routing_offset,
                  data_offset=data_offset, file_size=file_size, alignment=alignment)

    records, seen = [], set()
    for i in range(tensor_count):
        (name_b, code, ndim, res, s0, s1, s2, s3, offset, nbyt, crc) = RECORD.unpack_from(mm, HEADER_SIZE + i * RECORD_SIZE)
        where = f"tensor record {i}"
        name_b = name_b.rstrip(b"\0")
        try:
            name = name_b.decode("ascii")
        except UnicodeDecodeError:
            raise BadTensorRecord(path, where, f"name {name_b!r} is not ASCII") from None
        if not name or not name.isprintable() or " " in name or "\0" in name:
            raise BadTensorRecord(path, where, f"name {name!r} is empty or has blanks or control characters")
        if name in seen:
            raise DuplicateName(path, name, f"tensor name appears twice (again at record {i})")
        seen.add(name)
        known = [c for c in DTYPES if version >= 3 or c not in _blocks.BY_CODE]
        if code not in known:
            raise UnknownDtype(path, name, f"dtype code {code} is not one of {sorted(known)} (version {version})")
        if not 1 <= ndim <= MAX_NDIM:
            raise BadTensorRecord(path, name, f"ndim {ndim} is not in 1..{MAX_NDIM}")
        if res:
            raise BadTensorRecord(path, name, "reserved field must be zero")
        dims = (s0, s1, s2, s3)
        shape = dims[:ndim]
        if any(d == 0 for d in shape) or any(d != 0 for d in dims[ndim:]):
            raise BadTensorRecord(path, name, f"shape {dims} with ndim {ndim}: zero or stray dimension")
        dname = DTYPES[code][0]
        try:
            want = nbytes(dname, shape)
        except ValueError as e:
            raise BadTensorRecord(path, name, str(e)) from None
        if nbyt != want:
            raise BadTensorRecord(path, name, f"size {nbyt} bytes, but {dname}{list(shape)} needs {want}")
        if offset < data_offset or offset + nbyt > size:
            raise TensorOutOfBounds(path, name, f"bytes [{offset}, {offset + nbyt}) are outside the data "
                                                f"region [{data_offset}, {size})")
        if offset % alignment:
            raise Misaligned(path, name, f"offset {offset} is not a multiple of {alignment}")
        records.append(TensorRecord(i, name, dname, tuple(int(d) for d in shape), offset, nbyt, crc))
    by_offset = sorted(records, key=lambda r: r.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if b.offset < a.offset + a.size:
            raise TensorOutOfBounds(path, b.name, f"bytes [{b.offset}, {b.offset + b.size}) overlap tensor "
                                                  f"{a.name} [{a.offset}, {a.offset + a.size})")

    routing = []
    for layer in range(num_layers):
        gate, bias, top_k, n_exp, flags, shared_gate, res = ROUTING.unpack_from(mm, routing_offset + layer * ROUTING_RECORD_SIZE)
        *_, n_group, topk_group, rscale = ROUTING_V2.unpack_from(mm, routing_offset + layer * ROUTING_RECORD_SIZE)
        where = f"routing[{layer}]"
        for fname, idx in (("gate", gate), ("bias", bias), ("shared_gate", shared_gate)):
            if idx != NO_TENSOR and idx >= tensor_count:
                raise BadRouting(path, where, f"{fname} tensor index {idx} >= tensor_count {tensor_count}")
        if n_exp:
            if gate == NO_TENSOR:
                raise BadRouting(path, where, "a MoE layer needs a gate tensor")
            if n_exp != num_experts:
                raise BadRouting(path, where, f"num_experts {n_exp} differs from the header's {num_experts}")
            if not 1 <= top_k <= n_exp:
                raise BadRouting(path, where, f"top_k {top_k} is not in 1..{n_exp}")
        elif top_k or gate != NO_TENSOR or bias != NO_TENSOR or shared_gate != NO_TENSOR or flags or res:
            raise BadRouting(path, where, "a dense layer (num_experts 0) has a gate, bias, shared gate, top_k, "
                                          "flags or group fields")
        if version == 1:
            if flags & ~V1_FLAGS:
                raise BadRouting(path, where, f"unknown flag bits {flags:#x}")
            if n_exp and not flags & ROUTE_SOFTMAX:
                raise BadRouting(path, where, "a version-1 MoE layer needs the SOFTMAX flag")
            if bias != NO_TENSOR:
                raise BadRouting(path, where, "a version-1 routing record has no bias")
            if bool(flags & ROUTE_SHARED_EXPERT) != (shared_gate != NO_TENSOR):
                raise BadRouting(path, where, "the shared-expert flag and the shared_gate index disagree")
            if res:
                raise BadRouting(path, where, "reserved field must be zero")
            routing.append(RoutingRecord(gate, bias, top_k, n_exp, flags, shared_gate))
            continue
        if flags & ~V2_FLAGS:
            raise BadRouting(path, where, f"unknown flag bits {flags:#x}")
        if n_exp and bool(flags & ROUTE_SOFTMAX) == bool(flags & ROUTE_SIGMOID):
            raise BadRouting(path, where, "exactly one of the SOFTMAX and SIGMOID flags must be set")
        if shared_gate != NO_TENSOR and not flags & ROUTE_SHARED_EXPERT:
            raise BadRouting(path, where, "a shared_gate without the shared-expert flag")
        if flags & ROUTE_GROUP_LIMITED:
            if n_group < 2 or n_exp % n_group or not 1 <= topk_group <= n_group \
                    or topk_group * (n_exp // n_group) < top_k \
                    or (flags & ROUTE_SIGMOID and n_exp // n_group < 2):
                raise BadRouting(path, where, f"n_group {n_group} / topk_group {topk_group} do not fit "
                                              f"{n_exp} experts and top_k {top_k}")
        elif n_group > 1 or topk_group:
            raise BadRouting(path, where, "n_group / topk_group without the group-limited flag")
        else:
            n_group = 0                 # 0 or 1: no groups (docs/format.md)
        if flags & ROUTE_BIAS_IN_LOGITS and bias == NO_TENSOR:
            raise BadRouting(path, where, "the bias-in-logits flag without a bias")
        if flags & ROUTE_SPARSEMIXER and (top_k != 2 or flags & (ROUTE_SIGMOID | ROUTE_GROUP_LIMITED | ROUTE_RENORM)):
            raise BadRouting(path, where, "sparsemixer routing needs top_k 2 and softmax scores, no groups, no "
                                          "renormalising")
        if n_exp and not (math.isfinite(rscale) and rscale > 0):
            raise BadRouting(path, where, f"routed_scale {rscale!r} must be finite and > 0")
        routing.append(RoutingRecord(gate, bias, top_k, n_exp, flags, shared_gate, n_group, topk_group,
                                     rscale if n_exp else 1.0))
    return header, records, routing, blobs


def read_json_blob(path, field, text, required=True):
    """Parse one JSON blob (config, metadata) into a dict, or raise BadBlob/BadConfig naming it."""
    err = BadConfig if field == "config" else BadBlob
    if not text:
        if required:
            raise err(path, field, "is empty")
        return {}
    def no_constants(c):
        raise ValueError(f"{c} is not valid JSON")
    try:
        obj = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise err(path, field, f"is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise err(path, field, f"must be a JSON object, found {type(obj).__name__}")
    return obj


def is_expert_stack(name: str, shape, num_experts: int) -> bool:
    """True for a tensor holding one slice per routed expert of a layer (`blk.N.ffn_*_exps*`, leading
    dimension the model's expert count): each expert's slice is one contiguous byte range of it."""
    return num_experts > 0 and name.startswith("blk.") and "_exps" in name and len(shape) > 0 \
        and int(shape[0]) == num_experts
