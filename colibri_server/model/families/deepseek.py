"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Moonlight and Kimi-K2 ship as the
latter): multi-head latent attention on DeepSeek's MoE.

Its own:
- latent attention (model/mla.py): the query through its own low rank (q_a_proj, q_a_layernorm,
  q_b_proj) or straight (q_proj); kv_a_proj_with_mqa giving the latent (kv_lora_rank) and one rotary
  key shared by the heads; kv_b_proj's per-head expansion, stored split into its key half
  (attn_k_up, (H, r, nope), transposed: it multiplies the queries) and its value half (attn_v_up,
  (H, v, r)). head_dim is the rotary part (qk_rope_head_dim), num_kv_heads 1;
- the rotary dims interleaved in pairs (V2 always, V3 unless rope_interleave is false): the converter
  stores each head's rotary rows of q and the rotary rows of kv_a de-interleaved (evens, then odds),
  so the shared rotate-half RoPE runs them (q.k unchanged: the same order on both sides);
- the softmax scale 1/sqrt(nope + rope) times yarn's mscale(factor, mscale_all_dim)^2 (rope.attention_scale);
- routing: V2 softmax, greedy or group-limited greedy (a group's score is its best expert), the
  weights never renormalised (transformers 5), times routed_scaling_factor; V3 sigmoid with a
  selection-only correction bias (mlp.gate.e_score_correction_bias), groups scored by their two best,
  renormalised when norm_topk_prob, times routed_scaling_factor;
- an ungated shared expert of n_shared_experts * moe_intermediate_size (mlp.shared_experts.*);
- the first first_k_dense_replace layers dense.
The checkpoints' multi-token-prediction layers (numbered after the last layer) are not converted.
"""
from __future__ import annotations

import numpy as np

from .base import ConvertError, Family, get


def _interleaved(hf: dict) -> bool:
    archs = hf.get("architectures") or []
    return archs[:1] == ["DeepseekV2ForCausalLM"] or bool(hf.get("rope_interleave", True))


def hf_config(hf: dict, kw: dict) -> dict:
    v3 = (hf.get("architectures") or [""])[0] == "DeepseekV3ForCausalLM"
    if hf.get("attention_bias"):
        raise ConvertError("config.json: attention_bias=true is not supported for DeepSeek's latent attention")
    L = kw["num_layers"]
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    rope = int(get(hf, "qk_rope_head_dim"))
    kw = {**kw, "head_dim": rope, "num_kv_heads": 1,
          "kv_lora_rank": int(get(hf, "kv_lora_rank")), "q_lora_rank": int(hf.get("q_lora_rank") or 0),
          "qk_nope_head_dim": int(get(hf, "qk_nope_head_dim")), "v_head_dim": int(get(hf, "v_head_dim")),
          "num_experts": get(hf, "n_routed_experts"), "top_k": get(hf, "num_experts_per_tok"),
          "moe_intermediate_size": get(hf, "moe_intermediate_size"),
          "intermediate_size": get(hf, "intermediate_size") if first_dense else 0,
          "dense_layers": tuple(range(min(first_dense, L))),
          "shared_expert_intermediate_size": get(hf, "moe_intermediate_size") * int(hf.get("n_shared_experts") or 0),
          "shared_expert_gate": False, "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0)}
    n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if v3:
        return {**kw, "score_func": "sigmoid", "correction_bias": True,
                "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
                "n_group": n_group if n_group > 1 else 0, "topk_group": topk_group if n_group > 1 else 0}
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ConvertError(f"config.json: topk_method {method!r} is not supported for DeepseekV2ForCausalLM "
                           "(greedy, group_limited_greedy)")
    groups = method == "group_limited_greedy" and n_group > 1
    return {**kw, "norm_topk_prob": False, "n_group": n_group if groups else 0, "topk_group": topk_group if groups else 0}


def _deinterleave(n: int) -> np.ndarray:
    """Rotary dims (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): rotate-half's pairs (i, i + n/2)."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def _q_rows(cfg, w, order):
    """q (H*(nope+dr), n): each head's rotary rows in `order`."""
    H, nope, dr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim
    w = w.reshape(H, nope + dr, -1)
    return np.concatenate([w[:, :nope], w[:, nope:][:, order]], axis=1).reshape(H * (nope + dr), -1)


def _kv_rows(cfg, w, order):
    """kv_a (r+dr, D): the rotary key's rows in `order`."""
    r = cfg.kv_lora_rank
    return np.concatenate([w[:r], w[r:][order]])


def _up(cfg, w, part):
    """kv_b (H*(nope+v), r) -> its key half (H, r, nope) (transposed: it multiplies the queries) or value half (H, v, r)."""
    H, nope, v, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = w.reshape(H, nope + v, r)
    return np.ascontiguousarray(w[:, :nope].transpose(0, 2, 1)) if part == "k" else np.ascontiguousarray(w[:, nope:])


def hf_tensor(hf: dict, cfg, key: str, p: str):
    a = p + "self_attn."
    D, H, r, dr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    order = _deinterleave(dr) if _interleaved(hf) else np.arange(dr)
    q_in = cfg.q_lora_rank or D
    kv_b = [(a + "kv_b_proj.weight", (H * (nope + v), r))]
    names = {
        "attn_q_a": ("plain", a + "q_a_proj.weight"), "attn_q_a_norm": ("plain", a + "q_a_layernorm.weight"),
        "attn_q": ("derived", [(a + ("q_b_proj.weight" if cfg.q_lora_rank else "q_proj.weight"), (cfg.q_dim, q_in))],
                   lambda w: _q_rows(cfg, w, order)),
        "attn_kv_a": ("derived", [(a + "kv_a_proj_with_mqa.weight", (r + dr, D))], lambda w: _kv_rows(cfg, w, order)),
        "attn_kv_a_norm": ("plain", a + "kv_a_layernorm.weight"),
        "attn_k_up": ("derived", kv_b, lambda w: _up(cfg, w, "k")),
        "attn_v_up": ("derived", kv_b, lambda w: _up(cfg, w, "v")),
        "ffn_gate_bias": ("plain", p + "mlp.gate.e_score_correction_bias"),
        "ffn_gate_shexp": ("plain", p + "mlp.shared_experts.gate_proj.weight"),
        "ffn_up_shexp": ("plain", p + "mlp.shared_experts.up_proj.weight"),
        "ffn_down_shexp": ("plain", p + "mlp.shared_experts.down_proj.weight"),
    }
    return names.get(key)


def gguf_config(kv, kw: dict) -> dict:
    """llama.cpp's deepseek2 (V2, V2-Lite, V3, Kimi-K2, Moonlight). Its metadata: kv_lora_rank, q_lora_rank
    (absent: none), key_length_mla / value_length_mla (a query head and a value head; GGUFs written before
    them say key_length / value_length), rope.dimension_count (the rotary part), expert_gating_func (1
    softmax, 2 sigmoid; absent in V2 files: softmax, as llama.cpp reads them), expert_weights_norm /
    _scale, expert_group_count / _used_count, leading_dense_block_count, yarn_log_multiplier (0.1 x
    mscale_all_dim). Its block_count includes the multi-token-prediction layers (nextn_predict_layers)."""
    L = kw["num_layers"] - kv.arch_int("nextn_predict_layers", default=0)
    rope = kv.arch_int("rope.dimension_count")
    if kv.arch_int("attention.key_length_mla", default=0):
        nope, v = kv.arch_int("attention.key_length_mla") - rope, kv.arch_int("attention.value_length_mla")
    else:
        nope, v = kv.arch_int("attention.key_length") - rope, kv.arch_int("attention.value_length")
    first_dense = kv.arch_int("leading_dense_block_count", default=0)
    gating = kv.arch_int("expert_gating_func", default=1)
    if gating not in (1, 2):
        raise ConvertError(f"{kv.path}: GGUF key {kv.arch}.expert_gating_func = {gating} is not softmax (1) or sigmoid (2)")
    n_group = kv.arch_int("expert_group_count", default=0)
    I = kv.arch_int("expert_feed_forward_length")
    scaling = dict(kw["rope_scaling"])
    ylm = kv.arch_value("rope.scaling.yarn_log_multiplier", None)
    if scaling.get("rope_type") == "yarn" and ylm:
        scaling["mscale"] = scaling["mscale_all_dim"] = float(ylm) / 0.1
    return {**kw, "num_layers": L, "head_dim": rope, "num_kv_heads": 1, "rope_scaling": scaling,
            "kv_lora_rank": kv.arch_int("attention.kv_lora_rank"), "q_lora_rank": kv.arch_int("attention.q_lora_rank", default=0),
            "qk_nope_head_dim": nope, "v_head_dim": v,
            "num_experts": kv.arch_int("expert_count"), "top_k": kv.arch_int("expert_used_count"),
            "moe_intermediate_size": I, "intermediate_size": kv.arch_int("feed_forward_length") if first_dense else 0,
            "dense_layers": tuple(range(min(first_dense, L))),
            "shared_expert_intermediate_size": I * kv.arch_int("expert_shared_count", default=0),
            "shared_expert_gate": False, "norm_topk_prob": bool(kv.arch_value("expert_weights_norm", False)),
            "score_func": "sigmoid" if gating == 2 else "softmax",
            "correction_bias": kv.has_tensor(f"blk.{min(first_dense, L - 1)}.exp_probs_b.bias"),
            "n_group": n_group if n_group > 1 else 0,
            "topk_group": kv.arch_int("expert_group_used_count") if n_group > 1 else 0,
            "routed_scaling_factor": float(kv.arch_value("expert_weights_scale", 1.0))}


def gguf_tensor(kv, cfg, name: str):
    """llama.cpp keeps DeepSeek's interleaved rotary rows (its NORM rope rotates adjacent pairs): de-interleaved
    here as from a checkpoint. Its attn_k_b / attn_v_b are our attn_k_up / attn_v_up as they are; GGUFs written
    before llama.cpp split them hold attn_kv_b, split here."""
    if not name.startswith("blk."):
        return None
    blk, key = name.rsplit(".", 1)
    order = _deinterleave(cfg.head_dim)
    if key == "attn_q":
        return f"{blk}.attn_q_b.weight" if cfg.q_lora_rank else f"{blk}.attn_q.weight", lambda w: _q_rows(cfg, w, order)
    if key == "attn_kv_a":
        return f"{blk}.attn_kv_a_mqa.weight", lambda w: _kv_rows(cfg, w, order)
    if key in ("attn_k_up", "attn_v_up"):
        split = f"{blk}.attn_{key[5]}_b.weight"
        if kv.has_tensor(split) or not kv.has_tensor(f"{blk}.attn_kv_b.weight"):
            return split, None
        return f"{blk}.attn_kv_b.weight", lambda w: _up(cfg, w, key[5])
    return None


FAMILY = Family(arch="deepseek2", hf_classes=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                hf_config=hf_config, hf_tensor=hf_tensor, gguf_arch="deepseek2", gguf_config=gguf_config,
                gguf_tensor=gguf_tensor)
