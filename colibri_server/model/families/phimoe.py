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

From a GGUF (llama.cpp arch "phimoe", its converter's PhiMoeModel): the tensors hold the checkpoint's
weights as they are (q/k rows unpermuted: llama.cpp runs this arch with NEOX rope), the experts stacked
(w1 -> ffn_gate_exps, w3 -> ffn_up_exps, w2 -> ffn_down_exps), the norms' and the head's biases as
*.bias; longrope as the rope_factors_short / rope_factors_long tensors (gguf_import._rope_scaling).
What the file does not say comes from the model as transformers defines it: LayerNorm, and sparsemixer
with router_jitter_noise 0.01 (Phi-3.5-MoE's value and transformers' default; llama.cpp's converter does
not write it). llama.cpp's own graph for this arch is not that model (an RMS norm plus the bias, softmax
top-2 renormalised); colibri runs the model, not llama.cpp's approximation of it. Lost in the file: the
checkpoint's short_mscale / long_mscale. The attention factor is rope.scaling.attn_factor for both sets,
as llama.cpp runs it; its converter writes sqrt(1 + ln(context / original) / ln(original)), 1.190 for
Phi-3.5-MoE (131072 / 4096) where the checkpoint says 1.243.
"""
from __future__ import annotations

from .base import ConvertError, Family, get

SPARSEMIXER_EPS = 0.01         # router_jitter_noise: Phi-3.5-MoE's and transformers' default


def hf_config(hf: dict, kw: dict) -> dict:
    k = get(hf, "num_experts_per_tok")
    if k != 2:
        raise ConvertError(f"config.json: num_experts_per_tok {k}: sparsemixer routing chooses exactly 2 experts")
    bias = bool(hf.get("attention_bias", False))
    return {**kw, "num_experts": get(hf, "num_local_experts"), "top_k": k,
            "moe_intermediate_size": get(hf, "intermediate_size"), "norm_topk_prob": False,
            "sparsemixer_eps": float(hf.get("router_jitter_noise", SPARSEMIXER_EPS)), "norm": "layer",
            "output_bias": bool(hf.get("lm_head_bias", False)), "qkv_bias": bias, "o_bias": bias,
            "sliding_window": hf.get("sliding_window") or 0}


def hf_tensor(hf: dict, cfg, key: str, p: str):
    names = {"ffn_gate_inp": ("plain", p + "mlp.router.weight", p + "block_sparse_moe.gate.weight"),
             "attn_norm_b": ("plain", p + "input_layernorm.bias"), "ffn_norm_b": ("plain", p + "post_attention_layernorm.bias"),
             "output_norm_b": ("plain", "model.norm.bias"), "output_b": ("plain", "lm_head.bias")}
    return names.get(key)


def gguf_config(kv, kw: dict) -> dict:
    """llama.cpp's phimoe: expert_count / expert_used_count (2: sparsemixer chooses exactly two), the experts'
    size as feed_forward_length, attention.sliding_window as config.json's (0: none; transformers applies it,
    llama.cpp ignores it for this arch), the biases by their tensors (llama.cpp requires attn_output.bias and
    output.bias; q/k/v's are optional)."""
    k = kv.arch_int("expert_used_count")
    if k != 2:
        raise ConvertError(f"{kv.path}: GGUF key {kv.arch}.expert_used_count = {k} is not supported: "
                           "Phi-MoE's sparsemixer routing chooses exactly 2 experts")
    return {**kw, "num_experts": kv.arch_int("expert_count"), "top_k": k,
            "moe_intermediate_size": kv.arch_int("expert_feed_forward_length", "feed_forward_length"),
            "norm_topk_prob": False, "sparsemixer_eps": SPARSEMIXER_EPS, "norm": "layer",
            "output_bias": kv.has_tensor("output.bias"), "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"),
            "o_bias": kv.has_tensor("blk.0.attn_output.bias"),
            "sliding_window": kv.arch_int("attention.sliding_window", default=0)}


GGUF_NAMES = {"output_norm_b": "output_norm.bias", "output_b": "output.bias",
              "attn_norm_b": "attn_norm.bias", "ffn_norm_b": "ffn_norm.bias"}


def gguf_tensor(kv, cfg, name: str):
    """The norms' and the head's biases: llama.cpp's *.bias (the rest are the common names)."""
    blk, key = name.rsplit(".", 1) if name.startswith("blk.") else ("", name)
    if key not in GGUF_NAMES:
        return None
    return (f"{blk}.{GGUF_NAMES[key]}" if blk else GGUF_NAMES[key]), None


# the released Phi-3.5-MoE config.json says PhiMoEForCausalLM (its remote code); transformers 5 says Phimoe
FAMILY = Family(arch="phimoe", hf_classes=("PhimoeForCausalLM", "PhiMoEForCausalLM"), hf_config=hf_config,
                hf_tensor=hf_tensor, hf_moe_prefixes=("block_sparse_moe.", "mlp."),
                hf_expert_names={"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
                gguf_arch="phimoe", gguf_config=gguf_config, gguf_tensor=gguf_tensor)
