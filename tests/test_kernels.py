"""Kernels vs their numpy twins, for every weight dtype.

Tolerances: the f16/bf16 -> f32 conversions are exact, so every dtype gets the
same tolerance; the kernels differ from the (float64-accumulating) twins only
by float32 accumulation order, so dot-product-like results are checked
element-wise against ``RTOL * (|W| @ |x|)`` (the natural scale of the rounding
error of a dot product), elementwise kernels against rtol=1e-6/atol=1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_server.model import kernels as K

RTOL = 1e-5
DTYPES = ["f32", "f16", "bf16"]


def as_weights(a: np.ndarray, kind: str) -> np.ndarray:
    """float32 array -> stored weight array (read-only, like an mmap view)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if kind == "f32":
        w = a.copy()
    elif kind == "f16":
        w = a.astype(np.float16).view(np.uint16)
    elif kind == "bf16":
        w = (a.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)  # truncation
    else:
        raise ValueError(kind)
    w = np.ascontiguousarray(w)
    w.setflags(write=False)
    return w


def assert_dot_close(got, ref, scale, rtol=RTOL):
    """|got - ref| <= rtol * scale element-wise (scale = |A| @ |b|)."""
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    bound = rtol * scale + 1e-30
    bad = err > bound
    assert not bad.any(), f"max err/bound {np.max(err / bound):.3g} at {np.argwhere(bad)[:3]}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------
# conversions
# --------------------------------------------------------------------------


def test_f16_all_bit_patterns_exact():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    bits.setflags(write=False)
    out = np.empty((256, 256), np.float32)
    K.rows_to_f32(bits, 0, 256, out)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # incl. -0.0
    assert np.array_equal(ref, K.weights_to_f32(bits), equal_nan=True)


def test_bf16_all_bit_patterns_exact():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16).reshape(256, 256)
    bits.setflags(write=False)
    out = np.empty((256, 256), np.float32)
    K.rows_to_f32(bits, 0, 256, out)
    ref = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    # bit-exact, NaN payloads included (the conversion is a pure shift)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(K.weights_to_f32(bits).view(np.uint32), ref.view(np.uint32))


def test_to_f32_python_fallback():
    assert K.to_f32(np.uint16(0x3C00)) == 1.0  # f16 1.0
    assert K.to_f32(np.int16(0x3F80)) == 1.0  # bf16 1.0
    assert K.to_f32(np.int16(-16512)) == -1.0  # bf16 0xBF80
    assert K.to_f32(np.float32(2.5)) == 2.5


@pytest.mark.parametrize("kind", DTYPES)
def test_rows_to_f32_tile(rng, kind):
    W = as_weights(rng.standard_normal((37, 61)), kind)
    out = np.full((11, 61), np.nan, np.float32)
    K.rows_to_f32(W, 5, 16, out)
    assert np.array_equal(out, K.rows_to_f32_ref(W, 5, 16))
    assert np.array_equal(out, K.weights_to_f32(W)[5:16])


# --------------------------------------------------------------------------
# matvec / matmul
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("d,n", [(1, 1), (3, 5), (4, 8), (13, 7), (37, 61), (256, 1000),
                                 (5, 64), (33, 1024), (70, 192)])     # whole 64-column steps: kernels_float
def test_matvec(rng, kind, d, n):
    W = as_weights(rng.standard_normal((d, n)), kind)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(d, np.nan, np.float32)
    K.matvec(W, x, out)
    Wf = K.weights_to_f32(W).astype(np.float64)
    assert_dot_close(out, K.matvec_ref(W, x), np.abs(Wf) @ np.abs(x))


def test_matvec_can_fail(rng):
    W = rng.standard_normal((37, 61)).astype(np.float32)
    x = rng.standard_normal(61).astype(np.float32)
    ref = K.matvec_ref(W, x)
    W2 = W.copy()
    W2[36, 60] += 0.5  # last row (single-row tail), last column
    W2.setflags(write=False)
    out = np.empty(37, np.float32)
    K.matvec(W2, x, out)
    with pytest.raises(AssertionError):
        assert_dot_close(out, ref, np.abs(W) @ np.abs(x))


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_matmul(rng, kind, T):
    d, n = 37, 61
    W = as_weights(rng.standard_normal((d, n)), kind)
    X = rng.standard_normal((T, n)).astype(np.float32)
    out = np.full((T, d), np.nan, np.float32)
    scratch = np.empty((16, n), np.float32)  # 37 rows -> tiles 16, 16, 5
    K.matmul(X, W, out, scratch)
    Wf = K.weights_to_f32(W).astype(np.float64)
    assert_dot_close(out, K.matmul_ref(X, W), np.abs(X) @ np.abs(Wf).T)


