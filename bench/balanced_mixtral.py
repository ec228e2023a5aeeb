"""bench-mixtral-balanced: bench-mixtral's weights with near-uniform routing (issue 36's worst case for residency).

bench-mixtral's random router concentrates a layer's routes on 2-3 of its 8 experts (bench/routing_stats.py):
the MoE input of every token shares one large common direction (the mean of the post-attention
RMSNorm outputs), and a random router row's projection on it acts as a per-expert bias that favours
the same experts for every token. This script removes that bias, layer by layer from the first: it
runs bench-mixtral (transformers, f32) on --prompts prompts, takes the mean m of layer l's MoE inputs
(with the routers of the layers before l already changed, so the inputs are the new model's), and
replaces layer l's router W by W - (W m) m^T / |m|^2 (no expert favoured by the common direction), each
row then scaled so its logit has the same spread over those inputs as the others (none favoured by a
larger variance). That alone changes little (routing_stats: top-2 share within a sequence 0.72 -> 0.70):
the concentration is mostly within a greedy sequence, because a random model's greedy decode loops over
a few tokens whose repeated hidden states route alike whatever the router. So, before the routers, the
token embedding is scaled by EMBED_SCALE (the token's own embedding then dominates the residual stream,
and every layer routes by the token, which is random) and the head is the embedding's rows permuted (it
predicts a fixed permutation of the current token: a greedy decode walks a long cycle of distinct
tokens). Every other weight is bench-mixtral's.
It prints each layer's share of routes on its top 1/2/3 experts before and after (uniform: 0.125/0.25/0.375 for 8 experts, top-2), and writes:

- DATA/bench-mixtral-balanced-f32/ (safetensors + config: the HF checkpoint),
- DATA/bench-mixtral-balanced-f16.colibri (colibri's converter, f16, as bench/decode.py converts bench-mixtral),
- DATA/bench-mixtral-balanced-F16.gguf (bench/decode.py's GGUF writer: the same weights for llama.cpp).

    python bench/balanced_mixtral.py [--data DIR]
    python bench/routing_stats.py --model DIR/bench-mixtral-balanced-f16.colibri
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import decode as D  # noqa: E402  (bench-mixtral's checkpoint, converter settings and GGUF writer)

NAME = "bench-mixtral-balanced"
EMBED_SCALE = 100.0     # 30 already routes near-uniformly; 100 leaves no layer concentrated (a measured choice)


def moe_inputs(model, ids, layer: int):
    """The MoE inputs (post-attention RMSNorm outputs) of `layer` for every token of `ids`: (T, hidden)."""
    import torch
    got = []
    gate = model.model.layers[layer].mlp.gate
    h = gate.register_forward_pre_hook(lambda mod, args: got.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for row in ids:
                model(torch.tensor([row]))
    finally:
        h.remove()
    return torch.cat(got).double().numpy()


def shares(x, w, top_k):
    """Share of the routes on a layer's top 1/2/3 experts for MoE inputs x under router w."""
    idx = np.argsort(-(x @ w.T), axis=1)[:, :top_k]
    c = np.bincount(idx.ravel(), minlength=w.shape[0])
    return (np.cumsum(-np.sort(-c))[:3] / c.sum()).round(3).tolist()


def prompts(n: int, length: int, seed: int = 0):
    """Prompts as bench/routing_stats.py makes them: runs of ids from a few random 'topics'."""
    rng = np.random.default_rng(seed)
    topics = [rng.choice(D.VOCAB, 400, replace=False) for _ in range(4)]
    return [[int(i) for i in rng.choice(topics[p % 4], length)] for p in range(n)]


def balance(src: pathlib.Path, dst: pathlib.Path, n_prompts: int, length: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import MixtralForCausalLM
    torch.set_num_threads(1)
    model = MixtralForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).eval()
    st = load_file(str(src / "model.safetensors"))
    ids = prompts(n_prompts, length)
    # greedy decoding of a random model falls into a loop of a few tokens, whose repeated hidden states
    # route alike whatever the router: the embedding is scaled up (EMBED_SCALE) so a token's own embedding
    # dominates the residual stream, and the head's row for pi(t) is t's embedding (it predicts a fixed
    # permutation of the current token): a greedy decode walks a long cycle of distinct tokens, and each
    # layer routes by the token, near-uniformly
    pi = np.random.default_rng(1).permutation(D.VOCAB)
    emb = st["model.embed_tokens.weight"]
    head = np.empty_like(emb)
    head[pi] = emb
    st["lm_head.weight"], st["model.embed_tokens.weight"] = head, emb * EMBED_SCALE
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(st["lm_head.weight"]))
        model.model.embed_tokens.weight.copy_(torch.from_numpy(st["model.embed_tokens.weight"]))
    top_k = D.BENCH_MIXTRAL["num_experts_per_tok"]
    report = []
    for layer in range(D.BENCH_MIXTRAL["num_hidden_layers"]):
        key = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        x = moe_inputs(model, ids, layer)
        w = st[key].astype(np.float64)
        m = x.mean(axis=0)
        nw = w - np.outer(w @ m, m) / (m @ m)
        sd = (x @ nw.T).std(axis=0)
        nw *= (np.mean(sd) / sd)[:, None]
        st[key] = nw.astype(np.float32)
        with torch.no_grad():
            model.model.layers[layer].mlp.gate.weight.copy_(torch.from_numpy(st[key]))
        report.append({"layer": layer, "before": shares(x, w, top_k), "after": shares(x, nw, top_k)})
        print(f"layer {layer}: share of routes on the top 1/2/3 experts {report[-1]['before']} -> "
              f"{report[-1]['after']}", flush=True)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    (dst / "balanced.json").write_text(json.dumps(report, indent=1))
    return {"layers": report}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("COLIBRI_BENCH_DATA", "~/.cache/colibri-speed")).expanduser())
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    a = ap.parse_args(argv)
    src = D.build_hf(a.data)
    hf = a.data / f"{NAME}-f32"
    if not (hf / "model.safetensors").exists():
        balance(src, hf, a.prompts, a.prompt_len)
    col = a.data / f"{NAME}-f16.colibri"
    from colibri_server.model.convert import CONVERTER_VERSION, convert
    if not col.exists() or D.converter_of(col) != CONVERTER_VERSION:     # older converters: other layouts
        convert(hf, col, require_tokenizer=False, progress=False, **D.COLIBRI["f16"])
        print(f"wrote {col}", flush=True)
    gguf = a.data / f"{NAME}-F16.gguf"
    if not gguf.exists():
        D.write_gguf(hf, gguf, "F16")
        print(f"wrote {gguf}", flush=True)


if __name__ == "__main__":
    main()
