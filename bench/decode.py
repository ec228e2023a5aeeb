"""Decode and prefill speed of colibri against llama.cpp (and transformers at bf16), in ONE run.

    python bench/decode.py [--data DIR] [--threads 1 2] [--precisions f16 q8 q4 bf16]
                           [--reps 3] [--rounds 1] [--no-hf] [--no-quality] [--json OUT]

Model: bench-mixtral (MixtralConfig hidden 1024, intermediate 2048, 8 experts, top-2, 8
layers, 16 heads / 4 kv heads, vocab 32000, rope_theta 1e6; random init under
torch.manual_seed(0): the anchors' weights), built once with transformers into --data and
converted there: .colibri files at f32 (the quality reference), f16, bf16, q8 and q4, and
GGUF files written here with the `gguf` package (arch "llama" with stacked expert tensors,
q/k rows permuted as llama.cpp's converter does), quantized to Q8_0 / Q4_0 (mixed: llama.cpp's
default, output in Q6_K, attn_k/v in Q8_0) / Q4_0 pure with llama-cpp-python's
llama_model_quantize.

Speed: batch 1, a 128-token prompt (prefill tok/s) then 128 greedy tokens (decode tok/s);
every (system, precision, threads) runs in its own subprocess, one after the other (never
two at once), warm-up then the median of --reps; with --rounds R the systems of one
(precision, threads) group take turns R times (A B A B ...) and the median covers all samples,
so a drift of the machine during the group falls on every system alike. Bandwidth: Numba read
kernels, 1 and 2 threads, measured at the start and at the end of the run (median of both), over a
1 GiB array and over a populated MAP_SHARED mapping of the f16 .colibri file (the page cache's
folios, 2 MiB ones PMD-mapped: `file_huge_mib` in the JSON, and each colibri row's `huge_mib`; the
memory both colibri and llama.cpp decode from), each read as one stream and as 4
streams (blocks of 4 MiB, 4 streams 1 MiB apart, step by step: on a Zen 3 VM one stream read
16.5 GB/s and 4 streams 21.3 on the array, 16.7 and 19.8 on the file); the limit is the fastest of the
four. "% roofline" = decode tok/s / (limit / weight bytes read per decoded token); "% roofline, per
round": the bandwidth is also measured before and after every round of a group, and each round's
decode is divided by its own round's limit, the mean of the two (median over the rounds, and their range): this VM's
bandwidth drifts by a quarter within minutes, so a figure from the start and end of a 20-minute run
can miss the moment of the runs. "% of 1-stream read" divides by the one-stream array read instead (this table's roofline before the 4-stream
reads were measured). The array gets transparent huge pages where the kernel's THP mode is
"always" (recorded in the JSON's cpu).

Quality: logits of every position of one 128-token prompt against the colibri f32 model:
mean and max per-position KL(ref || test), max relative logit error (max |l - ref| /
max |ref|), argmax agreement; the same for llama.cpp's F16 / Q8_0 / Q4_0 files.

llama.cpp's speed is its own llama-bench binary's (bench/llama_bench.py: flash attention auto and off, the
faster), its Q8_0/Q4_0 files are llama-quantize's: both built from the pinned source with -DGGML_NATIVE=ON
(LLAMA_BIN; bench/README.md). Its quality logits go through llama-cpp-python when it is installed (the
`bench` extra), else those rows say so. After bench-mixtral, --families (default: deepseek gpt-oss) runs
bench/families.py's DeepSeek-style and GPT-OSS-style bench models at f16 the same way. Needs gguf, torch,
transformers, safetensors. Not part of the test suite; see bench/README.md.
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
sys.path.insert(0, str(HERE))

import llama_bench  # noqa: E402  (bench/, on the path above)

PROMPT_LEN, NEW_TOKENS, VOCAB = 128, 128, 32000
BENCH_MIXTRAL = dict(hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
COLIBRI = {"f32": dict(dtype="f32"), "f16": dict(dtype="f16"), "bf16": dict(dtype="bf16"),
           "q8": dict(dtype="f16", quantize="q8"), "q4": dict(dtype="f16", quantize="q4")}
# colibri precision -> the llama.cpp files it is compared with (first = the speed target)
LLAMA = {"f16": ["F16"], "q8": ["Q8_0"], "q4": ["Q4_0", "Q4_0-pure"], "bf16": [], "f32": ["F32"]}


def prompt_ids():
    return [int(t) for t in np.random.default_rng(1234).integers(3, VOCAB, PROMPT_LEN)]


# ---------------------------------------------------------------------------- building

def build_hf(data: pathlib.Path) -> pathlib.Path:
    d = data / "bench-mixtral-f32"
    if (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists():
        return d
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    print("building bench-mixtral with transformers (torch.manual_seed(0)) ...", flush=True)
    cfg = MixtralConfig(**BENCH_MIXTRAL)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    model.to(torch.float32).save_pretrained(str(d), safe_serialization=True)
    return d


def build_colibri(data, hf_dir, precisions):
    from colibri_server.model.convert import CONVERTER_VERSION, convert
    out = {}
    for p in sorted(set(precisions) | {"f32"}):
        path = data / f"bench-mixtral-{p}.colibri"
        if not path.exists() or converter_of(path) != CONVERTER_VERSION:   # older converters: other layouts
            t0 = time.time()
            convert(hf_dir, path, require_tokenizer=False, progress=False, **COLIBRI[p])
            print(f"converted {path.name} in {time.time() - t0:.0f}s", flush=True)
        out[p] = path
    return out


def converter_of(path) -> str:
    """The converter that wrote the .colibri file at path, "" when this tree cannot read it (a newer tree wrote a
    kind this one does not know): either way a caller that wants its own CONVERTER_VERSION converts it again."""
    from colibri_server.model import format as fmt
    try:
        cf = fmt.ColibriFile.open(path)
    except fmt.ColibriFormatError:
        return ""
    try:
        return json.loads(cf.metadata_json or "{}").get("converter", "")
    finally:
        cf.close()


def _permute(w, n_head):
    # HF rotate-half q/k rows -> GGML's interleaved rope order (llama.cpp's converter)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, path, ftype):
    """HF Mixtral safetensors -> GGUF arch llama (F32 or F16 matrices; norms and router F32)."""
    import gguf
    from safetensors.numpy import load_file
    c = BENCH_MIXTRAL
    st = {}
    for f in sorted(pathlib.Path(hf_dir).glob("*.safetensors")):
        st.update(load_file(str(f)))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if ftype == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    # a synthetic SentencePiece-style vocabulary: the benchmark feeds token ids only
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"\u2581t{i}" for i in range(VOCAB - len(toks))]
    types = [2, 3, 3] + [6] * 256 + [1] * (VOCAB - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(VOCAB - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    H, Hkv, E = c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"]

    def mat(a):
        return a.astype(np.float32 if ftype == "F32" else np.float16)
    w.add_tensor("token_embd.weight", mat(st["model.embed_tokens.weight"]))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", st[p + "input_layernorm.weight"].astype(np.float32))
        w.add_tensor(b + "attn_q.weight", mat(_permute(st[p + "self_attn.q_proj.weight"], H)))
        w.add_tensor(b + "attn_k.weight", mat(_permute(st[p + "self_attn.k_proj.weight"], Hkv)))
        w.add_tensor(b + "attn_v.weight", mat(st[p + "self_attn.v_proj.weight"]))
        w.add_tensor(b + "attn_output.weight", mat(st[p + "self_attn.o_proj.weight"]))
        w.add_tensor(b + "ffn_norm.weight", st[p + "post_attention_layernorm.weight"].astype(np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", st[p + "block_sparse_moe.gate.weight"].astype(np.float32))
        for ours, hf in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            w.add_tensor(b + ours + ".weight", mat(np.stack(
                [st[f"{p}block_sparse_moe.experts.{e}.{hf}.weight"] for e in range(E)])))
    w.add_tensor("output_norm.weight", st["model.norm.weight"].astype(np.float32))
    w.add_tensor("output.weight", mat(st["lm_head.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_gguf(data, hf_dir, names):
    out = {}
    for name in ["F32", "F16"] + [n for n in names if n not in ("F32", "F16")]:
        path = data / f"bench-mixtral-{name}.gguf"
        out[name] = path
        if path.exists():
            continue
        t0 = time.time()
        if name in ("F32", "F16"):
            write_gguf(hf_dir, path, name)
        else:                                  # llama.cpp's own llama-quantize (its default mix unless -pure)
            llama_bench.quantize(data / "bench-mixtral-F32.gguf", path, name.split("-")[0], pure=name.endswith("-pure"))
        print(f"wrote {path.name} in {time.time() - t0:.0f}s", flush=True)
    return out


# ---------------------------------------------------------------------------- bytes per token

def colibri_bytes_per_token(path):
    from colibri_server.model import format as fmt
    cf = fmt.ColibriFile.open(path)
    E, A = cf.header["num_experts"], 2
    tot = 0.0
    for r in cf.record_list:
        if r.name == "token_embd":
            tot += r.size / r.shape[0]
        elif "_exps" in r.name:
            tot += r.size * A / E
        else:
            tot += r.size
    cf.close()
    return tot


def gguf_bytes_per_token(path):
    import gguf
    r = gguf.GGUFReader(str(path))
    tot = 0.0
    for t in r.tensors:
        nb = int(t.n_bytes)
        if t.name == "token_embd.weight":
            nb /= VOCAB
        elif "_exps." in t.name:
            nb = nb * 2 / 8
        tot += nb
    return tot


# ---------------------------------------------------------------------------- workers (subprocesses)

def _timed_runs(prefill, decode, reps):
    prefill()
    decode()                                             # warm-up (compiles, faults pages in)
    pf = [prefill() for _ in range(reps)]
    dc = [decode() for _ in range(reps)]
    return dict(prefill_s=pf, decode_s=dc, prefill_tok_s=PROMPT_LEN / statistics.median(pf),
                decode_tok_s=NEW_TOKENS / statistics.median(dc))


def colibri_timers(m, ids, new_tokens):
    """(prefill, decode): seconds of one prefill of ids, and of new_tokens greedy decode steps after it
    (Model.prefill / Model.decode with argmax_only, as a worker's single greedy sequence takes them)."""
    cache = m.new_cache(len(ids) + new_tokens + 8)

    def prefill():
        cache.reset()
        t = time.perf_counter()
        m.prefill(cache, ids)
        return time.perf_counter() - t

    def decode():
        cache.reset()
        tok = int(np.argmax(m.prefill(cache, ids, argmax_only=True)[0]))
        t = time.perf_counter()
        for _ in range(new_tokens):
            tok = int(np.argmax(m.decode(cache, tok, argmax_only=True)[0]))
        return time.perf_counter() - t
    return prefill, decode


def worker_colibri(a, prefill_bf16=False):
    from colibri_server.model import Model
    m = Model.open(a.path, threads=a.threads, populate=True, prefill_bf16=prefill_bf16)
    ids = np.asarray(prompt_ids(), np.int64)
    if a.logits:
        np.save(a.logits, m.logits(ids))                       # prefill: dequantized tiles + BLAS
        c = m.new_cache(PROMPT_LEN)
        dec = np.stack([m.decode(c, int(t))[0].copy() for t in ids])    # the decode kernels, token by token
        np.save(str(a.logits).replace(".npy", "-decode.npy"), dec)
        return {}
    prefill, decode = colibri_timers(m, ids, NEW_TOKENS)
    huge = m.file.huge_bytes
    return {**_timed_runs(prefill, decode, a.reps), "huge_mib": None if huge is None else round(huge / 2**20)}


def worker_llama(a):
    """llama.cpp's logits of the prompt's every position (quality only: its speed is llama-bench's, llama_bench.py),
    through llama-cpp-python, an optional dependency (the bench extra)."""
    from llama_cpp import Llama
    llm = Llama(model_path=a.path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=a.threads,
                n_threads_batch=a.threads, logits_all=True, verbose=False, seed=0)
    llm.reset()
    llm.eval(prompt_ids())
    np.save(a.logits, np.array(llm.scores[:PROMPT_LEN], np.float32))
    return {}


def worker_hf(a):
    import torch
    from transformers import MixtralForCausalLM
    torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.precision]
    model = MixtralForCausalLM.from_pretrained(a.path, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids()])

    @torch.inference_mode()
    def prefill():
        t = time.perf_counter()
        model(ids, use_cache=True)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode():
        out = model(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t
    return _timed_runs(prefill, decode, a.reps)


def worker_membw(a):
    import numba
    from numba import njit, prange
    numba.set_num_threads(a.threads)

    @njit(parallel=True, fastmath=True)
    def read(x):
        acc = 0.0
        for i in prange(x.size):
            acc += x[i]
        return acc
    @njit(parallel=True)
    def read_int(x):
        acc = 0
        for i in prange(x.size):
            acc += x[i]
        return acc

    @njit(parallel=True)
    def read4(x):           # blocks of 4 MiB, each read as 4 streams 1 MiB apart, step by step
        blk = (4 << 20) // 8
        q = blk // 4
        acc = 0
        for b in prange(x.size // blk):
            y = x[b * blk:(b + 1) * blk]
            for i in range(q):
                acc += (y[i] + y[q + i]) + (y[2 * q + i] + y[3 * q + i])
        return acc

    def rate(fn, x):
        fn(x)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn(x)
            ts.append(time.perf_counter() - t)
        return x.nbytes / statistics.median(ts) / 1e9, [x.nbytes / t / 1e9 for t in ts]
    arr = np.full((1 << 30) // 8, 1.0)
    GBps, samples = rate(read, arr)
    out = dict(GBps=GBps, samples=samples)
    out["read4_GBps"], out["read4_samples"] = rate(read4, arr.view(np.int64))
    if a.path != "-":       # the same read over a populated MAP_SHARED mapping of a model file: what decode
        import mmap  # streams (the page cache's folios: 2 MiB ones are PMD-mapped, file_huge_mib)
        with open(a.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
        buf = np.frombuffer(mm, np.int64, count=os.path.getsize(a.path) // 8)
        from colibri_server.model.hugepages import pmd_mapped
        huge = pmd_mapped(a.path)
        out["file_huge_mib"] = None if huge is None else round(huge / 2**20)
        out["file_GBps"], out["file_samples"] = rate(read_int, buf)
        out["file4_GBps"], out["file4_samples"] = rate(read4, buf[:buf.size // (1 << 19) * (1 << 19)])
        del buf
    return out


def _merge(acc, r):
    """One system's results over rounds: every timed sample kept, tok/s = median of all of them;
    an error in any round is the result."""
    if acc is None or "error" in r:
        return dict(r)
    if "error" in acc:
        return acc
    out = dict(acc, prefill_s=acc["prefill_s"] + r["prefill_s"], decode_s=acc["decode_s"] + r["decode_s"],
               wall_s=round(acc.get("wall_s", 0) + r.get("wall_s", 0), 1))
    out["prefill_tok_s"] = PROMPT_LEN / statistics.median(out["prefill_s"])
    out["decode_tok_s"] = NEW_TOKENS / statistics.median(out["decode_s"])
    return out


def run_worker(kind, path, threads, reps, precision="", logits=None, timeout=1800):
    cmd = [sys.executable, __file__, "--worker", kind, "--path", str(path), "--nthreads", str(threads),
           "--reps", str(reps), "--precision", precision]
    if logits:
        cmd += ["--logits", str(logits)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS=str(threads),
               NUMBA_NUM_THREADS=str(max(2, threads)))
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return dict(error=(p.stderr or p.stdout)[-1500:], wall_s=round(time.time() - t0, 1))
    return {**json.loads(lines[-1][7:]), "wall_s": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------- quality

def quality(ref, test):
    def logsoftmax(z):
        z = z.astype(np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lr, lt = logsoftmax(ref), logsoftmax(test)
    kl = (np.exp(lr) * (lr - lt)).sum(-1)                                     # (T,)
    return dict(kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                max_rel_err=float(np.abs(test - ref).max() / np.abs(ref).max()),
                argmax_agree=float((test.argmax(-1) == ref.argmax(-1)).mean()))


# ---------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.environ.get("COLIBRI_BENCH_DATA", os.path.expanduser("~/.cache/colibri-speed")))
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--precisions", nargs="*", default=["f16", "q8", "q4", "bf16"])
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems of each (precision, threads) group round-robin this many times, "
                         "each --reps samples; the figure is the median of all samples")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (the bf16 prefill anchor)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama-bench --repack 0 (the AMX Xeon VM: llama.cpp's CPU extra buffers fail there)")
    ap.add_argument("--families", nargs="*", default=["deepseek", "gpt-oss"], choices=["deepseek", "gpt-oss"],
                    help="after bench-mixtral, these bench models of bench/families.py at f16 (none: --families)")
    ap.add_argument("--json", default=None, help="results file (default DATA/decode-<time>.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--nthreads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="", help=argparse.SUPPRESS)
    ap.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.threads = a.nthreads
        fn = {"colibri": worker_colibri, "colibri-pbf16": lambda a: worker_colibri(a, prefill_bf16=True),
              "llama": worker_llama, "hf": worker_hf, "membw": worker_membw}[a.worker]
        print("RESULT " + json.dumps(fn(a)), flush=True)
        return

    data = pathlib.Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    hf_dir = build_hf(data)
    col = build_colibri(data, hf_dir, a.precisions)
    want_ll = sorted({n for p in a.precisions for n in LLAMA[p]}) if not a.no_llama else []
    ll = build_gguf(data, hf_dir, want_ll) if want_ll else {}
    res = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
               reps=a.reps, rounds=a.rounds, cpu=_cpu(), rows=[], membw=[], round_bw=[], quality={})

    def membw():
        for th in a.threads:
            r = run_worker("membw", col.get("f16", "-"), th, 5)
            res["membw"].append({"threads": th, **r})
            print(f"bandwidth {th}T: " + ", ".join(f"{k} {r[k]:.1f}" for k in READS if k in r) + " GB/s", flush=True)
    membw()
    for p in a.precisions:
        for th in a.threads:
            jobs = [("colibri", p, col[p])] + [("llama.cpp", n, ll[n]) for n in (LLAMA[p] if ll else [])]
            if p == "bf16":           # the opt-in bf16-activation prefill (transformers' arithmetic)
                jobs.insert(1, ("colibri", "bf16 prefill_bf16", col[p]))
            if p == "bf16" and not a.no_hf:
                jobs.append(("transformers", "bf16", hf_dir))
            merged = {}

            def limit_now():                     # the bandwidth limit at this moment: the fastest read
                bw = run_worker("membw", col.get("f16", "-"), th, 5)
                return max(bw.get(k, 0.0) for k in READS)
            edge = limit_now()
            for rnd in range(a.rounds):          # round-robin: drift during the group hits every system alike
                res["round_bw"].append(dict(group=p, threads=th, round=rnd, limit=edge))   # just before the round
                for system, prec, path in jobs:
                    kind = {"colibri": "colibri", "llama.cpp": "llama", "transformers": "hf"}[system]
                    kind = "colibri-pbf16" if prec.endswith("prefill_bf16") else kind
                    if kind == "llama":              # llama.cpp's own binary, never the binding (llama_bench.py)
                        try:
                            t0 = time.time()
                            r = llama_bench.run(path, th, a.reps, PROMPT_LEN, NEW_TOKENS, a.llama_no_repack)
                            r["wall_s"] = round(time.time() - t0, 1)
                        except RuntimeError as e:
                            r = dict(error=str(e)[-1500:])
                    else:
                        r = run_worker(kind, path, th, a.reps, precision=p)
                    if a.rounds > 1:
                        print(f"  round {rnd + 1}: {system} {prec} {th}T prefill {r.get('prefill_tok_s', float('nan')):.1f} "
                              f"decode {r.get('decode_tok_s', float('nan')):.1f}", flush=True)
                    merged[(system, prec)] = _merge(merged.get((system, prec)), r)
                edge = limit_now()               # after this round: the next one's "before"
                res["round_bw"][-1]["limit_after"] = edge
            for system, prec, path in jobs:
                r = merged[(system, prec)]
                mb = (colibri_bytes_per_token(path) if system == "colibri" else
                      gguf_bytes_per_token(path) if system == "llama.cpp" else
                      colibri_bytes_per_token(col["bf16"]) if "bf16" in col else float("nan"))
                row = dict(system=system, precision=prec, group=p, threads=th, bytes_per_token=mb, **r)
                res["rows"].append(row)
                print(f"{system:12s} {prec:17s} {th}T  prefill {r.get('prefill_tok_s', float('nan')):7.1f}  "
                      f"decode {r.get('decode_tok_s', float('nan')):7.1f} tok/s  ({r.get('wall_s')}s)"
                      + (f"  ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)
    membw()
    if not a.no_quality:
        ref_path = data / "logits-colibri-f32.npy"
        run_worker("colibri", col["f32"], 1, 1, logits=ref_path)
        ref = np.load(ref_path)
        for p in a.precisions:
            for system, name, path in [("colibri", p, col[p])] + [("llama.cpp", n, ll[n]) for n in LLAMA[p] if ll]:
                out = data / f"logits-{system}-{name}.npy"
                r = run_worker("colibri" if system == "colibri" else "llama", path, 1, 1, logits=out)
                if "error" in r:
                    res["quality"][f"{system} {name}"] = r
                    continue
                res["quality"][f"{system} {name}" + (" prefill" if system == "colibri" else "")] = \
                    quality(ref, np.load(out))
                if system == "colibri":
                    res["quality"][f"colibri {name} decode"] = quality(ref, np.load(str(out).replace(".npy", "-decode.npy")))
        if ll:
            out = data / "logits-llama.cpp-F32.npy"
            if "error" not in run_worker("llama", ll["F32"], 1, 1, logits=out):
                res["quality"]["llama.cpp F32"] = quality(ref, np.load(out))
    if a.families:                       # DeepSeek-style and GPT-OSS-style bench models, the same protocol (families.py)
        import families
        try:
            res["families"] = families.measure(data, a.families, a.threads, a.reps, a.llama_no_repack)
        except RuntimeError as e:
            res["families"] = [dict(error=str(e)[-1500:])]
    table = make_table(res)
    print(table)
    res["table"] = table
    out = pathlib.Path(a.json or data / f"decode-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            txt = f.read()
        first = {}
        for ln in txt.splitlines():         # the first CPU's fields
            k, _, v = ln.partition(":")
            first.setdefault(k.strip(), v.strip())
        flags = first.get("flags", "").split()
        # a VM often names its CPU only "AMD EPYC": vendor, family and model tell a Zen 3 (25, 1) from a Zen 4 (25, 17)
        out = dict(model=first["model name"], vendor=first.get("vendor_id", ""), family=first.get("cpu family", ""),
                   model_number=first.get("model", ""), simd=[f for f in flags if f.startswith(("avx", "fma", "f16c"))],
                   cores=os.cpu_count())
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                out["thp"] = f.read().strip()
        except OSError:
            pass
        return out
    except (OSError, KeyError):
        return {}


# the reads of worker_membw: the 1 GiB array and the mapped f16 file, each as one stream and as 4 streams
# (blocks of 4 MiB, streams 1 MiB apart); the bandwidth limit is the fastest of them
READS = {"GBps": "array, 1 stream", "read4_GBps": "array, 4 streams", "file_GBps": "file, 1 stream",
         "file4_GBps": "file, 4 streams"}


def bandwidths(res):
    """threads -> (limit, one-stream array read): medians over the run's measurements (start and end);
    the limit is the fastest read pattern of each measurement."""
    lim, one = {}, {}
    for m in res["membw"]:
        lim.setdefault(m["threads"], []).append(max(m.get(k, 0.0) for k in READS))
        one.setdefault(m["threads"], []).append(m.get("GBps", float("nan")))
    return ({t: statistics.median(v) for t, v in lim.items()}, {t: statistics.median(v) for t, v in one.items()})


def per_round(res, r):
    """The median over rounds of decode / roofline, each round against the bandwidth measured beside it
    (res["round_bw"]: the mean of the limits just before and just after the round, or the one before in
    runs recorded before the after-reads): on a drifting machine a round's runs and its bandwidth share
    their moment."""
    lim = {b["round"]: (b["limit"] + b["limit_after"]) / 2 if b.get("limit_after", 0) > 0 else b["limit"]
           for b in res.get("round_bw", [])
           if b["group"] == r["group"] and b["threads"] == r["threads"] and b["limit"] > 0}
    reps = res.get("reps", 1)
    ds = r.get("decode_s", [])
    if not lim or len(ds) != reps * len(lim):
        return ""
    pct = [100 * NEW_TOKENS / statistics.median(ds[k * reps:(k + 1) * reps]) / (lim[k] * 1e9 / r["bytes_per_token"])
           for k in sorted(lim)]
    return f"{statistics.median(pct):.0f}% ({min(pct):.0f}-{max(pct):.0f})"


def make_table(res):
    bw, bw1 = bandwidths(res)
    per = {k: {} for k in READS}
    for m in res["membw"]:
        for k in READS:
            if k in m:
                per[k].setdefault(m["threads"], []).append(m[k])
    lines = ["bandwidth (numba reads, median of start and end of run): "
             + "; ".join(f"{name} " + ", ".join(f"{t}T {statistics.median(v):.1f}" for t, v in sorted(per[k].items()))
                         for k, name in READS.items() if per[k]) + " GB/s; the limit: the fastest, "
             + ", ".join(f"{t}T {v:.1f} GB/s" for t, v in sorted(bw.items())), "",
             "| system | precision | threads | prefill tok/s | decode tok/s | MB/token | roofline tok/s | % roofline "
             "| % roofline, per round | % of 1-stream read | decode vs llama.cpp | prefill vs best anchor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = res["rows"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['precision']} | {r['threads']} | error | | | | | | | | |")
            continue
        roof = bw.get(r["threads"], float("nan")) * 1e9 / r["bytes_per_token"]
        roof1 = bw1.get(r["threads"], float("nan")) * 1e9 / r["bytes_per_token"]
        vs_d = vs_p = ""
        if r["system"] == "colibri":
            peers = [x for x in rows if x["group"] == r["group"] and x["threads"] == r["threads"]
                     and x["system"] != "colibri" and "error" not in x]
            lc = [x for x in peers if x["system"] == "llama.cpp"]
            if lc:
                vs_d = f"{r['decode_tok_s'] / lc[0]['decode_tok_s']:.2f}x {lc[0]['precision']}"
            if peers:
                best = max(peers, key=lambda x: x["prefill_tok_s"])
                vs_p = f"{r['prefill_tok_s'] / best['prefill_tok_s']:.2f}x {best['system']} {best['precision']}"
        lines.append(f"| {r['system']} | {r['precision']} | {r['threads']} | {r['prefill_tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {r['bytes_per_token'] / 1e6:.1f} | {roof:.0f} | "
                     f"{100 * r['decode_tok_s'] / roof:.0f}% | {per_round(res, r)} | {100 * r['decode_tok_s'] / roof1:.0f}% | "
                     f"{vs_d} | {vs_p} |")
    if res["quality"]:
        lines += ["", "quality vs colibri f32 (128 positions): | model | KL mean | KL max | max rel logit err | argmax agree |",
                  "|---|---|---|---|---|"]
        for k, q in res["quality"].items():
            if "error" in q:
                lines.append(f"| {k} | error | | | |")
            else:
                lines.append(f"| {k} | {q['kl_mean']:.2e} | {q['kl_max']:.2e} | {q['max_rel_err']:.4f} | "
                             f"{100 * q['argmax_agree']:.0f}% |")
    if res.get("families"):
        lines += ["", "families (f16; tok/s colibri / llama.cpp): | model | threads | decode | prefill |", "|---|---|---|---|"]
        for r in res["families"]:
            if "error" in r:
                lines.append(f"| error: {r['error'][-200:]} | | | |")
                continue
            c, ll = r["colibri"], r["llama.cpp"]
            lines.append(f"| {r['model']} | {r['threads']} | {c['decode_tok_s']:.1f} / {ll['decode_tok_s']:.1f} "
                         f"({c['decode_tok_s'] / ll['decode_tok_s']:.2f}x) | {c['prefill_tok_s']:.0f} / "
                         f"{ll['prefill_tok_s']:.0f} ({c['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
