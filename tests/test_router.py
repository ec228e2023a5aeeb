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


class _W:
    def __init__(self, pid, generation=1):
        self.pid, self.generation, self.engine = pid, generation, None

    def beat(self, counts, tokens, rows, steps):          # a heartbeat: a new engine dict, the old one kept as is
        self.engine = {"expert_counts": counts, "tokens_out": tokens, "rows_total": rows, "steps": steps}


def test_the_recent_window_is_each_workers_figures_now_minus_at_its_start():
    from colibri_server.router.recent import RecentWindow
    rw = RecentWindow(window=30.0, every=2.0)
    a, b, old = _W(1), _W(2), _W(3, generation=0)
    a.beat([[5, 0], [1, 4]], 10, 20, 5)
    old.beat([[100, 100], [100, 100]], 500, 500, 50)
    assert rw.figures(0.0, 1, [a, old])["window_s"] == 0.0        # no sample yet: everything so far
    rw.sample(0.0, [a, old])
    rw.sample(1.0, [a, old])                       # within `every` of the last: not kept
    assert len(rw.samples) == 1
    a.beat([[9, 2], [3, 8]], 16, 30, 9)
    b.beat([[1, 1], [2, 0]], 1, 2, 1)              # started within the window: counted from zero
    f = rw.figures(10.0, 1, [a, b, old])           # generation 0's worker is not the serving generation's
    assert f == {"window_s": 10.0, "expert_counts": [[5, 3], [4, 4]], "tokens": 7, "tokens_per_s": 0.7,
                 "steps": 5, "rows_per_step": 2.4}
    for t in range(2, 40, 2):
        rw.sample(float(t), [a, b])
    # the oldest sample kept is the newest at least 30 s old: the start of a's last beats is forgotten
    assert [t for t, _ in rw.samples][0] == 8.0
    f = rw.figures(39.0, 1, [a, b])
    assert f["window_s"] == 31.0 and f["expert_counts"] == [[0, 0], [0, 0]] and f["tokens_per_s"] == 0.0
    a.beat([[9, 2], [3, 8]], 16, 30, 9)
    a.engine = None                                # a worker gone quiet or exited: it drops out
    assert rw.figures(39.0, 1, [a])["expert_counts"] == []
