"""The model families the converter knows, one module each (vLLM's models/, llama.cpp's
per-architecture builders): adding a family is one module here, its entry in FAMILIES, and
its tests. Conversion-time only: the server never imports this package."""
from __future__ import annotations

from . import deepseek, dense, glm4_moe, gpt_oss, granite, mixtral, olmoe, phimoe, qwen_moe
from .base import ConvertError, Family, get, gguf_name

FAMILIES = (mixtral.FAMILY, qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, olmoe.FAMILY, dense.LLAMA, dense.QWEN2,
            dense.QWEN3, granite.FAMILY, glm4_moe.FAMILY, deepseek.FAMILY, gpt_oss.FAMILY, phimoe.FAMILY)
BY_ARCH = {f.arch: f for f in FAMILIES}
BY_HF_CLASS = {c: f for f in FAMILIES for c in f.hf_classes}

__all__ = ["ConvertError", "Family", "FAMILIES", "BY_ARCH", "BY_HF_CLASS", "by_hf_class", "by_gguf_arch", "get",
           "gguf_name"]


def by_hf_class(name: str) -> Family:
    try:
        return BY_HF_CLASS[name]
    except KeyError:
        raise ConvertError(f"config.json: architecture {name!r} is not supported "
                           f"(supported: {', '.join(BY_HF_CLASS)})") from None


def by_gguf_arch(arch: str, has_experts: bool) -> Family:
    """llama.cpp writes Mixtral and dense Llama both as "llama"; the expert tensors tell them apart."""
    if arch == "llama":
        return mixtral.FAMILY if has_experts else dense.LLAMA
    for f in FAMILIES:
        if f.gguf_arch == arch:
            return f
    known = sorted({f.gguf_arch for f in FAMILIES if f.gguf_arch})
    raise ConvertError(f"GGUF general.architecture {arch!r} is not supported (supported: {', '.join(known)})")
