"""Write a large random .colibri model directly (no checkpoint, no torch): for memory and
serving tests that need hundreds of MB of weights but not meaningful outputs."""
from __future__ import annotations

import numpy as np

from colibri_server.model import format as fmt
from colibri_server.model.config import ModelConfig, expected_tensors
from colibri_server.model.convert import _routing

BENCH_MIXTRAL = dict(arch="mixtral", vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                     head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=2048, rms_norm_eps=1e-5,
                     max_position_embeddings=4096, rope_theta=1e6, bos_token_id=1, eos_token_ids=(2,))


def write_model(path, dtype="f16", seed=0, **overrides) -> int:
    """A Mixtral-architecture model (bench-mixtral shape by default: 933 MiB in f16). Returns its size."""
    cfg = ModelConfig(**{**BENCH_MIXTRAL, **overrides, "dtype": dtype})
    cfg.check()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 20, dtype=np.float32) * 0.02)        # reused, shifted per tensor
    view = {"f32": lambda a: a, "f16": lambda a: a.astype(np.float16).view(np.uint16),
            "bf16": lambda a: (a.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)}
    with fmt.ColibriWriter(path, config=cfg.to_dict(), metadata={"name": "synthetic"}, num_experts=cfg.num_experts,
                           num_layers=cfg.num_layers) as w:
        plan = list(expected_tensors(cfg))
        for name, shape, dts in plan:
            w.declare(name, dts[0], shape)
        w.set_routing(_routing(cfg, w))
        for k, (name, shape, dts) in enumerate(plan):
            n = int(np.prod(shape))
            if name.endswith("norm"):
                w.write(name, np.ones(n, np.float32))
                continue
            done = 0
            while done < n:
                m = min(n - done, pool.size)
                block = np.roll(pool, k * 7919 + done)[:m]
                w.write(name, view[dts[0]](block) if dts[0] != "f32" else block)
                done += m
    return fmt.ColibriFile.open(path).header["file_size"]
