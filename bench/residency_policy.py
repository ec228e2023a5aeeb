"""Which experts a weights budget should keep locked: route traces replayed against ranking policies.

Issue 36 locks the experts a decayed count of routes ranks highest (model/residency.py, HALF_LIFE_TOKENS).
This script records which experts greedy decodes route to (the server's batched step, every layer of every
token; no memory limit, so it takes seconds) and replays those routes against a budget of K experts,
re-ranked every LAG tokens, for several half-lives of the count (in tokens through the model; 0: no decay),
and against the best fixed set known in hindsight. It prints, per policy, the share of a decode token's
expert uses found locked and the newcomers locked per token (each one read from disk when it is not cached).
Sequences run one at a time (batch-1 decode) and, with --together, all at once as one step's rows.

    python bench/residency_policy.py --model ~/.cache/colibri-speed/bench-mixtral-f16.colibri --locked 13
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

PROMPT = [1, 5, 9, 200, 31, 77, 1000, 4, 2300, 17, 99, 512, 8, 4096, 250, 13]     # bench/memory_limit.py's


def trace(m, prompt, new):
    """[step][layer] -> [[expert, ...] per row]: every routed layer's choices, step by step."""
    steps, cur = [], {}
    real = batch._feed_forward

    def spy(cfg_, l, L, x, h, sub, ws, noise, counts, *rest):
        real(cfg_, l, L, x, h, sub, ws, noise, counts, *rest)
        if L.gate is not None:
            cur[l] = ws.route_idx[:x.shape[0], :L.top_k].tolist()
    batch._feed_forward = spy
    try:
        eng = BatchEngine(m, max_seqs=1, max_batch_tokens=len(prompt) + 1, prefix_cache=False)
        eng.single = None                       # every step through forward_batch (the spy's)
        eng.add(0, prompt, max_tokens=new, ignore_eos=True, temperature=0.0)
        while eng.has_work():
            cur.clear()
            eng.step()
            steps.append(dict(cur))
    finally:
        batch._feed_forward = real
    return steps


def replay(steps, L, E, K, half_life, lag, bias=1.25):
    """(share of decode uses found locked, newcomers a token): the top K of the decayed counts (incumbents
    ahead by `bias`) locked every `lag` steps; the first step (the prompt) only counts."""
    score, locked, hits, uses, new = np.zeros((L, E)), np.zeros((L, E), bool), 0, 0, 0
    for t, st in enumerate(steps):
        rows = len(next(iter(st.values())))
        if t:
            for l, choice in st.items():
                used = {e for r in choice for e in r}
                uses += len(used)
                hits += sum(bool(locked[l, e]) for e in used)
        if half_life:
            score *= 0.5 ** (rows / half_life)
        for l, choice in st.items():
            for r in choice:
                score[l, r] += 1
        if t % lag == 0:
            eff = score * np.where(locked, bias, 1.0)
            top = np.zeros((L, E), bool)
            top.flat[np.argsort(-eff, axis=None, kind="stable")[:K]] = True
            top &= eff > 0
            new += int((top & ~locked).sum())
            locked = top
    return hits / max(1, uses), new / max(1, len(steps) - 1)


def hindsight(steps, L, E, K):
    total = np.zeros((L, E))
    for st in steps:
        for l, choice in st.items():
            for r in choice:
                total[l, r] += 1
    best = np.zeros((L, E), bool)
    best.flat[np.argsort(-total, axis=None, kind="stable")[:K]] = True
    hits = uses = 0
    for st in steps[1:]:
        for l, choice in st.items():
            used = {e for r in choice for e in r}
            uses += len(used)
            hits += sum(bool(best[l, e]) for e in used)
    return hits / max(1, uses)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/colibri-speed/bench-mixtral-f16.colibri"))
    ap.add_argument("--locked", type=int, default=13, help="experts the budget holds (13: bench-mixtral f16 at 50%%)")
    ap.add_argument("--new", type=int, default=96, help="tokens decoded per sequence")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="random prompts (besides PROMPT)")
    ap.add_argument("--half-lives", type=float, nargs="+", default=[0, 2, 4, 8, 16])
    ap.add_argument("--lags", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--together", action="store_true", help="also replay the sequences as one step's rows")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    m = Model.open(a.model, context=32 + a.new + 8)
    L, E = m.config.num_layers, m.config.num_experts
    prompts = {"PROMPT": PROMPT}
    for s in a.seeds:
        r = np.random.default_rng(s)
        topic = r.choice(m.config.vocab_size, 400, replace=False)
        prompts[f"seed{s}"] = [int(i) for i in r.choice(topic, 32)]
    traces = {k: trace(m, p, a.new) for k, p in prompts.items()}
    if a.together:
        n = min(len(t) for t in traces.values())
        traces["together"] = [{l: [r for t in traces.values() if l in t[i] for r in t[i][l]]
                               for l in traces["PROMPT"][i]} for i in range(n)]
    out = {"model": os.path.basename(a.model), "locked": a.locked, "new_tokens": a.new, "rows": []}
    for name, steps in traces.items():
        h = hindsight(steps, L, E, a.locked)
        print(f"{name}: best fixed set in hindsight {h:.3f}")
        for hl in a.half_lives:
            for lag in a.lags:
                share, new = replay(steps, L, E, a.locked, hl, lag)
                out["rows"].append({"trace": name, "half_life": hl, "lag": lag, "locked_share": round(share, 4),
                                    "newcomers_per_token": round(new, 3), "hindsight": round(h, 4)})
                print(f"  half-life {hl or 'none':>4} tokens, re-ranked every {lag:2d}: {share:.3f} of uses locked, "
                      f"{new:.2f} newcomers a token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
