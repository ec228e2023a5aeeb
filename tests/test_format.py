"""The .colibri format (docs/format.md): round trip, every named error, writer safety, CLI, fuzz.

Bad files are crafted by patching the bytes of a valid file written by ColibriWriter, with
the field layout taken from format.HEADER / RECORD / ROUTING. `Patch.set_blobs` relays out the
blob region (and shifts the data region by whole pages) so a blob can be replaced by one of
any length while every other field stays consistent.
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri_server import cli
from colibri_server.model import format as fmt
from colibri_server.model.config import ROPE_TYPES, ModelConfig, expected_tensors
from colibri_server.model.engine import Model

NO = fmt.NO_TENSOR
BLOBS = ("config", "metadata", "tokenizer", "chat_template")
HDR_FIELDS = ("magic", "version", "num_experts", "num_layers", "header_size", "tensor_count",
              "routing_offset", "data_offset", "file_size",
              "config_offset", "config_size", "metadata_offset", "metadata_size",
              "tokenizer_offset", "tokenizer_size", "chat_template_offset", "chat_template_size",
              "alignment", "reserved")
REC_FIELDS = ("name", "dtype", "ndim", "reserved", "s0", "s1", "s2", "s3", "offset", "size", "crc32")
ROUTE_FIELDS = ("gate", "bias", "top_k", "num_experts", "flags", "shared_gate", "reserved")


def _codes(s):
    """Per-field struct codes of a Struct: '<4sII' -> ['4s', 'I', 'I']."""
    out = []
    for n, c in re.findall(r"(\d*)([a-zA-Z])", s.format):
        out += [n + c] if c == "s" else [c] * int(n or 1)
    return out


_MAX = {"B": 0xFF, "H": 0xFFFF, "I": 0xFFFFFFFF, "Q": 0xFFFFFFFFFFFFFFFF}
HDR_MAX = {f: _MAX.get(c) for f, c in zip(HDR_FIELDS, _codes(fmt.HEADER))}
REC_MAX = {f: _MAX.get(c) for f, c in zip(REC_FIELDS, _codes(fmt.RECORD))}
ROUTE_MAX = {f: _MAX.get(c) for f, c in zip(ROUTE_FIELDS, _codes(fmt.ROUTING))}
assert len(HDR_MAX) == len(_codes(fmt.HEADER)) and len(REC_MAX) == len(_codes(fmt.RECORD))
assert len(ROUTE_MAX) == len(_codes(fmt.ROUTING))

META = {"name": "tiny-test", "license": "apache-2.0", "converter": "test_format"}
TOKENIZER = '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}'
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %} \u2014 \u00fc\u00df \U0001F426"

_COMMON = dict(vocab_size=32, hidden_size=16, rms_norm_eps=1e-5, max_position_embeddings=64)
CONFIGS = {
    # all MoE, renorm, f16, untied
    "mixtral": dict(_COMMON, arch="mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                    num_experts=4, top_k=2, moe_intermediate_size=8, rope_theta=1e6,
                    bos_token_id=1, eos_token_ids=(2,), dtype="f16"),
    # dense layer 0, shared expert, qkv bias, no renorm, bf16, tied embeddings
    "qwen2": dict(_COMMON, arch="qwen2_moe", num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
                  num_experts=4, top_k=2, moe_intermediate_size=8, intermediate_size=24,
                  shared_expert_intermediate_size=8, dense_layers=(0,), qkv_bias=True, norm_topk_prob=False,
                  tie_word_embeddings=True, rope_theta=1e4, dtype="bf16"),
    # per-head qk norm, q/k/v/o bias, yarn, sliding window, f16
    "qwen3": dict(_COMMON, arch="qwen3_moe", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  num_experts=4, top_k=1, moe_intermediate_size=8, qkv_bias=True, o_bias=True, qk_norm="head",
                  sliding_window=16, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                   "original_max_position_embeddings": 32},
                  rope_theta=1e6, dtype="f16"),
    # full qk norm, clip_qkv, f32
    "olmoe": dict(_COMMON, arch="olmoe", num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                  num_experts=8, top_k=8, moe_intermediate_size=4, qk_norm="full", clip_qkv=8.0,
                  norm_topk_prob=False, rope_theta=1e4, dtype="f32"),
}


# ---------------------------------------------------------------------------- building files

def _random_tensor(rng, dtype, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16).view(np.uint16)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)  # bf16: top half of the f32


def routing_records(cfg: ModelConfig, index):
    """The routing table of convert.py::_routing."""
    recs = []
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            recs.append((NO, NO, 0, 0, 0, NO))
            continue
        flags = fmt.ROUTE_SOFTMAX | (fmt.ROUTE_RENORM if cfg.norm_topk_prob else 0)
        shared = NO
        if cfg.shared_expert_intermediate_size:
            flags |= fmt.ROUTE_SHARED_EXPERT
            shared = index(f"blk.{i}.ffn_shexp_gate")
        recs.append((index(f"blk.{i}.ffn_gate_inp"), NO, cfg.top_k, cfg.num_experts, flags, shared))
    return recs


def build_file(path, cfg: ModelConfig, seed=0, override=None, skip=(), extra=()):
    """Write a valid (unless override/skip/extra say otherwise) file; return {name: stored array}."""
    override = override or {}
    plan = [(n, *override.get(n, (dts[0], shape))) for n, shape, dts in expected_tensors(cfg) if n not in skip]
    plan += list(extra)
    rng = np.random.default_rng(seed)
    data = {n: _random_tensor(rng, dt, shape) for n, dt, shape in plan}
    with fmt.ColibriWriter(path, config=cfg.to_dict(), metadata=META, tokenizer_json=TOKENIZER,
                           chat_template=TEMPLATE, num_experts=cfg.num_experts, num_layers=cfg.num_layers) as w:
        for n, dt, shape in plan:
            w.declare(n, dt, shape)
        w.set_routing(routing_records(cfg, w.index))
        for n, _, _ in plan:
            flat = data[n].reshape(-1)
            w.write(n, flat[:len(flat) // 3])          # in chunks, as a converter streams
            w.write(n, flat[len(flat) // 3:])
    return data


class Base:
    """A valid file: its config, the stored tensor arrays and its bytes (a plain class, so that
    hypothesis prints it as Base('name'), not field by field)."""

    def __init__(self, name, path, cfg: ModelConfig, data: dict, raw: bytes):
        self.name, self.path, self.cfg, self.data, self.raw = name, path, cfg, data, raw

    def patch(self):
        return Patch(self.raw)

    def __repr__(self):
        return f"Base({self.name!r})"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    out = {}
    for name, kw in CONFIGS.items():
        cfg = ModelConfig(**kw)
        cfg.check()
        path = str(d / f"{name}.colibri")
        data = build_file(path, cfg)
        with open(path, "rb") as f:
            out[name] = Base(name, path, cfg, data, f.read())
    return out


@pytest.fixture(scope="module")
def base(bases):
    return bases["mixtral"]


class Patch:
    """A mutable copy of a file's bytes, with field-level setters."""

    def __init__(self, raw):
        self.b = bytearray(raw)

    # header
    def header(self):
        return dict(zip(HDR_FIELDS, fmt.HEADER.unpack_from(self.b, 0)))

    def set_header(self, **kw):
        h = self.header()
        assert set(kw) <= set(h), kw
        h.update(kw)
        fmt.HEADER.pack_into(self.b, 0, *h.values())

    # tensor records
    def count(self):
        return fmt.HEADER.unpack_from(self.b, 0)[5]

    def index(self, name):
        for i in range(self.count()):
            if self.record(i)["name"].rstrip(b"\0") == name.encode():
                return i
        raise KeyError(name)

    def record(self, i):
        i = self.index(i) if isinstance(i, str) else i
        return dict(zip(REC_FIELDS, fmt.RECORD.unpack_from(self.b, fmt.HEADER_SIZE + i * fmt.RECORD_SIZE)))

    def set_record(self, which, **kw):
        i = self.index(which) if isinstance(which, str) else which
        r = self.record(i)
        assert set(kw) <= set(r), kw
        r.update(kw)
        fmt.RECORD.pack_into(self.b, fmt.HEADER_SIZE + i * fmt.RECORD_SIZE, *r.values())

    # routing records
    def route(self, layer):
        pos = self.header()["routing_offset"] + layer * fmt.ROUTING_RECORD_SIZE
        return dict(zip(ROUTE_FIELDS, fmt.ROUTING.unpack_from(self.b, pos)))

    def set_route(self, layer, **kw):
        r = self.route(layer)
        assert set(kw) <= set(r), kw
        r.update(kw)
        fmt.ROUTING.pack_into(self.b, self.header()["routing_offset"] + layer * fmt.ROUTING_RECORD_SIZE, *r.values())

    # blobs
    def blob(self, name):
        h = self.header()
        off, n = h[name + "_offset"], h[name + "_size"]
        return bytes(self.b[off:off + n])

    def set_blobs(self, **new):
        """Replace blobs (bytes) and relay out: blobs packed after the routing table, data_offset
        re-aligned to a page, every tensor offset shifted by the same whole number of pages."""
        h = self.header()
        routing_end = h["routing_offset"] + h["num_layers"] * fmt.ROUTING_RECORD_SIZE
        blobs = {k: new.get(k, self.blob(k)) for k in BLOBS}
        head, upd = bytearray(self.b[:routing_end]), {}
        for k in BLOBS:
            upd[k + "_offset"], upd[k + "_size"] = len(head), len(blobs[k])
            head += blobs[k]
        data_offset = -(-len(head) // fmt.PAGE) * fmt.PAGE
        head += bytes(data_offset - len(head))
        self.b = head + self.b[h["data_offset"]:]
        upd.update(data_offset=data_offset, file_size=len(self.b))
        self.set_header(**upd)
        for i in range(h["tensor_count"]):
            self.set_record(i, offset=self.record(i)["offset"] + data_offset - h["data_offset"])

    def set_config(self, base, **changes):
        d = base.cfg.to_dict()
        for k, v in changes.items():
            if v is _DEL:
                del d[k]
            else:
                d[k] = v
        self.set_blobs(config=json.dumps(d).encode())

    def write(self, path):
        with open(path, "wb") as f:
            f.write(self.b)
        return str(path)


_DEL = object()


def expect_error(path, exc, field, deep=False):
    """Model.open raises exactly `exc` whose field is `field` and whose message names it."""
    with pytest.raises(fmt.ColibriFormatError) as ei:
        Model.open(path, deep=deep).close()
    e = ei.value
    assert type(e) is exc, f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    assert e.field == field, f"field {e.field!r}, expected {field!r}: {e}"
    assert field in str(e) and str(path) in str(e)
    return e


# ---------------------------------------------------------------------------- valid files

@pytest.mark.parametrize("arch", list(CONFIGS))
def test_round_trip(bases, arch):
    b = bases[arch]
    cf = fmt.ColibriFile.open(b.path)
    try:
        h = cf.header
        assert h["file_size"] == os.path.getsize(b.path) and h["data_offset"] % fmt.PAGE == 0
        assert h["num_layers"] == b.cfg.num_layers and h["num_experts"] == b.cfg.num_experts
        assert h["alignment"] == fmt.ALIGNMENT and h["tensor_count"] == len(b.data)
        assert [r.name for r in cf.record_list] == list(b.data)
        assert json.loads(cf.config_json) == json.loads(json.dumps(b.cfg.to_dict()))
        assert ModelConfig.from_dict(json.loads(cf.config_json)) == b.cfg
        assert json.loads(cf.metadata_json) == META
        assert cf.tokenizer_json == TOKENIZER and cf.chat_template == TEMPLATE
        names = [r.name for r in cf.record_list]
        for i, rt in enumerate(cf.routing):
            assert tuple(rt.__dict__.values()) == (*routing_records(b.cfg, names.index)[i], 0, 0, 1.0)
        prev_end = h["data_offset"]
        for r in cf.record_list:
            want = b.data[r.name]
            v = cf.view(r.name)
            assert r.offset % fmt.ALIGNMENT == 0 and r.offset >= prev_end
            prev_end = r.offset + r.size
            assert v.dtype == fmt.DTYPES[fmt.DTYPE_CODES[r.dtype]][1] == want.dtype
            assert v.shape == want.shape and v.tobytes() == want.tobytes()
            assert bytes(cf.tensor_bytes(r.name)) == want.tobytes()
            assert r.crc32 == zlib.crc32(want.tobytes())
            assert r.size == want.nbytes == fmt.nbytes(r.dtype, r.shape)
        assert prev_end == h["file_size"]
        cf.verify_checksums()
    finally:
        cf.close()
    m = Model.open(b.path, deep=True)
    assert m.config == b.cfg and m.metadata == META
    m.close()


def test_views_are_read_only_and_zero_copy(base):
    cf = fmt.ColibriFile.open(base.path)
    try:
        a, b = cf.view("blk.1.ffn_up_exps"), cf.view("blk.1.ffn_up_exps")
        assert a is not b and np.shares_memory(a, b)
        assert not np.shares_memory(a, cf.view("blk.1.ffn_gate_exps"))
        for v in (a, cf.view("output_norm")):
            assert not v.flags.writeable
            with pytest.raises(ValueError):
                v[...] = 0
            with pytest.raises(ValueError):
                v.setflags(write=True)
            x = v
            while isinstance(x, np.ndarray):
                x = x.base
            assert isinstance(x, memoryview) and x.obj is cf._mm     # a view of the one mapping
        del a, b, v
    finally:
        cf.close()


def test_stacked_view_is_the_rows_of_tensors_stored_back_to_back(base):
    cf = fmt.ColibriFile.open(base.path)
    try:
        names = ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]
        s = cf.stacked_view(names)
        assert s is not None and not s.flags.writeable
        np.testing.assert_array_equal(s, np.concatenate([cf.view(n) for n in names]))
        assert np.shares_memory(s, cf.view("blk.0.attn_v"))            # a view, no copy
        assert cf.stacked_view(["blk.0.attn_q", "blk.0.attn_v"]) is None      # a gap (attn_k)
        assert cf.stacked_view(["blk.0.attn_k", "blk.0.attn_q"]) is None      # not in file order
        assert cf.stacked_view(["blk.0.ffn_gate_inp", "blk.0.ffn_gate_exps"]) is None   # f32 2-D, f16 3-D
        assert cf.stacked_view(["blk.0.ffn_gate_exps", "blk.0.ffn_up_exps"]) is None    # 3-D
        assert cf.stacked_view(["blk.0.attn_norm", "blk.0.attn_q"]) is None   # 1-D and 2-D
        assert cf.stacked_view(["blk.0.attn_q", "no_such_tensor"]) is None
        del s
    finally:
        cf.close()


