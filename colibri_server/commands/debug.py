"""Looking inside a model (the seed's colibri_debug): which experts each token is routed
to, layer by layer, and how the load spreads over experts."""
from __future__ import annotations

import numpy as np


def routing_trace(model, prompt):
    """Prefill `prompt` (text or ids) and return (ids, [(layer, idx (T,A), weights (T,A))]) for
    every MoE layer, in layer order."""
    ids = model._ids(prompt)
    trace = []
    model.prefill(model.new_cache(len(ids)), ids, trace=trace)
    moe_layers = [i for i in range(model.config.num_layers) if model.config.is_moe_layer(i)]
    return ids, [(layer, idx, w) for layer, (idx, w) in zip(moe_layers, trace)]


def format_routing(model, ids, trace) -> str:
    tok = model.tokenizer if model.file.tokenizer_json else None
    E = model.config.num_experts
    lines = []
    for t, tid in enumerate(ids):
        piece = repr(tok.id_to_token(int(tid))) if tok is not None else ""
        lines.append(f"token {t} id {int(tid)} {piece}")
        for layer, idx, w in trace:
            pairs = "  ".join(f"e{int(e):<3d} {float(x):.3f}" for e, x in zip(idx[t], w[t]))
            lines.append(f"  layer {layer:>3}: {pairs}")
    lines.append("")
    lines.append(f"expert load over {len(ids)} tokens (selections per expert, all MoE layers)")
    load = np.zeros(E, np.int64)
    for _, idx, _ in trace:
        load += np.bincount(idx.reshape(-1), minlength=E)
    top = max(int(load.max()), 1)
    for e in range(E):
        lines.append(f"  e{e:<3d} {int(load[e]):>6d} {'#' * int(round(40 * load[e] / top))}")
    per_layer = ["layer " + str(layer) + ": " + " ".join(str(int(c)) for c in np.bincount(idx.reshape(-1), minlength=E))
                 for layer, idx, _ in trace]
    lines.append("per layer: " + "; ".join(per_layer))
    return "\n".join(lines)


def format_gate(cf, layer: int, rows: int) -> str:
    """The router gate of one layer: its shape and the first rows (one row per expert)."""
    name = f"blk.{layer}.ffn_gate_inp"
    if name not in cf:
        raise KeyError(f"layer {layer} has no router gate (dense layer, or out of range)")
    g = np.asarray(cf.view(name), dtype=np.float32)
    out = [f"{name} f32{list(g.shape)} (experts x hidden): row norms " +
           " ".join(f"{n:.3f}" for n in np.linalg.norm(g, axis=1))]
    with np.printoptions(precision=4, suppress=True, linewidth=120, threshold=48, edgeitems=6):
        for e in range(min(rows, g.shape[0])):
            out.append(f"e{e}: {g[e]}")
    return "\n".join(out)