class _CountingPool:
    """concurrent.futures' thread pool, counting the runs handed to it."""

    def __init__(self, n):
        from concurrent.futures import ThreadPoolExecutor
        self.pool, self.runs = ThreadPoolExecutor(n), 0

    def submit(self, *a):
        self.runs += 1
        return self.pool.submit(*a)


@pytest.mark.parametrize("kind", ["f16", "bf16", "f16-panels", "q8"])
@pytest.mark.parametrize("d,threads", [(704, 2), (704, 3), (192, 2), (1024, 2)])
def test_matmul_par_is_matmul_bit_for_bit(rng, monkeypatch, kind, d, threads):
    """Prefill on threads (kernels.matmul_par): each thread converts and multiplies whole tiles
    of its own run of rows, exactly as matmul does, so the product has the same bits; fewer
    tiles than threads (192 rows: one tile) leaves the pool unused. Quantized weights take these
    tiles only without the integer GEMM (switched off here)."""
    from colibri_server.model import quant
    from colibri_server.model.kernels import matmuls as K  # the module whose _GEMM is switched off
    from colibri_server.model.panels import Panels, to_panels
    n, T, tile = 512, 5, 256
    W = as_weights(rng.standard_normal((d, n)), kind.split("-")[0] if kind != "q8" else "f32")
    if kind == "f16-panels":
        W = Panels(to_panels(W))
    elif kind == "q8":
        W = quant.QTensor("q8", *quant.quantize("q8", W, 32))
        monkeypatch.setattr(K._GEMM, "HAVE_GEMM", False)
    X = rng.standard_normal((T, n)).astype(np.float32)
    want = np.full((T, d), np.nan, np.float32)
    K.matmul(X, W, want, np.empty((tile, n), np.float32))
    got = np.full((T, d), np.nan, np.float32)
    pool = _CountingPool(threads - 1)
    K.matmul_par(X, W, got, [np.empty((tile, n), np.float32) for _ in range(threads)],
                 [np.empty((T, tile), np.float32) for _ in range(threads)], pool)
    np.testing.assert_array_equal(got, want)
    assert pool.runs == min(threads, -(-d // tile)) - 1


def test_matmul_par_raises_a_thread_s_error_after_every_run_finished(rng, monkeypatch):
    from colibri_server.model.kernels import matmuls as K  # the module whose _tiles is replaced
    W = as_weights(rng.standard_normal((600, 64)), "f16")
    X = rng.standard_normal((3, 64)).astype(np.float32)
    bad = np.empty((256, 32), np.float32)                 # the second run's tile has the wrong width
    with pytest.raises(ValueError, match="scratch shape"):
        K.matmul_par(X, W, np.empty((3, 600), np.float32), [np.empty((256, 64), np.float32), bad],
                     [np.empty((3, 256), np.float32)] * 2, _CountingPool(1))
    # the first pool run fails at once while the second still works: the error leaves only after it
    import time
    K.matmul(X, W, np.empty((3, 600), np.float32), np.empty((256, 64), np.float32))   # compiled or loaded now
    done, real = [], K._tiles

    def tiles(X, W, out, scratch, tmp, r_lo, r_hi):
        if r_lo == 256:
            raise RuntimeError("run 2 failed")
        if r_lo == 512:
            time.sleep(0.5)
            done.append(r_lo)
        return real(X, W, out, scratch, tmp, r_lo, r_hi)
    monkeypatch.setattr(K, "_tiles", tiles)
    with pytest.raises(RuntimeError, match="run 2 failed"):
        K.matmul_par(X, W, np.empty((3, 600), np.float32), [np.empty((256, 64), np.float32)] * 3,
                     [np.empty((3, 256), np.float32)] * 3, _CountingPool(2))
    assert done == [512]


# --------------------------------------------------------------------------
# norms, embedding, rope
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T,D", [(1, 1), (5, 61), (3, 1000)])
def test_rmsnorm(rng, T, D):
    x = (rng.standard_normal((T, D)) * 3).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    out = np.full((T, D), np.nan, np.float32)
    K.rmsnorm(x, w, 1e-6, out)
    np.testing.assert_allclose(out, K.rmsnorm_ref(x, w, 1e-6), rtol=RTOL, atol=1e-6)
    # in place (out aliases x)
    x2 = x.copy()
    K.rmsnorm(x2, w, 1e-6, x2)
    np.testing.assert_allclose(x2, out, rtol=1e-6, atol=0)


def test_rmsnorm_eps_matters():
    x = np.full((1, 4), 1e-3, np.float32)
    w = np.ones(4, np.float32)
    a = np.empty_like(x)
    b = np.empty_like(x)
    K.rmsnorm(x, w, 1e-6, a)
    K.rmsnorm(x, w, 0.0, b)
    np.testing.assert_allclose(b, 1.0, rtol=1e-6)
    assert a[0, 0] < 0.9  # sqrt(1e-6 / (1e-6 + 1e-6)) ~ 0.707
    np.testing.assert_allclose(a, K.rmsnorm_ref(x, w, 1e-6), rtol=1e-6)


def test_rmsnorm_heads(rng):
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    out = np.empty_like(x)
    K.rmsnorm_heads(x, w, 1e-6, out)
    np.testing.assert_allclose(out, K.rmsnorm_heads_ref(x, w, 1e-6), rtol=RTOL, atol=1e-6)
    # per-head normalisation differs from normalising the whole row
    whole = K.rmsnorm_ref(x.reshape(3, 64), np.tile(w, 4), 1e-6).reshape(3, 4, 16)
    assert not np.allclose(out, whole, rtol=1e-3)


@pytest.mark.parametrize("kind", DTYPES)
def test_embed(rng, kind):
    table = as_weights(rng.standard_normal((37, 61)), kind)
    ids = np.array([0, 36, 5, 5, 17], np.int64)
    out = np.full((5, 61), np.nan, np.float32)
    K.embed(table, ids, out)
    assert np.array_equal(out, K.embed_ref(table, ids))
    with pytest.raises(IndexError):
        K.embed(table, np.array([37], np.int64), out[:1])


def _rope_tables(P, hd, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(P)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def test_rope(rng):
    T, H, hd = 5, 3, 16
    cos, sin = _rope_tables(64, hd)
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.array([0, 7, 8, 9, 63], np.int64)
    ref = K.rope_ref(x, pos, cos, sin)
    y = x.copy()
    K.rope(y, pos, cos, sin)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    # rotate_half pairs i with i + hd/2; the interleaved convention differs
    inter = x.copy()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    inter[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    inter[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    assert not np.allclose(y, inter, atol=1e-3)


def test_rope_matches_hf_formula(rng):
    # HF: q * cos + rotate_half(q) * sin, with cos/sin duplicated over both halves
    T, H, hd = 2, 2, 8
    cos, sin = _rope_tables(16, hd)
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.array([3, 11], np.int64)
    c = np.concatenate([cos[pos], cos[pos]], -1)[:, None, :]
    s = np.concatenate([sin[pos], sin[pos]], -1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    hf = x * c + rot * s
    y = x.copy()
    K.rope(y, pos, cos, sin)
    np.testing.assert_allclose(y, hf, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------
# SwiGLU
# --------------------------------------------------------------------------


def test_silu_mul(rng):
    g = (rng.standard_normal((3, 61)) * 4).astype(np.float32)
    g[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    u = rng.standard_normal((3, 61)).astype(np.float32)
    ref = K.silu_mul_ref(g, u)
    out = np.full_like(g, np.nan)
    K.silu_mul(g, u, out)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    g2 = g.copy()
    K.silu_mul(g2, u, g2)  # aliasing
    np.testing.assert_array_equal(g2, out)


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("I,D", [(37, 61), (64, 128)])
def test_expert_ffn(rng, kind, I, D):
    E, e = 3, 1
    w1f = rng.standard_normal((E, I, D)).astype(np.float32) * 0.2
    w3f = rng.standard_normal((E, I, D)).astype(np.float32) * 0.2
    w2f = rng.standard_normal((E, D, I)).astype(np.float32) * 0.2
    w1, w3, w2 = (as_weights(a, kind) for a in (w1f, w3f, w2f))
    x = rng.standard_normal(D).astype(np.float32)
    out0 = rng.standard_normal(D).astype(np.float32)
    ref = K.expert_ffn_ref(w1, w3, w2, e, x, 0.7, out0)
    out = out0.copy()
    h1 = np.empty(I, np.float32)
    h3 = np.empty(I, np.float32)
    K.expert_ffn(w1, w3, w2, e, x, np.float32(0.7), h1, h3, out)
    # error scale: |out0| + 0.7 * |W2| @ |h| with |h| bounded by the reference h
    W2 = np.abs(K.weights_to_f32(w2[e]).astype(np.float64))
    W1 = np.abs(K.weights_to_f32(w1[e]).astype(np.float64))
    W3 = np.abs(K.weights_to_f32(w3[e]).astype(np.float64))
    hscale = (W1 @ np.abs(x)) * (W3 @ np.abs(x))
    scale = np.abs(out0) + 0.7 * (W2 @ hscale)
    assert_dot_close(out, ref, scale, rtol=3 * RTOL)
    # other experts give something else
    out_other = out0.copy()
    K.expert_ffn(w1, w3, w2, 0, x, np.float32(0.7), h1, h3, out_other)
    assert not np.allclose(out_other, out, atol=1e-3)


# --------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 2), (5, 60, 4), (3, 64, 8), (2, 5, 5)])
def test_route(rng, renorm, T, E, k):
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    idx = np.full((T, k), -1, np.int32)
    w = np.full((T, k), np.nan, np.float32)
    K.route(logits, k, renorm, idx, w)
    ridx, rw = K.route_ref(logits, k, renorm)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)
    assert (np.diff(w, axis=1) <= 0).all()
    if renorm:
        np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
    else:
        assert (w.sum(1) <= 1.0 + 1e-5).all()


def test_route_ties_lower_index_first():
    logits = np.array([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    idx = np.empty((2, 3), np.int32)
    w = np.empty((2, 3), np.float32)
    K.route(logits, 3, False, idx, w)
    np.testing.assert_array_equal(idx, [[1, 2, 4], [0, 1, 2]])
    np.testing.assert_array_equal(idx, K.route_ref(logits, 3, False)[0])
    np.testing.assert_allclose(w[1], 0.2, rtol=1e-6)


def _check_grouping(idx, E):
    T, k = idx.shape
    counts = np.full(E, -7, np.int64)
    offsets = np.full(E + 1, -7, np.int64)
    order = np.full(T * k, -7, np.int64)
    K.group_by_expert(idx, E, counts, offsets, order)
    rc, ro, rord = K.group_by_expert_ref(idx, E)
    # invariants
    assert offsets[0] == 0 and offsets[-1] == T * k
    np.testing.assert_array_equal(np.diff(offsets), counts)
    assert sorted(order.tolist()) == list(range(T * k))
    flat = idx.reshape(-1)
    for e in range(E):
        seg = order[offsets[e] : offsets[e + 1]]
        assert (flat[seg] == e).all()
        assert (np.diff(seg) > 0).all()  # stable
    # twin
    np.testing.assert_array_equal(counts, rc)
    np.testing.assert_array_equal(offsets, ro)
    np.testing.assert_array_equal(order, rord)


def test_group_by_expert(rng):
    T, k, E = 9, 3, 6
    idx = rng.integers(0, E - 1, size=(T, k)).astype(np.int32)  # expert E-1 unused
    _check_grouping(idx, E)
    counts = np.empty(E, np.int64)
    offsets = np.empty(E + 1, np.int64)
    order = np.empty(T * k, np.int64)
    K.group_by_expert(idx, E, counts, offsets, order)
    assert counts[E - 1] == 0
    bad = idx.copy()
    bad[2, 1] = E
    with pytest.raises(ValueError):
        K.group_by_expert(bad, E, counts, offsets, order)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 12),
    k=st.integers(1, 4),
    E=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_group_by_expert_property(T, k, E, seed):
    idx = np.random.default_rng(seed).integers(0, E, size=(T, k)).astype(np.int32)
    _check_grouping(idx, E)


# --------------------------------------------------------------------------
# argmax
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9, 61, 151936])
def test_argmax(rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    assert K.argmax(x) == K.argmax_ref(x)
    x[n - 1] = 100.0
    assert K.argmax(x) == n - 1
    x[n // 3] = 100.0  # tie: first index wins
    assert K.argmax(x) == n // 3 == K.argmax_ref(x)


def test_argmax_negative_inf():
    x = np.array([-np.inf, -np.inf, -5.0, -np.inf], np.float32)
    assert K.argmax(x) == 2
    assert K.argmax(np.full(5, -np.inf, np.float32)) == 0


@pytest.mark.parametrize("pos", [0, 5, 60])
def test_argmax_nan_and_inf_like_numpy(rng, pos):
    x = rng.standard_normal(61).astype(np.float32)
    y = x.copy()
    y[pos] = np.nan
    y[30] = np.inf
    assert K.argmax(y) == int(np.argmax(y))
    y[pos] = 0.0
    y[40] = np.inf
    assert K.argmax(y) == 30 == int(np.argmax(y))


@pytest.mark.parametrize("shape,dtype", [((3, 1024), np.float32), (7, np.float32), ((2, 5), np.int64),
                                         ((1, 1536), np.float32), (0, np.int16), ((4, 33), np.int16)])
def test_aligned_zeros_start_on_a_cache_line(shape, dtype):
    from colibri_server.model.kernels.buffers import ALIGN, aligned_zeros
    for _ in range(8):                      # several allocations: malloc's offsets vary
        a = aligned_zeros(shape, dtype)
        assert a.shape == ((shape,) if np.isscalar(shape) else shape) and a.dtype == dtype
        assert (a.size == 0 or a.ctypes.data % ALIGN == 0) and a.flags.c_contiguous and a.flags.writeable
        assert not a.any()


def test_workspace_decode_vectors_are_aligned():
    """Every vector a decode matvec reads or writes starts on a cache line (see buffers.py: a
    16-byte-aligned input cost the f16 head a fifth of its streaming rate)."""
    from colibri_server.model.config import ModelConfig
    from colibri_server.model.kernels import quant as KQ
    from colibri_server.model.transformer import Workspace
    cfg = ModelConfig(arch="mixtral", vocab_size=100, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=96,
                      rms_norm_eps=1e-5, max_position_embeddings=64, rope_theta=1e4, dtype="f16")
    ws = Workspace(cfg, rows=8, threads=3)
    for name in ("x", "h", "qkv", "attn", "sub", "ffn_g", "h1", "h3", "logits", "router"):
        assert getattr(ws, name).ctypes.data % 64 == 0, name
    assert ws.score_buffer(100).ctypes.data % 64 == 0
    for row in list(ws.xs) + list(ws.xi):          # one scratch row per thread chunk
        assert row.ctypes.data % 64 == 0
    assert len(ws.tiles) == len(ws.mm_tmps) == 3       # prefill's tiles, one per thread
    for a in ws.tiles + ws.mm_tmps:
        assert a.ctypes.data % 64 == 0
    assert KQ.scratch_len(1000) % 16 == 0 and KQ.xi_len(1000) % 32 == 0


# --------------------------------------------------------------------------
# bf16 GEMM (opt-in prefill of bf16 weights with bf16 activations)
# --------------------------------------------------------------------------

needs_bf16 = pytest.mark.skipif(not __import__("colibri_server.model.kernels.gemm", fromlist=["x"]).HAVE_BF16_GEMM,
                                reason="CPU without avx512bf16")


def test_round_bf16_is_round_to_nearest_even(rng):
    import torch

    from colibri_server.model.kernels import gemm as GE
    x = np.concatenate([rng.standard_normal(997).astype(np.float32) * 10,
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 1e-40, -1e-45, 1.0 + 2**-8,
                                  1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], np.float32)]).reshape(1, -1)
    xb = np.zeros((4, x.shape[1]), np.int16)
    GE.round_bf16(x, xb)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(xb[:1], want)
    assert not xb[1:].any()
    xn = np.array([[np.nan]], np.float32)
    GE.round_bf16(xn, xb[:1, :1])
    assert np.isnan(K.weights_to_f32(xb[:1, :1]))[0, 0]


@needs_bf16
@pytest.mark.parametrize("T,d,n", [(1, 7, 40), (5, 64, 1024), (33, 131, 96), (3, 3, 31), (8, 130, 64)])
def test_bf16_gemm_is_the_bf16_products_summed_in_f32(rng, T, d, n):
    """matmul_bf16 = round_bf16(X) @ W.T exactly but for f32 summation order: every shape tail
    (tokens not a multiple of 4, rows not of BF16_R or BF16_ROWS, columns not of 32) included;
    the threaded form gives the same bits."""
    from colibri_server.model.kernels import gemm as GE
    X = (rng.standard_normal((T, n)) * 3).astype(np.float32)
    W = as_weights(rng.standard_normal((d, n)).astype(np.float32), "bf16")
    out = np.full((T, d), np.nan, np.float32)
    GE.matmul_bf16(W, X, out)
    xb = np.zeros((T, n), np.int16)
    GE.round_bf16(X, xb)
    xf, wf = K.weights_to_f32(xb).astype(np.float64), K.weights_to_f32(W).astype(np.float64)
    assert_dot_close(out, xf @ wf.T, np.abs(xf) @ np.abs(wf).T)
    assert not np.array_equal(xf, X)                      # the activations were rounded
    par = np.full_like(out, np.nan)
    GE.matmul_bf16_par(W, X, par, 3)
    np.testing.assert_array_equal(par, out)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_float_ir_rows_take_whole_steps_and_keep_alpha_and_accumulate(rng, kind):
    """kernels_float runs the f16/bf16 matvec when the rows are contiguous whole steps (64 columns
    on AVX-512, 32 on AVX2; any row stride) and says so, declines otherwise (Numba's loop then runs),
    and applies alpha and accumulate like _matvec_core."""
    from numba import njit

    from colibri_server.model.kernels import float_ir as KF
    if not (KF.HAVE_FLOAT_IR or KF.HAVE_FLOAT_IR8):
        pytest.skip("CPU without AVX-512 or AVX2+F16C")
    step = KF.STEP if KF.HAVE_FLOAT_IR else KF.STEP8

    @njit
    def probe(W, x, out):                 # float_rows is an overload: callable from Numba only
        return KF.float_rows(W, x, out, np.float32(1.0), False)
    Wf = rng.standard_normal((9, 2 * step)).astype(np.float32)
    W = as_weights(Wf, kind)
    x = rng.standard_normal(2 * step).astype(np.float32)
    ref = K.matvec_ref(W, x).astype(np.float64)
    scale = np.abs(K.weights_to_f32(W)).astype(np.float64) @ np.abs(x)
    out = np.full(9, np.nan, np.float32)
    assert probe(W, x, out)
    assert_dot_close(out, ref, scale)
    acc = np.full(9, 2.0, np.float32)
    K._matvec_core(W, x, acc, np.float32(-0.5), True)
    assert_dot_close(acc, 2.0 - 0.5 * ref, scale)
    assert not probe(as_weights(Wf[:, :step + 3], kind), x, out)              # a part step
    wide = as_weights(np.concatenate([Wf, Wf], axis=1), kind)
    out2 = np.full(9, np.nan, np.float32)
    assert probe(wide[:, :2 * step], x, out2)                                 # strided rows, each contiguous
    np.testing.assert_array_equal(out2, out)
    assert not probe(wide[:, ::2], x, out)                                    # columns not contiguous
    assert not probe(Wf, x, out)                                               # f32: Numba/BLAS


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("panels", [False, True])
def test_avx2_float_kernels_vector_code_and_rows_independent_of_their_neighbours(rng, kind, panels):
    """The AVX2 matvec (kernels_float, STREAMS8 far-apart rows at once): ymm FMAs on converted weights,
    and a row's result is the same bits whatever the matrix around it: the whole matrix, any row
    slice (the threaded split), a remainder row, a fastmath caller (_matvec_core)."""
    from numba import njit

    from colibri_server.model.kernels import float_ir as KF
    from colibri_server.model.panels import to_panels
    if not KF.HAVE_FLOAT_IR8:
        pytest.skip("not an AVX2 CPU without AVX-512")
    d, n = 2 * KF.STREAMS8 * 5 + 3, 512
    W = as_weights(rng.standard_normal((d, n)).astype(np.float32), kind)
    M = to_panels(W) if panels else W
    kern = (KF._panels8 if panels else KF._rows8)[kind == "bf16"]

    @njit
    def run(W, x, out):
        kern(W, x, out, np.float32(1.0), False)
    x = rng.standard_normal(n).astype(np.float32)
    whole = np.full(d, np.nan, np.float32)
    run(M, x, whole)
    assert_dot_close(whole, K.matvec_ref(W, x).astype(np.float64),
                     np.abs(K.weights_to_f32(W)).astype(np.float64) @ np.abs(x))
    for r0, r1 in [(0, 1), (0, KF.STREAMS8), (3, d), (1, d - 2), (d - 5, d)]:
        part = np.full(r1 - r0, np.nan, np.float32)
        run(M[:, r0:r1] if panels else M[r0:r1], x, part)
        np.testing.assert_array_equal(part, whole[r0:r1])
    via_core = np.full(d, np.nan, np.float32)
    K.matvec(M, x, via_core)
    np.testing.assert_array_equal(via_core, whole)
    par = np.full(d, np.nan, np.float32)
    K.matvec_par(M, x, par, 3)
    np.testing.assert_array_equal(par, whole)
    asm = run.inspect_asm(run.signatures[0])
    fmas = [ln for ln in asm.splitlines() if "vfmadd" in ln]
    assert len(fmas) >= 4 * KF.STREAMS8 and all("ymm" in ln for ln in fmas)
    assert ("vcvtph2ps" in asm) == (kind == "f16")


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("groups", [(0, 0), (4, 2), (8, 3)])
@pytest.mark.parametrize("renorm,scale", [(True, 1.0), (True, 2.5), (False, 16.0)])
def test_route_rule_matches_its_twin(rng, sigmoid, groups, renorm, scale):
    """Version-2 routing (sigmoid or softmax, selection-only bias, group-limited choice, routed
    scale) against its numpy twin, and each part changing the answer."""
    T, E, k = 9, 32, 4
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32)
    flags = (K.moe.RULE_RENORM if renorm else 0) | (K.moe.RULE_SIGMOID if sigmoid else 0) | \
        (K.moe.RULE_GROUPS if groups[0] else 0)
    rule = np.array([flags, *groups, scale], np.float32)
    idx = np.full((T, k), -1, np.int32)
    w = np.full((T, k), np.nan, np.float32)
    K.route_rule(logits, k, rule, bias, idx, w)
    ridx, rw = K.route_rule_ref(logits, k, rule, bias)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)
    if renorm:
        np.testing.assert_allclose(w.sum(1), scale, rtol=1e-5)
    if groups[0]:                       # every choice inside the kept groups: at most topk_group groups
        assert all(len(set(r // (E // groups[0]))) <= groups[1] for r in idx)
    # the bias moves the choice, not the weights: without it another expert set for some token
    nob = np.empty_like(idx)
    K.route_rule(logits, k, rule, np.zeros(0, np.float32), nob, np.empty_like(w))
    assert (nob != idx).any()
    s = 1 / (1 + np.exp(-logits.astype(np.float64))) if sigmoid else None
    if sigmoid and not renorm:          # weights are the uncorrected scores of the chosen experts
        np.testing.assert_allclose(w, np.take_along_axis(s, idx, 1) * scale, rtol=1e-5)


def test_route_rule_groups_tie_to_the_lower_index():
    logits = np.zeros((1, 8), np.float32)
    idx, w = np.empty((1, 2), np.int32), np.empty((1, 2), np.float32)
    K.route_rule(logits, 2, np.array([K.moe.RULE_SIGMOID | K.moe.RULE_GROUPS, 4, 1, 1.0], np.float32),
                 np.zeros(0, np.float32), idx, w)
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(w, 0.5)