def test_empty_optional_blobs_are_valid(base, tmp_path):
    p = base.patch()
    p.set_blobs(metadata=b"", tokenizer=b"", chat_template=b"")
    m = Model.open(p.write(tmp_path / "f.colibri"), deep=True)
    assert m.metadata == {} and m.file.tokenizer_json == "" and m.file.chat_template == ""
    m.close()


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        fmt.ColibriFile.open("/nonexistent/x.colibri")


# ---------------------------------------------------------------------------- named errors

def _hdr(**kw):
    return lambda p, b: p.set_header(**kw)


def _rec(which, **kw):
    return lambda p, b: p.set_record(which, **kw)


def _route(layer, **kw):
    return lambda p, b: p.set_route(layer, **kw)


def _truncate(n):
    def f(p, b):
        p.b = p.b[:n if n >= 0 else len(p.b) + n]
    return f


def _append(p, b):
    p.b += b"\0" * 8


def _blob_byte(name):
    def f(p, b):
        p.b[p.header()[name + "_offset"] + 1] = 0xFF
    return f


def _blobs(**kw):
    return lambda p, b: p.set_blobs(**kw)


def _config(**kw):
    return lambda p, b: p.set_config(b, **kw)


def _header_rel(field, fn):
    return lambda p, b: p.set_header(**{field: fn(p.header())})


