"""Fuzzing the .colibri reader: mutations of a valid file (header, records, routing, blobs, config values,
bytes of any region) must give a clean open or a ColibriFormatError, never another exception."""
from __future__ import annotations

import json
import os
import struct

import pytest
from format_files import (
    CONFIGS,
    HDR_MAX,
    NO,
    REC_MAX,
    ROUTE_FIELDS,
    ROUTE_MAX,
    Patch,
    base,  # noqa: F401  (a fixture)
    bases,  # noqa: F401  (a fixture)
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri_server.model import format as fmt
from colibri_server.model.config import ROPE_TYPES
from colibri_server.model.engine import Model

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
