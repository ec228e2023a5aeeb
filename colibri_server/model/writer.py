"""The .colibri writer: `ColibriWriter` declares every tensor first, then streams each tensor's bytes in
declaration order (so a converter never holds a whole model), into a temp file that is fsynced and
`os.replace`d over the target: a live server that maps the old file never sees a half-written one. The
layout it chooses (docs/format.md, *Layout*) is format.py's rules; the reader never relies on it."""
from __future__ import annotations

import json
import os
import tempfile
import zlib

import numpy as np

from . import format as fmt

__all__ = ["ColibriWriter"]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class ColibriWriter:
    """Streams a .colibri file: declare every tensor, then `write()` each one's bytes in
    declaration order (in as many chunks as you like), then `close()` commits it.

        with ColibriWriter(out, config=..., metadata=..., tokenizer_json=..., chat_template=...) as w:
            w.declare("token_embd", "f16", (V, D)); ...
            w.set_routing(records)
            for name, chunk in ...: w.write(name, chunk)

    Nothing appears at `out` until every byte is written and fsynced; on error the temp
    file is removed and `out` is left as it was."""

    def __init__(self, path, *, config: dict, metadata: dict, tokenizer_json: str = "",
                 chat_template: str = "", num_experts: int, num_layers: int):
        self.path = os.fspath(path)
        self._blobs = [json.dumps(config, sort_keys=True, allow_nan=False).encode(),
                       json.dumps(metadata, sort_keys=True, allow_nan=False).encode(),
                       tokenizer_json.encode("utf-8"), (chat_template or "").encode("utf-8")]
        self.num_experts, self.num_layers = num_experts, num_layers
        self._decl, self._index, self._routing = [], {}, None
        self._fh = None
        self._cur = 0          # index of the tensor being written
        self._written = 0      # bytes of it written so far
        self._crc = 0

    def declare(self, name: str, dtype: str, shape) -> int:
        if self._fh is not None:
            raise RuntimeError("declare() after writing started")
        if name in self._index:
            raise ValueError(f"tensor {name!r} declared twice")
        if not (name.isascii() and name.isprintable() and " " not in name and 0 < len(name) <= fmt.NAME_BYTES):
            raise ValueError(f"tensor name {name!r} must be 1..{fmt.NAME_BYTES} printable ASCII characters, no blanks")
        if dtype not in fmt.DTYPE_CODES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        shape = tuple(int(s) for s in shape)
        if not 1 <= len(shape) <= fmt.MAX_NDIM or min(shape) <= 0:
            raise ValueError(f"tensor {name!r}: bad shape {shape}")
        size = fmt.nbytes(dtype, shape)
        self._index[name] = len(self._decl)
        self._decl.append([name, dtype, shape, 0, size, 0])
        return self._index[name]

    def index(self, name: str) -> int:
        return self._index[name]

    def set_routing(self, records) -> None:
        """One record per layer: a RoutingRecord, or its fields as a tuple (gate, bias, top_k,
        num_experts, flags, shared_gate[, n_group, topk_group, routed_scale]). The file is
        version 2 when a record needs it, else version 1."""
        if len(records) != self.num_layers:
            raise ValueError(f"{len(records)} routing records for {self.num_layers} layers")
        self._routing = [r if isinstance(r, fmt.RoutingRecord) else fmt.RoutingRecord(*r) for r in records]
        self._version = 2 if any(r.is_v2 for r in self._routing) else 1
        if any(d[1] in fmt.BLOCK_DTYPES for d in self._decl):
            self._version = 3

    def _layout(self):
        table_end = fmt.HEADER_SIZE + len(self._decl) * fmt.RECORD_SIZE
        routing_offset = table_end
        pos = routing_offset + self.num_layers * fmt.ROUTING_RECORD_SIZE
        offs = []
        for b in self._blobs:
            offs.append((pos, len(b)))
            pos += len(b)
        data_offset = _align(pos, fmt.PAGE)
        pos = data_offset
        stack = [fmt.is_expert_stack(d[0], d[2], self.num_experts) for d in self._decl]
        for s, d in sorted(zip(stack, self._decl), key=lambda sd: sd[0]):     # stable: declaration order
            pos = _align(pos, fmt.PIECE if s and d[4] % (fmt.PIECE * d[2][0]) == 0 else fmt.ALIGNMENT)
            d[3] = pos
            pos += d[4]
        return routing_offset, offs, data_offset, pos

    def _start(self):
        if self._routing is None:
            raise RuntimeError("set_routing() must be called before writing tensor data")
        self._routing_offset, self._blob_offs, self._data_offset, self._file_size = self._layout()
        d = os.path.dirname(os.path.abspath(self.path))
        fd, self._tmp = tempfile.mkstemp(prefix=".colibri-", suffix=".tmp", dir=d)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)     # mkstemp makes 0600; a model file is as readable as any file
        self._fh = os.fdopen(fd, "wb")
        # placeholder header + table (rewritten with checksums at close); blobs are final now
        self._fh.write(b"\0" * self._data_offset)
        self._fh.seek(self._routing_offset)
        for r in self._routing:
            head = (r.gate, r.bias, r.top_k, r.num_experts, r.flags, r.shared_gate)
            if self._version == 1:
                self._fh.write(fmt.ROUTING.pack(*head, 0))
            else:
                self._fh.write(fmt.ROUTING_V2.pack(*head, r.n_group, r.topk_group,
                                               r.routed_scale if r.num_experts else 0.0))
        for (off, _), b in zip(self._blob_offs, self._blobs):
            self._fh.seek(off)
            self._fh.write(b)
        self._seek_to_tensor(0)

    def _seek_to_tensor(self, i):
        if i < len(self._decl):
            self._fh.seek(self._decl[i][3])

    def write(self, name: str, data) -> None:
        """Append bytes (any C-contiguous buffer, e.g. a numpy array of the declared dtype) to tensor `name`."""
        if self._fh is None:
            self._start()
        if self._cur >= len(self._decl) or self._decl[self._cur][0] != name:
            want = self._decl[self._cur][0] if self._cur < len(self._decl) else "(none left)"
            raise RuntimeError(f"writing {name!r} but the next tensor in declaration order is {want!r}")
        mv = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        d = self._decl[self._cur]
        if self._written + len(mv) > d[4]:
            raise ValueError(f"tensor {name!r}: {self._written + len(mv)} bytes written, declared {d[4]}")
        self._fh.write(mv)
        self._crc = zlib.crc32(mv, self._crc)
        self._written += len(mv)
        if self._written == d[4]:
            d[5] = self._crc
            self._cur, self._written, self._crc = self._cur + 1, 0, 0
            self._seek_to_tensor(self._cur)

    def close(self) -> None:
        if self._fh is None:
            self._start()
        if self._cur != len(self._decl):
            raise RuntimeError(f"tensor {self._decl[self._cur][0]!r} and later ones were never written")
        fh = self._fh
        fh.seek(0, os.SEEK_END)
        if fh.tell() < self._file_size:
            fh.truncate(self._file_size)
        (c, m, t, p) = self._blob_offs
        fh.seek(0)
        fh.write(fmt.HEADER.pack(fmt.MAGIC, self._version, self.num_experts, self.num_layers, fmt.HEADER_SIZE,
                                 len(self._decl), self._routing_offset, self._data_offset, self._file_size,
                                 c[0], c[1], m[0], m[1], t[0], t[1], p[0], p[1], fmt.ALIGNMENT, b"\0" * 12))
        for name, dtype, shape, off, size, crc in self._decl:
            dims = list(shape) + [0] * (fmt.MAX_NDIM - len(shape))
            fh.write(fmt.RECORD.pack(name.encode("ascii"), fmt.DTYPE_CODES[dtype], len(shape), 0, *dims, off, size, crc))
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        os.replace(self._tmp, self.path)
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._fh = None
        # the written pages sit in the page cache as 4 KiB folios; dropped, the first open reads
        # the file back on 2 MiB pages (hugepages.py)
        fmt.PAGES.drop_cached(self.path)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if getattr(self, "_tmp", None) and os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
        return False
