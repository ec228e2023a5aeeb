"""ModelConfig: the architecture of a model, as stored in the .colibri config blob.

The converter fills it from a Hugging Face config.json (convert.py); the reader parses it
back with `ModelConfig.from_dict`, which names the key at fault on any bad value. The
tensor names and shapes a config implies are listed by `expected_tensors()`: the one
place that says what a valid file of this architecture holds.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields

from .blocks import KINDS as BLOCK_KINDS
from .format import PANEL

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "qwen2", "qwen3", "granitemoe", "glm4_moe",
                 "deepseek2", "gpt_oss", "phimoe")
QK_NORMS = ("none", "head", "full")   # head: RMSNorm over head_dim per head (Qwen3); full: over H*hd (OLMoE)
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "factors", "longrope")  # factors: llama.cpp's rope_freqs   # dynamic NTK and longrope change with length: not supported
FLOAT_DTYPES = ("f32", "f16", "bf16")
QUANTS = ("none", "q8", "q4")          # group-quantized matrices (quant.py): values i8 / u4 + f16 scales
QUANT_VALUE_DTYPE = {"q8": "i8", "q4": "u4"}
LAYOUTS = ("rows", "panels")           # how f16/bf16 matrices are stored (panels.py)
# the matrices a `quant` applies to (key = name without the "blk.N." prefix); the router gate,
# norms, biases and the token embedding are never quantized
QUANTIZABLE = ("attn_q", "attn_k", "attn_v", "attn_o", "attn_q_a", "attn_kv_a", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
               "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate", "ffn_up", "ffn_down", "output")


OMITTED_AT_DEFAULT = ("layout", "block_types", "score_func", "correction_bias", "n_group", "topk_group", "routed_scaling_factor",
                      "shared_expert_gate", "rotary_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                      "v_head_dim", "sliding_layers", "attn_sinks", "router_bias", "expert_bias", "swiglu_limit",
                      "swiglu_alpha", "norm", "output_bias", "sparsemixer_eps")
SCORE_FUNCS = ("softmax", "sigmoid")
NORMS = ("rms", "layer")


class ConfigError(ValueError):
    """A config value is missing or invalid; `key` names it."""

    def __init__(self, key, message):
        self.key = key
        super().__init__(f"config key {key!r}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int                 # D
    num_layers: int                  # L
    num_heads: int                   # H
    num_kv_heads: int                # Hkv (H % Hkv == 0)
    head_dim: int                    # hd
    num_experts: int                 # E (0: a dense model, every layer a dense MLP)
    top_k: int                       # A: active experts per token
    moe_intermediate_size: int       # I of one expert
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    intermediate_size: int = 0       # I of a dense MLP layer (0: none)
    shared_expert_intermediate_size: int = 0  # Is (0: no shared expert)
    norm_topk_prob: bool = True      # renormalise the top-k routing weights
    dense_layers: tuple = ()         # layer indices whose FFN is a dense MLP instead of MoE
    qkv_bias: bool = False
    o_bias: bool = False             # bias on the attention output projection (Qwen3 / OLMoE attention_bias)
    qk_norm: str = "none"
    clip_qkv: float = 0.0            # 0: off; else q, k, v are clamped to [-clip, clip] (OLMoE)
    sliding_window: int = 0          # 0: full attention; else keys j with j > pos - window
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., params}; {} = default
    tie_word_embeddings: bool = False
    bos_token_id: int = -1
    eos_token_ids: tuple = ()
    dtype: str = "f32"               # storage dtype of the big matrices (those not quantized)
    quant: str = "none"              # none | q8 | q4: quantization of the QUANTIZABLE matrices
    quant_group: int = 32            # G: rows of a matrix that share one scale per column
    quant_overrides: dict = field(default_factory=dict)  # matrix key -> none|q8|q4, overriding `quant`
    layout: str = "rows"             # rows | panels: f16/bf16 QUANTIZABLE matrices in panels (f16p/bf16p)
    # tensor name -> block kind (blocks.py: q4_k, q6_k, ...): matrices kept in llama.cpp's block formats
    # as the GGUF holds them (the QUANTIZABLE ones and token_embd), one kind per tensor
    block_types: dict = field(default_factory=dict)
    # version-2 routing (docs/format.md) and what else later families need; left out of the blob
    # at their defaults, so that files of the first families read as before
    score_func: str = "softmax"      # softmax | sigmoid: the router's scores
    correction_bias: bool = False    # blk.N.ffn_gate_bias [E]: added to the scores for the choice only
    n_group: int = 0                 # > 1: group-limited choice among n_group consecutive expert groups
    topk_group: int = 0              # groups kept
    routed_scaling_factor: float = 1.0   # on the routed experts' weights
    shared_expert_gate: bool = True  # a shared expert has a sigmoid gate (Qwen2-MoE); False: ungated (DeepSeek, GLM)
    rotary_dim: int = 0              # RoPE on this many leading dims of a head (0: all); GLM-4.5's partial rotary
    # multi-head latent attention (DeepSeek-V2/V3, mla.py): kv_lora_rank > 0 turns it on. head_dim is
    # then the rotary part of a head (qk_rope_head_dim), num_kv_heads 1 (the latent is shared by all heads)
    kv_lora_rank: int = 0            # r: the latent every key and value is expanded from (what the cache holds)
    q_lora_rank: int = 0             # the query's own low-rank input (0: q projected from the hidden state)
    qk_nope_head_dim: int = 0        # the part of a query/key head without position
    v_head_dim: int = 0              # a value head
    # GPT-OSS
    sliding_layers: tuple = ()       # the layers that use sliding_window (empty: all of them)
    attn_sinks: bool = False         # blk.N.attn_sinks [H]: a learned logit in each head's softmax sum
    router_bias: bool = False        # blk.N.ffn_gate_inp_b [E]: the router's logits are W x + b
    expert_bias: bool = False        # blk.N.ffn_{gate,up,down}_exps_b: each expert's projections have biases
    swiglu_limit: float = 0.0        # > 0: the clamped SwiGLU (up + 1) * g * sigmoid(alpha g), g <= limit, |up| <= limit
    swiglu_alpha: float = 0.0        # its alpha (1.702)
    # Phi-3.5-MoE
    norm: str = "rms"                # rms | layer: LayerNorm with a bias (blk.N.attn_norm_b, ffn_norm_b, output_norm_b)
    output_bias: bool = False        # output_b [V]: the output head's bias
    sparsemixer_eps: float = 0.0     # > 0: sparsemixer routing (top_k 2) with this jitter eps

    # -- derived ----------------------------------------------------------------
    def quant_of(self, key: str) -> str:
        """none | q8 | q4 for a matrix key (name without the "blk.N." prefix)."""
        if key not in QUANTIZABLE:
            return "none"
        return self.quant_overrides.get(key, self.quant)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def window(self, layer: int) -> int:
        """The sliding window of a layer's attention (0: full)."""
        return self.sliding_window if not self.sliding_layers or layer in self.sliding_layers else 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_dim(self) -> int:
        """Width of the query projection: H heads of head_dim (MLA: of qk_nope_head_dim + head_dim)."""
        return self.num_heads * (self.qk_nope_head_dim + self.head_dim if self.mla else self.head_dim)

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection; MLA: of the latent row, kv_lora_rank + head_dim."""
        return self.kv_lora_rank + self.head_dim if self.mla else self.num_kv_heads * self.head_dim

    @property
    def cache_dim(self) -> int:
        """One cached row of one kv head: head_dim; MLA: the latent and the rotary key, kv_lora_rank + head_dim
        (its values are the latent itself: the first kv_lora_rank dims of the same row, nothing else is cached)."""
        return self.kv_lora_rank + self.head_dim if self.mla else self.head_dim

    @property
    def attn_dim(self) -> int:
        """Width of the attention's output (the input of attn_o)."""
        return self.num_heads * self.v_head_dim if self.mla else self.q_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        for key in OMITTED_AT_DEFAULT:  # left out at their defaults: older readers take the file
            if d[key] == _DEFAULTS[key] or (isinstance(_DEFAULTS[key], tuple) and d[key] == list(_DEFAULTS[key])):
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("(root)", f"must be an object, found {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(unknown[0], "unknown key")
        kw = {}
        for name, f in known.items():
            if name not in d:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise ConfigError(name, "missing")
                continue
            kw[name] = _coerce(name, d[name], f.type)
        cfg = cls(**kw)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise ConfigError naming the first inconsistent value."""
        def need(ok, key, msg):
            if not ok:
                raise ConfigError(key, msg)
        need(self.arch in ARCHITECTURES, "arch", f"{self.arch!r} is not one of {ARCHITECTURES}")
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "max_position_embeddings"):
            need(0 < getattr(self, key) <= 1 << 24, key, f"{getattr(self, key)} is not in 1..{1 << 24}")
        need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")
        need(self.head_dim % 2 == 0, "head_dim", f"{self.head_dim} must be even for RoPE")
        need(0 <= self.num_experts <= 65536, "num_experts", f"{self.num_experts} is not in 0..65536")
        if self.num_experts == 0:       # a dense model: every layer a dense MLP, nothing routed
            need(self.top_k == 0, "top_k", "must be 0 in a dense model (num_experts 0)")
            need(self.moe_intermediate_size == 0, "moe_intermediate_size", "must be 0 in a dense model (num_experts 0)")
            need(sorted(set(self.dense_layers)) == list(range(self.num_layers)), "dense_layers",
                 "a dense model (num_experts 0) lists every layer")
        else:
            need(0 < self.top_k <= self.num_experts, "top_k", f"{self.top_k} is not in 1..num_experts")
            need(0 < self.moe_intermediate_size <= 1 << 24, "moe_intermediate_size", "must be positive")
            need(len(set(self.dense_layers)) < self.num_layers, "dense_layers", "a MoE model needs at least one MoE layer")
        need(0 <= self.intermediate_size <= 1 << 24, "intermediate_size", "must be >= 0")
        need(0 <= self.shared_expert_intermediate_size <= 1 << 24, "shared_expert_intermediate_size", "must be >= 0")
        need(all(0 <= i < self.num_layers for i in self.dense_layers), "dense_layers",
             f"{list(self.dense_layers)} has an index outside 0..{self.num_layers - 1}")
        need(bool(self.dense_layers) == (self.intermediate_size > 0), "intermediate_size",
             "must be > 0 exactly when there are dense layers")
        need(math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, "rms_norm_eps",
             f"{self.rms_norm_eps} is not in (0, 1)")
        need(math.isfinite(self.rope_theta) and self.rope_theta > 0, "rope_theta", "must be positive")
        need(self.qk_norm in QK_NORMS, "qk_norm", f"{self.qk_norm!r} is not one of {QK_NORMS}")
        need(math.isfinite(self.clip_qkv) and self.clip_qkv >= 0, "clip_qkv", "must be >= 0")
        need(self.sliding_window >= 0, "sliding_window", "must be >= 0")
        need(self.dtype in FLOAT_DTYPES, "dtype", f"{self.dtype!r} is not one of {FLOAT_DTYPES}")
        _check_rope(self, need)
        need(self.layout in LAYOUTS, "layout", f"{self.layout!r} is not one of {LAYOUTS}")
        need(self.score_func in SCORE_FUNCS, "score_func", f"{self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.n_group > 1 or self.topk_group:
            need(self.n_group >= 2, "n_group", f"{self.n_group}: group-limited routing (topk_group set) needs >= 2 groups")
            need(self.num_experts > 0 and self.num_experts % self.n_group == 0, "n_group",
                 f"{self.n_group} does not divide num_experts {self.num_experts}")
            need(self.score_func != "sigmoid" or self.num_experts // self.n_group >= 2, "n_group",
                 "sigmoid group scores sum each group's two best experts: groups need >= 2 experts")
            need(1 <= self.topk_group <= self.n_group, "topk_group", f"{self.topk_group} is not in 1..n_group")
            need(self.topk_group * (self.num_experts // self.n_group) >= self.top_k, "topk_group",
                 f"{self.topk_group} groups of {self.num_experts // self.n_group} experts hold fewer than top_k")
        need(math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0, "routed_scaling_factor",
             "must be finite and > 0")
        need(self.rotary_dim == 0 or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
             "rotary_dim", f"{self.rotary_dim} must be 0 or an even number up to head_dim {self.head_dim}")
        if 0 < self.rotary_dim < self.head_dim:
            need((self.rope_scaling or {}).get("rope_type", "default") in ("default", "linear", "llama3", "factors"),
                 "rotary_dim", "a partial rotary embedding with yarn's attention factor is not supported")
        if self.mla:
            for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                need(0 < getattr(self, key) <= 1 << 16, key, f"{getattr(self, key)} is not in 1..{1 << 16}")
            need(0 <= self.q_lora_rank <= 1 << 16, "q_lora_rank", f"{self.q_lora_rank} is not in 0..{1 << 16}")
            need(self.num_kv_heads == 1, "num_kv_heads", "must be 1 with latent attention (kv_lora_rank > 0)")
            need(self.qk_norm == "none" and not self.qkv_bias and not self.o_bias and not self.clip_qkv
                 and not self.rotary_dim, "kv_lora_rank",
                 "latent attention takes no q/k norm, attention biases, clip_qkv or rotary_dim")
        else:
            for key in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                need(getattr(self, key) == 0, key, "is set only with latent attention (kv_lora_rank > 0)")
        need(all(0 <= i < self.num_layers for i in self.sliding_layers), "sliding_layers",
             f"{list(self.sliding_layers)} has an index outside 0..{self.num_layers - 1}")
        need(not self.sliding_layers or self.sliding_window > 0, "sliding_layers", "is set without a sliding_window")
        need(not (self.router_bias or self.expert_bias) or self.num_experts > 0, "router_bias",
             "router and expert biases need experts")
        need(not (self.router_bias and self.correction_bias), "router_bias",
             "a layer's routing has one bias: a correction or a logit bias, not both")
        need(math.isfinite(self.swiglu_limit) and self.swiglu_limit >= 0, "swiglu_limit", "must be finite and >= 0")
        need(self.swiglu_limit == 0 or (math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0), "swiglu_alpha",
             "must be finite and > 0 with a swiglu_limit")
        need(self.norm in NORMS, "norm", f"{self.norm!r} is not one of {NORMS}")
        need(math.isfinite(self.sparsemixer_eps) and self.sparsemixer_eps >= 0, "sparsemixer_eps", "must be finite and >= 0")
        if self.sparsemixer_eps > 0:
            need(self.num_experts >= 2 and self.top_k == 2, "sparsemixer_eps", "sparsemixer routing chooses 2 experts: "
                 "top_k must be 2")
            need(self.score_func == "softmax" and not (self.n_group or self.correction_bias or self.router_bias
                                                        or self.norm_topk_prob or self.routed_scaling_factor != 1.0),
                 "sparsemixer_eps", "sparsemixer routing takes no other routing rule (groups, biases, renormalising, scale)")
        need(self.expert_bias == (self.swiglu_limit > 0), "expert_bias",
             "biased experts come with the clamped SwiGLU (swiglu_limit > 0) and it with them (GPT-OSS)")
        need(self.quant in QUANTS, "quant", f"{self.quant!r} is not one of {QUANTS}")
        need(self.quant_group in (8, 16, 32, 64, 128), "quant_group", f"{self.quant_group} is not 8, 16, 32, 64 or 128")
        for k, v in self.quant_overrides.items():
            need(k in QUANTIZABLE, "quant_overrides", f"{k!r} is not a quantizable matrix {QUANTIZABLE}")
            need(v in QUANTS, "quant_overrides", f"{k}: {v!r} is not one of {QUANTS}")
        for name, kind in self.block_types.items():
            need(isinstance(kind, str) and kind in BLOCK_KINDS, "block_types", f"{name}: {kind!r} is not a block kind {tuple(BLOCK_KINDS)}")
            need(name == "token_embd" or name == "output" or name.split(".", 2)[-1] in QUANTIZABLE,
                 "block_types", f"{name!r} is not a matrix that can be stored in blocks")
        for name, shape, _ in (_expected_plain(self) if self.quant != "none" or self.quant_overrides else ()):
            q = self.quant_of(name.split(".", 2)[-1])
            need(quant_fits(self, q, shape), "quant",
                 f"{name} {list(shape)} cannot be stored as {q} (group {self.quant_group}): override it to none")
        need(-1 <= self.bos_token_id < self.vocab_size, "bos_token_id", "outside the vocabulary")
        need(all(0 <= e < self.vocab_size for e in self.eos_token_ids), "eos_token_ids", "outside the vocabulary")


ROPE_KEYS = {  # rope_type: (required positive numbers, optional positive numbers)
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "factors": ((), ()),        # "factors": a list of head_dim/2 divisors of inv_freq (a GGUF's rope_freqs)
    # longrope: short_factor / long_factor lists (head_dim/2 divisors each); rope.py chooses by the context
    "longrope": (("original_max_position_embeddings",), ("attention_factor", "factor", "short_mscale", "long_mscale")),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")),
}


def _check_rope(self, need):
    rs = self.rope_scaling or {}
    rt = rs.get("rope_type", "default")
    need(isinstance(rt, str) and rt in ROPE_TYPES, "rope_scaling", f"rope_type {rt!r} is not one of {ROPE_TYPES}")
    required, optional = ROPE_KEYS[rt]
    lists = {"factors": ("factors",), "longrope": ("short_factor", "long_factor")}.get(rt, ())
    allowed = {"rope_type", "truncate", *required, *optional, *lists}
    extra = sorted(set(rs) - allowed)
    need(not extra, "rope_scaling", f"unknown key {extra[0]!r} for rope_type {rt!r}" if extra else "")
    for k in required:
        need(k in rs, "rope_scaling", f"rope_type {rt!r} needs {k!r}")
    for k in (*required, *optional):
        if k in rs and rs[k] is not None:
            v = rs[k]
            need(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and 0 < v < 1e9,
                 "rope_scaling", f"{k} = {v!r} must be a positive finite number")
    need(isinstance(rs.get("truncate", True), bool), "rope_scaling", "truncate must be a boolean")
    for key in lists:
        f = rs.get(key)
        n = (self.rotary_dim or self.head_dim) // 2
        need(isinstance(f, list) and len(f) == n and all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and 0 < v < 1e9 for v in f),
            "rope_scaling", f"{key} must be a list of {n} positive finite numbers (one per rotary pair)")
    if rt == "llama3":
        need(rs["low_freq_factor"] != rs["high_freq_factor"], "rope_scaling",
             "low_freq_factor and high_freq_factor must differ")
    need(self.rope_theta > 1, "rope_theta", f"{self.rope_theta} must be > 1")



def _coerce(name, value, typ):
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    bad = ConfigError(name, f"{value!r} is not a valid {typ}")
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if typ == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            return float(value)
        except OverflowError:
            raise bad from None
    if typ == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if typ == "str":
        if not isinstance(value, str):
            raise bad
        return value
    if typ == "tuple":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(name, f"{value!r} is not a list of integers")
        return tuple(value)
    if typ == "dict":
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    raise bad  # pragma: no cover


# ---------------------------------------------------------------------------- tensors

def file_config(cf) -> ModelConfig:
    """The config of an opened .colibri file (format.ColibriFile); BadConfig naming the key when a
    value is wrong."""
    from . import format as fmt
    raw = fmt.read_json_blob(cf.path, "config", cf.config_json)
    try:
        return ModelConfig.from_dict(raw)
    except ConfigError as e:
        raise fmt.BadConfig(cf.path, f"config.{e.key}", str(e)) from None


def expected_tensors(cfg: ModelConfig):
    """Yield (name, shape, allowed dtypes) for every tensor a file of this config holds.
    Norms, biases and router gates are always f32 (routing is precision sensitive);
    the big matrices are in cfg.dtype, in panels (f16p / bf16p) under layout "panels"."""
    for name, shape, dtypes in _expected_plain(cfg):
        key = name.split(".", 2)[-1]
        if name in cfg.block_types:
            yield name, shape, (cfg.block_types[name],)
            continue
        q = cfg.quant_of(key)
        if q == "none":
            yield name, shape, (stored_dtype(cfg, key, shape),) if dtypes == (cfg.dtype,) else dtypes
            continue
        # values (logical shape) and per-(row group, column) f16 scales `<name>.s`
        yield name, shape, (QUANT_VALUE_DTYPE[q],)
        yield name + ".s", (*shape[:-2], shape[-2] // cfg.quant_group, shape[-1]), ("f16",)


def stored_dtype(cfg: ModelConfig, key: str, shape) -> str:
    """The dtype of an unquantized big matrix: cfg.dtype, or its panel dtype (f16p / bf16p) under
    layout "panels" for the QUANTIZABLE matrices whose columns are whole panels."""
    if (cfg.layout == "panels" and cfg.dtype in ("f16", "bf16") and key in QUANTIZABLE
            and len(shape) >= 2 and shape[-1] % PANEL == 0):
        return cfg.dtype + "p"
    return cfg.dtype


def quant_fits(cfg: ModelConfig, q: str, shape) -> bool:
    """Whether a matrix of this logical shape can be stored in quantization q (rows a multiple
    of the group, an even number of columns for q4)."""
    return q == "none" or (shape[-2] % cfg.quant_group == 0 and (q != "q4" or shape[-1] % 2 == 0))


def _expected_plain(cfg: ModelConfig):
    D, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    W, F32 = (cfg.dtype,), ("f32",)
    yield "token_embd", (V, D), W
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        yield p + "attn_norm", (D,), F32
        if cfg.norm == "layer":
            yield p + "attn_norm_b", (D,), F32
        if cfg.mla:
            yield from _expected_mla(cfg, p)
        else:
            yield p + "attn_q", (cfg.q_dim, D), W
            yield p + "attn_k", (cfg.kv_dim, D), W
            yield p + "attn_v", (cfg.kv_dim, D), W
        yield p + "attn_o", (D, cfg.attn_dim), W
        if cfg.attn_sinks:
            yield p + "attn_sinks", (cfg.num_heads,), F32
        if cfg.qkv_bias:
            yield p + "attn_q_b", (cfg.q_dim,), F32
            yield p + "attn_k_b", (cfg.kv_dim,), F32
            yield p + "attn_v_b", (cfg.kv_dim,), F32
        if cfg.o_bias:
            yield p + "attn_o_b", (D,), F32
        if cfg.qk_norm == "head":
            yield p + "attn_q_norm", (cfg.head_dim,), F32
            yield p + "attn_k_norm", (cfg.head_dim,), F32
        elif cfg.qk_norm == "full":
            yield p + "attn_q_norm", (cfg.q_dim,), F32
            yield p + "attn_k_norm", (cfg.kv_dim,), F32
        yield p + "ffn_norm", (D,), F32
        if cfg.norm == "layer":
            yield p + "ffn_norm_b", (D,), F32
        if not cfg.is_moe_layer(i):
            yield p + "ffn_gate", (cfg.intermediate_size, D), W
            yield p + "ffn_up", (cfg.intermediate_size, D), W
            yield p + "ffn_down", (D, cfg.intermediate_size), W
            continue
        yield p + "ffn_gate_inp", (E, D), F32
        if cfg.correction_bias:
            yield p + "ffn_gate_bias", (E,), F32
        if cfg.router_bias:
            yield p + "ffn_gate_inp_b", (E,), F32
        yield p + "ffn_gate_exps", (E, I, D), W
        yield p + "ffn_up_exps", (E, I, D), W
        yield p + "ffn_down_exps", (E, D, I), W
        if cfg.expert_bias:
            yield p + "ffn_gate_exps_b", (E, I), F32
            yield p + "ffn_up_exps_b", (E, I), F32
            yield p + "ffn_down_exps_b", (E, D), F32
        if cfg.shared_expert_intermediate_size:
            S = cfg.shared_expert_intermediate_size
            yield p + "ffn_gate_shexp", (S, D), W
            yield p + "ffn_up_shexp", (S, D), W
            yield p + "ffn_down_shexp", (D, S), W
            if cfg.shared_expert_gate:
                yield p + "ffn_shexp_gate", (1, D), F32
    yield "output_norm", (D,), F32
    if cfg.norm == "layer":
        yield "output_norm_b", (D,), F32
    if not cfg.tie_word_embeddings:
        yield "output", (V, D), W
    if cfg.output_bias:
        yield "output_b", (V,), F32


def _expected_mla(cfg: ModelConfig, p: str):
    """A latent-attention layer's projections (mla.py): the query (through its own low-rank input when
    q_lora_rank), the latent row (kv_lora_rank + rotary dims) and its norm, and the two per-head halves of
    the latent's expansion: attn_k_up (H, r, nope) multiplies the queries (the key half, absorbed),
    attn_v_up (H, v, r) the attention's latent output (the value half). The expansions are stored in
    cfg.dtype, never quantized or in panels."""
    D, W, F32 = cfg.hidden_size, (cfg.dtype,), ("f32",)
    H, r = cfg.num_heads, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        yield p + "attn_q_a", (cfg.q_lora_rank, D), W
        yield p + "attn_q_a_norm", (cfg.q_lora_rank,), F32
        yield p + "attn_q", (cfg.q_dim, cfg.q_lora_rank), W
    else:
        yield p + "attn_q", (cfg.q_dim, D), W
    yield p + "attn_kv_a", (cfg.kv_dim, D), W
    yield p + "attn_kv_a_norm", (r,), F32
    yield p + "attn_k_up", (H, r, cfg.qk_nope_head_dim), W
    yield p + "attn_v_up", (H, cfg.v_head_dim, r), W


_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
             for f in fields(ModelConfig) if f.default is not MISSING or f.default_factory is not MISSING}
