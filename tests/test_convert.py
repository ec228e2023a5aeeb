"""The converter: layouts it accepts, errors it names, files it never half-writes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from synth_checkpoint import write_checkpoint

from colibri_server.model import Model
from colibri_server.model.checkpoint import index_checkpoint
from colibri_server.model.convert import ConvertError, convert

TINY = dict(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
PROMPT = [5, 9, 17, 33, 2, 60, 41]


@pytest.fixture
def hf_dir(built, tmp_path):
    """A private copy of the tiny Mixtral checkpoint, safe to damage."""
    d = tmp_path / "hf"
    shutil.copytree(built("mixtral").hf_dir, d)
    return d


def _rewrite_config(d, **changes):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def test_sharded_checkpoint_equals_single_file(tmp_path):
    write_checkpoint(tmp_path / "sharded", TINY, np.float32, shards=3)
    write_checkpoint(tmp_path / "single", TINY, np.float32, shards=1)
    assert len(index_checkpoint(tmp_path / "sharded")) == len(index_checkpoint(tmp_path / "single"))
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    convert(tmp_path / "sharded", a, "f32", require_tokenizer=False, progress=False)
    convert(tmp_path / "single", b, "f32", require_tokenizer=False, progress=False)
    ma, mb = Model.open(a), Model.open(b)
    for r in ma.file.record_list:
        assert r.crc32 == mb.file.records[r.name].crc32, r.name
    np.testing.assert_array_equal(ma.logits(PROMPT), mb.logits(PROMPT))


def test_experts_are_stacked_in_order(tmp_path):
    """blk.L.ffn_gate_exps[e] is expert e's w1, byte for byte."""
    from safetensors.numpy import load_file
    write_checkpoint(tmp_path / "hf", TINY, np.float32, shards=1)
    out = tmp_path / "m.colibri"
    convert(tmp_path / "hf", out, "f32", require_tokenizer=False, progress=False)
    src = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    m = Model.open(out)
    for e in range(4):
        np.testing.assert_array_equal(m.file.view("blk.1.ffn_gate_exps")[e],
                                      src[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"])
        np.testing.assert_array_equal(m.file.view("blk.1.ffn_down_exps")[e],
                                      src[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"])


def test_fused_in_memory_layout_is_accepted(built, tmp_path):
    """A state dict saved straight from transformers 5's modules (fused gate_up_proj)."""
    from safetensors.torch import save_file
    b = built("mixtral")
    d = tmp_path / "fused"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(b.hf_dir, f), d / f)
    sd = {k: v.contiguous() for k, v in b.hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(d / "model.safetensors"))
    convert(d, tmp_path / "m.colibri", "f32", progress=False)
    np.testing.assert_array_equal(Model.open(tmp_path / "m.colibri").logits(PROMPT),
                                  Model.open(b.colibri("f32")).logits(PROMPT))


@pytest.mark.parametrize("change,needle", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_attention_heads=3), "num_kv_heads"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}), "dynamic"),
    (dict(intermediate_size=80), "w1.weight"),
])
def test_bad_config_is_named(hf_dir, tmp_path, change, needle):
    _rewrite_config(hf_dir, **change)
    out = tmp_path / "m.colibri"
    with pytest.raises(ConvertError, match=needle):
        convert(hf_dir, out, "f32", progress=False)
    assert not out.exists()


