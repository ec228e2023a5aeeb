"""forward_batch(): one step of the decoder over the rows of many sequences, top to bottom.

A serving step holds N rows: the next token of every decoding sequence and prefill chunks of
others (scheduler.py). Every matrix multiplies all N rows at once (Workspace.mm: the small-row
kernels stream each weight row once for the batch); RoPE runs at each row's own position;
attention reads each row's own sequence through its block table in the paged pool (kv.py);
the MoE routes every row and groups the rows of the whole batch by expert, so each selected
expert's weights are read once per step however many sequences chose it. Only the rows whose
next token is sampled go through the output head.

Legend: N rows, S sequences, D hidden, H heads, Hkv kv heads, hd head dim, V vocab,
M rows that are sampled.
"""
from __future__ import annotations

import numpy as np

from . import kernels as K
from . import mla as MLA
from .config import ModelConfig
from .head import head_logits
from .kernels import paged as KP
from .kernels import tiled as KT
from .moe import moe, swiglu
from .rope import attention_scale
from .transformer import embed, norm, qkv_finish, qkv_rows


class Rows:
    """The rows of one step and where each one lives: built by the serving engine from the
    scheduler's segments, read by forward_batch."""

    def __init__(self, tokens, seq_index, positions, tables, block_size: int, sample_rows):
        self.tokens = np.ascontiguousarray(tokens, np.int64)                     # (N,)
        self.seq = np.ascontiguousarray(seq_index, np.int64)                     # (N,) row -> table
        self.pos = np.ascontiguousarray(positions, np.int64)                     # (N,) absolute
        self.tables = np.ascontiguousarray(tables, np.int32)                     # (S,maxb)
        self.blocks = self.tables[self.seq, self.pos // block_size].astype(np.int64)   # (N,) where each row writes
        self.offsets = self.pos % block_size                                     # (N,)
        self.sample = np.ascontiguousarray(sample_rows, np.int64)                # (M,)
        self.embeds = []                     # [(first row, (k,D) f32)]: rows whose input is given as embeddings

    def __len__(self) -> int:
        return self.tokens.shape[0]


def forward_batch(cfg: ModelConfig, w, rope, ws, pool, rows: Rows, logits_out, noise=None, expert_counts=None,
                  fetch=None, argmax_rows=None) -> np.ndarray:
    """Run every row of the step; write their keys and values into the pool; return the logits of
    the sampled rows (M,V), a view of logits_out (>= M,V). expert_counts (L,E) int64: each layer's
    routing choices of these rows are added to it. fetch: a residency.ReadAhead when the weights have a
    budget (asks for the experts that are not resident before they are needed). argmax_rows (M,) bool: the
    sampled rows that take only their argmax (head.head_logits)."""
    N = len(rows)
    if N > ws.rows:
        raise ValueError(f"{N} rows exceed the workspace's {ws.rows}")
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope
    scale = attention_scale(cfg)
    if ws.threads > 1:
        def attend(*args):
            KT.tiled_attention_par(*args, ws.threads)
    else:
        attend = KT.tiled_attention
    x, h, sub = ws.x[:N], ws.h[:N], ws.sub[:N]                                 # (N,D)

    embed(w.token_embd, rows.tokens, x)
    for r, e in rows.embeds:                                                   # a prompt given as embeddings
        x[r:r + e.shape[0]] = e
    for l, L in enumerate(w.layers):
        # attention: RMSNorm -> q, k, v (+ bias) -> [clip] -> [q/k norm] -> RoPE at each row's position
        norm(x, L.attn_norm, L.attn_norm_b, cfg.rms_norm_eps, h)
        if cfg.mla:            # latent attention (mla.py): one cached row per position, its values its first r dims
            qa, lat_rows = MLA.project(cfg, L, h, ws, rows.pos, cos, sin)    # (N,H,r+dr) (N,1,r+dr)
            KP.write_kv(lat_rows, lat_rows, pool.k[l], pool.k[l], rows.blocks, rows.offsets)
            lat = ws.latent_out[:N].reshape(N, H, cfg.kv_lora_rank)
            attend(qa, pool.k[l], pool.k[l], rows.tables, rows.seq, rows.pos, cfg.window(l), scale, lat, L.sinks)
            MLA.output(cfg, L, lat, ws, sub)
        else:
            q, k, v = qkv_rows(ws, h, L, N)
            q3, k3 = qkv_finish(cfg, L, q, k, v)                               # (N,H,hd) (N,Hkv,hd)
            v3 = v.reshape(N, Hkv, hd)
            K.rope(q3, rows.pos, cos, sin)
            K.rope(k3, rows.pos, cos, sin)
            # the step's keys and values into their slots, then every row over its own sequence
            KP.write_kv(k3, v3, pool.k[l], pool.v[l], rows.blocks, rows.offsets)
            attn = ws.attn[:N]                                                 # (N,H*hd)
            attend(q3, pool.k[l], pool.v[l], rows.tables, rows.seq, rows.pos, cfg.window(l), scale,
                   attn.reshape(N, H, hd), L.sinks)
            ws.mm(attn, L.wo, sub)
            if L.bo is not None:
                sub += L.bo
        x += sub
        _feed_forward(cfg, l, L, x, h, sub, ws, noise, expert_counts, fetch)
        if fetch is not None:
            fetch.ahead(l, x, w.layers)                                        # layer l+1's probable experts

    # final norm and the output head, for the sampled rows only
    M = rows.sample.shape[0]
    hs = ws.gather[:M]                                                         # (M,D)
    np.take(x, rows.sample, axis=0, out=hs)
    norm(hs, w.output_norm, w.output_norm_b, cfg.rms_norm_eps, hs)
    return head_logits(ws, hs, w.output, w.output_b, logits_out[:M], argmax_rows)      # (M,V)


def _feed_forward(cfg: ModelConfig, l: int, L, x, h, sub, ws, noise, expert_counts, fetch=None) -> None:
    """RMSNorm -> MoE over the whole batch (rows grouped by expert) or dense MLP -> residual, in x (N,D)."""
    N = x.shape[0]
    norm(x, L.ffn_norm, L.ffn_norm_b, cfg.rms_norm_eps, h)
    if L.gate is not None:
        if fetch is not None:
            fetch.route(l, L, h)                                               # its experts not resident: read now
        moe(L, h, ws, sub, noise=noise, stream=fetch.stream if fetch is not None else None)
        if fetch is not None:
            fetch.predicted(l, ws.route_idx[:N, :L.top_k])
        if expert_counts is not None:                                          # the layer's choices, (N,A)
            expert_counts[l] += np.bincount(ws.route_idx[:N, :L.top_k].ravel(), minlength=cfg.num_experts)
    else:
        swiglu(h, L.mlp_w1, L.mlp_w3, L.mlp_w2, ws, sub)
    x += sub
