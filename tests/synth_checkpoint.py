"""Write a random Mixtral-layout safetensors checkpoint with numpy only (no torch), fast,
sharded with an index when asked. Used by the converter's memory test and bench."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

BENCH_MIXTRAL = dict(hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)


def mixtral_tensors(c):
    D, I, E, V = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    hd = D // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (V, D)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,)
        yield p + "post_attention_layernorm.weight", (D,)
        yield p + "self_attn.q_proj.weight", (D, D)
        yield p + "self_attn.k_proj.weight", (kv, D)
        yield p + "self_attn.v_proj.weight", (kv, D)
        yield p + "self_attn.o_proj.weight", (D, D)
        yield p + "block_sparse_moe.gate.weight", (E, D)
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            yield q + "w1.weight", (I, D)
            yield q + "w3.weight", (I, D)
            yield q + "w2.weight", (D, I)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


def write_checkpoint(out_dir, config=BENCH_MIXTRAL, dtype=np.float16, shards=2, seed=0):
    """Returns (total bytes, largest tensor bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = dict(config, architectures=["MixtralForCausalLM"], model_type="mixtral", rms_norm_eps=1e-5,
               max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = list(mixtral_tensors(cfg))
    total = sum(int(np.prod(s)) for _, s in names) * np.dtype(dtype).itemsize
    largest = max(int(np.prod(s)) for _, s in names) * np.dtype(dtype).itemsize
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n, s in names[k * per_shard:(k + 1) * per_shard]:
            part[n] = (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(dtype)
            weight_map[n] = fname
        save_file(part, os.path.join(out_dir, fname))
        del part
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, largest
