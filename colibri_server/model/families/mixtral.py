"""Mixtral (MixtralForCausalLM): softmax top-k routing renormalised, no shared expert, llama
attention. llama.cpp writes it as arch "llama" with expert tensors."""
from __future__ import annotations

from .base import ConvertError, Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    if hf.get("attention_bias"):
        raise ConvertError("config.json: attention_bias=true is not supported for Mixtral")
    return {**kw, "num_experts": get(hf, "num_local_experts", "num_experts"), "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "intermediate_size"), "norm_topk_prob": True,
            "sliding_window": hf.get("sliding_window") or 0}


def gguf_config(kv, kw: dict) -> dict:
    return {**kw, "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": kv.arch_int("expert_feed_forward_length", "feed_forward_length"),
            "norm_topk_prob": True}


FAMILY = Family(
    arch="mixtral", hf_classes=("MixtralForCausalLM",), hf_config=hf_config,
    # checkpoints say block_sparse_moe; transformers 5's in-memory state dict says mlp
    hf_moe_prefixes=("block_sparse_moe.", "mlp."),
    hf_expert_names={"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
    default_rope_theta=1e6, gguf_arch="llama", gguf_config=gguf_config, gguf_qk_permuted=True)
