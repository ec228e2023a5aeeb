"""Granite-MoE (GraniteMoeForCausalLM), IBM's MoE made for CPUs (granite-3.x-1b-a400m, 3b-a800m).

Its own: four scalar multipliers and its expert tensors.
- Routing is softmax over the top-k router logits, which is softmax-then-renormalise (the same
  weights, the same order): norm_topk_prob, no new routing rule.
- The multipliers are folded into the weights at conversion, so the shared forward runs it as
  it is: embedding_multiplier into the token embedding; attention_multiplier into W_q (our
  attention scales scores by 1/sqrt(head_dim), so q is scaled by m * sqrt(head_dim));
  residual_multiplier into W_o and every expert's W_down (both write into the residual stream);
  1/logits_scaling into the output head. A tied embedding is untied: the head is the embedding
  scaled by 1/logits_scaling, the embedding by embedding_multiplier.
- Experts: input_linear [E, 2I, D] holds gate then up; output_linear [E, D, I]; router.layer
  [E, D] (transformers 5 in memory: experts.gate_up_proj, experts.down_proj, router.weight).
"""
from __future__ import annotations

import math

from .base import ConvertError, Family, get


def hf_config(hf: dict, kw: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    if hf.get("shared_intermediate_size"):
        raise ConvertError("config.json: shared_intermediate_size (GraniteMoeShared) is not supported")
    return {**kw, "num_experts": get(hf, "num_local_experts"), "top_k": get(hf, "num_experts_per_tok"),
            "moe_intermediate_size": get(hf, "intermediate_size"), "norm_topk_prob": True,
            "qkv_bias": bias, "o_bias": bias, "tie_word_embeddings": False}


def _folds(get_value, where: str, cfg) -> dict:
    """Our tensor key -> the factor its values are multiplied by at conversion."""
    def m(key):
        raw = get_value(key)
        v = 1.0 if raw is None else float(raw)
        if not math.isfinite(v) or v == 0:
            raise ConvertError(f"{where}: {key} = {raw!r} must be a finite non-zero number")
        return v
    q = m("attention_multiplier") * math.sqrt(cfg.head_dim)
    r = m("residual_multiplier")
    return {"token_embd": m("embedding_multiplier"), "attn_q": q, "attn_q_b": q, "attn_o": r, "attn_o_b": r,
            "ffn_down_exps": r, "output": 1.0 / m("logits_scaling")}


def hf_folds(hf: dict, cfg) -> dict:
    return _folds(hf.get, "config.json", cfg)


# llama.cpp's names for the same four scalars
_GGUF_KEYS = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
              "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}


def gguf_folds(kv, cfg) -> dict:
    """llama.cpp reads a missing or zero scale as "not applied": attention 1/sqrt(head_dim), the others 1."""
    def value(k):
        v = kv.arch_value(_GGUF_KEYS[k], None)
        if v in (None, 0):
            return 1.0 / math.sqrt(cfg.head_dim) if k == "attention_multiplier" else None
        return v
    return _folds(value, kv.path, cfg)


def gguf_config(kv, kw: dict) -> dict:
    return {**kw, "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": kv.arch_int("expert_feed_forward_length", "feed_forward_length"),
            "norm_topk_prob": True, "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"),
            "o_bias": kv.has_tensor("blk.0.attn_output.bias"), "tie_word_embeddings": False}


def hf_tensor(hf: dict, cfg, key: str, p: str):
    """Granite's own HF names for a tensor (p = "model.layers.N." in a layer), or None for the common ones."""
    if key == "output" and hf.get("tie_word_embeddings"):
        return ("plain", "model.embed_tokens.weight")       # untied here: the head gets its own scale
    moe = p + "block_sparse_moe."
    if key == "ffn_gate_inp":
        return ("plain", moe + "router.layer.weight", moe + "router.weight")
    if key in ("ffn_gate_exps", "ffn_up_exps"):
        return ("experts", [], [moe + "input_linear.weight", moe + "experts.gate_up_proj"],
                0 if key == "ffn_gate_exps" else 1)
    if key == "ffn_down_exps":
        return ("experts", [], [moe + "output_linear.weight", moe + "experts.down_proj"], None)
    return None


FAMILY = Family(arch="granitemoe", hf_classes=("GraniteMoeForCausalLM",), hf_config=hf_config,
                hf_folds=hf_folds, hf_tensor=hf_tensor, gguf_arch="granitemoe", gguf_config=gguf_config,
                gguf_folds=gguf_folds, gguf_qk_permuted=True)
