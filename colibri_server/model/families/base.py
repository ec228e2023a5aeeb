"""What every family shares: the Family record, the converter's error, and the names and
config keys that all supported families spell the same way.

A family module (mixtral.py, qwen_moe.py, ...) holds only what is its own: which Hugging Face
classes and llama.cpp architectures it is, how their configs map to ModelConfig, and where its
tensors differ from the common names below. The forward is one shared path driven by the
config (engine, transformer); a family never adds a branch there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class ConvertError(Exception):
    """The checkpoint cannot be converted; the message names the file, key or tensor."""


@dataclass(frozen=True)
class Family:
    arch: str                               # ModelConfig.arch
    hf_classes: tuple = ()                  # transformers architectures (config.json "architectures")
    hf_config: Callable = None              # (hf config.json, common kwargs) -> ModelConfig kwargs
    hf_moe_prefixes: tuple = ("mlp.",)      # where the router and experts sit in a layer
    hf_expert_names: dict = field(default_factory=lambda: dict(HF_EXPERT_NAMES))
    # (hf config.json, cfg, key, "model.layers.N." or "") -> a source recipe for the family's own
    # names (see convert._hf_names), or None for the common ones
    hf_tensor: Callable = None
    # (hf config.json, ModelConfig) -> {tensor key: factor}: scalars folded into the weights
    hf_folds: Callable = None
    default_rope_theta: float = 10000.0
    gguf_arch: str = ""                     # llama.cpp general.architecture ("" = not importable)
    gguf_config: Callable = None            # (GgufKV, common kwargs) -> ModelConfig kwargs
    gguf_folds: Callable = None             # (GgufKV, ModelConfig) -> {tensor key: factor}, as hf_folds
    # (GgufKV, ModelConfig, our name) -> (GGUF tensor name, None or fn(its whole f32 values) -> our tensor), or None
    # for the common name: the family's own names and reshapes (DeepSeek's rotary rows, its split kv_b)
    gguf_tensor: Callable = None
    # llama.cpp's converter permutes q/k rows for its "normal" (interleaved) rope; the GGUF
    # importer undoes it. False for the NEOX-rope families (Qwen, OLMoE), stored as in HF.
    gguf_qk_permuted: bool = False


def get(hf: dict, *keys):
    """The first of `keys` present in config.json (transformers renames some between versions)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ConvertError(f"config.json: missing key {keys[0]!r}")


# our tensor key (name without "blk.N.") -> the HF name inside "model.layers.N."
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight", "attn_o": "self_attn.o_proj.weight",
    "attn_q_b": "self_attn.q_proj.bias", "attn_k_b": "self_attn.k_proj.bias",
    "attn_v_b": "self_attn.v_proj.bias", "attn_o_b": "self_attn.o_proj.bias",
    "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight", "ffn_shexp_gate": "mlp.shared_expert_gate.weight",
}
HF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# our tensor key -> llama.cpp's GGUF name (without "blk.N." and ".weight"/".bias")
GGUF_LAYER_NAMES = {
    "attn_o": "attn_output", "attn_q_b": "attn_q.bias", "attn_k_b": "attn_k.bias", "attn_v_b": "attn_v.bias",
    "attn_o_b": "attn_output.bias", "ffn_shexp_gate": "ffn_gate_inp_shexp", "ffn_gate_bias": "exp_probs_b.bias",
}


def gguf_name(name: str) -> str:
    """Our tensor name -> its name in a llama.cpp GGUF."""
    if "." not in name or name.startswith("blk."):
        head, key = (name.rsplit(".", 1) if name.startswith("blk.") else ("", name))
        g = GGUF_LAYER_NAMES.get(key, key)
        g = g if g.endswith((".bias", ".weight")) else g + ".weight"
        return f"{head}.{g}" if head else g
    return name
