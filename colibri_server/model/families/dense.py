"""Dense Llama, Qwen2 and Qwen3: every layer a dense MLP (num_experts 0), the degenerate case of
the engine's dense layers. Llama has optional attention biases, Qwen2 q/k/v biases, Qwen3
per-head q/k norms."""
from __future__ import annotations

from .base import ConvertError, Family, get


def _dense(hf: dict, kw: dict, arch_name: str) -> dict:
    if hf.get("mlp_bias"):
        raise ConvertError(f"config.json: mlp_bias=true is not supported for {arch_name}")
    if hf.get("use_sliding_window"):
        raise ConvertError(f"config.json: use_sliding_window=true is not supported for {arch_name} "
                           "(sliding windows on some layers only)")
    return {**kw, "num_experts": 0, "top_k": 0, "moe_intermediate_size": 0,
            "intermediate_size": get(hf, "intermediate_size"), "dense_layers": tuple(range(kw["num_layers"]))}


def llama_config(hf, kw):
    bias = bool(hf.get("attention_bias", False))
    return {**_dense(hf, kw, "LlamaForCausalLM"), "qkv_bias": bias, "o_bias": bias}


def qwen2_config(hf, kw):
    return {**_dense(hf, kw, "Qwen2ForCausalLM"), "qkv_bias": True}


def qwen3_config(hf, kw):
    bias = bool(hf.get("attention_bias", False))
    return {**_dense(hf, kw, "Qwen3ForCausalLM"), "qkv_bias": bias, "o_bias": bias, "qk_norm": "head"}


def gguf_dense(kv, kw):
    return {**kw, "num_experts": 0, "top_k": 0, "moe_intermediate_size": 0,
            "intermediate_size": kv.arch_int("feed_forward_length"), "dense_layers": tuple(range(kw["num_layers"])),
            "qkv_bias": kv.has_tensor("blk.0.attn_q.bias"), "o_bias": kv.has_tensor("blk.0.attn_output.bias")}


def qwen3_gguf(kv, kw):
    return {**gguf_dense(kv, kw), "qk_norm": "head"}


LLAMA = Family(arch="llama", hf_classes=("LlamaForCausalLM",), hf_config=llama_config,
               gguf_arch="llama", gguf_config=gguf_dense, gguf_qk_permuted=True)
QWEN2 = Family(arch="qwen2", hf_classes=("Qwen2ForCausalLM",), hf_config=qwen2_config,
               gguf_arch="qwen2", gguf_config=gguf_dense)
QWEN3 = Family(arch="qwen3", hf_classes=("Qwen3ForCausalLM",), hf_config=qwen3_config,
               gguf_arch="qwen3", gguf_config=qwen3_gguf)
