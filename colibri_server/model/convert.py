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
from dataclasses import replace

import numpy as np

from . import format as fmt
from .checkpoint import _ST_DTYPES, SourceTensor, _mxfp4_source, _read_rows, index_checkpoint
from .config import LAYOUTS, ConfigError, ModelConfig, expected_tensors
from .families import BY_ARCH, BY_HF_CLASS, ConvertError, by_hf_class
from .families import get as _get
from .families.base import HF_LAYER_NAMES
from .kernels.blocks import to_x16
from .panels import to_panels
from .writer import ColibriWriter

CONVERTER_VERSION = "colibri-convert 5"     # 2: f16 matrices in panels by default; 3: q4_k experts as tiles; 4: q6_k's;
# 5: expert stacks after the rest, on 2 MiB when an expert's slice is whole 2 MiB pieces (format.PIECE)
CHUNK_BYTES = 8 << 20       # rows are converted in blocks of about this many source bytes

SUPPORTED = tuple(BY_HF_CLASS)     # the transformers architectures the families convert



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

def _rope(hf: dict, default_theta: float):
    """(rope_theta, rope_scaling dict) from either transformers 5 `rope_parameters` or 4.x keys."""
    params = dict(hf.get("rope_parameters") or {})
    params.pop("partial_rotary_factor", None)       # the family reads it (GLM-4.5: rotary_dim)
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or default_theta
    scaling = {k: v for k, v in {**legacy, **params}.items() if v is not None}
    rtype = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rtype == "default":
        return float(theta), {}
    if rtype == "su":                               # longrope's first name (Phi-3)
        rtype = "longrope"
    if rtype in ("yarn", "llama3", "longrope") and "original_max_position_embeddings" not in scaling:
        # transformers defaults it to max_position_embeddings
        scaling["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                       or hf.get("max_position_embeddings"))
    if rtype not in ("linear", "yarn", "llama3", "longrope"):
        raise ConvertError(f"config.json: rope_type {rtype!r} is not supported (supported: default, linear, "
                           "yarn, llama3, longrope; dynamic NTK changes with the sequence length)")
    scaling["rope_type"] = rtype
    return float(theta), scaling


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
    archs = hf.get("architectures") or []
    family = by_hf_class(archs[0] if archs else hf.get("model_type", "?"))
    D, H = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    theta, scaling = _rope(hf, family.default_rope_theta)
    eos = hf.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    bos = hf.get("bos_token_id")
    kw = dict(arch=family.arch, vocab_size=_get(hf, "vocab_size"), hidden_size=D,
              num_layers=_get(hf, "num_hidden_layers"), num_heads=H,
              num_kv_heads=hf.get("num_key_value_heads") or H,
              head_dim=hf.get("head_dim") or D // H,
              rms_norm_eps=float(_get(hf, "rms_norm_eps")),
              max_position_embeddings=_get(hf, "max_position_embeddings"),
              rope_theta=theta, rope_scaling=scaling,
              tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
              bos_token_id=-1 if bos is None else int(bos), eos_token_ids=tuple(eos), dtype=dtype)
    return checked_config(family.hf_config(hf, kw), "config.json")


def checked_config(kw: dict, where: str) -> ModelConfig:
    try:
        cfg = ModelConfig(**kw)
        cfg.check()
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None
    return cfg


# ---------------------------------------------------------------------------- tensor sources

def _hf_names(cfg: ModelConfig, name: str, hf: dict | None = None):
    """Our tensor name -> where it comes from: ('plain', candidate hf names...),
    ('experts', [per-expert hf names, per naming scheme], [fused hf names], part) where
    part selects the gate (0) or up (1) half of a fused gate_up_proj tensor, or a family's
    ('derived', [(hf name, shape)], fn): fn(the whole source matrices as f32) -> our tensor."""
    family = BY_ARCH[cfg.arch]
    layer, key = name.split(".", 2)[1:] if name.startswith("blk.") else (None, name)
    p = "" if layer is None else f"model.layers.{layer}."
    own = family.hf_tensor(hf or {}, cfg, key, p) if family.hf_tensor else None
    if own is not None:
        return own
    if name == "token_embd":
        return ("plain", "model.embed_tokens.weight")
    if name == "output_norm":
        return ("plain", "model.norm.weight")
    if name == "output":
        return ("plain", "lm_head.weight")
    if key in HF_LAYER_NAMES:
        return ("plain", p + HF_LAYER_NAMES[key])
    moes = family.hf_moe_prefixes
    if key == "ffn_gate_inp":
        return ("plain", *[p + m + "gate.weight" for m in moes])
    legacy = family.hf_expert_names
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
        t = _mxfp4_source(tensors, hf_name)
    if t is None:
        raise ConvertError(f"checkpoint: tensor {hf_name!r} (for {name}) is missing")
    if t.dtype not in _ST_DTYPES and t.dtype != "MXFP4":
        raise ConvertError(f"checkpoint: tensor {hf_name!r} has dtype {t.dtype}; supported: F32, F16, BF16, "
                           "F8_E4M3 with block scales (weight_scale_inv) and MXFP4 blocks with their scales")
    if t.dtype == "F8_E4M3":
        sc = tensors.get(hf_name + "_scale_inv")
        if sc is None or sc.dtype not in ("F32", "BF16") or len(shape) != 2:
            raise ConvertError(f"checkpoint: FP8 tensor {hf_name!r} needs a 2-D f32/bf16 {hf_name}_scale_inv of "
                               "block scales (the DeepSeek-V3 / Qwen3-FP8 layout); other FP8 schemes are not supported")
    if t.dtype == "MXFP4" and len(shape) != 3:
        raise ConvertError(f"checkpoint: MXFP4 tensor {hf_name!r} where a family does not read one")
    if tuple(t.shape) != tuple(shape):
        raise ConvertError(f"checkpoint: tensor {hf_name!r} has shape {list(t.shape)}, expected {list(shape)} "
                           f"from config.json")
    return t


def _sources(cfg, tensors, name, shape, hf=None):
    """Yield (SourceTensor, 2-D shape, lead index, part) for each piece of our tensor, in file order."""
    recipe = _hf_names(cfg, name, hf)
    if recipe[0] == "derived":
        for hf_name, shape2 in recipe[1]:
            yield _check_src(tensors, hf_name, name, shape2), shape2, 0, None
        return
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
    missing = per_expert[0][0] if per_expert else fused[0]
    raise ConvertError(f"checkpoint: tensor {missing!r} (for {name}) is missing")


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
        from .kquants import SCHEMES
        raise ConvertError(f"--quantize {quantize!r} / head {head!r}: choose one of {', '.join(QUANTS)} (and for a GGUF "
                           f"auto or blocks; for a checkpoint one of llama.cpp's file types {', '.join(SCHEMES)})")
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
    """Row blocks of one source matrix -> (values, scales, source f32 rows) per block of a multiple
    of G rows."""
    from .kernels.packing import quantize
    pending = []
    have = 0
    for b in blocks:
        pending.append(_to_f32(b, src_dtype))
        have += b.shape[0]
        if have >= G:
            a = np.concatenate(pending) if len(pending) > 1 else pending[0]
            cut = have // G * G
            yield (*quantize(kind, a[:cut], G), a[:cut])
            pending, have = ([a[cut:]], have - cut) if have > cut else ([], 0)
    if have:
        raise ConvertError(f"rows not a multiple of the quantization group {G}")


def convert(hf_dir, out_path, dtype: str = "f16", *, name=None, license=None, require_tokenizer=True,
            progress=True, quantize: str = "none", quantize_head: str | None = None,
            quant_group: int | None = None, layout: str | None = None, errors: dict | None = None) -> ModelConfig:
    """HF checkpoint -> .colibri. quantize (none|q8|q4) stores the attention projections, the
    experts and the output head group-quantized (quant.py); the rest stays `dtype`. layout
    (rows|panels; default: panels for f16, rows otherwise) is how the f16/bf16 matrices are
    stored (panels.py). `errors`, when given and the checkpoint holds MXFP4 tensors (which are always
    re-encoded), receives each tensor's relative RMS error against the checkpoint's values."""
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
    from .kquants import SCHEMES, scheme_kinds
    if quantize in SCHEMES:         # llama.cpp's block kinds, each matrix's as llama-quantize picks it (kquants.py)
        if quantize_head is not None or quant_group is not None:
            raise ConvertError(f"--quantize {quantize} picks every matrix's block kind itself: "
                               "drop --quantize-head / --quant-group")
        cfg = config_from_hf(hf, dtype)
        cfg = replace(cfg, block_types=scheme_kinds(cfg, quantize), layout=default_layout(dtype, layout))
        cfg.check()
    else:
        cfg = replace(quant_config(config_from_hf(hf, dtype), quantize, quantize_head, quant_group),
                      layout=default_layout(dtype, layout))
    tensors = index_checkpoint(hf_dir)
    if quantize == "none":              # MXFP4 experts kept as they are (mxfp4.py), not widened to --dtype
        from .mxfp4 import keeps
        cfg = replace(cfg, block_types={n: "mxfp4" for n, s, _ in expected_tensors(cfg)
                                        if n.startswith("blk.") and keeps(_hf_names(cfg, n, hf), tensors, s)})
        cfg.check()
    tok, template = _tokenizer_blobs(hf_dir, require_tokenizer)
    plan = [(n, s, dts[0]) for n, s, dts in expected_tensors(cfg)]
    # resolve every source before writing a byte: a missing tensor fails fast
    for n, s, _ in plan:
        if not n.endswith(".s"):
            for _ in _sources(cfg, tensors, n, s, hf):
                pass
    metadata = {"name": name or os.path.basename(os.path.abspath(hf_dir)), "license": license or hf.get("license", ""),
                "source": os.path.abspath(hf_dir), "source_architecture": hf["architectures"][0],
                "converter": CONVERTER_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "transformers_version": hf.get("transformers_version", "")}

    family = BY_ARCH[cfg.arch]
    folds = family.hf_folds(hf, cfg) if family.hf_folds else {}

    def pieces(n, s):
        key = n.split(".", 2)[-1]
        recipe = _hf_names(cfg, n, hf)
        if cfg.block_types.get(n) == "mxfp4":
            from .mxfp4 import kept_pieces
            yield from kept_pieces(recipe, tensors, s)
            return
        if recipe[0] == "derived":      # a family's reshaping of whole source matrices (families/deepseek.py)
            srcs = list(_sources(cfg, tensors, n, s, hf))
            if recipe[3:] == ("per_matrix",):   # a stack, one matrix of each source at a time (gpt_oss.py)
                for e in range(s[0]):
                    m = recipe[2](*(_whole_matrix(tensors, src, shape2[1:], hf, e) for src, shape2, _, _ in srcs))
                    if tuple(m.shape) != tuple(s[1:]):
                        raise ConvertError(f"{n}: the family's recipe gave shape {list(m.shape)}, expected {list(s[1:])}")
                    yield "F32", iter([m])
                return
            a = recipe[2](*(_whole_matrix(tensors, src, shape2, hf) for src, shape2, _, _ in srcs))
            if tuple(a.shape) != tuple(s):
                raise ConvertError(f"{n}: the family's recipe gave shape {list(a.shape)}, expected {list(s)}")
            for m in (a if a.ndim == 3 else (a,)):          # one matrix of a stack at a time
                yield "F32", iter([m])
            return
        f = np.float32(folds.get(key, 1.0))
        for src, shape2, lead, part in _sources(cfg, tensors, n, s, hf):
            blocks = _blocks(src, n, shape2, lead, part)
            if src.dtype == "F8_E4M3":
                blocks, src = _fp8(tensors, src, blocks, shape2, hf), replace(src, dtype="F32")
            if f != 1:      # a family's scalar folded into the weights (families/granite.py)
                blocks, dtype = (_to_f32(b, src.dtype) * f for b in blocks), "F32"
            else:
                dtype = src.dtype
            yield dtype, partial_rotary_rows(cfg, key, blocks)
    mxfp4 = errors is not None and any(n.endswith("_blocks") and n[:-7] + "_scales" in tensors for n in tensors)
    write_model(out_path, cfg, pieces, metadata=metadata, tokenizer_json=tok, chat_template=template,
                progress=progress, errors=errors if mxfp4 else None)
    return cfg


def _whole_matrix(tensors, src: SourceTensor, shape2, hf: dict, lead: int = 0) -> np.ndarray:
    """One source matrix (number `lead` of a stack), whole, as f32 (FP8 dequantized with its block scales,
    MXFP4 with its scales)."""
    if src.dtype == "MXFP4":
        from .mxfp4 import matrix
        b, sc = tensors[src.name + "_blocks"], tensors[src.name + "_scales"]
        E, rows, G = sc.shape
        flat = replace(b, shape=(E, rows * G, 16))                           # matrix `lead`'s bytes in one read
        return matrix(_read_rows(flat, 0, rows * G, lead).reshape(rows, G, 16), _read_rows(sc, 0, rows, lead))
    blocks, dtype = _blocks(src, src.name, shape2, lead), src.dtype
    if dtype == "F8_E4M3":
        blocks, dtype = _fp8(tensors, src, blocks, shape2, hf), "F32"
    return np.concatenate([_to_f32(b, dtype) for b in blocks]).reshape(shape2)


def _fp8(tensors, src: SourceTensor, blocks, shape2, hf: dict):
    """An FP8 matrix's row blocks, dequantized with its block scales (fp8.py)."""
    from .fp8 import dequantized_blocks
    block = (hf.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size {block!r} must be two positive "
                           "integers (FP8 block scales)")
    sc = tensors[src.name + "_scale_inv"]
    R, C = -(-shape2[0] // block[0]), -(-shape2[1] // block[1])
    if tuple(sc.shape) != (R, C):
        raise ConvertError(f"checkpoint: {src.name}_scale_inv has shape {list(sc.shape)}, expected {[R, C]} for "
                           f"blocks of {list(block)}")
    scale = _to_f32(_read_rows(sc, 0, R), sc.dtype)
    return dequantized_blocks(blocks, scale, block, shape2[1])


ROTARY_KEYS = ("attn_q", "attn_k", "attn_q_b", "attn_k_b", "attn_q_norm", "attn_k_norm")


def partial_rotary_order(cfg: ModelConfig) -> np.ndarray | None:
    """Within a head, the source dim each stored dim comes from when only the first rotary_dim
    dims rotate (GLM-4.5): the rotated halves go to the pairs (i, i + hd/2), i < rotary_dim/2,
    the passed-through dims to the pairs rope.py gives angle 0. q.k is unchanged (the same
    order on both sides); None when every dim rotates."""
    hd, rot = cfg.head_dim, cfg.rotary_dim
    if not rot or rot == hd:
        return None
    half, r2, p2 = hd // 2, rot // 2, (hd - rot) // 2
    first = [k if k < r2 else rot + (k - r2) for k in range(half)]
    second = [r2 + k if k < r2 else rot + p2 + (k - r2) for k in range(half)]
    return np.array(first + second, np.int64)


def partial_rotary_rows(cfg: ModelConfig, key: str, blocks):
    """Row blocks of a q/k tensor (weights, biases, norm gains) in the stored dim order (one
    block: the whole tensor); other tensors' blocks as they come."""
    order = partial_rotary_order(cfg) if key in ROTARY_KEYS else None
    if order is None:
        return blocks
    a = np.concatenate(list(blocks))
    hd = cfg.head_dim
    rows = a.reshape(-1, hd, *a.shape[1:]) if a.shape[0] % hd == 0 and a.shape[0] > 1 else None
    if rows is None:                    # 1-D tensors come as one (1, n) row: permute its columns
        flat = a.reshape(-1, hd)
        return iter([flat[:, order].reshape(a.shape)])
    return iter([rows[:, order].reshape(a.shape)])


def write_model(out_path, cfg: ModelConfig, pieces, *, metadata: dict, tokenizer_json: str, chat_template: str,
                progress: bool = True, errors: dict | None = None) -> None:
    """Write the .colibri file of `cfg`. pieces(name, logical shape) yields, for each matrix of
    that tensor in file order (one per expert of a stack), (source dtype F32|F16|BF16, an
    iterator of its row blocks); every encoding, quantization and layout decision is made here.
    `errors`, when given, receives each tensor's relative RMS error of the stored values
    against the source values (the GGUF importer reports it)."""
    err = _ErrorMeter() if errors is not None else None
    plan = [(n, s, dts[0]) for n, s, dts in expected_tensors(cfg)]
    total = sum(fmt.nbytes(dt, s) for _, s, dt in plan)
    bar = _progress(total, f"convert {os.path.basename(out_path)}", progress)
    with ColibriWriter(out_path, config=cfg.to_dict(), metadata=metadata, tokenizer_json=tokenizer_json,
                       chat_template=chat_template, num_experts=cfg.num_experts, num_layers=cfg.num_layers) as w:
        for n, s, dt in plan:
            w.declare(n, dt, s)
        w.set_routing(routing_records(cfg, w))
        scales = {}     # quantized matrix -> its scale blocks, written right after it
        for n, s, dt in plan:
            if n.endswith(".s"):
                for blk in scales.pop(n[:-2]):
                    w.write(n, blk)
                    bar.update(blk.nbytes)
                continue
            for src_dtype, blocks in pieces(n, s):
                if dt in fmt.BLOCK_DTYPES:       # llama.cpp's blocks: as a GGUF holds them, or quantized here
                    if src_dtype != "BLOCKS":
                        blocks = _block_encoded(blocks, src_dtype, cfg.block_types[n], err, n)
                    for raw in blocks:
                        w.write(n, raw)
                        bar.update(raw.nbytes)
                    continue
                if dt in ("i8", "u4"):
                    kind = "q8" if dt == "i8" else "q4"
                    for q, sc, a in _quantized_blocks(blocks, kind, cfg.quant_group, src_dtype):
                        if err:
                            err.add(n, a, _dequantized(kind, q, sc))
                        w.write(n, q)
                        scales.setdefault(n, []).append(sc)
                        bar.update(q.nbytes)
                    continue
                if dt in fmt.PANEL_DTYPES:       # panels need every row: one matrix of a stack at a time
                    shape2 = s[-2:] if len(s) >= 2 else (1, s[0])
                    if err:
                        blocks = err.tap(n, blocks, src_dtype)
                    out = _panel_matrix(blocks, src_dtype, dt, n, shape2)
                    if err:
                        err.stored(n, _decoded(out, dt))
                    w.write(n, out)
                    bar.update(out.nbytes)
                    continue
                for block in blocks:
                    out = _encode(block, src_dtype, dt, n)
                    if err:
                        err.add(n, _to_f32(block, src_dtype), _decoded(out, dt))
                    w.write(n, out)
                    bar.update(out.nbytes)
    bar.close()
    if err:
        errors.update(err.result())


def as_stored(kind: str, blocks):
    """Row blocks of `kind`'s base blocks (BASE: the GGUF's rows) -> the bytes a file of `kind` holds: for a tiled
    kind the same rows regrouped into whole tiles and interleaved (kernels/blocks.to_x16), else as they come."""
    from .blocks import BASE, KINDS, TILE_ROWS
    if kind not in BASE:
        yield from blocks
        return
    rest = None
    for b in blocks:
        b = np.ascontiguousarray(b).reshape(-1, b.shape[-1])
        rest = b if rest is None or not len(rest) else np.concatenate([rest, b])
        whole = rest.shape[0] // TILE_ROWS * TILE_ROWS
        if whole:
            yield to_x16(rest[:whole], KINDS[kind].size)
            rest = rest[whole:]
    if rest is not None and rest.shape[0]:
        raise ValueError(f"{kind}: {rest.shape[0]} rows left over, not a whole tile of {TILE_ROWS}")


def _block_encoded(blocks, src_dtype: str, kind: str, err, name: str):
    """Row blocks of float values -> their bytes in block kind `kind` (kquants.py)."""
    import gguf

    from .blocks import BASE, KINDS
    from .kquants import quantize
    base = BASE.get(kind, kind)                 # a tiled kind: its base kind's blocks, as_stored's tiles

    def encoded():
        for b in blocks:
            a = _to_f32(b, src_dtype)
            a2 = a.reshape(-1, a.shape[-1])
            raw = quantize(base, a2)
            if err:
                err.add(name, a2, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(KINDS[base].ggml)))
            yield raw.reshape(a.shape[:-1] + (raw.shape[-1],))
    yield from as_stored(kind, encoded())


class _ErrorMeter:
    """Per tensor: sum of squared differences and of squared source values."""

    def __init__(self):
        self.acc, self.pending = {}, {}

    def add(self, name, src, stored):
        d = src.astype(np.float64).ravel() - stored.astype(np.float64).ravel()
        a = self.acc.setdefault(name, [0.0, 0.0])
        a[0] += float(d @ d)
        a[1] += float(np.square(src, dtype=np.float64).sum())

    def tap(self, name, blocks, src_dtype):
        """Pass blocks through, keeping their f32 values until the stored matrix is known."""
        self.pending[name] = []
        for b in blocks:
            self.pending[name].append(_to_f32(b, src_dtype))
            yield b

    def stored(self, name, values):
        self.add(name, np.concatenate(self.pending.pop(name)), values)

    def result(self) -> dict:
        return {n: (float(np.sqrt(e / s)) if s > 0 else float(np.sqrt(e))) for n, (e, s) in self.acc.items()}


def _decoded(stored: np.ndarray, dt: str) -> np.ndarray:
    """Stored values (as written) -> f32, in the logical row order."""
    if dt in fmt.PANEL_DTYPES:
        from .panels import from_panels
        return _decoded(from_panels(stored), fmt.PANEL_DTYPES[dt])
    if dt == "f16":
        return stored.view(np.float16).astype(np.float32)
    if dt == "bf16":
        return (stored.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32, copy=False)


def _dequantized(kind, q, sc):
    from .kernels.packing import dequantize_q4, dequantize_q8
    return (dequantize_q8 if kind == "q8" else dequantize_q4)(q, sc)


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


def routing_records(cfg: ModelConfig, w: ColibriWriter):
    recs = []
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            recs.append((fmt.NO_TENSOR, fmt.NO_TENSOR, 0, 0, 0, fmt.NO_TENSOR))
            continue
        flags = (fmt.ROUTE_SIGMOID if cfg.score_func == "sigmoid" else fmt.ROUTE_SOFTMAX) | \
            (fmt.ROUTE_RENORM if cfg.norm_topk_prob else 0)
        shared = fmt.NO_TENSOR
        if cfg.shared_expert_intermediate_size:
            flags |= fmt.ROUTE_SHARED_EXPERT
            if cfg.shared_expert_gate:
                shared = w.index(f"blk.{i}.ffn_shexp_gate")
        groups = (cfg.n_group, cfg.topk_group) if cfg.n_group > 1 else (0, 0)
        if groups[0]:
            flags |= fmt.ROUTE_GROUP_LIMITED
        bias = w.index(f"blk.{i}.ffn_gate_bias") if cfg.correction_bias else fmt.NO_TENSOR
        if cfg.sparsemixer_eps > 0:         # Phi-MoE
            flags |= fmt.ROUTE_SPARSEMIXER
        if cfg.router_bias:                 # GPT-OSS: the router's own bias, part of its logits
            bias, flags = w.index(f"blk.{i}.ffn_gate_inp_b"), flags | fmt.ROUTE_BIAS_IN_LOGITS
        recs.append((w.index(f"blk.{i}.ffn_gate_inp"), bias, cfg.top_k, cfg.num_experts, flags, shared,
                     *groups, float(np.float32(cfg.routed_scaling_factor))))
    return recs


def _progress(total, desc, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, leave=False)
