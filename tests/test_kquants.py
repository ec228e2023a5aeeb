"""The k-quant encoders (model/kquants.py) and `colibri convert --quantize q4_k_m | ...` of checkpoints.

Bytes equal llama.cpp's: against `tests/kquants_llama.npz` (rows quantized by llama.cpp's own
`ggml_quantize_chunk`, written by `python tests/test_kquants.py` where bench/build_anchors.sh has
built llama.cpp), and live against that library and llama-quantize where they are built. A converted
checkpoint holds the kinds llama-quantize picks for the file type and runs: its logits are those of
its own dequantized weights within the activations' rounding."""
from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys

import gguf
import hf_models as H
import numpy as np
import pytest
from blocks_data import int8_rounded_products

from colibri_server import cli
from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model.blocks import BASE, KINDS
from colibri_server.model.convert import ConvertError, convert
from colibri_server.model.kernels.blocks import to_x16
from colibri_server.model.kernels.kquants import quantize_k_ref
from colibri_server.model.kquants import SCHEMES, quantize, scheme_kinds

HERE = pathlib.Path(__file__).resolve().parent
ANCHORS = HERE.parent / "bench" / ".anchors" / "bin"
GOLDEN = HERE / "kquants_llama.npz"
K_KINDS = ("q4_k", "q5_k", "q6_k")
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4]