CASES = [
    # (base, mutation, error, field)
    pytest.param("mixtral", _hdr(magic=b"GGUF"), fmt.BadMagic, "magic", id="magic"),
    pytest.param("mixtral", _hdr(version=3), fmt.UnsupportedVersion, "version", id="version-3"),
    pytest.param("mixtral", _hdr(version=0), fmt.UnsupportedVersion, "version", id="version-0"),
    pytest.param("mixtral", _truncate(100), fmt.Truncated, "header", id="shorter-than-header"),
    pytest.param("mixtral", _truncate(0), fmt.Truncated, "header", id="empty-file"),
    pytest.param("mixtral", _truncate(-1), fmt.Truncated, "file_size", id="truncated-by-one"),
    pytest.param("mixtral", _truncate(5000), fmt.Truncated, "file_size", id="truncated-in-data"),
    pytest.param("mixtral", _header_rel("file_size", lambda h: h["file_size"] + 4096), fmt.Truncated,
                 "file_size", id="file_size-too-big"),
    pytest.param("mixtral", _hdr(header_size=64), fmt.BadHeader, "header_size", id="header_size"),
    pytest.param("mixtral", _append, fmt.BadHeader, "file_size", id="trailing-bytes"),
    pytest.param("mixtral", _hdr(alignment=0), fmt.BadHeader, "alignment", id="alignment-0"),
    pytest.param("mixtral", _hdr(alignment=48), fmt.BadHeader, "alignment", id="alignment-not-pow2"),
    pytest.param("mixtral", _hdr(alignment=8192), fmt.BadHeader, "alignment", id="alignment-gt-page"),
    pytest.param("mixtral", _hdr(num_layers=0), fmt.BadHeader, "num_layers", id="num_layers-0"),
    pytest.param("mixtral", _hdr(num_layers=4097), fmt.BadHeader, "num_layers", id="num_layers-big"),
    pytest.param("mixtral", _hdr(num_experts=65537), fmt.BadHeader, "num_experts", id="num_experts-big"),
    pytest.param("mixtral", _hdr(data_offset=4097), fmt.BadHeader, "data_offset", id="data_offset-unaligned"),
    pytest.param("mixtral", _header_rel("data_offset", lambda h: (h["file_size"] // 4096 + 1) * 4096),
                 fmt.BadHeader, "data_offset", id="data_offset-past-eof"),
    pytest.param("mixtral", _hdr(tensor_count=0), fmt.BadHeader, "tensor_count", id="tensor_count-0"),
    pytest.param("mixtral", _hdr(tensor_count=100), fmt.BadHeader, "tensor_count", id="tensor_count-big"),
    pytest.param("mixtral", _hdr(tensor_count=2**32 - 1), fmt.BadHeader, "tensor_count", id="tensor_count-max"),
    pytest.param("mixtral", _hdr(routing_offset=64), fmt.BadHeader, "routing_offset", id="routing-in-table"),
    pytest.param("mixtral", _header_rel("routing_offset", lambda h: h["data_offset"] - 32), fmt.BadHeader,
                 "routing_offset", id="routing-past-data_offset"),
    pytest.param("mixtral", _hdr(config_offset=64), fmt.BadHeader, "config_offset", id="config-in-table"),
    pytest.param("mixtral", _hdr(metadata_size=10**6), fmt.BadHeader, "metadata_offset", id="metadata-too-long"),
    pytest.param("mixtral", _header_rel("tokenizer_offset", lambda h: h["data_offset"]), fmt.BadHeader,
                 "tokenizer_offset", id="tokenizer-in-data"),
    pytest.param("mixtral", _hdr(chat_template_offset=2**64 - 1), fmt.BadHeader, "chat_template_offset",
                 id="template-offset-max"),
    # header fields checked against the config (weights.check_tensors)
    pytest.param("mixtral", _hdr(num_layers=1), fmt.BadHeader, "num_layers", id="num_layers-vs-config"),
    pytest.param("mixtral", lambda p, b: (p.set_header(num_experts=8), p.set_route(0, num_experts=8),
                                          p.set_route(1, num_experts=8)),
                 fmt.BadHeader, "num_experts", id="num_experts-vs-config"),
    # tensor records
    pytest.param("mixtral", lambda p, b: p.set_record("token_embd", offset=p.header()["file_size"]),
                 fmt.TensorOutOfBounds, "token_embd", id="offset-past-eof"),
    pytest.param("mixtral", lambda p, b: p.set_record("token_embd", offset=p.header()["data_offset"] - 64),
                 fmt.TensorOutOfBounds, "token_embd", id="offset-before-data"),
    pytest.param("mixtral", lambda p, b: p.set_record("output", offset=p.record("output")["offset"] + 64),
                 fmt.TensorOutOfBounds, "output", id="end-past-eof"),
    pytest.param("mixtral", _rec("token_embd", offset=2**64 - 64), fmt.TensorOutOfBounds, "token_embd",
                 id="offset-max"),
    pytest.param("mixtral", lambda p, b: p.set_record("token_embd", offset=p.record("token_embd")["offset"] + 2),
                 fmt.Misaligned, "token_embd", id="offset-plus-2"),
    pytest.param("mixtral", _hdr(alignment=128), fmt.Misaligned, "blk.0.attn_q", id="alignment-128"),
    pytest.param("mixtral", _rec("token_embd", dtype=5), fmt.UnknownDtype, "token_embd", id="dtype-5"),
    # f16p on a matrix of 64 columns: not whole 256-column panels
    pytest.param("mixtral", _rec("token_embd", dtype=3), fmt.BadTensorRecord, "token_embd", id="f16p-partial-panel"),
    pytest.param("mixtral", _rec("blk.0.attn_norm", dtype=4, size=128), fmt.BadTensorRecord, "blk.0.attn_norm",
                 id="bf16p-vector"),
    pytest.param("mixtral", _rec("output", dtype=255), fmt.UnknownDtype, "output", id="dtype-255"),
    pytest.param("mixtral", _rec(0, name=b"\xfftoken"), fmt.BadTensorRecord, "tensor record 0", id="name-non-ascii"),
    pytest.param("mixtral", _rec(0, name=b""), fmt.BadTensorRecord, "tensor record 0", id="name-empty"),
    pytest.param("mixtral", _rec(3, name=b"token embd"), fmt.BadTensorRecord, "tensor record 3", id="name-blank"),
    pytest.param("mixtral", _rec(0, name=b"tok\0embd"), fmt.BadTensorRecord, "tensor record 0", id="name-inner-nul"),
    pytest.param("mixtral", _rec(0, name=b"tok\tembd"), fmt.BadTensorRecord, "tensor record 0", id="name-control"),
    pytest.param("mixtral", _rec("token_embd", ndim=0), fmt.BadTensorRecord, "token_embd", id="ndim-0"),
    pytest.param("mixtral", _rec("token_embd", ndim=5), fmt.BadTensorRecord, "token_embd", id="ndim-5"),
    pytest.param("mixtral", _rec("token_embd", s1=0), fmt.BadTensorRecord, "token_embd", id="shape-zero-dim"),
    pytest.param("mixtral", _rec("token_embd", s2=1), fmt.BadTensorRecord, "token_embd", id="shape-stray-dim"),
    pytest.param("mixtral", lambda p, b: p.set_record("token_embd", size=p.record("token_embd")["size"] + 2),
                 fmt.BadTensorRecord, "token_embd", id="size-wrong"),
    pytest.param("mixtral", _rec(1, name=b"token_embd"), fmt.DuplicateName, "token_embd", id="duplicate"),
    # blobs
    pytest.param("mixtral", _blob_byte("config"), fmt.BadBlob, "config", id="config-not-utf8"),
    pytest.param("mixtral", _blob_byte("metadata"), fmt.BadBlob, "metadata", id="metadata-not-utf8"),
    pytest.param("mixtral", _blob_byte("tokenizer"), fmt.BadBlob, "tokenizer", id="tokenizer-not-utf8"),
    pytest.param("mixtral", _blob_byte("chat_template"), fmt.BadBlob, "chat_template", id="template-not-utf8"),
    pytest.param("mixtral", _blobs(metadata=b"{not json"), fmt.BadBlob, "metadata", id="metadata-not-json"),
    pytest.param("mixtral", _blobs(metadata=b"[1, 2]"), fmt.BadBlob, "metadata", id="metadata-not-object"),
    # config
    pytest.param("mixtral", _blobs(config=b'{"arch": "mixtral",'), fmt.BadConfig, "config", id="config-not-json"),
    pytest.param("mixtral", _blobs(config=b""), fmt.BadConfig, "config", id="config-empty"),
    pytest.param("mixtral", _blobs(config=b"[]"), fmt.BadConfig, "config", id="config-not-object"),
    pytest.param("mixtral", _config(foo=1), fmt.BadConfig, "config.foo", id="config-unknown-key"),
    pytest.param("mixtral", _config(arch=_DEL), fmt.BadConfig, "config.arch", id="config-missing-key"),
    pytest.param("mixtral", _config(hidden_size="16"), fmt.BadConfig, "config.hidden_size", id="config-str-for-int"),
    pytest.param("mixtral", _config(vocab_size=True), fmt.BadConfig, "config.vocab_size", id="config-bool-for-int"),
    pytest.param("mixtral", _config(rope_theta="1e6"), fmt.BadConfig, "config.rope_theta", id="config-str-float"),
    pytest.param("mixtral", _config(eos_token_ids=2), fmt.BadConfig, "config.eos_token_ids", id="config-int-for-list"),
    pytest.param("mixtral", _config(arch="gpt2"), fmt.BadConfig, "config.arch", id="config-bad-arch"),
    pytest.param("mixtral", _config(num_kv_heads=3), fmt.BadConfig, "config.num_kv_heads", id="config-kv-heads"),
    pytest.param("mixtral", _config(top_k=5), fmt.BadConfig, "config.top_k", id="config-top_k-gt-E"),
    pytest.param("mixtral", _config(dense_layers=[7]), fmt.BadConfig, "config.dense_layers", id="config-dense-layers"),
    pytest.param("mixtral", _config(rms_norm_eps=0), fmt.BadConfig, "config.rms_norm_eps", id="config-eps-0"),
    pytest.param("mixtral", _config(eos_token_ids=[32]), fmt.BadConfig, "config.eos_token_ids", id="config-eos"),
    pytest.param("mixtral", _config(dtype="q4"), fmt.BadConfig, "config.dtype", id="config-dtype"),
    pytest.param("mixtral", _config(rope_scaling={"rope_type": "dynamic"}), fmt.BadConfig, "config.rope_scaling",
                 id="config-rope-type"),
    # routing table: structure (format.py)
    pytest.param("mixtral", _route(0, gate=23), fmt.BadRouting, "routing[0]", id="gate-index-out-of-table"),
    pytest.param("mixtral", _route(1, bias=10**6), fmt.BadRouting, "routing[1]", id="bias-index-out-of-table"),
    pytest.param("mixtral", _route(0, shared_gate=10**6), fmt.BadRouting, "routing[0]", id="shared-index-out"),
    pytest.param("mixtral", _route(0, gate=NO), fmt.BadRouting, "routing[0]", id="moe-without-gate"),
    pytest.param("mixtral", _route(1, num_experts=3), fmt.BadRouting, "routing[1]", id="num_experts-vs-header"),
    pytest.param("mixtral", _route(0, top_k=0), fmt.BadRouting, "routing[0]", id="top_k-0"),
    pytest.param("mixtral", _route(0, top_k=5), fmt.BadRouting, "routing[0]", id="top_k-gt-E"),
    pytest.param("mixtral", _route(0, num_experts=0), fmt.BadRouting, "routing[0]", id="dense-with-top_k"),
    pytest.param("mixtral", _route(0, flags=fmt.ROUTE_SOFTMAX | 8), fmt.BadRouting, "routing[0]", id="flags-unknown"),
    # routing table against the config (weights.check_tensors)
    pytest.param("mixtral", _route(1, gate=NO, top_k=0, num_experts=0), fmt.BadRouting, "routing[1]",
                 id="dense-but-config-moe"),
    pytest.param("qwen2", lambda p, b: p.set_route(0, gate=p.index("blk.1.ffn_gate_inp"), top_k=2, num_experts=4),
                 fmt.BadRouting, "routing[0]", id="moe-but-config-dense"),
    pytest.param("mixtral", _route(0, gate=0), fmt.BadRouting, "routing[0]", id="gate-wrong-tensor"),
    pytest.param("mixtral", lambda p, b: p.set_route(1, gate=p.index("blk.0.ffn_gate_inp")), fmt.BadRouting,
                 "routing[1]", id="gate-other-layer"),
    pytest.param("mixtral", _route(0, bias=1), fmt.BadRouting, "routing[0]", id="bias-unsupported"),
    pytest.param("mixtral", _route(0, flags=fmt.ROUTE_SOFTMAX | fmt.ROUTE_SHARED_EXPERT), fmt.BadRouting,
                 "routing[0]", id="shared-flag-vs-config"),
    pytest.param("qwen2", _route(1, flags=fmt.ROUTE_SOFTMAX), fmt.BadRouting, "routing[1]", id="no-shared-flag"),
    pytest.param("qwen2", lambda p, b: p.set_route(2, shared_gate=p.index("blk.1.ffn_shexp_gate")), fmt.BadRouting,
                 "routing[2]", id="shared-gate-wrong-tensor"),
    pytest.param("mixtral", _route(0, flags=fmt.ROUTE_RENORM), fmt.BadRouting, "routing[0]", id="no-softmax"),
    # tensors against the config
    pytest.param("mixtral", _rec("output", name=b"outpuX"), fmt.MissingTensor, "output", id="missing-output"),
    pytest.param("mixtral", _rec("blk.1.ffn_down_exps", name=b"blk.1.ffn_down_expz"), fmt.MissingTensor,
                 "blk.1.ffn_down_exps", id="missing-experts"),
    pytest.param("mixtral", _rec("blk.0.attn_norm", dtype=1, size=32), fmt.ShapeMismatch, "blk.0.attn_norm",
                 id="norm-not-f32"),
    pytest.param("mixtral", _rec("blk.1.attn_q", dtype=2), fmt.ShapeMismatch, "blk.1.attn_q", id="bf16-not-f16"),
    pytest.param("mixtral", _rec("token_embd", s0=16, s1=32), fmt.ShapeMismatch, "token_embd", id="shape-transposed"),
    pytest.param("mixtral", _rec("token_embd", ndim=1, s0=512, s1=0), fmt.ShapeMismatch, "token_embd", id="shape-flat"),
    pytest.param("mixtral", _config(hidden_size=32, num_heads=8, num_kv_heads=4), fmt.ShapeMismatch, "token_embd",
                 id="config-disagrees-with-tensors"),
]


@pytest.mark.parametrize("arch, mutate, exc, field", CASES)
def test_named_error(bases, tmp_path, arch, mutate, exc, field):
    p = bases[arch].patch()
    mutate(p, bases[arch])
    expect_error(p.write(tmp_path / "bad.colibri"), exc, field)


@pytest.mark.parametrize("override, field", [
    ({"blk.0.attn_q": ("f32", (16, 16))}, "blk.0.attn_q"),          # matrix in f32, the file's dtype is f16
    ({"blk.1.ffn_gate_inp": ("f16", (4, 16))}, "blk.1.ffn_gate_inp"),  # router gate must be f32
    ({"blk.0.ffn_up_exps": ("f16", (4, 16, 8))}, "blk.0.ffn_up_exps"),  # transposed experts
])
def test_shape_mismatch_written(base, tmp_path, override, field):
    path = tmp_path / "bad.colibri"
    build_file(path, base.cfg, override=override)
    expect_error(path, fmt.ShapeMismatch, field)


def test_unexpected_extra_tensor(base, tmp_path):
    path = tmp_path / "bad.colibri"
    build_file(path, base.cfg, extra=[("blk.0.ffn_extra", "f32", (16,))])
    e = expect_error(path, fmt.ShapeMismatch, "blk.0.ffn_extra")
    assert "unexpected" in str(e)


def test_missing_tensor_written(base, tmp_path):
    path = tmp_path / "bad.colibri"
    build_file(path, base.cfg, skip=("blk.1.ffn_norm",))
    expect_error(path, fmt.MissingTensor, "blk.1.ffn_norm")


@pytest.mark.parametrize("how", ["data", "crc"])
def test_checksum_mismatch_only_when_deep(base, tmp_path, how):
    p = base.patch()
    name = "blk.1.ffn_up_exps" if how == "data" else "output_norm"
    r = p.record(name)
    if how == "data":
        p.b[r["offset"] + 5] ^= 0x40
    else:
        p.set_record(name, crc32=r["crc32"] ^ 1)
    path = p.write(tmp_path / "bad.colibri")
    Model.open(path).close()                                   # structurally valid
    expect_error(path, fmt.ChecksumMismatch, name, deep=True)
    cf = fmt.ColibriFile.open(path)
    with pytest.raises(fmt.ChecksumMismatch):
        cf.verify_checksums()
    cf.close()


# ---------------------------------------------------------------------------- found while writing these tests
# Each of these files is accepted (or crashes with a non-format error) today; the expected
# error class is the proposed fix (see the report). They fail until the reader is fixed.

def test_regression_routing_top_k_must_match_config(base, tmp_path):
    # routing top_k 4 > config top_k 2: Workspace.route_idx has top_k columns, so K.route
    # (Numba, no bounds checks) would write past them on the first MoE step.
    p = base.patch()
    p.set_route(0, top_k=4)
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.BadRouting, "routing[0]")


def test_regression_shared_flag_without_shared_gate(bases, tmp_path):
    # shared-expert flag set, shared_gate = NO_TENSOR: weights.check_tensors does names[0xFFFFFFFF]
    p = bases["qwen2"].patch()
    p.set_route(1, shared_gate=NO)
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.BadRouting, "routing[1]")