def test_missing_tensor_is_named_and_nothing_written(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    f = hf_dir / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(sd, str(f))
    out = tmp_path / "m.colibri"
    out.write_bytes(b"previous model")
    with pytest.raises(ConvertError, match=r"experts\.3\.w2\.weight"):
        convert(hf_dir, out, "f32", progress=False)
    assert out.read_bytes() == b"previous model"
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_wrong_shape_is_named(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    f = hf_dir / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(sd, str(f))
    with pytest.raises(ConvertError, match=r"k_proj.weight.*shape \[8, 64\]"):
        convert(hf_dir, tmp_path / "m.colibri", "f32", progress=False)


def test_missing_files_are_named(hf_dir, tmp_path):
    with pytest.raises(ConvertError, match="config.json not found"):
        convert(tmp_path, tmp_path / "m.colibri", "f32", progress=False)
    os.unlink(hf_dir / "tokenizer.json")
    with pytest.raises(ConvertError, match="tokenizer.json not found"):
        convert(hf_dir, tmp_path / "m.colibri", "f32", progress=False)
    convert(hf_dir, tmp_path / "m.colibri", "f32", progress=False, require_tokenizer=False)
    m = Model.open(tmp_path / "m.colibri")
    assert len(m.generate(PROMPT, max_tokens=3)) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        m.generate("text prompt", max_tokens=3)
    os.unlink(hf_dir / "model.safetensors")
    with pytest.raises(ConvertError, match="no \\*.safetensors"):
        convert(hf_dir, tmp_path / "m.colibri", "f32", progress=False)


def test_index_naming_a_missing_shard(tmp_path):
    write_checkpoint(tmp_path, TINY, np.float32, shards=2)
    os.unlink(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(ConvertError, match="00002-of-00002.safetensors: listed in the index but missing"):
        convert(tmp_path, tmp_path / "m.colibri", "f32", require_tokenizer=False, progress=False)


def test_f16_overflow_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file
    write_checkpoint(tmp_path, TINY, np.float32, shards=1)
    f = tmp_path / "model-00001-of-00001.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.self_attn.q_proj.weight"][0, 0] = 1e6
    save_file(sd, str(f))
    with pytest.raises(ConvertError, match="attn_q.*f16 range"):
        convert(tmp_path, tmp_path / "m.colibri", "f16", require_tokenizer=False, progress=False)
    convert(tmp_path, tmp_path / "m.colibri", "bf16", require_tokenizer=False, progress=False)


def test_bf16_rounding_is_nearest_even():
    from colibri_server.model.convert import _encode
    f = np.array([1.0, 1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-20, -3.5, np.inf, np.nan], np.float32)
    got = _encode(f, "F32", "bf16", "t").view(np.uint16)
    back = (got.astype(np.uint32) << 16).view(np.float32)
    # halfway 1+2^-8 rounds to even (1.0); 1+3*2^-8 rounds to even (1+2^-6); just above halfway rounds up
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == np.float32(1.015625)
    assert back[3] == np.float32(1.0078125) and back[4] == -3.5 and np.isinf(back[5]) and np.isnan(back[6])


def test_cli_convert_and_inspect(built, tmp_path):
    b = built("qwen2_moe")
    out = tmp_path / "q.colibri"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "convert", b.hf_dir, str(out), "--dtype", "bf16",
                        "--name", "tiny-qwen", "--license", "apache-2.0"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "qwen2_moe" in r.stderr
    m = Model.open(out)
    assert m.config.dtype == "bf16" and m.metadata["name"] == "tiny-qwen" and m.metadata["license"] == "apache-2.0"
    assert m.config.dense_layers == (0, 2)
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "inspect", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "blk.1.ffn_gate_exps" in r.stdout and "tiny-qwen" in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "inspect", str(out), "--tensor", "blk.1.ffn_gate_inp",
                        "--rows", "2"], capture_output=True, text=True)
    assert r.returncode == 0 and "[1]" in r.stdout and "[2]" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "convert", str(tmp_path / "nope"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "config.json not found" in r.stderr


@pytest.mark.slow
def test_convert_1gb_checkpoint_peak_memory(tmp_path):
    """Peak RSS of `colibri convert` on a ~1 GB checkpoint stays under 300 MiB + the largest tensor."""
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "convert_memory.py")
    r = subprocess.run([sys.executable, bench, "--dir", str(tmp_path)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_convert_quantize_and_dequantize(built, tmp_path):
    b = built("mixtral")
    q, dq = tmp_path / "q8.colibri", tmp_path / "dq.colibri"
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "convert", b.hf_dir, str(q), "--quantize", "q8",
                        "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0 and "+ q8" in r.stderr, r.stderr
    # the tiny model's 32-row k/v projections do not fill a 64-row group: the user is told
    assert "groups of 64 rows; kept in f16" in r.stderr and "attn_k" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "dequantize", str(q), str(dq), "--dtype", "f32"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ref = Model.open(b.colibri("f32")).logits(PROMPT)
    for path in (q, dq):
        got = Model.open(path).logits(PROMPT)
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()      # q8: group scales, small error
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "dequantize", str(tmp_path / "nope"), str(dq)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "model file not found" in r.stderr