def golden_rows() -> np.ndarray:
    """Rows that reach every branch of the search (f16 values, stored small): scales over four decades,
    a zero row, a constant sub-block, one-signed runs, an outlier, values that sit on rounding ties."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-3, 1, (32, 1)).astype(np.float32)
    x[1] = 0
    x[2, 256:288] = 0.75
    x[3, :200] = np.abs(x[3, :200])
    x[4, 7] = 50.0
    x[5, :64] = np.float32(0.5) * np.arange(64, dtype=np.float32) % 4 - 2
    x[6, 100:140] = -np.abs(x[6, 100:140])
    return x.astype(np.float16)


def _ggml():
    lib = ANCHORS / "libggml-base.so"
    if not lib.exists():
        pytest.skip("llama.cpp is not built (bench/build_anchors.sh)")
    f = ctypes.CDLL(str(lib)).ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]

    def run(kind, x):
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros((x.shape[0], x.shape[1] // KINDS[kind].block * KINDS[kind].size), np.uint8)
        f(KINDS[kind].ggml, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        return out
    return run


@pytest.mark.parametrize("kind", K_KINDS)
def test_kernel_and_twin_bytes_equal_llama_cpps_on_the_stored_rows(kind):
    g = np.load(GOLDEN)
    x = g["x"].astype(np.float32)
    np.testing.assert_array_equal(quantize(kind, x), g[kind])
    np.testing.assert_array_equal(quantize_k_ref(KINDS[kind].ggml, x), g[kind])
    y = (np.random.default_rng(8).standard_normal((64, 768)) * 0.02).astype(np.float32)    # and on more rows
    np.testing.assert_array_equal(quantize(kind, y), quantize_k_ref(KINDS[kind].ggml, y))


@pytest.mark.parametrize("kind", K_KINDS + ("q4_0", "q5_1", "q8_0"))
def test_bytes_equal_llama_cpps_library_on_random_rows(kind):
    run = _ggml()
    rng = np.random.default_rng(3)
    for scale in (1e-3, 0.05, 3.0):
        x = (rng.standard_normal((32, 1024)) * scale).astype(np.float32)
        np.testing.assert_array_equal(quantize(kind, x), run(kind, x))


@pytest.mark.parametrize("kind", K_KINDS)
def test_dequantized_values_are_close_and_a_row_is_quantized_alone(kind):
    """The gguf package reads the bytes back near the input (the kind's step); each row's bytes do
    not depend on the rows beside it."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    raw = quantize(kind, x)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(KINDS[kind].ggml)).reshape(x.shape)
    rel = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    assert rel < {"q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03}[kind], rel
    np.testing.assert_array_equal(quantize(kind, x[5:6]), raw[5:6])
    with pytest.raises(ValueError, match="whole number"):
        quantize(kind, x[:, :300])


def _hf(tmp_path, arch="mixtral", layers=8, **kw):
    H.build_hf_model(arch, tmp_path / "hf", hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                     num_local_experts=8, **kw)
    return tmp_path / "hf"


def test_scheme_kinds_follow_llama_quantize_for_an_eight_expert_model(tmp_path):
    import json

    from colibri_server.model.convert import config_from_hf
    hf = json.loads((_hf(tmp_path) / "config.json").read_text())
    cfg = config_from_hf(hf, "f16")
    k = scheme_kinds(cfg, "q4_k_m")
    more = {0, 3, 6, 7}                      # use_more_bits over 8 layers
    for i in range(8):
        assert k[f"blk.{i}.attn_k"] == k[f"blk.{i}.attn_v"] == "q8_0"       # 8 experts: k and v at 8 bits
        assert k[f"blk.{i}.attn_o"] == "q5_k" and k[f"blk.{i}.attn_q"] == "q4_k"
        # the experts' Q4_K and Q6_K as 16-row tiles (q4_k_x16, q6_k_x16: the same blocks, kernels/blocks_x16)
        assert k[f"blk.{i}.ffn_down_exps"] == ("q6_k_x16" if i in more else "q4_k_x16"), i
        assert k[f"blk.{i}.ffn_up_exps"] == k[f"blk.{i}.ffn_gate_exps"] == "q4_k_x16"
    assert k["output"] == "q6_k" and k["token_embd"] == "q4_k"
    assert set(scheme_kinds(cfg, "q8_0").values()) == {"q8_0"}
    with pytest.raises(ValueError, match="q4_k_m"):
        scheme_kinds(cfg, "q3_k_l")


def test_a_steps_q_k_and_v_take_one_parallel_region_with_each_products_bits(tmp_path):
    """Workspace.qkv_blocks (q, k and v of a serving step or a prefill in one parallel region on the threads) gives
    the bits of the three products one after another, and declines (doing nothing) where each product alone would
    stay on one thread: a few rows, or one thread."""
    from colibri_server.model.transformer import Workspace
    hf = _hf(tmp_path, layers=1)
    convert(hf, tmp_path / "m.colibri", "f32", quantize="q4_k_m", progress=False, require_tokenizer=False)
    m = Model.open(str(tmp_path / "m.colibri"))
    L = m.weights.layers[0]
    assert (L.wq.kind, L.wk.kind) == ("q4_k", "q8_0")             # two roundings of the input
    rng = np.random.default_rng(4)
    D, dkv = m.config.hidden_size, L.wk.shape[0]
    for T in (1, 16, 40):
        X = rng.standard_normal((T, D)).astype(np.float32)
        outs = [[np.full((T, W.shape[0]), np.nan, np.float32) for W in (L.wq, L.wk, L.wv)] for _ in range(2)]
        ws = Workspace(m.config, 64, threads=2)
        for W, out in zip((L.wq, L.wk, L.wv), outs[0]):
            ws.mm(X, W, out)
        assert ws.qkv_blocks(X, L, *outs[1]) == (T > 1), T           # 1 row: 256 x 64 weights, below PAR_MIN_WEIGHTS
        assert (dkv * D * T >= ws.PAR_MIN_WEIGHTS) == (T > 1)
        for got, want in zip(outs[1], outs[0]):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or T == 1, T
        assert T > 1 or all(np.isnan(o).all() for o in outs[1])
    assert not Workspace(m.config, 64, threads=1).qkv_blocks(X, L, *outs[1])


def test_a_checkpoint_converts_to_q4_k_m_and_runs(tmp_path, monkeypatch, capsys):
    hf = _hf(tmp_path, layers=2)
    cfg = convert(hf, tmp_path / "m.colibri", "f32", quantize="q4_k_m", progress=False, require_tokenizer=False)
    assert cfg.block_types["blk.1.ffn_down_exps"] == "q6_k_x16" and cfg.block_types["blk.0.ffn_down_exps"] == "q4_k_x16"
    cf = fmt.ColibriFile.open(tmp_path / "m.colibri")
    f32 = convert(hf, tmp_path / "f.colibri", "f32", progress=False, require_tokenizer=False)
    ref = fmt.ColibriFile.open(tmp_path / "f.colibri")
    for name, kind in cfg.block_types.items():          # the stored bytes are the encoder's on the f32 weights
        w = np.asarray(ref.view(name), np.float32)
        want = quantize(BASE.get(kind, kind), w.reshape(-1, w.shape[-1]))
        if kind in BASE:                                 # the experts' q4_k and q6_k rows as tiles
            want = to_x16(want, KINDS[kind].size)
        assert bytes(cf.tensor_bytes(name)) == want.tobytes(), name
    cf.close(), ref.close()
    assert f32.block_types == {}
    got = Model.open(str(tmp_path / "m.colibri")).logits(PROMPT)
    int8_rounded_products(monkeypatch)      # the reference: exact products of its dequantized weights
    ref = Model.open(str(tmp_path / "m.colibri")).logits(PROMPT)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 5e-3, err
    cli.main(["inspect", str(tmp_path / "m.colibri")])
    assert "q6_k" in capsys.readouterr().out
    with pytest.raises(ConvertError, match="drop --quantize-head"):
        convert(hf, tmp_path / "x.colibri", "f32", quantize="q4_k_m", quantize_head="q8", progress=False,
                require_tokenizer=False)
    with pytest.raises(ConvertError, match="q4_k_m"):
        convert(hf, tmp_path / "x.colibri", "f32", quantize="q3_k", progress=False, require_tokenizer=False)
    assert all(s in cli.build_parser().format_help() + _convert_help() for s in SCHEMES)


def _convert_help() -> str:
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["convert"].format_help()


@pytest.mark.skipif(not (ANCHORS / "llama-quantize").exists(), reason="llama.cpp's binaries are not built (bench/.anchors)")
@pytest.mark.parametrize("scheme", ["q4_k_m", "q5_k_m"])
def test_a_converted_checkpoint_holds_llama_quantizes_bytes(tmp_path, scheme):
    """The same weights through llama-quantize (F32 GGUF -> the file type) and kept as blocks, and through
    `convert --quantize <type>` from the checkpoint: every tensor's kind and bytes equal."""
    from test_gguf_import import write_gguf

    from colibri_server.model.gguf_import import convert_gguf
    hf = _hf(tmp_path)
    write_gguf(hf, tmp_path / "F32.gguf", "mixtral", gguf.GGMLQuantizationType.F32,
               config={**H.SMALL_CONFIGS["mixtral"], "hidden_size": 256, "intermediate_size": 256,
                       "num_hidden_layers": 8, "num_local_experts": 8})
    r = subprocess.run([str(ANCHORS / "llama-quantize"), str(tmp_path / "F32.gguf"), str(tmp_path / "q.gguf"),
                        scheme.upper()], check=False, capture_output=True, text=True,
                       env={"LD_LIBRARY_PATH": str(ANCHORS)})
    assert r.returncode == 0, r.stderr[-2000:]
    theirs, _ = convert_gguf(str(tmp_path / "q.gguf"), str(tmp_path / "theirs.colibri"), "f32", quantize="blocks",
                             progress=False, require_tokenizer=False)
    ours = convert(hf, tmp_path / "ours.colibri", "f32", quantize=scheme, progress=False, require_tokenizer=False)
    assert ours.block_types == theirs.block_types
    a, b = fmt.ColibriFile.open(tmp_path / "ours.colibri"), fmt.ColibriFile.open(tmp_path / "theirs.colibri")
    for name in ours.block_types:
        assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name
    a.close(), b.close()


if __name__ == "__main__":          # rewrite the stored rows' llama.cpp bytes (needs bench/build_anchors.sh)
    sys.modules.setdefault("pytest", pytest)
    run = _ggml()
    x = golden_rows()
    np.savez_compressed(GOLDEN, x=x, **{k: run(k, x.astype(np.float32)) for k in K_KINDS})
    print(f"wrote {GOLDEN}")
