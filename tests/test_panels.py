"""f16 / bf16 matrices stored in panels of 256 columns (dtypes f16p / bf16p, panels.py).

- The panel matvec (LLVM IR on AVX-512 and on AVX2, a Numba loop elsewhere), its row split over threads,
  the prefill tile gather and matmul, each against the numpy twin of the row-major matrix.
- Files: every architecture, built with hidden 256 so that most matrices are whole panels
  (the rest stay row-major in the same file), converted from an f16 / bf16 checkpoint in
  panels, match transformers running those values in f32 as tightly as row-major files do;
  decode equals prefill; the fused decode call equals the general path bit for bit; two
  threads equal one bit for bit.
- The converter's defaults and options, dequantize, inspect and prefill_bf16 with panels.
"""
from __future__ import annotations

import json

import hf_models as H
import numpy as np
import pytest
import torch

from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model import kernels as K
from colibri_server.model.kernels.float_ir import HAVE_FLOAT_IR
from colibri_server.model.panels import PANEL, Panels, from_panels, to_panels

PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 512, size=24)]
# hidden 256: attention q/k/v, the experts' w1/w3, the heads and (where the width is 256) w2
# and wo are panels; qwen2_moe's shared expert (96) and dense MLP (128), qwen3's wo (q_dim 96)
# and olmoe's w2 (32) keep rows
WIDE = {"mixtral": dict(hidden_size=256, intermediate_size=256),
        "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=256),
        "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256),
        "olmoe": dict(hidden_size=256)}
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}


def _bits(rng, shape, dtype):
    w = rng.standard_normal(shape).astype(np.float32)
    if dtype == "f16":
        return w.astype(np.float16).view(np.uint16)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


# ---------------------------------------------------------------------------- kernels

def test_to_panels_layout_and_round_trip():
    w = np.arange(3 * 5 * 512, dtype=np.int32).reshape(3, 5, 512)
    p = to_panels(w)
    assert p.shape == (3, 2, 5, PANEL) and p.flags.c_contiguous
    np.testing.assert_array_equal(p[1, 1, 4], w[1, 4, 256:])          # panel b = columns b*256.. of each row
    np.testing.assert_array_equal(from_panels(p), w)
    P = Panels(p)
    assert P.shape == (3, 5, 512) and P.ndim == 3 and P[2].shape == (5, 512) and P.nbytes == w.nbytes
    with pytest.raises(IndexError):
        P[0][0]
    with pytest.raises(ValueError, match="multiple of the panel width"):
        to_panels(np.zeros((4, 300)))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("d,n", [(136, 768), (8, 256), (1, 512)])
def test_panel_matvec_matches_the_row_major_twin(dtype, d, n):
    rng = np.random.default_rng(d + n)
    W = _bits(rng, (d, n), dtype)
    P = to_panels(W)
    x = rng.standard_normal(n).astype(np.float32)
    ref = K.matvec_ref(W, x)
    tol = 2e-6 * np.abs(ref).max() * np.sqrt(n)
    out = np.full(d, np.nan, np.float32)
    K.matvec(P, x, out)                                   # the IR kernel (AVX-512 or AVX2)
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)
    loop = np.full(d, np.nan, np.float32)
    K._panels_loop(P, x, loop, np.float32(1.0), False)    # the Numba loop (CPUs without either)
    np.testing.assert_allclose(loop, ref, rtol=0, atol=tol)
    acc = np.ones(d, np.float32)
    K._matvec_core(P, x, acc, np.float32(-0.5), True)     # out += alpha * W @ x, as the expert's w2
    np.testing.assert_allclose(acc, 1 - 0.5 * ref, rtol=0, atol=tol)
    par = np.full(d, np.nan, np.float32)
    K.matvec_par(P, x, par, 2)                            # row chunks: W[:, r0:r1], strided panels
    np.testing.assert_array_equal(par, out)


@pytest.mark.skipif(not HAVE_FLOAT_IR, reason="the IR kernel needs AVX-512")
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_panel_kernel_is_vector_code_without_x_loads_in_the_row_loop(dtype):
    from numba import njit

    from colibri_server.model.kernels import float_ir as KF
    kern = KF._panels_f16 if dtype == "f16" else KF._panels_bf16

    @njit
    def run(W, x, out):
        kern(W, x, out, np.float32(1.0), False)
    P = to_panels(_bits(np.random.default_rng(0), (16, 512), dtype))
    run(P, np.ones(512, np.float32), np.zeros(16, np.float32))
    asm = run.inspect_asm(run.signatures[0])
    fmas = [ln for ln in asm.splitlines() if "vfmadd" in ln]
    assert len(fmas) >= PANEL // 16 and all("zmm" in ln for ln in fmas)
    # x is in registers: no FMA takes a memory operand (the weights are converted first)
    assert not any("(%" in ln for ln in fmas)
    assert ("vcvtph2ps" in asm) == (dtype == "f16")


