"""Valid .colibri files to patch, for the format tests (test_format*.py): a file of every routing kind
written by ColibriWriter (`make_bases`), `Patch` to change its bytes field by field with the layout taken
from format.HEADER / RECORD / ROUTING, and `expect_error`. `Patch.set_blobs` relays out the blob region
(and shifts the data region by whole pages) so a blob can be replaced by one of any length while every
other field stays consistent.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from colibri_server.model import format as fmt
from colibri_server.model.config import ModelConfig, expected_tensors
from colibri_server.model.engine import Model
from colibri_server.model.writer import ColibriWriter

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
    with ColibriWriter(path, config=cfg.to_dict(), metadata=META, tokenizer_json=TOKENIZER,
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


def make_bases(d) -> dict:
    """{name: Base} for every config of CONFIGS, written into directory `d`."""
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
def bases(tmp_path_factory):
    return make_bases(tmp_path_factory.mktemp("bases"))


@pytest.fixture(scope="module")
def base(bases):
    return bases["mixtral"]
