"""llama.cpp GGUF file -> .colibri file (`colibri convert model.gguf out.colibri`). Offline tooling:
the server never imports it.

Reads the GGUF with the `gguf` package (memory-mapped; one matrix row block at a time is
dequantized), maps llama.cpp's names and metadata to ModelConfig through the family modules,
undoes the q/k row permutation llama.cpp applies for its interleaved ("normal") rope, rebuilds
tokenizer.json from the GGUF vocabulary (gguf_vocab), and hands every matrix to the one write
path of convert.py: what is stored (dtype, q8/q4, panels) is decided there, as for a Hugging
Face checkpoint. F32/F16/BF16 tensors are read as they are; every quantized type the `gguf`
package can dequantize (Q8_0, Q4_0/1, Q5_0/1, the k-quants, ...) becomes f32 first, then is
stored per --dtype/--quantize. The error of that re-encoding is measured tensor by tensor
against the dequantized GGUF values and reported (`ImportReport`); nothing is silently lost.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .convert import (
    CONVERTER_VERSION,
    ROTARY_KEYS,
    _to_f32,
    as_stored,
    checked_config,
    default_layout,
    partial_rotary_rows,
    quant_config,
    write_model,
)
from .families import BY_ARCH, ConvertError, by_gguf_arch, gguf_name

MISSING = object()
ROW_BLOCK_BYTES = 8 << 20
# quantized types of 6 bits or more (the rest: what a q4 re-encoding would quantize twice)
_Q8_TYPES = {"Q8_0", "Q8_1", "Q8_K", "Q6_K"}
_FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


class GgufKV:
    """The GGUF's metadata (decoded values) and tensor index, with errors that name the key."""

    def __init__(self, path: str, reader):
        self.path = path
        self.fields = {}
        for k, f in reader.fields.items():
            try:
                self.fields[k] = f.contents()
            except Exception as e:          # a field the gguf package cannot decode: name it
                raise ConvertError(f"{path}: GGUF key {k!r} cannot be read ({e})") from None
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch = self.fields.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ConvertError(f"{path}: GGUF key 'general.architecture' is missing")

    def value(self, key, default=MISSING):
        v = self.fields.get(key, MISSING)
        if v is MISSING:
            if default is MISSING:
                raise ConvertError(f"{self.path}: GGUF key {key!r} is missing")
            return default
        return v

    def arch_value(self, key, default=MISSING):
        return self.value(f"{self.arch}.{key}", default)

    def arch_int(self, *keys, default=MISSING) -> int:
        for k in keys:
            v = self.fields.get(f"{self.arch}.{k}", MISSING)
            if v is not MISSING:
                if isinstance(v, list):
                    raise ConvertError(f"{self.path}: GGUF key {self.arch}.{k!r} varies by layer ({v[:4]}...); "
                                       "per-layer values are not supported")
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ConvertError(f"{self.path}: GGUF key {self.arch}.{k} = {v!r} is not an integer")
                return int(v)
        if default is MISSING:
            raise ConvertError(f"{self.path}: GGUF key {self.arch}.{keys[0]!r} is missing")
        return default

    def arch_float(self, key, default=MISSING) -> float:
        v = self.arch_value(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ConvertError(f"{self.path}: GGUF key {self.arch}.{key} = {v!r} is not a number")
        return float(v)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors


@dataclass
class ImportReport:
    """What the import kept and lost: the GGUF's tensor types, and per stored tensor the relative
    RMS error of what was written against the dequantized GGUF values."""
    source_types: dict = field(default_factory=dict)        # GGUF type name -> tensor count
    low_bit_share: float = 0.0                               # matrix weights below 6 bits, a share
    errors: dict = field(default_factory=dict)              # our tensor name -> relative RMS error
    blocks: dict = field(default_factory=dict)              # block kind kept -> tensor count (--quantize blocks)
    converted: dict = field(default_factory=dict)           # GGUF tensor -> "TYPE -> kind": no native kernel

    def worst(self, n: int = 3):
        return sorted(self.errors.items(), key=lambda kv: -kv[1])[:n]

    def summary(self) -> str:
        types = ", ".join(f"{k} x{v}" for k, v in sorted(self.source_types.items()))
        if self.blocks:
            types += "; kept as they are: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.blocks.items()))
        if self.converted:
            types += "; no kernel for these types, dequantized and stored as the nearest kind: " + ", ".join(
                f"{k} ({v})" for k, v in sorted(self.converted.items()))
        if not self.errors:
            return f"GGUF tensors: {types}"
        vals = np.array(list(self.errors.values()))
        worst = ", ".join(f"{k} {v:.2e}" for k, v in self.worst())
        return (f"GGUF tensors: {types}; re-encoding error (relative RMS vs the GGUF's values): "
                f"mean {vals.mean():.2e}, max {vals.max():.2e} ({worst})")


def open_gguf(path):
    import gguf
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConvertError(f"{path}: no such file")
    try:
        return GgufKV(path, gguf.GGUFReader(path, "r"))
    except ConvertError:
        raise
    except Exception as e:                  # the gguf package raises ValueError, struct errors, ...
        raise ConvertError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def is_gguf(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------------------- config

def config_from_gguf(kv: GgufKV, dtype: str):
    has_experts = any(n.endswith(("ffn_gate_exps.weight", "ffn_gate.0.weight")) for n in kv.tensors)
    family = by_gguf_arch(kv.arch, has_experts)
    D = kv.arch_int("embedding_length")
    H = kv.arch_int("attention.head_count")
    if H < 1 or D < 1:
        raise ConvertError(f"{kv.path}: GGUF keys {kv.arch}.embedding_length = {D} and attention.head_count = {H} "
                           "must be positive")
    latent = kv.arch_int("attention.kv_lora_rank", default=0) > 0      # DeepSeek's MLA: its family sets the heads
    hd = kv.arch_int("attention.key_length", default=D // H)
    if kv.arch_int("attention.value_length", default=hd) != hd and not latent:
        raise ConvertError(f"{kv.path}: attention.value_length differs from key_length (not supported)")
    rot = kv.arch_int("rope.dimension_count", default=hd)
    if latent:
        hd = rot
    if rot != hd and (family.gguf_qk_permuted or rot % 2 or not 0 < rot < hd):
        raise ConvertError(f"{kv.path}: GGUF key {kv.arch}.rope.dimension_count = {rot} is a partial rotary "
                           f"embedding (head size {hd}); not supported for {kv.arch}")
    tokens = kv.value("tokenizer.ggml.tokens", None)
    emb = kv.tensors.get("token_embd.weight")
    if emb is None:
        raise ConvertError(f"{kv.path}: tensor 'token_embd.weight' is missing")
    vocab = int(emb.shape[-1])
    if tokens is not None and len(tokens) != vocab:
        raise ConvertError(f"{kv.path}: {len(tokens)} tokens in tokenizer.ggml.tokens but token_embd has {vocab} rows")
    kw = dict(arch=family.arch, vocab_size=vocab, hidden_size=D, num_layers=kv.arch_int("block_count"),
              num_heads=H, num_kv_heads=kv.arch_int("attention.head_count_kv", default=H), head_dim=hd,
              rms_norm_eps=kv.arch_float("attention.layer_norm_rms_epsilon"),
              max_position_embeddings=kv.arch_int("context_length"),
              rope_theta=kv.arch_float("rope.freq_base", family.default_rope_theta),
              rope_scaling=_rope_scaling(kv), tie_word_embeddings=not kv.has_tensor("output.weight"),
              sliding_window=kv.arch_int("attention.sliding_window", default=0) if family.arch == "mixtral" else 0,
              rotary_dim=rot if rot < hd else 0, dtype=dtype)
    return family, checked_config(family.gguf_config(kv, kw), kv.path)


def _factor_list(kv: GgufKV, gname: str) -> list:
    """A rope factor tensor (1-D F32, one value per rotary pair) as a list of floats."""
    t = kv.tensors[gname]
    if _type_name(t) != "F32" or len(t.shape) != 1:
        raise ConvertError(f"{kv.path}: tensor {gname!r} must be 1-D F32, found {_type_name(t)} "
                           f"{[int(x) for x in t.shape]}")
    return [float(v) for v in np.asarray(t.data, np.float32)]


def _rope_scaling(kv: GgufKV) -> dict:
    if "rope_freqs.weight" in kv.tensors:       # Llama 3's rope scaling, as llama.cpp stores it: a divisor per pair
        return {"rope_type": "factors", "factors": _factor_list(kv, "rope_freqs.weight")}
    pair = ("rope_factors_short.weight", "rope_factors_long.weight")
    if any(n in kv.tensors for n in pair):
        # longrope (Phi-3, Phi-3.5-MoE), as llama.cpp stores it: the short and the long divisors per pair, the
        # long ones taken when the context passes rope.scaling.original_context_length (its default: the
        # training context), and one attention factor for both (rope.scaling.attn_factor, default 1: its
        # converter writes sqrt(1 + ln(context / original) / ln(original)); a checkpoint's short_mscale /
        # long_mscale do not reach the file)
        missing = [n for n in pair if n not in kv.tensors]
        if missing:
            raise ConvertError(f"{kv.path}: tensor {missing[0]!r} is missing: llama.cpp's longrope needs both "
                               "rope_factors_short and rope_factors_long")
        return {"rope_type": "longrope", "short_factor": _factor_list(kv, pair[0]),
                "long_factor": _factor_list(kv, pair[1]),
                "original_max_position_embeddings": kv.arch_int("rope.scaling.original_context_length",
                                                                "context_length"),
                "attention_factor": kv.arch_float("rope.scaling.attn_factor", 1.0)}
    rtype = kv.arch_value("rope.scaling.type", "none")
    if rtype in ("none", None):
        return {}
    factor = kv.arch_float("rope.scaling.factor")
    if rtype == "linear":
        return {"rope_type": "linear", "factor": factor}
    if rtype == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": kv.arch_int("rope.scaling.original_context_length")}
        for key, gkey in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
            if kv.arch_value(gkey, None) is not None:
                out[key] = kv.arch_float(gkey)
        return out
    raise ConvertError(f"{kv.path}: GGUF key {kv.arch}.rope.scaling.type = {rtype!r} is not supported "
                       "(supported: none, linear, yarn)")


# ---------------------------------------------------------------------------- tensors

def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved q/k row order -> Hugging Face's rotate-half order, per head."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _type_name(t) -> str:
    return t.tensor_type.name


def _tensor_pieces(kv: GgufKV, family, cfg, name: str, shape):
    """Yield (source dtype, row-block iterator) per matrix of our tensor `name` (one per expert).
    An expert stack is one GGUF tensor (`ffn_gate_exps`), or, in GGUFs written before llama.cpp
    stacked them (early 2024 Mixtral files), one tensor per expert (`ffn_gate.0` ...)."""
    own = _own(kv, family, cfg, name)
    if own is not None and own[1] is not None:             # the family's reshape of a whole tensor
        a = own[1](_whole(kv, own[0]))
        if tuple(a.shape) != tuple(shape):
            raise ConvertError(f"{kv.path}: tensor {own[0]!r} gave {list(a.shape)} for {name}, expected {list(shape)}")
        for m in (a if a.ndim == 3 else (a,)):
            yield "F32", iter([np.ascontiguousarray(m)])
        return
    gname = own[0] if own is not None else _source_name(kv, name)
    if gname in kv.tensors or not name.endswith("_exps"):
        yield from _pieces_of(kv, family, cfg, name, gname, shape)
        return
    for e, ename in enumerate(_per_expert_names(name, shape[0])):
        if ename not in kv.tensors:
            raise ConvertError(f"{kv.path}: tensor {gname!r} (for {name}) is missing, and so is {ename!r}")
        yield from _pieces_of(kv, family, cfg, name, ename, shape[1:])


def _own(kv: GgufKV, family, cfg, name: str):
    """The family's (GGUF name, transform or None) for our tensor `name`, or None for the common name."""
    return family.gguf_tensor(kv, cfg, name) if family.gguf_tensor else None


def _whole(kv: GgufKV, gname: str) -> np.ndarray:
    """A GGUF tensor's values, whole, as f32 in its logical (numpy) shape."""
    import gguf
    t = kv.tensors.get(gname)
    if t is None:
        raise ConvertError(f"{kv.path}: tensor {gname!r} is missing")
    logical = tuple(int(x) for x in reversed(t.shape))
    tname = _type_name(t)
    if tname in _FLOAT_TYPES:
        a = np.asarray(t.data)
        return _to_f32(a.view(np.uint16) if tname == "BF16" else a, _FLOAT_TYPES[tname]).reshape(logical)
    try:
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(logical)
    except NotImplementedError:
        raise ConvertError(f"{kv.path}: tensor {gname!r} has GGML type {tname}, which cannot be dequantized here") from None


def _per_expert_names(name: str, E: int):
    layer, key = name.rsplit(".", 1)
    return [f"{layer}.{key[:-len('_exps')]}.{e}.weight" for e in range(E)]


def _pieces_of(kv: GgufKV, family, cfg, name: str, gname: str, shape):
    import gguf
    t = kv.tensors.get(gname)
    if t is None:
        raise ConvertError(f"{kv.path}: tensor {gname!r} (for {name}) is missing")
    logical = tuple(int(x) for x in reversed(t.shape))
    if int(np.prod(logical)) != int(np.prod(shape)) or (len(logical) == len(shape) and logical != tuple(shape)):
        raise ConvertError(f"{kv.path}: tensor {gname!r} has shape {list(logical)}, expected {list(shape)} "
                           "from the GGUF's metadata")
    tname = _type_name(t)
    src = _FLOAT_TYPES.get(tname, "F32")
    raw = t.data
    lead = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    raw = raw.reshape(lead, rows, -1)
    key = name.split(".", 2)[-1]
    if name in cfg.block_types:                 # kept in its block kind: the GGUF's bytes, rows as they are
        yield from _block_pieces(t, raw, cfg.block_types[name], key, family, cfg, rows, cols)
        return
    fold = np.float32((family.gguf_folds(kv, cfg) if family.gguf_folds else {}).get(key, 1.0))
    if fold != 1:
        src = "F32"
    permute = family.gguf_qk_permuted and key in ("attn_q", "attn_k", "attn_q_b", "attn_k_b")
    heads = cfg.num_heads if key.startswith("attn_q") else cfg.num_kv_heads

    def decode(block):
        if fold != 1:       # a family's scalar folded into the weights (families/granite.py)
            return _to_f32(_raw(block), _FLOAT_TYPES[tname]) * fold if tname in _FLOAT_TYPES else _deq(block) * fold
        return _raw(block) if tname in _FLOAT_TYPES else _deq(block)

    def _raw(block):
        a = np.asarray(block)
        return a.view(np.uint16) if tname == "BF16" else a

    def _deq(block):
        try:
            return gguf.quants.dequantize(np.asarray(block), t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise ConvertError(f"{kv.path}: tensor {gname!r} has GGML type {tname}, which cannot be "
                               "dequantized here") from None

    def matrix(e):
        m = raw[e]
        if key in ROTARY_KEYS and cfg.rotary_dim:     # partial rotary: each head's dims reordered, whole
            yield from partial_rotary_rows(cfg, key, iter([decode(m).reshape(rows, cols)]))
            return
        if permute:         # q/k are small: unpermute the whole matrix at once, over its output rows
            full = decode(m).reshape(shape[0], -1)
            yield _unpermute(full, heads).reshape(rows, cols)
            return
        step = max(1, ROW_BLOCK_BYTES // max(1, m.strides[0] if m.ndim > 1 else m.nbytes))
        for r in range(0, rows, step):
            yield decode(m[r:r + step]).reshape(-1, cols)

    for e in range(lead):
        yield src, matrix(e)


def _block_pieces(t, raw, kind, key, family, cfg, rows, cols):
    """("BLOCKS", row-block iterator of uint8 bytes) per matrix of a tensor kept in block kind `kind`:
    the GGUF's own bytes when its type is that kind (q/k rows unpermuted whole), else its values
    dequantized and quantized to `kind` by the gguf package (a type with no kernel here)."""
    import gguf
    permute = family.gguf_qk_permuted and key in ("attn_q", "attn_k", "attn_q_b", "attn_k_b")
    heads = cfg.num_heads if key.startswith("attn_q") else cfg.num_kv_heads
    from .blocks import BASE
    base = BASE.get(kind, kind)                 # a tiled kind holds its base kind's blocks (as_stored)
    own = _type_name(t).lower() == base
    target = gguf.GGMLQuantizationType[base.upper()]

    def matrix(m):
        if permute:
            m = _unpermute(np.asarray(m), heads)
        step = max(1, ROW_BLOCK_BYTES // max(1, m.strides[0]))
        for r in range(0, rows, step):
            b = np.asarray(m[r:r + step])
            if own:
                yield np.ascontiguousarray(b)
            else:
                f = gguf.quants.dequantize(b, t.tensor_type).astype(np.float32).reshape(-1, cols)
                yield gguf.quants.quantize(f, target)
    for e in range(raw.shape[0]):
        yield "BLOCKS", as_stored(kind, matrix(raw[e]))


def block_plan(kv: GgufKV, family, cfg) -> tuple[dict, dict]:
    """--quantize blocks: (our tensor name -> block kind, GGUF tensor -> "TYPE -> kind" for the types
    with no kernel here). Every quantized matrix the kernels multiply (the QUANTIZABLE ones and the
    token embedding) keeps its GGUF type; float tensors stay float, and so do tensors a family
    transforms or scales (their values change: llama.cpp's blocks would not hold them)."""
    from .blocks import BY_GGML, stored_kind
    from .config import QUANTIZABLE, expected_tensors
    folds = family.gguf_folds(kv, cfg) if family.gguf_folds else {}
    kinds, converted = {}, {}
    for n, shape, _ in expected_tensors(cfg):
        key = n.split(".", 2)[-1]
        if (n != "token_embd" and key not in QUANTIZABLE) or folds.get(key, 1.0) != 1.0 \
                or (key in ROTARY_KEYS and cfg.rotary_dim):
            continue
        own = _own(kv, family, cfg, n)
        if own is not None and own[1] is not None:
            continue
        gname = own[0] if own is not None else _source_name(kv, n)
        names = [gname] if gname in kv.tensors else _per_expert_names(n, shape[0])
        types = {_type_name(kv.tensors[g]) for g in names if g in kv.tensors}
        if len(types) != 1 or next(iter(types)) in _FLOAT_TYPES:
            continue
        tname = types.pop()
        bk = BY_GGML.get(int(kv.tensors[names[0]].tensor_type))
        if bk is None or shape[-1] % bk.block:
            converted[gname] = f"{tname} -> q8_0"
            kinds[n] = "q8_0"
        else:
            kinds[n] = stored_kind(n, bk.name, shape)
    return kinds, converted


def source_types(kv: GgufKV) -> dict:
    out = {}
    for t in kv.tensors.values():
        out[_type_name(t)] = out.get(_type_name(t), 0) + 1
    return out


def auto_quantize(kv: GgufKV) -> str:
    """--quantize auto: none when most of the GGUF's matrix weights (by count; the embedding and
    routers aside) are float, else blocks: every quantized tensor kept in its own llama.cpp type
    (block_plan), the file within a few bytes of the GGUF's size, its products through the block
    kernels (kernels/blocks, blocks_gemm: on bench-mixtral's Q4_K_M, Q4_0 and Q8_0 their prefill and
    decode are at least q8's, docs/models.md). Never q4: re-quantizing 4-bit blocks (llama.cpp's grid,
    32 along a row, an offset in Q4_1/K) onto q4's (symmetric, a scale per column per 64 rows) stacks
    a second rounding on the first: SmolLM2-135M's Q4_1 file went from perplexity 11.74 to 17.62
    that way (bench/real_model.py)."""
    by = {}
    for n, t in kv.tensors.items():
        if len(t.shape) >= 2 and n != "token_embd.weight" and "ffn_gate_inp" not in n:
            by[_type_name(t)] = by.get(_type_name(t), 0) + int(t.n_elements)
    if not by:
        return "none"
    return "none" if max(by, key=by.get) in _FLOAT_TYPES else "blocks"


def low_bit_share(kv: GgufKV) -> float:
    """The share of matrix weights stored below 6 bits (what q4 would re-quantize)."""
    tot = low = 0
    for t in kv.tensors.values():
        if len(t.shape) >= 2:
            tot += int(t.n_elements)
            if _type_name(t) not in _FLOAT_TYPES and _type_name(t) not in _Q8_TYPES:
                low += int(t.n_elements)
    return low / tot if tot else 0.0


# ---------------------------------------------------------------------------- main entry

def convert_gguf(gguf_path, out_path, dtype: str = "f16", *, name=None, license=None, progress=True,
                 quantize: str = "auto", quantize_head: str | None = None, quant_group: int | None = None,
                 layout: str | None = None, require_tokenizer: bool = True):
    """GGUF -> .colibri. Returns (ModelConfig, ImportReport)."""
    from .gguf_vocab import VocabError, tokenizer_from_gguf
    if dtype not in ("f32", "f16", "bf16"):
        raise ConvertError(f"--dtype {dtype!r}: choose f32, f16 or bf16")
    kv = open_gguf(gguf_path)
    family, cfg = config_from_gguf(kv, dtype)
    if quantize == "auto":
        quantize = auto_quantize(kv)
    tok = template = ""
    bos, eos = cfg.bos_token_id, cfg.eos_token_ids
    if "tokenizer.ggml.model" in kv.fields:
        try:
            v = tokenizer_from_gguf(kv.fields)
        except VocabError as e:
            raise ConvertError(f"{kv.path}: {e}") from None
        tok, template = v.tokenizer_json, v.chat_template
        bos = -1 if v.bos_token_id is None else v.bos_token_id
        eos = tuple(i for i in v.eos_token_ids if 0 <= i < cfg.vocab_size)
    elif require_tokenizer:
        raise ConvertError(f"{kv.path}: no tokenizer in the GGUF (tokenizer.ggml.model); pass --no-tokenizer to "
                           "convert without one: such a model takes token ids only")
    cfg = checked_config({**cfg.__dict__, "bos_token_id": bos, "eos_token_ids": eos}, kv.path)
    blocks = quantize == "blocks"
    cfg = replace(quant_config(cfg, "none" if blocks else quantize, quantize_head, quant_group),
                  layout=default_layout(dtype, layout))
    converted = {}
    if blocks:
        kinds, converted = block_plan(kv, family, cfg)
        cfg = replace(cfg, block_types=kinds)
        cfg.check()
    assert BY_ARCH[cfg.arch] is family
    from .config import expected_tensors
    for n, s, _ in expected_tensors(cfg):       # every source resolved before a byte is written
        if not n.endswith(".s"):
            own = _own(kv, family, cfg, n)
            if own is None or own[1] is None:
                _check_present(kv, n, s, own[0] if own else None)
            elif own[0] not in kv.tensors:
                raise ConvertError(f"{kv.path}: tensor {own[0]!r} (for {n}) is missing")
    report = ImportReport(source_types=source_types(kv), low_bit_share=low_bit_share(kv), converted=converted)
    for k in cfg.block_types.values():
        report.blocks[k] = report.blocks.get(k, 0) + 1
    metadata = {"name": name or str(kv.fields.get("general.name") or os.path.basename(kv.path)),
                "license": license or str(kv.fields.get("general.license") or ""),
                "source": os.path.abspath(kv.path), "source_architecture": f"gguf:{kv.arch}",
                "converter": CONVERTER_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_model(out_path, cfg, lambda n, s: _tensor_pieces(kv, family, cfg, n, s), metadata=metadata,
                tokenizer_json=tok, chat_template=template, progress=progress, errors=report.errors)
    return cfg, report


def _source_name(kv: GgufKV, name: str) -> str:
    """The GGUF tensor behind our `name`; a head the family untied (no output.weight in the
    file) is read from the token embedding."""
    if name == "output" and not kv.has_tensor("output.weight"):
        return "token_embd.weight"
    return gguf_name(name)


def _check_present(kv: GgufKV, name: str, shape, gname: str | None = None):
    gname = gname or _source_name(kv, name)
    t = kv.tensors.get(gname)
    if t is None and name.endswith("_exps"):
        per = _per_expert_names(name, shape[0])
        if all(n in kv.tensors for n in per):
            return _check_present_each(kv, name, per, shape[1:])
    if t is None:
        raise ConvertError(f"{kv.path}: tensor {gname!r} (for {name}) is missing")
    if int(np.prod([int(x) for x in t.shape])) != int(np.prod(shape)):
        raise ConvertError(f"{kv.path}: tensor {gname!r} has shape {list(reversed([int(x) for x in t.shape]))}, "
                           f"expected {list(shape)} from the GGUF's metadata")


def _check_present_each(kv: GgufKV, name: str, names, shape):
    for n in names:
        if int(np.prod([int(x) for x in kv.tensors[n].shape])) != int(np.prod(shape)):
            raise ConvertError(f"{kv.path}: tensor {n!r} (for {name}) has {kv.tensors[n].n_elements} values, "
                               f"expected {list(shape)}")
