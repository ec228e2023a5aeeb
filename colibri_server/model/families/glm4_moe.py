"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM): DeepSeek-V3's routing on ordinary attention.

Its own:
- routing (format version 2): sigmoid scores, a selection-only correction bias
  (mlp.gate.e_score_correction_bias), group-limited choice (n_group, topk_group: a group's score
  is its two best corrected scores), renormalised weights (+1e-20) times routed_scaling_factor;
- an ungated shared expert of n_shared_experts * moe_intermediate_size (mlp.shared_experts.*);
- the first first_k_dense_replace layers dense;
- a partial rotary embedding (partial_rotary_factor, 0.5 by default): the converter reorders
  each head's q/k dims (convert.partial_rotary_order) so the shared RoPE kernels run it;
- q/k norms per head when use_qk_norm; q/k/v biases when attention_bias (o_proj never has one).
The checkpoints' multi-token-prediction layers (num_mtp_layers, numbered after the last layer)
are not part of the forward and are not converted.
"""
from __future__ import annotations

from .base import ConvertError, Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    L, hd = kw["num_layers"], kw["head_dim"]
    rope = dict(hf.get("rope_parameters") or {})
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rot = int(hd * factor)
    if rot % 2 or not 0 < rot <= hd:
        raise ConvertError(f"config.json: partial_rotary_factor {factor} gives {rot} rotary dims of head_dim {hd}")
    first_dense = int(hf.get("first_k_dense_replace", 1) or 0)
    n_group = int(hf.get("n_group", 1) or 1)
    bias = bool(hf.get("attention_bias", False))
    return {**kw, "num_experts": get(hf, "n_routed_experts"), "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "moe_intermediate_size"),
            "intermediate_size": get(hf, "intermediate_size") if first_dense else 0,
            "dense_layers": tuple(range(min(first_dense, L))),
            "shared_expert_intermediate_size": get(hf, "moe_intermediate_size") * int(hf.get("n_shared_experts", 1) or 0),
            "shared_expert_gate": False, "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "score_func": "sigmoid", "correction_bias": True,
            "n_group": n_group if n_group > 1 else 0, "topk_group": int(hf.get("topk_group", 1)) if n_group > 1 else 0,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "qkv_bias": bias, "qk_norm": "head" if hf.get("use_qk_norm") else "none",
            "rotary_dim": rot if rot < hd else 0}


def hf_tensor(hf: dict, cfg, key: str, p: str):
    names = {"ffn_gate_bias": "mlp.gate.e_score_correction_bias",
             "ffn_gate_shexp": "mlp.shared_experts.gate_proj.weight", "ffn_up_shexp": "mlp.shared_experts.up_proj.weight",
             "ffn_down_shexp": "mlp.shared_experts.down_proj.weight"}
    return ("plain", p + names[key]) if key in names else None


def gguf_config(kv, kw: dict) -> dict:
    """llama.cpp's glm4moe: its block_count includes the multi-token-prediction layers, its
    rope.dimension_count is the rotary part (the importer sets rotary_dim from it)."""
    L = kw["num_layers"] - kv.arch_int("nextn_predict_layers", default=0)
    first_dense = kv.arch_int("leading_dense_block_count", default=0)
    if kv.arch_int("expert_gating_func", default=2) != 2:
        raise ConvertError(f"{kv.path}: GGUF key {kv.arch}.expert_gating_func is not sigmoid (2)")
    n_group = kv.arch_int("expert_group_count", default=0)
    I = kv.arch_int("expert_feed_forward_length")
    return {**kw, "num_layers": L, "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": I, "intermediate_size": kv.arch_int("feed_forward_length") if first_dense else 0,
            "dense_layers": tuple(range(min(first_dense, L))),
            "shared_expert_intermediate_size": I * kv.arch_int("expert_shared_count", default=1),
            "shared_expert_gate": False, "norm_topk_prob": bool(kv.arch_value("expert_weights_norm", True)),
            "score_func": "sigmoid", "correction_bias": True,
            "n_group": n_group if n_group > 1 else 0,
            "topk_group": kv.arch_int("expert_group_used_count") if n_group > 1 else 0,
            "routed_scaling_factor": float(kv.arch_value("expert_weights_scale", 1.0)),
            "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"),
            "qk_norm": "head" if kv.has_tensor("blk.0.attn_q_norm.weight") else "none"}


FAMILY = Family(arch="glm4_moe", hf_classes=("Glm4MoeForCausalLM",), hf_config=hf_config, hf_tensor=hf_tensor,
                gguf_arch="glm4moe", gguf_config=gguf_config)
