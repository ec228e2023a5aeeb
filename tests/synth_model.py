"""Write a large random .colibri model directly (no checkpoint, no torch): for memory and
serving tests that need hundreds of MB of weights but not meaningful outputs."""
from __future__ import annotations

from colibri_server.model.config import ModelConfig
from colibri_server.model.synthetic import write_synthetic

BENCH_MIXTRAL = dict(arch="mixtral", vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                     head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=2048, rms_norm_eps=1e-5,
                     max_position_embeddings=4096, rope_theta=1e6, bos_token_id=1, eos_token_ids=(2,))


def write_model(path, dtype="f16", seed=0, **overrides) -> int:
    """A Mixtral-architecture model (bench-mixtral shape by default: 933 MiB in f16). Returns its size."""
    return write_synthetic(path, ModelConfig(**{**BENCH_MIXTRAL, **overrides, "dtype": dtype}), seed)
