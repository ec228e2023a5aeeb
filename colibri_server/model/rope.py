"""Rotary position tables, computed once per model as Hugging Face computes them.

inv_freq follows transformers' modeling_rope_utils for each rope_type (default, linear,
yarn, llama3), in float32 like the reference, and cos/sin tables [P, hd/2] hold
cos(p * inv_freq) * attention_factor for every position p < P: RoPE in the forward pass
is then a table lookup (kernels.rope).
"""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)           # (dim/2,) f32
    return (np.float32(1.0) / np.power(np.float32(theta), exps)).astype(np.float32)


def inv_freq_and_factor(cfg: ModelConfig, positions: int = 0):
    """(inv_freq (hd/2,) f32, attention_factor float) for cfg's rope_type. A partial rotary
    embedding (rotary_dim < head_dim, GLM-4.5) has rotary_dim/2 frequencies and zeros after them:
    the converter has moved each head's rotated dims to the pairs (i, i + hd/2), i < rotary_dim/2,
    and the rest to the pairs whose angle stays 0 (cos 1, sin 0: passed through; the config
    check keeps the attention factor at 1 there)."""
    inv, factor = _inv_freq_and_factor(cfg, positions)
    if inv.shape[0] < cfg.head_dim // 2:
        inv = np.concatenate([inv, np.zeros(cfg.head_dim // 2 - inv.shape[0], np.float32)])
    return inv, factor


def _inv_freq_and_factor(cfg: ModelConfig, positions: int = 0):
    dim, theta = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta
    rs = cfg.rope_scaling or {}
    rtype = rs.get("rope_type", "default")
    inv = _base_inv_freq(theta, dim)
    if rtype == "default":
        return inv, 1.0
    if rtype == "linear":
        return (inv / np.float32(rs["factor"])).astype(np.float32), 1.0
    if rtype == "factors":          # llama.cpp's rope_freqs: one divisor per pair (its Llama 3 GGUFs)
        return (inv / np.asarray(rs["factors"], np.float32)).astype(np.float32), 1.0
    if rtype == "longrope":
        # Phi-3.5-MoE. transformers takes the short factors up to original_max_position_embeddings and the
        # long ones past it, per sequence; a table here serves every sequence of a context of `positions`,
        # so it takes the long ones when the context reaches past it (llama.cpp's choice, by n_ctx): the
        # same as transformers for every sequence when the context is within it
        orig = float(rs["original_max_position_embeddings"])
        long = positions > orig
        att = rs.get("long_mscale" if long else "short_mscale") or rs.get("attention_factor")
        if att is None:
            f = rs.get("factor") or cfg.max_position_embeddings / orig
            att = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(orig))
        ext = np.asarray(rs["long_factor" if long else "short_factor"], np.float32)
        return (np.float32(1.0) / (ext * np.power(np.float32(theta), np.arange(0, dim, 2, dtype=np.float32)
                                                  / np.float32(dim)))).astype(np.float32), float(att)
    if rtype == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = np.float32(2 * math.pi) / inv
        out = np.where(wavelen > old / lo, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
        smoothed = (1 - smooth) * out / np.float32(factor) + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if rtype == "yarn":
        orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
        factor = rs.get("factor") or cfg.max_position_embeddings / orig
        att = rs.get("attention_factor")
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if att is None:
            att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) \
                else get_mscale(factor)
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extra = (1 - ramp).astype(np.float32)                                    # (dim/2,)
        pos_freqs = np.power(np.float32(theta), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        interp, extrap = np.float32(1.0) / (np.float32(factor) * pos_freqs), np.float32(1.0) / pos_freqs
        return (interp * (1 - extra) + extrap * extra).astype(np.float32), float(att)
    raise ValueError(f"rope_type {rtype!r} is not supported")


def rope_tables(cfg: ModelConfig, positions: int):
    """cos, sin: (positions, hd/2) f32 tables, already scaled by the attention factor."""
    inv, factor = inv_freq_and_factor(cfg, positions)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]      # (P, hd/2) f32
    cos = (np.cos(freqs) * np.float32(factor)).astype(np.float32)
    sin = (np.sin(freqs) * np.float32(factor)).astype(np.float32)
    return cos, sin


def attention_scale(cfg: ModelConfig) -> float:
    """The softmax scale of q.k: 1/sqrt(head_dim). Latent attention (DeepSeek) scales by its whole
    query head, 1/sqrt(qk_nope_head_dim + head_dim), and under yarn with mscale_all_dim by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2 more, as transformers' DeepSeek attention does."""
    if not cfg.mla:
        return 1.0 / math.sqrt(cfg.head_dim)
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    m_all, factor = rs.get("mscale_all_dim"), rs.get("factor")
    if rs.get("rope_type", "default") != "default" and m_all and factor and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale
