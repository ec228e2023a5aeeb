"""Group quantization (q8, q4): numpy quantize/dequantize bounds, every quantized kernel
against its numpy twin, the file format, the converter and `colibri dequantize`."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model import kernels as K
from colibri_server.model import quant as Q
from colibri_server.model.config import ModelConfig, expected_tensors
from colibri_server.model.kernels import quant as KQ
from colibri_server.model.writer import ColibriWriter

KINDS = ["q8", "q4"]


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _qt(rng, kind, shape, G=32, scale=0.02):
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    q, s = Q.quantize(kind, w, G)
    q.setflags(write=False)
    s.setflags(write=False)
    return w, Q.QTensor(kind, q, s)


# ---------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("G", [8, 32])
def test_q8_round_trip_bound(rng, G):
    w = (rng.standard_normal((3, 64, 40)) * rng.uniform(0.001, 3, (3, 1, 40))).astype(np.float32)
    q, s = Q.quantize_q8(w, G)
    assert q.dtype == np.int8 and q.shape == w.shape and s.dtype == np.uint16 and s.shape == (3, 64 // G, 40)
    d = Q.dequantize_q8(q, s)
    sf = np.repeat(s.view(np.float16).astype(np.float32), G, axis=-2)       # (3,64,40) scale of each weight
    # the f16 scale is within one f16 ulp of absmax/127, so |v| <= 127 and the error is half a step
    assert np.all(np.abs(d - w) <= 0.5 * sf * (1 + 1e-3) + 1e-12)
    assert np.abs(q).max() <= 127


@pytest.mark.parametrize("G", [8, 32])
def test_q4_round_trip_bound(rng, G):
    w = (rng.standard_normal((2, 64, 48)) * 0.05).astype(np.float32)
    q, s = Q.quantize_q4(w, G)
    assert q.dtype == np.uint8 and q.shape == (2, 64, 24) and s.shape == (2, 64 // G, 48)
    d = Q.dequantize_q4(q, s)
    sf = np.abs(np.repeat(s.view(np.float16).astype(np.float32), G, axis=-2))
    # inside the range a value is off by at most half a step; the extremes may be clipped
    # to -8 or 7 steps (the scale search trades that against the error of every other value)
    bound = np.maximum(0.5 * sf, np.abs(w) - 7 * sf) * (1 + 1e-3) + 1e-12
    assert np.all(np.abs(d - w) <= bound)
    # and the search never does worse than llama.cpp's Q4_0 rule (scale = signed absmax / -8)
    wg = w.reshape(2, 64 // G, G, 48)
    m = np.take_along_axis(wg, np.abs(wg).argmax(axis=-2)[..., None, :], axis=-2)[..., 0, :]
    d0 = (m / -8).astype(np.float16).astype(np.float32)
    u0 = np.clip(np.rint(wg / d0[..., None, :]) + 8, 0, 15)
    e0 = ((wg - d0[..., None, :] * (u0 - 8)) ** 2).sum()
    assert ((d - w) ** 2).sum() <= e0 * (1 + 1e-6)


def test_q4_packing_is_split_halves():
    w = np.zeros((32, 4), np.float32)
    w[0] = [1.0, -1.0, 0.5, 0.0]
    q, s = Q.quantize_q4(w)
    u = Q.unpack_q4(q)
    assert q.shape == (32, 2)
    assert np.array_equal(u[0], (q[0, [0, 1, 0, 1]] >> np.array([0, 0, 4, 4], np.uint8) & 15).astype(np.int8) - 8)
    np.testing.assert_allclose(Q.dequantize_q4(q, s)[0], w[0], atol=0.07)


def test_zero_groups_quantize_to_zero():
    for kind in KINDS:
        q, s = Q.quantize(kind, np.zeros((32, 8), np.float32))
        deq = Q.dequantize(Q.QTensor(kind, q, s))
        assert not np.isnan(deq).any() and np.all(deq == 0)


def test_rows_must_fill_groups():
    with pytest.raises(ValueError):
        Q.quantize_q8(np.zeros((30, 8), np.float32))
    with pytest.raises(ValueError):
        Q.quantize_q4(np.zeros((32, 7), np.float32))


# ---------------------------------------------------------------------------- kernels vs twins

def _close_q(got, ref, kind, W, x):
    """Within float rounding of the twin, plus (on AVX2, where the activations are rounded to
    int8 (q4) / int16 (q8) per chunk) the bound that rounding implies."""
    from colibri_server.model.kernels.cpu import HAVE_AVX2
    from colibri_server.model.kernels.quant_ir import act_error_bound
    scale = np.abs(Q.dequantize(W)) @ np.abs(x).astype(np.float64)
    bound = 2e-5 * scale + (act_error_bound(kind, W.q, W.s, x) if HAVE_AVX2 else 0) + 1e-30
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)


def _close(got, ref, Wabs, x, rtol=2e-5):
    scale = np.abs(Wabs) @ np.abs(x).astype(np.float64)
    assert np.all(np.abs(got - ref) <= rtol * scale + 1e-30), np.max(np.abs(got - ref) / (scale + 1e-30))


@pytest.mark.parametrize("kind", KINDS)
# (704, 2200): q8 has 3 activation chunks a row, so a call of the dot kernel takes 341 rows, and the
# far-apart row streams of AVX2 (kernels_simd.split_rows) leave remainder rows that run alone
@pytest.mark.parametrize("d,n,G", [(32, 8, 32), (64, 96, 32), (96, 1000, 32), (40, 34, 8), (2048, 1024, 32),
                                   (704, 2200, 32)])
def test_matvec_q(rng, kind, d, n, G):
    _, W = _qt(rng, kind, (d, n), G)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(d, np.nan, np.float32)
    KQ.matvec_q(W.q, W.s, x, out, *KQ.scratch(n))
    ref = KQ.matvec_q_ref(W.q, W.s, x)
    _close_q(out, ref, kind, W, x)
    # the threaded variant, whatever the number of chunks (it is run here, in a test process)
    for chunks in (1, 2, 3):
        out2 = np.full(d, np.nan, np.float32)
        KQ.matvec_q_par(W.q, W.s, x, out2, *KQ.scratch(n, chunks))
        _close_q(out2, ref, kind, W, x)


@pytest.mark.parametrize("kind", KINDS)
def test_matvec_q_can_fail(rng, kind):
    _, W = _qt(rng, kind, (64, 64))
    x = rng.standard_normal(64).astype(np.float32)
    out = np.zeros(64, np.float32)
    q = W.q.copy()
    q[37, 5] ^= 0x11
    q.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
    KQ.matvec_q(q, W.s, x, out, *KQ.scratch(64))
    assert not np.allclose(out, KQ.matvec_q_ref(W.q, W.s, x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_to_f32_q(rng, kind):
    _, W = _qt(rng, kind, (96, 70))
    out = np.zeros((40, 70), np.float32)
    KQ.rows_to_f32_q(W.q, W.s, 20, 60, out)
    assert np.array_equal(out, KQ.rows_to_f32_q_ref(W.q, W.s, 20, 60))   # exact: one product per weight


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 5, 300])
def test_matmul_q(rng, kind, T):
    _, W = _qt(rng, kind, (320, 64))
    X = rng.standard_normal((T, 64)).astype(np.float32)
    out = np.zeros((T, 320), np.float32)
    K.matmul(X, W, out, np.zeros((256, 64), np.float32), np.zeros((T, 256), np.float32))
    ref = K.matmul_ref(X, W)
    from colibri_server.model.kernels.gemm import HAVE_GEMM
    for t in range(T):
        if T == 1 or HAVE_GEMM:
            _close_q(out[t], ref[t], kind, W, X[t])       # the matvec kernel, or the integer GEMM (VNNI)
        else:
            _close(out[t], ref[t], Q.dequantize(W), X[t])  # dequantized tiles and BLAS


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d,n,G,T", [(64, 128, 32, 5), (128, 256, 64, 8), (320, 64, 32, 300), (96, 2200, 32, 3),
                                     (256, 1024, 64, 33), (16, 40, 8, 1), (128, 2200, 32, 2), (60, 256, 6, 2)])
def test_integer_gemm_is_the_matvec_kernel_per_token(rng, kind, d, n, G, T):
    # prefill's integer GEMM (AVX2, VNNI) rounds each token's activations exactly as decode's matvec does,
    # so a token's logits do not depend on how it was batched; n=2200 and n=40 leave tails; T <= 2 takes
    # the 4-row x 2-token kernel (G a multiple of 4; G = 6 keeps the 4-token one)
    from colibri_server.model.kernels import gemm as GE
    if not GE.HAVE_GEMM:
        pytest.skip("the integer GEMM needs AVX2")
    _, W = _qt(rng, kind, (d, n), G)
    X = rng.standard_normal((T, n)).astype(np.float32)
    out = np.full((T, d), np.nan, np.float32)
    (GE.matmul_q4_i8 if kind == "q4" else GE.matmul_q8_i16)(W.q, W.s, X, out)
    ref = K.matmul_ref(X, W)
    for t in range(T):
        one = np.full(d, np.nan, np.float32)
        KQ.matvec_q(W.q, W.s, X[t], one, *KQ.scratch(n))
        assert np.array_equal(out[t], one)
        _close_q(out[t], ref[t], kind, W, X[t])


@pytest.mark.parametrize("kind", KINDS)
def test_integer_kernels_are_vector_code(rng, kind):
    """The decode dot and the GEMM micro-kernel of this CPU are integer vector code: VNNI dots on zmm
    (vpdpbusd q4, vpdpwssd q8), or on AVX2 vpmaddubsw (q4) and vpmaddwd on ymm registers."""
    from numba import njit

    from colibri_server.model.kernels import gemm as GE
    from colibri_server.model.kernels import quant_ir as KS
    if not GE.HAVE_AVX2:
        pytest.skip("the integer kernels need AVX2")
    _, W = _qt(rng, kind, (64, 256), 32)
    cols = W.q.shape[1]                                   # packed bytes (q4) or columns (q8) of a row
    x = np.ones((4, 256), np.int8 if kind == "q4" else np.int16)   # 4 tokens' rounded activations
    sums = np.zeros(1024, np.int32)
    dot = KS._dot_u4_i8 if kind == "q4" else KS._dot_i8_i16
    gemm = GE._gemm_u4_i8 if kind == "q4" else GE._gemm_i8_i16

    @njit
    def run_dot(q, x, sums):
        dot(q, x, 0, q.shape[0], cols, 32, 0, sums)

    @njit
    def run_gemm_q4(q, x, sums):
        gemm(q, x, 0, 2, 0, 1, cols, sums)

    @njit
    def run_gemm_q8(q, x, sums):
        gemm(q, x, 0, 2, 0, 1, sums)
    for fn in (run_dot, run_gemm_q4 if kind == "q4" else run_gemm_q8):
        fn(W.q, x, sums)
        asm = fn.inspect_asm(fn.signatures[0])
        if KS.HAVE_VNNI512:
            assert ("vpdpbusd" if kind == "q4" else "vpdpwssd") in asm and "zmm" in asm
        else:
            for op in (["vpmaddubsw", "vpmaddwd"] if kind == "q4" else ["vpmaddwd"]):
                lines = [ln for ln in asm.splitlines() if op in ln]
                assert lines and all("ymm" in ln for ln in lines), op


@pytest.mark.parametrize("kind", KINDS)
def test_expert_ffn_q(rng, kind):
    E, I, D = 3, 64, 96
    _, w1 = _qt(rng, kind, (E, I, D), scale=0.2)
    _, w3 = _qt(rng, kind, (E, I, D), scale=0.2)
    _, w2 = _qt(rng, kind, (E, D, I), scale=0.2)
    x = rng.standard_normal(D).astype(np.float32)
    out0 = rng.standard_normal(D).astype(np.float32)
    ref = KQ.expert_ffn_q_ref(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, 2, x, 0.3, out0)
    for par in (False, True):
        out = out0.copy()
        h1, h3 = np.zeros(I, np.float32), np.zeros(I, np.float32)
        if par:
            KQ.expert_ffn_q_par(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, 2, x, 0.3, h1, h3, out, *KQ.scratch(D, 2))
        else:
            KQ.expert_ffn_q(w1.q, w1.s, w3.q, w3.s, w2.q, w2.s, 2, x, 0.3, h1, h3, out, *KQ.scratch(D))
        tol = {"q8": 1e-3, "q4": 3e-2}[kind]       # int16 / int8 activations through two layers
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_threaded_float_kernels(rng, kind):
    W = rng.standard_normal((3, 80, 48)).astype(np.float32)
    W = W if kind == "f32" else W.astype(np.float16).view(np.uint16)
    x = rng.standard_normal(48).astype(np.float32)
    for chunks in (1, 2, 3):
        out = np.zeros(80, np.float32)
        K.matvec_par(W[1], x, out, chunks)
        np.testing.assert_allclose(out, K.matvec_ref(W[1], x), rtol=1e-4, atol=1e-5)
    W2 = np.ascontiguousarray(W.transpose(0, 2, 1))                      # (E, 48, 80)
    for a in (W, W2):
        a.setflags(write=False)  # read-only as a model's weights: the signature a served model compiles
    out0 = np.zeros(48, np.float32)
    out = out0.copy()
    K.expert_ffn_par(W, W, W2, 1, x, 0.5, np.zeros(80, np.float32), np.zeros(80, np.float32), out, 2)
    np.testing.assert_allclose(out, K.expert_ffn_ref(W, W, W2, 1, x, 0.5, out0), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- format and config

def _cfg(**kw):
    base = dict(arch="mixtral", vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=64, rms_norm_eps=1e-5,
                max_position_embeddings=64, rope_theta=1e6, dtype="f16")
    return ModelConfig(**{**base, **kw})


def test_expected_tensors_of_a_quantized_config():
    cfg = _cfg(quant="q4", quant_overrides={"output": "q8", "attn_k": "none"})
    cfg.check()
    t = {n: (s, d) for n, s, d in expected_tensors(cfg)}
    assert t["blk.0.ffn_gate_exps"] == ((4, 64, 64), ("u4",))
    assert t["blk.0.ffn_gate_exps.s"] == ((4, 2, 64), ("f16",))
    assert t["output"] == ((64, 64), ("i8",)) and t["output.s"] == ((2, 64), ("f16",))
    assert t["blk.0.attn_k"] == ((32, 64), ("f16",)) and "blk.0.attn_k.s" not in t
    assert t["token_embd"] == ((64, 64), ("f16",)) and t["blk.0.ffn_gate_inp"][1] == ("f32",)


@pytest.mark.parametrize("kw,key", [
    (dict(quant="q3"), "quant"),
    (dict(quant="q8", quant_group=24), "quant_group"),
    (dict(quant="q8", quant_overrides={"ffn_gate_inp": "q8"}), "quant_overrides"),
    (dict(quant="q8", head_dim=8, num_kv_heads=2), "quant"),            # kv_dim 16 is not a multiple of 32
])
def test_bad_quant_config_is_named(kw, key):
    from colibri_server.model.config import ConfigError
    with pytest.raises(ConfigError) as e:
        _cfg(**kw).check()
    assert e.value.key == key


def test_u4_sizes_and_views(tmp_path):
    assert fmt.nbytes("u4", (3, 32, 10)) == 480 and fmt.nbytes("i8", (3, 4)) == 12
    with pytest.raises(ValueError):
        fmt.nbytes("u4", (32, 7))
    cfg = _cfg()
    w = ColibriWriter(tmp_path / "x.colibri", config=cfg.to_dict(), metadata={}, num_experts=4, num_layers=1)
    with pytest.raises(ValueError):
        w.declare("odd", "u4", (32, 7))
    w.abort()


# ---------------------------------------------------------------------------- converter and files

@pytest.fixture(scope="module")
def mixtral_files(built, tmp_path_factory):
    from colibri_server.model.convert import convert
    b = built("mixtral")
    root = tmp_path_factory.mktemp("quant")
    out = {"f32": b.colibri("f32")}
    for kind in KINDS:
        out[kind] = str(root / f"m-{kind}.colibri")
        # the tiny test shapes (32-row k/v projections) need the 32-row group to be quantized
        convert(b.hf_dir, out[kind], "f16", progress=False, quantize=kind, quant_group=32)
    return out


def test_converter_default_group_is_64_and_a_stated_constant(built):
    import json
    import os

    from colibri_server.model.convert import config_from_hf, quant_config
    b = built("mixtral")
    with open(os.path.join(b.hf_dir, "config.json")) as f:
        cfg = config_from_hf(json.load(f), "f16")
    assert Q.CONVERT_GROUP == 64
    assert quant_config(cfg, "q8").quant_group == 64 and quant_config(cfg, "q8", group=32).quant_group == 32


PROMPT = [5, 9, 17, 33, 71, 60, 41, 300, 7, 8, 9, 10]


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_model_tracks_the_float_one(mixtral_files, kind):
    ref = Model.open(mixtral_files["f32"]).logits(PROMPT)
    m = Model.open(mixtral_files[kind])
    assert m.config.quant == kind
    assert isinstance(m.weights.layers[0].w1, Q.QTensor) and m.weights.layers[0].w1.kind == kind
    assert isinstance(m.weights.output, Q.QTensor) and m.weights.output.kind == "q8"   # q4's head is q8
    assert m.weights.token_embd.dtype == np.uint16                                        # f16, never quantized
    got = m.logits(PROMPT)
    # the tiny test model amplifies weight noise (and a close router choice can flip), so this
    # is a sanity bound; the real quality check is bench/decode.py against llama.cpp's quants
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert corr >= {"q8": 0.995, "q4": 0.75}[kind]
    if kind == "q8":
        assert np.abs(got - ref).mean() <= 0.06 * np.abs(ref).mean()
    # decode through the KV cache (the matvec kernels) agrees with prefill (dequantize + BLAS)
    c = m.new_cache(32)
    m.prefill(c, np.array(PROMPT[:-1]))
    dec = m.decode(c, PROMPT[-1])[0]
    # (decode rounds the activations to int16 / int8 per chunk on AVX2; prefill does not)
    np.testing.assert_allclose(dec, got[-1], rtol=0, atol={"q8": 1e-3, "q4": 5e-2}[kind] * np.abs(got).max())


@pytest.mark.parametrize("kind", KINDS)
def test_fused_decode_of_a_quantized_model_is_the_general_path_bit_for_bit(mixtral_files, kind):
    """test_parity's fused-MoE decode check (the one-call MoE, kernels_decode.moe_quant, against a routing trace's
    general path) on the quantized files: here, after the test above compiled their kernels in this process, so
    that it loads them instead of waiting on another worker compiling the same signatures."""
    from test_parity import fused_decode_is_the_general_path
    fused_decode_is_the_general_path(Model.open(mixtral_files[kind]))


@pytest.mark.slow   # 22 s cold; test_threaded_model_gives_the_same_logits[q4] holds the same bits
def test_quantized_threads_match_single_thread(mixtral_files):
    a = Model.open(mixtral_files["q4"]).generate(PROMPT, max_tokens=8, ignore_eos=True)
    b = Model.open(mixtral_files["q4"], threads=2).generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert a == b


@pytest.mark.parametrize("kind", KINDS)
def test_threaded_model_gives_the_same_logits(mixtral_files, kind):
    # threads > 1: decode matvecs and (VNNI) prefill GEMMs split their rows over threads; each row is
    # computed exactly as on one thread. compile_threaded (what the master runs before fork) must
    # compile every threaded kernel these weights need
    one = Model.open(mixtral_files[kind])
    two = Model.open(mixtral_files[kind])
    two.compile_threaded()
    two.set_threads(2)
    assert np.array_equal(two.logits(PROMPT), one.logits(PROMPT))
    c1, c2 = one.new_cache(16), two.new_cache(16)
    for t in PROMPT[:4]:
        assert np.array_equal(two.decode(c2, t), one.decode(c1, t))


def test_prefill_bf16_beside_quantized_matrices(built, tmp_path):
    """A bf16 file with q8 experts and attention: prefill_bf16 takes the bf16 matrices only (the
    quantized ones keep the integer GEMM), and the logits stay within the activations' rounding."""
    from colibri_server.model.convert import convert
    from colibri_server.model.kernels import gemm as GE
    path = str(tmp_path / "bf16-q8.colibri")
    convert(built("mixtral").hf_dir, path, "bf16", progress=False, quantize="q8", quant_group=32,
            quantize_head="none")
    plain = Model.open(path).logits(PROMPT)
    m = Model.open(path, prefill_bf16=True)
    got = m.logits(PROMPT)
    assert m.prefill_bf16 and np.isfinite(got).all()
    if GE.HAVE_BF16_GEMM:
        assert m.weights.output.dtype == np.int16 and not np.array_equal(got, plain)   # the bf16 head ran
    assert np.abs(got - plain).max() < 0.05 * np.abs(plain).max()


