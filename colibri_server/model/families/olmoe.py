"""OLMoE (OlmoeForCausalLM): q/k norms over the whole projection, optional q/k/v clipping,
no renormalisation of the top-k weights by default."""
from __future__ import annotations

from .base import Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**kw, "num_experts": get(hf, "num_experts", "num_local_experts"), "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "intermediate_size"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "qkv_bias": bias, "o_bias": bias, "qk_norm": "full", "clip_qkv": float(hf.get("clip_qkv") or 0.0)}


def gguf_config(kv, kw: dict) -> dict:
    return {**kw, "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": kv.arch_int("expert_feed_forward_length", "feed_forward_length"),
            "norm_topk_prob": bool(kv.arch_value("expert_weights_norm", False)),
            "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"), "o_bias": kv.has_tensor("blk.0.attn_output.bias"),
            "qk_norm": "full", "clip_qkv": float(kv.arch_value("attention.clamp_kqv", 0.0) or 0.0)}


FAMILY = Family(arch="olmoe", hf_classes=("OlmoeForCausalLM",), hf_config=hf_config,
                gguf_arch="olmoe", gguf_config=gguf_config)
