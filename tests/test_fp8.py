"""FP8 checkpoints (issue 17): float8_e4m3fn weights with 128x128 block scales (weight_scale_inv), as
DeepSeek-V3 and Qwen3-FP8 ship them, converted with no torch; the same logits, bit for bit, as the
f32 checkpoint of torch's own dequantization of those weights."""
from __future__ import annotations

import glob
import json

import hf_models as H
import numpy as np
import pytest
import torch

from colibri_server.model import Model
from colibri_server.model.convert import ConvertError, convert
from colibri_server.model.fp8 import E4M3FN

PROMPT = [int(t) for t in np.random.default_rng(2).integers(3, 500, size=20)]
BLOCK = 128


def test_e4m3fn_table_is_torchs():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(E4M3FN, ref)          # NaN where torch has NaN, every value exact


def _fp8_checkpoint(src, fp8_dir, ref_dir, block=(BLOCK, BLOCK)):
    """src's matrices (not the router, norms, embedding, head) as FP8 + weight_scale_inv in fp8_dir,
    and the dequantized values as f32 in ref_dir."""
    from safetensors.torch import load_file, save_file
    st = {}
    for f in glob.glob(f"{src}/*.safetensors"):
        st.update(load_file(f))
    q, ref = {}, {}
    for name, w in st.items():
        quantize = (w.ndim == 2 and name.endswith("proj.weight") and "embed" not in name)
        if not quantize:
            q[name] = ref[name] = w
            continue
        R, C = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        pad = torch.zeros(R * block[0], C * block[1])
        pad[:w.shape[0], :w.shape[1]] = w
        tiles = pad.reshape(R, block[0], C, block[1])
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0                                   # (R, C)
        f8 = (tiles / scale[:, None, :, None]).reshape(pad.shape)[:w.shape[0], :w.shape[1]].to(torch.float8_e4m3fn)
        q[name], q[name + "_scale_inv"] = f8, scale.float()
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:w.shape[0], :w.shape[1]]
        ref[name] = f8.float() * full
    for d, tensors in ((fp8_dir, q), (ref_dir, ref)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        for f in ("config.json", "tokenizer.json"):
            (d / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])   # V3: its latent projections, read whole
def test_fp8_checkpoint_converts_to_its_dequantized_values_bit_for_bit(tmp_path, arch):
    H.build_hf_model(arch, tmp_path / "hf")
    _fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref", block=(16, 32))
    convert(str(tmp_path / "fp8"), str(tmp_path / "fp8.colibri"), "f32", progress=False)
    convert(str(tmp_path / "ref"), str(tmp_path / "ref.colibri"), "f32", progress=False)
    got = Model.open(str(tmp_path / "fp8.colibri")).logits(PROMPT)
    assert np.array_equal(got, Model.open(str(tmp_path / "ref.colibri")).logits(PROMPT))
    # and the FP8 rounding is visible against the original weights (the test would see a no-op)
    convert(str(tmp_path / "hf"), str(tmp_path / "orig.colibri"), "f32", progress=False)
    assert not np.array_equal(got, Model.open(str(tmp_path / "orig.colibri")).logits(PROMPT))


def test_fp8_without_block_scales_is_refused_by_name(tmp_path):
    H.build_hf_model("qwen3_moe", tmp_path / "hf")
    _fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref")
    from safetensors.torch import load_file, save_file
    st = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    del st["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(st, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"q_proj.weight.*needs a 2-D f32/bf16 .*_scale_inv"):
        convert(str(tmp_path / "fp8"), str(tmp_path / "x.colibri"), "f32", progress=False)


@pytest.mark.parametrize("block", [[0, 128], [128], 128, "128", [128.0, 128]])
def test_a_bad_weight_block_size_is_refused_by_name(tmp_path, block):
    H.build_hf_model("qwen3_moe", tmp_path / "hf")
    _fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="weight_block_size .* must be two positive integers"):
        convert(str(tmp_path / "fp8"), str(tmp_path / "x.colibri"), "f32", progress=False)
    assert not (tmp_path / "x.colibri").exists()
