"""Tiny Hugging Face reference models for tests (helper module, not a test file).

Builds small random checkpoints of the four supported MoE architectures with
``transformers`` (offline), saves them with ``save_pretrained`` (safetensors) next to
an offline-trained byte-level BPE tokenizer, and exposes reference helpers:

    train_tokenizer(out_dir, vocab_size=512)
    SMALL_CONFIGS                      arch -> config kwargs
    build_hf_model(arch, out_dir, dtype=torch.float32, seed=0, **overrides) -> model
    hf_logits(model, ids) -> np.ndarray [T, V] float32
    hf_greedy(model, ids, n) -> list[int]          (exactly n new tokens, no eos stop)
    hf_greedy_margins(model, ids, n) -> (tokens, top1-top2 margins per step)

Weights are re-initialised with a large std so that logits and router scores are far
from ties (greedy outputs do not hinge on 1e-6 differences).
See docs/notes/hf_semantics.md for the exact HF semantics these models follow.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

__all__ = [
    "ARCHS",
    "SMALL_CONFIGS",
    "CHAT_TEMPLATE",
    "train_tokenizer",
    "build_hf_model",
    "hf_logits",
    "hf_greedy",
    "hf_greedy_margins",
]

# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)

# Stdlib modules present in every CPython >= 3.10; read in this fixed order.
_CORPUS_FILES = [
    "argparse.py", "ast.py", "bisect.py", "calendar.py", "collections/__init__.py",
    "configparser.py", "contextlib.py", "csv.py", "dataclasses.py", "datetime.py",
    "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "inspect.py",
    "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py", "textwrap.py",
    "typing.py",
]
_CORPUS_MAX_BYTES = 400_000
# A little non-ASCII text so some multi-byte merges exist (the byte-level alphabet covers
# every byte anyway, so any UTF-8 round-trips regardless).
_EXTRA_TEXT = (
    "Grüße aus Köln! Ça va très bien, merci. Año nuevo, niño. Ελληνικά κείμενα. "
    "Русский текст для проверки. 日本語のテキスト。中文文本测试。한국어 텍스트. "
    "emoji: 🙂🚀✨ — “quotes” … «guillemets» € £ ¥ ±×÷ ∑ √ ∞\n"
) * 20

_TOKENIZER_CACHE: dict[int, dict[str, bytes]] = {}


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for rel in _CORPUS_FILES:
        p = stdlib / rel
        if not p.is_file():
            continue
        t = p.read_text(encoding="utf-8", errors="replace")
        if total + len(t) > _CORPUS_MAX_BYTES:
            t = t[: max(0, _CORPUS_MAX_BYTES - total)]
        if t:
            texts.append(t)
            total += len(t)
        if total >= _CORPUS_MAX_BYTES:
            break
    texts.append(_EXTRA_TEXT)
    # Split into lines-ish chunks: the trainer only needs an iterator of strings.
    return [chunk for t in texts for chunk in t.splitlines(keepends=True)]


def _train_tokenizer_files(vocab_size: int) -> dict[str, bytes]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok_json = tok.to_str(pretty=True)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer.json": tok_json.encode("utf-8"),
        "tokenizer_config.json": (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    }


def train_tokenizer(out_dir, vocab_size: int = 512) -> None:
    """Train (offline, deterministic) a byte-level BPE tokenizer and write
    ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir``.

    Special tokens: ``<unk>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos). Byte-level pre-tokenizer
    and decoder, no normalizer, no post-processor (nothing is added on encode), so
    ``decode(encode(s)) == s`` for any UTF-8 string. Trained once per process per vocab
    size; later calls copy the cached bytes.
    """
    files = _TOKENIZER_CACHE.get(vocab_size)
    if files is None:
        files = _train_tokenizer_files(vocab_size)
        _TOKENIZER_CACHE[vocab_size] = files
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)


# --------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    hidden_act="silu",
)

SMALL_CONFIGS: dict[str, dict] = {
    # Plain Mixtral: every layer sparse, softmax -> top-2 -> renormalise, rope theta 1e6 (default).
    "mixtral": dict(
        _COMMON,
        model_type="mixtral",
        num_hidden_layers=2,
        intermediate_size=64,  # expert width
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
    # Qwen2-MoE: shared expert + sigmoid shared_expert_gate, qkv bias, norm_topk_prob False,
    # dense layers via decoder_sparse_step=2 (layers 0 and 2 dense, 1 and 3 sparse).
    "qwen2_moe": dict(
        _COMMON,
        model_type="qwen2_moe",
        num_hidden_layers=4,
        intermediate_size=128,  # dense-MLP width (dense layers)
        moe_intermediate_size=32,  # expert width
        shared_expert_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        qkv_bias=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Qwen3-MoE: per-head q/k RMSNorm, head_dim 24 != 64/4, norm_topk_prob True, dense layer 1
    # via mlp_only_layers, YaRN rope (attention_factor = 0.1*ln(4)+1), tied embeddings.
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        num_hidden_layers=3,
        head_dim=24,
        intermediate_size=96,  # dense-MLP width (layer 1)
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        attention_bias=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # OLMoE: q/k RMSNorm over the whole projection, clip_qkv (clips a fair fraction of
    # entries with the re-init below), norm_topk_prob False, linear rope scaling.
    "olmoe": dict(
        _COMMON,
        model_type="olmoe",
        num_hidden_layers=2,
        intermediate_size=32,  # expert width
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        clip_qkv=2.0,
        attention_bias=False,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
}
ARCHS = tuple(SMALL_CONFIGS)

# Dense families (issue 17: the degenerate case, every layer a dense MLP). Kept out of ARCHS: the MoE
# parametrizations stay as they are; tests/test_families.py runs these.
DENSE_CONFIGS: dict[str, dict] = {
    # Llama: llama3 rope scaling, untied head, no biases.
    "llama": dict(_COMMON, model_type="llama", num_hidden_layers=2, intermediate_size=96, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2": dict(_COMMON, model_type="qwen2", num_hidden_layers=2, intermediate_size=96, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Qwen3: per-head q/k RMSNorm, head_dim 24 != 64/4.
    "qwen3": dict(_COMMON, model_type="qwen3", num_hidden_layers=2, intermediate_size=96, head_dim=24,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

# Further families (issue 17), each with its own test file; kept out of ARCHS like the dense ones.
FAMILY_CONFIGS: dict[str, dict] = {
    # Granite-MoE: every multiplier away from 1 (folded into the weights by the converter), tied
    # embeddings (untied by the converter: the head has its own scale), top-k-then-softmax routing.
    "granitemoe": dict(_COMMON, model_type="granitemoe", num_hidden_layers=2, intermediate_size=32,
                       num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       attention_bias=False, embedding_multiplier=12.0, attention_multiplier=0.09,
                       residual_multiplier=0.22, logits_scaling=0.5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # GLM-4.5: sigmoid routing with a correction bias (re-initialised non-zero below), 4 groups of 2
    # experts of which 2 are kept (the limit changes choices), routed scale 2.5, an ungated shared
    # expert, layer 0 dense, partial rotary (8 of 16 dims), per-head q/k norm, q/k/v biases.
    "glm4_moe": dict(_COMMON, model_type="glm4_moe", num_hidden_layers=3, head_dim=16, intermediate_size=96,
                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                     use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     num_mtp_layers=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # DeepSeek-V2 (V2-Lite's shape): latent attention without a query rank (q_proj), odd head parts
    # (nope 12, rope 8, value 10, latent 24), interleaved rotary dims, softmax group-limited greedy routing
    # (4 groups of 2, 1 kept: a group scores its best expert, so with 2 kept the best 2 experts always pass and
    # the limit would never matter) with routed scale 1.5 and no renormalisation, an ungated shared expert,
    # layer 0 dense, yarn rope with mscale / mscale_all_dim (the softmax scale's factor).
    "deepseek_v2": dict(_COMMON, model_type="deepseek_v2", num_hidden_layers=3, num_key_value_heads=4,
                        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                        topk_group=1, routed_scaling_factor=1.5, kv_lora_rank=24, q_lora_rank=None,
                        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rms_norm_eps=1e-6,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V3 (Moonlight / Kimi-K2's class): a query rank (q_a_proj, q_a_layernorm, q_b_proj), sigmoid
    # routing with a correction bias, 4 groups (2 kept), renormalised, routed scale 2.5, 2 shared experts,
    # layer 0 dense, yarn with mscale_all_dim only (the rope tables' factor 1, the softmax scale's not).
    "deepseek_v3": dict(_COMMON, model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4,
                        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # GPT-OSS: sinks (re-initialised non-zero below), sliding (window 8, shorter than the prompts) and full
    # layers alternating, biases everywhere, the router's bias, the clamped SwiGLU (limit 1.5: the
    # re-initialised projections cross it often), yarn without truncation, head_dim 16 != 64/4.
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", num_hidden_layers=3, head_dim=16, intermediate_size=32,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    swiglu_limit=1.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
    # Phi-3.5-MoE: LayerNorm with biases, the head's bias, sparsemixer routing (jitter eps 0.3: several experts
    # within the band, so the masks matter), q/k/v/o biases, longrope (short/long factors, mscales; the context
    # of 64 is its original length: the short factors, as transformers takes them).
    "phimoe": dict(_COMMON, model_type="phimoe", num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                   num_experts_per_tok=2, router_jitter_noise=0.3, attention_bias=True, lm_head_bias=True,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
                                    "short_mscale": 1.1, "long_mscale": 1.3, "original_max_position_embeddings": 64}),
}

# Re-initialisation std (see _reinit_weights).
INIT_STD = 0.25
LM_HEAD_STD = 0.3  # lm_head (and the embedding when tied): wider => clear top1-top2 margins
ROUTER_STD = 0.2  # router gates / shared_expert_gate: clear top-k gaps without saturating softmax
OUT_STD = 0.35  # o_proj / down_proj (matrices writing into the residual stream)
NORM_NOISE = 0.1
BIAS_STD = 0.05


def _make_config(arch: str, **overrides):
    from transformers import AutoConfig

    configs = {**SMALL_CONFIGS, **DENSE_CONFIGS, **FAMILY_CONFIGS}
    if arch not in configs:
        raise KeyError(f"unknown arch {arch!r}; expected one of {tuple(configs)}")
    kw = dict(configs[arch])
    kw.update(overrides)
    model_type = kw.pop("model_type")
    if "rope_parameters" in kw and kw["rope_parameters"] is not None:
        kw["rope_parameters"] = dict(kw["rope_parameters"])  # config mutates it
    if "mlp_only_layers" in kw and kw["mlp_only_layers"] is not None:
        kw["mlp_only_layers"] = list(kw["mlp_only_layers"])
    return AutoConfig.for_model(model_type, **kw)


@torch.no_grad()
def _reinit_weights(model, gen: torch.Generator) -> None:
    """Large-std re-init: every matrix (Linear, Embedding, fused 3-D experts) ~ N(0, INIT_STD),
    lm_head / embedding-if-tied ~ N(0, LM_HEAD_STD), routers ~ N(0, ROUTER_STD), norm gains ~ 1 + N(0, NORM_NOISE),
    biases ~ N(0, BIAS_STD). Draws in named_parameters() order from ``gen``."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, p in model.named_parameters():
        shape, dt = p.shape, p.dtype
        if name.endswith("norm.weight"):  # input/post_attention/final norm, q_norm, k_norm
            v = 1.0 + NORM_NOISE * torch.randn(shape, generator=gen)
        elif name.endswith("self_attn.sinks"):  # GPT-OSS: as large as the scores, so each sink matters
            v = 2.0 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            v = BIAS_STD * torch.randn(shape, generator=gen)
        elif name == "lm_head.weight" or (tied and name.endswith("embed_tokens.weight")):
            v = LM_HEAD_STD * torch.randn(shape, generator=gen)
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "router.weight")):
            v = ROUTER_STD * torch.randn(shape, generator=gen)
        elif name.endswith("o_proj.weight") or "down_proj" in name:
            v = OUT_STD * torch.randn(shape, generator=gen)
        else:
            v = INIT_STD * torch.randn(shape, generator=gen)
        p.copy_(v.to(dt))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):       # DeepSeek-V3 / GLM-4.5: zero at init
            b.copy_(ROUTER_STD * torch.randn(b.shape, generator=gen))


