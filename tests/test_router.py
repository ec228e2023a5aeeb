"""The router package's own pieces, without a running server: the prompt-affinity key it routes by
agrees with the prefix cache a worker reuses blocks from."""
from __future__ import annotations

import pytest

from colibri_server.model.config import ModelConfig
from colibri_server.model.kv import BLOCK_SIZE, KVPool, chain_hash, first_block_key
from colibri_server.router.records import prefix_key

CFG = ModelConfig(arch="mixtral", vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=96, rms_norm_eps=1e-5,
                  max_position_embeddings=256, rope_theta=1e4)


@pytest.mark.parametrize("extra", [-1, 0, 1, BLOCK_SIZE])
def test_a_prompt_has_a_key_exactly_when_a_worker_could_reuse_its_first_block(extra):
    """A worker matches at most tokens[:len - 1] against its prefix cache (scheduler._match): a prompt
    of one block or less never reuses its first block, so the router must not steer it by one."""
    pool = KVPool(CFG, 8, BLOCK_SIZE, "f32")
    first = tuple(range(1, BLOCK_SIZE + 1))
    b = pool.allocate()
    pool.register(b, chain_hash(0, first), first)
    prompt = list(first[:BLOCK_SIZE + extra]) + list(range(50, 50 + max(extra, 0)))
    blocks, _ = pool.match(prompt, len(prompt) - 1)
    reused = bool(blocks)
    pool.unmatch(blocks)
    assert (prefix_key(prompt) is not None) == reused == (len(prompt) > BLOCK_SIZE)
    if reused:
        assert prefix_key(prompt) == first_block_key(prompt) == chain_hash(0, first)


def test_a_text_prompt_has_no_key():
    assert prefix_key("x" * 100) is None
    assert prefix_key(list(range(BLOCK_SIZE + 1))) == chain_hash(0, tuple(range(BLOCK_SIZE)))
