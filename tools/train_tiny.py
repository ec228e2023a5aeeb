#!/usr/bin/env python3
"""Train the tiny model bundled with the package (colibri_server/data/tiny-stdlib.colibri).

A few-million-parameter Mixtral (a real MoE: 8 experts, top-2) trained on the CPU, in
about 25 minutes on one thread, on the Python standard library's own sources, so that a
new user's first `colibri run "def "` prints recognisable Python. Steps:

  1. corpus: every stdlib .py file (sorted, deterministic; test/, tests/, idlelib/,
     site-packages skipped, and so are the 72 generated charmap codec tables in encodings/,
     10% of the text, which otherwise pull samples into hex tables); every 50th file is
     held out as validation text;
  2. tokenizer: byte-level BPE (`tokenizers`), <unk>=0 <s>=1 </s>=2, trained on the
     training files only; files are joined with </s> in the token stream. Pre-tokens keep
     ONE trailing space on the word ("def ", "return ", ", "), not a leading one as GPT-2
     does: a prompt typed as "def " then tokenizes exactly as in the training text, where
     the GPT-2 split ("def" + " name") leaves a lone " " the model has never seen there;
  3. model: transformers.MixtralConfig, random init, plain PyTorch loop (AdamW, warmup then
     cosine decay over the time budget, random 256-token windows, router load-balancing loss).
     The budget (--minutes) is CPU time of the training thread, so that a busy machine
     changes how long the run takes, not what it produces (--max-wall-minutes caps it);
  4. output: save_pretrained (f32) + tokenizer files + train_report.json in --out-dir,
     then the project's converter writes the f16 .colibri file to --output, and the file is
     checked by loading it with colibri_server and comparing its greedy text with torch's.

Nothing downloads; nothing big is written to the repo except the --output file.

    OMP_NUM_THREADS=1 .venv/bin/python tools/train_tiny.py --minutes 25 --out-dir /tmp/tiny-hf
"""
from __future__ import annotations

import os

# one thread everywhere (the machine is shared): set before torch / tokenizers load
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import math
import shlex
import sys
import sysconfig
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO, "colibri_server", "data", "tiny-stdlib.colibri")
MODEL_NAME = "colibri-tiny-stdlib"
LICENSE = "PSF-2.0 (training text: CPython standard library)"
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
SPECIALS = ["<unk>", "<s>", "</s>"]          # ids 0, 1, 2
# word / punctuation run + at most one trailing space | newlines | other blank runs
PRETOKEN_REGEX = r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|(?:\r?\n)+|[ \t]+|\s"
EOS_ID = 2
PROMPTS = ["def ", "import ", "class ", "    return "]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


def log(msg=""):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- corpus

def stdlib_files(root):
    """Sorted relative paths of the stdlib's .py files, minus tests, idlelib, site-packages."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def is_generated_table(text):
    """encodings/cp1252.py and friends: 256-entry charmap tables (gencodec.py and the like)."""
    return "Python Character Mapping Codec" in text[:300]


def load_corpus(root, val_every):
    train, val, skipped = [], [], []
    files = []
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if is_generated_table(text):
            skipped.append(rel)
            continue
        files.append((rel, text))
    for i, (rel, text) in enumerate(files):
        (val if i % val_every == 0 else train).append((rel, text))
    return train, val, skipped


# ---------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKEN_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_files(tok, texts):
    """One token stream: file, </s>, file, </s>, ... (uint16: the vocab is < 65536)."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([EOS_ID], dtype=np.uint16))
    return np.concatenate(parts)


def save_tokenizer(tok, out_dir, ctx):
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
           "model_max_length": ctx, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f, indent=2)


# ---------------------------------------------------------------------------- model

