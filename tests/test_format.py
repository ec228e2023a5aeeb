"""The .colibri format (docs/format.md): round trip and zero-copy views of every routing kind, every
named error of a patched file, and the files that once passed the reader. Writer safety is in
test_format_writer.py, the fuzzing in test_format_fuzz.py; the files and Patch in format_files.py.
"""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from format_files import (
    _DEL,
    CONFIGS,
    META,
    NO,
    TEMPLATE,
    TOKENIZER,
    base,  # noqa: F401  (a fixture)
    bases,  # noqa: F401  (a fixture)
    build_file,
    expect_error,
    routing_records,
)
from server_harness import mapped_bytes

from colibri_server.model import format as fmt
from colibri_server.model.config import ModelConfig
from colibri_server.model.engine import Model

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
        stack = [fmt.is_expert_stack(r.name, r.shape, b.cfg.num_experts) for r in cf.record_list]
        by_offset = sorted(cf.record_list, key=lambda r: r.offset)
        # the expert stacks after every other tensor, each kind in declaration order
        assert [r.name for r in by_offset] == [r.name for s, r in sorted(zip(stack, cf.record_list), key=lambda sr: sr[0])]
        assert any(stack) == (b.cfg.num_experts > 0)
        for r in by_offset:
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


def test_close_releases_the_file_while_views_of_it_are_alive(base, tmp_path):
    """close() drops the mapping now: with views still held (a reference cycle, a frozen generation) the file is
    no longer mapped, and one deleted meanwhile has its space back; the views' range is unmapped when they go."""
    import gc
    import shutil
    path = str(tmp_path / "m.colibri")
    shutil.copy(base.path, path)
    cf = fmt.ColibriFile.open(path)
    held = [cf.view("blk.1.ffn_up_exps"), cf.view("output_norm")]
    size = os.path.getsize(path)
    assert mapped_bytes(path) >= size
    os.unlink(path)                                          # a model file replaced on disk, then USR1
    cf.close()
    assert mapped_bytes(path) == 0 and mapped_bytes(path + " (deleted)") == 0
    cf.close()                                               # twice: nothing more to do
    del held, cf
    gc.collect()
    other = fmt.ColibriFile.open(base.path)                  # the range is free for the next mapping
    try:
        assert other.view("output_norm").size > 0
    finally:
        other.close()
    assert mapped_bytes(base.path) == 0                     # no view left: the plain close


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
    pytest.param("mixtral", _hdr(version=4), fmt.UnsupportedVersion, "version", id="version-4"),
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
    pytest.param("mixtral", lambda p, b: p.set_record("blk.1.ffn_down_exps",              # the file's last tensor
                                                      offset=p.record("blk.1.ffn_down_exps")["offset"] + 64),
                 fmt.TensorOutOfBounds, "blk.1.ffn_down_exps", id="end-past-eof"),
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


# ---------------------------------------------------------------------------- files a reader could wrongly accept
# Each of these files would pass a reader that checked fields one by one (or crash it with a
# non-format error); the reader refuses each with the named error.

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
