"""How concentrated a model's routing is, and how well layer l+1's router predicts its choice early.

Issue 36 keeps experts resident by how often they are routed and reads ahead the experts layer l+1
will probably use. Both pay only if (1) a workload's routes concentrate on few experts per layer and
(2) layer l+1's router, applied to a hidden state available before layer l+1 runs, agrees with its
real top-k. This script measures both on the batched step (forward_batch, the server's path), for
greedy decodes of a set of prompts:

- concentration: per layer, the share of all routes that went to its top 1 / 2 / 3 experts (over the
  whole run, and the mean over sequences of the same share within one sequence);
- prediction: for every row and layer l+1, the share of its actual top-k experts that are in the top-k
  (and top-k+1) of layer l+1's router applied to RMSNorm(ffn_norm of l+1) of
  (a) "post": layer l's output, the hidden state before layer l+1's attention, and
  (b) "pre": layer l's residual before its MoE (one layer earlier: more time to read).

    python bench/routing_stats.py --model ~/.cache/colibri-speed/bench-mixtral-f16.colibri --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from colibri_server.model import Model, batch  # noqa: E402
from colibri_server.model.serving import BatchEngine  # noqa: E402


def _topk(logits, k):
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def _rms(x, w, eps):
    return (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)) * w


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/colibri-speed/bench-mixtral-f16.colibri"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    m = Model.open(a.model, context=a.prompt_len + a.new + 8)
    cfg, W = m.config, m.weights
    E, A, Lnum = cfg.num_experts, cfg.top_k, cfg.num_layers
    eps = cfg.rms_norm_eps
    rng = np.random.default_rng(a.seed)
    vocab = cfg.vocab_size
    # prompts: runs of ids drawn from a few "topics" (a random subset of the vocabulary each), so a
    # prompt is a text about something rather than uniform noise
    topics = [rng.choice(vocab, 400, replace=False) for _ in range(4)]

    step = {}                                  # per forward call: layer -> (pre x, post x, actual idx)
    real_ff = batch._feed_forward

    def spy(cfg_, l, L, x, h, sub, ws, noise, counts, *rest):     # rest: the read-ahead (fetch), when given
        pre = x.copy()
        real_ff(cfg_, l, L, x, h, sub, ws, noise, counts, *rest)
        if L.gate is not None:
            step[l] = (pre, x.copy(), ws.route_idx[:x.shape[0], :L.top_k].copy())
    batch._feed_forward = spy

    routes = np.zeros((Lnum, E), np.int64)
    per_seq = []
    hits = {"post": [0, 0], "pre": [0, 0], "post_k1": [0, 0], "pre_k1": [0, 0]}
    for p in range(a.prompts):
        t = topics[p % len(topics)]
        prompt = [int(i) for i in rng.choice(t, a.prompt_len)]
        eng = BatchEngine(m, max_seqs=1, max_batch_tokens=a.prompt_len + 1, prefix_cache=False)
        eng.single = None                      # every step through forward_batch (the spy's)
        eng.add(0, prompt, max_tokens=a.new, ignore_eos=True, temperature=0.0)
        seq_counts = np.zeros((Lnum, E), np.int64)
        while eng.has_work():
            step.clear()
            eng.step()
            for l in range(Lnum):
                if l not in step:
                    continue
                idx = step[l][2]
                np.add.at(seq_counts[l], idx.ravel(), 1)
                if l + 1 in step:
                    nxt = W.layers[l + 1]
                    actual = step[l + 1][2]
                    for name, x in (("pre", step[l][0]), ("post", step[l][1])):
                        logits = _rms(x, W.layers[l + 1].ffn_norm, eps) @ nxt.gate.T
                        for suffix, k in (("", A), ("_k1", A + 1)):
                            pred = _topk(logits, k)
                            hit = sum(len(set(actual[r]) & set(pred[r])) for r in range(actual.shape[0]))
                            hits[name + suffix][0] += hit
                            hits[name + suffix][1] += actual.size
        routes += seq_counts
        per_seq.append(seq_counts)
    batch._feed_forward = real_ff

    def shares(c):                             # (L,E) -> (L,3) share of routes on the top 1,2,3
        s = -np.sort(-c, axis=1)
        tot = np.maximum(1, c.sum(axis=1, keepdims=True))
        return np.cumsum(s, axis=1)[:, :3] / tot
    whole = shares(routes)
    within = np.mean([shares(c) for c in per_seq], axis=0)
    out = {"model": os.path.basename(a.model), "experts": E, "top_k": A, "layers": Lnum,
           "prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new,
           "share_top123_per_layer_whole_run": whole.round(3).tolist(),
           "share_top123_mean_whole_run": whole.mean(axis=0).round(3).tolist(),
           "share_top123_mean_within_sequence": within.mean(axis=0).round(3).tolist(),
           "uniform_top123": [round(k / E, 3) for k in (1, 2, 3)],
           "prediction_hit_rate": {k: round(v[0] / max(1, v[1]), 4) for k, v in hits.items()}}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
