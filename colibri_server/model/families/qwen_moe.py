"""Qwen2-MoE and Qwen3-MoE: dense layers mixed in (decoder_sparse_step, mlp_only_layers);
Qwen2-MoE has a gated shared expert and q/k/v biases, Qwen3-MoE per-head q/k norms."""
from __future__ import annotations

from .base import ConvertError, Family, get


def _common(hf: dict, kw: dict, arch_name: str) -> dict:
    L = kw["num_layers"]
    E = get(hf, "num_experts", "num_local_experts")
    step = hf.get("decoder_sparse_step", 1) or 1
    mlp_only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(L) if i in mlp_only or not (E > 0 and (i + 1) % step == 0)]
    return {**kw, "num_experts": E, "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "moe_intermediate_size"),
            "intermediate_size": hf.get("intermediate_size", 0) if dense else 0,
            "dense_layers": tuple(dense)}


def qwen2_moe_config(hf: dict, kw: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise ConvertError("config.json: use_sliding_window=true is not supported for Qwen2MoeForCausalLM "
                           "(sliding windows on some layers only)")
    return {**_common(hf, kw, "Qwen2MoeForCausalLM"), "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0) or 0,
            "qkv_bias": bool(hf.get("qkv_bias", True))}


def qwen3_moe_config(hf: dict, kw: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**_common(hf, kw, "Qwen3MoeForCausalLM"), "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "qkv_bias": bias, "o_bias": bias, "qk_norm": "head",
            "sliding_window": (hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0}


def _gguf_common(kv, kw: dict) -> dict:
    L = kw["num_layers"]
    dense = tuple(i for i in range(L) if not kv.has_tensor(f"blk.{i}.ffn_gate_inp.weight"))
    return {**kw, "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": kv.arch_int("expert_feed_forward_length"),
            "intermediate_size": kv.arch_int("feed_forward_length") if dense else 0, "dense_layers": dense}


def qwen2_moe_gguf(kv, kw: dict) -> dict:
    # llama.cpp's qwen2moe graph never renormalises the top-k weights (Qwen2-MoE's default)
    return {**_gguf_common(kv, kw), "norm_topk_prob": False, "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"),
            "shared_expert_intermediate_size": kv.arch_int("expert_shared_feed_forward_length", default=0)}


def qwen3_moe_gguf(kv, kw: dict) -> dict:
    bias = kv.has_tensor("blk.0.attn_q.bias")
    return {**_gguf_common(kv, kw), "norm_topk_prob": bool(kv.arch_value("expert_weights_norm", True)),
            "qkv_bias": bias, "o_bias": kv.has_tensor("blk.0.attn_output.bias"), "qk_norm": "head"}


QWEN2_MOE = Family(arch="qwen2_moe", hf_classes=("Qwen2MoeForCausalLM",), hf_config=qwen2_moe_config,
                   gguf_arch="qwen2moe", gguf_config=qwen2_moe_gguf)
QWEN3_MOE = Family(arch="qwen3_moe", hf_classes=("Qwen3MoeForCausalLM",), hf_config=qwen3_moe_config,
                   gguf_arch="qwen3moe", gguf_config=qwen3_moe_gguf)
