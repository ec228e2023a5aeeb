"""Phi-3.5-MoE (PhimoeForCausalLM).

Its own:
- LayerNorm (weight and bias) where the others have RMSNorm: before attention, before the MoE and at
  the end (config norm "layer", tensors *_norm_b), with eps = rms_norm_eps as transformers builds it;
- the output head's bias (lm_head_bias: tensor output_b);
- sparsemixer routing at inference (format flag SPARSEMIXER, config jitter_eps = router_jitter_noise):
  the best expert, its weight a softmax over the logits within a relative 2*eps of the best; then
  the best of the rest, its weight a softmax over the rest within 2*eps of it (kernels/moe.route_sparsemixer);
- q/k/v/o biases when attention_bias;
- longrope (rope_type "longrope": short_factor / long_factor per pair, an attention factor): transformers
  switches from the short to the long factors once a sequence passes original_max_position_embeddings;
  colibri chooses once per model, by its context (the long ones when the context is longer), as llama.cpp
  does by n_ctx (rope.py).
Checkpoints say block_sparse_moe.gate / experts.N.w1|w2|w3 (Mixtral's names); transformers 5 says
mlp.router / experts.gate_up_proj.
"""
from __future__ import annotations

from .base import ConvertError, Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    k = get(hf, "num_experts_per_tok")
    if k != 2:
        raise ConvertError(f"config.json: num_experts_per_tok {k}: sparsemixer routing chooses exactly 2 experts")
    bias = bool(hf.get("attention_bias", False))
    return {**kw, "num_experts": get(hf, "num_local_experts"), "top_k": k,
            "moe_intermediate_size": get(hf, "intermediate_size"), "norm_topk_prob": False,
            "sparsemixer_eps": float(hf.get("router_jitter_noise", 0.01)), "norm": "layer",
            "output_bias": bool(hf.get("lm_head_bias", False)), "qkv_bias": bias, "o_bias": bias,
            "sliding_window": hf.get("sliding_window") or 0}


def hf_tensor(hf: dict, cfg, key: str, p: str):
    names = {"ffn_gate_inp": ("plain", p + "mlp.router.weight", p + "block_sparse_moe.gate.weight"),
             "attn_norm_b": ("plain", p + "input_layernorm.bias"), "ffn_norm_b": ("plain", p + "post_attention_layernorm.bias"),
             "output_norm_b": ("plain", "model.norm.bias"), "output_b": ("plain", "lm_head.bias")}
    return names.get(key)


FAMILY = Family(arch="phimoe", hf_classes=("PhimoeForCausalLM",), hf_config=hf_config, hf_tensor=hf_tensor,
                hf_moe_prefixes=("block_sparse_moe.", "mlp."),
                hf_expert_names={"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"})