def test_panel_rows_and_matmul_match_the_row_major_matrix():
    rng = np.random.default_rng(3)
    W = _bits(rng, (300, 512), "f16")
    P = to_panels(W)
    buf = np.zeros((40, 512), np.float32)
    K.panel_rows_to_f32(P, 100, 140, buf)
    np.testing.assert_array_equal(buf, K.weights_to_f32(W[100:140]))
    np.testing.assert_array_equal(K.weights_to_f32(Panels(P)), K.weights_to_f32(W))
    for T in (1, 5):
        X = rng.standard_normal((T, 512)).astype(np.float32)
        out = np.zeros((T, 300), np.float32)
        K.matmul(X, Panels(P), out, np.zeros((64, 512), np.float32))
        ref = K.matmul_ref(X, W)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_format_refuses_panels_that_are_not_whole():
    assert fmt.view_shape("f16p", (4, 8, 512)) == (4, 2, 8, 256)
    assert fmt.nbytes("bf16p", (8, 512)) == 8 * 512 * 2
    for shape in [(8, 300), (512,)]:
        with pytest.raises(ValueError, match="whole 256-column panels"):
            fmt.nbytes("f16p", shape)


# ---------------------------------------------------------------------------- files

@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(arch, half dtype) -> (HF dir, reference logits of the half values run in f32)."""
    from transformers import AutoModelForCausalLM
    cache, root = {}, tmp_path_factory.mktemp("wide")

    def get(arch, dtype):
        if (arch, dtype) not in cache:
            d = root / f"hf-{arch}-{dtype}"
            H.build_hf_model(arch, d, dtype=HALF[dtype], **WIDE[arch])
            ref_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            cache[arch, dtype] = (d, H.hf_logits(ref_model, PROMPT))
        return cache[arch, dtype]
    return get


def _convert(hf_dir, path, dtype, layout):
    from colibri_server.model.convert import convert
    convert(hf_dir, path, dtype, progress=False, layout=layout)
    return str(path)


# every family in f16 and mixtral in bf16 by default; the other bf16 families (20 s each cold) with -m slow
@pytest.mark.parametrize("arch,dtype", [(a, "f16") for a in H.ARCHS] + [
    (a, "bf16") if a == "mixtral" else pytest.param(a, "bf16", marks=pytest.mark.slow) for a in H.ARCHS])
def test_panel_files_are_exact_against_transformers(wide, tmp_path, arch, dtype):
    hf_dir, ref = wide(arch, dtype)
    m = Model.open(_convert(hf_dir, tmp_path / "p.colibri", dtype, "panels"))
    kinds = {r.dtype for r in m.file.record_list if len(r.shape) >= 2}
    assert dtype + "p" in kinds                                        # most matrices are panels ...
    assert all(L.wqkv is None for L in m.weights.layers)              # ... so q|k|v are three streams
    got = m.logits(PROMPT)
    # measured max |diff| / max |logit|: 3e-6..3e-5, the same as the row-major file to 3 digits
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
    # decode through the KV cache gives the prefill's rows
    cache = m.new_cache()
    rows = [m.prefill(cache, np.array(PROMPT[:4]))[0].copy()]
    rows += [m.decode(cache, t)[0].copy() for t in PROMPT[4:10]]
    np.testing.assert_allclose(np.stack(rows), got[3:10], rtol=0, atol=1e-4 * np.abs(got).max())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_panel_decode_fused_and_threaded_are_the_general_path_bit_for_bit(wide, tmp_path, arch):
    from colibri_server.model.transformer import forward
    hf_dir, _ = wide(arch, "f16")
    path = _convert(hf_dir, tmp_path / "p.colibri", "f16", "panels")
    m = Model.open(path)
    cfg = m.config

    def run(model, trace=None):
        cache = model.new_cache()
        forward(cfg, model.weights, model.rope, model.workspace, cache, tokens=np.array(PROMPT[:5]))
        return np.stack([forward(cfg, model.weights, model.rope, model.workspace, cache, tokens=np.array([t]),
                                 trace=trace)[0].copy() for t in PROMPT[5:10]])

    fused = run(m)
    trace = []
    np.testing.assert_array_equal(fused, run(m, trace))                # the general path ran, same bits
    assert trace
    two = Model.open(path)
    two.set_threads(2)
    np.testing.assert_array_equal(run(two), fused)                     # rows split over 2 threads


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("panels", [False, True])
def test_matvec_stack_is_each_matvec_bit_for_bit(dtype, panels):
    # decode's q|k|v in one call (kernels.matvec_stack): the stacked rows give each matrix's own bits
    rng = np.random.default_rng(11)
    Ws = [_bits(rng, (d, 512), dtype) for d in (96, 32, 32)]
    Ms = tuple(to_panels(W) if panels else W for W in Ws)
    x = rng.standard_normal(512).astype(np.float32)
    out = np.full(160, np.nan, np.float32)
    K.matvec_stack(Ms, x, out)
    one = np.concatenate([np.full(W.shape[0], np.nan, np.float32) for W in Ws])
    o = 0
    for M in Ms:
        K.matvec(M, x, one[o:o + M.shape[-2]])
        o += M.shape[-2]
    np.testing.assert_array_equal(out, one)
    # matrices of different widths are not one stack: the kernel declines, each runs alone, same bits
    odd = (Ms[0], Ms[1], (to_panels(Ws[2][:, :256]) if panels else Ws[2][:, :256]))
    out2 = np.full(160, np.nan, np.float32)
    K.matvec_stack(odd, x, out2)
    np.testing.assert_array_equal(out2[:128], one[:128])
    ref = K.matvec_ref(Ws[2][:, :256], x[:256])
    np.testing.assert_allclose(out2[128:], ref, rtol=0, atol=2e-6 * np.abs(ref).max() * np.sqrt(256))


def test_panel_decode_with_qkv_in_one_call_gives_the_same_logits(wide, tmp_path):
    import dataclasses
    hf_dir, _ = wide("mixtral", "f16")
    m = Model.open(_convert(hf_dir, tmp_path / "p.colibri", "f16", "panels"))
    assert all(L.wqkv is None and L.qkv_stack is not None for L in m.weights.layers)
    apart = Model.open(m.file.path)
    apart.weights = dataclasses.replace(apart.weights, layers=tuple(
        dataclasses.replace(L, qkv_stack=None) for L in apart.weights.layers))

    def run(model):
        cache = model.new_cache()
        model.prefill(cache, np.array(PROMPT[:4]))
        return np.stack([model.decode(cache, t)[0].copy() for t in PROMPT[4:10]])
    np.testing.assert_array_equal(run(m), run(apart))


def test_converter_layout_defaults_and_options(wide, tmp_path):
    from colibri_server.cli import main
    from colibri_server.model.convert import ConvertError, convert
    hf_dir, ref = wide("mixtral", "f16")
    convert(hf_dir, tmp_path / "d16.colibri", "f16", progress=False)
    convert(hf_dir, tmp_path / "d32.colibri", "f32", progress=False)
    main(["convert", str(hf_dir), str(tmp_path / "rows.colibri"), "--layout", "rows", "--quiet"])
    main(["convert", str(hf_dir), str(tmp_path / "pb.colibri"), "--dtype", "bf16", "--layout", "panels", "--quiet"])
    layouts = {}
    for name in ("d16", "d32", "rows", "pb"):
        cf = fmt.ColibriFile.open(str(tmp_path / f"{name}.colibri"))
        layouts[name] = (json.loads(cf.config_json).get("layout"), cf.records["blk.0.ffn_gate_exps"].dtype)
    assert layouts == {"d16": ("panels", "f16p"), "d32": (None, "f32"), "rows": (None, "f16"),
                       "pb": ("panels", "bf16p")}                      # a rows config leaves the key out
    rows = Model.open(str(tmp_path / "rows.colibri")).logits(PROMPT)
    pan = Model.open(str(tmp_path / "d16.colibri")).logits(PROMPT)
    np.testing.assert_allclose(pan, rows, rtol=0, atol=2e-5 * np.abs(rows).max())  # summation order only
    with pytest.raises(ConvertError, match="--layout 'tiles'"):
        convert(hf_dir, tmp_path / "x.colibri", "f16", progress=False, layout="tiles")
    with pytest.raises(ConvertError, match="--layout panels stores f16 or bf16"):
        convert(hf_dir, tmp_path / "x.colibri", "f32", progress=False, layout="panels")
    assert not (tmp_path / "x.colibri").exists()


def test_dequantize_and_inspect_with_panels(wide, tmp_path, capsys):
    from colibri_server.cli import main
    from colibri_server.model.convert import convert
    hf_dir, _ = wide("mixtral", "f16")
    q8 = tmp_path / "q8.colibri"
    convert(hf_dir, q8, "f16", progress=False, quantize="q8", quant_group=32)
    main(["dequantize", str(q8), str(tmp_path / "dp.colibri")])                       # f16: panels
    main(["dequantize", str(q8), str(tmp_path / "dr.colibri"), "--layout", "rows"])
    dp, dr = Model.open(str(tmp_path / "dp.colibri")), Model.open(str(tmp_path / "dr.colibri"))
    assert dp.file.records["blk.1.ffn_down_exps"].dtype == "f16p"
    assert dr.file.records["blk.1.ffn_down_exps"].dtype == "f16"
    np.testing.assert_array_equal(K.weights_to_f32(dp.weights.layers[1].w2), K.weights_to_f32(dr.weights.layers[1].w2))
    a, b = dp.logits(PROMPT), dr.logits(PROMPT)
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())
    # a panel file dequantized back to rows: the same values
    main(["dequantize", str(tmp_path / "dp.colibri"), str(tmp_path / "back.colibri"), "--layout", "rows"])
    back = Model.open(str(tmp_path / "back.colibri"))
    np.testing.assert_array_equal(K.weights_to_f32(back.weights.output), K.weights_to_f32(dr.weights.output))
    with pytest.raises(SystemExit):                                                  # named, no traceback
        main(["dequantize", str(q8), str(tmp_path / "x.colibri"), "--dtype", "f32", "--layout", "panels"])
    assert "--layout panels stores f16 or bf16" in capsys.readouterr().err
    assert not (tmp_path / "x.colibri").exists()
    for f in ("dp", "dr"):
        main(["inspect", str(tmp_path / f"{f}.colibri"), "--tensor", "blk.0.ffn_up_exps", "--rows", "2"])
    out = capsys.readouterr().out.split("blk.0.ffn_up_exps ")
    assert out[1].split(":", 1)[1] == out[2].split(":", 1)[1]                        # the same logical rows
    assert "f16p[4, 256, 256]: first 2 of 1024 rows" in out[1]


def test_prefill_bf16_takes_panels_with_the_sums_of_rows(wide, tmp_path):
    """The bf16 GEMM walks a panel matrix panel by panel with its accumulators carried over:
    the same products and sums as the row-major file (bit for bit per matmul; the model's
    logits agree to float rounding, as single-token experts take the matvec, whose order
    differs), on one thread and on two."""
    from colibri_server.model.kernels import gemm as GE
    hf_dir, _ = wide("mixtral", "bf16")
    rows = Model.open(_convert(hf_dir, tmp_path / "r.colibri", "bf16", "rows"), prefill_bf16=True)
    pan = Model.open(_convert(hf_dir, tmp_path / "p.colibri", "bf16", "panels"), prefill_bf16=True)
    assert pan.has_bf16_weights() and pan.set_prefill_bf16(True) == GE.HAVE_BF16_GEMM
    if not GE.HAVE_BF16_GEMM:
        pytest.skip("this CPU has no avx512bf16")
    W = rows.weights.layers[0].w1[1]
    X = np.random.default_rng(5).standard_normal((7, W.shape[1])).astype(np.float32)
    a, b, c = (np.zeros((7, W.shape[0]), np.float32) for _ in range(3))
    GE.matmul_bf16(W, X, a)
    GE.matmul_bf16(pan.weights.layers[0].w1[1], X, b)
    GE.matmul_bf16_par(pan.weights.layers[0].w1[1], X, c, 2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b, c)
    want = rows.logits(PROMPT)
    np.testing.assert_allclose(pan.logits(PROMPT), want, rtol=0, atol=1e-4 * np.abs(want).max())
    pan.set_threads(2)
    np.testing.assert_allclose(pan.logits(PROMPT), want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow          # 59 s of cold compiling (a q8/f16-panels mix no other test builds): -m slow
def test_quantized_experts_beside_a_float_head_in_panels(wide, tmp_path):
    """q8 experts and attention with the head kept f16 (--quantize-head none): the head is
    stored in panels beside the QTensors, and the file gives the rows file's answers, on one
    thread and on two."""
    from colibri_server.model.convert import convert
    hf_dir, _ = wide("mixtral", "f16")
    paths = {}
    for layout in ("panels", "rows"):
        paths[layout] = str(tmp_path / f"{layout}.colibri")
        convert(hf_dir, paths[layout], "f16", progress=False, quantize="q8", quantize_head="none", quant_group=32,
                layout=layout)
    pan, rows = Model.open(paths["panels"]), Model.open(paths["rows"])
    assert pan.file.records["output"].dtype == "f16p" and pan.file.records["blk.0.attn_q"].dtype == "i8"
    want = rows.logits(PROMPT)
    np.testing.assert_allclose(pan.logits(PROMPT), want, rtol=0, atol=2e-5 * np.abs(want).max())
    greedy = rows.generate(PROMPT[:5], max_tokens=12, ignore_eos=True)
    assert pan.generate(PROMPT[:5], max_tokens=12, ignore_eos=True) == greedy
    pan.set_threads(2)
    assert pan.generate(PROMPT[:5], max_tokens=12, ignore_eos=True) == greedy