def test_dequantize_file_round_trip(mixtral_files, tmp_path):
    src = mixtral_files["q8"]
    out = tmp_path / "deq.colibri"
    Q.dequantize_file(src, out, "f32")
    m, d = Model.open(src), Model.open(str(out))
    assert d.config.quant == "none" and d.config.dtype == "f32"
    np.testing.assert_array_equal(d.weights.layers[1].w2, Q.dequantize(m.weights.layers[1].w2))
    ref = d.logits(PROMPT)
    # the quantized model's prefill rounds activations per chunk (int16 for q8, kernels_gemm and
    # kernels_simd) where the float file does not: ~1e-4 of the largest logit apart, not exact
    np.testing.assert_allclose(m.logits(PROMPT), ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    cf = fmt.ColibriFile.open(str(out))
    cf.verify_checksums()


def test_cli_dequantize(mixtral_files, tmp_path):
    from colibri_server.cli import main
    main(["dequantize", mixtral_files["q4"], str(tmp_path / "o.colibri")])
    assert Model.open(str(tmp_path / "o.colibri")).config.dtype == "f16"
    with pytest.raises(SystemExit):
        main(["dequantize", str(tmp_path / "missing.colibri"), str(tmp_path / "o2.colibri")])


def test_shapes_that_do_not_fit_stay_float(built, tmp_path):
    from colibri_server.model.convert import convert
    b = built("qwen3_moe")                       # head_dim 24: kv_dim 48 is not a multiple of 32
    cfg = convert(b.hf_dir, str(tmp_path / "q.colibri"), "f16", progress=False, quantize="q8", quant_group=32)
    assert cfg.quant_overrides == {"attn_k": "none", "attn_v": "none"}
    m = Model.open(str(tmp_path / "q.colibri"))
    assert m.weights.layers[0].wk.dtype == np.uint16 and isinstance(m.weights.layers[0].wq, Q.QTensor)
    ref = Model.open(b.colibri("f32")).logits(PROMPT)
    assert np.corrcoef(m.logits(PROMPT).ravel(), ref.ravel())[0, 1] >= 0.99