def build_hf_model(arch: str, out_dir, *, dtype=torch.float32, seed: int = 0, **overrides):
    """Build a tiny random ``arch`` model, save it (safetensors, ``dtype``) plus tokenizer files
    into ``out_dir`` and return it in eval mode as float32.

    If ``dtype`` is lower precision (bf16/fp16) the returned float32 model holds exactly the
    rounded values that were written to disk, so it is the right reference for the checkpoint.
    ``overrides`` are merged into ``SMALL_CONFIGS[arch]`` (e.g. ``num_hidden_layers=3``,
    ``sliding_window=16``, ``tie_word_embeddings=True``).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _make_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    _reinit_weights(model, gen)
    model.eval()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype != torch.float32:
        # model.to(dtype) would also round the float buffers (rotary inv_freq), which a fresh
        # from_pretrained recomputes in float32 -> keep them and restore after the round trip.
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        model.to(dtype)
        model.save_pretrained(out, safe_serialization=True)
        model.to(torch.float32)  # exact: lower-precision values are representable in fp32
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
    else:
        model.save_pretrained(out, safe_serialization=True)
    model.config.dtype = torch.float32
    train_tokenizer(out, vocab_size=512)
    return model


# --------------------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------------------


def _as_ids(ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        t = ids.to(torch.long)
    else:
        t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if t.dim() == 1:
        t = t.unsqueeze(0)
    assert t.dim() == 2 and t.shape[0] == 1, "single sequence expected"
    return t


@torch.no_grad()
def hf_logits(model, ids) -> np.ndarray:
    """Full-sequence forward (no cache): logits [T, V] as float32 numpy."""
    t = _as_ids(ids)
    out = model(input_ids=t, use_cache=False)
    return out.logits[0].to(torch.float32).cpu().numpy()


@torch.no_grad()
def hf_greedy_margins(model, ids, n: int) -> tuple[list[int], list[float]]:
    """Greedy-decode exactly ``n`` new tokens with ``model.generate`` (KV cache, eos ignored).
    Returns (new token ids, top1 - top2 logit margin at each step)."""
    t = _as_ids(ids)
    if n <= 0:
        return [], []
    out = model.generate(
        input_ids=t,
        attention_mask=torch.ones_like(t),
        max_new_tokens=n,
        min_new_tokens=None,  # would suppress eos logits -> not pure argmax
        do_sample=False,
        num_beams=1,
        eos_token_id=None,  # kwarg None disables the eos stop (GenerationConfig(eos=None) does not)
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, t.shape[1]:].tolist()
    assert len(new) == n, (len(new), n)
    margins = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return new, margins


def hf_greedy(model, ids, n: int) -> list[int]:
    """Exactly ``n`` greedily generated token ids (prompt excluded); does not stop at eos."""
    return hf_greedy_margins(model, ids, n)[0]


# --------------------------------------------------------------------------------------
# Self-check (python tests/hf_models.py): build, save, reload, compare; report margins.
# --------------------------------------------------------------------------------------


def engine_tokens(model, jobs, **engine_kw) -> list[list[int]]:
    """The greedy tokens of each (prompt, max_tokens) job, all stepped together by one BatchEngine of
    `model` (f32 KV pool unless told otherwise): the serving path, sequences joining at different steps."""
    from colibri_server.model.serving import BatchEngine
    eng = BatchEngine(model, **{"max_seqs": len(jobs), "max_batch_tokens": 16, "kv_dtype": "f32", **engine_kw})
    out = {}
    for i, (prompt, n) in enumerate(jobs):
        eng.add(i, prompt, max_tokens=n, ignore_eos=True)
    while eng.has_work():
        for rid, ev in eng.step():
            if ev.token_id is not None:
                out.setdefault(rid, []).append(ev.token_id)
    return [out.get(i, []) for i in range(len(jobs))]


def _self_check() -> None:  # pragma: no cover - manual tool
    import time

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root = Path(tempfile.mkdtemp(prefix="hf_models_"))
    try:
        t0 = time.perf_counter()
        train_tokenizer(root / "tok")
        print(f"tokenizer trained in {time.perf_counter() - t0:.2f}s")
        prompt = [1, 40, 300, 7, 99, 12]
        for arch in ARCHS:
            t0 = time.perf_counter()
            d = root / arch
            m = build_hf_model(arch, d)
            dt = time.perf_counter() - t0
            m2 = AutoModelForCausalLM.from_pretrained(d).eval()
            a, b = hf_logits(m, prompt), hf_logits(m2, prompt)
            toks, margins = hf_greedy_margins(m, prompt, 32)
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                nkeys = len(list(f.keys()))
            print(
                f"{arch:10s} build {dt:.2f}s  keys={nkeys}  reload max|dlogit|={np.abs(a - b).max():.3g}  "
                f"greedy min margin={min(margins):.4f} median={np.median(margins):.3f}  tokens={toks[:12]}..."
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    _self_check()
