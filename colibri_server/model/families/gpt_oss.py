"""GPT-OSS (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b).

Its own:
- attention sinks: a learned logit per head (self_attn.sinks) in every softmax's sum, attended to by
  nothing (blk.N.attn_sinks, kernels/attn and kernels/paged);
- sliding-window and full-attention layers alternating (layer_types -> sliding_layers);
- biases on q, k, v and o (attention_bias);
- the router: a linear layer with a bias (mlp.router.weight / .bias: format flag BIAS_IN_LOGITS), the
  top-k of its logits, a softmax over those k (written as SOFTMAX + RENORM: the same weights);
- experts with biases and a clamped SwiGLU, (min(max(up, -limit), limit) + 1) * g * sigmoid(alpha g),
  g = min(gate, limit) (config swiglu_limit, swiglu_alpha; moe.py); the checkpoint's fused
  gate_up_proj (E, D, 2I) interleaves gate and up columns (gate the even ones) and holds every
  expert transposed against ours (x @ W), as does down_proj (E, I, D): the converter splits and
  transposes them one expert at a time;
- MXFP4 expert weights (`*_blocks` + `*_scales`, the released checkpoints) dequantized by the converter
  (mxfp4.py) and stored in the float dtype or requantized to q8/q4;
- yarn RoPE without truncation (rope_scaling truncate false).
"""
from __future__ import annotations

import numpy as np

from .base import ConvertError, Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    L = kw["num_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if len(types) != L or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConvertError(f"config.json: layer_types {types!r} must be {L} of sliding_attention / full_attention")
    window = int(hf.get("sliding_window") or 0)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    bias = bool(hf.get("attention_bias", True))
    return {**kw, "num_experts": get(hf, "num_local_experts"), "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "intermediate_size"), "norm_topk_prob": True,
            "qkv_bias": bias, "o_bias": bias, "attn_sinks": True, "router_bias": True, "expert_bias": True,
            "sliding_window": window if sliding else 0,
            "sliding_layers": sliding if 0 < len(sliding) < L else (),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}


def hf_tensor(hf: dict, cfg, key: str, p: str):
    m = p + "mlp."
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up, down = (m + "experts.gate_up_proj", (E, D, 2 * I)), (m + "experts.down_proj", (E, I, D))
    names = {
        "attn_sinks": ("plain", p + "self_attn.sinks"),
        "ffn_gate_inp": ("plain", m + "router.weight"), "ffn_gate_inp_b": ("plain", m + "router.bias"),
        # one expert at a time: gate_up (D, 2I) -> gate (I, D) = its even columns, transposed; up the odd ones
        "ffn_gate_exps": ("derived", [gate_up], lambda w: np.ascontiguousarray(w[:, 0::2].T), "per_matrix"),
        "ffn_up_exps": ("derived", [gate_up], lambda w: np.ascontiguousarray(w[:, 1::2].T), "per_matrix"),
        "ffn_down_exps": ("derived", [down], lambda w: np.ascontiguousarray(w.T), "per_matrix"),
        "ffn_gate_exps_b": ("derived", [(m + "experts.gate_up_proj_bias", (E, 2 * I))],
                            lambda b: np.ascontiguousarray(b[:, 0::2])),
        "ffn_up_exps_b": ("derived", [(m + "experts.gate_up_proj_bias", (E, 2 * I))],
                          lambda b: np.ascontiguousarray(b[:, 1::2])),
        "ffn_down_exps_b": ("plain", m + "experts.down_proj_bias"),
    }
    return names.get(key)


def gguf_config(kv, kw: dict) -> dict:
    """llama.cpp's gpt-oss: sliding_window on the even layers (its fixed pattern), the clamped SwiGLU's
    constants fixed too (limit 7, alpha 1.702: not in the file), yarn without truncation as the model
    defines it."""
    L = kw["num_layers"]
    window = kv.arch_int("attention.sliding_window", default=0)
    scaling = dict(kw["rope_scaling"])
    if scaling.get("rope_type") == "yarn":
        scaling["truncate"] = False
    bias = kv.has_tensor("blk.0.attn_q.bias")
    return {**kw, "rope_scaling": scaling, "num_experts": kv.arch_int("expert_count"),
            "top_k": kv.arch_int("expert_used_count"), "moe_intermediate_size": kv.arch_int("expert_feed_forward_length"),
            "norm_topk_prob": True, "qkv_bias": bias, "o_bias": kv.has_tensor("blk.0.attn_output.bias"),
            "attn_sinks": True, "router_bias": True, "expert_bias": True,
            "sliding_window": window, "sliding_layers": tuple(range(0, L, 2)) if window and L > 1 else (),
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


GGUF_NAMES = {"attn_sinks": "attn_sinks.weight", "ffn_norm": "post_attention_norm.weight",
              "ffn_gate_inp_b": "ffn_gate_inp.bias", "ffn_gate_exps_b": "ffn_gate_exps.bias",
              "ffn_up_exps_b": "ffn_up_exps.bias", "ffn_down_exps_b": "ffn_down_exps.bias"}


def gguf_tensor(kv, cfg, name: str):
    if not name.startswith("blk."):
        return None
    blk, key = name.rsplit(".", 1)
    return (f"{blk}.{GGUF_NAMES[key]}", None) if key in GGUF_NAMES else None


FAMILY = Family(arch="gpt_oss", hf_classes=("GptOssForCausalLM",), hf_config=hf_config, hf_tensor=hf_tensor,
                default_rope_theta=150000.0, gguf_arch="gpt-oss", gguf_config=gguf_config, gguf_tensor=gguf_tensor)