def test_regression_huge_int_for_float_config_key(base, tmp_path):
    # config._coerce does float(10**400): OverflowError
    p = base.patch()
    p.set_blobs(config=json.dumps(dict(base.cfg.to_dict(), rms_norm_eps=10**400)).encode())
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.BadConfig, "config.rms_norm_eps")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear"},                                             # KeyError 'factor'
    {"rope_type": "linear", "factor": "x"},                              # ValueError from np.float32
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},                          # ZeroDivisionError
    {"rope_type": "yarn", "factor": "2"},                                # TypeError
    {"rope_type": "yarn", "original_max_position_embeddings": -5},       # math domain error
])
def test_regression_rope_scaling_params_unchecked(base, tmp_path, rope):
    p = base.patch()
    p.set_config(base, rope_scaling=rope)
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.BadConfig, "config.rope_scaling")


def test_regression_overlapping_tensors(base, tmp_path):
    # two records describing the same bytes are accepted
    p = base.patch()
    p.set_record("blk.0.ffn_norm", offset=p.record("blk.0.attn_norm")["offset"])
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.TensorOutOfBounds, "blk.0.ffn_norm")


def test_regression_overlapping_blobs(base, tmp_path):
    # the metadata region is the config's bytes; also accepted today
    p = base.patch()
    h = p.header()
    p.set_header(metadata_offset=h["config_offset"], metadata_size=h["config_size"])
    expect_error(p.write(tmp_path / "bad.colibri"), fmt.BadHeader, "metadata_offset")