def make_model(a, vocab_size):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(
        vocab_size=vocab_size, hidden_size=a.hidden, intermediate_size=a.expert_dim,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads, max_position_embeddings=a.ctx, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None,
        num_local_experts=a.experts, num_experts_per_tok=a.top_k, router_aux_loss_coef=a.aux_coef,
        output_router_logits=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS_ID,
        pad_token_id=None, initializer_range=0.02, attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    model = MixtralForCausalLM(cfg)
    model.generation_config.pad_token_id = EOS_ID
    return model


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def forward_loss(model, batch, autocast, with_aux=True):
    """(cross-entropy in nats/token, aux loss or None) for a (B, T+1) batch of token windows."""
    import torch
    import torch.nn.functional as F
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=x, output_router_logits=with_aux, use_cache=False)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return ce, (out.aux_loss if with_aux else None)


def evaluate(model, windows, autocast, bs=16):
    import torch
    model.eval()
    tot = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), bs):
            b = windows[i:i + bs]
            ce, _ = forward_loss(model, b, autocast, with_aux=False)
            tot += ce.item() * len(b)
    model.train()
    return tot / len(windows)


def lr_at(step, progress, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(1.0, progress)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def generate_samples(model, tok, n_tokens, seed):
    import torch
    model.eval()
    out = []
    for mode in ("greedy", "sampled"):
        for i, p in enumerate(PROMPTS):
            ids = torch.tensor([tok.encode(p, add_special_tokens=False).ids])
            kw = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=0.8, top_k=40)
            torch.manual_seed(seed + i)
            with torch.no_grad():
                g = model.generate(ids, max_new_tokens=n_tokens, eos_token_id=EOS_ID, pad_token_id=EOS_ID, **kw)
            new = g[0, ids.shape[1]:].tolist()
            out.append({"mode": mode, "prompt": p, "text": p + tok.decode(new, skip_special_tokens=True),
                        "ids": new})
    model.train()
    return out


