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


def test_a_retired_generations_request_sent_back_runs_on_the_serving_one_checked_again(built, model_b):
    """After a reload the router retires the old generation once none of its requests is queued; a
    request its draining worker then rejects (sent before the drain, arrived after) comes back to a
    queue with no worker of its generation. Having streamed nothing, it is checked and tokenized
    again by the serving generation, as if it came now, and runs there; one the serving generation
    refuses (a token id outside its vocabulary) ends with worker_lost."""
    import time

    import msgpack

    from colibri_server.model import Model
    from colibri_server.router.loop import Router
    from colibri_server.router.records import Gen, W
    from colibri_server.settings.load import defaults

    def info(g, path):
        m = Model.open(path)
        return {"generation": g, "model": path, "vocab_size": m.config.vocab_size, "context": 256,
                "tokenizer_json": m.file.tokenizer_json}
    old_path, new_path = built("mixtral").colibri("f32"), str(model_b)
    r = Router(frontend="inproc://x", backend="inproc://y", pipe_fd=-1, settings=defaults(), generation=1,
               model_path=old_path)
    for g, path in ((1, old_path), (2, new_path)):
        r.gens[g] = Gen(info(g, path), r.settings)
    assert r.gens[1].vocab_size > 450 > r.gens[2].vocab_size
    r.select(1)
    sent, errors, told = [], [], []
    r.send_worker = lambda ident, kind, body, sock=None: sent.append((ident, kind, body)) or True
    r.error = lambda client, cid, code, message: errors.append((cid, code, message))
    r.to_master = told.append
    now = time.monotonic()
    r.workers[b"old"] = W(b"old", {"pid": 1, "wid": 1, "generation": 1, "slots": 4}, now)
    text = "Hello there, a prompt in words"
    for cid, prompt in (("text", text), ("ids", [5, 6, 7]), ("old ids", [5, 450])):
        r.on_generate(b"c", cid, {"type": "generate", "id": cid, "prompt": prompt, "max_tokens": 4,
                                  "request_id": f"rq-{len(cid)}"})
    r.dispatch()
    assert [(i, k) for i, k, _ in sent] == [(b"old", b"WORK")] * 3
    r.workers[b"new"] = W(b"new", {"pid": 2, "wid": 2, "generation": 2, "slots": 4}, now)
    r.select(2)                                   # the commit
    r.check_generations()
    assert {"op": "retire", "generation": 1} in told      # none of its requests queued: its workers drain
    for _, _, body in sent:                       # the drained worker rejects what reached it after
        r.on_backend([b"old", b"REJECT", msgpack.packb({"rid": body["rid"]})])
    r.check_generations()
    assert [(cid, code) for cid, code, _ in errors] == [("old ids", "worker_lost")]
    assert "generation 1" in errors[0][2] and "no worker left" in errors[0][2] and "vocabulary" in errors[0][2]
    sent.clear()
    r.dispatch()
    assert [(i, k) for i, k, _ in sent] == [(b"new", b"WORK")] * 2
    reqs = {body["request"]["request_id"]: body["request"] for _, _, body in sent}     # still named as they came
    text_req, ids_req = reqs["rq-4"], reqs["rq-3"]
    new_ids = Model.open(new_path).tokenizer.encode(text)
    assert text_req["prompt"] == new_ids != Model.open(old_path).tokenizer.encode(text)    # the new tokenizer's
    assert ids_req["prompt"] == [5, 6, 7]
    assert r.counters["readmitted"] == 2 and r.counters["worker_lost"] == 1


def test_a_killed_master_stops_the_router_with_one_line_not_a_crash(caplog):
    """The master killed outright (SIGKILL, an OOM kill) while a message of the router's sat unread in
    its end: the router's read gets ECONNRESET, not EOF. It stops as it does on EOF, saying why in one
    line, instead of dying in a traceback."""
    import socket
    import types

    from colibri_server.router.master_pipe import MasterPipe
    master_end, router_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    router = types.SimpleNamespace(stopping=False)
    pipe = MasterPipe(router, router_end.detach())
    pipe.send({"op": "alive"})              # unread by the master
    master_end.close()
    with caplog.at_level("ERROR", logger="colibri.router"):
        pipe.read()
    assert router.stopping
    assert [r.getMessage() for r in caplog.records] == \
        ["router: the master is gone (its end of the pipe was reset): stopping"]