# ---------------------------------------------------------------------------- writer safety

def _writer(path, cfg):
    return fmt.ColibriWriter(path, config=cfg.to_dict(), metadata=META, tokenizer_json=TOKENIZER,
                             chat_template=TEMPLATE, num_experts=cfg.num_experts, num_layers=cfg.num_layers)


def _declare_all(w, cfg):
    plan = [(n, dts[0], s) for n, s, dts in expected_tensors(cfg)]
    for n, dt, s in plan:
        w.declare(n, dt, s)
    w.set_routing(routing_records(cfg, w.index))
    return plan


def _temps(d):
    return [f for f in os.listdir(d) if f.endswith(".tmp") or f.startswith(".colibri-")]


@pytest.mark.parametrize("when", ["before-data", "mid-tensor", "after-all-data"])
def test_writer_exception_leaves_nothing(base, tmp_path, when):
    target = tmp_path / "m.colibri"
    with pytest.raises(KeyError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            if when != "before-data":
                for n, dt, s in plan:
                    a = base.data[n].reshape(-1)
                    w.write(n, a if when == "after-all-data" else a[:3])
                    if when == "mid-tensor":
                        break
            raise KeyError("boom")
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_failed_rewrite_keeps_target(base, tmp_path):
    target = tmp_path / "m.colibri"
    target.write_bytes(base.raw)
    ino, before = os.stat(target).st_ino, target.read_bytes()
    with pytest.raises(KeyError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            w.write(plan[0][0], np.zeros(plan[0][2], np.uint16))
            raise KeyError("boom")
    with pytest.raises(RuntimeError, match="never written"):
        with _writer(target, base.cfg) as w:
            _declare_all(w, base.cfg)
    assert target.read_bytes() == before and os.stat(target).st_ino == ino and _temps(tmp_path) == []
    Model.open(target, deep=True).close()


def test_writer_rewrite_does_not_disturb_live_mapping(base, tmp_path):
    # the writer replaces the file (new inode): a mapping of the old one keeps the old bytes
    target = tmp_path / "m.colibri"
    target.write_bytes(base.raw)
    cf = fmt.ColibriFile.open(target)
    old = cf.view("token_embd")
    new_data = build_file(target, base.cfg, seed=99)
    assert old.tobytes() == base.data["token_embd"].tobytes() != new_data["token_embd"].tobytes()
    cf2 = fmt.ColibriFile.open(target)
    assert cf2.view("token_embd").tobytes() == new_data["token_embd"].tobytes()
    del old
    cf.close()
    cf2.close()


def test_writer_misuse_raises(base, tmp_path):
    target = tmp_path / "m.colibri"
    w = _writer(target, base.cfg)
    plan = _declare_all(w, base.cfg)
    with pytest.raises(ValueError):
        w.declare(plan[0][0], "f16", (1,))                       # declared twice
    with pytest.raises(ValueError):
        w.declare("x" * 25, "f32", (1,))                        # name too long
    with pytest.raises(ValueError):
        w.declare("x", "q4", (1,))                              # unknown dtype
    with pytest.raises(ValueError):
        w.declare("x", "f32", (0,))                             # empty dimension
    with pytest.raises(ValueError):
        w.declare("x", "f32", (1, 1, 1, 1, 1))                  # ndim 5
    with pytest.raises(RuntimeError, match="declaration order"):
        w.write(plan[1][0], base.data[plan[1][0]])              # out of order
    first = base.data[plan[0][0]].reshape(-1)
    w.write(plan[0][0], first[:-1])
    with pytest.raises(ValueError, match="bytes written"):
        w.write(plan[0][0], first[-2:])                          # one element too many
    with pytest.raises(RuntimeError):
        w.declare("late", "f32", (1,))                           # declare after writing started
    with pytest.raises(RuntimeError, match="never written"):
        w.close()                                                # not all tensors written
    w.abort()
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_too_many_bytes_in_with(base, tmp_path):
    target = tmp_path / "m.colibri"
    with pytest.raises(ValueError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            w.write(plan[0][0], np.zeros(base.data[plan[0][0]].size + 1, np.uint16))
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_needs_routing(base, tmp_path):
    w = _writer(tmp_path / "m.colibri", base.cfg)
    w.declare("token_embd", "f16", (32, 16))
    with pytest.raises(RuntimeError, match="set_routing"):
        w.write("token_embd", base.data["token_embd"])
    with pytest.raises(ValueError):
        w.set_routing([])                                        # one record per layer
    w.abort()
    assert _temps(tmp_path) == []


# ---------------------------------------------------------------------------- colibri validate

def _validate(args, capsys):
    try:
        cli.main(["validate", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_validate(base, tmp_path, capsys):
    assert _validate([base.path], capsys)[0] == 0
    code, out, _ = _validate([base.path, "--deep"], capsys)
    assert code == 0 and "OK" in out and "checksums" in out

    p = base.patch()
    p.b[p.record("output")["offset"]] ^= 1
    crc_bad = p.write(tmp_path / "crc.colibri")
    assert _validate([crc_bad], capsys)[0] == 0
    code, _, err = _validate([crc_bad, "--deep"], capsys)
    assert code == 1 and "ChecksumMismatch" in err and "output" in err

    p = base.patch()
    p.set_route(0, flags=0)
    code, _, err = _validate([p.write(tmp_path / "route.colibri")], capsys)
    assert code == 1 and "BadRouting" in err and "routing[0]" in err

    code, _, err = _validate([str(tmp_path / "nope.colibri")], capsys)
    assert code == 1 and "FileNotFoundError" in err


def test_cli_validate_subprocess(base, tmp_path):
    p = base.patch()
    p.set_header(magic=b"GGUF")
    bad = p.write(tmp_path / "bad.colibri")
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "validate", bad, "--deep"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "BadMagic" in r.stderr and "magic" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- fuzz
# Mutations of a valid file: any input must give a clean open or a ColibriFormatError.

_INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 65, 127, 128, 255, 4095, 4096, 4097, 65535, 65536,
                2**24, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 64, 2**64 - 1]


def _value(maxv):
    """("set", v) an absolute value, or ("add", d) a small change of the current one."""
    return st.one_of(st.sampled_from([v for v in _INTERESTING if v <= maxv]).map(lambda v: ("set", v)),
                     st.integers(0, maxv).map(lambda v: ("set", v)),
                     st.integers(-130, 130).map(lambda d: ("add", d)))


def _field_mut(kind, maxes, index=st.just(0)):
    fields = [f for f, m in maxes.items() if m is not None]
    return st.sampled_from(fields).flatmap(
        lambda f: st.tuples(st.just(kind), index, st.just(f), _value(maxes[f])))


_NAMES = ["token_embd", "output", "output_norm", "blk.0.ffn_gate_inp", "blk.1.ffn_gate_inp", "blk.1.attn_q",
          "blk.1.ffn_shexp_gate", "blk.2.ffn_gate_inp", "blk.0.ffn_gate", "blk.9.attn_q", "extra"]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                     st.sampled_from([10**400, -10**400, 2**24, 2**24 + 1, 0, -1, 1, 2, 4, 16, 32, 1e-300,
                                      "mixtral", "qwen2_moe", "f16", "f32", "bf16", "head", "full", "yarn"]))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=6)
_ROPE_KEYS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"]
_rope = st.fixed_dictionaries({"rope_type": st.sampled_from(list(ROPE_TYPES) + ["dynamic"])},
                              optional={k: _scalars for k in _ROPE_KEYS})
_CONFIG_KEYS = list(CONFIGS["qwen2"]) + ["o_bias", "qk_norm", "clip_qkv", "sliding_window", "rope_scaling",
                                         "bos_token_id", "eos_token_ids", "max_position_embeddings", "bogus"]
_EDGE_NUMBERS = [10**400, -10**400, 2**64, 2**24, 2**24 + 1, 0, -1, 1e308, float("inf"), float("nan"), 1e-320]
_config_op = st.one_of(st.tuples(st.just("set"), st.sampled_from(_CONFIG_KEYS), _json),
                       st.tuples(st.just("set"), st.just("rope_scaling"), _rope),
                       st.tuples(st.just("set"), st.sampled_from(_CONFIG_KEYS), st.sampled_from(_EDGE_NUMBERS)),
                       st.tuples(st.just("del"), st.sampled_from(_CONFIG_KEYS), st.none()))
_config_mut = st.one_of(st.lists(_config_op, min_size=1, max_size=3).map(lambda ops: ("ops", ops)),
                        _json.map(lambda v: ("json", v)),
                        st.binary(max_size=48).map(lambda b: ("raw", b)))
_meta_mut = st.one_of(_json.map(lambda v: ("json", v)), st.binary(max_size=48).map(lambda b: ("raw", b)))

_mutation = st.one_of(
    _field_mut("hdr", HDR_MAX),
    _field_mut("rec", REC_MAX, st.integers(0, 63)),
    _field_mut("route", ROUTE_MAX, st.integers(0, 3)),
    st.tuples(st.just("route"), st.integers(0, 3), st.sampled_from(ROUTE_FIELDS[:6]),   # plausible indices
              (st.just(NO) | st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 20, 22, 23, 24])).map(
                  lambda v: ("set", v))),
    st.tuples(st.just("name"), st.integers(0, 63), st.sampled_from(_NAMES).map(str.encode) | st.binary(max_size=24)),
    st.tuples(st.just("flip"), st.sampled_from(["header", "table", "routing", "blobs", "data", "any"]),
              st.integers(0, 2**32), st.integers(1, 255)),
    st.tuples(st.just("trunc"), st.integers(0, 2**32)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
)
FUZZ_CASE = st.fixed_dictionaries({
    "base": st.sampled_from(["mixtral", "qwen2"]),
    "config": st.none() | _config_mut,
    "metadata": st.none() | _meta_mut,
    "muts": st.lists(_mutation, max_size=3),
})


def _mutated_config(base, m):
    kind, v = m
    if kind == "raw":
        return v
    if kind == "json":
        return json.dumps(v).encode()
    d = base.cfg.to_dict()
    for op, key, val in v:
        if op == "del":
            d.pop(key, None)
        else:
            d[key] = val
    return json.dumps(d).encode()


def _region(p, base, name):
    h = Patch(base.raw).header()
    routing_end = h["routing_offset"] + h["num_layers"] * fmt.ROUTING_RECORD_SIZE
    return {"header": (0, fmt.HEADER_SIZE), "table": (fmt.HEADER_SIZE, h["routing_offset"]),
            "routing": (h["routing_offset"], routing_end), "blobs": (routing_end, h["data_offset"]),
            "data": (h["data_offset"], len(p.b)), "any": (0, len(p.b))}[name]


def mutate(base, case) -> bytes:
    p = base.patch()
    blobs = {}
    if case["config"] is not None:
        blobs["config"] = _mutated_config(base, case["config"])
    if case["metadata"] is not None:
        kind, v = case["metadata"]
        blobs["metadata"] = v if kind == "raw" else json.dumps(v).encode()
    if blobs:
        p.set_blobs(**blobs)
    n_rec, n_layers = len(base.data), base.cfg.num_layers
    for m in case["muts"]:
        try:
            _mutate_one(p, base, m, n_rec, n_layers)
        except (struct.error, IndexError):
            pass                 # the field is no longer inside the (truncated / re-pointed) file
    return bytes(p.b)


def _mutate_one(p, base, m, n_rec, n_layers):
    kind = m[0]
    if kind in ("hdr", "rec", "route"):
        _, i, field, (how, v) = m
        get, put, maxv = {"hdr": (lambda: p.header(), lambda **kw: p.set_header(**kw), HDR_MAX),
                          "rec": (lambda: p.record(i % n_rec), lambda **kw: p.set_record(i % n_rec, **kw), REC_MAX),
                          "route": (lambda: p.route(i % n_layers), lambda **kw: p.set_route(i % n_layers, **kw),
                                    ROUTE_MAX)}[kind]
        v = v if how == "set" else get()[field] + v
        put(**{field: min(max(v, 0), maxv[field])})
    elif kind == "name":
        p.set_record(m[1] % n_rec, name=m[2])
    elif kind == "flip":
        lo, hi = _region(p, base, m[1])
        if hi > lo:
            p.b[lo + m[2] % (hi - lo)] ^= m[3]
    elif kind == "trunc":
        p.b = p.b[:m[1] % (len(p.b) + 1)]
    elif kind == "append":
        p.b += m[1]


def check_open(path):
    """The property: Model.open(deep=True) succeeds or raises a ColibriFormatError."""
    try:
        m = Model.open(path, deep=True)
    except fmt.ColibriFormatError:
        return False
    m.close()
    return True


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _fuzz_body(bases, fuzz_dir, case):
    raw = mutate(bases[case["base"]], case)
    path = str(fuzz_dir / "fuzz.colibri")
    with open(path + ".tmp", "wb") as f:       # new inode each time: never truncate a mapped file
        f.write(raw)
    os.replace(path + ".tmp", path)
    check_open(path)


_FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=250, **_FUZZ_SETTINGS)
@given(case=FUZZ_CASE)
def test_fuzz_open(bases, fuzz_dir, case):
    _fuzz_body(bases, fuzz_dir, case)


@pytest.mark.slow
@settings(max_examples=5000, **_FUZZ_SETTINGS)
@given(case=FUZZ_CASE)
def test_fuzz_open_long(bases, fuzz_dir, case):
    _fuzz_body(bases, fuzz_dir, case)
