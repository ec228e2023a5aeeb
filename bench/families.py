"""Decode and prefill of the newer families against llama.cpp on the same weights, in ONE run.

    python bench/families.py [--data DIR] [--threads 1 2] [--models deepseek gpt-oss] [--reps 3]

Models (random init under torch.manual_seed(0), built with transformers into --data once), each the
size of bench-mixtral's class (~0.5 B weights, f16):
  bench-deepseek  DeepseekV3ForCausalLM: hidden 1024, 8 layers, 16 heads, latent attention (kv_lora_rank 256,
                  q_lora_rank 384, nope 64, rope 32, v 64), 16 experts top-4 of 512 plus 2 shared, sigmoid routing
                  in 4 groups (2 kept), layer 0 dense (2816), vocab 32000
  bench-gpt-oss   GptOssForCausalLM: hidden 1024, 8 layers, 16 heads / 4 kv heads of 64, 16 experts top-4 of 1024,
                  sinks, sliding window 128 on every other layer, biases, vocab 32000
Both are converted to .colibri with the converter's defaults for f16 (panels), and to GGUF F16 by llama.cpp's
own convert_hf_to_gguf.py (tools/hf_to_gguf.py). llama.cpp is measured with its llama-bench binary
(-p 128 -n 128, flash attention auto and off, the faster of the two;
--llama-no-repack adds --repack 0, which the AMX Xeon VM needs), colibri in a subprocess per run: prefill of a 128-token prompt,
then 128 greedy decode steps (Model.prefill / Model.decode, the path a worker's single sequence takes), warm-up
then the median of --reps. Systems take turns, never two at once.

Needs: llama.cpp's source (LLAMA_CPP_SRC, default bench/.anchors/llama.cpp) and its llama-bench built with
-DGGML_NATIVE=ON (LLAMA_BIN, default bench/.anchors/bin): bench/build_anchors.sh makes both; the test
extra (torch, transformers). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

import llama_bench  # noqa: E402  (bench/, on the path above)

PROMPT_LEN, NEW_TOKENS, VOCAB = 128, 128, 32000
COMMON = dict(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, max_position_embeddings=4096,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MODELS = {
    "deepseek": ("deepseek_v3", dict(COMMON, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64,
                                     qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=512, n_shared_experts=2, first_k_dense_replace=1,
                                     intermediate_size=2816, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                     norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt-oss": ("gpt_oss", dict(COMMON, num_key_value_heads=4, head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                                intermediate_size=1024, sliding_window=128, attention_bias=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
}


def prompt_ids():
    return [int(t) for t in np.random.default_rng(1234).integers(3, 500, PROMPT_LEN)]


def build(data: pathlib.Path, name: str):
    """(.colibri f16, GGUF F16) of bench-<name>, built once."""
    model_type, kw = MODELS[name]
    d = data / f"bench-{name}"
    col, gg = data / f"bench-{name}-f16.colibri", data / f"bench-{name}-F16.gguf"
    if not (d / "config.json").exists():
        import hf_models
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        print(f"building bench-{name} with transformers (torch.manual_seed(0)) ...", flush=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32).eval()
        model.to(torch.bfloat16).save_pretrained(str(d), safe_serialization=True)
        hf_models.train_tokenizer(d, vocab_size=512)
        if model_type == "deepseek_v3":        # as the released V3's config.json says it (llama.cpp reads it)
            c = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**c, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}))
    if not col.exists():
        from colibri_server.model.convert import convert
        convert(str(d), str(col), "f16", progress=False)
    if not gg.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "hf_to_gguf.py"), str(d), "--outtype", "f16",
                        "--outfile", str(gg)], check=True, capture_output=True)
    return col, gg


def worker_colibri(path: str, threads: int, reps: int) -> dict:
    from decode import colibri_timers

    from colibri_server.model import Model
    m = Model.open(path, threads=threads, populate=True)
    prefill, decode = colibri_timers(m, np.asarray(prompt_ids(), np.int64), NEW_TOKENS)
    prefill()
    decode()                                             # warm-up (compiles, faults pages in)
    pf = [prefill() for _ in range(reps)]
    dc = [decode() for _ in range(reps)]
    return {"prefill_tok_s": PROMPT_LEN / statistics.median(pf), "decode_tok_s": NEW_TOKENS / statistics.median(dc)}


def run_colibri(path, threads, reps) -> dict:
    r = subprocess.run([sys.executable, __file__, "--worker", str(path), "--threads", str(threads), "--reps", str(reps)],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"colibri worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(data: pathlib.Path, names, threads, reps, no_repack=False) -> list:
    """Each bench model (built once into data) at each thread count: colibri, then llama-bench; prints a line per
    row and returns the rows (bench/decode.py runs this after bench-mixtral)."""
    data.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        col, gg = build(data, name)
        for t in threads:
            c = run_colibri(col, t, reps)
            ll = llama_bench.run(gg, t, reps, PROMPT_LEN, NEW_TOKENS, no_repack)
            rows.append({"model": f"bench-{name}", "threads": t, "colibri": c, "llama.cpp": ll})
            print(f"bench-{name} f16 {t}T: decode colibri {c['decode_tok_s']:.1f} tok/s, llama.cpp "
                  f"{ll['decode_tok_s']:.1f} ({c['decode_tok_s'] / ll['decode_tok_s']:.2f}x); prefill colibri "
                  f"{c['prefill_tok_s']:.0f}, llama.cpp {ll['prefill_tok_s']:.0f} "
                  f"({c['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama-bench --repack 0 (its CPU extra buffers fail an assertion on the AMX Xeon VM)")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker_colibri(a.worker, a.threads[0], a.reps)))
        return
    try:
        rows = measure(pathlib.Path(a.data), a.models, a.threads, a.reps, a.llama_no_repack)
    except RuntimeError as e:
        raise SystemExit(str(e))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
