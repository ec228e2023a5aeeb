"""Named read-only views of one mapped .colibri file. Nothing here copies a weight.

Legend: D hidden, V vocab, H heads, Hkv kv heads, hd head dim, E experts, I expert
intermediate, S shared-expert intermediate, F dense-MLP intermediate.
Matrices are in the file's dtype (f32; f16 viewed as uint16; bf16 viewed as int16), or,
when quantized, a quant.QTensor pairing the values (int8 / packed uint8) with their f16
scales `<name>.s`, or a blocks.BlockTensor (llama.cpp's block kinds), or, stored in panels (f16p / bf16p), a panels.Panels wrapping the panel
array; norms, biases and router gates are f32.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from .blocks import BlockTensor
from .config import ModelConfig, expected_tensors
from .panels import Panels
from .quant import QTensor

QUANT_KIND = {"i8": "q8", "u4": "q4"}
# a tensor a layer lacks: read-only, like the present ones (views of the mapped file), so that a kernel's type
# for it does not depend on whether the family has it (a writable placeholder compiles another signature)
_ABSENT = np.zeros(0, np.float32)
_ABSENT.setflags(write=False)
_NO_SINKS = _ABSENT


def read_only(a: np.ndarray) -> np.ndarray:
    """a, its write flag off (as a view of the mapped file has it); for arrays the model builds itself."""
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray              # (D,) f32
    wq: np.ndarray                     # (H*hd, D)
    wk: np.ndarray                     # (Hkv*hd, D)
    wv: np.ndarray                     # (Hkv*hd, D)
    wo: np.ndarray                     # (D, H*hd)
    bq: np.ndarray | None              # (H*hd,) f32
    bk: np.ndarray | None              # (Hkv*hd,) f32
    bv: np.ndarray | None              # (Hkv*hd,) f32
    bo: np.ndarray | None              # (D,) f32
    q_norm: np.ndarray | None          # (hd,) per head, or (H*hd,) whole projection; f32
    k_norm: np.ndarray | None          # (hd,) or (Hkv*hd,); f32
    ffn_norm: np.ndarray               # (D,) f32
    # MoE layer (gate is None for a dense layer)
    gate: np.ndarray | None            # (E, D) f32 router
    top_k: int
    renorm: bool                       # renormalise the top-k weights
    w1: np.ndarray | None              # (E, I, D) gate_proj of every expert, contiguous
    w3: np.ndarray | None              # (E, I, D) up_proj
    w2: np.ndarray | None              # (E, D, I) down_proj
    shared_w1: np.ndarray | None       # (S, D)
    shared_w3: np.ndarray | None       # (S, D)
    shared_w2: np.ndarray | None       # (D, S)
    shared_gate: np.ndarray | None     # (1, D) f32; None with a shared expert: ungated (v2)
    # dense MLP layer
    mlp_w1: np.ndarray | None          # (F, D)
    mlp_w3: np.ndarray | None          # (F, D)
    mlp_w2: np.ndarray | None          # (D, F)
    # wq, wk, wv as one (H*hd + 2*Hkv*hd, D) view when the file stores them back to back in one
    # float dtype (what the converter writes): decode streams them in one matvec
    wqkv: np.ndarray | None = None
    # otherwise, when the three are f16/bf16 arrays of one kind (panels: not one view), the tuple of
    # their kernel arrays: decode multiplies them in one call (kernels.matvec_stack)
    qkv_stack: tuple | None = None
    # a version-2 routing rule (kernels.route_rule): float32 [flags, n_group, topk_group, routed_scale]
    # and the selection-only correction bias (E,) f32 (size 0: none); None: v1's softmax top-k
    rule: np.ndarray | None = None
    corr_bias: np.ndarray | None = None
    # latent attention (mla.py; wk, wv are None): the query's low-rank input and its norm, the latent
    # row's projection and its norm, the latent's per-head key and value expansions
    q_a: np.ndarray | None = None      # (q_lora_rank, D); None: wq reads the hidden state
    q_a_norm: np.ndarray | None = None  # (q_lora_rank,) f32
    kv_a: np.ndarray | None = None     # (r+dr, D)
    kv_a_norm: np.ndarray | None = None  # (r,) f32
    k_up: np.ndarray | None = None     # (H, r, nope)
    v_up: np.ndarray | None = None     # (H, v, r)
    # GPT-OSS: per-head logits in every attention softmax's sum ((H,) f32; size 0: none), the router's
    # bias on its logits (E,), the experts' biases (E,I) (E,I) (E,D)
    sinks: np.ndarray = field(default_factory=lambda: _NO_SINKS)
    gate_b: np.ndarray | None = None
    b1: np.ndarray | None = None
    b3: np.ndarray | None = None
    b2: np.ndarray | None = None
    swiglu: tuple = ()                 # (alpha, limit) of the clamped SwiGLU with the biases; () otherwise
    # Phi-MoE: LayerNorm's biases (D,) f32 (None: RMSNorm), sparsemixer routing's eps (0: none)
    attn_norm_b: np.ndarray | None = None
    ffn_norm_b: np.ndarray | None = None
    sparsemixer: float = 0.0


@dataclass(frozen=True)
class Weights:
    token_embd: np.ndarray             # (V, D)
    layers: tuple                      # L x Layer
    output_norm: np.ndarray            # (D,) f32
    output: np.ndarray                 # (V, D): lm head (token_embd when tied)
    output_norm_b: np.ndarray | None = None  # (D,) f32: LayerNorm's bias (Phi-MoE)
    output_b: np.ndarray | None = None       # (V,) f32: the head's bias (Phi-MoE)


def check_tensors(cf: fmt.ColibriFile, cfg: ModelConfig) -> None:
    """Every tensor the config implies is present with the right dtype and shape, and no other."""
    expected = {}
    for name, shape, dtypes in expected_tensors(cfg):
        expected[name] = shape
        r = cf.records.get(name)
        if r is None:
            raise fmt.MissingTensor(cf.path, name, f"required by the config ({cfg.arch}), not in the file")
        if r.dtype not in dtypes or tuple(r.shape) != tuple(shape):
            raise fmt.ShapeMismatch(cf.path, name, f"is {r.dtype}{list(r.shape)}, the config needs "
                                                   f"{'/'.join(dtypes)}{list(shape)}")
    extra = sorted(set(cf.records) - set(expected))
    if extra:
        raise fmt.ShapeMismatch(cf.path, extra[0], "is not part of this architecture (unexpected tensor)")
    if cf.header["num_layers"] != cfg.num_layers:
        raise fmt.BadHeader(cf.path, "num_layers", f"{cf.header['num_layers']}, the config says {cfg.num_layers}")
    if cf.header["num_experts"] != cfg.num_experts:
        raise fmt.BadHeader(cf.path, "num_experts", f"{cf.header['num_experts']}, the config says {cfg.num_experts}")
    names = [r.name for r in cf.record_list]
    for i, rt in enumerate(cf.routing):
        where = f"routing[{i}]"
        if cfg.is_moe_layer(i) != bool(rt.num_experts):
            raise fmt.BadRouting(cf.path, where, "MoE/dense disagrees with the config's dense_layers")
        if not rt.num_experts:
            continue
        if names[rt.gate] != f"blk.{i}.ffn_gate_inp":
            raise fmt.BadRouting(cf.path, where, f"gate points at {names[rt.gate]!r}, not blk.{i}.ffn_gate_inp")
        if rt.top_k != cfg.top_k:
            raise fmt.BadRouting(cf.path, where, f"top_k {rt.top_k} differs from the config's {cfg.top_k}")
        if bool(rt.flags & fmt.ROUTE_RENORM) != cfg.norm_topk_prob:
            raise fmt.BadRouting(cf.path, where, "the renormalise flag disagrees with the config's norm_topk_prob")
        if (rt.bias != fmt.NO_TENSOR) != (cfg.correction_bias or cfg.router_bias) \
                or bool(rt.flags & fmt.ROUTE_BIAS_IN_LOGITS) != cfg.router_bias:
            raise fmt.BadRouting(cf.path, where, "the correction bias / router bias disagrees with the config")
        want = f"blk.{i}.ffn_gate_inp_b" if cfg.router_bias else f"blk.{i}.ffn_gate_bias"
        if rt.bias != fmt.NO_TENSOR and names[rt.bias] != want:
            raise fmt.BadRouting(cf.path, where, f"bias points at {names[rt.bias]!r}, not {want}")
        shared = bool(rt.flags & fmt.ROUTE_SHARED_EXPERT)
        if shared != bool(cfg.shared_expert_intermediate_size):
            raise fmt.BadRouting(cf.path, where, "shared-expert flag disagrees with the config")
        if shared and (rt.shared_gate != fmt.NO_TENSOR) != cfg.shared_expert_gate:
            raise fmt.BadRouting(cf.path, where, "the shared-expert gate disagrees with the config")
        if shared and cfg.shared_expert_gate and names[rt.shared_gate] != f"blk.{i}.ffn_shexp_gate":
            raise fmt.BadRouting(cf.path, where, f"shared_gate points at {names[rt.shared_gate]!r}")
        if not rt.flags & (fmt.ROUTE_SIGMOID if cfg.score_func == "sigmoid" else fmt.ROUTE_SOFTMAX):
            raise fmt.BadRouting(cf.path, where, f"the score flags disagree with the config's {cfg.score_func}")
        if bool(rt.flags & fmt.ROUTE_SPARSEMIXER) != (cfg.sparsemixer_eps > 0):
            raise fmt.BadRouting(cf.path, where, "the sparsemixer flag disagrees with the config's sparsemixer_eps")
        if (rt.n_group, rt.topk_group) != ((cfg.n_group, cfg.topk_group) if cfg.n_group > 1 else (0, 0)):
            raise fmt.BadRouting(cf.path, where, "n_group / topk_group disagree with the config")
        if rt.routed_scale != np.float32(cfg.routed_scaling_factor):
            raise fmt.BadRouting(cf.path, where, "routed_scale disagrees with the config")


def _rule(rt: fmt.RoutingRecord, bias) -> dict:
    """A layer's version-2 routing rule for kernels.route_rule, or none (v1's softmax top-k)."""
    if not rt.num_experts or not (rt.flags & (fmt.ROUTE_SIGMOID | fmt.ROUTE_GROUP_LIMITED) or bias is not None
                                  or rt.routed_scale != 1.0):
        return {}
    from .kernels.moe import RULE_GROUPS, RULE_RENORM, RULE_SIGMOID
    flags = ((RULE_RENORM if rt.flags & fmt.ROUTE_RENORM else 0) | (RULE_SIGMOID if rt.flags & fmt.ROUTE_SIGMOID else 0)
             | (RULE_GROUPS if rt.flags & fmt.ROUTE_GROUP_LIMITED else 0))
    return {"rule": read_only(np.array([flags, rt.n_group, rt.topk_group, rt.routed_scale], np.float32)),
            "corr_bias": _ABSENT if bias is None else bias}


def load(cf: fmt.ColibriFile, cfg: ModelConfig) -> Weights:
    check_tensors(cf, cfg)

    def v(name):
        if name not in cf:
            return None
        kind = QUANT_KIND.get(cf.records[name].dtype)
        if cf.records[name].dtype in fmt.BLOCK_DTYPES:
            return BlockTensor(cf.records[name].dtype, cf.view(name))
        if kind is not None:
            return QTensor(kind, cf.view(name), cf.view(name + ".s"))
        if cf.records[name].dtype in fmt.PANEL_DTYPES:
            return Panels(cf.view(name))
        return cf.view(name)

    layers = []
    for i in range(cfg.num_layers):
        p, rt = f"blk.{i}.", cf.routing[i]
        layers.append(Layer(
            attn_norm=v(p + "attn_norm"), wq=v(p + "attn_q"), wk=v(p + "attn_k"), wv=v(p + "attn_v"),
            wo=v(p + "attn_o"), bq=v(p + "attn_q_b"), bk=v(p + "attn_k_b"), bv=v(p + "attn_v_b"), bo=v(p + "attn_o_b"),
            q_norm=v(p + "attn_q_norm"), k_norm=v(p + "attn_k_norm"), ffn_norm=v(p + "ffn_norm"),
            gate=v(p + "ffn_gate_inp"), top_k=rt.top_k, renorm=bool(rt.flags & fmt.ROUTE_RENORM),
            w1=v(p + "ffn_gate_exps"), w3=v(p + "ffn_up_exps"), w2=v(p + "ffn_down_exps"),
            shared_w1=v(p + "ffn_gate_shexp"), shared_w3=v(p + "ffn_up_shexp"),
            shared_w2=v(p + "ffn_down_shexp"), shared_gate=v(p + "ffn_shexp_gate"),
            mlp_w1=v(p + "ffn_gate"), mlp_w3=v(p + "ffn_up"), mlp_w2=v(p + "ffn_down"),
            **_rule(rt, v(p + "ffn_gate_bias")),      # GPT-OSS's logit bias is gate_b, not a rule's
            q_a=v(p + "attn_q_a"), q_a_norm=v(p + "attn_q_a_norm"), kv_a=v(p + "attn_kv_a"),
            kv_a_norm=v(p + "attn_kv_a_norm"), k_up=v(p + "attn_k_up"), v_up=v(p + "attn_v_up"),
            sinks=v(p + "attn_sinks") if p + "attn_sinks" in cf else _NO_SINKS, gate_b=v(p + "ffn_gate_inp_b"),
            b1=v(p + "ffn_gate_exps_b"), b3=v(p + "ffn_up_exps_b"), b2=v(p + "ffn_down_exps_b"),
            swiglu=(cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit > 0 and cfg.is_moe_layer(i) else (),
            attn_norm_b=v(p + "attn_norm_b"), ffn_norm_b=v(p + "ffn_norm_b"),
            sparsemixer=cfg.sparsemixer_eps if rt.flags & fmt.ROUTE_SPARSEMIXER else 0.0,
            wqkv=None if cfg.mla or QUANT_KIND.get(cf.records[p + "attn_q"].dtype)
            else cf.stacked_view([p + "attn_q", p + "attn_k", p + "attn_v"])))
        L = layers[-1]
        if L.wqkv is None and not cfg.mla:
            qkv = [getattr(W, "p", W) for W in (L.wq, L.wk, L.wv)]
            if (all(isinstance(a, np.ndarray) and a.dtype in (np.uint16, np.int16) for a in qkv)
                    and len({(a.dtype, a.ndim, a.flags.c_contiguous) for a in qkv}) == 1):
                layers[-1] = dataclasses.replace(L, qkv_stack=tuple(qkv))
    emb = v("token_embd")
    return Weights(token_embd=emb, layers=tuple(layers), output_norm=cf.view("output_norm"),
                   output=emb if cfg.tie_word_embeddings else v("output"), output_norm_b=v("output_norm_b"),
                   output_b=v("output_b"))


def first_rows(cf: fmt.ColibriFile, name: str, rows: int) -> tuple[np.ndarray, int]:
    """The first `rows` rows of tensor `name` (of its first matrix, for a stack in panels) as f32,
    and how many rows there are (`colibri inspect --tensor`)."""
    from .kernels import weights_to_f32
    from .kernels.packing import from_panels
    v, r = cf.view(name), cf.records[name]
    if r.dtype in fmt.PANEL_DTYPES:              # the first matrix's first rows, gathered from its panels
        p = v.reshape((-1,) + v.shape[-3:])[0]
        total = v.size // (p.shape[0] * p.shape[2])
        return weights_to_f32(from_panels(p[:, :rows])), total
    v2 = v.reshape(-1, v.shape[-1])
    if r.dtype in fmt.BLOCK_DTYPES:
        from .blocks import KINDS
        from .kernels.blocks import dequantize_ref
        return dequantize_ref(v2[:rows], KINDS[r.dtype].ggml, int(r.shape[-1])), v2.shape[0]
    return weights_to_f32(v2[:rows]), v2.shape[0]
