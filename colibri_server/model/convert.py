"""Hugging Face checkpoint directory -> .colibri file. Offline tooling: the server never imports it.

Streaming: safetensors tensors are read one row block at a time with pread (never mmap,
which would leave every touched page of the checkpoint in our RSS), converted, and
appended to the output, so peak memory stays near one row block, whatever the model size.
Each layer's experts are written one after another into one contiguous [E, ...] tensor.
Every layout decision is made here, so that loading is a map and nothing else.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from . import format as fmt
from .config import LAYOUTS, ConfigError, ModelConfig, expected_tensors
from .panels import to_panels

CONVERTER_VERSION = "colibri-convert 2"     # 2: f16 matrices in panels by default
CHUNK_BYTES = 8 << 20       # rows are converted in blocks of about this many source bytes

SUPPORTED = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    # dense: every layer an MLP (the degenerate case of the engine's dense layers)
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConvertError(Exception):
    """The checkpoint cannot be converted; the message names the file, key or tensor."""


# ---------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


@dataclass(frozen=True)
class SourceTensor:
    file: str
    dtype: str          # safetensors dtype string: F32, F16, BF16
    shape: tuple
    start: int          # absolute byte offset in file
    nbytes: int


def read_safetensors_header(path) -> dict:
    """name -> SourceTensor for one .safetensors file (format: u64 n, n bytes of JSON, data)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, 100 << 20):
            raise ConvertError(f"{path}: safetensors header length {n} is larger than the file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConvertError(f"{path}: safetensors header is not JSON: {e}") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            dt, shape = info["dtype"], tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if 8 + n + e > size or b > e:
            raise ConvertError(f"{path}: tensor {name!r} data [{b}, {e}) lies outside the file")
        out[name] = SourceTensor(str(path), dt, shape, 8 + n + b, e - b)
    return out


def index_checkpoint(hf_dir) -> dict:
    """All tensors of a checkpoint directory, sharded (with model.safetensors.index.json) or not."""
    idx = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        try:
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{idx}: not a valid safetensors index ({e})") from None
    else:
        files = sorted(p for p in os.listdir(hf_dir) if p.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise ConvertError(f"{path}: listed in the index but missing")
        tensors.update(read_safetensors_header(path))
    return tensors


def _read_rows(t: SourceTensor, row0: int, row1: int, lead: int = 0) -> np.ndarray:
    """Rows [row0, row1) of the 2-D matrix number `lead` of a tensor (f32, bf16 as raw uint16)."""
    dt = _ST_DTYPES[t.dtype]
    cols = t.shape[-1]
    rows = t.shape[-2] if len(t.shape) >= 2 else 1
    off = t.start + ((lead * rows + row0) * cols) * dt.itemsize
    count = (row1 - row0) * cols
    with open(t.file, "rb") as f:
        a = np.fromfile(f, dtype=dt, count=count, offset=off)
    if a.size != count:
        raise ConvertError(f"{t.file}: truncated while reading a tensor at byte {off}")
    return a.reshape(row1 - row0, cols)


def _to_f32(a: np.ndarray, src: str) -> np.ndarray:
    if src == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _encode(a: np.ndarray, src: str, dst: str, name: str) -> np.ndarray:
    """Convert a block of source values to the stored representation of dtype `dst` (a panel
    dtype takes whole matrices (..., d, n) and returns their panels)."""
    if dst in fmt.PANEL_DTYPES:
        return to_panels(_encode(a, src, fmt.PANEL_DTYPES[dst], name))
    if dst == "bf16" and src == "BF16":
        return a.view(np.int16)
    f = _to_f32(a, src)
    if dst == "f32":
        return f
    if dst == "f16":
        with np.errstate(over="ignore"):
            h = f.astype(np.float16)
        if not np.isfinite(h).all() and np.isfinite(f).all():
            raise ConvertError(f"tensor {name}: values beyond the f16 range (|x| > 65504); use --dtype bf16 or f32")
        return h.view(np.uint16)
    # f32 -> bf16, round to nearest even; NaN stays NaN
    u = f.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        r[nan] = 0x7FC0
    return r.view(np.int16)


# ---------------------------------------------------------------------------- config

def _get(hf: dict, *keys):
    """The first of `keys` present in config.json (transformers renames some between versions)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ConvertError(f"config.json: missing key {keys[0]!r}")


def _rope(hf: dict, default_theta: float):
    """(rope_theta, rope_scaling dict) from either transformers 5 `rope_parameters` or 4.x keys."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or default_theta
    scaling = {k: v for k, v in {**legacy, **params}.items() if v is not None}
    rtype = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rtype == "default":
        return float(theta), {}
    if rtype in ("yarn", "llama3") and "original_max_position_embeddings" not in scaling:
        # transformers defaults it to max_position_embeddings
        scaling["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                       or hf.get("max_position_embeddings"))
    if rtype not in ("linear", "yarn", "llama3"):
        raise ConvertError(f"config.json: rope_type {rtype!r} is not supported (supported: default, linear, "
                           "yarn, llama3; dynamic NTK and longrope change with the sequence length)")
    scaling["rope_type"] = rtype
    return float(theta), scaling


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
    archs = hf.get("architectures") or []
    arch_name = archs[0] if archs else hf.get("model_type", "?")
    if arch_name not in SUPPORTED:
        raise ConvertError(f"config.json: architecture {arch_name!r} is not supported "
                           f"(supported: {', '.join(SUPPORTED)})")
    arch = SUPPORTED[arch_name]
    D, H = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    L = _get(hf, "num_hidden_layers")
    theta, scaling = _rope(hf, 1e6 if arch == "mixtral" else 10000.0)
    eos = hf.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    bos = hf.get("bos_token_id")
    kw = dict(arch=arch, vocab_size=_get(hf, "vocab_size"), hidden_size=D, num_layers=L, num_heads=H,
              num_kv_heads=hf.get("num_key_value_heads") or H,
              head_dim=hf.get("head_dim") or D // H,
              rms_norm_eps=float(_get(hf, "rms_norm_eps")),
              max_position_embeddings=_get(hf, "max_position_embeddings"),
              rope_theta=theta, rope_scaling=scaling,
              tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
              bos_token_id=-1 if bos is None else int(bos), eos_token_ids=tuple(eos), dtype=dtype)
    if arch == "mixtral":
        kw.update(num_experts=_get(hf, "num_local_experts", "num_experts"), top_k=_get(hf, "num_experts_per_tok"),
                  moe_intermediate_size=_get(hf, "intermediate_size"), norm_topk_prob=True,
                  sliding_window=hf.get("sliding_window") or 0)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        E = _get(hf, "num_experts", "num_local_experts")
        step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        dense = [i for i in range(L) if i in mlp_only or not (E > 0 and (i + 1) % step == 0)]
        if hf.get("use_sliding_window") and arch == "qwen2_moe":
            raise ConvertError("config.json: use_sliding_window=true is not supported for "
                               f"{arch_name} (sliding windows on some layers only)")
        kw.update(num_experts=E, top_k=_get(hf, "num_experts_per_tok"),
                  moe_intermediate_size=_get(hf, "moe_intermediate_size"),
                  intermediate_size=hf.get("intermediate_size", 0) if dense else 0,
                  norm_topk_prob=bool(hf.get("norm_topk_prob", arch == "qwen3_moe")),
                  dense_layers=tuple(dense))
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
                      qkv_bias=bool(hf.get("qkv_bias", True)))
        else:
            bias = bool(hf.get("attention_bias", False))
            kw.update(qkv_bias=bias, o_bias=bias, qk_norm="head",
                      sliding_window=(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0)
    elif arch in ("llama", "qwen2", "qwen3"):
        if hf.get("mlp_bias"):
            raise ConvertError(f"config.json: mlp_bias=true is not supported for {arch_name}")
        if hf.get("use_sliding_window"):
            raise ConvertError(f"config.json: use_sliding_window=true is not supported for {arch_name} "
                               "(sliding windows on some layers only)")
        bias = bool(hf.get("attention_bias", False))
        kw.update(num_experts=0, top_k=0, moe_intermediate_size=0, intermediate_size=_get(hf, "intermediate_size"),
                  dense_layers=tuple(range(L)), qkv_bias=True if arch == "qwen2" else bias,
                  o_bias=False if arch == "qwen2" else bias, qk_norm="head" if arch == "qwen3" else "none")
    elif arch == "olmoe":
        bias = bool(hf.get("attention_bias", False))
        kw.update(num_experts=_get(hf, "num_experts", "num_local_experts"), top_k=_get(hf, "num_experts_per_tok"),
                  moe_intermediate_size=_get(hf, "intermediate_size"),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  qkv_bias=bias, o_bias=bias, qk_norm="full",
                  clip_qkv=float(hf.get("clip_qkv") or 0.0))
    try:
        cfg = ModelConfig(**kw)
        cfg.check()
    except ConfigError as e:
        raise ConvertError(f"config.json: {e}") from None
    if arch == "mixtral" and hf.get("attention_bias"):
        raise ConvertError("config.json: attention_bias=true is not supported for Mixtral")
    return cfg


# ---------------------------------------------------------------------------- tensor sources

def _hf_names(cfg: ModelConfig, name: str):
    """Our tensor name -> where it comes from: ('plain', candidate hf names...) or
    ('experts', [per-expert hf names, per naming scheme], [fused hf names], part) where
    part selects the gate (0) or up (1) half of a fused gate_up_proj tensor."""
    if name == "token_embd":
        return ("plain", "model.embed_tokens.weight")
    if name == "output_norm":
        return ("plain", "model.norm.weight")
    if name == "output":
        return ("plain", "lm_head.weight")
    _, layer, key = name.split(".", 2)
    p = f"model.layers.{layer}."
    att = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
           "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
           "attn_v": "self_attn.v_proj.weight", "attn_o": "self_attn.o_proj.weight",
           "attn_q_b": "self_attn.q_proj.bias", "attn_k_b": "self_attn.k_proj.bias",
           "attn_v_b": "self_attn.v_proj.bias", "attn_o_b": "self_attn.o_proj.bias", "attn_q_norm": "self_attn.q_norm.weight",
           "attn_k_norm": "self_attn.k_norm.weight",
           "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
           "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
           "ffn_down_shexp": "mlp.shared_expert.down_proj.weight", "ffn_shexp_gate": "mlp.shared_expert_gate.weight"}
    if key in att:
        return ("plain", p + att[key])
    # Mixtral checkpoints say block_sparse_moe; transformers 5's in-memory state dict says mlp
    moes = ("block_sparse_moe.", "mlp.") if cfg.arch == "mixtral" else ("mlp.",)
    if key == "ffn_gate_inp":
        return ("plain", *[p + m + "gate.weight" for m in moes])
    legacy = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"} if cfg.arch == "mixtral" else \
             {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    fused, part = {"ffn_gate_exps": ("gate_up_proj", 0), "ffn_up_exps": ("gate_up_proj", 1),
                   "ffn_down_exps": ("down_proj", None)}[key]
    return ("experts", [[f"{p}{m}experts.{e}.{legacy[key]}.weight" for e in range(cfg.num_experts)] for m in moes],
            [p + m + "experts." + fused for m in moes], part)


def _blocks(src: SourceTensor, name: str, want_shape, lead: int = 0, part=None):
    """Yield row blocks (numpy, source dtype) of one 2-D matrix of `src` with shape `want_shape`."""
    rows, cols = want_shape if len(want_shape) == 2 else (1, want_shape[0])
    row0 = 0 if part is None else part * rows
    step = max(1, CHUNK_BYTES // max(1, cols * _ST_DTYPES[src.dtype].itemsize))
    for r in range(0, rows, step):
        yield _read_rows(src, row0 + r, row0 + min(rows, r + step), lead)


def _check_src(tensors, hf_name, name, shape):
    t = tensors.get(hf_name)
    if t is None:
        raise ConvertError(f"checkpoint: tensor {hf_name!r} (for {name}) is missing")
    if t.dtype not in _ST_DTYPES:
        raise ConvertError(f"checkpoint: tensor {hf_name!r} has dtype {t.dtype}; supported: F32, F16, BF16")
    if tuple(t.shape) != tuple(shape):
        raise ConvertError(f"checkpoint: tensor {hf_name!r} has shape {list(t.shape)}, expected {list(shape)} "
                           f"from config.json")
    return t


def _sources(cfg, tensors, name, shape):
    """Yield (SourceTensor, 2-D shape, lead index, part) for each piece of our tensor, in file order."""
    recipe = _hf_names(cfg, name)
    if recipe[0] == "plain":
        found = [n for n in recipe[1:] if n in tensors]
        yield _check_src(tensors, found[0] if found else recipe[1], name, shape), shape, 0, None
        return
    _, per_expert, fused, part = recipe
    inner = shape[1:]
    for names in per_expert:
        if names[0] in tensors:
            for hf in names:
                yield _check_src(tensors, hf, name, inner), inner, 0, None
            return
    for fname in fused:   # transformers 5 in-memory layout: gate_up_proj [E, 2I, D], down_proj [E, D, I]
        if fname in tensors:
            full = (shape[0], 2 * inner[0], inner[1]) if part is not None else shape
            t = _check_src(tensors, fname, name, full)
            for e in range(shape[0]):
                yield t, inner, e, part
            return
    raise ConvertError(f"checkpoint: tensor {per_expert[0][0]!r} (for {name}) is missing")


# ---------------------------------------------------------------------------- main entry

def _read_text(path):
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def _tokenizer_blobs(hf_dir, require: bool):
    tok = _read_text(os.path.join(hf_dir, "tokenizer.json"))
    if tok is None and require:
        raise ConvertError(f"{hf_dir}: tokenizer.json not found (the model file embeds it; "
                           "pass --no-tokenizer to convert without one: such a model takes token ids only)")
    template = _read_text(os.path.join(hf_dir, "chat_template.jinja"))
    tc = _read_text(os.path.join(hf_dir, "tokenizer_config.json"))
    if tc and template is None:
        try:
            t = json.loads(tc).get("chat_template")
        except ValueError:
            raise ConvertError(f"{hf_dir}/tokenizer_config.json is not valid JSON") from None
        template = t if isinstance(t, str) else None
    return tok or "", template or ""


def quant_config(cfg: ModelConfig, quantize: str, head: str | None = None, group: int | None = None) -> ModelConfig:
    """cfg with quantization `quantize` (none|q8|q4) of the QUANTIZABLE matrices, in groups of
    `group` rows (default quant.CONVERT_GROUP). The output head
    gets `head` (default: q8 under q4, as llama.cpp keeps it at 6+ bits; else `quantize`), and
    q4 keeps attn_k / attn_v at q8 unless head is q4 ("pure"); a matrix whose shape does not fit
    the group stays in cfg.dtype."""
    from .config import QUANTS, _expected_plain, quant_fits
    if quantize not in QUANTS or (head is not None and head not in QUANTS):
        raise ConvertError(f"--quantize {quantize!r} / head {head!r}: choose one of {', '.join(QUANTS)}")
    if quantize == "none" and head in (None, "none"):
        return cfg
    over = {}
    head = head or ("q8" if quantize == "q4" else quantize)
    if head != quantize:
        over["output"] = head
    if quantize == "q4" and head != "q4":
        # llama.cpp's Q4_0 mix: the small k and v projections at 8 bits too (2% of the bytes
        # read per token, a visible share of the error); head == "q4" asks for everything in q4
        over["attn_k"] = over["attn_v"] = "q8"
    from .kernels.packing import CONVERT_GROUP
    q = replace(cfg, quant=quantize, quant_overrides=dict(over), quant_group=group or CONVERT_GROUP)
    for name, shape, _ in _expected_plain(q):
        key = name.split(".", 2)[-1]
        if not quant_fits(q, q.quant_of(key), shape):
            over[key] = "none"
    q = replace(q, quant_overrides=over)
    q.check()
    return q


def _quantized_blocks(blocks, kind: str, G: int, src_dtype: str):
    """Row blocks of one source matrix -> (values, scales) per block of a multiple of G rows."""
    from .kernels.packing import quantize
    pending = []
    have = 0
    for b in blocks:
        pending.append(_to_f32(b, src_dtype))
        have += b.shape[0]
        if have >= G:
            a = np.concatenate(pending) if len(pending) > 1 else pending[0]
            cut = have // G * G
            yield quantize(kind, a[:cut], G)
            pending, have = ([a[cut:]], have - cut) if have > cut else ([], 0)
    if have:
        raise ConvertError(f"rows not a multiple of the quantization group {G}")


def convert(hf_dir, out_path, dtype: str = "f16", *, name=None, license=None, require_tokenizer=True,
            progress=True, quantize: str = "none", quantize_head: str | None = None,
            quant_group: int | None = None, layout: str | None = None) -> ModelConfig:
    """HF checkpoint -> .colibri. quantize (none|q8|q4) stores the attention projections, the
    experts and the output head group-quantized (quant.py); the rest stays `dtype`. layout
    (rows|panels; default: panels for f16, rows otherwise) is how the f16/bf16 matrices are
    stored (panels.py)."""
    hf_dir = os.fspath(hf_dir)
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ConvertError(f"{hf_dir}: config.json not found (is this a Hugging Face model directory?)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ConvertError(f"{cfg_path}: not valid JSON ({e})") from None
    if dtype not in ("f32", "f16", "bf16"):
        raise ConvertError(f"--dtype {dtype!r}: choose f32, f16 or bf16")
    cfg = replace(quant_config(config_from_hf(hf, dtype), quantize, quantize_head, quant_group),
                  layout=default_layout(dtype, layout))
    tensors = index_checkpoint(hf_dir)
    tok, template = _tokenizer_blobs(hf_dir, require_tokenizer)
    plan = [(n, s, dts[0]) for n, s, dts in expected_tensors(cfg)]
    # resolve every source before writing a byte: a missing tensor fails fast
    for n, s, _ in plan:
        if not n.endswith(".s"):
            for _ in _sources(cfg, tensors, n, s):
                pass
    metadata = {"name": name or os.path.basename(os.path.abspath(hf_dir)), "license": license or hf.get("license", ""),
                "source": os.path.abspath(hf_dir), "source_architecture": hf["architectures"][0],
                "converter": CONVERTER_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "transformers_version": hf.get("transformers_version", "")}
    total = sum(fmt.nbytes(dt, s) for _, s, dt in plan)
    bar = _progress(total, f"convert {os.path.basename(out_path)}", progress)
    with fmt.ColibriWriter(out_path, config=cfg.to_dict(), metadata=metadata, tokenizer_json=tok,
                           chat_template=template, num_experts=cfg.num_experts, num_layers=cfg.num_layers) as w:
        for n, s, dt in plan:
            w.declare(n, dt, s)
        w.set_routing(_routing(cfg, w))
        scales = {}     # quantized matrix -> its scale blocks, written right after it
        for n, s, dt in plan:
            if n.endswith(".s"):
                for blk in scales.pop(n[:-2]):
                    w.write(n, blk)
                    bar.update(blk.nbytes)
                continue
            for src, shape2, lead, part in _sources(cfg, tensors, n, s):
                if dt in ("i8", "u4"):
                    kind = "q8" if dt == "i8" else "q4"
                    for q, sc in _quantized_blocks(_blocks(src, n, shape2, lead, part), kind, cfg.quant_group,
                                                   src.dtype):
                        w.write(n, q)
                        scales.setdefault(n, []).append(sc)
                        bar.update(q.nbytes)
                    continue
                if dt in fmt.PANEL_DTYPES:       # panels need every row: one matrix of a stack at a time
                    out = _panel_matrix(_blocks(src, n, shape2, lead, part), src.dtype, dt, n, shape2)
                    w.write(n, out)
                    bar.update(out.nbytes)
                    continue
                for block in _blocks(src, n, shape2, lead, part):
                    out = _encode(block, src.dtype, dt, n)
                    w.write(n, out)
                    bar.update(out.nbytes)
    bar.close()
    return cfg


def _panel_matrix(blocks, src_dtype: str, dt: str, name: str, shape2) -> np.ndarray:
    """Row blocks of one (d, n) matrix -> its panels (n/PANEL, d, PANEL), filled block by block:
    the converter holds one stored matrix and one source block, never the matrix twice."""
    d, n = shape2
    out = np.empty((n // fmt.PANEL, d, fmt.PANEL), fmt.DTYPES[fmt.DTYPE_CODES[dt]][1])
    r = 0
    for b in blocks:
        e = _encode(b, src_dtype, fmt.PANEL_DTYPES[dt], name)
        out[:, r:r + e.shape[0]] = e.reshape(e.shape[0], n // fmt.PANEL, fmt.PANEL).swapaxes(0, 1)
        r += e.shape[0]
    return out


def default_layout(dtype: str, layout: str | None) -> str:
    """The converter's layout: `layout` when given, else panels for f16 (its decode streams ~10%
    faster in panels) and rows for bf16 (its opt-in prefill_bf16 GEMM runs 5-10% faster on rows at
    8-32 tokens, the same at 128) and f32."""
    if layout is None:
        return "panels" if dtype == "f16" else "rows"
    if layout not in LAYOUTS:
        raise ConvertError(f"--layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if layout == "panels" and dtype == "f32":
        raise ConvertError("--layout panels stores f16 or bf16 matrices; with --dtype f32 use rows")
    return layout


def _routing(cfg: ModelConfig, w: fmt.ColibriWriter):
    recs = []
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            recs.append((fmt.NO_TENSOR, fmt.NO_TENSOR, 0, 0, 0, fmt.NO_TENSOR))
            continue
        flags = fmt.ROUTE_SOFTMAX | (fmt.ROUTE_RENORM if cfg.norm_topk_prob else 0)
        shared = fmt.NO_TENSOR
        if cfg.shared_expert_intermediate_size:
            flags |= fmt.ROUTE_SHARED_EXPERT
            shared = w.index(f"blk.{i}.ffn_shexp_gate")
        recs.append((w.index(f"blk.{i}.ffn_gate_inp"), fmt.NO_TENSOR, cfg.top_k, cfg.num_experts, flags, shared))
    return recs


def _progress(total, desc, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, leave=False)