# ---------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--minutes", type=float, default=25.0,
                    help="training budget: CPU minutes of the training thread (evals included)")
    ap.add_argument("--max-wall-minutes", type=float, default=None,
                    help="stop (and finish the schedule) after this much wall time too (default 2 x --minutes)")
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--out-dir", default=None, help="HF model + tokenizer + report (default: a new temp dir)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT, help="the converted f16 .colibri file")
    ap.add_argument("--no-convert", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=50, help="hold out every Nth file")
    ap.add_argument("--vocab", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-dim", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    ap.add_argument("--eval-every", type=float, default=3.0, help="CPU minutes between held-out evaluations")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--precision", choices=["auto", "f32", "bf16"], default="auto",
                    help="auto: time a few steps of each and keep the faster")
    ap.add_argument("--sample-tokens", type=int, default=80)
    a = ap.parse_args(argv)
    cmdline = " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv)

    import torch
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    out_dir = a.out_dir or tempfile.mkdtemp(prefix="colibri-tiny-")
    os.makedirs(out_dir, exist_ok=True)
    log(f"out dir: {out_dir}")

    # corpus + tokenizer
    t0 = time.time()
    root = sysconfig.get_paths()["stdlib"]
    train, val, skipped = load_corpus(root, a.val_every)
    train_chars = sum(len(t) for _, t in train)
    val_chars = sum(len(t) for _, t in val)
    log(f"corpus: {root}: {len(train)} train files ({train_chars / 1e6:.2f} M chars), {len(val)} held-out files "
        f"({val_chars / 1e6:.2f} M chars), {len(skipped)} skipped (generated codec tables or not UTF-8)")
    tok = train_tokenizer([t for _, t in train], a.vocab)
    V = tok.get_vocab_size()
    for _, t in val[:5]:
        assert tok.decode(tok.encode(t, add_special_tokens=False).ids, skip_special_tokens=False) == t
    train_ids = torch.from_numpy(encode_files(tok, [t for _, t in train]).astype(np.int64))
    val_ids = torch.from_numpy(encode_files(tok, [t for _, t in val]).astype(np.int64))
    log(f"tokenizer: vocab {V}; {len(train_ids) / 1e6:.2f} M train tokens ({train_chars / len(train_ids):.2f} "
        f"chars/token), {len(val_ids) / 1e3:.1f} k held-out tokens; {time.time() - t0:.1f}s")

    # model
    model = make_model(a, V)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - n_expert + n_expert * a.top_k // a.experts
    print(f"parameters: {n_params:,} total ({n_expert:,} in experts; {active:,} active per token); "
          f"f16 ~{n_params * 2 / 2**20:.2f} MiB", flush=True)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=False)

    T = a.ctx
    gen = torch.Generator().manual_seed(a.seed)
    n_val = min(a.eval_windows, (len(val_ids) - 1) // (T + 1))
    starts = np.linspace(0, len(val_ids) - (T + 1), n_val).astype(np.int64)
    val_windows = torch.stack([val_ids[s:s + T + 1] for s in starts])

    def batch():
        s = torch.randint(0, len(train_ids) - (T + 1), (a.batch,), generator=gen)
        return torch.stack([train_ids[i:i + T + 1] for i in s.tolist()])

    def step(autocast, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        ce, aux = forward_loss(model, batch(), autocast)
        loss = ce + a.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return ce.item(), aux.item()

    # precision: the warmup steps double as the f32 / bf16 timing (tiny lr, so nothing is lost);
    # timed in CPU seconds, which the other processes on the machine do not disturb much
    timing = {}
    step_no = 0
    tokens = 0
    if a.precision == "auto":
        for name, ac in (("f32", False), ("bf16", True), ("f32", False), ("bf16", True)):
            ts = time.process_time()
            for _ in range(3):
                step(ac, lr_at(step_no, 0.0, a))
                step_no += 1
                tokens += a.batch * T
            timing.setdefault(name, []).append((time.process_time() - ts) / 3)
        timing = {k: min(v) for k, v in timing.items()}
        autocast = timing["bf16"] < timing["f32"]
        log(f"step time ({a.batch} x {T} tokens, CPU s): " + ", ".join(f"{k} {v:.3f}s" for k, v in timing.items())
            + f" -> {'bf16 autocast' if autocast else 'f32'}")
    else:
        autocast = a.precision == "bf16"
    precision = "bf16-autocast" if autocast else "f32"

    budget = a.minutes * 60
    wall_budget = (a.max_wall_minutes or 2 * a.minutes) * 60
    t_start, c_start = time.time(), time.process_time()
    history = []
    ema = None
    next_eval = 0.0
    eval_s = 0.0
    bar = tqdm(total=a.max_steps, initial=step_no, desc="train", file=sys.stderr, dynamic_ncols=True,
               mininterval=2.0)
    while True:
        el = time.process_time() - c_start
        if el >= next_eval:
            te = time.process_time()
            vl = evaluate(model, val_windows, autocast)
            eval_s += time.process_time() - te
            history.append({"step": step_no, "cpu_minutes": round(el / 60, 2),
                            "wall_minutes": round((time.time() - t_start) / 60, 2), "tokens": tokens,
                            "train_loss_ema": None if ema is None else round(ema, 4), "heldout_loss": round(vl, 4)})
            bar.write(f"step {step_no}: {el / 60:.1f} CPU min ({(time.time() - t_start) / 60:.1f} wall), "
                      f"{tokens / 1e6:.2f} M tokens, train {float('nan') if ema is None else ema:.3f}, "
                      f"held-out {vl:.3f} nats/token")
            next_eval = el + a.eval_every * 60
        progress = max(step_no / a.max_steps, (time.process_time() - c_start) / budget,
                       (time.time() - t_start) / wall_budget)
        if progress >= 1.0:
            break
        lr = lr_at(step_no, progress, a)
        ce, aux = step(autocast, lr)
        step_no += 1
        tokens += a.batch * T
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", aux=f"{aux:.2f}", lr=f"{lr:.1e}",
                        tok_s=f"{tokens / max(1e-9, time.process_time() - c_start):.0f}", refresh=False)
    bar.close()
    minutes = (time.process_time() - c_start) / 60
    wall_minutes = (time.time() - t_start) / 60
    final = evaluate(model, val_windows, autocast)
    final_f32 = evaluate(model, val_windows, False) if autocast else final
    history.append({"step": step_no, "cpu_minutes": round(minutes, 2), "wall_minutes": round(wall_minutes, 2),
                    "tokens": tokens,
                    "train_loss_ema": round(ema, 4), "heldout_loss": round(final_f32, 4)})
    print(f"done: {step_no} steps, {tokens / 1e6:.2f} M tokens ({tokens / len(train_ids):.2f} epochs), "
          f"{minutes:.1f} CPU min ({eval_s / 60:.1f} evaluating), {wall_minutes:.1f} wall min, {precision}", flush=True)
    print(f"final train loss (EMA) {ema:.3f}; held-out loss {final_f32:.4f} nats/token "
          f"(~{final_f32 / math.log(2) * len(val_ids) / val_chars:.3f} bits/char) over "
          f"{n_val} x {T} held-out tokens", flush=True)

    samples = generate_samples(model, tok, a.sample_tokens, a.seed)
    for s in samples:
        print(f"\n--- {s['mode']} {s['prompt']!r} ---\n{s['text']}", flush=True)

    # save
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tok, out_dir, a.ctx)
    report = {
        "name": MODEL_NAME, "command": cmdline, "parameters": n_params, "expert_parameters": n_expert,
        "active_parameters_per_token": active, "vocab_size": V, "steps": step_no, "cpu_minutes": round(minutes, 2),
        "wall_minutes": round(wall_minutes, 2),
        "tokens_seen": tokens, "epochs": round(tokens / len(train_ids), 3), "train_tokens": len(train_ids),
        "heldout_tokens": len(val_ids), "heldout_eval_tokens": n_val * T,
        "train_files": len(train), "heldout_files": [r for r, _ in val], "skipped_files": skipped,
        "chars_per_token": round(train_chars / len(train_ids), 3),
        "train_loss_ema": round(ema, 4), "heldout_loss": round(final_f32, 4),
        "heldout_bits_per_char": round(final_f32 / math.log(2) * len(val_ids) / val_chars, 4),
        "precision": precision, "step_time_s": {k: round(v, 4) for k, v in timing.items()},
        "threads": a.threads, "torch": torch.__version__, "python_stdlib": root,
        "hyperparameters": {k: v for k, v in vars(a).items() if k not in ("out_dir", "output")},
        "history": history, "samples": [{k: v for k, v in s.items() if k != "ids"} for s in samples],
    }
    rpath = os.path.join(out_dir, "train_report.json")
    with open(rpath, "w") as f:
        json.dump(report, f, indent=1)
    log(f"saved HF model + tokenizer + report to {out_dir}")

    if a.no_convert:
        return 0
    sys.path.insert(0, REPO)
    from colibri_server.model.convert import convert
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    convert(out_dir, a.output, "f16", name=MODEL_NAME, license=LICENSE)
    size = os.path.getsize(a.output)
    print(f"\nwrote {a.output}: {size / 2**20:.2f} MiB ({size:,} bytes)", flush=True)

    # check: the .colibri's greedy continuation vs torch's (f16 weights may diverge after a while)
    from colibri_server.model import Model
    m = Model.open(a.output)
    checks = []
    for s in samples:
        if s["mode"] != "greedy":
            continue
        got = m.generate(s["prompt"], max_tokens=len(s["ids"]) or 1, temperature=0.0)
        agree = next((i for i, (x, y) in enumerate(zip(got, s["ids"])) if x != y), min(len(got), len(s["ids"])))
        checks.append({"prompt": s["prompt"], "agreeing_prefix_tokens": agree, "of": len(s["ids"]),
                       "colibri_text": s["prompt"] + m.tokenizer.decode(got)})
        print(f"colibri check {s['prompt']!r}: first {agree}/{len(s['ids'])} greedy tokens equal torch's", flush=True)
    m.close()
    report.update(colibri_file=os.path.abspath(a.output), colibri_bytes=size, colibri_check=checks)
    with open(rpath, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
